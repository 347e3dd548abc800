"""The server as a process: clean stop on SIGTERM/SIGINT, restart with its data,
clear failures for a busy port, a locked or unusable data dir, and ETCD_* config;
a stop in well under a second with watches, keepalives and long polls open (on
both transports, and as a cluster member), and a second signal that exits at once."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import grpc
import hpack
import pytest

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from queue_server.transport import h2
from queue_server.transport.server import FLUSH_SECONDS
from tests.support.cluster import Cluster
from tests.support.h2_frames import frame, parse
from tests.support.processes import REPO_ROOT, ServerProcess, free_port, run_cli, wait_ready

pytestmark = pytest.mark.integration


def put_and_get(endpoint: str, key: bytes, value: bytes | None) -> rpc_pb2.RangeResponse:
    with grpc.insecure_channel(endpoint) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        if value is not None:
            kv.Put(rpc_pb2.PutRequest(key=key, value=value), timeout=10)
        response: rpc_pb2.RangeResponse = kv.Range(rpc_pb2.RangeRequest(key=key), timeout=10)
        return response


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


# -- a fast stop ------------------------------------------------------------------

STOP_BUDGET = 1.5
"""Seconds from SIGTERM to exit with watches, keepalives and long polls open. The
design aims well under a second (tens of milliseconds on an idle machine); the
slack is for a busy 2-core CI box."""
STOPPED = "etcdserver: server stopped"
"""etcd's ErrGRPCStopped, with UNAVAILABLE: what every call a stop ends is told."""
WAIT = 10.0
"""Seconds any one thing that should happen may take."""


def metric(endpoint: str, name: str, method: str) -> float:
    """A counter of the client port's /metrics for one gRPC method (0 if absent)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=WAIT) as page:
        text = page.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'grpc_method="{method}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class CallFuture(Protocol):
    """A unary call's future as grpc returns it. Its exception() takes a timeout,
    which grpc-stubs' grpc.Future leaves out."""

    def exception(self, timeout: float | None = None) -> BaseException | None: ...


class OpenCalls:
    """A watch, a LeaseKeepAlive stream and a CQS BatchDequeue long poll, held
    open on one server by threads, each recording how it ended."""

    def __init__(self, endpoint: str, metrics_endpoint: str) -> None:
        self.endpoint = endpoint
        self.metrics_endpoint = metrics_endpoint
        self.channel = grpc.insecure_channel(endpoint)
        self.ended: dict[str, tuple[grpc.StatusCode, str]] = {}
        self._release = threading.Event()
        self._watching = threading.Event()
        self._kept_alive = threading.Event()
        self._threads: list[threading.Thread] = []
        self._poll: CallFuture | None = None

    def _watch(self) -> None:
        def requests() -> Iterator[rpc_pb2.WatchRequest]:
            yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"w"))
            self._release.wait(60)  # the request stream stays open until the test ends

        self._follow("watch", rpc_pb2_grpc.WatchStub(self.channel).Watch, requests())

    def _keep_alive(self, lease_id: int) -> None:
        def requests() -> Iterator[rpc_pb2.LeaseKeepAliveRequest]:
            yield rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)
            self._release.wait(60)  # the request stream stays open until the test ends

        self._follow("keepalive", rpc_pb2_grpc.LeaseStub(self.channel).LeaseKeepAlive, requests())

    def _follow(self, name: str, method: Any, requests: Iterator[Any]) -> None:
        try:
            for response in method(requests, timeout=60):
                if name == "watch" and response.created:
                    self._watching.set()
                if name == "keepalive" and response.TTL > 0:
                    self._kept_alive.set()
            self.ended[name] = (grpc.StatusCode.OK, "")
        except grpc.RpcError as e:
            assert isinstance(e, grpc.Call)
            self.ended[name] = (e.code(), e.details())

    def open(self) -> OpenCalls:
        lease = rpc_pb2_grpc.LeaseStub(self.channel).LeaseGrant(
            rpc_pb2.LeaseGrantRequest(TTL=60), timeout=WAIT
        )
        cqs = cqs_pb2_grpc.DtoChangeQueueServiceStub(self.channel)
        cqs.CreateOrConfigureQueue(
            cqs_pb2.CreateOrConfigureQueueRequest(
                queue_name="stop-q", subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type="t")]
            ),
            timeout=WAIT,
        )
        for target, args in ((self._watch, ()), (self._keep_alive, (lease.ID,))):
            thread = threading.Thread(target=target, args=args, daemon=True)
            thread.start()
            self._threads.append(thread)
        self._poll = cqs.BatchDequeue.future(
            cqs_pb2.BatchDequeueRequest(
                queue_name="stop-q", max_notifications=1, wait_time_milliseconds=50_000
            ),
            timeout=60,
        )
        assert self._watching.wait(WAIT), "the watch was not created"
        assert self._kept_alive.wait(WAIT), "the keepalive stream did not answer"
        deadline = time.monotonic() + WAIT
        while metric(self.metrics_endpoint, "grpc_server_started_total", "BatchDequeue") < 1:
            assert time.monotonic() < deadline, "the long poll did not reach the server"
            time.sleep(0.02)  # poll the server's counter, bounded
        return self

    def endings(self) -> dict[str, tuple[grpc.StatusCode, str]]:
        """How each call ended (waits for them, bounded)."""
        for thread in self._threads:
            thread.join(WAIT)
        assert self._poll is not None
        error = self._poll.exception(timeout=WAIT)
        if error is None:
            self.ended["long poll"] = (grpc.StatusCode.OK, "")
        else:
            assert isinstance(error, grpc.Call)
            self.ended["long poll"] = (error.code(), error.details())
        return dict(self.ended)

    def close(self) -> None:
        self._release.set()
        self.channel.close()


