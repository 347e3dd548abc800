"""The etcd-key queue (issue 4) through our generated stubs against a real server
process: produce by put, consume by watch, acknowledge by delete; ordering and
fairness, redelivery, durability across SIGKILL, dead letters, depth limits,
transactions, leases, cancel, the registry and the settings key.

Every test uses its own queue name on the module's server. Every wait is bounded:
watch responses are read by a thread into a queue and taken with a timeout, and
"nothing was delivered" is proven with a sentinel message that must come first.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.integration

WAIT = 10.0
"""Seconds any one expected response may take."""
STREAM_SECONDS = 120.0
REPO = Path(__file__).resolve().parents[2]
CONSUMER_SCRIPT = Path(__file__).with_name("queue_consumer.py")
EXAMPLE = REPO / "examples" / "request_reply.py"

PUT, DELETE = kv_pb2.Event.PUT, kv_pb2.Event.DELETE


# -- helpers --------------------------------------------------------------------


class WatchStream:
    """One Watch stream. Requests go in through a queue; a thread reads the
    responses into `responses` (or hands those with events to `on_events`), so a
    test waits for each with a timeout."""

    def __init__(
        self,
        channel: grpc.Channel,
        on_events: Callable[[rpc_pb2.WatchResponse], None] | None = None,
    ) -> None:
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        self.responses: queue.Queue[rpc_pb2.WatchResponse | None] = queue.Queue()
        self._on_events = on_events
        self._call = rpc_pb2_grpc.WatchStub(channel).Watch(self._iter(), timeout=STREAM_SECONDS)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _iter(self) -> Iterator[rpc_pb2.WatchRequest]:
        while (req := self._requests.get()) is not None:
            yield req

    def _read(self) -> None:
        try:
            for resp in self._call:
                if self._on_events is not None and resp.events:
                    self._on_events(resp)
                else:
                    self.responses.put(resp)
        except grpc.RpcError:
            pass
        finally:
            self.responses.put(None)

    def next(self, timeout: float = WAIT) -> rpc_pb2.WatchResponse:
        try:
            resp = self.responses.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no watch response within {timeout}s") from None
        assert resp is not None, "the watch stream ended"
        return resp

    def watch(self, key: bytes, range_end: bytes = b"", start_revision: int = 0) -> int:
        resp = self.create(key, range_end, start_revision)
        assert resp.created and not resp.canceled, resp
        return int(resp.watch_id)

    def create(
        self, key: bytes, range_end: bytes = b"", start_revision: int = 0, watch_id: int = 0
    ) -> rpc_pb2.WatchResponse:
        """Send a watch create; returns its answer (created, or refused)."""
        create = rpc_pb2.WatchCreateRequest(
            key=key, range_end=range_end, start_revision=start_revision, watch_id=watch_id
        )
        self._requests.put(rpc_pb2.WatchRequest(create_request=create))
        return self.next()

    def cancel(self, watch_id: int) -> list[kv_pb2.Event]:
        """Cancel a watch; returns the events that arrived before the cancel answer."""
        cancel = rpc_pb2.WatchCancelRequest(watch_id=watch_id)
        self._requests.put(rpc_pb2.WatchRequest(cancel_request=cancel))
        events: list[kv_pb2.Event] = []
        while True:
            resp = self.next()
            events.extend(resp.events)
            if resp.canceled:
                return events

    def events(self, n: int, timeout: float = WAIT) -> list[kv_pb2.Event]:
        """The next `n` events, from as many responses as they come in."""
        deadline = time.monotonic() + timeout
        events: list[kv_pb2.Event] = []
        while len(events) < n:
            events.extend(self.next(max(0.0, deadline - time.monotonic())).events)
        assert len(events) == n, f"expected {n} events, got {len(events)}"
        return events

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
        self._reader.join(timeout=WAIT)


def new_id() -> bytes:
    return str(uuid.uuid4()).encode()


def consumer_key(name: bytes, consumer: bytes) -> bytes:
    return b"/q/%s/c/%s" % (name, consumer)


def consume(channel: grpc.Channel, name: bytes) -> tuple[WatchStream, bytes, int]:
    """A new consumer of queue `name`: its stream, uuid and watch id."""
    stream = WatchStream(channel)
    consumer = new_id()
    return stream, consumer, stream.watch(consumer_key(name, consumer))


def wait_registered(kv: rpc_pb2_grpc.KVStub, name: bytes) -> None:
    """Until the queue's registry key `/q/{name}` exists (bounded by WAIT)."""
    deadline = time.monotonic() + WAIT
    while not kv.Range(rpc_pb2.RangeRequest(key=b"/q/" + name), timeout=WAIT).kvs:
        assert time.monotonic() < deadline, f"/q/{name.decode()} was never written"
        time.sleep(0.01)  # no event tells a client of this write but a watch of its own


def produce(
    kv: rpc_pb2_grpc.KVStub, name: bytes, key: bytes, value: bytes = b"", lease: int = 0
) -> int:
    """Put on the producer key; returns the revision the message was enqueued at."""
    req = rpc_pb2.PutRequest(key=b"/q/%s/p/%s" % (name, key), value=value or key, lease=lease)
    return int(kv.Put(req, timeout=WAIT).header.revision)


def ack(kv: rpc_pb2_grpc.KVStub, key: bytes) -> int:
    """Delete a delivery key; returns how many keys the delete removed."""
    return int(kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=WAIT).deleted)


def messages(kv: rpc_pb2_grpc.KVStub, name: bytes, spelling: bytes = b"/q/") -> list[Any]:
    """The queue's message keys (pending and in flight), in idx order."""
    base = spelling + name + b"/"
    return list(kv.Range(rpc_pb2.RangeRequest(key=base + b"0", range_end=base + b":")).kvs)


