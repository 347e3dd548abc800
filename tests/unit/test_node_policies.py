"""The node's timer policies and the dispatcher's parts, in-process, on a fake clock.

Ack deadlines, stuck consumers, lease expiry and CQS visibility are decided by
policies that read no clock (`due(now)`), driven here by `Timers.run_due` with a
`FakeClock`: no sleeps, and every step asserts what must and must not have
happened yet. The CQS watch view stamps its commands with the same fake clock.
"""

from __future__ import annotations

import json
import logging
import uuid

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.mq.ack_policy import STUCK_REASON, STUCK_SECONDS
from queue_server.node.timers import Every, Timers
from tests.support.node_harness import NODE, FakeClock, Node, delivered_keys, drain

pytestmark = pytest.mark.unit


def consumer_key(name: bytes) -> tuple[bytes, bytes]:
    cid = str(uuid.uuid4()).encode()
    return cid, b"/q/%s/c/%s" % (name, cid)


async def test_registration_writes_the_registry_keys_and_release_deletes_them() -> None:
    node = Node()
    cid, key = consumer_key(b"reg")
    stream = node.watch(key)
    await node.settle()
    assert node.state.store.get(key).value == NODE  # type: ignore[union-attr]
    assert node.state.store.get(b"/q/reg").value == NODE  # type: ignore[union-attr]
    assert node.state.queues.queues[b"reg"].consumers[cid].node == NODE
    node.hub.close_stream(stream)
    await node.settle()
    assert node.state.store.get(key) is None
    assert cid not in node.state.queues.queues[b"reg"].consumers


async def test_a_deleted_registry_key_of_a_live_consumer_is_written_again() -> None:
    node = Node()
    _cid, key = consumer_key(b"again")
    node.watch(key)
    await node.settle()
    await node.delete(key)  # an operator, or an expired session lease
    await node.settle()
    assert node.state.store.get(key) is not None


async def test_what_one_batch_assigns_a_consumer_goes_in_one_response() -> None:
    node = Node()
    cid, key = consumer_key(b"batch")
    stream = node.watch(key)
    await node.settle()
    drain(stream)
    produce = [
        internal_pb2.Command(put=rpc_pb2.PutRequest(key=b"/q/batch/p/m%d" % i, value=b"x"))
        for i in range(5)
    ]
    node.log.apply_batch(produce[:3])
    node.log.apply_batch(produce[3:])
    responses = drain(stream)
    assert [[e.kv.key.rsplit(b"/", 1)[1] for e in r.events] for r in responses] == [
        [b"m0", b"m1", b"m2"],
        [b"m3", b"m4"],
    ]
    # one acknowledged and one produced in the same batch: only the new one is sent
    first = responses[0].events[0].kv.key
    node.log.apply_batch(
        [
            internal_pb2.Command(delete_range=rpc_pb2.DeleteRangeRequest(key=first)),
            internal_pb2.Command(put=rpc_pb2.PutRequest(key=b"/q/batch/p/m5", value=b"x")),
        ]
    )
    assert [k.rsplit(b"/", 1)[1] for k in delivered_keys(stream)] == [b"m5"]
    assert len(node.state.queues.queues[b"batch"].consumers[cid].held) == 5


async def test_delivery_past_its_ack_deadline_comes_back() -> None:
    node = Node()
    await node.put(b"/q/slow/config", json.dumps({"ack_deadline": 2}).encode())
    cid, key = consumer_key(b"slow")
    stream = node.watch(key)
    await node.settle()
    await node.put(b"/q/slow/p/m1", b"body")
    await node.settle()
    responses = drain(stream)
    assert [e.kv.key.rsplit(b"/", 1)[1] for r in responses for e in r.events] == [b"m1"]
    lease = responses[-1].events[0].kv.lease
    assert lease  # a delivery lease of its own, for LeaseKeepAlive
    q = node.state.queues.queues[b"slow"]

    await node.tick(1.5)
    assert q.attempts == {} and len(q.holder) == 1  # not yet

    # a keepalive on the delivery lease starts the deadline over
    assert node.delivery.keep_alive(lease, node.clock()) == 2
    await node.tick(1.5)
    assert q.attempts == {}

    await node.tick(1.0)  # 2.5 s since the keepalive
    assert q.attempts == {1: 1}
    again = delivered_keys(stream)  # the only consumer gets it again
    assert [k.rsplit(b"/", 1)[1] for k in again] == [b"m1"]
    assert q.consumers[cid].held


