"""The single-node log: durable proposals with group commit, snapshots, recovery.

`LocalLog.propose(command)` resolves once the command is on disk and applied, with
the state machine's result. This is the embedded default; the cluster puts a Raft
log behind the same `propose` so the servicers do not change.

Theory of operation
-------------------
Proposals made while a write is in flight wait in `_pending`. One flusher task
takes everything pending as one batch, hands the encoded records to the writer
thread (one write + one fdatasync for the whole batch: group commit; a small
batch with nothing else waiting is written on the loop itself, which is idle
then anyway), and, when the thread reports them durable, starts the next
batch's write and meanwhile applies the durable one in index order on the event
loop and resolves each proposal's future. Nothing is applied before it is durable, so
no reader ever sees a write that a crash could take back.

The applied state lives in the LMDB backend (`storage/backend.py`). Every
`snapshot_count` applied entries, or once `CHECKPOINT_BYTES` of key revisions
and CQS rows wait, a checkpoint takes the store's pending revisions and the other sections
(on the loop: the queues, CQS, leases, auth, members and alarms, not the key
space) and the backend thread writes them in one LMDB transaction with the
applied index, fsynced. Meanwhile the loop goes on applying and serving: the
revisions being written stay readable in memory until the loop's reader sees
them. When the checkpoint is durable, the WAL writer rotates the log and
deletes the segments it covers. Startup opens the backend, rebuilds the
in-memory index by one scan, and replays the WAL after the backend's
consistent index. A data dir of the earlier format (snapshot files, `snap/`)
is read once the old way, checkpointed into the backend, and its `snap/` is
renamed `snap.converted`.

A full disk is an expected condition, not a crash: the WAL cuts off the partial
write, the batch and everything pending fail with etcd's `NoSpace`, and
`on_no_space` (the server raises the NOSPACE alarm, in memory since the log has
no room for it) puts the state machine in capped mode until an operator frees
space and disarms. Any other write or fsync error stops all writes for good.

Only bytes (the encoded records, and the index they end at) cross to the WAL
writer thread, which also rotates and trims the segments. The backend thread
gets a `Checkpoint`: dicts of the key revisions and of each table's changed
rows, the revisions compaction dropped, and the plain-data sections, which the
loop no longer touches once handed over (the store keeps only reads of the
revisions). Snapshot and HashKV read the backend on other threads, each over a
read transaction of its own, and Defragment copies the file on the backend thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import lmdb

from etcdserverpb import internal_pb2
from queue_server.admission import MAX_UNAPPLIED, too_large
from queue_server.apply import (
    Applier,
    ApplyFailed,
    Checkpoint,
    sections_with_tables,
)
from queue_server.errors import NoSpace, RequestTooLarge, ServerStopped, TooManyRequests
from queue_server.proposals import ApplyResult
from queue_server.storage import etcd_backend, snapshot
from queue_server.storage.backend import DB_DIR, Backend, CommitBatch
from queue_server.storage.revisions import position
from queue_server.storage.snapshot import CorruptSnapshotError, SnapshotStore
from queue_server.storage.wal import WALFullError, WALGapError, WriteAheadLog

log = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_SNAPSHOT_COUNT = 100_000
"""Applied entries between checkpoints: etcd 3.5's --snapshot-count default. It
bounds replay time at restart and the log's size on disk."""

CHECKPOINT_BYTES = 64 << 20
"""Estimated bytes of key revisions and journaled CQS rows waiting in memory
(`StateMachine.pending_bytes`) past which a checkpoint starts before
`snapshot_count` entries: bounds the memory a load of large values, or of
notifications (a ReEnqueue entry carries a thousand), holds between checkpoints (etcd's backend commits every 100 ms or
10,000 writes; ours is bounded by bytes and entries instead, since each
checkpoint also writes the queue sections)."""


