"""CQS notifications as rows of the backend's `cqs` table (queue_server/cqs/state.py).

A StateMachine on a real LMDB Backend is driven through CQS commands with
checkpoints in between, written the way the local log writes them; a fresh
StateMachine restored from the backend (sections image + `cqs` rows) must have
exactly the original's `export_state`, and go on exactly like it. A failed
checkpoint loses nothing, and the sections image does not grow with the
notifications.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from etcdserverpb import cqs_pb2, internal_pb2, rpc_pb2
from queue_server import local_log
from queue_server.apply import Checkpoint, StateMachine, sections_with_tables
from queue_server.cqs.state import JOURNALED_ROW_BYTES, CqsState
from queue_server.cqs.tree import KEY_BYTES, DamagedRow, key_priority
from queue_server.errors import EtcdError
from queue_server.proposals import ApplyResult
from queue_server.storage import snapshot
from queue_server.storage.backend import Backend, CommitBatch
from tests.support.local_logs import open_log, propose_all, put, settled

pytestmark = pytest.mark.unit

Command = internal_pb2.Command
DTO = "storeesl.v1"
NOW = 1_000_000  # ms
VIS = 60_000  # ms


def sla(second: int) -> str:
    minute, second = divmod(second, 60)
    return f"2026-01-01T10:{minute:02d}:{second:02d}Z"


def config(*subs: tuple[str, str], depth: int = 4) -> bytes:
    subscriptions = [{"dto_type": t, "alias_name": a} for t, a in subs]
    return json.dumps({"cqs": {"subscriptions": subscriptions, "depth": depth}}).encode()


def note(dto_id: str, second: int, **fields: str) -> bytes:
    return json.dumps({"dto_id": dto_id, "sla_timestamp": sla(second), **fields}).encode()


class Machine:
    """A StateMachine on a Backend in `path`, fed commands at consecutive log
    indexes and checkpointed as `storage/local_log.py` does."""

    def __init__(self, path: Path, *, honour_replace: bool = True) -> None:
        self.path = path
        self.honour_replace = honour_replace
        self.backend = Backend(str(path), fsync=False)
        self.sm = StateMachine()
        self.sm.use_backend(self.backend)
        if self.backend.consistent_index:
            contents = snapshot.decode(self.backend.sections() or b"", "sections")
            self.sm.restore_state(contents.state, self.backend.scan_keys(), self.backend.table_rows)
        self.index = self.sm.applied_index

    def apply(self, command: internal_pb2.Command) -> ApplyResult:
        self.index += 1
        result = self.sm.apply(self.index, command)[0]
        assert not isinstance(result, EtcdError), f"{command} failed: {result}"
        return result

    def checkpoint(self) -> Checkpoint:
        cp = self.sm.checkpoint()
        image = snapshot.encode(cp.index, cp.sections)
        replace = cp.replace and self.honour_replace
        self.backend.commit(CommitBatch(cp.index, cp.writes, cp.dropped, image, cp.tables, replace))
        self.backend.renew_reader()
        self.sm.checkpoint_done()
        return cp

    def restarted(self) -> Machine:
        """A fresh machine on the same backend (this one's backend closed)."""
        self.backend.close()
        return Machine(self.path, honour_replace=self.honour_replace)

    # commands
    def put(self, key: str, value: bytes) -> None:
        self.apply(Command(put=rpc_pb2.PutRequest(key=key.encode(), value=value)))

    def delete(self, key: str) -> None:
        self.apply(Command(delete_range=rpc_pb2.DeleteRangeRequest(key=key.encode())))

    def dequeue(
        self, queue: str, base: str, *, max: int = 10, depth: int = 0, now: int = NOW
    ) -> list[str]:
        resp = self.apply(
            Command(
                cqs_dequeue=internal_pb2.CqsDequeue(
                    queue=queue,
                    max=max,
                    depth=depth,
                    now_ms=now,
                    visible_until_ms=now + VIS,
                    token_base=base,
                )
            )
        )
        assert isinstance(resp, internal_pb2.CqsDequeueResponse)
        return [n.ack_token for n in resp.notifications]

    def settle(
        self, queue: str, tokens: list[str], *, now: int = NOW, release: bool = False
    ) -> int:
        resp = self.apply(
            Command(
                cqs_settle=internal_pb2.CqsSettle(
                    queue=queue, tokens=tokens, now_ms=now, release=release
                )
            )
        )
        assert isinstance(resp, internal_pb2.CqsSettleResponse)
        return resp.settled

    def reenqueue(
        self,
        queue: str,
        original: str,
        ids: list[str],
        *,
        now: int = NOW,
        until: int = 0,
        commit: bool = False,
    ) -> None:
        items = [cqs_pb2.SplitItem(dto_type=DTO, dto_id=i) for i in ids]
        self.apply(
            Command(
                cqs_enqueue=internal_pb2.CqsEnqueue(
                    queue=queue,
                    original=original,
                    items=items,
                    now_ms=now,
                    visible_until_ms=until,
                    commit=commit,
                )
            )
        )

    def cqs_rows(self) -> list[tuple[bytes, bytes]]:
        return list(self.backend.table_rows("cqs"))

    def sections_bytes(self) -> int:
        return len(self.backend.sections() or b"")


def in_memory(sm: StateMachine) -> Machine:
    """A Machine with no backend (a cluster member): nothing to checkpoint."""
    m = Machine.__new__(Machine)
    m.sm, m.index = sm, sm.applied_index
    return m


def same(a: Machine, b: Machine) -> None:
    assert a.sm.export_state() == b.sm.export_state()
    assert a.sm.applied_index == b.sm.applied_index


def in_step(a: Machine, b: Machine, commands: list[internal_pb2.Command]) -> None:
    """Both machines answer the same commands the same way."""
    for command in commands:
        a.index += 1
        b.index += 1
        ra, _ = a.sm.apply(a.index, command)
        rb, _ = b.sm.apply(b.index, command)
        assert ra == rb, command
    same(a, b)


def store(n: int) -> str:
    return f"t/farmersmarket/s/store{n}"


def busy(m: Machine, rng: random.Random, rounds: int, tag: str) -> None:
    """Publications (merging duplicates too), grouped and plain dequeues, acks,
    releases, expiries, ReEnqueue with extension and commit, across two queues."""
    for r in range(rounds):
        for i in range(40):
            dto = f"{store(rng.randrange(5))}/esls/{rng.randrange(60)}"
            fields = {"tracking_id": f"{tag}-{r}-{i}"} if rng.random() < 0.5 else {}
            m.put(f"/q/dto:{DTO}/p/k", note(dto, rng.randrange(100), **fields))
        m.put(f"/q/dto:{DTO}/p/k", note(store(9), 3, alias_name="by_store"))
        m.put("/q/direct/p/x", note(f"{store(1)}/esls/d{r}", 7, dto_type="other.v1"))
        now = NOW + r * 1000
        held = m.dequeue("esl", f"{tag}{r}a-", max=7, now=now)
        m.settle("esl", held[:3], now=now)
        m.settle("esl", held[3:5], now=now, release=True)
        plain = m.dequeue("esl", f"{tag}{r}b-", max=5, depth=-1, now=now)
        if plain:
            m.reenqueue(
                "esl",
                plain[0],
                [f"{store(2)}/esls/split{r}-{j}" for j in range(3)],
                now=now,
                until=now + 2 * VIS,
            )
        if len(plain) > 1:
            m.reenqueue("esl", plain[1], [f"{store(3)}/esls/c{r}"], now=now, commit=True)
        m.dequeue("direct", f"{tag}{r}c-", max=2, depth=2, now=now)
        if r % 3 == 2:  # everything still held becomes visible again
            m.settle("esl", [], now=now + 3 * VIS)


def make(path: Path, *, honour_replace: bool = True) -> Machine:
    m = Machine(path, honour_replace=honour_replace)
    m.put("/q/esl/config", config((DTO, ""), (DTO, "by_store")))
    m.put("/q/direct/config", config((DTO, "nobody"), depth=2))
    return m


# -- round trips through the backend -------------------------------------------------


def test_a_restart_from_checkpoints_has_exactly_the_state_and_goes_on_alike(
    tmp_path: Path,
) -> None:
    rng = random.Random(23)
    m = make(tmp_path / "db")
    for step in range(4):
        busy(m, rng, 3, f"s{step}")
        m.checkpoint()
    busy(m, rng, 2, "tail")
    cp = m.checkpoint()
    assert cp.tables["cqs"], "the notifications went into the table"
    q = m.sm.cqs.queues["esl"]
    assert len(q.tree) > 100 and q.tree.in_flight > 0
    expected = m.sm.export_state()

    again = m.restarted()
    assert again.sm.export_state() == expected
    # a snapshot of the whole state folds the rows into the sections on a thread
    sections = snapshot.decode(again.backend.sections() or b"", "sections").state
    whole = sections_with_tables(sections, again.backend.table_rows)
    assert whole["cqs"] == expected["cqs"]

    # and it goes on as the state it was restored from does
    twin = in_memory(StateMachine())
    twin.sm.restore_state(expected)
    twin.index = twin.sm.applied_index
    later = NOW + 10**6
    in_step(
        again,
        twin,
        [
            Command(
                cqs_dequeue=internal_pb2.CqsDequeue(
                    queue="esl", max=9, now_ms=later, visible_until_ms=later + VIS, token_base="z-"
                )
            ),
            Command(cqs_settle=internal_pb2.CqsSettle(queue="esl", now_ms=later + 2 * VIS)),
            Command(
                cqs_dequeue=internal_pb2.CqsDequeue(
                    queue="direct", max=50, depth=-1, now_ms=later, token_base="y-"
                )
            ),
        ],
    )
    again.checkpoint()
    assert again.restarted().sm.export_state() == twin.sm.export_state()


def test_rows_are_keyed_by_queue_then_the_queue_order(tmp_path: Path) -> None:
    m = make(tmp_path / "db")
    busy(m, random.Random(5), 3, "k")
    m.checkpoint()
    rows = m.cqs_rows()
    cqs = m.sm.cqs
    by_table = {q.table_id.to_bytes(4, "big"): q for q in cqs.queues.values()}
    headers = [k for k, _ in rows if len(k) == 4]
    assert sorted(headers) == sorted(by_table)
    for table, q in by_table.items():
        assert dict(rows)[table] == q.name.encode()  # the header row: the queue's name
        mine = [k[4:] for k, _ in rows if k.startswith(table) and len(k) == 4 + KEY_BYTES]
        # a cursor walk of the queue's rows is its priority order
        held = {r.priority for r, _ in q.tree.in_flight_records()}
        walk = [key_priority(k) for k in mine]
        assert [p for p in walk if p not in held] == [r.priority for r in q.tree.pending()]
        assert set(walk) >= held and len(walk) == len(q.tree) + q.tree.in_flight
        # each queue's header row comes first of its rows
        keys = [k for k, _ in rows]
        assert keys.index(table) == min(i for i, k in enumerate(keys) if k.startswith(table))


def test_a_failed_checkpoint_loses_nothing(tmp_path: Path) -> None:
    rng = random.Random(7)
    m = make(tmp_path / "db")
    busy(m, rng, 2, "a")
    m.checkpoint()
    busy(m, rng, 2, "b")
    failed = m.sm.checkpoint()  # never written
    assert failed.tables["cqs"]
    busy(m, rng, 2, "c")  # newer changes, some to the same rows
    m.sm.checkpoint_failed(failed)
    busy(m, rng, 1, "d")
    m.checkpoint()
    expected = m.sm.export_state()
    assert m.restarted().sm.export_state() == expected


@pytest.mark.parametrize("honour_replace", [True, False])
def test_deleted_queues_and_full_restores_leave_no_rows_behind(
    tmp_path: Path, honour_replace: bool
) -> None:
    """A deleted queue's rows go through the journal; so do a fully restored
    state's old ones, even if the backend did not empty its tables (the
    checkpoint after a restore asks it to)."""
    rng = random.Random(11)
    m = make(tmp_path / "db", honour_replace=honour_replace)
    busy(m, rng, 2, "a")
    m.checkpoint()
    m.delete("/q/direct/config")  # gone with its rows
    m.put("/q/direct/config", config((DTO, "nobody"), depth=3))  # a new queue, same name
    m.put("/q/direct/p/x", note(f"{store(4)}/esls/new", 9, dto_type="other.v1"))
    m.checkpoint()

    def counted(m: Machine) -> int:
        return sum(len(q.tree) + q.tree.in_flight + 1 for q in m.sm.cqs.queues.values())

    assert len(m.cqs_rows()) == counted(m)
    again = m.restarted()
    assert again.sm.cqs.queues["direct"].tree.depth == 3
    assert len(again.sm.cqs.queues["direct"].tree) == 1

    # a full export restored over a state that keeps rows (a snapshot sent by a
    # leader, a data dir converted): the old rows go, the new ones come
    donor = StateMachine()
    donor.restore_state(again.sm.export_state())
    d = in_memory(donor)
    d.put("/q/other/config", config(("x.v1", "")))
    d.put("/q/dto:x.v1/p/k", note(f"{store(0)}/a", 1))
    d.delete("/q/direct/config")
    exported = donor.export_state()
    again.sm.restore_state(exported)
    again.index = again.sm.applied_index
    again.checkpoint()
    assert len(again.cqs_rows()) == counted(again)
    assert again.restarted().sm.export_state() == exported


def test_a_backend_with_notifications_in_its_sections_moves_them_to_rows(
    tmp_path: Path,
) -> None:
    """A backend checkpointed before the table was used (the sections held
    every notification) starts, and its next checkpoint moves them."""
    rng = random.Random(13)
    m = make(tmp_path / "db")
    busy(m, rng, 3, "a")
    expected = m.sm.export_state()
    sections = m.sm.export_sections()
    sections["cqs"] = m.sm.cqs.export_state()  # the old layout
    cp = m.sm.checkpoint()
    image = snapshot.encode(cp.index, sections)
    m.backend.commit(CommitBatch(cp.index, cp.writes, cp.dropped, image, {}))
    m.backend.renew_reader()
    m.sm.checkpoint_done()
    old_bytes = m.sections_bytes()
    assert m.cqs_rows() == []

    again = m.restarted()
    assert again.sm.export_state() == expected
    old = snapshot.decode(again.backend.sections() or b"", "sections").state
    assert sections_with_tables(old, again.backend.table_rows)["cqs"] == expected["cqs"]
    again.checkpoint()
    assert again.sections_bytes() < old_bytes / 4
    assert again.restarted().sm.export_state() == expected


def test_the_sections_image_does_not_grow_with_the_notifications(tmp_path: Path) -> None:
    m = make(tmp_path / "db")
    m.put(f"/q/dto:{DTO}/p/k", note(f"{store(0)}/esls/first", 1))
    m.checkpoint()
    small = m.sections_bytes()
    for i in range(3000):
        m.put(f"/q/dto:{DTO}/p/k", note(f"{store(i % 7)}/esls/{i}", i % 50, tracking_id=str(i)))
    m.dequeue("esl", "big-", max=100)
    cp = m.checkpoint()
    assert len(cp.tables["cqs"]) > 3000
    grown = m.sections_bytes()
    assert grown - small < 16, (small, grown)  # the seq counters' varints, no more
    assert sum(len(q["tree"]["pending"]) for q in cp.sections["cqs"]) == 0


def test_take_rows_hands_over_the_journal_as_it_is(tmp_path: Path) -> None:
    m = make(tmp_path / "db")
    m.put(f"/q/dto:{DTO}/p/k", note(f"{store(0)}/a", 1))
    (token,) = m.dequeue("esl", "t-", max=1)
    m.put(f"/q/dto:{DTO}/p/k", note(f"{store(0)}/b", 2))
    first = m.sm.cqs.take_rows()
    assert m.sm.cqs.take_rows() == {}  # taken: a new journal
    table = m.sm.cqs.queues["esl"].table_id.to_bytes(4, "big")
    assert first[table] == b"esl" and len(first) == 4  # two headers, two rows
    held = [k for k, v in first.items() if v is not None and token.encode() in v]
    assert len(held) == 1  # the dequeued one's row holds its token
    m.settle("esl", [token])
    assert m.sm.cqs.take_rows() == {held[0]: None}  # acknowledged: gone
    assert m.sm.cqs.take_rows() == {}


def test_without_a_backend_nothing_is_journaled_and_the_sections_are_whole() -> None:
    assert CqsState().take_rows() == {}
    sm = StateMachine()
    m = in_memory(sm)
    m.put("/q/esl/config", config((DTO, "")))
    m.put(f"/q/dto:{DTO}/p/k", note(f"{store(0)}/a", 1))
    assert sm.cqs.take_rows() == {}
    assert sm.cqs.export_sections()[0]["tree"]["pending"]


def test_damaged_rows_refuse_the_restore(tmp_path: Path) -> None:
    m = make(tmp_path / "db")
    m.put(f"/q/dto:{DTO}/p/k", note(f"{store(0)}/a", 1))
    m.checkpoint()
    sections = snapshot.decode(m.backend.sections() or b"", "x").state
    rows = m.cqs_rows()
    header = next(k for k, _ in rows if len(k) == 4)

    def restore(rows: list[tuple[bytes, bytes]]) -> None:
        sm = StateMachine()
        sm.restore_state(sections, iter(()), lambda name: iter(rows if name == "cqs" else []))

    restore(rows)
    with pytest.raises(DamagedRow, match="do not have"):
        restore([((99).to_bytes(4, "big"), b"nope"), *rows])
    with pytest.raises(DamagedRow, match="of no queue"):
        restore([(b"\x00\x00\x00\x63" + bytes(KEY_BYTES), b"\x00")])
    body = [(k, v) for k, v in rows if len(k) > 4]
    with pytest.raises(DamagedRow):
        restore([(header, dict(rows)[header]), (body[0][0], body[0][1][:3])])


def test_journaled_rows_start_a_checkpoint_before_the_entries_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of notifications moves no key revision, and a ReEnqueue entry
    carries a thousand of them: the journal's size starts checkpoints too, so
    it stays bounded."""
    monkeypatch.setattr(local_log, "CHECKPOINT_BYTES", 100 * JOURNALED_ROW_BYTES)

    async def load() -> None:
        sm, log, _ = open_log(tmp_path, snapshot_count=10**6)
        await propose_all(log, [put(b"/q/esl/config", config((DTO, "")))])
        for i in range(0, 1000, 50):
            notes = [note(f"{store(j % 3)}/esls/{j}", j % 60) for j in range(i, i + 50)]
            await propose_all(log, [put(f"/q/dto:{DTO}/p/k".encode(), n) for n in notes])
            await settled(log)
            assert sm.pending_bytes <= 150 * JOURNALED_ROW_BYTES
        assert log.checkpoints >= 6  # 1,001 entries: none would have started by entries
        expected = sm.export_state()
        await log.close()
        again, log, _ = open_log(tmp_path)
        assert again.export_state() == expected
        await log.close()

    asyncio.run(load())
