"""The etcd-key queue through fronts over a real 3-member etcd (queue_server/front/queues.py).

Producers, consumers and acks on different fronts; every byte of the queue is a
key in etcd. A consumer's watch on one front receives what a producer on another
front put; its delete acknowledges; a consumer that goes away gives its messages
back; when the dispatching front is SIGKILLed, another front takes the queue
over and nothing acknowledged is lost or handed to two consumers at once. Every
wait is bounded.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from tests.integration.test_queue import WatchStream, consumer_key, new_id
from tests.support.processes import EtcdCluster, FrontProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="needs Debian's etcd-server"),
]

WAIT = 15.0
"""Bounds every wait; a takeover needs the dead front's session lease (3 s) to expire."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    etcd = EtcdCluster(tmp_path_factory.mktemp("etcd3q")).start()
    yield etcd
    etcd.stop()


@pytest.fixture
def fronts(cluster: EtcdCluster, tmp_path: Path) -> Iterator[list[FrontProcess]]:
    procs = [FrontProcess(tmp_path / f"front{i}.etcd", cluster.endpoints).start() for i in (1, 2)]
    yield procs
    for proc in procs:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()


def kv(front: FrontProcess) -> rpc_pb2_grpc.KVStub:
    return rpc_pb2_grpc.KVStub(grpc.insecure_channel(front.endpoint))


def produce(front: FrontProcess, name: bytes, key: bytes, value: bytes) -> None:
    request = rpc_pb2.PutRequest(key=b"/q/%s/p/%s" % (name, key), value=value)
    kv(front).Put(request, timeout=WAIT)


def ack(front: FrontProcess, key: bytes) -> int:
    return int(kv(front).DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=WAIT).deleted)


class Consumer:
    """A consumer of `name` through `front`: its watch, and what it received."""

    def __init__(self, front: FrontProcess, name: bytes) -> None:
        self.channel = grpc.insecure_channel(front.endpoint)
        self.stream = WatchStream(self.channel)
        self.registration = consumer_key(name, new_id())
        self.watch_id = self.stream.watch(self.registration)

    def deliveries(self, n: int, timeout: float = WAIT) -> list[kv_pb2.KeyValue]:
        events = self.stream.events(n, timeout)
        assert all(e.type == kv_pb2.Event.PUT for e in events), events
        return [e.kv for e in events]

    def close(self) -> None:
        self.stream.close()
        self.channel.close()


def collect(consumers: list[Consumer], n: int) -> list[kv_pb2.KeyValue]:
    """`n` deliveries from whichever of `consumers` receives them (bounded)."""
    deadline = time.monotonic() + WAIT
    got: list[kv_pb2.KeyValue] = []
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} deliveries within {WAIT}s"
        for c in consumers:
            with contextlib.suppress(queue.Empty):
                response = c.stream.responses.get(timeout=0.05)
                assert response is not None, "a consumer's stream ended"
                got.extend(e.kv for e in response.events if e.type == kv_pb2.Event.PUT)
    assert len(got) == n
    return got


def pending_in_etcd(cluster: EtcdCluster, name: bytes) -> int:
    """Message keys of the queue left in etcd, read from etcd itself."""
    with grpc.insecure_channel(cluster.endpoints[1]) as ch:
        reply = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(
                key=b"/q/%s/0" % name, range_end=b"/q/%s/:" % name, count_only=True
            ),
            timeout=WAIT,
        )
    return int(reply.count)


