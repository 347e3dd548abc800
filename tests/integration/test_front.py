"""Fronts over a real 3-member etcd cluster (`queue-server --backend-endpoints`).

Two fronts serve one etcd cluster (Debian's etcd-server, started here): what a
client does through one is seen through the other, since etcd holds every
byte; a front keeps nothing on disk; the backend's members fail over; a front
that loses the whole backend refuses with UNAVAILABLE and serves again when it
comes back; etcd's auth and TLS work through it. The client suites through a
front (etcdctl, python etcd3, npm etcd3, etcd3gw) are in tests/compat, next to
the same suites against etcd itself. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.servers import free_port
from etcdserverpb import rpc_pb2, rpc_pb2_grpc, v3lock_pb2, v3lock_pb2_grpc
from tests.support.processes import (
    EtcdCluster,
    EtcdProcess,
    FrontProcess,
    until_answered,
    wait_ready,
)
from tests.support.tls import make_pki

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="needs Debian's etcd-server"),
]

WAIT = 10.0
CALL_TIMEOUT = 5.0
STOPPED_WAIT = 40.0
"""Bounds the failover from a stopped member: two keepalive periods, a 3 s
connect timeout to it, and a put's own 5 s timeout on the way."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    etcd = EtcdCluster(tmp_path_factory.mktemp("etcd3")).start()
    yield etcd
    etcd.stop()


@pytest.fixture(scope="module")
def fronts(
    cluster: EtcdCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[FrontProcess]]:
    workdir = tmp_path_factory.mktemp("fronts")
    procs = []
    for i in (1, 2):
        metrics = free_port()
        front = FrontProcess(
            workdir / f"front{i}.etcd",
            cluster.endpoints,
            ["--listen-metrics-urls", f"http://127.0.0.1:{metrics}"],
        )
        front.metrics_port = metrics  # type: ignore[attr-defined]
        procs.append(front.start())
    yield procs
    for front in procs:
        front.stop()


def kv(front: FrontProcess) -> rpc_pb2_grpc.KVStub:
    return rpc_pb2_grpc.KVStub(grpc.insecure_channel(front.endpoint))


def put(front: FrontProcess, key: bytes, value: bytes, lease: int = 0) -> rpc_pb2.PutResponse:
    request = rpc_pb2.PutRequest(key=key, value=value, lease=lease)
    response: rpc_pb2.PutResponse = kv(front).Put(request, timeout=CALL_TIMEOUT)
    return response


def get(front: FrontProcess, key: bytes) -> bytes | None:
    kvs = kv(front).Range(rpc_pb2.RangeRequest(key=key), timeout=CALL_TIMEOUT).kvs
    return kvs[0].value if kvs else None


def health(port: int) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=WAIT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def put_until_served(front: FrontProcess, key: bytes, value: bytes) -> float:
    """Put until a put succeeds (bounded by WAIT); returns the seconds it took."""
    start = time.monotonic()
    last: grpc.RpcError | None = None
    while time.monotonic() - start < WAIT:
        try:
            put(front, key, value)
            return time.monotonic() - start
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), e
            last = e
    raise AssertionError(f"no put served within {WAIT}s: {last}")


# -- two fronts, one etcd ---------------------------------------------------------


def test_what_one_front_writes_the_other_reads_and_watches(fronts: list[FrontProcess]) -> None:
    a, b = fronts
    watch = rpc_pb2_grpc.WatchStub(grpc.insecure_channel(b.endpoint))
    create = rpc_pb2.WatchRequest(
        create_request=rpc_pb2.WatchCreateRequest(key=b"/front/w/", range_end=b"/front/w0")
    )
    stream = watch.Watch(iter([create]), timeout=WAIT)
    assert next(stream).created
    revision = put(a, b"/front/w/k", b"v1").header.revision
    event = next(stream)
    assert [(e.kv.key, e.kv.value, e.kv.mod_revision) for e in event.events] == [
        (b"/front/w/k", b"v1", revision)
    ]
    stream.cancel()
    assert get(b, b"/front/w/k") == b"v1"


def test_a_lease_from_one_front_is_kept_alive_and_revoked_through_the_other(
    fronts: list[FrontProcess],
) -> None:
    a, b = fronts
    lease_a = rpc_pb2_grpc.LeaseStub(grpc.insecure_channel(a.endpoint))
    lease_b = rpc_pb2_grpc.LeaseStub(grpc.insecure_channel(b.endpoint))
    granted = lease_a.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30), timeout=CALL_TIMEOUT)
    put(a, b"/front/lease/k", b"v", lease=granted.ID)
    replies = lease_b.LeaseKeepAlive(
        iter([rpc_pb2.LeaseKeepAliveRequest(ID=granted.ID)]), timeout=WAIT
    )
    assert [r.TTL for r in replies] == [30]
    lease_b.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=granted.ID), timeout=CALL_TIMEOUT)
    assert get(a, b"/front/lease/k") is None
    with pytest.raises(grpc.RpcError) as e:
        lease_a.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=granted.ID), timeout=CALL_TIMEOUT)
    # etcd's own words, passed through
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert e.value.details() == "etcdserver: requested lease not found"


