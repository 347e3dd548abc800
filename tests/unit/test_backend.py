"""Unit tests of the LMDB backend under the local log: refused starts, torn
tails, migration from snapshot files, crashes, HashKV, the etcd export,
defragmenting and reads while a checkpoint is in flight.

Everything runs in this process on a real LMDB environment in `tmp_path`; a
crash is `tests.support.local_logs.die` (the loop stops for good, the disk
calls in flight finish, no close()). The only fake is at the disk's edge: a
backend whose commit can be held at the door, so that a crash, a read or a
defragment can land just before or just after one.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Any, cast

import lmdb
import pytest

from etcdserverpb import rpc_pb2
from queue_server.apply import Applier, StateMachine
from queue_server.errors import Compacted
from queue_server.local_log import BackendBehindLogError, LocalLog
from queue_server.mvcc.store import ALL_KEYS_END
from queue_server.proposals import ApplyResult
from queue_server.storage import etcd_backend
from queue_server.storage.backend import DB_DIR, Backend, CommitBatch
from queue_server.storage.snapshot import CorruptSnapshotError
from tests.support.local_logs import (
    WAIT,
    Command,
    die,
    files,
    legacy_data_dir,
    open_log,
    propose_all,
    put,
    replayed,
    same_state,
    settled,
)
from tests.support.mixed_load import MixedLoad, describe_result

pytestmark = pytest.mark.unit


class Died(BaseException):
    """The process died while this thread was in a call: nothing after it ran."""


class DoorBackend(Backend):
    """A real backend whose next commit can be held at the door: the test lets
    the process die there, before the commit (nothing written) or right after
    it (written, but the loop never hears of it)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.hold = False
        self.held = threading.Event()
        self.go = threading.Event()
        self.die_before = False
        self.die_after = False

    def commit(self, batch: CommitBatch) -> None:
        if self.hold:
            self.held.set()
            assert self.go.wait(WAIT)
            if self.die_before:
                raise Died()
        super().commit(batch)
        if self.die_after:
            raise Died()


# -- refused starts -------------------------------------------------------------------


def backend_older_than_the_wal(data_dir: Path) -> None:
    """An old copy of the backend put back (a restored backup) under a WAL
    trimmed since: the backend at 10, the WAL starting at 31."""

    async def first() -> None:
        _sm, log, _ = open_log(data_dir)
        await propose_all(log, [put(b"k%02d" % i) for i in range(10)])
        await log.close()

    async def second() -> None:
        _sm, log, _ = open_log(data_dir, snapshot_count=5)
        for first in range(10, 30, 5):
            await propose_all(log, [put(b"k%02d" % i) for i in range(first, first + 5)])
            await settled(log)
        assert log.checkpoints == 4
        await log.close()

    asyncio.run(first())
    db = data_dir / DB_DIR
    shutil.copytree(db, data_dir / "backup")
    asyncio.run(second())
    assert [p.name for p in (data_dir / "wal").iterdir()] == [f"{31:020d}.log"]
    shutil.rmtree(db)
    shutil.copytree(data_dir / "backup", db)


def backend_ahead_of_the_wal(data_dir: Path, wal: str) -> None:
    """The backend at 20 over a WAL that lost records it applied: emptied, or
    an older copy (ending at 10) put back."""

    async def life() -> None:
        _sm, log, _ = open_log(data_dir)
        await propose_all(log, [put(b"k%02d" % i) for i in range(10)])
        shutil.copytree(data_dir / "wal", data_dir / "wal-at-10")
        await propose_all(log, [put(b"k%02d" % i) for i in range(10, 20)])
        await log.checkpoint_now()
        assert log.backend.consistent_index == 20
        await log.close()

    asyncio.run(life())
    shutil.rmtree(data_dir / "wal")
    if wal == "emptied":
        os.mkdir(data_dir / "wal")
    else:
        os.rename(data_dir / "wal-at-10", data_dir / "wal")