def depth(kv: rpc_pb2_grpc.KVStub, name: bytes) -> int:
    """Range count_only over the message keys: etcdctl's `get --count-only`."""
    base = b"/q/" + name + b"/"
    req = rpc_pb2.RangeRequest(key=base + b"0", range_end=base + b":", count_only=True)
    return int(kv.Range(req, timeout=WAIT).count)


def configure(kv: rpc_pb2_grpc.KVStub, name: bytes, **settings: object) -> None:
    value = json.dumps(settings).encode()
    kv.Put(rpc_pb2.PutRequest(key=b"/q/%s/config" % name, value=value), timeout=WAIT)


def get(kv: rpc_pb2_grpc.KVStub, key: bytes) -> bytes | None:
    kvs = kv.Range(rpc_pb2.RangeRequest(key=key), timeout=WAIT).kvs
    return bytes(kvs[0].value) if kvs else None


def idx_of(key: bytes) -> int:
    """The idx of a message key `/q/{name}/{idx}/{key}`."""
    return int(key.rsplit(b"/", 2)[1])


def suffix_of(key: bytes) -> bytes:
    """The producer's `{key}` segment of a message key."""
    return key.rsplit(b"/", 1)[1]


def put_op(key: bytes, value: bytes) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value))


def delete_op(key: bytes) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))


def prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def await_deleted(channel: grpc.Channel, key: bytes) -> None:
    """Return once `key` does not exist: now, or after a DELETE seen by a watch
    that starts right after the revision it was read at."""
    kv = rpc_pb2_grpc.KVStub(channel)
    resp = kv.Range(rpc_pb2.RangeRequest(key=key), timeout=WAIT)
    if not resp.kvs:
        return
    # the keys beside `key` (a range on a consumer key itself is refused)
    parent = key[: key.rindex(b"/") + 1]
    stream = WatchStream(channel)
    try:
        stream.watch(parent, prefix_end(parent), start_revision=resp.header.revision + 1)
        deadline = time.monotonic() + WAIT
        seen: list[tuple[int, bytes]] = []
        while (DELETE, key) not in seen:
            events = stream.next(max(0.0, deadline - time.monotonic())).events
            seen.extend((e.type, e.kv.key) for e in events)
    finally:
        stream.close()


@pytest.fixture(scope="module")
def kv(channel: grpc.Channel) -> rpc_pb2_grpc.KVStub:
    return rpc_pb2_grpc.KVStub(channel)


# -- the seed's contract ----------------------------------------------------------


def test_happy_path_produce_consume_ack(channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub) -> None:
    name = b"happy"
    observer = WatchStream(channel)
    observer.watch(b"/q/happy/", prefix_end(b"/q/happy/"))
    stream, consumer, _ = consume(channel, name)
    try:
        assert observer.events(1)[0].kv.key == consumer_key(name, consumer)  # the registry
        rev = produce(kv, name, b"job-1", b"payload")

        (delivery,) = stream.events(1)
        assert delivery.type == PUT
        assert delivery.kv.key == b"/q/happy/0000000000000001/job-1"  # the queue's first idx
        assert delivery.kv.value == b"payload"
        # a real key with real revisions, the one the producer's put was applied at
        assert (delivery.kv.create_revision, delivery.kv.mod_revision) == (rev, rev)
        assert delivery.kv.version == 1
        # visible to a plain get while in flight, and counted in the depth
        assert [m.key for m in messages(kv, name)] == [delivery.kv.key]
        assert depth(kv, name) == 1

        assert ack(kv, delivery.kv.key) == 1
        assert depth(kv, name) == 0
        assert get(kv, delivery.kv.key) is None

        # a prefix watch on the queue sees the enqueue and the ack as put and delete
        enqueued, acked = observer.events(2)
        assert (enqueued.type, enqueued.kv.key, enqueued.kv.mod_revision) == (
            PUT,
            delivery.kv.key,
            rev,
        )
        assert (acked.type, acked.kv.key) == (DELETE, delivery.kv.key)
    finally:
        stream.close()
        observer.close()


