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
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from queue_server.front.session import SESSION_TTL
from queue_server.keyspace import grammar
from tests.integration.test_queue import WatchStream, consumer_key, new_id
from tests.integration.test_watch import WatchCall
from tests.support.processes import EtcdCluster, EtcdProcess, FrontProcess, free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="needs Debian's etcd-server"),
]

WAIT = 15.0
"""Bounds every wait (a takeover takes well under a second: front/liveness.py)."""


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
    # sooner than a's session lease could expire (2 s): b saw a's port close
    # and revoked that lease itself (front/liveness.py)
    assert took < SESSION_TTL, f"takeover took {took:.2f}s"
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
    b.kill()  # a, dispatching, sees b's port close and revokes b's session lease
    killed = time.monotonic()
    again = on_a.deliveries(len(held_by_b), timeout=WAIT)
    took = time.monotonic() - killed
    assert took < SESSION_TTL, f"the give-back took {took:.2f}s"
    assert sorted(kv.value for kv in again) == sorted(kv.value for kv in held_by_b)
    for kv_ in again:
        assert ack(a, kv_.key) == 1
    on_a.close()


# -- settings, ack deadlines, delivery counts, dead letters, refusals -----------------


def configure(front: FrontProcess, name: bytes, settings: bytes) -> None:
    kv(front).Put(rpc_pb2.PutRequest(key=b"/q/%s/config" % name, value=settings), timeout=WAIT)


def message_version(cluster: EtcdCluster, name: bytes, key: bytes) -> int:
    """The etcd version of the queue's message key ending in `/key` (0: none)."""
    with grpc.insecure_channel(cluster.endpoints[2]) as ch:
        reply = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=b"/q/%s/0" % name, range_end=b"/q/%s/:" % name),
            timeout=WAIT,
        )
    found = [kv.version for kv in reply.kvs if kv.key.endswith(b"/" + key)]
    return int(found[0]) if found else 0


def lease_stub(front: FrontProcess) -> rpc_pb2_grpc.LeaseStub:
    return rpc_pb2_grpc.LeaseStub(grpc.insecure_channel(front.endpoint))


def dead_letters(cluster: EtcdCluster, name: bytes) -> list[kv_pb2.KeyValue]:
    """The message keys of `{name}.dead`, once its dispatcher has moved them."""
    with grpc.insecure_channel(cluster.endpoints[0]) as ch:
        reply = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=b"/q/%s.dead/0" % name, range_end=b"/q/%s.dead/:" % name),
            timeout=WAIT,
        )
    return list(reply.kvs)


def wait_for_dead_letters(cluster: EtcdCluster, name: bytes, n: int) -> list[kv_pb2.KeyValue]:
    deadline = time.monotonic() + WAIT
    while len(found := dead_letters(cluster, name)) < n:
        assert time.monotonic() < deadline, f"{len(found)} of {n} dead letters within {WAIT}s"
        time.sleep(0.05)  # polling etcd itself: there is no event to await
    return found


def test_a_queues_prefetch_setting_is_read_from_its_config(fronts: list[FrontProcess]) -> None:
    a, b = fronts
    name = b"fq-prefetch"
    configure(a, name, b'{"prefetch": 2}')
    consumer = Consumer(b, name)
    for i in range(5):
        produce(a, name, b"k%d" % i, b"v%d" % i)
    first = consumer.deliveries(2)
    with pytest.raises(AssertionError):
        consumer.deliveries(1, timeout=1.0)  # full at 2: the third waits for an ack
    assert ack(a, first[0].key) == 1
    assert [kv.value for kv in consumer.deliveries(1)] == [b"v2"]
    consumer.close()


