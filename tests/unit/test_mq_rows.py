"""The etcd-key queue's rows in the backend table `t:mq` (mq/state.py's module
docstring): a state machine on a real LMDB backend, checkpointed now and then
(some checkpoints failing), and restarted from the backend's sections and rows,
is the state an in-memory twin fed the same log reaches; the sections hold no
per-message data; a restart reads no message value; a whole-state export (what
Maintenance.Snapshot writes) folds the rows back in."""

from __future__ import annotations

import asyncio
import io
import json
import random
from pathlib import Path
from typing import Any

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import Applier, StateMachine, sections_with_tables
from queue_server.local_log import LocalLog
from queue_server.mq.redrive import plan_redrive
from queue_server.mq.state import (
    MessageRow,
    QueueState,
    parse_row_key,
    row_key,
)
from queue_server.storage import etcd_backend, snapshot
from queue_server.storage.backend import Backend, CommitBatch
from queue_server.storage.revisions import KeyValueFields

pytestmark = pytest.mark.unit

Command = internal_pb2.Command
A = b"11111111-1111-1111-1111-111111111111"
B = b"22222222-2222-2222-2222-222222222222"
C = b"33333333-3333-3333-3333-333333333333"
NOW_MS = 1_700_000_000_000


def message(idx: int, key: bytes, name: bytes = b"jobs") -> bytes:
    return b"/q/%s/%016d/%s" % (name, idx, key)


class Twins:
    """One log applied to a state machine on a backend and to one in memory."""

    def __init__(self, path: Path) -> None:
        self.backend = Backend(str(path), fsync=False)
        self.sm = StateMachine()
        self.sm.use_backend(self.backend)
        self.ref = StateMachine()
        self.index = 0
        self.clock = NOW_MS

    def apply(self, command: internal_pb2.Command) -> Any:
        self.index += 1
        self.clock += 7
        command.now_ms = self.clock
        result, _ = self.sm.apply(self.index, command)
        ref_result, _ = self.ref.apply(self.index, command)
        assert type(result) is type(ref_result)
        return result

    def put(self, key: bytes, value: bytes = b"v") -> Any:
        return self.apply(Command(put=rpc_pb2.PutRequest(key=key, value=value)))

    def delete(self, key: bytes) -> Any:
        return self.apply(Command(delete_range=rpc_pb2.DeleteRangeRequest(key=key)))

    def requeue(self, consumer: bytes, idxs: list[int], name: bytes = b"jobs") -> Any:
        command = Command()
        command.queue_requeue.queue = name
        command.queue_requeue.consumer = consumer
        command.queue_requeue.idx.extend(idxs)
        return self.apply(command)

    def checkpoint(self) -> CommitBatch:
        """A checkpoint as the local log writes one."""
        cp = self.sm.checkpoint()
        batch = CommitBatch(
            cp.index, cp.writes, cp.dropped, snapshot.encode(cp.index, cp.sections), cp.tables
        )
        self.backend.commit(batch)
        self.backend.renew_reader()
        self.sm.checkpoint_done()
        return batch

    def failed_checkpoint(self) -> None:
        """A checkpoint taken and never written (a full disk)."""
        self.sm.checkpoint_failed(self.sm.checkpoint())

    def restart(self) -> None:
        """A checkpoint, then a new state machine from the backend alone."""
        self.checkpoint()
        self.sm = restored(self.backend)

    def same(self) -> None:
        assert self.sm.export_state() == self.ref.export_state()
        for q in self.sm.queues.queues.values():
            r = self.ref.queues.queues[q.name]
            assert list(q.pending.items()) == list(r.pending.items())
            assert {i: s.consumer_id for i, s in q.holder.items()} == {
                i: s.consumer_id for i, s in r.holder.items()
            }
            assert set(q.hand_out) == set(q.holder)
            assert q.settings == r.settings
        assert self.sm.store.hash_kv() == self.ref.store.hash_kv()

    def table(self) -> dict[bytes, bytes]:
        return dict(self.backend.table_rows("mq"))


