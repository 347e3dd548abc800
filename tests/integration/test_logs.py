"""Structured logs: `--log-format json` writes one JSON object per line, and a
request slower than `--experimental-warning-apply-duration` is logged as etcd's
"apply request took too long" with the call's method and request id. What grpc's
C-core writes (the grpcio transport) comes out as our records too."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess, run_cli

pytestmark = pytest.mark.integration


def json_lines(srv: ServerProcess) -> list[dict[str, object]]:
    return [json.loads(line) for line in srv.log_text().splitlines() if line.startswith("{")]


def test_json_logs_and_slow_request_warnings(tmp_path: Path) -> None:
    # every request is "slow" against a zero threshold
    srv = ServerProcess(
        tmp_path / "j.etcd",
        extra_args=["--log-format", "json", "--experimental-warning-apply-duration", "0s"],
    ).start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            kv.Put(rpc_pb2.PutRequest(key=b"a", value=b"1"), timeout=5)
            kv.Range(rpc_pb2.RangeRequest(key=b"a"), timeout=5)
        deadline = time.monotonic() + 10
        while True:
            slow = [r for r in json_lines(srv) if r["msg"] == "apply request took too long"]
            methods = {r["method"] for r in slow}
            if {"/etcdserverpb.KV/Put", "/etcdserverpb.KV/Range"} <= methods:
                break
            assert time.monotonic() < deadline, f"no slow-request warnings: {methods}"
            time.sleep(0.05)  # poll the log file, bounded
    finally:
        assert srv.stop() == 0
    lines = [line for line in srv.log_text().splitlines() if line.strip()]
    records = json_lines(srv)
    assert len(records) == len(lines), "every line is a JSON object"
    assert {"level", "ts", "logger", "msg"} <= set(records[0])
    put = next(r for r in slow if r["method"] == "/etcdserverpb.KV/Put")
    assert put["level"] == "warning"
    assert str(put["took"]).endswith("ms") and put["expected-duration"] == "0ms"
    ids = [r["request_id"] for r in slow]
    assert all(ids) and len(set(ids)) == len(ids), "each call has its own request id"


def test_console_logs_stay_quiet_for_fast_requests(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "c.etcd").start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            rpc_pb2_grpc.KVStub(ch).Put(rpc_pb2.PutRequest(key=b"a", value=b"1"), timeout=5)
    finally:
        assert srv.stop() == 0
    text = srv.log_text()
    assert "level=INFO logger=queue_server.server ready to serve client requests" in text
    assert "took too long" not in text  # a put on an idle server takes far less than 100ms


def test_grpc_core_lines_are_records_in_our_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grpc's C-core (--grpc-transport grpcio) writes its own lines to stderr; with
    # its debug verbosity and a trace on it says a lot at start, per call and at stop
    monkeypatch.setenv("GRPC_VERBOSITY", "debug")
    monkeypatch.setenv("GRPC_TRACE", "http")
    srv = ServerProcess(
        tmp_path / "g.etcd", extra_args=["--grpc-transport", "grpcio", "--log-format", "json"]
    ).start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            kv.Put(rpc_pb2.PutRequest(key=b"a", value=b"1"), timeout=5)
            kv.Range(rpc_pb2.RangeRequest(key=b"a"), timeout=5)
            with pytest.raises(grpc.RpcError):
                kv.Range(rpc_pb2.RangeRequest(key=b""), timeout=5)  # an error answer
    finally:
        assert srv.stop() == 0
    lines = [line for line in srv.log_text().splitlines() if line.strip()]
    records = json_lines(srv)
    assert len(records) == len(lines), [line for line in lines if not line.startswith("{")][:3]
    core = [r for r in records if r["logger"] == "grpc"]
    assert len(core) > 10, "the C-core said little: is it still writing to stderr itself?"
    assert all(str(r["source"]).rsplit(":", 1)[1].isdigit() for r in core)  # file.cc:LINE
    # its warning that debug verbosity is not for production, at its own level
    assert any(r["level"] == "warning" and "DEBUG" in str(r["msg"]) for r in core)
    last = records[-1]["msg"]
    assert isinstance(last, str) and last.startswith("stopped name="), last


def test_a_grpc_core_error_is_a_record_too(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli(
            [
                "--data-dir",
                str(tmp_path / "b.etcd"),
                "--grpc-transport",
                "grpcio",
                "--log-format",
                "json",
                "--listen-client-urls",
                f"http://127.0.0.1:{port}",
            ]
        )
    assert r.returncode == 1
    *logged, last = r.stderr.splitlines()
    assert last == f"queue-server: cannot listen on 127.0.0.1:{port}: address in use or unavailable"
    records = [json.loads(line) for line in logged]  # every other line: one of our records
    bind = [rec for rec in records if rec["logger"] == "grpc"]
    assert [rec["level"] for rec in bind] == ["error"]
    assert "Address already in use" in bind[0]["msg"]
    assert bind[0]["source"].startswith("add_port.cc:")