def test_an_unacknowledged_delivery_comes_back_after_its_ack_deadline(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    a, b = fronts
    name = b"fq-deadline"
    configure(a, name, b'{"ack_deadline": "2s"}')
    consumer = Consumer(b, name)
    produce(a, name, b"slow", b"slow work")
    (first,) = consumer.deliveries(1)
    assert first.lease, "a delivery under a deadline carries its lease"
    granted = lease_stub(a).LeaseTimeToLive(
        rpc_pb2.LeaseTimeToLiveRequest(ID=first.lease, keys=True), timeout=WAIT
    )
    assert 2 <= granted.grantedTTL <= 4, granted
    assert first.key in granted.keys
    started = time.monotonic()
    (again,) = consumer.deliveries(1)  # no ack: taken back, and handed out again
    assert time.monotonic() - started >= 1.5
    assert again.key == first.key and again.value == b"slow work"
    assert again.lease != first.lease
    assert message_version(cluster, name, b"slow") == 2  # one failed delivery counted
    assert ack(a, again.key) == 1
    consumer.close()


def test_lease_keepalive_on_a_delivery_holds_it_past_the_deadline(
    fronts: list[FrontProcess],
) -> None:
    a, b = fronts
    name = b"fq-keepalive"
    configure(a, name, b'{"ack_deadline": "2s"}')
    consumer = Consumer(b, name)
    produce(a, name, b"long", b"long work")
    (held,) = consumer.deliveries(1)
    leases = lease_stub(a)

    def keepalives() -> Iterator[rpc_pb2.LeaseKeepAliveRequest]:
        for _ in range(12):  # 6 s of keepalives, three deadlines' worth
            yield rpc_pb2.LeaseKeepAliveRequest(ID=held.lease)
            time.sleep(0.5)

    answers = list(leases.LeaseKeepAlive(keepalives(), timeout=WAIT))
    assert len(answers) == 12 and all(r.TTL > 0 for r in answers), answers
    assert consumer.stream.responses.empty(), "redelivered while kept alive"
    assert ack(a, held.key) == 1
    consumer.close()


def test_revoked_deliveries_are_counted_and_dead_lettered_at_max_deliveries(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    a, b = fronts
    name = b"fq-dead"
    configure(a, name, b'{"max_deliveries": 2}')
    consumer = Consumer(b, name)
    produce(a, name, b"poison", b"poison pill")
    (first,) = consumer.deliveries(1)
    leases = lease_stub(b)
    leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=first.lease), timeout=WAIT)  # a nack
    (second,) = consumer.deliveries(1)
    assert second.key == first.key
    leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=second.lease), timeout=WAIT)
    (dead,) = wait_for_dead_letters(cluster, name, 1)
    assert dead.key.endswith(b"/poison") and dead.value == b"poison pill"
    assert pending_in_etcd(cluster, name) == 0
    with pytest.raises(AssertionError):
        consumer.deliveries(1, timeout=1.0)  # dead: not handed out again
    # docs/queue.md's redrive, through a front: the dead letter is queued again,
    # with a fresh count
    redrive = rpc_pb2.TxnRequest(
        compare=[
            rpc_pb2.Compare(
                key=dead.key,
                target=rpc_pb2.Compare.CREATE,
                result=rpc_pb2.Compare.EQUAL,
                create_revision=dead.create_revision,
            )
        ],
        success=[
            rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=dead.key)),
            rpc_pb2.RequestOp(
                request_put=rpc_pb2.PutRequest(key=b"/q/fq-dead/p/poison", value=dead.value)
            ),
        ],
    )
    assert kv(a).Txn(redrive, timeout=WAIT).succeeded
    (back,) = consumer.deliveries(1)
    assert back.value == b"poison pill" and back.key.endswith(b"/poison")
    assert message_version(cluster, name, b"poison") == 1
    assert not kv(b).Txn(redrive, timeout=WAIT).succeeded  # a retried redrive does nothing
    assert ack(b, back.key) == 1
    consumer.close()


