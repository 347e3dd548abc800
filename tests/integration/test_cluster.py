"""A three-member Raft cluster of real processes on loopback: any member serves
any client, a killed leader is replaced with nothing acknowledged lost, a
stopped leader is replaced and rejoins into one history."""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from tests.support.cluster import Cluster, Member
from tests.support.linearizability import Op, linearizable
from tests.support.processes import EtcdProcess, free_port

pytestmark = pytest.mark.integration

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
WAIT = 20.0


def kv(member: Member) -> tuple[grpc.Channel, rpc_pb2_grpc.KVStub]:
    ch = grpc.insecure_channel(member.endpoint)
    return ch, rpc_pb2_grpc.KVStub(ch)


def get(member: Member, key: bytes, serializable: bool = False) -> bytes | None:
    ch, stub = kv(member)
    with ch:
        resp = stub.Range(rpc_pb2.RangeRequest(key=key, serializable=serializable), timeout=5)
    return resp.kvs[0].value if resp.kvs else None


def keys_with_prefix(member: Member, prefix: bytes, serializable: bool) -> set[bytes]:
    ch, stub = kv(member)
    with ch:
        resp = stub.Range(
            rpc_pb2.RangeRequest(
                key=prefix,
                range_end=prefix[:-1] + bytes([prefix[-1] + 1]),
                keys_only=True,
                serializable=serializable,
            ),
            timeout=5,
        )
    return {item.key for item in resp.kvs}


def assert_one_history(members: list[Member], key: bytes, value: bytes, revision: int) -> None:
    """Once every member has applied the write of `key`, all hold the same keys
    and values at `revision` (equal HashKV)."""
    hashes = set()
    for m in members:
        deadline = time.monotonic() + WAIT
        while get(m, key, serializable=True) != value:
            assert time.monotonic() < deadline, f"{m.data_dir.name} never applied {key!r}"
            time.sleep(0.05)  # poll its local state, bounded
        with grpc.insecure_channel(m.endpoint) as ch:
            resp = rpc_pb2_grpc.MaintenanceStub(ch).HashKV(
                rpc_pb2.HashKVRequest(revision=revision), timeout=5
            )
        hashes.add(resp.hash)
    assert len(hashes) == 1, hashes