def test_a_lock_held_through_one_front_blocks_it_through_the_other(
    fronts: list[FrontProcess],
) -> None:
    a, b = fronts
    leases = rpc_pb2_grpc.LeaseStub(grpc.insecure_channel(a.endpoint))
    first = leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30), timeout=CALL_TIMEOUT).ID
    second = leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30), timeout=CALL_TIMEOUT).ID
    lock_a = v3lock_pb2_grpc.LockStub(grpc.insecure_channel(a.endpoint))
    lock_b = v3lock_pb2_grpc.LockStub(grpc.insecure_channel(b.endpoint))
    held = lock_a.Lock(v3lock_pb2.LockRequest(name=b"/front/lock", lease=first), timeout=5)
    waiting = lock_b.Lock.future(
        v3lock_pb2.LockRequest(name=b"/front/lock", lease=second), timeout=WAIT
    )
    with pytest.raises(grpc.FutureTimeoutError):
        waiting.result(timeout=1.0)  # the lock is held: the second waits
    lock_a.Unlock(v3lock_pb2.UnlockRequest(key=held.key), timeout=CALL_TIMEOUT)
    assert waiting.result(timeout=WAIT).key.startswith(b"/front/lock/")


def test_a_front_keeps_nothing_on_disk(fronts: list[FrontProcess]) -> None:
    for front in fronts:
        assert not front.data_dir.exists()


def test_health_is_the_backends(fronts: list[FrontProcess]) -> None:
    a, _ = fronts
    status, body = health(a.metrics_port)  # type: ignore[attr-defined]
    assert (status, body) == (200, {"health": "true", "reason": ""})
    status, body = health(a.port)  # the client port answers it too, as etcd's does
    assert status == 200 and body["health"] == "true"


# -- the backend fails -------------------------------------------------------------