async def test_acknowledged_delivery_is_not_given_back_at_its_deadline() -> None:
    node = Node()
    await node.put(b"/q/acked/config", json.dumps({"ack_deadline": 1}).encode())
    _cid, key = consumer_key(b"acked")
    stream = node.watch(key)
    await node.settle()
    await node.put(b"/q/acked/p/m", b"x")
    await node.settle()
    (delivered,) = delivered_keys(stream)
    await node.delete(delivered)
    await node.tick(5)
    q = node.state.queues.queues[b"acked"]
    assert q.attempts == {} and q.depth == 0 and q.redelivered == 0


async def test_an_ack_ends_the_delivery_lease_when_it_is_applied_not_at_a_tick() -> None:
    node = Node()
    await node.put(b"/q/fast/config", json.dumps({"ack_deadline": 30}).encode())
    cid, key = consumer_key(b"fast")
    stream = node.watch(key)
    await node.settle()
    await node.put(b"/q/fast/p/m1", b"x")
    await node.put(b"/q/fast/p/m2", b"y")
    await node.settle()
    events = [e.kv for r in drain(stream) for e in r.events]
    assert [kv.key.rsplit(b"/", 1)[1] for kv in events] == [b"m1", b"m2"]
    (watch,) = node.delivery.local[(b"fast", cid)]
    assert set(watch.deadlines) == {1, 2}
    leases = [kv.lease for kv in events]
    assert node.delivery.time_to_live(leases[0], node.clock()) == (30, 30, events[0].key)

    await node.delete(events[0].key)  # the ack; no timer runs after it
    assert set(watch.deadlines) == {2} and set(watch.leases) == {2}
    assert leases[0] not in node.delivery.delivery_leases
    assert node.delivery.keep_alive(leases[0], node.clock()) is None
    assert not node.delivery.revoke(leases[0])
    assert node.delivery.keep_alive(leases[1], node.clock()) == 30  # the other stands


async def test_a_delivery_taken_back_by_apply_loses_its_lease_at_once() -> None:
    node = Node()
    await node.put(b"/q/back/config", json.dumps({"ack_deadline": 30}).encode())
    _cid, key = consumer_key(b"back")
    stream = node.watch(key)
    await node.settle()
    await node.put(b"/q/back/p/m1", b"x")
    await node.settle()
    (first,) = [e.kv for r in drain(stream) for e in r.events]
    # an operator deletes the registry key: apply takes m1 back from the consumer
    await node.delete(key)
    assert first.lease not in node.delivery.delivery_leases
    await node.settle()  # the key is written again, and m1 comes back to the consumer
    (again,) = [e.kv for r in drain(stream) for e in r.events]
    assert again.key.rsplit(b"/", 1)[1] == b"m1" and again.lease != first.lease
    assert node.delivery.keep_alive(again.lease, node.clock()) == 30
    assert node.state.queues.queues[b"back"].attempts == {1: 1}


async def test_stuck_consumer_is_dropped_and_its_messages_go_to_another() -> None:
    node = Node()
    stuck_id, stuck_key = consumer_key(b"st")
    stuck = node.watch(stuck_key)
    await node.settle()
    await node.put(b"/q/st/p/m1", b"x")
    await node.settle()
    assert len(stuck.outbox) == 2  # created, then the delivery nobody reads
    other_id, other_key = consumer_key(b"st")
    other = node.watch(other_key)
    await node.settle()
    drain(other)

    await node.tick(STUCK_SECONDS - 0.5)  # first seen stuck here
    await node.tick(STUCK_SECONDS - 1.0)
    assert stuck_id in node.state.queues.queues[b"st"].consumers
    await node.tick(1.0)
    q = node.state.queues.queues[b"st"]
    assert stuck_id not in q.consumers
    cancel = stuck.outbox[-1][0]
    assert cancel.canceled and cancel.cancel_reason == STUCK_REASON
    assert not stuck.watchers  # its only watch left the stream
    assert [k.rsplit(b"/", 1)[1] for k in delivered_keys(other)] == [b"m1"]
    assert q.consumers[other_id].held and q.redelivered == 1


