"""Structured logs: `--log-format json` writes one JSON object per line, and a
request slower than `--experimental-warning-apply-duration` is logged as etcd's
"apply request took too long" with the call's method and request id."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess

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
