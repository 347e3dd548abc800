"""A member far behind catches up through a streamed snapshot while the leader
keeps taking writes, with no leader change (issue 23's cluster tests).

Three members of ours with a small --snapshot-count, so the leader's log is cut
many times while a member is away and the only way back is a snapshot: the
leader writes its snapshot file when the member needs it (from a backend read transaction on
its backend thread), the member installs it (`raft installed snapshot` in its
log) and follows from there. Meanwhile a writer thread puts through the leader,
bounded in count and time, and notes its slowest put. The end: every key on
every member, one HashKV at one revision, and the raft term of before (no
election happened).

Scale: CATCHUP_KEYS keys are written while the member is away (default 20,000;
the issue's size is `CATCHUP_KEYS=500000`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.cluster import Cluster, Member
from tests.support.processes import free_port

pytestmark = pytest.mark.integration

KEYS = int(os.environ.get("CATCHUP_KEYS", "20000"))
SNAPSHOT_COUNT = 2000
VALUE = b"v" * 256
"""The issue's shape: 16-byte keys (`catchup/%08d`), 256-byte values."""
LOAD_CONCURRENCY = 32
LOAD_SECONDS = 60.0 + KEYS / 500
"""The bound on loading KEYS keys (a slow machine does about 2,000 puts/s)."""
CATCHUP_SECONDS = 60.0 + KEYS / 2000
"""The bound on a member's catch-up: streaming, installing, following."""
WRITER_MAX_PUTS = SNAPSHOT_COUNT // 2
"""The writer's puts during a catch-up: fewer than a snapshot's worth, so the
leader cuts its log at most once while the snapshot travels."""
WRITER_PAUSE = 0.01
"""Between the writer's puts: its load is a steady trickle, spread over the
catch-up, not a burst that ends before the snapshot is sent."""
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
PREFIX = b"catchup/"


# -- clients ---------------------------------------------------------------------------


def load(endpoint: str, first: int, count: int) -> None:
    """Put `catchup/{first..first+count-1}` through `endpoint`, LOAD_CONCURRENCY in
    flight, each retried on UNAVAILABLE/DEADLINE_EXCEEDED; all within LOAD_SECONDS."""

    async def run() -> None:
        async with aio.insecure_channel(endpoint) as ch:
            stub = rpc_pb2_grpc.KVStub(ch)
            todo = iter(range(first, first + count))

            async def worker() -> None:
                for i in todo:
                    request = rpc_pb2.PutRequest(key=PREFIX + b"%08d" % i, value=VALUE)
                    for attempt in range(5):
                        try:
                            await stub.Put(request, timeout=10)
                            break
                        except aio.AioRpcError as e:
                            if e.code() not in RETRYABLE or attempt == 4:
                                raise

            await asyncio.wait_for(
                asyncio.gather(*(worker() for _ in range(LOAD_CONCURRENCY))), LOAD_SECONDS
            )

    started = time.monotonic()
    asyncio.run(run())
    took = time.monotonic() - started
    print(f"\nloaded {count} keys in {took:.1f}s ({count / took:.0f} puts/s)")


class Writer:
    """Puts `during/{i}` through one member, one at a time, until told to stop,
    WRITER_MAX_PUTS are acknowledged or `seconds` pass; notes each latency."""

    def __init__(self, member: Member, seconds: float) -> None:
        self.member = member
        self.seconds = seconds
        self.acked: list[bytes] = []
        self.latencies: list[float] = []
        self.slowest_at = 0.0
        """When the slowest put began (wall clock), to find it in the logs."""
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Writer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the writer did not stop"

    @property
    def slowest(self) -> float:
        return max(self.latencies, default=0.0)

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        with grpc.insecure_channel(self.member.endpoint) as ch:
            stub = rpc_pb2_grpc.KVStub(ch)
            i = 0
            while (
                not self._stop.is_set()
                and len(self.acked) < WRITER_MAX_PUTS
                and time.monotonic() < deadline
            ):
                key = b"during/%06d" % i
                started = time.monotonic()
                began = time.time()
                try:
                    stub.Put(rpc_pb2.PutRequest(key=key, value=b"w"), timeout=10)
                    self.acked.append(key)
                    i += 1
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code()}: {e.details()}")
                latency = time.monotonic() - started
                if latency > self.slowest:
                    self.slowest_at = began
                self.latencies.append(latency)
                self._stop.wait(WRITER_PAUSE)  # pacing the load, not synchronisation


