"""The state machine's assignment of queue messages to consumers: deterministic
(two replicas applying one log agree, a snapshot carries it), round-robin within
prefetch windows, and what a consumer that leaves held goes back, counted, and
to the dead-letter queue at max_deliveries."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import StateMachine
from queue_server.mq.state import DEFAULT_ACK_DEADLINE, QueueSettings

pytestmark = pytest.mark.unit

A = b"11111111-1111-1111-1111-111111111111"
B = b"22222222-2222-2222-2222-222222222222"


class Replica:
    """A state machine fed commands in log order, recording what it assigns."""

    def __init__(self) -> None:
        self.sm = StateMachine()
        self.index = 0
        self.assigned: list[tuple[bytes, list[int]]] = []

    def apply(self, command: internal_pb2.Command) -> Any:
        self.index += 1
        result, effects = self.sm.apply(self.index, command)
        for a in effects.assignments:
            self.assigned.append((a.consumer, [idx for idx, _key in a.items]))
        return result

    def put(self, key: bytes, value: bytes = b"v") -> Any:
        return self.apply(internal_pb2.Command(put=rpc_pb2.PutRequest(key=key, value=value)))

    def delete(self, key: bytes) -> Any:
        return self.apply(internal_pb2.Command(delete_range=rpc_pb2.DeleteRangeRequest(key=key)))

    def holders(self, name: bytes = b"jobs") -> dict[int, bytes]:
        q = self.sm.queues.queues[name]
        return {idx: slot.consumer_id for idx, slot in q.holder.items()}


def message(idx: int, key: bytes = b"k", name: bytes = b"jobs") -> bytes:
    return b"/q/%s/%016d/%s" % (name, idx, key)


def test_messages_go_round_robin_within_prefetch_windows() -> None:
    r = Replica()
    r.put(b"/q/jobs/config", json.dumps({"prefetch": 2}).encode())
    r.put(b"/q/jobs/c/" + A, b"n1")
    r.put(b"/q/jobs/c/" + B, b"n2")
    for i in range(6):
        r.put(b"/q/jobs/p/k%d" % i)
    assert r.holders() == {1: A, 2: B, 3: A, 4: B}
    assert list(r.sm.queues.queues[b"jobs"].pending) == [5, 6]
    r.delete(message(3, b"k2"))  # an ack makes room for one more
    assert r.holders() == {1: A, 2: B, 4: B, 5: A}


def test_a_delivery_key_acknowledges_its_message() -> None:
    r = Replica()
    r.put(b"/q/jobs/c/" + A, b"n2")
    r.put(b"/q/jobs/p/job-1")
    resp = r.delete(b"/q/jobs/c/" + A + b"/0000000000000001/job-1")
    assert resp.deleted == 1
    assert r.sm.store.get(message(1, b"job-1")) is None
    assert r.holders() == {}


def test_a_consumer_that_leaves_gives_back_counted_and_dead_letters_at_the_limit() -> None:
    r = Replica()
    r.put(b"/q/jobs/config", json.dumps({"max_deliveries": 2}).encode())
    r.put(b"/q/jobs/p/poison")
    for _ in range(2):
        r.put(b"/q/jobs/c/" + A, b"n1")
        assert r.holders() == {1: A}
        r.delete(b"/q/jobs/c/" + A)  # its node's session expired, or its watch ended
    assert r.sm.store.get(message(1, b"poison")) is None
    dead = r.sm.queues.queues[b"jobs.dead"]
    assert r.sm.store.get(message(1, b"poison", b"jobs.dead")) is not None
    assert list(dead.pending) == [1]


def test_a_consumer_moving_to_another_node_gets_its_messages_again() -> None:
    r = Replica()
    r.put(b"/q/jobs/c/" + A, b"n1")
    r.put(b"/q/jobs/p/x")
    r.put(b"/q/jobs/c/" + A, b"n2")  # the client reconnected through n2
    assert r.assigned == [(A, [1]), (A, [1])]
    assert r.sm.queues.queues[b"jobs"].attempts == {1: 1}


def test_requeue_returns_only_what_that_consumer_holds() -> None:
    r = Replica()
    r.put(b"/q/jobs/c/" + A, b"n1")
    r.put(b"/q/jobs/p/x")
    command = internal_pb2.Command()
    command.queue_requeue.queue = b"jobs"
    command.queue_requeue.consumer = B
    command.queue_requeue.idx.append(1)
    r.apply(command)
    assert r.sm.queues.queues[b"jobs"].attempts == {}
    command.queue_requeue.consumer = A
    r.apply(command)
    assert r.sm.queues.queues[b"jobs"].attempts == {1: 1}
    assert r.holders() == {1: A}  # the only consumer gets it again


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("produce"), st.integers(0, 3)),
        st.tuples(st.just("join"), st.sampled_from([A, B]), st.sampled_from([b"n1", b"n2"])),
        st.tuples(st.just("leave"), st.sampled_from([A, B])),
        st.tuples(st.just("ack"), st.integers(1, 30)),
        st.tuples(st.just("snapshot")),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_replicas_and_snapshots_agree_on_every_assignment(ops: list[tuple[Any, ...]]) -> None:
    """Two replicas applying one log hold the same assignment at every step; one
    restored from a snapshot midway goes on to agree too."""
    first, second = Replica(), Replica()
    first.put(b"/q/jobs/config", json.dumps({"prefetch": 3}).encode())
    second.put(b"/q/jobs/config", json.dumps({"prefetch": 3}).encode())
    for op in ops:
        if op[0] == "snapshot":
            second.sm = StateMachine()
            second.sm.restore_state(first.sm.export_state())
            continue
        for r in (first, second):
            if op[0] == "produce":
                r.put(b"/q/jobs/p/k%d" % op[1])
            elif op[0] == "join":
                r.put(b"/q/jobs/c/" + op[1], op[2])
            elif op[0] == "leave":
                r.delete(b"/q/jobs/c/" + op[1])
            else:
                q = r.sm.queues.queues.get(b"jobs")
                held = q.holder.get(op[1]) if q is not None else None
                if held is not None:
                    r.delete(held.held[op[1]])
        q1 = first.sm.queues.queues.get(b"jobs")
        q2 = second.sm.queues.queues.get(b"jobs")
        assert (q1 is None) == (q2 is None)
        if q1 is not None and q2 is not None:
            assert first.holders() == second.holders()
            assert list(q1.pending) == list(q2.pending)
            assert q1.attempts == q2.attempts
            assert [(s.consumer_id, s.node) for s in q1.consumers.values()] == [
                (s.consumer_id, s.node) for s in q2.consumers.values()
            ]
            for slot in q1.consumers.values():
                assert len(slot.held) <= 3
            # nothing pending while a consumer has room
            if q1.pending and q1.consumers:
                assert all(len(s.held) == 3 for s in q1.consumers.values())


def test_a_config_without_ack_deadline_keeps_the_default() -> None:
    """Setting one field (a consumer library writing only `prefetch`) must not
    switch the 30 s ack deadline off; 0 does, when asked for."""
    assert QueueSettings().ack_deadline == DEFAULT_ACK_DEADLINE == 30.0
    assert QueueSettings.parse(b'{"prefetch": 4}').ack_deadline == DEFAULT_ACK_DEADLINE
    assert QueueSettings.parse(b'{"ack_deadline": 0}').ack_deadline == 0.0