def test_the_front_fails_over_when_its_etcd_member_dies(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    """A front's calls go to the leader (front/leader.py); killing it moves
    them to the next member that answers, and then to the new leader. The
    writes resume within the bound."""
    a, b = fronts
    put(a, b"/front/failover/before", b"1")
    leader = cluster.leader()
    cluster.kill(leader)
    try:
        took = put_until_served(a, b"/front/failover/after", b"2")
        assert took < WAIT
        assert get(b, b"/front/failover/after") == b"2"
        assert get(b, b"/front/failover/before") == b"1"
    finally:
        cluster.restart(leader)


def test_the_front_leaves_an_etcd_member_that_stops_answering(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    """A member that stops without closing its connections (SIGSTOP: as a cut
    network looks) is noticed by the front's keepalive pings, 10-20 s without an
    answer (front/h2_client.py KEEPALIVE_SECONDS, grpcio's for the streams), and
    left for the next member; before, every call went on timing out there. The
    front is given the two followers only, so no leader among its endpoints
    moves it first (front/leader.py; tests/integration/test_front_leader.py
    stops a leader)."""
    leader = cluster.leader()
    followers = [i for i in range(3) if i != leader]
    front = FrontProcess(
        tmp_path / "followers.etcd", [cluster.members[i].endpoint for i in followers]
    ).start()
    try:
        put(front, b"/front/stopped/before", b"1")
        proc = cluster.members[followers[0]].proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            until_answered(lambda: put(front, b"/front/stopped/after", b"2"), STOPPED_WAIT, "a put")
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert get(front, b"/front/stopped/after") == b"2"
    finally:
        front.stop()


def test_without_a_backend_a_front_refuses_with_unavailable_and_recovers(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    a, _ = fronts
    put(a, b"/front/outage/k", b"kept")
    for i in range(3):
        cluster.kill(i)
    try:
        with pytest.raises(grpc.RpcError) as e:
            put(a, b"/front/outage/k", b"lost?")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (e.value.details() or "").startswith("etcdserver: backend unavailable")
        status, body = health(a.metrics_port)  # type: ignore[attr-defined]
        assert status == 503 and body["health"] == "false"
        assert "backend unavailable" in body["reason"]
    finally:
        for i in range(3):
            cluster.start_member(i, state="existing")
        for m in cluster.members:
            wait_ready(m.endpoint, m.proc)
    put_until_served(a, b"/front/outage/after", b"back")
    assert get(a, b"/front/outage/k") == b"kept"  # the refused put changed nothing
    deadline = time.monotonic() + WAIT
    while health(a.metrics_port)[0] != 200:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "health did not come back"


def test_a_front_keeps_to_the_backends_stream_limit_instead_of_failing_calls(
    tmp_path: Path,
) -> None:
    """etcd's --max-concurrent-streams: grpc-go refuses streams past it
    (RST_STREAM REFUSED_STREAM). The front's calls past the limit wait for a
    stream, as clientv3's do, so many concurrent clients all get answers."""
    backend = EtcdProcess(tmp_path / "streams.etcd", ["--max-concurrent-streams", "2"]).start()
    front = FrontProcess(tmp_path / "front.etcd", [backend.endpoint])
    try:
        front.start()
        with grpc.insecure_channel(front.endpoint) as channel:
            stub = rpc_pb2_grpc.KVStub(channel)
            calls = [
                stub.Put.future(
                    rpc_pb2.PutRequest(key=b"/front/streams/%d" % i, value=b"v"), timeout=WAIT
                )
                for i in range(64)
            ]
            errors = [c.exception() for c in calls if c.exception() is not None]
            assert not errors, f"{len(errors)} of 64 puts failed, first: {errors[0]}"
            count = stub.Range(
                rpc_pb2.RangeRequest(
                    key=b"/front/streams/", range_end=b"/front/streams0", count_only=True
                ),
                timeout=WAIT,
            ).count
            assert count == 64
    finally:
        front.stop()
        backend.stop()


# -- auth and TLS through a front -----------------------------------------------------


def test_etcd_auth_through_a_front(tmp_path: Path) -> None:
    backend = EtcdProcess(tmp_path / "auth.etcd").start()
    metrics = free_port()
    front = FrontProcess(
        tmp_path / "front.etcd",
        [backend.endpoint],
        ["--backend-user", "root:rootpw", "--listen-metrics-urls", f"http://127.0.0.1:{metrics}"],
    )
    ctl = ["etcdctl", f"--endpoints={front.endpoint}", "--command-timeout=5s"]
    env = {**os.environ, "ETCDCTL_API": "3"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ctl, *args], capture_output=True, text=True, timeout=30, env=env)

    try:
        front.start()
        for step in (
            ("user", "add", "root:rootpw"),
            ("auth", "enable"),
        ):
            assert run(*step).returncode == 0
        refused = run("put", "k", "v")
        assert refused.returncode == 1
        assert "Error: etcdserver: user name is empty" in refused.stderr
        assert run("--user", "root:rootpw", "put", "k", "v").stdout == "OK\n"
        out = run("--user", "root:rootpw", "get", "k", "--print-value-only")
        assert out.stdout == "v\n"
        bad = run("--user", "root:wrong", "get", "k")
        assert "authentication failed, invalid user ID or password" in bad.stderr
        # the front's own read (its health) authenticates as --backend-user
        assert health(metrics) == (200, {"health": "true", "reason": ""})
    finally:
        front.stop()
        backend.stop()


def test_a_front_over_an_etcd_that_wants_client_certificates(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    tls = [
        *("--cert-file", str(pki.server.cert), "--key-file", str(pki.server.key)),
        *("--trusted-ca-file", str(pki.ca), "--client-cert-auth"),
    ]
    backend = EtcdProcess(tmp_path / "tls.etcd", tls, pki.credentials(pki.client)).start()
    plain = FrontProcess(tmp_path / "plain.etcd", [backend.url])
    front = FrontProcess(
        tmp_path / "front.etcd",
        [backend.url],
        [
            *("--backend-cacert", str(pki.ca)),
            *("--backend-cert", str(pki.client.cert), "--backend-key", str(pki.client.key)),
        ],
    )
    try:
        front.start()
        assert put(front, b"/front/tls", b"v").header.revision > 1
        assert get(front, b"/front/tls") == b"v"
        plain.start(wait=False)  # no client certificate: etcd refuses the handshake
        deadline = time.monotonic() + WAIT
        while True:
            with pytest.raises(grpc.RpcError) as e:
                get(plain, b"/front/tls")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            if (e.value.details() or "").startswith("etcdserver: backend unavailable"):
                break  # the front answered, not the kernel refusing its port
            assert time.monotonic() < deadline, e.value.details()
    finally:
        for proc in (plain, front):
            if proc.proc is not None:
                proc.stop()
        backend.stop()