def count_keys(member: Member, prefix: bytes) -> int:
    """How many keys under `prefix` the member holds now (its local state)."""
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    with grpc.insecure_channel(member.endpoint) as ch:
        resp = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=prefix, range_end=end, count_only=True, serializable=True),
            timeout=30,
        )
    return int(resp.count)


def keys_under(member: Member, prefix: bytes) -> set[bytes]:
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    with grpc.insecure_channel(member.endpoint) as ch:
        resp = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=prefix, range_end=end, keys_only=True, serializable=True),
            timeout=30,
        )
    return {kv.key for kv in resp.kvs}


def terms(members: list[Member]) -> dict[str, tuple[int, int]]:
    """Each member's (raftTerm, leader) from Maintenance.Status."""
    out = {}
    for m in members:
        status = m.status(timeout=10)
        out[m.data_dir.name] = (status.raftTerm, status.leader)
    return out


# -- waits -----------------------------------------------------------------------------


def wait_caught_up(
    member: Member, log_from: int, index: int, started: float, seconds: float
) -> float:
    """Until `member` logged an installed snapshot (after byte `log_from` of its
    log) and applied the raft `index` the loaded keys reached on the leader
    (Status: cheap, where counting the keys walks them on its loop); the
    seconds since `started`."""
    deadline = started + seconds
    installed = False
    applied = -1
    while True:
        if not installed:
            installed = "raft installed snapshot" in member.log_text()[log_from:]
        if installed:
            try:
                applied = member.status(timeout=5).raftAppliedIndex
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise
            if applied >= index:
                return time.monotonic() - started
        assert member.alive, f"{member.data_dir.name} exited during its catch-up"
        assert time.monotonic() < deadline, (
            f"{member.data_dir.name} did not catch up in {seconds:.0f}s: "
            f"installed a snapshot: {installed}, applied {applied} of {index}"
        )
        time.sleep(0.1)  # poll its log and status, bounded


def assert_converged(members: list[Member], leader: Member, want: int, acked: list[bytes]) -> None:
    """Once every member applied a marker written after everything: each holds
    every key and the writer's acknowledged ones, with one HashKV."""
    with grpc.insecure_channel(leader.endpoint) as ch:
        put = rpc_pb2_grpc.KVStub(ch).Put(
            rpc_pb2.PutRequest(key=b"marker", value=b"end"), timeout=10
        )
    revision = put.header.revision
    hashes = {}
    for m in members:
        deadline = time.monotonic() + 60
        while True:
            with grpc.insecure_channel(m.endpoint) as ch:
                got = rpc_pb2_grpc.KVStub(ch).Range(
                    rpc_pb2.RangeRequest(key=b"marker", serializable=True), timeout=10
                )
            if got.kvs:
                break
            assert time.monotonic() < deadline, f"{m.data_dir.name} never applied the marker"
            time.sleep(0.05)  # poll its local state, bounded
        name = m.data_dir.name
        assert count_keys(m, PREFIX) == want, name
        assert set(acked) <= keys_under(m, b"during/"), name
        with grpc.insecure_channel(m.endpoint) as ch:
            hashes[name] = (
                rpc_pb2_grpc.MaintenanceStub(ch)
                .HashKV(rpc_pb2.HashKVRequest(revision=revision), timeout=60)
                .hash
            )
    assert len(set(hashes.values())) == 1, hashes


