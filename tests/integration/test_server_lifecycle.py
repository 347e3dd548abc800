"""The server as a process: clean stop on SIGTERM/SIGINT, restart with its data,
clear failures for a busy port, a locked or unusable data dir, and ETCD_* config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import REPO_ROOT, ServerProcess, free_port, run_cli, wait_ready

pytestmark = pytest.mark.integration


def put_and_get(endpoint: str, key: bytes, value: bytes | None) -> rpc_pb2.RangeResponse:
    with grpc.insecure_channel(endpoint) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        if value is not None:
            kv.Put(rpc_pb2.PutRequest(key=key, value=value), timeout=10)
        return kv.Range(rpc_pb2.RangeRequest(key=key), timeout=10)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_data_survives(tmp_path: Path, sig: signal.Signals) -> None:
    srv = ServerProcess(tmp_path / "s.etcd").start()
    put_and_get(srv.endpoint, b"k", b"v1")
    assert srv.proc is not None
    srv.proc.send_signal(sig)
    assert srv.proc.wait(timeout=15) == 0
    assert "stopped" in srv.log_text()
    srv.start()
    try:
        resp = put_and_get(srv.endpoint, b"k", None)
        assert [(kv.key, kv.value, kv.mod_revision) for kv in resp.kvs] == [(b"k", b"v1", 2)]
        assert resp.header.raft_term == 3  # a new term per start
    finally:
        srv.stop()


def test_busy_port_fails_with_a_clear_message(tmp_path: Path, server: ServerProcess) -> None:
    url = f"http://{server.endpoint}"
    r = run_cli(["--data-dir", str(tmp_path / "b.etcd"), "--listen-client-urls", url])
    assert r.returncode == 1
    assert f"cannot listen on {server.endpoint}" in r.stderr


def test_data_dir_in_use_fails(server: ServerProcess) -> None:
    port = free_port()
    r = run_cli(
        ["--data-dir", str(server.data_dir), "--listen-client-urls", f"http://127.0.0.1:{port}"]
    )
    assert r.returncode == 1
    assert "is in use by another process" in r.stderr


def test_unusable_data_dir_fails(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    port = free_port()
    r = run_cli(
        ["--data-dir", str(blocker / "d"), "--listen-client-urls", f"http://127.0.0.1:{port}"]
    )
    assert r.returncode == 1
    assert "cannot use data dir" in r.stderr


def test_bad_flag_value_fails(tmp_path: Path) -> None:
    r = run_cli(["--data-dir", str(tmp_path / "x"), "--listen-client-urls", "nonsense"])
    assert r.returncode == 1 and "invalid URL" in r.stderr


def test_version_prints_ours_and_the_etcd_api_we_match() -> None:
    r = run_cli(["--version"])
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert lines[0].startswith("queue-server Version: ")
    assert lines[1] == "etcd API Version: 3.5.17"


def test_an_unknown_flag_gets_a_short_error_and_a_pointer_to_help() -> None:
    r = run_cli(["--no-such-flag"])
    assert r.returncode == 2
    assert r.stderr == (
        "queue-server: unrecognized arguments: --no-such-flag\n"
        "Run 'queue-server --help' for the flags.\n"
    )
    r = run_cli(["--heartbeat-interval", "soon"])
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "queue-server: argument --heartbeat-interval: invalid int value: 'soon'",
        "Run 'queue-server --help' for the flags.",
    ]


def test_etcd_environment_variables_configure_the_server(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "ETCD_NAME": "envnode",
        "ETCD_DATA_DIR": str(tmp_path / "env.etcd"),
        "ETCD_LISTEN_CLIENT_URLS": f"http://127.0.0.1:{port}",
        "ETCD_ADVERTISE_CLIENT_URLS": f"http://127.0.0.1:{port}",
        "ETCD_MAX_REQUEST_BYTES": "1000",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "queue_server.cli"],
        cwd=REPO_ROOT,
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"127.0.0.1:{port}"
        wait_ready(endpoint, proc)
        with grpc.insecure_channel(endpoint) as ch:
            members = rpc_pb2_grpc.ClusterStub(ch).MemberList(
                rpc_pb2.MemberListRequest(), timeout=10
            )
            assert [m.name for m in members.members] == ["envnode"]
            with pytest.raises(grpc.RpcError) as err:
                rpc_pb2_grpc.KVStub(ch).Put(
                    rpc_pb2.PutRequest(key=b"k", value=b"x" * 2000), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "etcdserver: request is too large"
        assert (tmp_path / "env.etcd" / "wal").is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
