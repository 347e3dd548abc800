"""Apply is a function of the log alone: the same log gives the same state,
HashKV and effects, from empty or from a snapshot, on a node with local queue
consumers or on one without. Node-local code (consumer registration, delivery)
only ever proposes; it never changes replicated state itself.

The spelling race is the case that once broke this: a consumer watching the
short spelling registers while the first long-spelling produce of a new queue
is in flight. The node hosting the watch used to create the queue itself, with
the consumer's spelling, so its message keys differed from every replica that
replayed the same log.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import StateMachine
from tests.support.node_harness import Node, delivered_keys, describe, replay

pytestmark = pytest.mark.unit


def same_state(a: StateMachine, b: StateMachine) -> None:
    assert a.export_state() == b.export_state()
    assert a.store.hash_kv() == b.store.hash_kv()
    assert a.store.revision == b.store.revision


def check_replays(node: Node) -> None:
    """The node's log replayed from empty, and from a snapshot taken at every
    third entry, reaches the node's state with the node's effects."""
    entries = node.log.entries
    replayed, effects = replay(entries)
    same_state(node.state, replayed)
    assert describe(effects) == describe(node.effects)
    for cut in range(0, len(entries), 3):
        head, _ = replay(entries[:cut])
        restored = StateMachine()
        restored.restore_state(head.export_state())
        tail, _ = replay(entries, restored, start=cut)
        same_state(node.state, tail)


@pytest.mark.parametrize("consumer_first", [True, False])
async def test_spelling_race_gives_the_same_keys_everywhere(consumer_first: bool) -> None:
    node = Node()
    consumer = str(uuid.uuid4()).encode()
    if consumer_first:
        stream = node.watch(b"/q/race/c/" + consumer)  # registration in flight
        await node.put(b"/queue/race/producer/k1", b"one")
    else:
        produce = asyncio.ensure_future(node.put(b"/queue/race/producer/k1", b"one"))
        stream = node.watch(b"/q/race/c/" + consumer)  # while the produce is in flight
        await produce
    await node.settle()
    await node.put(b"/queue/race/producer/k2", b"two")
    await node.settle()

    q = node.state.queues.queues[b"race"]
    first = q.spelling
    held = [slot.held[idx] for idx, slot in q.holder.items()]
    assert all(k.startswith(first) for k in (*q.pending.values(), *held))
    assert [k.rsplit(b"/", 1)[1] for k in delivered_keys(stream)] == [b"k1", b"k2"]
    check_replays(node)


async def test_a_node_with_consumers_applies_what_a_node_without_does() -> None:
    """A busy log from a node with consumers of both spellings, acks, a consumer
    leaving and a dead-letter: replayed without any node part, it agrees."""
    node = Node()
    await node.put(b"/q/jobs/config", json.dumps({"prefetch": 2, "max_deliveries": 2}).encode())
    a, b = (str(uuid.uuid4()).encode() for _ in range(2))
    sa = node.watch(b"/q/jobs/c/" + a)
    sb = node.watch(b"/queue/jobs/consumer/" + b)
    await node.settle()
    for i in range(6):
        node.clock.advance(0.25)  # each produce stamped with its own time
        await node.put(b"/queue/jobs/producer/m%d" % i, b"x%d" % i)
    await node.settle()
    assert len(set(node.state.queues.queues[b"jobs"].produced_ms.values())) == 6
    got_a = delivered_keys(sa)
    got_b = delivered_keys(sb)
    assert len(got_a) == 2 and len(got_b) == 2  # prefetch windows full
    await node.delete(got_a[0])  # an ack makes room
    await node.settle()
    node.hub.close_stream(sb)  # b leaves: what it held comes back
    await node.settle()
    txn = rpc_pb2.TxnRequest()
    for key in delivered_keys(sa):
        txn.success.add().request_delete_range.key = key
    await node.log.propose(internal_pb2.Command(txn=txn))
    await node.settle()
    assert node.state.queues.queues[b"jobs"].acked >= 2
    check_replays(node)