def restored(backend: Backend) -> StateMachine:
    sm = StateMachine()
    sm.use_backend(backend)
    image = backend.sections()
    assert image is not None
    sm.restore_state(snapshot.decode(image, "x").state, backend.scan_keys(), backend.table_rows)
    return sm


def rows_of(sm: StateMachine) -> dict[bytes, bytes]:
    """Every row the state has now, as the table must hold it after a checkpoint."""
    out: dict[bytes, bytes] = {}
    for q in sm.queues.queues.values():
        for idx in q.message_idxs():
            raw = q.row(idx)
            assert raw is not None
            out[row_key(q.name, idx)] = raw
    return out


def meaning(rows: dict[bytes, bytes | None]) -> tuple[dict[bytes, Any], dict[Any, list[int]]]:
    """Rows as what they say: each row's fields but its hand-out number, and
    each holder's messages in hand-out order (the numbers themselves differ
    between a machine and one restored from its export, their order does not)."""
    fields: dict[bytes, Any] = {}
    holds: dict[Any, list[tuple[int, int]]] = {}
    for key, raw in rows.items():
        if raw is None:
            fields[key] = None
            continue
        row = MessageRow.decode(raw)
        fields[key] = (row.produced_ms, row.attempts, row.holder)
        if row.holder:
            name, idx = parse_row_key(key)
            holds.setdefault((name, row.holder), []).append((row.hand_out, idx))
    return fields, {h: [idx for _n, idx in sorted(v)] for h, v in holds.items()}


def test_row_layout() -> None:
    key = row_key(b"jobs", 5)
    assert key == b"jobs/" + (5).to_bytes(8, "big")
    assert parse_row_key(key) == (b"jobs", 5)
    # one queue's rows are one run, in idx order, whatever the other names
    keys = sorted(row_key(n, i) for n in (b"a", b"a.dead", b"a0", b"b") for i in (1, 2, 300))
    names = [parse_row_key(k)[0] for k in keys]
    assert [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n] == [
        b"a.dead",
        b"a",
        b"a0",
        b"b",
    ]
    assert [parse_row_key(k)[1] for k in keys[:3]] == [1, 2, 300]
    row = MessageRow(produced_ms=NOW_MS, attempts=2, hand_out=-3, holder=A)
    raw = row.encode()
    assert len(raw) == 25 + len(A) and raw[0] == 1
    assert MessageRow.decode(raw) == row
    with pytest.raises(ValueError, match="layout"):
        MessageRow.decode(b"\x02" + raw[1:])
    with pytest.raises(ValueError):
        parse_row_key(b"jobs")


def test_checkpoints_and_restarts_keep_every_part_of_a_queue(tmp_path: Path) -> None:
    """Produce, hand out, ack, requeue, a consumer leaving and one moving node,
    dead letters and a redrive, with checkpoints between and restarts from the
    backend alone: the restarted machine is its in-memory twin, and the table
    holds exactly the state's rows."""
    t = Twins(tmp_path / "db")
    t.put(b"/q/jobs/config", json.dumps({"prefetch": 2, "max_deliveries": 2}).encode())
    t.put(b"/q/jobs/c/" + A, b"n1")
    t.put(b"/q/jobs/c/" + B, b"n2")
    for i in range(7):
        t.put(b"/q/jobs/p/k%d" % i)
    t.checkpoint()
    assert t.table() == rows_of(t.sm)
    t.restart()
    t.same()
    t.delete(message(1, b"k0"))  # an ack
    t.requeue(B, [2])  # B's ack deadline passed: its message back, counted
    t.put(b"/q/jobs/c/" + A, b"n3")  # A moved node: what it held comes back, counted
    t.checkpoint()
    t.restart()
    t.same()
    t.delete(b"/q/jobs/c/" + B)  # B left: its holds come back; some reach max_deliveries
    t.put(b"/q/jobs/c/" + C, b"n1")
    t.requeue(A, list(t.ref.queues.queues[b"jobs"].consumers[A].held))
    t.restart()
    t.same()
    dead = t.ref.queues.queues.get(b"jobs.dead")
    assert dead is not None and dead.pending, "the scenario must dead-letter something"
    plan = plan_redrive(t.sm.queues, t.sm.store, "jobs", None)
    for txn in plan.txns:
        t.apply(Command(txn=txn))
    t.same()
    t.restart()
    t.same()
    assert t.table() == rows_of(t.sm)
    # acks of everything: the table empties
    for q in list(t.ref.queues.queues.values()):
        for key in [*q.pending.values(), *(s.held[i] for i, s in q.holder.items())]:
            t.delete(key)
    t.delete(b"/q/jobs/c/" + A)
    t.delete(b"/q/jobs/c/" + C)
    t.restart()
    t.same()
    assert t.table() == {}


