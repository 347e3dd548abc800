"""Apply is a function of the log alone: the same log gives the same state,
HashKV and effects, from empty or from a snapshot, on a node with local queue
consumers or on one without, with the whole state in memory or with the key
revisions on an LMDB backend checkpointed between commands (and restarted
from it). Node-local code (consumer registration, delivery)
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
from pathlib import Path

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import Checkpoint, Effects, StateMachine
from queue_server.storage import snapshot
from queue_server.storage.backend import Backend, CommitBatch
from tests.support.mixed_load import MixedLoad, describe_result
from tests.support.node_harness import Command, Node, delivered_keys, describe, replay

pytestmark = pytest.mark.unit


def same_state(a: StateMachine, b: StateMachine) -> None:
    assert a.export_state() == b.export_state()
    assert a.store.hash_kv() == b.store.hash_kv()
    assert a.store.revision == b.store.revision


def check_replays(node: Node, directory: Path) -> None:
    """The node's log replayed from empty, and from a snapshot taken at every
    third entry, reaches the node's state with the node's effects; and so it
    does on a real backend (in `directory`) with checkpoints between commands."""
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
    check_backend_replays(entries, node.state, node.effects, directory)


def results_of(entries: list[bytes]) -> list[tuple[str, bytes | str]]:
    """Each entry's result, applied in memory."""
    sm = StateMachine()
    return [
        describe_result(sm.apply(i, Command.FromString(data))[0])
        for i, data in enumerate(entries, 1)
    ]


class OnBackend:
    """A state machine on a real Backend, fed entries with checkpoints taken as
    the local log takes them: `checkpoint()` on the loop, the commit on the
    backend thread, then `renew_reader` and `checkpoint_done` on the loop. With
    `lag`, the commit lands `lag` entries after the checkpoint was taken and
    the loop hears of it `lag` entries later still: entries applied meanwhile
    read the revisions being written."""

    def __init__(self, directory: Path, every: int, lag: int) -> None:
        self.backend = Backend(str(directory), fsync=False)
        self.sm = StateMachine()
        self.sm.use_backend(self.backend)
        self.every, self.lag = every, lag
        self.results: list[tuple[str, bytes | str]] = []
        self.effects: list[Effects] = []
        self.taken: Checkpoint | None = None
        self.committed_at = 0
        self.checkpoints = 0

    def apply(self, index: int, data: bytes) -> None:
        result, effects = self.sm.apply(index, Command.FromString(data))
        self.results.append(describe_result(result))
        if effects:
            self.effects.append(effects)
        if (
            self.taken is not None
            and not self.committed_at
            and index >= self.taken.index + self.lag
        ):
            self.commit()
        if self.committed_at and index >= self.committed_at + self.lag:
            self.done()
        if self.taken is None and index % self.every == 0:
            self.taken = self.sm.checkpoint()
            if not self.lag:
                self.commit()
                self.done()

    def commit(self) -> None:
        assert self.taken is not None
        cp = self.taken
        image = snapshot.encode(cp.index, cp.sections)
        self.backend.commit(
            CommitBatch(cp.index, cp.writes, cp.dropped, image, cp.tables, cp.replace)
        )
        self.committed_at = self.sm.applied_index

    def done(self) -> None:
        self.backend.renew_reader()
        self.sm.checkpoint_done()
        self.taken, self.committed_at = None, 0
        self.checkpoints += 1


def restarted(directory: Path) -> tuple[StateMachine, Backend]:
    """A state machine rebuilt from the backend in `directory`, as a restart
    rebuilds it: the sections, the index from one scan of the revisions, and
    the parts' rows from their tables."""
    backend = Backend(str(directory), fsync=False)
    sm = StateMachine()
    sm.use_backend(backend)
    image = backend.sections()
    if image is not None:  # else nothing was checkpointed: the log replays it all
        state = snapshot.decode(image, "sections").state
        sm.restore_state(state, backend.scan_keys(), backend.table_rows)
    assert sm.applied_index == backend.consistent_index
    return sm, backend


def check_backend_replays(
    entries: list[bytes], state: StateMachine, effects: list[Effects], directory: Path
) -> None:
    """The log on a backend, checkpointed every `every` entries (at once, or
    with the commit in flight while entries go on), gives the in-memory
    results, effects and `state`; so does a restart from the backend's last
    checkpoint with the rest of the log replayed."""
    results = results_of(entries)
    for every, lag in ((1, 0), (3, 0), (1, 1), (2, 1), (4, 2)):
        run = directory / f"every-{every}-lag-{lag}"
        on = OnBackend(run, every, lag)
        for index, data in enumerate(entries, 1):
            on.apply(index, data)
            if index == len(entries) // 2:  # mid-way too, with a checkpoint in flight or not
                same_state(replay(entries[:index])[0], on.sm)
        assert on.results == results
        if not lag:
            assert on.checkpoints == len(entries) // every
        assert describe(on.effects) == describe(effects)
        same_state(state, on.sm)
        heard = on.backend.consistent_index  # the loop's reader: a commit may be unheard of
        on.backend.close()
        again, backend = restarted(run)
        assert again.applied_index >= heard
        tail, _ = replay(entries, again, start=again.applied_index)
        same_state(state, tail)
        backend.close()


@pytest.mark.parametrize("consumer_first", [True, False])
async def test_spelling_race_gives_the_same_keys_everywhere(
    consumer_first: bool, tmp_path: Path
) -> None:
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
    check_replays(node, tmp_path)


async def test_a_node_with_consumers_applies_what_a_node_without_does(tmp_path: Path) -> None:
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
    check_replays(node, tmp_path)


@pytest.mark.parametrize("seed", range(3))
def test_a_mixed_log_applies_the_same_on_a_backend(seed: int, tmp_path: Path) -> None:
    """A longer log of every kind of command (keys, txns, compactions, leases,
    a queue's consumers, produces, acks and requeues, CQS notifications,
    dequeues and settles), on a backend with checkpoints between commands,
    gives what it gives in memory."""
    load = MixedLoad(seed)
    entries = [c.SerializeToString() for c in load.take(300)]
    state, effects = replay(entries)
    same_state(state, load.model)
    check_backend_replays(entries, state, effects, tmp_path)