def test_a_consumer_that_goes_away_counts_a_failed_delivery(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    a, b = fronts
    name = b"fq-gone-dead"
    configure(a, name, b'{"max_deliveries": 1, "dead_letter": "fq-graveyard"}')
    leaving = Consumer(b, name)
    produce(a, name, b"k", b"v")
    assert len(leaving.deliveries(1)) == 1
    leaving.close()
    deadline = time.monotonic() + WAIT
    with grpc.insecure_channel(cluster.endpoints[0]) as ch:
        stub = rpc_pb2_grpc.KVStub(ch)
        while True:
            found = stub.Range(
                rpc_pb2.RangeRequest(key=b"/q/fq-graveyard/0", range_end=b"/q/fq-graveyard/:"),
                timeout=WAIT,
            ).kvs
            if found:
                break
            assert time.monotonic() < deadline, "no dead letter in the named queue"
            time.sleep(0.05)  # polling etcd itself: there is no event to await
    assert [kv.value for kv in found] == [b"v"]


def test_a_front_refuses_malformed_queue_keys_and_configs(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    a, _ = fronts
    stub = kv(a)
    refused = [
        (rpc_pb2.PutRequest(key=b"/q//p/k", value=b"x"), "empty queue name"),
        (rpc_pb2.PutRequest(key=b"/q/fq-bad/producer/k"), '"producer" is the /queue/ spelling'),
        (
            rpc_pb2.PutRequest(key=b"/q/fq-bad/config", value=b'{"prefetch": "16"}'),
            '"prefetch": "16" is not an integer',
        ),
        (
            rpc_pb2.PutRequest(key=b"/q/fq-bad/config", value=b'{"prefetc": 16}'),
            'unknown field "prefetc"',
        ),
    ]
    for request, why in refused:
        with pytest.raises(grpc.RpcError) as e:
            stub.Put(request, timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert why in (e.value.details() or ""), e.value.details()
    txn = rpc_pb2.TxnRequest(
        success=[
            rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"fq-bad-ordinary", value=b"1")),
            rpc_pb2.RequestOp(
                request_put=rpc_pb2.PutRequest(
                    key=b"/q/fq-bad/config", value=b'{"ack_deadline": -1}'
                )
            ),
        ]
    )
    with pytest.raises(grpc.RpcError) as e:
        stub.Txn(txn, timeout=WAIT)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert '"ack_deadline": -1 is negative' in (e.value.details() or "")
    with grpc.insecure_channel(cluster.endpoints[0]) as ch:
        written = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=b"/q/", range_end=b"/q0", keys_only=True), timeout=WAIT
        )
        ordinary = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=b"fq-bad-ordinary"), timeout=WAIT
        )
    assert not [kv.key for kv in written.kvs if b"fq-bad" in kv.key or kv.key.startswith(b"/q//")]
    assert not ordinary.kvs, "a refused Txn wrote nothing"
    # a valid config goes through; an etcd refusal stays etcd's
    stub.Put(rpc_pb2.PutRequest(key=b"/q/fq-bad/config", value=b'{"prefetch": 16}'), timeout=WAIT)
    with pytest.raises(grpc.RpcError) as e:
        stub.Put(rpc_pb2.PutRequest(key=b"", value=b"x"), timeout=WAIT)
    assert e.value.details() == "etcdserver: key is not provided"
    # a consumer watch of a broken shape: created and canceled, with the reason
    with grpc.insecure_channel(a.endpoint) as ch:
        stream = WatchStream(ch)
        answer = stream.create(b"/q/fq-bad/c/not-a-uuid")
        assert answer.created and answer.canceled and answer.watch_id == -1
        assert 'consumer id "not-a-uuid" is not a UUID' in answer.cancel_reason
        # the stream goes on: an ordinary watch on it is created
        assert stream.watch(b"fq-bad-ordinary") >= 0
        stream.close()


def test_a_produce_into_a_full_queue_is_refused_until_an_ack_makes_room(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    a, b = fronts
    name = b"fq-depth"
    configure(a, name, b'{"max_depth": 3}')
    for i in range(3):
        produce(a, name, b"k%d" % i, b"v%d" % i)
    for front in (a, b):  # either front counts what is in etcd
        with pytest.raises(grpc.RpcError) as e:
            produce(front, name, b"k3", b"v3")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details() == "etcdserver: queue fq-depth is full (max_depth 3)"
    two = rpc_pb2.TxnRequest(
        success=[
            rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"/q/fq-depth/p/t%d" % i))
            for i in range(2)
        ]
    )
    with pytest.raises(grpc.RpcError) as e:
        kv(a).Txn(two, timeout=WAIT)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    consumer = Consumer(b, name)
    got = consumer.deliveries(3)
    assert pending_in_etcd(cluster, name) == 3, "a refused produce wrote nothing"
    assert ack(a, got[0].key) == 1
    deadline = time.monotonic() + WAIT
    while pending_in_etcd(cluster, name) > 2:
        assert time.monotonic() < deadline, "the ack did not remove the message"
    produce(a, name, b"k3", b"v3")  # room again
    assert [kv.value for kv in consumer.deliveries(1)] == [b"v3"]
    consumer.close()