def test_messages_wait_for_a_consumer_and_share_one_response(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """Messages put before any consumer wait; the first consumer gets them oldest
    first, several in one WatchResponse; a Txn producing several hands them out
    together too."""
    name = b"batch"
    for i in range(5):
        produce(kv, name, b"m%d" % i)
    assert depth(kv, name) == 5
    stream, _, _ = consume(channel, name)
    try:
        first = stream.next()
        assert [suffix_of(e.kv.key) for e in first.events] == [b"m%d" % i for i in range(5)]
        idxs = [idx_of(e.kv.key) for e in first.events]
        assert idxs == sorted(idxs) and len(set(idxs)) == 5
        assert all(e.type == PUT for e in first.events)

        txn = rpc_pb2.TxnRequest(success=[put_op(b"/q/batch/p/t%d" % i, b"t") for i in range(3)])
        rev = kv.Txn(txn, timeout=WAIT).header.revision
        together = stream.next()
        assert [suffix_of(e.kv.key) for e in together.events] == [b"t0", b"t1", b"t2"]
        assert {e.kv.mod_revision for e in together.events} == {rev}
    finally:
        stream.close()


def test_large_messages_fit_a_default_client(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """Deliveries waiting together are split over several WatchResponses when
    they are large, so a client with gRPC's default 4 MiB receive limit gets them
    (one response with all four would break its stream, give them back, and come
    again the same way)."""
    name = b"large"
    value = b"x" * (1200 * 1024)  # under the 1.5 MiB request limit
    for i in range(4):
        produce(kv, name, b"m%d" % i, value)
    stream, _, _ = consume(channel, name)  # a channel with gRPC's defaults
    try:
        got = stream.events(4)
        assert [suffix_of(e.kv.key) for e in got] == [b"m0", b"m1", b"m2", b"m3"]
        assert all(e.kv.value == value for e in got)
        for e in got:
            assert ack(kv, e.kv.key) == 1
    finally:
        stream.close()


def test_slash_queue_spelling_is_the_same_queue(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """`/queue/{name}/producer/` and `/q/{name}/p/` feed one queue, whose keys keep
    the spelling it was first used with; either consumer spelling receives them."""
    kv.Put(rpc_pb2.PutRequest(key=b"/queue/spell/producer/long", value=b"1"), timeout=WAIT)
    produce(kv, b"spell", b"short", b"2")
    keys = [m.key for m in messages(kv, b"spell", b"/queue/")]
    assert [suffix_of(k) for k in keys] == [b"long", b"short"]
    assert all(k.startswith(b"/queue/spell/") for k in keys)
    assert idx_of(keys[1]) == idx_of(keys[0]) + 1  # one idx sequence
    assert messages(kv, b"spell", b"/q/") == []

    long_consumer = new_id()
    stream = WatchStream(channel)
    try:
        stream.watch(b"/queue/spell/consumer/" + long_consumer)
        assert [e.kv.key for e in stream.events(2)] == keys
        for k in keys:
            assert ack(kv, k) == 1
        # the registry keys are spelled the queue's way
        assert get(kv, b"/queue/spell") is not None
        assert get(kv, b"/queue/spell/consumer/" + long_consumer) is not None
        assert get(kv, b"/q/spell") is None
    finally:
        stream.close()
    # a consumer spelled /q/ is a consumer of the same queue
    short, _, _ = consume(channel, b"spell")
    try:
        kv.Put(rpc_pb2.PutRequest(key=b"/queue/spell/producer/third", value=b"3"), timeout=WAIT)
        (third,) = short.events(1)
        assert third.kv.key.startswith(b"/queue/spell/") and suffix_of(third.kv.key) == b"third"
        assert ack(kv, third.kv.key) == 1
    finally:
        short.close()


def test_producer_key_is_one_segment(kv: rpc_pb2_grpc.KVStub) -> None:
    """Anything after a further "/" in a producer key is dropped; the producer key
    itself is never written."""
    produce(kv, b"segments", b"a/extra/parts", b"v")
    (msg,) = messages(kv, b"segments")
    assert msg.key == b"/q/segments/0000000000000001/a"
    assert msg.value == b"v"
    assert get(kv, b"/q/segments/p/a/extra/parts") is None
    assert get(kv, b"/q/segments/p/a") is None
    assert ack(kv, msg.key) == 1


def test_registry_keys_and_range_watches_get_no_deliveries(
    server: ServerProcess, channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """The server maintains `/q/{name}` and `/q/{name}/c/{uuid}` (value: its node
    name); a range watch over a queue's consumer keys is an ordinary watch: it
    sees those registry writes, never a delivery. A range watch starting at one
    consumer key is refused (issue 17: it used to consume nothing, silently)."""
    name = b"registry"
    node = server.data_dir.name.encode()
    consumer = new_id()
    ckey = consumer_key(name, consumer)
    marker = ckey + b"/marker"  # an ordinary key inside the range below

    ranges = WatchStream(channel)
    all_consumers = ranges.watch(b"/q/registry/c/", prefix_end(b"/q/registry/c/"))
    refused = ranges.create(ckey, prefix_end(ckey))
    assert refused.created and refused.canceled, refused
    assert refused.cancel_reason.startswith(f"etcdserver: queue key {ckey.decode()}: ")
    registry = WatchStream(channel)
    registry.watch(b"/q/registry")  # an ordinary key: the registry is not a consume key
    stream = WatchStream(channel)
    try:
        stream.watch(ckey)
        (reg,) = registry.events(1)
        assert (reg.type, reg.kv.value) == (PUT, node)
        assert get(kv, b"/q/registry") == node

        produce(kv, name, b"m1")
        (delivery,) = stream.events(1)
        kv.Put(rpc_pb2.PutRequest(key=marker, value=b"x"), timeout=WAIT)

        seen: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + WAIT
        while (PUT, marker) not in seen:
            resp = ranges.next(max(0.0, deadline - time.monotonic()))
            assert resp.watch_id == all_consumers
            seen.extend((e.type, e.kv.key) for e in resp.events)
        assert sorted(seen) == [(PUT, ckey), (PUT, marker)]
        assert get(kv, ckey) == node

        assert ack(kv, delivery.kv.key) == 1
        stream.close()  # the consumer goes away: its registry key is deleted
        (gone,) = ranges.events(1)
        assert (gone.type, gone.kv.key) == (DELETE, ckey)
        assert get(kv, ckey) is None
        assert get(kv, b"/q/registry") == node
    finally:
        stream.close()
        ranges.close()
        registry.close()


def test_second_watch_on_a_consumer_key_keeps_the_registry_key(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """A client that reconnects with the same consumer id before its old watch has
    ended: the old watch ending does not remove the registry key of the new one."""
    name = b"reconnect"
    consumer = new_id()
    ckey = consumer_key(name, consumer)
    marker = ckey + b"/marker"
    observer = WatchStream(channel)
    observer.watch(b"/q/reconnect/c/", prefix_end(b"/q/reconnect/c/"))
    old, new = WatchStream(channel), WatchStream(channel)
    try:
        old_id = old.watch(ckey)
        new.watch(ckey)
        old.cancel(old_id)
        kv.Put(rpc_pb2.PutRequest(key=marker, value=b"x"), timeout=WAIT)
        seen: list[tuple[int, bytes]] = []
        while (PUT, marker) not in seen:
            seen.extend((e.type, e.kv.key) for e in observer.next().events)
        assert (DELETE, ckey) not in seen
        assert get(kv, ckey) is not None
        produce(kv, name, b"m")
        (d,) = new.events(1)
        assert ack(kv, d.kv.key) == 1
    finally:
        old.close()
        new.close()
        observer.close()


def test_consumer_key_without_a_uuid_is_refused(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """A consumer id must be a UUID (issue 17: the server used to make one up,
    so the registry named a consumer the client did not know). The watch is
    answered created and canceled with the reason, the stream stays usable,
    and nothing is registered."""
    observer = WatchStream(channel)
    observer.watch(b"/q/nouuid/", prefix_end(b"/q/nouuid/"))
    stream = WatchStream(channel)
    try:
        refused = stream.create(b"/q/nouuid/c/worker-1", watch_id=7)
        assert (refused.created, refused.canceled, refused.watch_id) == (True, True, -1)
        assert refused.cancel_reason == (
            'etcdserver: queue key /q/nouuid/c/worker-1: consumer id "worker-1" is not a UUID'
        )
        # the same stream still consumes with a UUID; the observer's first event
        # is that consumer's registry key, so the refused one wrote nothing
        consumer = new_id()
        stream.watch(consumer_key(b"nouuid", consumer))
        (reg,) = observer.events(1)
        assert (reg.type, reg.kv.key) == (PUT, consumer_key(b"nouuid", consumer))
        produce(kv, b"nouuid", b"m")
        (delivery,) = stream.events(1)
        assert suffix_of(delivery.kv.key) == b"m"
        assert ack(kv, delivery.kv.key) == 1
    finally:
        stream.close()
        observer.close()


def test_prefetch_window_and_round_robin(channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub) -> None:
    name = b"window"
    configure(kv, name, prefetch=2)
    for i in range(5):
        produce(kv, name, b"m%d" % i)
    a, _, _ = consume(channel, name)
    b, _, _ = consume(channel, name)
    try:
        got_a = a.events(2)
        got_b = b.events(2)
        assert [suffix_of(e.kv.key) for e in got_a] == [b"m0", b"m1"]
        assert [suffix_of(e.kv.key) for e in got_b] == [b"m2", b"m3"]
        # m4 waits for room: the first ack makes some
        assert ack(kv, got_b[0].kv.key) == 1
        (m4,) = b.events(1)
        assert suffix_of(m4.kv.key) == b"m4"
        for e in [*got_a, got_b[1], m4]:
            assert ack(kv, e.kv.key) == 1

        # live consumers with room share new messages round-robin
        c, _, _ = consume(channel, name)
        try:
            for i in range(6):
                produce(kv, name, b"r%d" % i)
            per_consumer = [s.events(2) for s in (a, b, c)]
            got = sorted(suffix_of(e.kv.key) for events in per_consumer for e in events)
            assert got == [b"r%d" % i for i in range(6)]
            for events in per_consumer:
                for e in events:
                    assert ack(kv, e.kv.key) == 1
        finally:
            c.close()
        assert depth(kv, name) == 0
    finally:
        a.close()
        b.close()


def test_ordering_fairness_and_once_delivery_under_load(
    server: ServerProcess, kv: rpc_pb2_grpc.KVStub
) -> None:
    """10 000 messages from 4 concurrent producers reach 3 consumers that ack as
    they go: each message is delivered exactly once (no consumer leaves), each
    consumer sees its messages in idx order, and the three counts are within 20%
    of each other's mean."""
    name = b"load"
    total, producers, in_flight = 10_000, 4, 16

    class AckingConsumer:
        def __init__(self) -> None:
            self.channel = grpc.insecure_channel(server.endpoint)
            self.kv = rpc_pb2_grpc.KVStub(self.channel)
            self.got: list[bytes] = []
            self.acked = 0
            self.errors: list[str] = []
            self.lock = threading.Condition()
            self.unacked: list[bytes] = []
            self.closing = False
            self.stream = WatchStream(self.channel, on_events=self.on_events)
            self.stream.watch(consumer_key(name, new_id()))
            self.acker = threading.Thread(target=self.ack_loop, daemon=True)
            self.acker.start()

        def on_events(self, resp: rpc_pb2.WatchResponse) -> None:
            keys = [e.kv.key for e in resp.events if e.type == PUT]
            with self.lock:
                self.got.extend(keys)
                self.unacked.extend(keys)
                self.lock.notify_all()

        def ack_loop(self) -> None:
            """Ack everything received so far in one Txn, again and again."""
            while True:
                with self.lock:
                    while not self.unacked and not self.closing:
                        self.lock.wait()
                    if self.closing:
                        return
                    keys, self.unacked = self.unacked, []
                try:
                    resp = self.kv.Txn(
                        rpc_pb2.TxnRequest(success=[delete_op(k) for k in keys]), timeout=WAIT
                    )
                except grpc.RpcError as e:
                    self.errors.append(f"ack failed: {e}")
                    return
                deleted = sum(r.response_delete_range.deleted for r in resp.responses)
                if deleted != len(keys):
                    self.errors.append(f"acked {len(keys)} keys, {deleted} deleted")
                with self.lock:
                    self.acked += len(keys)
                    self.lock.notify_all()

        def close(self) -> None:
            with self.lock:
                self.closing = True
                self.lock.notify_all()
            self.acker.join(timeout=WAIT)
            self.stream.close()
            self.channel.close()

    consumers = [AckingConsumer() for _ in range(3)]
    produce_errors: list[str] = []

    def producer(p: int) -> None:
        window: list[grpc.Future[rpc_pb2.PutResponse]] = []
        try:
            for i in range(total // producers):
                req = rpc_pb2.PutRequest(key=b"/q/load/p/p%d-%05d" % (p, i), value=b"%d" % i)
                window.append(kv.Put.future(req, timeout=60))
                if len(window) >= in_flight:
                    window.pop(0).result()
            for f in window:
                f.result()
        except grpc.RpcError as e:
            produce_errors.append(f"producer {p}: {e}")

    try:
        threads = [threading.Thread(target=producer, args=(p,)) for p in range(producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not produce_errors, produce_errors
        deadline = time.monotonic() + 60
        for c in consumers:
            with c.lock:
                while c.acked < len(c.got) or sum(len(x.got) for x in consumers) < total:
                    left = deadline - time.monotonic()
                    if left <= 0 or c.errors:
                        break
                    c.lock.wait(timeout=min(left, 0.5))
        for c in consumers:
            assert not c.errors, c.errors
        counts = [len(c.got) for c in consumers]
        delivered = [k for c in consumers for k in c.got]
        assert len(delivered) == total, counts
        assert len(set(delivered)) == total, "a message was delivered twice"
        assert {suffix_of(k) for k in delivered} == {
            b"p%d-%05d" % (p, i) for p in range(producers) for i in range(total // producers)
        }
        assert len({idx_of(k) for k in delivered}) == total
        for c in consumers:
            idxs = [idx_of(k) for k in c.got]
            assert idxs == sorted(idxs), "a consumer saw its messages out of idx order"
        mean = total / len(consumers)
        assert all(abs(n - mean) <= 0.2 * mean for n in counts), counts
        assert depth(kv, name) == 0
    finally:
        for c in consumers:
            c.close()


# -- settings, limits, transactions, leases -----------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        b"not json",
        b"[1, 2]",
        b'{"prefetch": 0}',
        b'{"max_deliveries": -1}',
        b'{"ack_deadline": "soon"}',
        b'{"max_depth": -5}',
        b'{"dead_letter": "a/b"}',
        b'{"no_such_setting": 1}',
    ],
)
def test_invalid_config_is_refused(kv: rpc_pb2_grpc.KVStub, value: bytes) -> None:
    key = b"/q/settings/config"
    configure(kv, b"settings", prefetch=3, max_depth=100)
    good = get(kv, key)
    with pytest.raises(grpc.RpcError) as err:
        kv.Put(rpc_pb2.PutRequest(key=key, value=value), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("etcdserver: queue config /q/settings/config: ")
    assert get(kv, key) == good
    # inside a Txn the whole Txn is refused
    ordinary = b"/settings-txn/" + value.hex().encode()
    txn = rpc_pb2.TxnRequest(success=[put_op(ordinary, b"1"), put_op(key, value)])
    with pytest.raises(grpc.RpcError) as err:
        kv.Txn(txn, timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert get(kv, ordinary) is None
    assert get(kv, key) == good


def test_depth_limit_refuses_and_writes_nothing(kv: rpc_pb2_grpc.KVStub) -> None:
    name = b"bounded"
    configure(kv, name, max_depth=3)
    for i in range(3):
        produce(kv, name, b"m%d" % i)
    before = kv.Range(rpc_pb2.RangeRequest(key=b"/q/bounded/"), timeout=WAIT).header.revision
    with pytest.raises(grpc.RpcError) as err:
        produce(kv, name, b"one-too-many")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "etcdserver: queue bounded is full (max_depth 3)"
    # a Txn producing over the limit is refused whole: its other writes do not happen
    txn = rpc_pb2.TxnRequest(
        success=[put_op(b"/bounded-side-effect", b"1"), put_op(b"/q/bounded/p/txn", b"x")]
    )
    with pytest.raises(grpc.RpcError) as err:
        kv.Txn(txn, timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    after = kv.Range(rpc_pb2.RangeRequest(key=b"/q/bounded/"), timeout=WAIT).header.revision
    assert after == before
    assert get(kv, b"/bounded-side-effect") is None
    assert [suffix_of(m.key) for m in messages(kv, name)] == [b"m0", b"m1", b"m2"]
    # in-flight messages count too; room comes back when one goes (here: a cancel)
    assert ack(kv, messages(kv, name)[0].key) == 1
    produce(kv, name, b"m3")
    assert depth(kv, name) == 3


def test_depth_limit_counts_every_produce_of_one_txn(kv: rpc_pb2_grpc.KVStub) -> None:
    name = b"depth-txn"
    configure(kv, name, max_depth=2)
    produce(kv, name, b"m0")
    txn = rpc_pb2.TxnRequest(success=[put_op(b"/q/depth-txn/p/t%d" % i, b"x") for i in range(2)])
    with pytest.raises(grpc.RpcError) as err:
        kv.Txn(txn, timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert depth(kv, name) == 1


def test_txn_consume_transform_produce(channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub) -> None:
    """Ack an input message, produce its result and record it in an ordinary key,
    in one Txn guarded by the delivery's create_revision (the message's identity;
    its mod_revision is the delivery's): all or nothing, and a retry of the same
    step (a redelivery after a crash) changes nothing."""
    configure(kv, b"tx-in", prefetch=1)
    produce(kv, b"tx-in", b"order-7", b"7")
    produce(kv, b"tx-in", b"order-8", b"8")
    inputs, _, _ = consume(channel, b"tx-in")
    outputs, _, _ = consume(channel, b"tx-out")
    # A consumer's registration (its key, then the queue's `/q/{name}`) is written
    # after its watch is created; the revisions checked below must not see it.
    for name in (b"tx-in", b"tx-out"):
        wait_registered(kv, name)
    try:
        (d,) = inputs.events(1)
        assert suffix_of(d.kv.key) == b"order-7"
        step = rpc_pb2.TxnRequest(
            compare=[
                rpc_pb2.Compare(
                    key=d.kv.key,
                    target=rpc_pb2.Compare.CREATE,
                    result=rpc_pb2.Compare.EQUAL,
                    create_revision=d.kv.create_revision,
                )
            ],
            success=[
                delete_op(d.kv.key),
                put_op(b"/q/tx-out/p/order-7", b"%d" % (int(d.kv.value) * 2)),
                put_op(b"/tx/orders/order-7", b"done"),
            ],
        )
        resp = kv.Txn(step, timeout=WAIT)
        assert resp.succeeded
        rev = resp.header.revision
        assert resp.responses[0].response_delete_range.deleted == 1

        (out,) = outputs.events(1)
        assert (suffix_of(out.kv.key), out.kv.value, out.kv.mod_revision) == (
            b"order-7",
            b"14",
            rev,
        )
        side = kv.Range(rpc_pb2.RangeRequest(key=b"/tx/orders/order-7"), timeout=WAIT).kvs
        assert side[0].mod_revision == rev
        # the ack made room in the consumer's window (prefetch 1): the next comes
        (nxt,) = inputs.events(1)
        assert suffix_of(nxt.kv.key) == b"order-8"

        again = kv.Txn(step, timeout=WAIT)
        assert not again.succeeded
        assert again.header.revision == rev
        assert [suffix_of(m.key) for m in messages(kv, b"tx-out")] == [b"order-7"]
        assert [suffix_of(m.key) for m in messages(kv, b"tx-in")] == [b"order-8"]
        for key in (out.kv.key, nxt.kv.key):
            assert ack(kv, key) == 1
    finally:
        inputs.close()
        outputs.close()


def test_message_ttl_by_lease(channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub) -> None:
    """A message put with a lease disappears when the lease goes: undelivered
    (revoked), and while delivered and unacknowledged (expired)."""
    name = b"ttl"
    leases = rpc_pb2_grpc.LeaseStub(channel)
    # no ack deadline: a delivery then carries the message's own lease (under
    # one it carries its delivery lease; the stored key keeps the message's)
    configure(kv, name, prefetch=1, ack_deadline=0)
    revoked = leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=60), timeout=WAIT).ID
    produce(kv, name, b"short-lived", lease=revoked)
    (msg,) = messages(kv, name)
    assert msg.lease == revoked
    leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=revoked), timeout=WAIT)
    assert depth(kv, name) == 0

    stream, _, _ = consume(channel, name)
    try:
        produce(kv, name, b"sentinel")
        assert [suffix_of(e.kv.key) for e in stream.next().events] == [b"sentinel"]
        assert ack(kv, messages(kv, name)[0].key) == 1

        expiring = leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=2), timeout=WAIT).ID
        produce(kv, name, b"held", lease=expiring)
        (held,) = stream.events(1)
        assert held.kv.lease == expiring
        produce(kv, name, b"after")  # waits: the window (prefetch 1) is full
        (after,) = stream.events(1, timeout=15)  # comes once the lease has expired
        assert suffix_of(after.kv.key) == b"after"
        assert get(kv, held.kv.key) is None
        assert ack(kv, after.kv.key) == 1
    finally:
        stream.close()


def test_cancel_by_deleting_an_undelivered_message(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    name = b"cancel"
    produce(kv, name, b"a")
    produce(kv, name, b"b")
    first = messages(kv, name)[0]
    assert suffix_of(first.key) == b"a"
    assert ack(kv, first.key) == 1
    assert depth(kv, name) == 1
    stream, _, _ = consume(channel, name)
    try:
        assert [suffix_of(e.kv.key) for e in stream.next().events] == [b"b"]
    finally:
        stream.close()


def test_ack_of_unknown_or_acked_key_changes_nothing(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    name = b"unknown"
    configure(kv, name, prefetch=1)
    stream, consumer, _ = consume(channel, name)
    try:
        produce(kv, name, b"m1")
        (d,) = stream.events(1)
        assert ack(kv, d.kv.key) == 1
        rev = kv.Range(rpc_pb2.RangeRequest(key=b"/q/unknown"), timeout=WAIT).header.revision
        idx = idx_of(d.kv.key)
        for key in (
            d.kv.key,  # acked already
            b"/q/unknown/%016d/m1" % (idx + 1000),  # never existed
            b"/q/unknown/c/%s/%016d/m1" % (consumer, idx),  # a hand-over key, not stored here
        ):
            resp = kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=WAIT)
            assert (resp.deleted, resp.header.revision) == (0, rev)
        # the consumer's window is intact: the next message comes
        produce(kv, name, b"m2")
        (d2,) = stream.events(1)
        assert suffix_of(d2.kv.key) == b"m2"
        assert ack(kv, d2.kv.key) == 1
    finally:
        stream.close()


# -- redelivery and dead letters ------------------------------------------------------


def test_dead_letter_after_max_deliveries(channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub) -> None:
    """A message whose consumers go away without acking it is delivered again;
    after max_deliveries it moves to `{name}.dead`, an ordinary queue."""
    name = b"dl"
    configure(kv, name, max_deliveries=2, prefetch=1)
    dead = WatchStream(channel)
    dead.watch(b"/q/dl.dead/", prefix_end(b"/q/dl.dead/"))
    produce(kv, name, b"poison", b"bad input")
    try:
        for _attempt in range(2):
            stream, _, watch_id = consume(channel, name)
            try:
                (d,) = stream.events(1)
                assert (suffix_of(d.kv.key), d.kv.value) == (b"poison", b"bad input")
                stream.cancel(watch_id)  # gone without an ack
            finally:
                stream.close()
        (moved,) = dead.events(1)
        assert moved.type == PUT and moved.kv.key.startswith(b"/q/dl.dead/")
        assert (suffix_of(moved.kv.key), moved.kv.value) == (b"poison", b"bad input")
        assert depth(kv, name) == 0
        assert [m.key for m in messages(kv, b"dl.dead")] == [moved.kv.key]

        # not delivered a third time: a new consumer's first delivery is the sentinel
        stream, _, _ = consume(channel, name)
        try:
            produce(kv, name, b"sentinel")
            assert [suffix_of(e.kv.key) for e in stream.next().events] == [b"sentinel"]
            assert ack(kv, messages(kv, name)[0].key) == 1
        finally:
            stream.close()
        # the dead-letter queue is consumed like any queue
        stream, _, _ = consume(channel, b"dl.dead")
        try:
            (again,) = stream.events(1)
            assert again.kv.key == moved.kv.key
            assert ack(kv, again.kv.key) == 1
        finally:
            stream.close()
    finally:
        dead.close()


def test_ack_deadline_redelivers_then_dead_letters(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """With ack_deadline, a live consumer that holds a message too long has it taken
    back and delivered again; the configured dead-letter queue gets it at
    max_deliveries."""
    name = b"slow"
    configure(kv, name, ack_deadline=0.5, max_deliveries=2, dead_letter="slow-graveyard")
    graveyard = WatchStream(channel)
    graveyard.watch(b"/q/slow-graveyard/", prefix_end(b"/q/slow-graveyard/"))
    stream, _, _ = consume(channel, name)
    try:
        produce(kv, name, b"m")
        first, second = stream.events(2)
        assert first.kv.key == second.kv.key
        (moved,) = graveyard.events(1)
        assert suffix_of(moved.kv.key) == b"m"
        assert depth(kv, name) == 0
        assert ack(kv, moved.kv.key) == 1
    finally:
        stream.close()
        graveyard.close()


def test_ack_deadline_is_a_lease_any_etcd_client_can_keep_alive_or_revoke(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """A delivery under an ack deadline carries a lease: LeaseKeepAlive holds the
    message past the deadline, TimeToLive names its key, LeaseRevoke gives it
    back at once (a negative acknowledgement), and letting it lapse redelivers."""
    name = b"leased-acks"
    configure(kv, name, ack_deadline=2)
    leases = rpc_pb2_grpc.LeaseStub(channel)
    stream, _, _ = consume(channel, name)
    try:
        produce(kv, name, b"m")
        (first,) = stream.events(1)
        lease = first.kv.lease
        assert lease
        ttl = leases.LeaseTimeToLive(
            rpc_pb2.LeaseTimeToLiveRequest(ID=lease, keys=True), timeout=WAIT
        )
        assert ttl.grantedTTL == 2 and list(ttl.keys) == [first.kv.key]
        # kept alive for twice the deadline: nothing comes back meanwhile
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            answer = list(
                leases.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease)]), timeout=WAIT)
            )
            assert answer[0].TTL == 2
            time.sleep(0.5)  # the keepalive cadence, not synchronisation
        # without the keepalives a redelivery would have arrived after 2 s
        assert stream.responses.empty()
        leases.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=WAIT)
        (again,) = stream.events(1)
        assert again.kv.key == first.kv.key and again.kv.lease not in (0, lease)
        gone = leases.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=lease), timeout=WAIT)
        assert gone.TTL == -1
        # left to lapse, it is delivered once more; then acked for good
        (third,) = stream.events(1, timeout=WAIT)
        assert third.kv.key == first.kv.key
        assert ack(kv, third.kv.key) == 1
    finally:
        stream.close()


def test_consumer_that_does_not_read_is_dropped_after_5s(
    server: ServerProcess, channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """The seed's rule: a consumer whose stream does not take a delivery within 5 s
    is dropped (its watch is cancelled with a reason) and what it held goes to
    another consumer. The stuck one reads nothing after its `created` response,
    so flow control stops the server's writes once the transport buffers fill."""
    name = b"stuck"
    count, size = 12, 1000 * 1024
    configure(kv, name, prefetch=count)
    requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()

    def request_iter() -> Iterator[rpc_pb2.WatchRequest]:
        while (req := requests.get()) is not None:
            yield req

    # No BDP probing: grpc would grow the stream's window on its own while the
    # application reads nothing, and sometimes take all 12 MB into its buffers,
    # so the server's writes never stall. A fixed 64 KiB window stalls them.
    no_autotune = [("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(server.endpoint, options=no_autotune) as stuck_channel:
        stuck = rpc_pb2_grpc.WatchStub(stuck_channel).Watch(request_iter(), timeout=60)
        create = rpc_pb2.WatchCreateRequest(key=consumer_key(name, new_id()))
        requests.put(rpc_pb2.WatchRequest(create_request=create))
        assert next(stuck).created
        started = time.monotonic()  # before the first delivery, so before any stall
        for i in range(count):
            produce(kv, name, b"m%02d" % i, b"x" * size)
        other, _, _ = consume(channel, name)
        try:
            got: list[bytes] = []
            while len(got) < count:
                for e in other.next(15).events:
                    got.append(suffix_of(e.kv.key))
                    assert ack(kv, e.kv.key) == 1
            assert sorted(got) == [b"m%02d" % i for i in range(count)]
            assert time.monotonic() - started >= 4.9, "taken back before the 5 s rule"
            # the stuck stream, read at last: its deliveries, then the cancel
            reasons = []
            for resp in stuck:
                if resp.canceled:
                    reasons.append(resp.cancel_reason)
                    break
            assert reasons and "5s" in reasons[0]
        finally:
            requests.put(None)
            stuck.cancel()
            other.close()


class LineReader:
    """A subprocess's stdout lines, read by a thread, taken with a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stdout = proc.stdout
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def next(self, timeout: float = WAIT) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output within {timeout}s") from None
        assert line is not None, "the process ended"
        return line


def test_killed_consumer_process_messages_go_to_another(
    server: ServerProcess, channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """A consumer process holding unacknowledged messages is killed with SIGKILL:
    every message it held is delivered to another consumer, none is lost, and
    none it acknowledged comes back."""
    name = b"redeliver"
    configure(kv, name, prefetch=4)
    produced = [b"m%d" % i for i in range(10)]
    for key in produced:
        produce(kv, name, key)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(CONSUMER_SCRIPT),
            server.endpoint,
            f"/q/redeliver/c/{uuid.uuid4()}",
            "2",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    other: WatchStream | None = None
    try:
        out = LineReader(proc)
        assert out.next() == "ready"
        got: list[bytes] = []
        acked: list[bytes] = []
        # window 4: it gets m0-m3, acks m0 and m1, gets m4 and m5 in their place
        while len(got) < 6 or len(acked) < 2:
            verb, printed = out.next().split()
            (got if verb == "got" else acked).append(suffix_of(printed.encode()))
        held = [k for k in got if k not in acked]
        assert acked == [b"m0", b"m1"] and held == [b"m2", b"m3", b"m4", b"m5"]

        other, _, _ = consume(channel, name)
        first = other.events(4)
        assert [suffix_of(e.kv.key) for e in first] == [b"m6", b"m7", b"m8", b"m9"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT)

        redelivered: list[bytes] = []
        for e in first:
            assert ack(kv, e.kv.key) == 1
        while len(redelivered) < len(held):
            for e in other.events(1):
                redelivered.append(suffix_of(e.kv.key))
                assert ack(kv, e.kv.key) == 1
        assert redelivered == held  # back in idx order
        assert depth(kv, name) == 0
        assert sorted(acked + [suffix_of(e.kv.key) for e in first] + redelivered) == produced
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT)
        if other is not None:
            other.close()


# -- durability -------------------------------------------------------------------------


def test_sigkill_server_keeps_pending_and_in_flight_messages(tmp_path: Path) -> None:
    """Kill the server with SIGKILL while producers have puts in flight and a
    consumer holds unacknowledged messages. After a restart every acknowledged
    produce is either acked or delivered again; no acked message comes back; a
    new message gets an idx above every old one."""
    name = b"durable"
    srv = ServerProcess(tmp_path / "mq.etcd", extra_args=["--snapshot-count", "300"]).start()
    acknowledged: list[bytes] = []  # producer keys whose put returned
    enough = threading.Event()
    stop = threading.Event()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            configure(kv, name, prefetch=8)
            stream, old_consumer, _ = consume(ch, name)

            def producer() -> None:
                window: list[tuple[bytes, grpc.Future[rpc_pb2.PutResponse]]] = []
                try:
                    for i in range(5000):
                        if stop.is_set():
                            return
                        key = b"m%05d" % i
                        req = rpc_pb2.PutRequest(key=b"/q/durable/p/" + key, value=key)
                        window.append((key, kv.Put.future(req, timeout=WAIT)))
                        if len(window) >= 8:
                            done, future = window.pop(0)
                            future.result()
                            acknowledged.append(done)
                            if len(acknowledged) >= 400:
                                enough.set()
                except grpc.RpcError:
                    return  # the server is gone: the rest of the window is unknown

            writer = threading.Thread(target=producer)
            writer.start()
            # take 16 deliveries, acking every other one: 8 stay in flight (the window)
            acked: set[bytes] = set()
            held: set[bytes] = set()
            while len(acked) + len(held) < 16:
                for e in stream.next().events:
                    if len(acked) <= len(held) and len(acked) < 8:
                        assert ack(kv, e.kv.key) == 1
                        acked.add(e.kv.key)
                    else:
                        held.add(e.kv.key)
            assert enough.wait(timeout=60), "the producers did not get 400 puts through"
            srv.kill()
            stop.set()
            writer.join(timeout=30)
            assert not writer.is_alive()
            stream.close()
        max_idx_before = max(idx_of(k) for k in acked | held)

        srv.start()
        with grpc.insecure_channel(srv.endpoint) as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            await_deleted(
                ch, consumer_key(name, old_consumer)
            )  # the dead consumer leaves the registry
            remaining = depth(kv, name)
            stream, _, _ = consume(ch, name)
            delivered: list[bytes] = []
            deadline = time.monotonic() + 60
            while len(delivered) < remaining:
                for e in stream.next(max(0.0, deadline - time.monotonic())).events:
                    delivered.append(e.kv.key)
                    assert ack(kv, e.kv.key) == 1
            assert depth(kv, name) == 0
            assert len(set(delivered)) == len(delivered)
            assert not acked & set(delivered), "an acknowledged ack was undone"
            assert held <= set(delivered), "an in-flight message was lost"
            done = {suffix_of(k) for k in acked | set(delivered)}
            lost = [k for k in acknowledged if k not in done]
            assert not lost, f"{len(lost)} acknowledged produces lost: {lost[:5]}"
            max_idx_before = max(max_idx_before, *(idx_of(k) for k in delivered))
            produce(kv, name, b"after-restart")
            (new,) = stream.events(1)
            assert idx_of(new.kv.key) > max_idx_before
            stream.close()
    finally:
        stop.set()
        srv.stop()


# -- the request/reply example -----------------------------------------------------------


def test_request_reply_example_runs(server: ServerProcess) -> None:
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    env.pop("PYTHONPATH", None)  # the etcd3 client must not meet our etcdserverpb
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), server.endpoint, "--requests", "20"],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=EXAMPLE.parent,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    replies = [line for line in lines if line.startswith("reply ")]
    assert len(replies) == 20, proc.stdout
    assert lines[-1] == "20 requests, 20 replies, all matched"