def etcdctl(endpoints: str, *args: str) -> str:
    out = subprocess.run(
        ["etcdctl", f"--endpoints={endpoints}", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout


def test_any_member_serves_reads_writes_and_watches(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.members
    etcdctl(n1.endpoint, "put", "greeting", "hello")
    assert etcdctl(n2.endpoint, "get", "greeting") == "greeting\nhello\n"
    assert etcdctl(n3.endpoint, "get", "greeting") == "greeting\nhello\n"
    # member list: every member, with its name, peer URL and client URL
    rows = etcdctl(cluster.endpoints, "member", "list").strip().splitlines()
    assert len(rows) == 3
    for m in cluster.members:
        assert any(
            f", {m.data_dir.name}, http://127.0.0.1:{m.peer_port}, http://{m.endpoint}," in r
            for r in rows
        ), rows
    status = etcdctl(cluster.endpoints, "endpoint", "status").strip().splitlines()
    assert len(status) == 3
    assert sum(", true, " in line for line in status) == 1, status
    # a watch on n3 sees writes made through n1 and n2, in revision order
    with grpc.insecure_channel(n3.endpoint) as ch:
        watch = rpc_pb2_grpc.WatchStub(ch)
        created = threading.Event()
        requests = iter([rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"w"))])

        def gen() -> Iterator[rpc_pb2.WatchRequest]:
            yield from requests
            created.wait(WAIT)  # keep the stream open until the test is done

        stream = watch.Watch(gen(), timeout=WAIT)
        try:
            first = next(stream)
            assert first.created
            for member, value in ((n1, b"one"), (n2, b"two")):
                ch2, stub = kv(member)
                with ch2:
                    stub.Put(rpc_pb2.PutRequest(key=b"w", value=value), timeout=10)
            seen: list[tuple[bytes, int]] = []
            while len(seen) < 2:
                resp = next(stream)
                seen += [(e.kv.value, e.kv.mod_revision) for e in resp.events]
            assert [v for v, _ in seen] == [b"one", b"two"]
            assert seen[0][1] < seen[1][1]
        finally:
            created.set()
            stream.cancel()


class Writer:
    """Puts `load/{i}` one after another through whichever member answers,
    retrying on UNAVAILABLE; remembers what was acknowledged."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.acked: list[bytes] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Writer:
        self._thread.start()
        return self

    def wait_for(self, count: int, timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        while len(self.acked) < count:
            assert time.monotonic() < deadline, f"only {len(self.acked)} writes acknowledged"
            time.sleep(0.02)  # poll interval of a counter another thread advances

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT)

    def _run(self) -> None:
        i = 0
        turn = 0
        deadline = time.monotonic() + 60
        while not self._stop.is_set() and time.monotonic() < deadline:
            live = [m for m in self.cluster.members if m.alive]
            member = live[turn % len(live)]
            key = b"load/%06d" % i
            try:
                with grpc.insecure_channel(member.endpoint) as ch:
                    rpc_pb2_grpc.KVStub(ch).Put(rpc_pb2.PutRequest(key=key, value=b"v"), timeout=3)
                self.acked.append(key)
                i += 1
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    self.errors.append(f"{e.code()}: {e.details()}")
                turn += 1


def test_leader_killed_under_load_loses_nothing_and_rejoins(cluster: Cluster) -> None:
    leader = cluster.wait_leader()
    writer = Writer(cluster).start()
    try:
        writer.wait_for(30)
        killed_at = time.monotonic()
        leader.kill()
        new_leader = cluster.wait_leader(exclude=leader)
        failover = time.monotonic() - killed_at
        before = len(writer.acked)
        writer.wait_for(before + 30)
    finally:
        writer.stop()
    print(f"\nnew leader {failover:.2f}s after SIGKILL of the old one")
    assert new_leader is not leader
    assert failover < 10, failover
    assert writer.errors == []
    acked = set(writer.acked)
    for m in cluster.members:
        if m.alive:
            assert acked <= keys_with_prefix(m, b"load/", serializable=False)
    # the killed member comes back from its data dir and catches up
    leader.start()
    deadline = time.monotonic() + WAIT
    while not acked <= keys_with_prefix(leader, b"load/", serializable=True):
        assert time.monotonic() < deadline, "the restarted member did not catch up"
        time.sleep(0.1)  # poll its local state, bounded


def test_stopped_leader_is_replaced_and_rejoins_into_one_history(cluster: Cluster) -> None:
    old = cluster.wait_leader()
    old.pause()
    try:
        new = cluster.wait_leader(exclude=old)
        ch, stub = kv(new)
        with ch:
            stub.Put(rpc_pb2.PutRequest(key=b"during", value=b"split"), timeout=10)
    finally:
        old.resume()
    # the old leader learns the new term and follows; a write through it lands
    deadline = time.monotonic() + WAIT
    while old.status().leader in (0, old.status().header.member_id):
        assert time.monotonic() < deadline, "the old leader never followed"
        time.sleep(0.05)  # poll its status, bounded
    ch, stub = kv(old)
    with ch:
        put = stub.Put(rpc_pb2.PutRequest(key=b"after", value=b"heal"), timeout=10)
    assert get(old, b"during") == b"split"
    assert_one_history(cluster.members, b"after", b"heal", put.header.revision)


def test_a_fourth_member_joins_catches_up_and_is_removed(cluster: Cluster, tmp_path: Path) -> None:
    n1 = cluster.members[0]
    etcdctl(cluster.endpoints, "put", "before-join", "yes")
    peer_port = free_port()
    out = etcdctl(
        cluster.members[1].endpoint,
        "member",
        "add",
        "n4",
        f"--peer-urls=http://127.0.0.1:{peer_port}",
    )
    assert "added to cluster" in out
    initial = ",".join(
        [f"{m.data_dir.name}=http://127.0.0.1:{m.peer_port}" for m in cluster.members]
        + [f"n4=http://127.0.0.1:{peer_port}"]
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
        ],
    )
    cluster.members.append(n4)  # stopped with the others
    n4.start()
    deadline = time.monotonic() + WAIT
    while get(n4, b"before-join", serializable=True) != b"yes":
        assert time.monotonic() < deadline, "the new member did not catch up"
        time.sleep(0.05)  # poll its local state, bounded
    rows = etcdctl(n1.endpoint, "member", "list").strip().splitlines()
    assert len(rows) == 4 and any(", n4, " in r for r in rows), rows
    # four voters: a write needs three of them, and still commits
    etcdctl(n4.endpoint, "put", "with-four", "ok")
    assert etcdctl(n1.endpoint, "get", "with-four") == "with-four\nok\n"
    n4_id = n4.status().header.member_id
    etcdctl(n1.endpoint, "member", "remove", f"{n4_id:x}")
    rows = etcdctl(n1.endpoint, "member", "list").strip().splitlines()
    assert len(rows) == 3 and not any(", n4, " in r for r in rows), rows
    n4.kill()
    cluster.members.remove(n4)
    etcdctl(cluster.endpoints, "put", "after-remove", "ok")
    assert etcdctl(cluster.members[2].endpoint, "get", "after-remove") == "after-remove\nok\n"


def test_cqs_works_through_any_member(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.members
    with grpc.insecure_channel(n1.endpoint) as ch:
        cqs_pb2_grpc.DtoChangeQueueServiceStub(ch).CreateOrConfigureQueue(
            cqs_pb2.CreateOrConfigureQueueRequest(
                queue_name="renderer",
                subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type="storeesl.v1")],
            ),
            timeout=10,
        )
    etcdctl(
        n2.endpoint,
        "put",
        "/q/dto:storeesl.v1/p/x",
        '{"dto_id": "t/fm/s/oslo/esls/1", "sla_timestamp": "2026-01-01T10:00:01Z"}',
    )
    with grpc.insecure_channel(n3.endpoint) as ch:
        stub = cqs_pb2_grpc.DtoChangeQueueServiceStub(ch)
        got = stub.BatchDequeue(
            cqs_pb2.BatchDequeueRequest(
                queue_name="renderer", max_notifications=5, wait_time_milliseconds=5000
            ),
            timeout=10,
        ).notifications
    assert [n.dto_id for n in got] == ["t/fm/s/oslo/esls/1"]
    with grpc.insecure_channel(n1.endpoint) as ch:
        stub = cqs_pb2_grpc.DtoChangeQueueServiceStub(ch)
        stub.BatchAcknowledge(
            cqs_pb2.BatchAcknowledgeRequest(queue_name="renderer", ack_tokens=[got[0].ack_token]),
            timeout=10,
        )
    # acknowledged everywhere: the view on the third member shows nothing left
    deadline = time.monotonic() + WAIT
    while keys_with_prefix(n2, b"/q/renderer/0", serializable=True):
        assert time.monotonic() < deadline
        time.sleep(0.05)  # poll its local state, bounded


def test_a_member_behind_the_compacted_log_catches_up_by_snapshot(tmp_path: Path) -> None:
    c = Cluster(tmp_path, extra_args=["--snapshot-count", "20"]).start()
    try:
        leader = c.wait_leader()
        follower = next(m for m in c.members if m is not leader)
        follower.kill()
        ch, stub = kv(leader)
        with ch:
            for i in range(120):  # several snapshots: the log the follower needs is gone
                stub.Put(rpc_pb2.PutRequest(key=b"snap/%03d" % i, value=b"v"), timeout=10)
        follower.start()
        want = {b"snap/%03d" % i for i in range(120)}
        deadline = time.monotonic() + WAIT
        while keys_with_prefix(follower, b"snap/", serializable=True) != want:
            assert time.monotonic() < deadline, "the follower did not catch up"
            time.sleep(0.1)  # poll its local state, bounded
        # and it keeps following after the snapshot
        etcdctl(leader.endpoint, "put", "snap/after", "x")
        deadline = time.monotonic() + WAIT
        while get(follower, b"snap/after", serializable=True) != b"x":
            assert time.monotonic() < deadline
            time.sleep(0.05)  # poll its local state, bounded
        assert "installed snapshot" in follower.log_text()
        assert "snapshot received" in follower.log_text()  # streamed to a file, then installed
    finally:
        c.stop()


def test_whole_cluster_restarts_from_snapshots_and_logs(tmp_path: Path) -> None:
    c = Cluster(tmp_path, extra_args=["--snapshot-count", "20"]).start()
    try:
        ch, stub = kv(c.wait_leader())
        with ch:
            for i in range(50):
                stub.Put(rpc_pb2.PutRequest(key=b"r/%03d" % i, value=b"v"), timeout=10)
        for m in c.members:
            m.kill()
        for m in c.members:
            m.start(wait=False)
        c.wait_leader()
        want = {b"r/%03d" % i for i in range(50)}
        for m in c.members:
            assert keys_with_prefix(m, b"r/", serializable=False) == want
        etcdctl(c.endpoints, "put", "r/after", "x")
    finally:
        c.stop()


def test_a_cut_off_leader_steps_down_and_commits_nothing(tmp_path: Path) -> None:
    """No split brain: a leader that hears from no other member stops being leader
    (CheckQuorum) and acknowledges no write, the majority elects and serves, and
    after healing there is one history. (The cut is one-way, as a firewall may
    make it: the old leader's appends still reach the others, so its write may be
    committed by the new leader, which is why the client is told UNAVAILABLE, an
    unknown outcome, as etcd says "request timed out".)"""
    c = Cluster(tmp_path, proxied=True).start()
    try:
        old = c.wait_leader()
        old_id = old.status().header.member_id
        c.proxy_of(old).cut()
        failed: list[str] = []

        def write_through_old() -> None:
            ch, stub = kv(old)
            try:
                with ch:
                    stub.Put(rpc_pb2.PutRequest(key=b"split", value=b"brain"), timeout=12)
                failed.append("acknowledged")
            except grpc.RpcError as e:
                failed.append(e.code().name)

        writer = threading.Thread(target=write_through_old)
        writer.start()  # while the old leader may still think it leads
        new = c.wait_leader(exclude=old)
        ch, stub = kv(new)
        with ch:
            stub.Put(rpc_pb2.PutRequest(key=b"majority", value=b"ok"), timeout=10)
        deadline = time.monotonic() + WAIT
        while old.status().leader == old_id:
            assert time.monotonic() < deadline, "the cut-off leader never stepped down"
            time.sleep(0.05)  # poll its status, bounded
        writer.join(timeout=WAIT)
        assert failed and failed[0] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), failed
        c.proxy_of(old).heal()
        deadline = time.monotonic() + WAIT
        while get(old, b"majority", serializable=True) != b"ok":
            assert time.monotonic() < deadline, "the healed member did not catch up"
            time.sleep(0.05)  # poll its local state, bounded
        ch, stub = kv(new)
        with ch:
            final = stub.Put(rpc_pb2.PutRequest(key=b"healed", value=b"yes"), timeout=10)
        assert_one_history(c.members, b"healed", b"yes", final.header.revision)
        assert len({get(m, b"split", serializable=True) for m in c.members}) == 1
    finally:
        c.stop()


def test_a_lease_kept_alive_through_a_follower_outlives_its_ttl(cluster: Cluster) -> None:
    leader = cluster.wait_leader()
    follower = next(m for m in cluster.members if m is not leader)
    with grpc.insecure_channel(leader.endpoint) as ch:
        lease = rpc_pb2_grpc.LeaseStub(ch).LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=2), timeout=10)
        rpc_pb2_grpc.KVStub(ch).Put(
            rpc_pb2.PutRequest(key=b"leased", value=b"x", lease=lease.ID), timeout=10
        )
    stop = threading.Event()

    def keepalives() -> Iterator[rpc_pb2.LeaseKeepAliveRequest]:
        while not stop.is_set():
            yield rpc_pb2.LeaseKeepAliveRequest(ID=lease.ID)
            stop.wait(0.5)  # the client's keepalive period

    with grpc.insecure_channel(follower.endpoint) as ch:
        answers = rpc_pb2_grpc.LeaseStub(ch).LeaseKeepAlive(keepalives(), timeout=WAIT)
        started = time.monotonic()
        try:
            for answer in answers:
                assert answer.TTL > 0, "the lease expired while kept alive"
                if time.monotonic() - started > 5:  # 2.5 TTLs
                    break
        finally:
            stop.set()
            answers.cancel()
    # the leader's clock heard the follower's keepalives: the key is still there
    assert get(leader, b"leased") == b"x"
    # and once they stop, the leader revokes the lease
    deadline = time.monotonic() + WAIT
    while get(leader, b"leased") is not None:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.1)  # poll, bounded


def test_a_watch_on_a_follower_has_no_gap_across_a_leader_change(cluster: Cluster) -> None:
    leader = cluster.wait_leader()
    watched = next(m for m in cluster.members if m is not leader)
    done = threading.Event()
    with grpc.insecure_channel(watched.endpoint) as ch:

        def requests() -> Iterator[rpc_pb2.WatchRequest]:
            create = rpc_pb2.WatchCreateRequest(key=b"load/", range_end=b"load0")
            yield rpc_pb2.WatchRequest(create_request=create)
            done.wait(WAIT * 2)

        stream = rpc_pb2_grpc.WatchStub(ch).Watch(requests(), timeout=WAIT * 2)
        assert next(stream).created
        writer = Writer(cluster).start()
        try:
            writer.wait_for(20)
            leader.kill()
            cluster.wait_leader(exclude=leader)
            writer.wait_for(len(writer.acked) + 20)
        finally:
            writer.stop()
        acked = set(writer.acked)
        seen: list[tuple[bytes, int]] = []
        try:
            while not acked <= {k for k, _ in seen}:
                resp = next(stream)
                seen += [(e.kv.key, e.kv.mod_revision) for e in resp.events]
        finally:
            done.set()
            stream.cancel()
    revisions = [r for _, r in seen]
    assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
    assert writer.errors == []


def test_a_concurrent_history_across_members_and_a_leader_kill_is_linearizable(
    cluster: Cluster,
) -> None:
    """Three clients, one per member, write unique values to one key and read it
    (linearizable reads), while the leader is killed; the recorded history must
    have a linearization (tests/support/linearizability.py)."""
    history: list[Op] = []
    lock = threading.Lock()
    clock = time.monotonic
    stop = threading.Event()

    def client(member: Member, reader: Member, n: int) -> None:
        # writes through one member, reads through another: a stale follower
        # read would show
        with (
            grpc.insecure_channel(member.endpoint) as ch,
            grpc.insecure_channel(reader.endpoint) as read_ch,
        ):
            stub = rpc_pb2_grpc.KVStub(ch)
            read_stub = rpc_pb2_grpc.KVStub(read_ch)
            for i in range(40):
                if stop.is_set() or not member.alive or not reader.alive:
                    return
                start = clock()
                if i % 2 == 0:
                    value = f"c{n}-{i}"
                    try:
                        stub.Put(rpc_pb2.PutRequest(key=b"reg", value=value.encode()), timeout=3)
                        op = Op("write", value, start, clock())
                    except grpc.RpcError:
                        op = Op("write", value, start, math.inf)  # outcome unknown
                else:
                    try:
                        resp = read_stub.Range(rpc_pb2.RangeRequest(key=b"reg"), timeout=3)
                    except grpc.RpcError:
                        continue  # a failed read has no effect
                    got = resp.kvs[0].value.decode() if resp.kvs else None
                    op = Op("read", got, start, clock())
                with lock:
                    history.append(op)

    leader = cluster.wait_leader()
    members = cluster.members
    threads = [
        threading.Thread(target=client, args=(m, members[(n + 1) % 3], n), daemon=True)
        for n, m in enumerate(members)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + WAIT
    while len(history) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.02)  # poll a counter the clients advance, bounded
    leader.kill()
    for t in threads:
        t.join(timeout=WAIT * 2)
    stop.set()
    reads = [op for op in history if op.kind == "read"]
    writes = [op for op in history if op.kind == "write" and op.end != math.inf]
    assert len(reads) >= 10 and len(writes) >= 10, (len(reads), len(writes))
    assert linearizable(history)


def test_a_followers_etcd_snapshot_restores_into_a_real_etcd(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`etcdctl snapshot save` from a follower: the member writes the bbolt file
    from its backend on the backend thread (after a checkpoint at its applied
    index), and a real etcd restored from it serves the cluster's keys."""
    leader = cluster.wait_leader()
    follower = next(m for m in cluster.members if m is not leader)
    for i in range(200):
        etcdctl(leader.endpoint, "put", f"snap/{i:03d}", f"value-{i}")
    etcdctl(leader.endpoint, "del", "snap/007")
    want = json.loads(etcdctl(leader.endpoint, "get", "snap/", "--prefix", "-w", "json"))
    deadline = time.monotonic() + WAIT
    while keys_with_prefix(follower, b"snap/", serializable=True) != {
        f"snap/{i:03d}".encode() for i in range(200) if i != 7
    }:
        assert time.monotonic() < deadline, "the follower never applied the writes"
        time.sleep(0.05)  # poll its local state, bounded
    path = tmp_path / "follower.db"
    etcdctl(follower.endpoint, "snapshot", "save", str(path))
    status = json.loads(etcdctl(follower.endpoint, "snapshot", "status", str(path), "-w", "json"))
    assert status["revision"] >= want["header"]["revision"]

    etcd = EtcdProcess.restored_from(path, tmp_path / "restored.etcd")
    etcd.start()
    try:
        got = json.loads(etcdctl(etcd.endpoint, "get", "snap/", "--prefix", "-w", "json"))
    finally:
        etcd.stop()
    assert got["kvs"] == want["kvs"]