def test_a_backend_older_than_the_wal_is_refused(tmp_path: Path) -> None:
    backend_older_than_the_wal(tmp_path)
    wal_before = files(str(tmp_path / "wal"))
    sm = StateMachine()
    log = LocalLog(str(tmp_path), Applier(sm))
    with pytest.raises(
        BackendBehindLogError,
        match=r"holds the state at index 10, older than the WAL's first record.*refusing",
    ):
        log.recover()
    # nothing was cut or changed on the way to the refusal
    assert files(str(tmp_path / "wal")) == wal_before
    assert log.backend.consistent_index == 10
    log.backend.close()


@pytest.mark.parametrize("wal", ["emptied", "older copy"])
def test_a_backend_ahead_of_the_wal_is_refused(tmp_path: Path, wal: str) -> None:
    """The next index would be given twice: refused."""
    backend_ahead_of_the_wal(tmp_path, wal)
    log = LocalLog(str(tmp_path), Applier(StateMachine()))
    ends = 0 if wal == "emptied" else 10
    with pytest.raises(
        BackendBehindLogError,
        match=rf"holds the state at index 20, ahead of the WAL, which ends at index {ends}.*refusing",
    ):
        log.recover()
    log.backend.close()


REFUSALS = {
    "backend older": (backend_older_than_the_wal, BackendBehindLogError, "older than the WAL"),
    "backend ahead": (
        lambda d: backend_ahead_of_the_wal(d, "emptied"),
        BackendBehindLogError,
        "ahead of the WAL",
    ),
    "broken snapshot": (
        lambda d: broken_legacy_dir(d),
        CorruptSnapshotError,
        "no older snapshot can replace it",
    ),
}


def broken_legacy_dir(data_dir: Path) -> None:
    """A data dir of snapshot files whose newest is damaged, the WAL trimmed
    past the older one: nothing can stand in for the damaged one."""
    legacy_data_dir(data_dir, [put(b"k%03d" % i) for i in range(120)], snapshots=[50, 100])
    newest = data_dir / "snap" / f"{100:020d}.snap"
    data = newest.read_bytes()
    newest.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refused_start_stays_refused_after_the_log_is_closed(
    tmp_path: Path, refusal: str
) -> None:
    """A server whose start failed stops what it opened (cli.serve calls
    server.stop after a failed start, which closes the log): that close must
    write nothing, or the next start would not see what the first refused
    (a checkpoint of the half-recovered state and a fresh WAL segment would
    make the backend and the WAL meet again, and a restart would serve a
    state with acknowledged writes missing)."""
    build, error, says = REFUSALS[refusal]
    build(tmp_path)
    log = LocalLog(str(tmp_path), Applier(StateMachine()))
    with pytest.raises(error, match=says):
        log.recover()
    on_disk = files(str(tmp_path))
    asyncio.run(asyncio.wait_for(log.close(), WAIT))
    assert files(str(tmp_path)) == on_disk
    again = LocalLog(str(tmp_path), Applier(StateMachine()))
    with pytest.raises(error, match=says):
        again.recover()
    again.backend.close()


def test_a_torn_wal_tail_after_a_checkpoint_is_cut(tmp_path: Path) -> None:
    """A crash tore the last record written after the last checkpoint: it is
    cut, and the state is the checkpoint plus the good records after it."""
    commands = [put(b"k%02d" % i, b"v%d" % i) for i in range(15)]

    async def life() -> None:
        _sm, log, _ = open_log(tmp_path)
        await propose_all(log, commands[:10])
        await log.checkpoint_now()
        for command in commands[10:]:  # one record each, the last one at the end
            await asyncio.wait_for(log.propose(command), WAIT)
        die(log)

    asyncio.run(life())
    (segment,) = (tmp_path / "wal").glob("*.log")
    assert int(segment.stem) == 11  # the checkpoint at 10 trimmed the rest
    segment.write_bytes(segment.read_bytes()[:-3])

    async def after() -> None:
        sm, log, applier = open_log(tmp_path)
        assert log.wal.recovery.dropped_bytes > 0
        assert applier.indexes == [11, 12, 13, 14]  # the checkpoint, then the good tail
        same_state(sm, replayed(commands[:14]))
        # the next record takes the torn one's place
        result = await asyncio.wait_for(log.propose(commands[14]), WAIT)
        assert isinstance(result, rpc_pb2.PutResponse) and result.header.revision == 16
        await log.close()

    asyncio.run(after())
    sm, _log, applier = open_log(tmp_path)
    assert applier.indexes == []
    same_state(sm, replayed(commands))