@pytest.mark.parametrize("seed", range(6))
def test_random_logs_with_failed_checkpoints_and_restarts(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    t = Twins(tmp_path / "db")
    t.put(b"/q/jobs/config", json.dumps({"prefetch": 3, "max_deliveries": 3}).encode())
    consumers = [A, B, C]
    for step in range(250):
        op = rnd.random()
        q = t.ref.queues.queues.get(b"jobs")
        if op < 0.35:
            name = b"jobs" if rnd.random() < 0.8 else b"other"
            t.put(b"/q/%s/p/k%d" % (name, step))
        elif op < 0.45:
            t.put(b"/q/jobs/c/" + rnd.choice(consumers), rnd.choice([b"n1", b"n2"]))
        elif op < 0.5:
            t.delete(b"/q/jobs/c/" + rnd.choice(consumers))
        elif op < 0.7 and q is not None and q.holder:
            idx = rnd.choice(sorted(q.holder))
            t.delete(q.holder[idx].held[idx])  # an ack
        elif op < 0.8 and q is not None and q.holder:
            idx = rnd.choice(sorted(q.holder))
            t.requeue(q.holder[idx].consumer_id, [idx])
        elif op < 0.83 and q is not None and q.pending:
            t.delete(rnd.choice(list(q.pending.values())))  # cancelled while pending
        elif op < 0.86:
            for txn in plan_redrive(t.ref.queues, t.ref.store, "jobs", 3).txns:
                t.apply(Command(txn=txn))
        elif op < 0.91:
            t.checkpoint()
            assert t.table() == rows_of(t.sm)
        elif op < 0.95:
            t.failed_checkpoint()
        else:
            t.restart()
            t.same()
    t.restart()
    t.same()
    assert t.table() == rows_of(t.sm)


def test_a_failed_checkpoint_loses_nothing(tmp_path: Path) -> None:
    """The rows of a checkpoint that was not written go out with the next one,
    as they are then: a row changed since is written as it is now, a row gone
    since is deleted."""
    t = Twins(tmp_path / "db")
    t.put(b"/q/jobs/c/" + A, b"n1")
    for i in range(4):
        t.put(b"/q/jobs/p/k%d" % i)
    cp = t.sm.checkpoint()
    assert len(cp.tables["mq"]) == 4
    t.sm.checkpoint_failed(cp)
    t.delete(message(1, b"k0"))  # gone since
    t.requeue(A, [2])  # changed since: one failed delivery
    t.put(b"/q/jobs/p/k4")  # new since
    t.failed_checkpoint()  # and a second failure on top
    batch = t.checkpoint()
    rows = batch.tables["mq"]
    assert rows[row_key(b"jobs", 1)] is None
    assert MessageRow.decode(rows[row_key(b"jobs", 2)] or b"").attempts == 1
    assert set(rows) == {row_key(b"jobs", i) for i in range(1, 6)}
    assert t.table() == rows_of(t.sm)
    t.sm = restored(t.backend)
    t.same()
    assert t.sm.checkpoint().tables["mq"] == {}  # nothing changed since


def test_the_sections_do_not_grow_with_the_messages(tmp_path: Path) -> None:
    t = Twins(tmp_path / "db")
    t.put(b"/q/jobs/config", json.dumps({"prefetch": 100_000}).encode())
    t.put(b"/q/jobs/c/" + A, b"n1")
    t.put(b"/q/idle/p/first")
    sizes = []
    for batch in range(3):
        for i in range(1500):
            t.put(b"/q/jobs/p/k%d-%d" % (batch, i))  # held by A (its prefetch is large)
            t.put(b"/q/idle/p/k%d-%d" % (batch, i))  # pending: no consumer
        image = t.checkpoint().sections
        assert image is not None
        sizes.append(len(image))
    assert max(sizes) - min(sizes) <= 16  # a few varints grow (revision, next idx)
    state = snapshot.decode(t.backend.sections() or b"", "x").state
    for _name, _spelling, _next, attempts, assignment in state["queues"]:
        assert attempts == {} and assignment["produced_ms"] == []
        assert all(held == [] for _c, _n, held in assignment["consumers"])
    assert len(t.table()) == 9001
    t.sm = restored(t.backend)
    t.same()


class CountingBackend:
    """A backend's `CommittedRevisions` side that counts the values read."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.reads = 0

    def get_kv(self, position: int) -> KeyValueFields:
        self.reads += 1
        return self.backend.get_kv(position)

    @property
    def in_use_bytes(self) -> int:
        return self.backend.in_use_bytes


def test_a_restart_reads_no_message_value(tmp_path: Path) -> None:
    t = Twins(tmp_path / "db")
    t.put(b"/q/jobs/config", json.dumps({"prefetch": 5}).encode())
    t.put(b"/q/jobs/c/" + A, b"n1")
    for i in range(200):
        t.put(b"/q/jobs/p/k%d" % i, b"payload %d" % i)
    t.checkpoint()
    counting = CountingBackend(t.backend)
    sm = StateMachine()
    sm.use_backend(counting)
    image = t.backend.sections()
    assert image is not None
    sm.restore_state(snapshot.decode(image, "x").state, t.backend.scan_keys(), t.backend.table_rows)
    assert counting.reads == 1  # the config value
    t.sm = sm
    t.same()


def test_a_whole_state_export_restores_into_rows(tmp_path: Path) -> None:
    """An exported state (a snapshot file, an older server's data dir, a
    restore) on a backend: every message's row goes out with the first
    checkpoint, and rows of the state it replaced are deleted."""
    t = Twins(tmp_path / "db")
    t.put(b"/q/jobs/config", json.dumps({"prefetch": 2, "max_deliveries": 9}).encode())
    t.put(b"/q/jobs/c/" + A, b"n1")
    t.put(b"/q/jobs/c/" + B, b"n2")
    for i in range(6):
        t.put(b"/q/jobs/p/k%d" % i)
    t.requeue(A, [1])
    t.put(b"/q/jobs/c/" + B, b"n3")  # B's holds back, handed out again out of idx order
    other = Backend(str(tmp_path / "other"), fsync=False)
    sm = StateMachine()
    sm.use_backend(other)
    sm.restore_state(t.ref.export_state())
    sm.applied_index = t.index
    cp = sm.checkpoint()
    assert meaning(cp.tables["mq"]) == meaning(dict(rows_of(t.ref)))
    other.commit(
        CommitBatch(
            cp.index, cp.writes, cp.dropped, snapshot.encode(cp.index, cp.sections), cp.tables
        )
    )
    other.renew_reader()
    sm.checkpoint_done()
    t.sm = restored(other)
    t.same()


def test_an_export_replacing_a_state_deletes_its_rows(tmp_path: Path) -> None:
    t = Twins(tmp_path / "db")
    t.put(b"/q/old/p/a")
    t.put(b"/q/old/p/b")
    t.checkpoint()
    assert len(t.table()) == 2
    fresh = StateMachine()
    fresh.apply(1, Command(put=rpc_pb2.PutRequest(key=b"/q/new/p/x"), now_ms=NOW_MS))
    t.sm.restore_state(fresh.export_state())
    rows = t.sm.checkpoint().tables["mq"]
    assert rows == {
        row_key(b"old", 1): None,
        row_key(b"old", 2): None,
        row_key(b"new", 1): MessageRow(NOW_MS).encode(),
    }


def test_sections_of_an_older_backend_are_moved_into_rows(tmp_path: Path) -> None:
    """A backend checkpointed before the queue kept rows holds its per-message
    data in the sections and none in the table: it restores whole, and the
    next checkpoint writes the rows."""
    t = Twins(tmp_path / "db")
    t.put(b"/q/jobs/c/" + A, b"n1")
    for i in range(3):
        t.put(b"/q/jobs/p/k%d" % i)
    t.requeue(A, [1])
    cp = t.sm.checkpoint()
    full = t.sm.export_sections(full=True)  # what that older server wrote
    t.backend.commit(
        CommitBatch(cp.index, cp.writes, cp.dropped, snapshot.encode(cp.index, full), {})
    )
    t.backend.renew_reader()
    t.sm.checkpoint_done()
    assert t.table() == {}
    t.sm = restored(t.backend)
    t.same()
    t.restart()
    assert meaning(dict(t.table())) == meaning(dict(rows_of(t.ref)))
    t.same()


def test_rows_that_do_not_match_the_keys_are_refused(tmp_path: Path) -> None:
    t = Twins(tmp_path / "db")
    t.put(b"/q/jobs/p/k")
    t.checkpoint()
    sections = snapshot.decode(t.backend.sections() or b"", "x").state
    queues = QueueState()
    bad = [(row_key(b"jobs", 9), MessageRow(NOW_MS).encode())]
    with pytest.raises(ValueError, match="no message key"):
        queues.restore_state(sections["queues"], t.sm.store, iter(bad))
    held = [(row_key(b"jobs", 1), MessageRow(NOW_MS, 0, 1, B).encode())]
    with pytest.raises(ValueError, match="not a consumer"):
        queues.restore_state(sections["queues"], t.sm.store, iter(held))


def test_whole_state_from_sections_and_rows(tmp_path: Path) -> None:
    """What a checkpoint wrote, sections and rows read back together, is the
    whole state at that checkpoint (Maintenance.Snapshot's bucket)."""
    t = Twins(tmp_path / "db")
    t.put(b"/q/jobs/config", json.dumps({"prefetch": 2}).encode())
    t.put(b"/q/jobs/c/" + A, b"n1")
    t.put(b"/q/jobs/c/" + B, b"n2")
    for i in range(7):
        t.put(b"/q/jobs/p/k%d" % i)
    t.put(b"/q/jobs/c/" + A, b"n2")
    t.requeue(B, [2])
    t.checkpoint()
    state = snapshot.decode(t.backend.sections() or b"", "x").state
    assert sections_with_tables(state, t.backend.table_rows) == t.sm.export_sections(full=True)


def test_maintenance_snapshot_of_a_local_log_holds_the_rows(tmp_path: Path) -> None:
    async def run() -> None:
        sm = StateMachine()
        log = LocalLog(str(tmp_path), Applier(sm), fsync=False)
        log.recover()

        async def put(key: bytes, value: bytes = b"v") -> None:
            await log.propose(Command(put=rpc_pb2.PutRequest(key=key, value=value), now_ms=5))

        await put(b"/q/jobs/config", json.dumps({"prefetch": 1}).encode())
        await put(b"/q/jobs/c/" + A, b"n1")
        for i in range(4):
            await put(b"/q/jobs/p/k%d" % i)
        await put(b"/q/jobs/c/" + A, b"n2")  # its message back, counted
        buffer = io.BytesIO()
        await log.export_etcd_db(buffer)
        got = etcd_backend.read_etcd_db(buffer.getvalue(), "snapshot.db")
        assert got.state["queues"] == sm.export_state()["queues"]
        assert got.state["queues"][0][3] == {1: 1}
        await log.close()

    asyncio.run(run())
