"""The dashboard's core, in-process on a state machine with a fake clock: each
queue's history ring (bounded, starting where the traffic that woke the queue
began, dropped when quiet for the window), idle times, and the redrive plan and
Txn applied as a client's Txn would be (produce rewritten, dead letter gone,
a retry a no-op)."""

from __future__ import annotations

import json

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import StateMachine
from queue_server.dashboard import HISTORY_SAMPLES, HISTORY_SECONDS, SAMPLE_INTERVAL, QueueHistory
from queue_server.mq.redrive import MAX_REDRIVE, RedriveRefused, plan_redrive

pytestmark = pytest.mark.unit

A = b"11111111-1111-1111-1111-111111111111"


class Node:
    def __init__(self) -> None:
        self.sm = StateMachine()
        self.index = 0

    def apply(self, command: internal_pb2.Command) -> object:
        self.index += 1
        result, _effects = self.sm.apply(self.index, command)
        return result

    def put(self, key: bytes, value: bytes = b"v") -> object:
        return self.apply(internal_pb2.Command(put=rpc_pb2.PutRequest(key=key, value=value)))

    def delete(self, key: bytes) -> object:
        return self.apply(internal_pb2.Command(delete_range=rpc_pb2.DeleteRangeRequest(key=key)))

    def keys(self, prefix: bytes) -> list[bytes]:
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        return [kv.key for kv in self.sm.store.range(prefix, end).kvs]


def dead_letters(node: Node, n: int) -> None:
    """`n` messages of `jobs` (max_deliveries 1) dead-lettered: their consumer left."""
    node.put(b"/q/jobs/config", json.dumps({"max_deliveries": 1}).encode())
    node.put(b"/q/jobs/c/" + A, b"n1")
    for i in range(n):
        node.put(b"/q/jobs/p/k%d" % i, b"v%d" % i)
    node.delete(b"/q/jobs/c/" + A)


def test_history_starts_before_the_traffic_that_woke_a_queue_and_is_bounded() -> None:
    node = Node()
    history = QueueHistory(node.sm, started=0.0)
    history.due(2.0)
    for i in range(5):
        node.put(b"/q/jobs/p/k%d" % i)
    history.due(4.0)
    series = history.series(b"jobs", now=4.0, wall=1000.0)
    assert series["t"] == [998.0, 1000.0]  # the sample before the produces, and now
    assert series["produced"] == [0, 5] and series["pending"] == [0, 5]
    for k in range(HISTORY_SAMPLES + 50):
        history.due(4.0 + SAMPLE_INTERVAL * (k + 1))
    assert len(history.rings[b"jobs"].samples) == HISTORY_SAMPLES


def test_a_quiet_queue_is_idle_and_loses_its_ring_after_the_window() -> None:
    node = Node()
    node.put(b"/q/old/config", b'{"prefetch": 8}')  # configured, never used
    history = QueueHistory(node.sm, started=0.0)
    node.put(b"/q/jobs/p/k")
    history.due(2.0)
    assert history.idle_seconds(b"old", 2.0) == 2.0 and b"old" not in history.rings
    assert history.idle_seconds(b"jobs", 2.0) == 0.0
    node.delete(b"/q/jobs/0000000000000001/k")  # cancelled: nothing left, counters still
    history.due(4.0)
    assert history.idle_seconds(b"jobs", 10.0) == 10.0 - 2.0
    history.due(2.0 + HISTORY_SECONDS + SAMPLE_INTERVAL)
    assert b"jobs" not in history.rings


def test_a_redrive_plan_moves_the_oldest_pending_dead_letters_by_txn() -> None:
    node = Node()
    dead_letters(node, 3)
    assert len(node.keys(b"/q/jobs.dead/")) == 3
    plan = plan_redrive(node.sm.queues, node.sm.store, "jobs", 2)
    assert (plan.queue, plan.dead_letter, len(plan.txns)) == ("jobs", "jobs.dead", 2)
    txn = plan.txns[0]
    assert txn.compare[0].target == rpc_pb2.Compare.CREATE
    assert txn.success[0].request_delete_range.key == b"/q/jobs.dead/0000000000000001/k0"
    assert txn.success[1].request_put.key == b"/q/jobs/p/k0"
    for t in plan.txns:
        assert node.apply(internal_pb2.Command(txn=t)).succeeded  # type: ignore[attr-defined]
    assert node.keys(b"/q/jobs/0") == [
        b"/q/jobs/0000000000000004/k0",
        b"/q/jobs/0000000000000005/k1",
    ]
    assert node.keys(b"/q/jobs.dead/") == [b"/q/jobs.dead/0000000000000003/k2"]
    assert node.sm.queues.queues[b"jobs.dead"].depth == 1  # the dead queue let go
    assert node.sm.queues.queues[b"jobs"].depth == 2
    # the same Txn again: the dead letter is gone, the compare fails, nothing moves
    again = node.apply(internal_pb2.Command(txn=plan.txns[0]))
    assert not again.succeeded  # type: ignore[attr-defined]
    assert node.sm.queues.queues[b"jobs"].depth == 2


@pytest.mark.parametrize(
    ("name", "count", "why"),
    [
        ("", None, "not one segment"),
        ("a/b", None, "not one segment"),
        ("nope", None, "no queue named"),
        ("jobs", 0, "between 1 and"),
        ("jobs", MAX_REDRIVE + 1, "between 1 and"),
    ],
)
def test_a_redrive_plan_refuses(name: str, count: int | None, why: str) -> None:
    node = Node()
    dead_letters(node, 1)
    with pytest.raises(RedriveRefused, match=why):
        plan_redrive(node.sm.queues, node.sm.store, name, count)