# -- failures under load -------------------------------------------------------------


class Ledger:
    """What the chaos test's producer and consumers saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.produced: set[bytes] = set()
        """Message keys whose produce etcd acknowledged."""
        self.received: set[bytes] = set()
        self.acked: set[bytes] = set()
        self.holding: dict[bytes, str] = {}
        """`{idx}/{key}` -> the consumer holding that message (received, not
        acked, stream alive)."""
        self.violations: list[str] = []


class ChaosConsumer:
    """A consumer that acks what it receives and watches again, as a new
    consumer, whenever its stream ends, until told to stop."""

    def __init__(self, front: FrontProcess, name: bytes, label: str, ledger: Ledger) -> None:
        self.front, self.name, self.label, self.ledger = front, name, label, ledger
        self.stopping = threading.Event()
        self.registered = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        while not self.stopping.is_set() and time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                self._one_stream()
            self._release()  # the stream ended: the front gives back what it held
            self.stopping.wait(0.2)

    def _one_stream(self) -> None:
        with grpc.insecure_channel(self.front.endpoint) as ch:
            requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
            create = rpc_pb2.WatchCreateRequest(key=consumer_key(self.name, new_id()))
            requests.put(rpc_pb2.WatchRequest(create_request=create))
            call = rpc_pb2_grpc.WatchStub(ch).Watch(iter(requests.get, None), timeout=120)
            stub = rpc_pb2_grpc.KVStub(ch)
            try:
                for response in call:
                    if response.created and not response.canceled:
                        self.registered.set()
                    if response.canceled or self.stopping.is_set():
                        return
                    for event in response.events:
                        self._received(stub, event.kv)
            finally:
                requests.put(None)
                call.cancel()

    def _received(self, stub: rpc_pb2_grpc.KVStub, delivery: kv_pb2.KeyValue) -> None:
        # a message is its idx: a produce retried after an unanswered try (the
        # leader died under it) may have been written twice, as two messages
        # of one key, and each may be held by its own consumer
        _, idx, message = delivery.key.rsplit(b"/", 2)
        held = idx + b"/" + message
        ledger = self.ledger
        with ledger.lock:
            other = ledger.holding.get(held)
            if other is not None and other != self.label:
                ledger.violations.append(f"{held!r} held by {other} and {self.label}")
            ledger.holding[held] = self.label
            ledger.received.add(message)
        for attempt in range(10):  # etcd may be choosing a leader: retry, bounded
            try:
                deleted = stub.DeleteRange(
                    rpc_pb2.DeleteRangeRequest(key=delivery.key), timeout=5
                ).deleted
            except grpc.RpcError:
                time.sleep(0.3)
                continue
            with ledger.lock:
                if ledger.holding.get(held) == self.label:
                    del ledger.holding[held]
                if deleted or attempt:  # a retry finds it gone: the failed try deleted it
                    ledger.acked.add(message)
            return

    def _release(self) -> None:
        with self.ledger.lock:
            for message in [m for m, who in self.ledger.holding.items() if who == self.label]:
                del self.ledger.holding[message]

    def stop(self) -> None:
        self.stopping.set()
        self._release()


def test_nothing_acknowledged_is_lost_when_etcds_leader_and_the_dispatching_front_die(
    cluster: EtcdCluster, fronts: list[FrontProcess], tmp_path: Path
) -> None:
    a, b = fronts
    producer_front = FrontProcess(tmp_path / "front3.etcd", cluster.endpoints).start()
    name, count = b"fq-chaos", 300
    ledger = Ledger()
    on_a = ChaosConsumer(a, name, "on-a", ledger)
    assert on_a.registered.wait(WAIT)  # a registers first: a dispatches
    on_b = ChaosConsumer(b, name, "on-b", ledger)
    assert on_b.registered.wait(WAIT)

    def produce_all() -> None:
        stub = kv(producer_front)
        for i in range(count):
            key = b"m%03d" % i
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    stub.Put(rpc_pb2.PutRequest(key=b"/q/%s/p/%s" % (name, key)), timeout=5)
                except grpc.RpcError:
                    time.sleep(0.2)
                    continue
                with ledger.lock:
                    ledger.produced.add(key)
                break

    def produced_at_least(n: int) -> None:
        deadline = time.monotonic() + 60
        while len(ledger.produced) < n:
            assert time.monotonic() < deadline, f"{len(ledger.produced)} of {n} produced"
            time.sleep(0.02)  # the producer thread's progress: nothing to await

    producer = threading.Thread(target=produce_all, daemon=True)
    producer.start()
    leader = cluster.leader()
    try:
        produced_at_least(80)
        cluster.kill(leader)  # SIGKILL etcd's leader mid-stream
        produced_at_least(160)
        cluster.restart(leader)
        produced_at_least(220)
        on_a.stop()
        a.kill()  # the dispatching front, and a consumer's front, mid-stream
        producer.join(90)
        assert not producer.is_alive()
        assert ledger.produced == {b"m%03d" % i for i in range(count)}
        deadline = time.monotonic() + 60
        while not ledger.produced <= ledger.acked:
            missing = len(ledger.produced - ledger.acked)
            assert time.monotonic() < deadline, f"{missing} acknowledged produces never acked"
            time.sleep(0.05)  # the consumers' progress: nothing to await
        # every acknowledged produce was delivered, and nothing of the queue is
        # left in etcd: no message was lost, none is stuck
        assert ledger.produced <= ledger.received
        while pending_in_etcd(cluster, name):
            assert time.monotonic() < deadline, "acked messages left in etcd"
            time.sleep(0.05)  # the dispatcher's deletes: nothing to await
    finally:
        on_a.stop()
        on_b.stop()
        producer_front.stop()
        member = cluster.members[leader]
        if member.proc is None or member.proc.poll() is not None:
            cluster.restart(leader)
    assert ledger.violations == []


def test_a_front_whose_session_lease_expired_registers_its_consumers_again(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    a, b = fronts
    name = b"fq-session"
    consumer = Consumer(b, name)
    produce(a, name, b"first", b"first")
    (held,) = consumer.deliveries(1)
    with grpc.insecure_channel(cluster.endpoints[0]) as ch:
        stub = rpc_pb2_grpc.KVStub(ch)
        (reg,) = stub.Range(rpc_pb2.RangeRequest(key=consumer.registration), timeout=WAIT).kvs
        # what etcd does when it has not heard from a front for its session's
        # TTL: the lease ends, and the registration with it
        rpc_pb2_grpc.LeaseStub(ch).LeaseRevoke(
            rpc_pb2.LeaseRevokeRequest(ID=reg.lease), timeout=WAIT
        )
        deadline = time.monotonic() + WAIT
        while True:  # the front registers its consumer again, on a new session lease
            now = stub.Range(rpc_pb2.RangeRequest(key=consumer.registration), timeout=WAIT).kvs
            if now and now[0].lease != reg.lease:
                break
            assert time.monotonic() < deadline, "the consumer was not registered again"
            time.sleep(0.05)  # polling etcd itself: there is no event to await
    produce(a, name, b"second", b"second")
    # the watch goes on: "second" arrives, and "first" is either still held (its
    # delivery key acks it) or was given back and is handed out again
    got = consumer.deliveries(1)
    if got[0].value == b"first":
        got += consumer.deliveries(1)
    else:
        assert ack(a, held.key) == 1
    assert got[-1].value == b"second"
    for kv_ in got:
        assert ack(a, kv_.key) == 1
    deadline = time.monotonic() + WAIT
    while pending_in_etcd(cluster, name):
        assert time.monotonic() < deadline, "acked messages were not removed"
    consumer.close()


# -- figures -------------------------------------------------------------------------


def scrape(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=WAIT) as answer:
        return str(answer.read().decode())


def test_every_front_shows_the_queues_figures_and_which_front_dispatches(
    cluster: EtcdCluster, fronts: list[FrontProcess], tmp_path: Path
) -> None:
    a, b = fronts
    name = b"fq-figures"
    metrics_port = free_port()
    watcher = FrontProcess(  # serves no client of the queue: it reads the figures from etcd
        tmp_path / "front3.etcd",
        cluster.endpoints,
        ["--listen-metrics-urls", f"http://127.0.0.1:{metrics_port}"],
    ).start()
    try:
        consumer = Consumer(b, name)  # b dispatches
        for i in range(5):
            produce(a, name, b"k%d" % i, b"v%d" % i)
        got = consumer.deliveries(5)
        for kv_ in got[:2]:
            assert ack(a, kv_.key) == 1
        wanted = [
            'queue_server_queue_depth{queue="fq-figures"} 3.0',
            'queue_server_queue_in_flight{queue="fq-figures"} 3.0',
            'queue_server_queue_consumers{queue="fq-figures"} 1.0',
            'queue_server_queue_produced_total{queue="fq-figures"} 5.0',
            'queue_server_queue_acked_total{queue="fq-figures"} 2.0',
        ]
        deadline = time.monotonic() + WAIT
        while True:
            text = scrape(metrics_port, "/metrics")
            if all(line in text for line in wanted):
                break
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.2)  # the figures are written once a second: nothing to await
        dispatching = [
            line
            for line in text.splitlines()
            if line.startswith("queue_server_queue_dispatcher{") and '"fq-figures"' in line
        ]
        assert len(dispatching) == 1 and 'queue="fq-figures"' in dispatching[0]
        assert f":{b.port}" in dispatching[0], dispatching  # b's id carries b's client port
        state = json.loads(scrape(metrics_port, "/api/state"))
        (row,) = [q for q in state["queues"] if q["name"] == "fq-figures"]
        assert row["depth"] == 3 and row["acked"] == 2
        assert [c["holding"] for c in row["consumers"]] == [3]
        consumer.close()
    finally:
        watcher.stop()


def test_a_produce_and_an_ack_on_fronts_are_written_by_the_dispatcher_in_its_own_txns(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    """front/direct.py: with a dispatcher running, a produce through either front
    becomes its message key in the produce's own revision (no producer key
    ever reaches etcd), and an ack deletes the delivery and the message key in one."""
    a, b = fronts
    name = b"fq-direct"
    consumer = Consumer(a, name)  # a dispatches
    first = kv(b).Put(rpc_pb2.PutRequest(key=b"/q/%s/p/k0" % name, value=b"v0"), timeout=WAIT)
    [delivery] = consumer.deliveries(1)
    with grpc.insecure_channel(cluster.endpoints[0]) as ch:
        stub = rpc_pb2_grpc.KVStub(ch)
        stored = stub.Range(
            rpc_pb2.RangeRequest(key=b"/q/%s/" % name, range_end=b"/q/%s0" % name), timeout=WAIT
        )
        messages = [kv_ for kv_ in stored.kvs if grammar_kind(kv_.key) == "message"]
        assert [m.mod_revision for m in messages] == [first.header.revision]
        assert not [kv_ for kv_ in stored.kvs if grammar_kind(kv_.key) == "produce"]
        assert ack(b, delivery.key) == 1
        assert ack(b, delivery.key) == 0  # gone: etcd's own answer
        assert pending_in_etcd(cluster, name) == 0
    consumer.close()


def bytes_queued_at(port: int) -> int:
    """Bytes received and not yet read by the sockets of established TCP
    connections whose local port is `port` (/proc/net/tcp's rx_queue)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if state == "01" and int(local.rpartition(":")[2], 16) == port:
            total += int(queues.partition(":")[2], 16)
    return total


def test_an_ack_in_flight_when_the_dispatching_front_dies_is_written_through_etcd(
    cluster: EtcdCluster, fronts: list[FrontProcess]
) -> None:
    """front/direct.py: an ack that b handed to the dispatching front a, which
    died before answering, may or may not have been written; b writes it to
    etcd itself as the dispatcher's ack Txn (a second one deletes nothing), so
    the client's ack succeeds, where a produce in that state fails UNAVAILABLE."""
    a, b = fronts
    name = b"fq-direct-ack-dies"
    on_a = Consumer(a, name)  # a dispatches
    on_b = Consumer(b, name)
    for i in range(6):  # through b: b's connection to a is open from here on
        produce(b, name, b"k%d" % i, b"v%d" % i)
    got = collect([on_a, on_b], 6)
    held_by_b = [kv_ for kv_ in got if kv_.key.startswith(on_b.registration + b"/")]
    assert held_by_b, "round-robin gave the consumer on b nothing"
    for kv_ in got:
        if kv_ not in held_by_b:
            assert ack(b, kv_.key) == 1
    assert a.proc is not None
    port = int(a.endpoint.rpartition(":")[2])
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        queued = bytes_queued_at(port)
        acked: queue.Queue[int | grpc.RpcError] = queue.Queue()

        def send_ack() -> None:
            try:
                acked.put(ack(b, held_by_b[0].key))
            except grpc.RpcError as e:
                acked.put(e)

        threading.Thread(target=send_ack, daemon=True).start()
        deadline = time.monotonic() + WAIT
        # the ack's HEADERS and DATA frames (its key alone is over 60 bytes)
        # wait in a's socket: a has it and will never answer
        while bytes_queued_at(port) < queued + 60:
            assert time.monotonic() < deadline, "b did not hand the ack to a"
            time.sleep(0.01)
    finally:
        a.kill()
    answer = acked.get(timeout=WAIT)
    assert answer == 1, f"the ack failed: {answer}"
    for kv_ in held_by_b[1:]:
        assert ack(b, kv_.key) == 1
    deadline = time.monotonic() + WAIT
    while pending_in_etcd(cluster, name):  # b took over and saw the ack's delete
        assert time.monotonic() < deadline, "the acked message is still in etcd"
        time.sleep(0.05)
    produce(b, name, b"after", b"after")
    assert [kv_.value for kv_ in on_b.deliveries(1)] == [b"after"]
    on_a.close()
    on_b.close()


def grammar_kind(key: bytes) -> str:
    parsed = grammar.parse(key)
    return parsed.kind if parsed is not None else ""


def test_a_produce_forwarded_to_etcd_is_not_overtaken_by_a_direct_one_after_it(
    fronts: list[FrontProcess],
) -> None:
    """A produce with a lease goes to etcd as a producer key (front/direct.py);
    the plain produce sent after it on the same front waits for the dispatcher
    to have moved it, so the consumer receives them in the order they were made."""
    a, b = fronts
    name = b"fq-direct-order"
    consumer = Consumer(a, name)  # a dispatches; the produces come in on b
    lease = lease_stub(b).LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=60), timeout=WAIT).ID
    for i in range(5):
        kv(b).Put(
            rpc_pb2.PutRequest(key=b"/q/%s/p/l%d" % (name, i), value=b"%d" % (2 * i), lease=lease),
            timeout=WAIT,
        )
        produce(b, name, b"d%d" % i, b"%d" % (2 * i + 1))
    got = consumer.deliveries(10)
    assert [int(kv_.value) for kv_ in got] == list(range(10))
    for kv_ in got:
        assert ack(b, kv_.key) == 1
    consumer.close()