def report(what: str, took: float, writer: Writer) -> None:
    at = time.strftime("%H:%M:%S", time.localtime(writer.slowest_at))
    at += f".{int(writer.slowest_at % 1 * 1000):03d}"
    print(
        f"\n{what}: caught up in {took:.1f}s, {len(writer.acked)} puts meanwhile, "
        f"slowest put {writer.slowest * 1000:.0f} ms (at {at})"
    )


# -- the tests -------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, extra_args=["--snapshot-count", str(SNAPSHOT_COUNT)]).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("signal", ["SIGTERM", "SIGKILL"])
def test_a_stopped_follower_catches_up_by_a_streamed_snapshot_under_writes(
    cluster: Cluster, signal: str
) -> None:
    """SIGTERM: a clean stop (its backend checkpointed); SIGKILL: a crash (it
    restarts from its last checkpoint and replays its WAL) before the snapshot."""
    leader = cluster.wait_leader()
    follower = next(m for m in cluster.members if m is not leader)
    before = terms(cluster.members)
    if signal == "SIGTERM":
        follower.stop()  # to its pid, waited for
    else:
        follower.kill()
    load(leader.endpoint, 0, KEYS)
    loaded_at = leader.status(timeout=10).raftIndex
    log_from = len(follower.log_text())
    writer = Writer(leader, CATCHUP_SECONDS).start()
    try:
        started = time.monotonic()
        follower.start()
        took = wait_caught_up(follower, log_from, loaded_at, started, CATCHUP_SECONDS)
        assert count_keys(follower, PREFIX) == KEYS
    finally:
        writer.stop()
    report(f"follower after {KEYS} keys", took, writer)
    assert writer.errors == []
    assert writer.acked, "the leader took no write during the catch-up"
    assert "snapshot received" in follower.log_text()[log_from:]  # streamed to a file
    assert_converged(cluster.members, leader, KEYS, writer.acked)
    after = terms(cluster.members)
    assert set(after.values()) == set(before.values()), (before, after)
    assert len(set(after.values())) == 1, after


def test_a_member_added_to_a_loaded_cluster_catches_up_the_same_way(
    cluster: Cluster, tmp_path: Path
) -> None:
    leader = cluster.wait_leader()
    before = terms(cluster.members)
    load(leader.endpoint, 0, KEYS)
    loaded_at = leader.status(timeout=10).raftIndex
    peer_port = free_port()
    peer_url = f"http://127.0.0.1:{peer_port}"
    with grpc.insecure_channel(leader.endpoint) as ch:
        rpc_pb2_grpc.ClusterStub(ch).MemberAdd(
            rpc_pb2.MemberAddRequest(peerURLs=[peer_url]), timeout=10
        )
    initial = ",".join(
        [f"{m.data_dir.name}=http://127.0.0.1:{m.peer_port}" for m in cluster.members]
        + [f"n4={peer_url}"]
    )
    n4 = Member(
        tmp_path / "n4",
        peer_port,
        [
            "--initial-cluster",
            initial,
            "--initial-cluster-token",
            "test-cluster",
            "--initial-cluster-state",
            "existing",
            "--snapshot-count",
            str(SNAPSHOT_COUNT),
        ],
    )
    cluster.members.append(n4)  # stopped with the others
    writer = Writer(leader, CATCHUP_SECONDS).start()
    try:
        started = time.monotonic()
        n4.start()
        took = wait_caught_up(n4, 0, loaded_at, started, CATCHUP_SECONDS)
        assert count_keys(n4, PREFIX) == KEYS
    finally:
        writer.stop()
    report(f"added member after {KEYS} keys", took, writer)
    assert writer.errors == []
    assert writer.acked, "the leader took no write during the catch-up"
    assert "snapshot received" in n4.log_text()
    assert_converged(cluster.members, leader, KEYS, writer.acked)
    after = terms(cluster.members)
    assert len(set(after.values())) == 1, after
    assert set(after.values()) == set(before.values()), (before, after)
