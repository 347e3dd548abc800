"""The etcd-key queue across a three-member cluster: a producer on one member, the
dispatching member (the leader), a consumer on a third, with the seed's
handed-over delivery keys; no message is given to two live consumers at once;
and when the dispatching member dies, the queue goes on with nothing
acknowledged lost and every unacknowledged message delivered again."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from tests.support.cluster import Cluster, Member

pytestmark = pytest.mark.integration

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
WAIT = 30.0


def name_of(member: Member) -> bytes:
    return member.data_dir.name.encode()


def get(member: Member, key: bytes) -> bytes | None:
    with grpc.insecure_channel(member.endpoint) as ch:
        resp = rpc_pb2_grpc.KVStub(ch).Range(rpc_pb2.RangeRequest(key=key), timeout=5)
    return resp.kvs[0].value if resp.kvs else None


def wait_value(member: Member, key: bytes, want: bytes | None, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while (got := get(member, key)) != want:
        assert time.monotonic() < deadline, f"{key!r} is {got!r}, not {want!r}"
        time.sleep(0.05)  # poll replicated state, bounded


class Consumer:
    """A watch on `/q/{queue}/c/{uuid}` through one member, in its own thread.
    Each delivery is recorded, then (if `ack`) acknowledged by deleting the key
    it came as, through the same member, retried while the member lives."""

    def __init__(self, member: Member, queue_name: str, ack: bool = True) -> None:
        self.member = member
        self.consumer_id = str(uuid.uuid4())
        self.key = f"/q/{queue_name}/c/{self.consumer_id}".encode()
        self.ack = ack
        self.received: list[tuple[bytes, bytes]] = []  # (delivery key, value)
        self.acked: list[bytes] = []
        self.events: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self._created = threading.Event()
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        self._channel = grpc.insecure_channel(member.endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Consumer:
        self._thread.start()
        assert self._created.wait(WAIT), "the consumer watch was not created"
        return self

    def close(self) -> None:
        self._requests.put(None)
        self._channel.close()
        self._thread.join(timeout=WAIT)

    def _iter_requests(self) -> Iterator[rpc_pb2.WatchRequest]:
        yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=self.key))
        while (r := self._requests.get()) is not None:
            yield r

    def _run(self) -> None:
        watch = rpc_pb2_grpc.WatchStub(self._channel)
        kv = rpc_pb2_grpc.KVStub(self._channel)
        try:
            for resp in watch.Watch(self._iter_requests()):
                if resp.created:
                    self._created.set()
                for ev in resp.events:
                    if ev.type != kv_pb2.Event.PUT:
                        continue
                    self.received.append((ev.kv.key, ev.kv.value))
                    self.events.put((ev.kv.key, ev.kv.value))
                    if self.ack:
                        self._delete(kv, ev.kv.key)
        except grpc.RpcError:
            return  # the member died or the test closed the consumer

    def _delete(self, kv: rpc_pb2_grpc.KVStub, key: bytes) -> None:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=3)
                self.acked.append(key)
                return
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE or not self.member.alive:
                    return


def put(member: Member, key: bytes, value: bytes) -> rpc_pb2.PutResponse:
    with grpc.insecure_channel(member.endpoint) as ch:
        response: rpc_pb2.PutResponse = rpc_pb2_grpc.KVStub(ch).Put(
            rpc_pb2.PutRequest(key=key, value=value), timeout=5
        )
        return response


def test_producer_dispatcher_and_consumer_on_three_members(cluster: Cluster) -> None:
    leader = cluster.wait_leader()
    consumer_member, producer_member = [m for m in cluster.members if m is not leader]
    consumer = Consumer(consumer_member, "jobs", ack=False).start()
    try:
        # the registry: the consumer's member, and the dispatching member
        wait_value(producer_member, consumer.key, name_of(consumer_member))
        wait_value(producer_member, b"/q/jobs", name_of(leader))

        put(producer_member, b"/q/jobs/p/job-1", b"resize photo 17")
        key, value = consumer.events.get(timeout=WAIT)
        # handed over from the dispatching member: /q/{name}/c/{uuid}/{idx}/{key}
        assert key == consumer.key + b"/0000000000000001/job-1"
        assert value == b"resize photo 17"
        assert get(leader, b"/q/jobs/0000000000000001/job-1") == b"resize photo 17"

        # deleting the delivery key, through any member, acknowledges the message
        with grpc.insecure_channel(producer_member.endpoint) as ch:
            deleted = rpc_pb2_grpc.KVStub(ch).DeleteRange(
                rpc_pb2.DeleteRangeRequest(key=key), timeout=5
            )
        assert deleted.deleted == 1
        for m in cluster.members:
            wait_value(m, b"/q/jobs/0000000000000001/job-1", None)
    finally:
        consumer.close()
    # the consumer's registry key goes with its watch
    wait_value(leader, consumer.key, None)


def test_consumers_on_different_members_share_the_work_without_duplicates(
    cluster: Cluster,
) -> None:
    consumers = [Consumer(m, "shared").start() for m in cluster.members]
    try:
        for c in consumers:
            wait_value(cluster.members[0], c.key, name_of(c.member))
        producer = cluster.members[1]
        for i in range(60):
            put(producer, b"/q/shared/p/m%02d" % i, b"%d" % i)
        deadline = time.monotonic() + WAIT
        while sum(len(c.acked) for c in consumers) < 60:
            assert time.monotonic() < deadline, [len(c.acked) for c in consumers]
            time.sleep(0.05)  # poll counters the consumer threads advance
        values = [v for c in consumers for _k, v in c.received]
        assert sorted(values, key=int) == [b"%d" % i for i in range(60)]  # each exactly once
        assert all(c.received for c in consumers), "round-robin reaches every member's consumer"
    finally:
        for c in consumers:
            c.close()


class Producer:
    """Produces `/q/{queue}/p/m{i}` through the live members in turn, retrying on
    UNAVAILABLE; remembers what was acknowledged."""

    def __init__(self, cluster: Cluster, queue_name: str, count: int) -> None:
        self.cluster = cluster
        self.queue_name = queue_name
        self.count = count
        self.acked: list[bytes] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join(timeout=WAIT * 2)

    def _run(self) -> None:
        turn = 0
        deadline = time.monotonic() + WAIT * 2
        i = 0
        while i < self.count and time.monotonic() < deadline:
            live = [m for m in self.cluster.members if m.alive]
            member = live[turn % len(live)]
            value = b"%d" % i
            try:
                put(member, f"/q/{self.queue_name}/p/m{i}".encode(), value)
                self.acked.append(value)
                i += 1
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    self.errors.append(f"{e.code()}: {e.details()}")
                turn += 1
            time.sleep(0.005)  # a steady load, not a flood: pacing, not synchronisation


def acknowledged(consumers: list[Consumer]) -> set[bytes]:
    """Values whose delivery some consumer deleted successfully."""
    return {v for c in consumers for k, v in list(c.received) if k in set(c.acked)}


def test_the_queue_goes_on_when_the_dispatching_member_dies(cluster: Cluster) -> None:
    leader = cluster.wait_leader()
    # the dispatching member's own consumer takes messages and never acknowledges
    consumers = [Consumer(m, "jobs", ack=m is not leader).start() for m in cluster.members]
    doomed = next(c for c in consumers if c.member is leader)
    producer = Producer(cluster, "jobs", 300)
    try:
        for c in consumers:
            wait_value(cluster.members[0], c.key, name_of(c.member))
        producer.start()
        deadline = time.monotonic() + WAIT
        while len(producer.acked) < 100:
            assert time.monotonic() < deadline, "the producer is stuck"
            time.sleep(0.02)  # poll a counter the producer thread advances
        killed_at = time.monotonic()
        leader.kill()  # the dispatching member, with a consumer of its own
        new_leader = cluster.wait_leader(exclude=leader)
        print(f"\nnew dispatching member {time.monotonic() - killed_at:.2f}s after SIGKILL")
        producer.join()
        assert producer.errors == []
        assert len(producer.acked) == 300

        # every acknowledged produce is acknowledged by a surviving consumer: what
        # the dead member's consumer held comes back once its session expires
        assert doomed.received, "the dead member's consumer held messages"
        want = set(producer.acked)
        deadline = time.monotonic() + WAIT
        while not want <= (done := acknowledged(consumers)):
            assert time.monotonic() < deadline, f"{len(want - done)} never acknowledged"
            time.sleep(0.05)  # poll counters the consumer threads advance
        print(f"redelivered after the kill: {len(doomed.received)}")
        # nothing left in the queue, on every survivor; the registry moved
        for m in cluster.members:
            if m.alive:
                with grpc.insecure_channel(m.endpoint) as ch:
                    left = rpc_pb2_grpc.KVStub(ch).Range(
                        rpc_pb2.RangeRequest(key=b"/q/jobs/0", range_end=b"/q/jobs/:"), timeout=5
                    )
                assert left.count == 0
        wait_value(new_leader, b"/q/jobs", name_of(new_leader))
        wait_value(new_leader, doomed.key, None)
    finally:
        for c in consumers:
            c.close()