# -- migration --------------------------------------------------------------------------


def test_a_legacy_data_dir_is_converted_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    load = MixedLoad(seed=23)
    commands = load.take(400)
    legacy_data_dir(tmp_path, commands, snapshots=[150, 300])
    assert sorted(int(p.stem) for p in (tmp_path / "wal").glob("*.log")) == [301]
    want = load.model

    async def first() -> None:
        with caplog.at_level(logging.WARNING):
            sm, log, applier = open_log(tmp_path)
        assert "data dir converted" in caplog.text
        assert applier.indexes == list(range(301, len(commands) + 1))  # only the tail
        assert log.backend.consistent_index == len(commands)
        same_state(sm, want)
        assert await log.hash_kv(0) == want.store.hash_kv()
        await log.close()

    asyncio.run(first())
    assert not (tmp_path / "snap").exists()
    converted = sorted(p.name for p in (tmp_path / "snap.converted").iterdir())
    assert converted == [f"{150:020d}.snap", f"{300:020d}.snap"]  # kept, never read again

    caplog.clear()

    async def second() -> None:
        with caplog.at_level(logging.INFO):
            sm, log, applier = open_log(tmp_path)
        assert "converted" not in caplog.text
        assert applier.indexes == []  # the backend holds it all
        same_state(sm, want)
        for revision in (0, want.store.compact_revision, want.store.revision - 7):
            assert await log.hash_kv(revision) == want.store.hash_kv(revision)
        await log.close()

    asyncio.run(second())
    assert not (tmp_path / "snap").exists()


@pytest.mark.parametrize("moment", ["before its commit", "after its commit"])
def test_a_conversion_cut_short_by_a_crash_is_not_lost(tmp_path: Path, moment: str) -> None:
    """A crash in the conversion's checkpoint leaves the data dir as it was
    (the next start converts it); a crash right after it, before `snap/` is
    renamed, leaves the backend holding it all (the next start reads it)."""
    load = MixedLoad(seed=5)
    commands = load.take(200)
    legacy_data_dir(tmp_path, commands, snapshots=[120])
    sm = StateMachine()
    backend = DoorBackend(os.path.join(tmp_path, DB_DIR))
    backend.hold = True
    backend.go.set()  # the commit runs on recover()'s own thread: no waiting at the door
    backend.die_before = moment == "before its commit"
    backend.die_after = not backend.die_before
    sm.use_backend(backend)
    log = LocalLog(str(tmp_path), Applier(sm))
    with pytest.raises(Died):
        log.recover()
    die(log)
    assert (tmp_path / "snap").is_dir()
    again, log, applier = open_log(tmp_path)
    if moment == "before its commit":
        assert applier.indexes == list(range(121, len(commands) + 1))
        assert not (tmp_path / "snap").exists() and (tmp_path / "snap.converted").is_dir()
    else:
        assert applier.indexes == []
    assert log.backend.consistent_index == len(commands)
    same_state(again, load.model)
    die(log)


# -- crashes ----------------------------------------------------------------------------