CHECKPOINT_SMALL_ENTRIES = 10_000
"""Entries after which a checkpoint starts anyway while the sections are cheap to
export (the last export took under `CHEAP_SECTIONS_SECONDS`): etcd's backend
batch limit. Small checkpoints keep each commit's work on the backend thread
(and the GIL it takes from the loop) short, and restarts replay little."""

CHEAP_SECTIONS_SECONDS = 0.002
"""An export of the queue and CQS sections this fast costs the loop nothing
worth counting; a slower one (a large queue state) waits for `snapshot_count`."""


class BackendBehindLogError(RuntimeError):
    """The backend and the WAL do not meet: the backend is older than the WAL's
    first record, or ahead of its last one. Starting would serve a state with
    writes missing or doubled."""


INLINE_BATCH = 1
"""A batch this small is written and fsynced on the event loop itself: the loop
has nothing else waiting, and two thread hand-offs cost more than the fsync
(measured: about 10% less server CPU per put at 1 in flight)."""

MAX_BATCH = 4096
"""Most records per group commit: bounds the latency one batch adds to the next."""


@dataclass(slots=True)
class _Proposal:
    index: int
    command: internal_pb2.Command
    record: bytes  # the encoded WAL record
    future: asyncio.Future[ApplyResult]


class LocalLog:
    """A durable log on one node, feeding one `StateMachine` whose state lives
    in `backend` (the state machine's own)."""

    def __init__(
        self,
        data_dir: str,
        applier: Applier,
        *,
        fsync: bool = True,
        snapshot_count: int = DEFAULT_SNAPSHOT_COUNT,
        max_request_bytes: int = 1_572_864,
    ) -> None:
        self.applier = applier
        self.state_machine = applier.state
        backend = applier.state.backend
        if backend is None:  # the state machine is new: its backend is in the data dir
            backend = Backend(os.path.join(data_dir, DB_DIR), fsync=fsync)
            applier.state.use_backend(backend)
        if not isinstance(backend, Backend):
            raise TypeError("the local log needs a state machine on a storage.backend.Backend")
        self.backend = backend
        self.data_dir = data_dir
        self.max_request_bytes = max_request_bytes
        self.snapshot_count = snapshot_count
        self.fsync = fsync
        self.wal = WriteAheadLog(os.path.join(data_dir, "wal"), fsync=fsync)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wal-writer")
        self._backend_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backend")
        self._pending: list[_Proposal] = []
        self._flusher: asyncio.Task[None] | None = None
        self._next_index = 0
        self._checkpoint_index = 0  # the backend's consistent index
        self._checkpoint: asyncio.Task[bool] | None = None  # one in flight at a time
        self._sections_seconds = 0.0  # how long the last checkpoint's export took
        # Set while a defragment copies and swaps the file: no checkpoint then.
        self._defragmenting: asyncio.Future[None] | None = None
        # Reads of a checkpoint's transaction on threads (Snapshot, HashKV): the
        # file is swapped only once they end (closing it ends their transactions).
        self._reading: set[asyncio.Future[None]] = set()
        self._failed: BaseException | None = None
        self._wal_job = False  # the writer thread owns the WAL files meanwhile
        self._recovered = False  # recover() finished: the state is the data dir's
        self._closed = False
        self.commits = 0  # group commits done: batches written and fsynced
        self.checkpoints = 0  # backend checkpoints committed
        self.on_no_space: Callable[[], None] | None = None
        """Called on the loop when a write found the disk full."""

    # -- startup --------------------------------------------------------------

    def recover(self) -> None:
        """Open the backend's state, or convert a data dir of snapshot files,
        then replay the log after it (blocking; call before serving)."""
        started = time.monotonic()
        sm = self.state_machine
        backend = self.backend
        start = backend.consistent_index
        legacy = os.path.join(self.data_dir, "snap")
        converted = False
        broken: list[CorruptSnapshotError] = []
        snaps: SnapshotStore | None = None
        if start:
            image = backend.sections()
            if image is None:
                raise CorruptSnapshotError(f"{backend.path}: a consistent index but no sections")
            name = os.path.join(backend.path, "sections")
            try:
                contents = snapshot.decode(image, name)
            except CorruptSnapshotError as e:
                raise CorruptSnapshotError(
                    f"{e}; the backend's state cannot be read: refusing to start"
                ) from e
            sm.restore_state(contents.state, backend.scan_keys(), backend.table_rows)
            backend.release_mapped_pages()  # the scan's pages: page cache, not ours
        elif os.path.isdir(legacy):
            snaps = SnapshotStore(legacy, fsync=self.fsync)
            loaded, broken = snaps.load_usable()
            for error in broken:
                log.error("snapshot refused error=%r", str(error))
            if loaded is not None:
                start = loaded.index
                sm.restore_state(loaded.state)
                converted = True
        replayed = 0
        apply = self.applier.apply
        parse = internal_pb2.Command.FromString
        try:
            for index, payload in self.wal.replay(start):
                apply(index, parse(payload))
                replayed += 1
        except WALGapError as e:
            if broken:
                raise CorruptSnapshotError(
                    f"{broken[0]}; no older snapshot can replace it (the log does not reach "
                    f"back to index {start}): refusing to start"
                ) from e
            if backend.consistent_index:
                raise BackendBehindLogError(
                    f"the backend {backend.path} holds the state at index {start}, older than "
                    f"the WAL's first record ({e}): records in between are missing; "
                    "refusing to start"
                ) from e
            raise
        if backend.consistent_index and self.wal.end_index < start:
            raise BackendBehindLogError(
                f"the backend {backend.path} holds the state at index {start}, ahead of the "
                f"WAL, which ends at index {self.wal.end_index}: the WAL lost records the "
                "backend applied; refusing to start"
            )
        if snaps is not None:
            for error in broken:
                # Replay proved the log holds everything after the older snapshot.
                name = snaps.set_aside(error.index)
                log.warning("snapshot fallback used_index=%d set_aside=%s", start, name)
        self.wal.open_for_append()
        self._next_index = max(self.wal.last_index, start)
        self._checkpoint_index = backend.consistent_index
        if converted or (snaps is not None and sm.applied_index):
            self._checkpoint_blocking()
            os.replace(legacy, legacy + ".converted")
            log.warning(
                "data dir converted from snapshot files to the backend index=%d path=%s "
                "old_snapshots=%s",
                sm.applied_index,
                backend.path,
                legacy + ".converted",
            )
        self._recovered = True
        rec = self.wal.recovery
        log.info(
            "recovered backend_index=%d replayed=%d last_index=%d keys=%d dropped_bytes=%d "
            "seconds=%.3f",
            start,
            replayed,
            rec.last_index,
            sm.store.key_count,
            rec.dropped_bytes,
            time.monotonic() - started,
        )

    def _checkpoint_blocking(self) -> None:
        """A checkpoint written on the calling thread (startup, before serving)."""
        checkpoint = self.state_machine.checkpoint()
        self._write_checkpoint(checkpoint)
        self.backend.renew_reader()
        self.state_machine.checkpoint_done()
        self._checkpoint_index = checkpoint.index

    @property
    def last_index(self) -> int:
        return self._next_index

    # -- proposing ------------------------------------------------------------

    async def linearize(self) -> None:
        """Every acknowledged write is applied here already: nothing to wait for."""

    async def propose(self, command: internal_pb2.Command) -> ApplyResult:
        """Append `command`; returns its result once durable and applied.

        Raises `RequestTooLarge` (etcd's check on the encoded log entry),
        `TooManyRequests` (MAX_UNAPPLIED) and `ServerStopped` without appending
        anything."""
        if self._failed is not None or self._closed:
            raise ServerStopped()
        if self._next_index - self.state_machine.applied_index >= MAX_UNAPPLIED:
            raise TooManyRequests()
        payload = command.SerializeToString()
        if too_large(command, payload, self.max_request_bytes):
            raise RequestTooLarge()
        # The flusher runs on the proposers' loop; asking it is cheaper than
        # get_running_loop(), which makes a getpid() system call each time.
        flusher = self._flusher
        loop = flusher.get_loop() if flusher is not None else asyncio.get_running_loop()
        self._next_index += 1
        future: asyncio.Future[ApplyResult] = loop.create_future()
        index = self._next_index
        self._pending.append(_Proposal(index, command, self.wal.encode(index, payload), future))
        if flusher is None:
            self._flusher = loop.create_task(self._flush())
        return await future

    def _start_write(self, batch: list[_Proposal]) -> asyncio.Future[None]:
        """Write and fsync `batch`: on the writer thread, or on the loop itself
        for a small batch when nothing else waits (one client: no thread hop)."""
        loop = asyncio.get_running_loop()
        data = b"".join([p.record for p in batch])
        if len(batch) <= INLINE_BATCH and not self._wal_job and not self._pending:
            done: asyncio.Future[None] = loop.create_future()
            try:
                self.wal.write(data, batch[-1].index)
            except BaseException as e:
                done.set_exception(e)
            else:
                done.set_result(None)
            return done
        return loop.run_in_executor(self._writer, self.wal.write, data, batch[-1].index)

    def _take_batch(self) -> list[_Proposal]:
        batch = self._pending[:MAX_BATCH]
        del self._pending[:MAX_BATCH]
        return batch

    async def _flush(self) -> None:
        """Group commit, pipelined: as soon as one batch is durable the next
        one's write starts, and the durable batch is applied meanwhile, so the
        fsync of batch N+1 overlaps the apply (and the answers) of batch N."""
        apply = self.applier.apply
        inflight: tuple[list[_Proposal], asyncio.Future[None]] | None = None
        try:
            while inflight is not None or self._pending:
                if inflight is None:
                    batch = self._take_batch()
                    inflight = (batch, self._start_write(batch))
                batch, written = inflight
                inflight = None
                try:
                    await written
                except WALFullError as e:
                    self._refuse_for_space(e, batch)
                    continue
                except BaseException as e:
                    self._fail(e, batch)
                    return
                self.commits += 1
                if self._pending:
                    following = self._take_batch()
                    inflight = (following, self._start_write(following))
                for i, p in enumerate(batch):
                    try:
                        result = apply(p.index, p.command)
                    except ApplyFailed as e:  # fail-stop: nothing more is applied
                        following = inflight[0] if inflight is not None else []
                        self._fail(e, [*batch[i:], *following])
                        return
                    if not p.future.done():
                        p.future.set_result(result)
                self.applier.batch_applied()
                if self._checkpoint_due():
                    self._start_checkpoint()
        finally:
            self._flusher = None
            if inflight is not None:  # cancelled mid-way: the write goes on; wait for it
                with contextlib.suppress(BaseException):
                    await inflight[1]

    def _fail(self, error: BaseException, batch: list[_Proposal]) -> None:
        """The disk refused a write, or an apply failed: nothing more is taken."""
        if not isinstance(error, ApplyFailed):  # the applier reported that one
            log.error("wal write failed, refusing further writes error=%r", error)
        self._failed = error
        for p in (*batch, *self._pending):
            if not p.future.done():
                p.future.set_exception(ServerStopped())
        self._pending.clear()

    def _refuse_for_space(self, error: WALFullError, batch: list[_Proposal]) -> None:
        """The disk is full; the log is as before the batch. Refuse the batch and
        everything pending (their indexes followed the batch's), number the next
        proposal after the last durable one, and raise the alarm."""
        refused = len(batch) + len(self._pending)
        log.error(
            "wal write refused, disk full refused=%d last_index=%d error=%r",
            refused,
            self.wal.last_index,
            error,
        )
        for p in (*batch, *self._pending):
            if not p.future.done():
                p.future.set_exception(NoSpace())
        self._pending.clear()
        self._next_index = self.wal.last_index
        if self.on_no_space is not None:
            self.on_no_space()

    # -- checkpoints ----------------------------------------------------------

    def _checkpoint_due(self) -> bool:
        if (
            self._checkpoint is not None
            or self._defragmenting is not None
            or self._failed is not None
        ):
            return False
        sm = self.state_machine
        entries = sm.applied_index - self._checkpoint_index
        return (
            entries >= self.snapshot_count
            or sm.pending_bytes >= CHECKPOINT_BYTES
            or (
                entries >= CHECKPOINT_SMALL_ENTRIES
                and self._sections_seconds < CHEAP_SECTIONS_SECONDS
            )
        )

    def _start_checkpoint(self) -> asyncio.Task[bool]:
        """Take the checkpoint's contents on the loop and write them on the
        backend thread; the task answers whether it committed."""
        assert self._checkpoint is None
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        checkpoint = self.state_machine.checkpoint()
        self._sections_seconds = time.monotonic() - started
        written = loop.run_in_executor(self._backend_thread, self._write_checkpoint, checkpoint)
        self._checkpoint = loop.create_task(self._finish_checkpoint(written, checkpoint))
        return self._checkpoint

    def _write_checkpoint(self, checkpoint: Checkpoint) -> float:
        """On the backend thread: the sections' image and one LMDB commit."""
        started = time.monotonic()
        index = checkpoint.index
        image = snapshot.encode(index, checkpoint.sections)
        self.backend.commit(
            CommitBatch(
                index,
                checkpoint.writes,
                checkpoint.dropped,
                image,
                checkpoint.tables,
                checkpoint.replace,
            )
        )
        return time.monotonic() - started

    async def _finish_checkpoint(
        self, written: asyncio.Future[float], checkpoint: Checkpoint
    ) -> bool:
        sm = self.state_machine
        index = checkpoint.index
        try:
            try:
                seconds = await written
            except (lmdb.Error, OSError) as e:
                sm.checkpoint_failed(checkpoint)
                log.error("backend checkpoint failed, will retry index=%d error=%r", index, e)
                if _is_disk_full(e) and self.on_no_space is not None:
                    self.on_no_space()
                return False
            self.backend.renew_reader()
            sm.checkpoint_done()
            self._checkpoint_index = index
            self.checkpoints += 1
            log.info(
                "backend checkpoint index=%d in_use_bytes=%d seconds=%.3f",
                index,
                self.backend.in_use_bytes,
                seconds,
            )
            await self._trim_wal(index)
            return True
        finally:
            self._checkpoint = None

    async def _trim_wal(self, index: int) -> None:
        """The backend holds everything up to `index` durably: start a new WAL
        segment and delete those it covers (on the writer thread, between
        batches)."""
        self._wal_job = True
        try:
            await asyncio.get_running_loop().run_in_executor(self._writer, self._rotate, index)
        except OSError as e:  # the log still holds everything: trimmed next time
            log.error("wal trim failed, will retry error=%r", e)
        finally:
            self._wal_job = False

    def _rotate(self, index: int) -> None:
        self.wal.rotate()
        self.wal.remove_covered(index)

    async def _settled(self) -> None:
        """Return once no checkpoint and no defragment is in flight."""
        while True:
            busy: asyncio.Future[Any] | None = self._checkpoint or self._defragmenting
            if busy is None:
                return
            await asyncio.shield(busy)

    async def checkpoint_now(self) -> None:
        """Write a checkpoint at the current applied index, after the one (or
        the defragment) in flight (tests, Defragment, a Snapshot or HashKV
        request, shutdown)."""
        await self._settled()
        if self._failed is not None:
            raise ServerStopped()
        if not await self._start_checkpoint():
            raise NoSpace()

    snapshot_now = checkpoint_now

    async def read_checkpointed(self) -> tuple[int, lmdb.Transaction]:
        """A checkpoint now, and a read transaction that sees exactly it: the
        applied index it holds and the transaction (abort it when done; it may
        move to a thread)."""
        while True:
            await self.checkpoint_now()
            txn = self.backend.begin_read()
            if self.backend.consistent_index_in(txn) == self._checkpoint_index:
                return self._checkpoint_index, txn
            txn.abort()  # another checkpoint committed in between: again

    async def export_etcd_db(self, fileobj: IO[bytes]) -> int:
        """The state as an etcd backend database (Maintenance.Snapshot) into the
        empty, seekable `fileobj`: a checkpoint, then the file is written on a
        thread from a read transaction, the key revisions straight from the
        backend's `key` db; returns its size."""
        backend = self.backend

        def write(index: int, txn: lmdb.Transaction) -> int:
            image = backend.sections(txn)
            assert image is not None
            contents = snapshot.decode(image, "backend sections")
            state = sections_with_tables(contents.state, lambda t: backend.table_rows(t, txn))
            return etcd_backend.write_etcd_db(
                fileobj, index, state, key_items=backend.raw_revisions(txn)
            )

        return await self._read_on_thread(write)

    async def _read_on_thread(self, read: Callable[[int, lmdb.Transaction], _T]) -> _T:
        """`read(index, txn)` on a thread over a read transaction that sees a
        checkpoint made now, aborted after; a defragment waits for it to end
        before swapping the file."""
        index, txn = await self.read_checkpointed()
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        self._reading.add(ended)
        ended.add_done_callback(self._reading.discard)

        def run() -> _T:
            try:
                return read(index, txn)
            finally:
                txn.abort()
                with contextlib.suppress(RuntimeError):  # the loop is gone: no one waits
                    loop.call_soon_threadsafe(ended.set_result, None)

        return await loop.run_in_executor(None, run)

    async def hash_kv(self, revision: int) -> int:
        """HashKV at `revision` (checked already, 0: now): the store's checksum
        computed on a thread from a checkpoint's read transaction, the same
        value `MVCCStore.hash_kv` gives."""
        bound = position(self.state_machine.store.check_revision(revision)) << 1 | 1
        backend = self.backend
        return await self._read_on_thread(lambda _index, txn: backend.hash_revisions(txn, bound))

    async def defragment(self) -> None:
        """etcd's Defragment: the backend file rewritten without its free pages,
        copied in a thread while the loop serves; no checkpoint commits from the
        copy's start to the swap (checkpoint_now waits, so a Snapshot, a HashKV
        or another Defragment asked meanwhile waits too), so swapping the copy in
        loses nothing, and the swap waits for the reads begun before."""
        await self.checkpoint_now()
        await self._settled()  # a defragment, or a checkpoint, started meanwhile
        loop = asyncio.get_running_loop()
        done = self._defragmenting = loop.create_future()
        try:
            copy = self.backend.path + ".defrag"
            await loop.run_in_executor(self._backend_thread, self.backend.copy_compacted, copy)
            while self._reading:
                await asyncio.wait(list(self._reading))
            self.backend.swap_in(copy)
        finally:
            self._defragmenting = None
            done.set_result(None)

    # -- shutdown -------------------------------------------------------------

    async def close(self) -> None:
        """Finish what is in flight, checkpoint (so a restart replays nothing),
        then release the files."""
        self._closed = True
        while self._flusher is not None:
            await asyncio.shield(self._flusher)
        await self._settled()
        sm = self.state_machine
        # After a refused recover() the state is half-built (the server stops
        # what it could not start): a checkpoint of it, and the WAL segment its
        # trim opens, would make the backend and the WAL meet again, and the
        # next start would serve it.
        if (
            self._recovered
            and self._failed is None
            and sm.failed is None
            and sm.applied_index > self._checkpoint_index
        ):
            with contextlib.suppress(lmdb.Error, OSError, NoSpace):
                await self._start_checkpoint()
        self._writer.shutdown(wait=True)
        self._backend_thread.shutdown(wait=True)
        self.wal.close()
        self.backend.close()


def _is_disk_full(error: BaseException) -> bool:
    if isinstance(error, lmdb.MapFullError):
        return True
    return getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space" in str(error)