def signal_and_time(proc: subprocess.Popen[bytes], sig: signal.Signals) -> tuple[int, float]:
    """Send `sig`; (exit status, seconds from the signal to the exit)."""
    began = time.monotonic()
    proc.send_signal(sig)
    status = proc.wait(timeout=30)
    return status, time.monotonic() - began


def assert_stopped_last(log_text: str) -> None:
    """One `stopped` line, and nothing logged after it."""
    lines = [line for line in log_text.splitlines() if line.strip()]
    assert sum("stopped name=" in line for line in lines) == 1, lines[-5:]
    assert "stopped name=" in lines[-1], f"logged after the stopped line: {lines[-3:]}"


@pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl is not installed")
@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_sigterm_with_streams_and_long_polls_open_stops_at_once(
    tmp_path: Path, transport: str
) -> None:
    metrics_port = free_port()
    srv = ServerProcess(
        tmp_path / "f.etcd",
        extra_args=[
            "--grpc-transport",
            transport,
            "--listen-metrics-urls",
            f"http://127.0.0.1:{metrics_port}",
        ],
    ).start()
    assert srv.proc is not None
    metrics = f"127.0.0.1:{metrics_port}"
    etcdctl = subprocess.Popen(  # a real etcd client's watch, which retries on UNAVAILABLE
        ["etcdctl", f"--endpoints={srv.endpoint}", "watch", "w"],
        env={**os.environ, "ETCDCTL_API": "3"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    calls = OpenCalls(srv.endpoint, metrics).open()
    try:
        deadline = time.monotonic() + WAIT
        while metric(metrics, "grpc_server_started_total", "Watch") < 2:
            assert time.monotonic() < deadline, "etcdctl's watch did not reach the server"
            time.sleep(0.02)  # poll the server's counter, bounded
        acked = put_and_get(srv.endpoint, b"acked", b"before the stop")
        status, took = signal_and_time(srv.proc, signal.SIGTERM)
        endings = calls.endings()
    finally:
        calls.close()
        etcdctl.kill()
        etcdctl.wait(timeout=WAIT)
    assert status == 0
    assert took < STOP_BUDGET, f"the stop took {took:.2f}s"
    unavailable = (grpc.StatusCode.UNAVAILABLE, STOPPED)
    assert endings == {"watch": unavailable, "keepalive": unavailable, "long poll": unavailable}
    assert_stopped_last(srv.log_text())
    srv.start()  # what was acknowledged before the stop is on disk
    try:
        resp = put_and_get(srv.endpoint, b"acked", None)
        assert [kv.value for kv in resp.kvs] == [b"before the stop"]
        assert resp.kvs[0].mod_revision == acked.kvs[0].mod_revision
    finally:
        srv.stop()


def test_a_cluster_member_with_streams_open_stops_at_once(cluster: Cluster) -> None:
    leader = cluster.wait_leader()
    member = next(m for m in cluster.members if m is not leader)
    assert member.proc is not None
    calls = OpenCalls(member.endpoint, member.endpoint).open()
    try:
        status, took = signal_and_time(member.proc, signal.SIGTERM)
        endings = calls.endings()
    finally:
        calls.close()
    assert status == 0
    assert took < STOP_BUDGET, f"the member's stop took {took:.2f}s"
    unavailable = (grpc.StatusCode.UNAVAILABLE, STOPPED)
    assert endings == {"watch": unavailable, "keepalive": unavailable, "long poll": unavailable}
    assert_stopped_last(member.log_text())
    put_and_get(leader.endpoint, b"after", b"the others go on")  # two of three: a quorum


def open_unread_watch(sock: socket.socket) -> None:
    """A watch over raw HTTP/2 whose client grants no flow-control window: once
    its response HEADERS are in, the watch's answers wait unsent, and a stop
    waits for them (a client that does not read) until it cuts the connection."""
    headers = hpack.Encoder().encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/etcdserverpb.Watch/Watch"),
            (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
    )
    body = rpc_pb2.WatchRequest(
        create_request=rpc_pb2.WatchCreateRequest(key=b"w")
    ).SerializeToString()
    no_window = struct.pack(">HI", h2.SETTINGS_INITIAL_WINDOW_SIZE, 0)
    sock.sendall(
        h2.PREFACE
        + frame(h2.SETTINGS, 0, 0, no_window)
        + frame(h2.HEADERS, h2.FLAG_END_HEADERS, 1, headers)
        + frame(h2.DATA, 0, 1, b"\0" + len(body).to_bytes(4, "big") + body)
    )
    received = b""
    acked = False
    while True:
        chunk = sock.recv(65536)  # the socket's timeout bounds the wait
        assert chunk, "the server closed the connection"
        received += chunk
        frames = parse(received)
        if not acked and any(f.type == h2.SETTINGS and not f.flags for f in frames):
            sock.sendall(frame(h2.SETTINGS, h2.FLAG_ACK, 0))
            acked = True
        if any(f.type == h2.HEADERS and f.stream_id == 1 for f in frames):
            return


def wait_for_line(srv: ServerProcess, text: str) -> None:
    deadline = time.monotonic() + WAIT
    while text not in srv.log_text():
        assert time.monotonic() < deadline, f"{text!r} was not logged"
        time.sleep(0.01)  # poll the log file, bounded


def test_a_client_that_does_not_read_holds_a_stop_only_so_long(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "u.etcd").start()
    assert srv.proc is not None
    with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT) as sock:
        open_unread_watch(sock)
        status, took = signal_and_time(srv.proc, signal.SIGTERM)
    assert status == 0
    # no call runs: only the time to flush its last bytes (transport/server.py)
    assert took < FLUSH_SECONDS + STOP_BUDGET, f"{took:.2f}s"
    assert_stopped_last(srv.log_text())


def test_a_second_signal_during_a_stop_exits_at_once(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "s.etcd").start()
    assert srv.proc is not None
    put_and_get(srv.endpoint, b"acked", b"before the stop")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT) as sock:
        open_unread_watch(sock)  # the stop waits for this client for seconds
        srv.proc.send_signal(signal.SIGTERM)
        wait_for_line(srv, "received signal, stopping")
        status, took = signal_and_time(srv.proc, signal.SIGINT)
    assert status == -signal.SIGINT  # ended by the signal, as etcd is by a second one
    assert took < STOP_BUDGET, f"the second signal took {took:.2f}s"
    assert "stopped name=" not in srv.log_text()  # the stop did not get to finish
    srv.start()  # an acknowledged write is on disk from the moment it was acknowledged
    try:
        assert [kv.value for kv in put_and_get(srv.endpoint, b"acked", None).kvs] == [
            b"before the stop"
        ]
    finally:
        srv.stop()


def test_a_gateway_watch_ends_with_the_stopped_error_line(tmp_path: Path) -> None:
    """etcd's HTTP/JSON gateway on the client port: a streamed watch answered
    already ends with grpc-gateway's error line, and the stop is as fast."""
    srv = ServerProcess(tmp_path / "g.etcd").start()
    assert srv.proc is not None
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=WAIT)
    try:
        conn.request("POST", "/v3/watch", body=b'{"create_request": {"key": "dw=="}}')
        answer = conn.getresponse()
        assert answer.status == 200
        assert json.loads(answer.readline())["result"]["created"] is True
        status, took = signal_and_time(srv.proc, signal.SIGTERM)
        last = json.loads(answer.readline())
        assert answer.read() == b""  # and the answer ends
    finally:
        conn.close()
    assert status == 0
    assert took < STOP_BUDGET, f"the stop took {took:.2f}s"
    assert last["error"]["grpc_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert last["error"]["message"] == STOPPED
    assert_stopped_last(srv.log_text())