def test_produce_on_one_front_consume_and_ack_on_the_other(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    a, b = fronts
    name = b"fq-basic"
    consumer = Consumer(b, name)
    for i in range(20):
        produce(a, name, b"job-%02d" % i, b"work %d" % i)
    got = consumer.deliveries(20)
    assert [kv.value for kv in got] == [b"work %d" % i for i in range(20)]  # oldest first
    assert all(kv.key.startswith(consumer.registration + b"/") for kv in got)
    assert [kv.key.rsplit(b"/", 1)[1] for kv in got] == [b"job-%02d" % i for i in range(20)]
    for kv_ in got:
        assert ack(a, kv_.key) == 1
    deadline = time.monotonic() + WAIT
    while pending_in_etcd(cluster, name):
        assert time.monotonic() < deadline, "acked messages were not removed"
    consumer.close()


def test_two_consumers_on_two_fronts_share_the_messages(fronts: list[FrontProcess]) -> None:
    a, b = fronts
    name = b"fq-share"
    first, second = Consumer(a, name), Consumer(b, name)
    for i in range(200):
        produce(a, name, b"m%03d" % i, b"%d" % i)
    # prefetch 64 each: 128 handed out, the rest wait for acks
    got_first = first.deliveries(64)
    got_second = second.deliveries(64)
    values = {kv.value for kv in got_first} | {kv.value for kv in got_second}
    assert len(values) == 128  # never one message to both
    for kv_ in got_first + got_second:
        ack(b, kv_.key)
    rest = collect([first, second], 72)  # each ack makes room for one more
    assert values.isdisjoint({kv.value for kv in rest})
    assert values | {kv.value for kv in rest} == {b"%d" % i for i in range(200)}
    first.close()
    second.close()


def test_a_consumer_that_goes_away_gives_its_messages_back(fronts: list[FrontProcess]) -> None:
    a, b = fronts
    name = b"fq-giveback"
    leaving = Consumer(b, name)
    for i in range(5):
        produce(a, name, b"k%d" % i, b"v%d" % i)
    assert len(leaving.deliveries(5)) == 5
    leaving.close()  # no ack: the stream ends
    staying = Consumer(a, name)
    got = staying.deliveries(5)
    assert sorted(kv.value for kv in got) == [b"v%d" % i for i in range(5)]
    staying.close()


def test_when_the_dispatching_front_dies_another_takes_over(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    a, b = fronts
    name = b"fq-takeover"
    on_a = Consumer(a, name)  # a registers first: a dispatches
    produce(a, name, b"before", b"before")
    assert [kv.value for kv in on_a.deliveries(1)] == [b"before"]
    on_b = Consumer(b, name)
    with grpc.insecure_channel(cluster.endpoints[0]) as ch:
        holder = rpc_pb2_grpc.KVStub(ch).Range(rpc_pb2.RangeRequest(key=b"/q/" + name), timeout=5)
    assert holder.kvs, "no front dispatches the queue"
    a.kill()
    killed = time.monotonic()
    for i in range(10):
        produce(b, name, b"after-%d" % i, b"after-%d" % i)
    got = on_b.deliveries(11, timeout=WAIT)  # the 10, and "before" given back by a's death
    took = time.monotonic() - killed
    assert sorted(kv.value for kv in got) == sorted(
        [b"before"] + [b"after-%d" % i for i in range(10)]
    )
    assert took < WAIT
    for kv_ in got:
        assert ack(b, kv_.key) == 1
    on_a.close()
    on_b.close()


def test_when_a_consumers_front_dies_its_messages_go_to_a_consumer_elsewhere(
    fronts: list[FrontProcess],
) -> None:
    a, b = fronts
    name = b"fq-consumer-front"
    on_a = Consumer(a, name)  # a dispatches
    on_b = Consumer(b, name)
    for i in range(10):
        produce(a, name, b"k%d" % i, b"v%d" % i)
    got = collect([on_a, on_b], 10)
    held_by_b = [kv for kv in got if kv.key.startswith(on_b.registration + b"/")]
    assert held_by_b, "round-robin gave the consumer on b nothing"
    for kv_ in got:
        if not kv_.key.startswith(on_b.registration + b"/"):
            assert ack(a, kv_.key) == 1
    b.kill()  # its session lease expires in 3 s, and its consumer's registration with it
    again = on_a.deliveries(len(held_by_b), timeout=WAIT)
    assert sorted(kv.value for kv in again) == sorted(kv.value for kv in held_by_b)
    for kv_ in again:
        assert ack(a, kv_.key) == 1
    on_a.close()