async def test_a_cqs_watch_delivery_comes_back_after_its_visibility_on_the_fake_clock() -> None:
    node = Node()  # the CQS view's visibility timeout: 60 s
    config = {"cqs": {"subscriptions": [{"dto_type": "order"}]}}
    await node.put(b"/q/v/config", json.dumps(config).encode())
    _cid, key = consumer_key(b"v")
    stream = node.watch(key)
    await node.settle()
    drain(stream)
    sla = "1970-01-01T00:15:00Z"  # before the fake clock's 1000 s
    await node.put(
        b"/q/dto:order/p/k", json.dumps({"dto_id": "t/1", "sla_timestamp": sla}).encode()
    )
    await node.settle()
    (first,) = delivered_keys(stream)
    dequeues = [
        c.cqs_dequeue
        for c in map(internal_pb2.Command.FromString, node.log.entries)
        if c.WhichOneof("op") == "cqs_dequeue"
    ]
    assert [(d.now_ms, d.visible_until_ms) for d in dequeues] == [(1_000_000, 1_060_000)]

    await node.tick(59.9)
    assert delivered_keys(stream) == []  # still in flight on the fake clock
    await node.tick(0.2)  # 60.1 s: expired, and the view delivers it again
    (again,) = delivered_keys(stream)
    assert again.rsplit(b"/", 2)[1] == first.rsplit(b"/", 2)[1]  # the same seq
    assert again != first  # under a new ack token


async def test_lease_expires_on_the_fake_clock() -> None:
    node = Node()
    grant = internal_pb2.Command(lease_grant=rpc_pb2.LeaseGrantRequest(ID=7, TTL=5))
    await node.log.propose(grant)
    await node.put(b"/with-lease", b"v", lease=7)
    await node.tick(4.9)
    assert node.revoked == [] and 7 in node.state.lessor.leases
    await node.tick(0.2)
    assert node.revoked == [7]
    assert 7 not in node.state.lessor.leases
    assert node.state.store.get(b"/with-lease") is None
    assert node.expiry.remaining(7) == -1  # the revoke's effect reached the clock


def test_timers_call_each_policy_at_its_interval_and_survive_a_failing_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(0.0)
    timers = Timers(clock)
    calls: list[tuple[str, float]] = []

    def fail(now: float) -> None:
        raise RuntimeError("boom")

    timers.add("fast", Every(0.5, lambda now: calls.append(("fast", now))))
    timers.add("slow", Every(2.0, lambda now: calls.append(("slow", now))))
    timers.add("bad", Every(1.0, fail))
    with caplog.at_level(logging.ERROR):
        for _ in range(8):
            timers.run_due(clock.advance(0.5))
    assert [t for name, t in calls if name == "fast"] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    assert [t for name, t in calls if name == "slow"] == [2.0, 4.0]
    assert sum("policy=bad" in r.getMessage() for r in caplog.records) == 4


async def test_a_message_taken_back_and_handed_again_in_one_batch_is_sent_once() -> None:
    node = Node()
    cid, key = consumer_key(b"again1")
    stream = node.watch(key)
    await node.settle()
    drain(stream)
    requeue = internal_pb2.Command()
    requeue.queue_requeue.queue = b"again1"
    requeue.queue_requeue.consumer = cid
    requeue.queue_requeue.idx.append(1)
    # produced (handed to the one consumer), given back, handed to it again: one batch
    node.log.apply_batch(
        [internal_pb2.Command(put=rpc_pb2.PutRequest(key=b"/q/again1/p/m", value=b"x")), requeue]
    )
    assert [k.rsplit(b"/", 1)[1] for k in delivered_keys(stream)] == [b"m"]
    assert list(node.state.queues.queues[b"again1"].consumers[cid].held) == [1]
