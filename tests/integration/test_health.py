"""--listen-metrics-urls against real server processes: etcd's /health (alarms,
?exclude, ?serializable, no leader), /readyz, /livez and 404, asked over HTTP;
the README's first command serves the dashboard and /metrics there."""

from __future__ import annotations

import http.client
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.cluster import Cluster, Member
from tests.support.processes import REPO_ROOT, ServerProcess, free_port, wait_ready

pytestmark = pytest.mark.integration

HTTP_TIMEOUT = 10.0
"""Longer than the server's own 7 s bound on the read behind /health."""
README = REPO_ROOT / "README.md"
NO_LEADER_TIMEOUT = 30.0
"""A member cut off from its peers loses its leader within an election timeout or
two (1-2 s); its /health can also wait out one 7 s read first."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


def get(port: int, path: str, method: str = "GET") -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return Answer(resp.status, resp.read())
    finally:
        conn.close()


def metrics_args(port: int) -> list[str]:
    return ["--listen-metrics-urls", f"http://127.0.0.1:{port}"]


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    port = free_port()
    data_dir = tmp_path_factory.mktemp("health") / "h.etcd"
    srv = ServerProcess(data_dir, extra_args=metrics_args(port)).start()
    yield srv, port
    srv.stop()


def set_nospace(endpoint: str, active: bool) -> None:
    with grpc.insecure_channel(endpoint) as ch:
        mt = rpc_pb2_grpc.MaintenanceStub(ch)
        member = mt.Status(rpc_pb2.StatusRequest(), timeout=10).header.member_id
        action = rpc_pb2.AlarmRequest.ACTIVATE if active else rpc_pb2.AlarmRequest.DEACTIVATE
        mt.Alarm(
            rpc_pb2.AlarmRequest(action=action, memberID=member, alarm=rpc_pb2.NOSPACE), timeout=10
        )


def test_health_is_etcds_json_true(metrics_server: tuple[ServerProcess, int]) -> None:
    _, port = metrics_server
    answer = get(port, "/health")
    assert answer.status == 200
    assert answer.body == b'{"health":"true","reason":""}'
    assert get(port, "/health?serializable=true").status == 200


@pytest.mark.parametrize("path", ["/readyz", "/livez"])
def test_probes_answer_ok(metrics_server: tuple[ServerProcess, int], path: str) -> None:
    _, port = metrics_server
    assert get(port, path) == Answer(200, b"ok")


def test_unknown_path_is_404_and_other_methods_405(
    metrics_server: tuple[ServerProcess, int],
) -> None:
    _, port = metrics_server
    assert get(port, "/nope").status == 404
    assert get(port, "/metrics/x").status == 404
    assert get(port, "/health", method="POST").status == 405


def test_oversized_request_head_is_refused(metrics_server: tuple[ServerProcess, int]) -> None:
    _, port = metrics_server
    head = b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 10_000 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT) as s:
        s.sendall(head)
        assert s.recv(64).startswith(b"HTTP/1.1 431 ")


def test_nospace_alarm_fails_health_unless_excluded(
    metrics_server: tuple[ServerProcess, int],
) -> None:
    srv, port = metrics_server
    set_nospace(srv.endpoint, True)
    try:
        answer = get(port, "/health")
        assert answer.status == 503
        assert answer.json() == {"health": "false", "reason": "ALARM NOSPACE"}
        assert get(port, "/health?serializable=true").status == 503
        excluded = get(port, "/health?exclude=NOSPACE")
        assert excluded.status == 200 and excluded.json() == {"health": "true", "reason": ""}
        assert get(port, "/health?exclude=CORRUPT").status == 503
    finally:
        set_nospace(srv.endpoint, False)
    assert get(port, "/health").status == 200


def test_environment_variable_sets_the_metrics_urls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("ETCD_LISTEN_METRICS_URLS", f"http://127.0.0.1:{port}")
    srv = ServerProcess(tmp_path / "env.etcd").start()
    try:
        assert get(port, "/health").status == 200
    finally:
        srv.stop()


def poll(port: int, path: str, until_status: int, timeout: float) -> Answer:
    """Ask `path` until it answers `until_status` (bounded by `timeout`)."""
    deadline = time.monotonic() + timeout
    answer = Answer(0, b"")
    while time.monotonic() < deadline:
        answer = get(port, path)
        if answer.status == until_status:
            return answer
        time.sleep(0.1)  # poll interval of a bounded wait, not synchronisation
    raise TimeoutError(f"{path} still {answer} after {timeout}s")


def test_member_cut_off_from_its_peers_is_unhealthy(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    ports: dict[str, int] = {}
    for m in cluster.members:
        ports[m.data_dir.name] = free_port()
        m.extra_args += metrics_args(ports[m.data_dir.name])
    cluster.start()
    try:
        for m in cluster.members:
            assert get(ports[m.data_dir.name], "/health").status == 200, m.data_dir.name
        survivor: Member = cluster.members[0]
        for m in cluster.members[1:]:
            m.stop()
        port = ports[survivor.data_dir.name]
        answer = poll(port, "/health", 503, NO_LEADER_TIMEOUT)
        verdict = answer.json()
        assert isinstance(verdict, dict) and verdict["health"] == "false"
        reason = verdict["reason"]
        assert reason == "RAFT NO LEADER" or reason.startswith("RANGE ERROR:"), reason
        assert poll(port, "/readyz", 503, NO_LEADER_TIMEOUT).body == b"RAFT NO LEADER\n"
        # The member itself is fine: a serializable check and liveness say so.
        assert get(port, "/health?serializable=true").status == 200
        assert get(port, "/livez").status == 200
    finally:
        cluster.stop()


def test_the_readmes_first_command_serves_the_dashboard_and_metrics(tmp_path: Path) -> None:
    """README.md's first command, run as written but on free ports and in a tmp
    dir: clients, and the dashboard and /metrics on the metrics listener."""
    install, _, command = (
        README.read_text(encoding="utf-8").splitlines()[4].strip().partition(" && ")
    )
    assert install == "pip install -e ."
    program, *args = shlex.split(command)
    assert program == "queue-server"  # pyproject's entry point: queue_server.cli:main
    client, metrics = free_port(), free_port()
    local = [
        arg.replace("127.0.0.1:2379", f"127.0.0.1:{client}")
        .replace("127.0.0.1:2381", f"127.0.0.1:{metrics}")
        .replace("./default.etcd", str(tmp_path / "default.etcd"))
        for arg in args
    ]
    assert local != args and f"http://127.0.0.1:{metrics}" in local
    proc = subprocess.Popen(
        [sys.executable, "-m", "queue_server.cli", *local],
        cwd=REPO_ROOT,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(f"127.0.0.1:{client}", proc)
        page = get(metrics, "/")
        assert page.status == 200 and b"<html" in page.body.lower()  # the dashboard
        figures = get(metrics, "/metrics")
        assert figures.status == 200 and b"etcd_server_has_leader 1" in figures.body
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