def live_and_die(
    data_dir: Path,
    commands: list[Command],
    results: list[tuple[str, bytes | str]],
    rng: random.Random,
    moment: str,
) -> int:
    """One life of a log under `commands` (from where the last life left off)
    until it dies at `moment` ("anywhere", "before commit", "after commit").
    Checks every answer it gave; returns the index it had applied when it died
    (all durable: nothing is applied before it is)."""
    problems: list[dict[str, Any]] = []

    def on_error(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "was destroyed but it is pending" not in context.get("message", ""):
            problems.append(context)  # the dead loop's tasks are dropped: expected

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(on_error)
    sm = StateMachine()
    backend = DoorBackend(os.path.join(data_dir, DB_DIR))
    sm.use_backend(backend)
    log = LocalLog(str(data_dir), Applier(sm), snapshot_count=rng.randint(5, 40))
    log.recover()
    start = sm.applied_index
    kill_after = rng.randint(1, max(1, (len(commands) - start) // 2))
    window = rng.choice([1, 4, 16, 64])
    tasks: dict[asyncio.Task[ApplyResult], int] = {}

    async def load() -> None:
        acked = 0
        for index in range(start + 1, len(commands) + 1):
            tasks[loop.create_task(log.propose(commands[index - 1]))] = index
            while sum(not t.done() for t in tasks) >= window or rng.random() < 0.2:
                running = [t for t in tasks if not t.done()]
                if not running:
                    break
                done, _ = await asyncio.wait(running, timeout=WAIT, return_when="FIRST_COMPLETED")
                assert done, "no answer within the bound"
                acked += len(done)
            if acked < kill_after:
                continue
            if moment == "anywhere":
                # a few more on their way to the disk as it dies (or not yet)
                for later in range(index + 1, min(index + rng.randint(0, 8), len(commands)) + 1):
                    tasks[loop.create_task(log.propose(commands[later - 1]))] = later
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)  # a turn of the loop: the flusher may start a write
                return
            if backend.hold and log._checkpoint is not None:
                return  # started since the door closed: it is at the door (or on its way)
            if not backend.hold and log._checkpoint is None:
                backend.hold = True  # the next checkpoint is held at the door
        if moment != "anywhere":  # the load ran out first: one more checkpoint, held
            if not backend.hold:
                if log._checkpoint is not None:
                    await asyncio.wait_for(asyncio.shield(log._checkpoint), WAIT)
                backend.hold = True
            if log._checkpoint is None:
                log._start_checkpoint()

    loop.run_until_complete(asyncio.wait_for(load(), 4 * WAIT))
    # -- the process dies here: the loop never runs again --
    died_at = sm.applied_index
    if moment != "anywhere":
        assert backend.held.wait(WAIT), "no checkpoint reached the door"
        backend.die_before = moment == "before commit"
        backend.go.set()
    answered = {index: t.result() for t, index in tasks.items() if t.done()}
    for index, result in answered.items():
        assert describe_result(result) == results[index - 1], f"answer at index {index}"
    assert all(index <= died_at for index in answered)
    die(log, loop)
    assert not problems, problems
    return died_at


@pytest.mark.parametrize("seed", range(4))
def test_a_crash_loses_nothing_acknowledged(tmp_path: Path, seed: int) -> None:
    """Lives under mixed load, each ended by a crash at a random moment: while
    proposals and checkpoints are in flight, just before a checkpoint commits,
    just after. Every restart holds everything that was applied (and so
    everything acknowledged), and is the state the same commands give in
    memory, with the same HashKV."""
    rng = random.Random(seed)
    load = MixedLoad(seed)
    commands = load.take(500)
    for moment in ("anywhere", "before commit", "after commit", "anywhere"):
        died_at = live_and_die(tmp_path, commands, load.results, rng, moment)
        sm, log, applier = open_log(tmp_path)
        assert sm.applied_index >= died_at, f"lost what was applied, dying {moment}"
        assert applier.indexes == list(
            range(log.backend.consistent_index + 1, sm.applied_index + 1)
        )
        same_state(sm, replayed(commands[: sm.applied_index]))
        die(log)


# -- reads of the whole state -----------------------------------------------------------


async def test_hash_kv_is_the_in_memory_stores(tmp_path: Path) -> None:
    """LocalLog.hash_kv (computed on a thread from the backend) equals the
    in-memory store's at every revision kept, before and after compactions."""
    load = MixedLoad(seed=7)
    commands = load.take(600)
    sm, log, _ = open_log(tmp_path, snapshot_count=64)
    memory = StateMachine()
    compactions = 0
    for first in range(0, len(commands), 100):
        batch = commands[first : first + 100]
        await propose_all(log, batch)
        for index, command in enumerate(batch, first + 1):
            memory.apply(index, command)
            compactions += command.WhichOneof("op") == "compaction"
        store = memory.store
        low = max(store.compact_revision, 1)
        for revision in {0, low, (low + store.revision) // 2, store.revision}:
            assert await log.hash_kv(revision) == store.hash_kv(revision), revision
        if store.compact_revision > 1:
            with pytest.raises(Compacted):
                await log.hash_kv(store.compact_revision - 1)
    assert compactions >= 3
    # a compaction of everything but the present, then the hash again
    last = put(b"last")
    compaction = Command(compaction=rpc_pb2.CompactionRequest(revision=sm.store.revision + 1))
    results = await propose_all(log, [last, compaction])
    memory.apply(len(commands) + 1, last)
    memory.apply(len(commands) + 2, compaction)
    assert isinstance(results[1], rpc_pb2.CompactionResponse)
    assert await log.hash_kv(0) == memory.store.hash_kv(0) == sm.store.hash_kv(0)
    await log.close()


async def test_the_etcd_export_reads_back_as_the_state(tmp_path: Path) -> None:
    """Maintenance.Snapshot's bbolt file, written from a backend read
    transaction, is the state: read back it equals export_state()."""
    load = MixedLoad(seed=11)
    commands = load.take(500)
    sm, log, _ = open_log(tmp_path, snapshot_count=50)
    await propose_all(log, commands[:300])
    for command in commands[300:]:
        await asyncio.wait_for(log.propose(command), WAIT)
    out = io.BytesIO()
    size = await log.export_etcd_db(out)
    data = out.getvalue()
    assert size == len(data) and etcd_backend.is_bbolt(data[:4096])
    contents = etcd_backend.read_etcd_db(data, "export")
    assert contents.index == sm.applied_index == len(commands)
    assert contents.state == sm.export_state() == load.model.export_state()
    # and it is the file the state in memory makes
    memory = io.BytesIO()
    etcd_backend.write_etcd_db(memory, len(commands), load.model.export_state())
    assert etcd_backend.read_etcd_db(memory.getvalue(), "memory").state == contents.state
    await log.close()


def all_revisions(sm: StateMachine) -> list[Any]:
    """Every readable revision's whole range, and every event since the
    compaction: what any read could see."""
    store = sm.store
    low = max(store.compact_revision, 1)
    ranges = [
        store.range(b"\x00", ALL_KEYS_END, revision=r).kvs for r in range(low, store.revision + 1)
    ]
    events = [
        (e.is_delete, e.kv, e.prev_kv)
        for e in store.events_between(b"\x00", ALL_KEYS_END, low, store.revision)
    ]
    return [ranges, events]


async def test_defragment_shrinks_the_file_and_reads_the_same(tmp_path: Path) -> None:
    sm, log, _ = open_log(tmp_path)
    for round_ in range(10):
        await propose_all(log, [put(b"k%03d" % i, b"%d" % round_ * 400) for i in range(300)])
    await log.checkpoint_now()
    await log.propose(Command(compaction=rpc_pb2.CompactionRequest(revision=sm.store.revision)))
    await log.checkpoint_now()
    before = log.backend.file_bytes
    reads = all_revisions(sm)
    state = sm.export_state()
    await asyncio.wait_for(log.defragment(), WAIT)
    assert log.backend.file_bytes < before / 4, (before, log.backend.file_bytes)
    assert log.backend.in_use_bytes <= log.backend.file_bytes
    assert all_revisions(sm) == reads
    assert sm.export_state() == state
    assert await log.hash_kv(0) == sm.store.hash_kv(0)
    # writes go on, on the new file, and survive a restart
    await propose_all(log, [put(b"after%d" % i) for i in range(10)])
    reads, state = all_revisions(sm), sm.export_state()
    await log.close()
    again, log, applier = open_log(tmp_path)
    assert applier.indexes == []
    assert all_revisions(again) == reads and again.export_state() == state
    await log.close()


async def test_reads_while_a_checkpoint_is_in_flight_see_every_value(tmp_path: Path) -> None:
    """From the moment a checkpoint takes the revisions to the moment the loop's
    reader sees them committed, every read still finds every value, while
    writes and a compaction go on: with the commit held at the door, then done
    on its thread but not yet heard of on the loop, then finished."""
    sm = StateMachine()
    backend = DoorBackend(os.path.join(tmp_path, DB_DIR))
    sm.use_backend(backend)
    log = LocalLog(str(tmp_path), Applier(sm))
    log.recover()
    memory = StateMachine()
    commands: list[Command] = []

    async def propose(batch: list[Command]) -> None:
        await propose_all(log, batch)
        for command in batch:
            commands.append(command)
            memory.apply(len(commands), command)

    def same_reads() -> None:
        assert all_revisions(sm) == all_revisions(memory)
        assert sm.store.hash_kv() == memory.store.hash_kv()

    await propose([put(b"k%02d" % (i % 40), b"first %d" % i) for i in range(100)])
    await log.checkpoint_now()  # some values in the backend,
    await propose([put(b"k%02d" % (i % 60), b"second %d" % i) for i in range(100)])  # some not
    backend.hold = True
    checkpoint = log._start_checkpoint()  # taken on the loop; the commit runs on its thread
    assert backend.held.wait(WAIT)
    backend.hold = False  # (for the commits after this one)
    same_reads()
    await propose([put(b"k%02d" % (i % 50), b"third %d" % i) for i in range(30)])
    await propose([Command(compaction=rpc_pb2.CompactionRequest(revision=150))])
    same_reads()
    backend.go.set()
    log._backend_thread.submit(int).result(timeout=WAIT)  # committed; the loop has not heard
    txn = backend.begin_read()
    assert backend.consistent_index == 100 and backend.consistent_index_in(txn) == 200
    txn.abort()
    same_reads()
    assert await asyncio.wait_for(checkpoint, WAIT)
    assert backend.consistent_index == 200
    same_reads()
    await log.checkpoint_now()  # the compaction's deletes too
    same_reads()
    await log.close()
    again, log, _ = open_log(tmp_path)
    same_state(again, memory)
    await log.close()


# -- defragmenting while the server serves ----------------------------------------------


class WatchedTxn:
    """A read transaction that tells its backend when it ends."""

    def __init__(self, txn: lmdb.Transaction, backend: WatchedBackend) -> None:
        self._txn = txn
        self._backend = backend
        self._open = True

    def abort(self) -> None:
        if self._open:
            self._open = False
            with self._backend.lock:
                self._backend.open_reads -= 1
        self._txn.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


class WatchedBackend(Backend):
    """A real backend that notes what a defragment must never meet: a commit
    between the start of its copy and the end of the swap (it would be lost
    with the old file, or run on a closed one), and read transactions still
    open when the file is swapped (closing the environment ends them under
    the thread reading). Its copy can be held at the door."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.lock = threading.Lock()
        self.open_reads = 0
        self.defragmenting = False
        self.hold_copy = False
        self.copy_started = threading.Event()
        self.copy_go = threading.Event()
        self.copied = threading.Event()
        self.met: list[str] = []

    def begin_read(self) -> lmdb.Transaction:
        with self.lock:
            self.open_reads += 1
        return cast(lmdb.Transaction, WatchedTxn(super().begin_read(), self))

    def commit(self, batch: CommitBatch) -> None:
        if self.defragmenting:
            self.met.append(f"a commit at index {batch.index} while defragmenting")
        super().commit(batch)

    def copy_compacted(self, into: str) -> None:
        self.defragmenting = True
        self.copy_started.set()
        if self.hold_copy:
            assert self.copy_go.wait(WAIT)
        super().copy_compacted(into)
        self.copied.set()

    def swap_in(self, copied: str) -> None:
        if self.open_reads:
            self.met.append(f"{self.open_reads} read transaction(s) open at the swap")
        super().swap_in(copied)
        self.defragmenting = False


class Mirror:
    """A LocalLog on a WatchedBackend and the same commands in memory."""

    def __init__(self, data_dir: Path) -> None:
        self.sm = StateMachine()
        self.backend = WatchedBackend(os.path.join(data_dir, DB_DIR))
        self.sm.use_backend(self.backend)
        self.log = LocalLog(str(data_dir), Applier(self.sm))
        self.log.recover()
        self.commands: list[Command] = []
        self.memory = StateMachine()

    async def propose(self, commands: list[Command]) -> None:
        await propose_all(self.log, commands)
        for command in commands:
            self.commands.append(command)
            self.memory.apply(len(self.commands), command)

    def check_export(self, data: bytes) -> None:
        contents = etcd_backend.read_etcd_db(data, "export")
        assert contents.state == replayed(self.commands[: contents.index]).export_state()


async def in_thread(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, WAIT)


async def test_a_defragment_holds_the_checkpoints_asked_for_meanwhile(tmp_path: Path) -> None:
    """While the copy is taken, writes go on, and a checkpoint, a HashKV and a
    Snapshot (each one a checkpoint first) and a second Defragment are asked
    for: their commits wait for the swap, and every answer is right."""
    m = Mirror(tmp_path)
    await m.propose([put(b"k%03d" % (i % 200), b"%d" % i * 100) for i in range(600)])
    await m.log.checkpoint_now()
    m.backend.hold_copy = True
    defragment = asyncio.ensure_future(m.log.defragment())
    await in_thread(m.backend.copy_started)
    await m.propose([put(b"during%d" % i) for i in range(50)])  # writes go on
    revision = m.sm.store.revision
    out = io.BytesIO()
    asked = [
        asyncio.ensure_future(m.log.checkpoint_now()),
        asyncio.ensure_future(m.log.hash_kv(revision)),
        asyncio.ensure_future(m.log.export_etcd_db(out)),
        asyncio.ensure_future(m.log.defragment()),
    ]
    await m.propose([put(b"more%d" % i) for i in range(50)])
    m.backend.hold_copy = False
    m.backend.copy_go.set()
    await asyncio.wait_for(defragment, WAIT)
    _, hashed, _, _ = await asyncio.wait_for(asyncio.gather(*asked), WAIT)
    assert m.backend.met == []
    assert hashed == m.memory.store.hash_kv(revision)
    m.check_export(out.getvalue())
    assert all_revisions(m.sm) == all_revisions(m.memory)
    await m.log.close()
    again, log, _ = open_log(tmp_path)
    same_state(again, m.memory)
    await log.close()


class HeldFile(io.BytesIO):
    """A file whose first write waits (bounded) for `go`: a Snapshot stream
    whose client reads slowly."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = threading.Event()
        self.go = threading.Event()

    def write(self, data: Any) -> int:
        if not self.writing.is_set():
            self.writing.set()
            assert self.go.wait(WAIT)
        return super().write(data)


async def test_a_defragment_waits_for_the_reads_in_flight(tmp_path: Path) -> None:
    """A Snapshot stream (and a HashKV) reading on a thread when a Defragment
    comes: the file is swapped only once they have read what they need."""
    m = Mirror(tmp_path)
    await m.propose([put(b"k%04d" % i, b"%d" % i * 20) for i in range(5000)])
    out = HeldFile()
    export = asyncio.ensure_future(m.log.export_etcd_db(out))
    await in_thread(out.writing)  # its read transaction is open on its thread
    defragment = asyncio.ensure_future(m.log.defragment())
    await in_thread(m.backend.copy_started)
    # the copy is taken from a read transaction of its own: the stream goes on
    await in_thread(m.backend.copied)
    out.go.set()
    await asyncio.wait_for(export, WAIT)
    await asyncio.wait_for(defragment, WAIT)
    assert m.backend.met == []
    m.check_export(out.getvalue())
    assert await m.log.hash_kv(0) == m.memory.store.hash_kv()
    await m.log.close()


async def test_a_defragment_cut_short_leaves_nothing_in_the_way(tmp_path: Path) -> None:
    """A crash between a defragment's copy and its swap (or a copy the disk
    cut short) leaves the copy behind: the next defragment still runs."""
    sm, log, _ = open_log(tmp_path)
    await propose_all(log, [put(b"k%03d" % i) for i in range(100)])
    leftover = tmp_path / (DB_DIR + ".defrag")
    leftover.mkdir()
    (leftover / "data.mdb").write_bytes(b"the first pages of a copy")
    state = sm.export_state()
    await asyncio.wait_for(log.defragment(), WAIT)
    assert not leftover.exists()
    assert sm.export_state() == state
    await log.close()