def test_an_ack_under_backend_auth_deletes_the_delivery_and_its_message_in_one_revision(
    tmp_path: Path,
) -> None:
    """front/direct.py: with auth on in etcd, an ack through a front is the ack
    Txn sent with the caller's token, so the message key goes in the ack's own
    revision, not later when the dispatcher sees the delivery's delete (a
    dispatcher rebuilt in between would deliver the message again)."""
    backend = EtcdProcess(tmp_path / "auth.etcd").start()
    front = FrontProcess(
        tmp_path / "front.etcd", [backend.endpoint], ["--backend-user", "root:rootpw"]
    )
    ctl = ["etcdctl", f"--endpoints={front.endpoint}", "--command-timeout=5s"]
    closed = threading.Event()
    try:
        front.start()
        for step in (("user", "add", "root:rootpw"), ("auth", "enable")):
            done = subprocess.run([*ctl, *step], capture_output=True, text=True, timeout=WAIT)
            assert done.returncode == 0, done.stderr
        with grpc.insecure_channel(front.endpoint) as ch:
            login = rpc_pb2.AuthenticateRequest(name="root", password="rootpw")
            token = (("token", rpc_pb2_grpc.AuthStub(ch).Authenticate(login, timeout=WAIT).token),)
            stub = rpc_pb2_grpc.KVStub(ch)
            name = b"fq-auth-ack"

            def requests() -> Iterator[rpc_pb2.WatchRequest]:
                yield rpc_pb2.WatchRequest(
                    create_request=rpc_pb2.WatchCreateRequest(key=consumer_key(name, new_id()))
                )
                closed.wait(WAIT)  # the stream stays open until the test is done

            def consume(
                key: bytes, metadata: tuple[tuple[str, str], ...]
            ) -> tuple[WatchCall, bytes, bytes]:
                """A consumer's watch (left open), a produce of `key`, and the delivery
                key and message key it made."""
                responses = rpc_pb2_grpc.WatchStub(ch).Watch(
                    requests(), metadata=metadata, timeout=WAIT
                )
                put = rpc_pb2.PutRequest(key=b"/q/%s/p/%s" % (name, key), value=b"v")
                stub.Put(put, metadata=metadata, timeout=WAIT)
                delivery = next(r for r in responses if r.events).events[0].kv.key  # within WAIT
                parsed = grammar.parse(delivery)
                assert parsed is not None and parsed.kind == "delivery"
                return (
                    responses,
                    delivery,
                    grammar.message_key(parsed.spelling, parsed.name, parsed.idx, parsed.key),
                )

            responses, delivery, message = consume(b"k0", token)
            ack = rpc_pb2.DeleteRangeRequest(key=delivery)
            acked = stub.DeleteRange(ack, metadata=token, timeout=WAIT)
            assert acked.deleted == 1

            def message_count(message: bytes, revision: int) -> int:
                request = rpc_pb2.RangeRequest(key=message, revision=revision, count_only=True)
                return int(stub.Range(request, metadata=token, timeout=WAIT).count)

            at = acked.header.revision
            assert message_count(message, at - 1) == 1 and message_count(message, at) == 0
            assert stub.DeleteRange(ack, metadata=token, timeout=WAIT).deleted == 0
            responses.cancel()

            # a caller who may write its produces and deliveries but not the message
            # keys: the Txn is refused, and the delivery's delete goes as it came
            q = name.decode()
            grants: tuple[tuple[str, ...], ...] = (
                ("role", "add", "consumer"),
                ("role", "grant-permission", "consumer", "readwrite", f"/q/{q}/p/", "--prefix"),
                ("role", "grant-permission", "consumer", "readwrite", f"/q/{q}/c/", "--prefix"),
                ("user", "add", "worker:workerpw"),
                ("user", "grant-role", "worker", "consumer"),
            )
            for grant in grants:
                done = subprocess.run(
                    [*ctl, "--user", "root:rootpw", *grant],
                    capture_output=True,
                    text=True,
                    timeout=WAIT,
                )
                assert done.returncode == 0, done.stderr
            login = rpc_pb2.AuthenticateRequest(name="worker", password="workerpw")
            worker = (("token", rpc_pb2_grpc.AuthStub(ch).Authenticate(login, timeout=WAIT).token),)
            responses, delivery, message = consume(b"k1", worker)
            ack = rpc_pb2.DeleteRangeRequest(key=delivery)
            acked = stub.DeleteRange(ack, metadata=worker, timeout=WAIT)
            assert acked.deleted == 1
            assert message_count(message, acked.header.revision) == 1  # the delete went alone
            responses.cancel()
            deadline = time.monotonic() + WAIT
            everything = rpc_pb2.RangeRequest(
                key=b"/q/%s/0" % name, range_end=b"/q/%s/:" % name, count_only=True
            )
            while stub.Range(everything, metadata=token, timeout=WAIT).count:
                assert time.monotonic() < deadline, "the dispatcher deletes the message"
                time.sleep(0.05)
    finally:
        closed.set()
        front.stop()
        backend.stop()
