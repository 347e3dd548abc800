"""A deterministic simulation of whole cluster members: the real member driver
(`ClusterLog`), the real `StateMachine` and `Applier`, over a simulated network,
disk and clock.

`tests/support/raft_sim.py` tests the Raft core alone; this runs what a member
runs around it. What is real: `queue_server/replication/driver.py` (the Ready
cycle, forwarding of proposals to the leader, ReadIndex rounds, snapshots and
their installation, recovery), `raft/`, and `queue_server/apply.py` with the MVCC
store under it. What is simulated, all from one seeded `random.Random` so that a
seed replays exactly:

- the clock: `VirtualTimeLoop`, an asyncio loop whose `time()` is a counter that
  jumps to the next timer whenever nothing is ready, so the driver's sleeps,
  `wait_for` timeouts and ticks cost no wall time;
- the network (`SimNetwork`, one `SimPeers` per member behind the `Peers`
  protocol): every raft message may be dropped, duplicated or delayed (which
  reorders), and partitions may be symmetric or one-way; forwarded requests
  travel the same way and are answered by the destination's `ClusterLog.answer`;
- the disk (`SimDisk`, durable across crashes, and `SimStorage`, the handle one
  incarnation writes through, with the methods `ClusterLog` calls on
  `RaftStorage`): the WAL is a list of segments of records, replayed by
  `RaftStorage.load`'s rules; the writer (`SimWriter`) runs jobs one at a time,
  each taking a simulated fsync;
- with `SimConfig.backend`, the state machine's backend: a real LMDB `Backend`
  in a directory of the member's (`SimBackend`), so the driver takes the
  server's path (a snapshot is a checkpoint whose file is streamed from a read
  transaction, a restart reads the backend, an install replaces it, Defragment
  swaps the file); its thread (`SimBackendThread`) runs jobs one at a time in
  virtual time while the loop goes on;
- crashes: a crash cancels every task of the member (tasks are owned through a
  context variable the loop's task factory reads), drops its state machine and
  core, and decides what the write in flight left on disk: nothing, all of it,
  or a prefix of its records (the real WAL cuts a torn tail); the jobs queued
  behind it are lost. The backend job in flight did nothing, finished, or
  committed without writing the snapshot file after; the backend keeps every
  commit (LMDB commits whole) and the environment is closed. A restart builds
  a new StateMachine, Applier and ClusterLog from the disk (and the backend
  dir) alone (`recover()`, then `start()`).

Clients put unique values to a few keys and read them linearizably (`propose`,
then `linearize()` and `read_range`, as `api/kv.py` serves Range) on random
members, with call and return times in virtual time; an operation whose outcome
is unknown (an error, a timeout, its member crashed) is a write that may or may
not have happened (end = inf) or a read that is left out.

Invariants, each reported as a violation naming the seed:

- election safety: one leader per term (from `on_leader_change` and sampling);
- state machine safety: every member applies, at each index, the same entry
  (term and data hash), and within one incarnation the applied index never goes
  backwards;
- no lost writes, linearizability: after the faults stop, the network heals and
  every member restarts and catches up, every member reads every key; each key's
  history, these reads included, must be linearizable
  (`tests/support/linearizability.py`), so an acknowledged write that was lost
  is a violation;
- convergence: every member's state (applied index, revision, HashKV) is equal;
- liveness: within a bound after healing, a leader exists and a fresh write is
  applied everywhere;
- fail-stop: no member's apply fails, and no task dies of an unexpected exception;
- no livelock: a message storm (`max_messages_per_second`) stops the run.

`run(seed, size)` runs `size` client operations under faults and returns a
`SimReport` (its `violations` list is empty when all is well).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import math
import os
import random
import selectors
import shutil
import struct
import tempfile
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Generator, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from etcdserverpb import internal_pb2, peer_pb2, rpc_pb2
from queue_server.apply import Applier, ApplyFailed, Effects, StateMachine
from queue_server.errors import EtcdError
from queue_server.proposals import ApplyResult
from queue_server.replication.driver import ClusterLog
from queue_server.replication.peers import PeerUnavailable
from queue_server.replication.storage import (
    HeldPosition,
    Loaded,
    StoredEntry,
    encode_entry,
    encode_hard_state,
)
from queue_server.storage import snapshot as snapshot_format
from queue_server.storage.backend import Backend, CommitBatch
from raft.messages import Entry
from tests.support.linearizability import Op, linearizable

Command = internal_pb2.Command
T = TypeVar("T")

# -- virtual time -------------------------------------------------------------------


SIM_MAP_BYTES = 1 << 30
"""The address space each simulated member's LMDB environment reserves (its
file only grows as pages are used)."""

SIM_SNAPSHOT = "sim-snapshot:"
"""How a simulated disk names a snapshot for the network (see `snapshot_path`)."""


class SimStalled(RuntimeError):
    """The loop has nothing ready and no timer: the simulation would hang."""


class _VirtualSelector(selectors.BaseSelector):
    """The loop's selector: polls the real one (for the loop's self-pipe) without
    blocking; when the loop would wait, moves the virtual clock instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        loop = self._loop
        if timeout is None and not ready:
            raise SimStalled("nothing is ready and no timer is set")
        if timeout and not ready:
            loop.now += timeout
        # The loop runs timers due within its clock resolution (1 ns) as due now,
        # even while callbacks are ready and the clock stands still: a coroutine
        # that waits out "deadline - time()" and then compares time() with its
        # deadline would spin. So the clock moves to such a timer.
        scheduled = loop._scheduled
        if scheduled and scheduled[0].when() < loop.now + loop._clock_resolution:
            loop.now = max(loop.now, scheduled[0].when())
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: `time()` starts at 0 and only moves when the
    loop would otherwise sleep, straight to the next timer. Tasks may be given an
    owner (`OWNER`, a context variable), so a crash can cancel a member's tasks."""

    # BaseEventLoop's own, which typeshed leaves out: its timer heap and its clock
    # resolution (read by _VirtualSelector.select).
    _scheduled: list[asyncio.TimerHandle]
    _clock_resolution: float

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_VirtualSelector(self))
        self.owned: dict[object, dict[asyncio.Task[Any], None]] = {}
        """Each owner's unfinished tasks, in creation order (a set would order
        them by address, and a crash would cancel them in another order)."""
        self.set_task_factory(self._make_task)
        self.errors: list[str] = []
        self.on_unexpected: Callable[[BaseException], None] | None = None
        self.set_exception_handler(self._on_error)

    def time(self) -> float:
        return self.now

    def _on_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """What asyncio would log (an exception nobody retrieved): kept by kind
        (no addresses, so runs compare equal)."""
        e = context.get("exception")
        self.errors.append(f"{context.get('message')}: {type(e).__name__}")
        if e is not None and not isinstance(e, EtcdError) and self.on_unexpected is not None:
            self.on_unexpected(e)

    def _make_task(
        self,
        loop: asyncio.AbstractEventLoop,
        coro: Generator[Any, None, T] | Coroutine[Any, Any, T],
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.Task(coro, loop=loop, context=context)
        owner = context.get(OWNER) if context is not None else OWNER.get()
        if owner is not None:
            tasks = self.owned.setdefault(owner, {})
            tasks[task] = None
            task.add_done_callback(lambda t: tasks.pop(t, None))
        return task


OWNER: contextvars.ContextVar[object | None] = contextvars.ContextVar("sim_owner", default=None)
"""The member incarnation a task belongs to (None: the simulation's own)."""


def owned_context(owner: object) -> contextvars.Context:
    """A context whose tasks and callbacks belong to `owner`."""
    ctx = contextvars.copy_context()
    ctx.run(OWNER.set, owner)
    return ctx


# -- the disk -----------------------------------------------------------------------

_FRAME = struct.Struct("<I")


def _frame(records: list[bytes]) -> bytes:
    return b"".join(_FRAME.pack(len(r)) + r for r in records)


def _unframe(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        (n,) = _FRAME.unpack_from(data, pos)
        pos += _FRAME.size
        out.append(data[pos : pos + n])
        pos += n
    return out


@dataclass
class DiskFaults:
    """How the simulated disk misbehaves (only to show that the checks catch it)."""

    volatile_seconds: float = 0.0
    """A lying disk: a write completed less than this long before a crash is lost
    with it (as a write cache that ignores fsync). 0: fsync means durable."""


class SimDisk:
    """What survives a member's crash: WAL segments of raw records and snapshots.

    Replay follows `RaftStorage.load`: records in write order, an entry at index i
    replaces i and everything after it, the last hard state wins, entries at or
    below the newest snapshot are skipped."""

    def __init__(
        self, incoming: str, faults: DiskFaults | None = None, backend_dir: str | None = None
    ) -> None:
        self.incoming = incoming
        """A real directory: the driver reads a snapshot a peer sent from a file."""
        self.backend_dir = backend_dir
        """A real directory for the state machine's LMDB environment (None: the
        state lives in memory). Its commits survive a crash as they are: LMDB
        commits whole or not at all, and a commit the member made is in the file
        (the process goes on; only the member's incarnation is gone)."""
        self.segments: list[list[bytes]] = [[]]
        self.snapshots: list[tuple[int, bytes]] = []
        self.faults = faults or DiskFaults()
        self._unsynced: deque[tuple[float, int, int]] = deque()
        """(completion time, segment number, records before the write) of the
        writes a lying disk still holds in its cache."""
        self.writes = 0
        self.snapshots_saved = 0

    def append(self, records: list[bytes], now: float) -> None:
        seg = self.segments[-1]
        if self.faults.volatile_seconds:
            self._unsynced.append((now, len(self.segments) - 1, len(seg)))
        seg.extend(records)
        self.writes += 1

    def save_snapshot(self, index: int, data: bytes) -> None:
        self._unsynced.clear()  # a lying disk still flushes on a snapshot's rename
        self.snapshots.append((index, data))
        del self.snapshots[:-2]
        self.snapshots_saved += 1

    def restart_wal(self, records: list[bytes]) -> None:
        self.segments.append(list(records))

    def remove_old_segments(self) -> None:
        del self.segments[:-1]

    def crash(self, now: float) -> None:
        """What a lying disk forgets when the power goes."""
        window = self.faults.volatile_seconds
        while self._unsynced and self._unsynced[-1][0] > now - window:
            _, seg, keep = self._unsynced.pop()
            if seg < len(self.segments):
                del self.segments[seg][keep:]
        self._unsynced.clear()

    def load(self, state_held_at: int = 0, held_position: HeldPosition | None = None) -> Loaded:
        """As `RaftStorage.load`: a snapshot at or below `state_held_at` (the
        backend's consistent index) gives only its raft position, and the
        backend's own snapshot (`held_position`) stands for the newest when no
        file is newer."""
        out = Loaded()
        if held_position is not None and (
            not self.snapshots or self.snapshots[-1][0] <= held_position.index
        ):
            out.snapshot_index = held_position.index
            out.snapshot_term = held_position.term
            out.voters = held_position.voters
        elif self.snapshots:
            index, data = self.snapshots[-1]
            payload = _read_snapshot(index, data)
            out.snapshot_index = payload["index"]
            out.snapshot_term = payload["term"]
            out.voters = tuple(payload["voters"])
            if not 0 < index <= state_held_at:
                out.state = payload["state"]
        entries: list[StoredEntry] = []
        for seg in self.segments:
            for payload_ in seg:
                if payload_[:1] == b"H":
                    out.term, out.vote, out.commit = struct.unpack_from("<QQQ", payload_, 1)
                    continue
                index, term, kind = struct.unpack_from("<QQB", payload_, 1)
                if index <= out.snapshot_index:
                    continue
                while entries and entries[-1].index >= index:
                    entries.pop()
                if (entries and entries[-1].index != index - 1) or (
                    not entries and index != out.snapshot_index + 1
                ):
                    raise RuntimeError(f"sim wal: entry {index} leaves a gap")
                entries.append(StoredEntry(index, term, kind, payload_[1 + 17 :]))
        out.entries = entries
        out.commit = max(out.commit, out.snapshot_index)
        return out


def _read_snapshot(index: int, data: bytes) -> dict[str, Any]:
    """A stored snapshot's payload ({"index", "term", "voters", "state"}), read
    with the snapshot module the driver encodes with (the one place the
    simulation touches the snapshot format)."""
    got = snapshot_format.decode(data, f"sim snapshot {index}")
    return {"index": got.index, "term": got.raft_term, "voters": got.voters, "state": got.state}


class SnapshotJob:
    """`snapshot_job`'s, `install_job`'s and `restart_job`'s blocking function,
    in the three steps a crash can fall between (save the snapshot, start a new
    WAL segment, drop the old). `restart_job`'s has no snapshot to save (`data`
    None: the backend path saved it already)."""

    def __init__(
        self, storage: SimStorage, index: int, data: bytes | None, records: list[bytes]
    ) -> None:
        self.storage = storage
        self.index = index
        self.data = data
        self.records = records

    def __call__(self) -> int:
        self.run(3)
        return len(self.data or b"")

    def run(self, steps: int) -> None:
        disk = self.storage.disk
        if steps >= 1 and self.data is not None:
            disk.save_snapshot(self.index, self.data)
        if steps >= 2:
            disk.restart_wal(self.records)
        if steps >= 3:
            disk.remove_old_segments()


class SimStorage:
    """What one incarnation of a member holds of its disk: the methods
    `ClusterLog` calls on `RaftStorage`. Dead after a crash: nothing more it is
    asked to do reaches the disk."""

    def __init__(self, disk: SimDisk, loop: asyncio.AbstractEventLoop) -> None:
        self.disk = disk
        self.loop = loop
        self.dead = False
        self._seq = 0

    def load(self, state_held_at: int = 0, held_position: HeldPosition | None = None) -> Loaded:
        return self.disk.load(state_held_at, held_position)

    def has_snapshot_file(self, index: int) -> bool:
        return any(i == index for i, _ in self.disk.snapshots)

    def remove_snapshots_below(self, index: int) -> None:
        if not self.dead:
            self.disk.snapshots = [(i, data) for i, data in self.disk.snapshots if i >= index]

    def encode(self, records: list[bytes]) -> tuple[bytes, int]:
        self._seq += len(records)
        return _frame(records), self._seq

    def write(self, data: bytes, last_seq: int) -> None:
        if not self.dead:
            self.disk.append(_unframe(data), self.loop.time())

    @property
    def snapshot_dir(self) -> str:
        return self.disk.incoming

    def snapshot_path(self, index: int) -> str:
        """Not a file: the network reads the snapshot's bytes off this disk."""
        return f"{SIM_SNAPSHOT}{index}"

    def snapshot_bytes(self, path: str) -> bytes | None:
        """The snapshot `snapshot_path` named, if this disk still has it."""
        index = int(path.removeprefix(SIM_SNAPSHOT))
        return next((data for i, data in self.disk.snapshots if i == index), None)

    def snapshot_job(
        self,
        index: int,
        state: dict[str, Any],
        raft_term: int,
        voters: Iterable[int],
        hard_state: tuple[int, int, int],
        entries_after: list[StoredEntry],
    ) -> Callable[[], int]:
        data = snapshot_format.encode(index, state, raft_term=raft_term, voters=voters)
        return SnapshotJob(self, index, data, self._restart_records(hard_state, entries_after))

    def save_snapshot(
        self, index: int, state: dict[str, Any], raft_term: int, voters: Iterable[int]
    ) -> int:
        """The backend path's snapshot file, written from its read transaction
        (on the simulated backend thread): durable once it returns, as
        `RaftStorage.save_snapshot` fsyncs and renames. A dead incarnation's
        reaches nothing."""
        data = snapshot_format.encode(index, state, raft_term=raft_term, voters=voters)
        if not self.dead:
            self.disk.save_snapshot(index, data)
        return len(data)

    def restart_job(
        self, hard_state: tuple[int, int, int], entries_after: list[StoredEntry]
    ) -> Callable[[], int]:
        """The WAL restarted after a snapshot `save_snapshot` saved: its records
        numbered now, written by the writer in two steps a crash can fall
        between."""
        return SnapshotJob(self, 0, None, self._restart_records(hard_state, entries_after))

    def install_job(
        self, index: int, received: str, hard_state: tuple[int, int, int]
    ) -> Callable[[], int]:
        with open(received, "rb") as f:
            data = f.read()
        os.remove(received)
        return SnapshotJob(self, index, data, self._restart_records(hard_state, []))

    def _restart_records(
        self, hard_state: tuple[int, int, int], entries_after: list[StoredEntry]
    ) -> list[bytes]:
        records = [encode_hard_state(*hard_state)]
        records += [encode_entry(e) for e in entries_after]
        self._seq += len(records)
        return records

    def close(self) -> None:
        return None


class SimWriter(Executor):
    """The writer thread in virtual time: jobs run one after another, in the order
    submitted, each after a simulated fsync of `fsync` seconds (drawn per job)."""

    def __init__(
        self,
        storage: SimStorage,
        loop: asyncio.AbstractEventLoop,
        rng: random.Random,
        fsync: tuple[float, float],
    ) -> None:
        self.storage = storage
        self.loop = loop
        self.rng = rng
        self.fsync = fsync
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._running: tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        if self.storage.dead:
            return fut  # never completes: the member is gone
        self._queue.append((fn, args, fut))
        if self._running is None:
            self._next()
        return fut

    def _next(self) -> None:
        if not self._queue:
            self._running = None
            return
        self._running = self._queue.popleft()
        self._timer = self.loop.call_later(self.rng.uniform(*self.fsync), self._done)

    def _done(self) -> None:
        assert self._running is not None
        fn, args, fut = self._running
        try:
            result = fn(*args)
        except Exception as e:
            fut.set_exception(e)
        else:
            fut.set_result(result)
        self._next()

    def crash(self, rng: random.Random) -> str:
        """The power goes: the job in flight leaves nothing, all, or a prefix of
        its records; the queued ones are lost. Returns what happened."""
        if self._timer is not None:
            self._timer.cancel()
        running, self._running = self._running, None
        self._queue.clear()
        if running is None:
            return "idle"
        fn, args, _ = running
        fate = rng.randrange(3)
        if fate == 0:
            return "write lost"
        if isinstance(fn, SnapshotJob):
            steps = 3 if fate == 1 else rng.randint(1, 2)
            fn.run(steps)
            return f"snapshot job, {steps} of 3 steps"
        if fate == 1:
            fn(*args)
            return "write kept"
        if getattr(fn, "__func__", None) is SimStorage.write:
            records = _unframe(args[0])
            keep = rng.randrange(len(records) + 1)
            if keep:
                self.storage.disk.append(records[:keep], self.loop.time())
            return f"write torn, {keep} of {len(records)} records kept"
        return "write lost"

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None

    @property
    def busy(self) -> bool:
        """A job runs or waits."""
        return self._running is not None or bool(self._queue)


class SimBackendThread(SimWriter):
    """The backend thread in virtual time: the backend's commits, snapshot
    streams and defragment copies, one after another, each taking a drawn
    while during which the loop goes on (the real thread overlaps the loop so).
    A job's effects happen at its end, all at once."""

    def crash(self, rng: random.Random) -> str:
        """The power goes during the job in flight: it did nothing, it finished
        (an LMDB commit is whole or absent), or its commit landed and the
        snapshot file it went on to write did not. The queued ones are lost."""
        if self._timer is not None:
            self._timer.cancel()
        running, self._running = self._running, None
        self._queue.clear()
        if running is None:
            return "backend idle"
        fn, args, _ = running
        fate = rng.randrange(3)
        if fate == 0:
            return "backend job lost"
        if fate == 2:
            self.storage.dead = True  # what the job writes after its commit is lost
        try:
            fn(*args)
        except Exception as e:
            return f"backend job failed {type(e).__name__}"
        return "backend job done" if fate == 1 else "backend job committed, its file lost"


class SimBackend(Backend):
    """The real backend, checking a rule of its own the simulation cannot see
    break (its jobs run whole, at once): the file is swapped only with no
    backend job in flight (`swap_in`), or a commit would run on a closed file."""

    thread: SimBackendThread | None = None
    on_violation: Callable[[str], None] | None = None
    report: SimReport | None = None

    def commit(self, batch: CommitBatch) -> None:
        super().commit(batch)
        if self.report is not None:
            self.report.backend_commits += 1

    def swap_in(self, copied: str) -> None:
        if self.thread is not None and self.thread.busy and self.on_violation is not None:
            self.on_violation(f"{self.path}: swap_in with a backend job in flight")
        super().swap_in(copied)
        if self.report is not None:
            self.report.defragments += 1


# -- the network --------------------------------------------------------------------


@dataclass
class NetConfig:
    """Per-message behaviour of the network; delays in seconds."""

    drop: float = 0.02
    duplicate: float = 0.02
    min_delay: float = 0.0005
    max_delay: float = 0.015


class SimNetwork:
    """Carries raft messages and forwarded requests between members."""

    def __init__(self, sim: MemberSim, rng: random.Random, config: NetConfig) -> None:
        self.sim = sim
        self.rng = rng
        self.config = config
        self.blocked: set[tuple[int, int]] = set()
        """(from, to) pairs that cannot talk: partitions, possibly one-way."""
        self.sent = 0
        self.delivered = 0
        self.snapshot_files = 0

    def can_reach(self, src: int, dst: int) -> bool:
        return (src, dst) not in self.blocked

    def _delay(self) -> float:
        return self.rng.uniform(self.config.min_delay, self.config.max_delay)

    def send(self, src: int, dst: int, raw: bytes) -> None:
        self.sent += 1
        if not self.can_reach(src, dst) or self.rng.random() < self.config.drop:
            return
        copies = 2 if self.rng.random() < self.config.duplicate else 1
        for _ in range(copies):
            self.sim.loop.call_later(self._delay(), self._arrive, src, dst, raw)

    def _arrive(self, src: int, dst: int, raw: bytes) -> None:
        member = self.sim.members.get(dst)
        if member is None or member.log is None or not self.can_reach(src, dst):
            return
        self.delivered += 1
        member.ctx.run(member.log.deliver, [raw])

    def send_snapshot(self, src: int, dst: int, message: bytes, path: str) -> None:
        """A snapshot travels like a raft message: read off the sender's disk when
        sent, written to a file of the receiver's when it arrives (as the peer
        transport does), then handed to its driver with the file."""
        self.sent += 1
        sender = self.sim.members.get(src)
        if sender is None or sender.storage is None:
            return
        data = sender.storage.snapshot_bytes(path)
        if data is None or not self.can_reach(src, dst) or self.rng.random() < self.config.drop:
            return
        self.sim.loop.call_later(self._delay(), self._snapshot_arrives, src, dst, message, data)

    def _snapshot_arrives(self, src: int, dst: int, message: bytes, data: bytes) -> None:
        member = self.sim.members.get(dst)
        if member is None or member.log is None or not self.can_reach(src, dst):
            return
        self.delivered += 1
        self.snapshot_files += 1
        path = os.path.join(member.disk.incoming, f"{src:x}-{self.snapshot_files}.incoming.tmp")
        with open(path, "wb") as f:
            f.write(data)
        member.ctx.run(member.log.deliver_snapshot, message, path)

    async def request(
        self, src: int, dst: int, request: peer_pb2.Request, timeout: float
    ) -> peer_pb2.Answer:
        """A request travels to `dst`, is answered there, and the answer travels
        back; each way may be lost or cut. The caller learns only that nothing
        came back in time, and whether the request left (then it may have acted)."""
        loop = self.sim.loop
        member = self.sim.members.get(dst)
        if member is None or member.log is None:
            await asyncio.sleep(self._delay())  # connection refused
            raise PeerUnavailable(f"member {dst:x} is down", sent=False)
        if not self.can_reach(src, dst):
            await asyncio.sleep(timeout)  # the connection never opens
            raise PeerUnavailable(f"member {dst:x} unreachable", sent=False)
        reply: asyncio.Future[peer_pb2.Answer] = loop.create_future()
        raw = request.SerializeToString()
        if self.rng.random() >= self.config.drop:
            loop.call_later(self._delay(), self._request_arrives, src, dst, raw, reply)
        try:
            return await asyncio.wait_for(asyncio.shield(reply), timeout)
        except TimeoutError:
            raise PeerUnavailable(f"no answer from {dst:x}", sent=True) from None

    def _request_arrives(
        self, src: int, dst: int, raw: bytes, reply: asyncio.Future[peer_pb2.Answer]
    ) -> None:
        member = self.sim.members.get(dst)
        if member is None or member.log is None or not self.can_reach(src, dst):
            return
        log = member.log

        async def answer() -> None:
            got = await log.answer(peer_pb2.Request.FromString(raw))
            back = got.SerializeToString()
            if self.can_reach(dst, src) and self.rng.random() >= self.config.drop:
                self.sim.loop.call_later(self._delay(), self._answer_arrives, src, dst, back, reply)

        self.sim.loop.create_task(answer(), context=member.ctx)

    def _answer_arrives(
        self, src: int, dst: int, raw: bytes, reply: asyncio.Future[peer_pb2.Answer]
    ) -> None:
        if self.can_reach(dst, src) and not reply.done():
            reply.set_result(peer_pb2.Answer.FromString(raw))


class SimPeers:
    """One member's `Peers`: its end of the simulated network."""

    def __init__(self, network: SimNetwork, member_id: int) -> None:
        self.network = network
        self.member_id = member_id

    def set_peer(self, member_id: int, url: str) -> None:
        return None

    def remove_peer(self, member_id: int) -> None:
        return None

    def send(self, member_id: int, message: bytes) -> None:
        self.network.send(self.member_id, member_id, message)

    def send_snapshot(self, member_id: int, message: bytes, path: str) -> None:
        self.network.send_snapshot(self.member_id, member_id, message, path)

    async def request(
        self, member_id: int, request: peer_pb2.Request, timeout: float
    ) -> peer_pb2.Answer:
        return await self.network.request(self.member_id, member_id, request, timeout)


# -- members ------------------------------------------------------------------------


class _NoEffects:
    """The applier's sink: a member with no node parts (watches, deliveries)."""

    def applied(self, effects: Effects) -> None:
        return None

    def batch_applied(self) -> None:
        return None


class ObservedClusterLog(ClusterLog):
    """The real driver, with every entry it applies shown to the checker."""

    observer: Callable[[Entry, int], None] | None = None

    def _apply(self, e: Entry) -> None:
        before = self.state_machine.applied_index
        super()._apply(e)
        if e.index > before and self.observer is not None:
            self.observer(e, before)


@dataclass
class SimMember:
    """One member: its disk (kept across crashes) and its running incarnation."""

    member_id: int
    disk: SimDisk
    log: ClusterLog | None = None
    storage: SimStorage | None = None
    writer: SimWriter | None = None
    backend: SimBackend | None = None
    backend_thread: SimBackendThread | None = None
    incarnation: int = 0
    ctx: contextvars.Context = field(default_factory=contextvars.copy_context)
    down_since: float = 0.0
    applied_seen: int = 0


# -- the run ------------------------------------------------------------------------


FAULT_WEIGHTS = {
    "crash": 0.25,
    "restart": 0.15,
    "partition": 0.12,
    "one_way": 0.10,
    "heal": 0.20,
    "weather": 0.10,
    "snapshot_now": 0.08,
}
"""How often each fault is drawn (`MemberSim._fault_<name>`)."""


@dataclass
class SimConfig:
    """One run's shape (`config_for(seed)` varies it with the seed)."""

    members: int = 3
    clients: int = 4
    keys: int = 4
    snapshot_count: int = 100_000
    net: NetConfig = field(default_factory=NetConfig)
    fsync: tuple[float, float] = (0.0005, 0.004)
    fault_every: tuple[float, float] = (0.3, 2.0)
    fault_weights: dict[str, float] = field(default_factory=lambda: dict(FAULT_WEIGHTS))
    max_down_seconds: float = 6.0
    settle_seconds: float = 60.0
    max_messages_per_second: int = 5000
    """Past this many raft messages in one virtual second the run stops as a
    livelock (a healthy run of five members sends a few hundred)."""
    disk: DiskFaults = field(default_factory=DiskFaults)
    backend: bool = False
    """Each member's state machine keeps its state on a real LMDB `Backend` in
    a directory of its own (the server's way): a snapshot is a checkpoint, its
    file is streamed from a read transaction on the (simulated) backend thread,
    a restart reads the backend. False: the state lives in memory."""
    backend_seconds: tuple[float, float] = (0.001, 0.01)
    """How long one backend job (a commit, a snapshot stream, a copy) takes."""


def config_for(seed: int, backend: bool = False) -> SimConfig:
    """Three or five members; every other seed snapshots every 16 entries, so
    lagging and restarted members are sent snapshots; on the backend, one seed
    in three has a slow backend thread (its jobs overlap installs, Defragments
    and crashes more)."""
    return SimConfig(
        members=5 if seed % 4 == 3 else 3,
        snapshot_count=16 if seed % 2 == 0 else 100_000,
        backend=backend,
        backend_seconds=(0.05, 0.5) if seed % 3 == 1 else (0.001, 0.01),
        fault_weights=dict(FAULT_WEIGHTS, hash_kv=0.06) if backend else dict(FAULT_WEIGHTS),
    )


@dataclass
class SimReport:
    """What a run did and found. Equal for two runs of one seed."""

    seed: int
    members: int = 0
    ops: int = 0
    writes_ok: int = 0
    writes_unknown: int = 0
    reads_ok: int = 0
    reads_failed: int = 0
    crashes: int = 0
    partitions: int = 0
    leaders: int = 0
    snapshots_saved: int = 0
    snapshots_installed: int = 0
    messages_sent: int = 0
    backend_commits: int = 0
    """Checkpoints the members' backends committed (0 in memory)."""
    backend_restarts: int = 0
    """Restarts that found a checkpoint in the backend and started from it."""
    defragments: int = 0
    """Backend files a Defragment swapped in."""
    hashes: int = 0
    """HashKVs computed on a backend thread and checked."""
    loop_errors: dict[str, int] = field(default_factory=dict)
    """Exceptions asyncio would have logged as never retrieved, by kind."""
    applied_index: int = 0
    end_time: float = 0.0
    state_digest: tuple[int, int, int] = (0, 0, 0)
    """(applied index, revision, HashKV) every member converged to."""
    trace_digest: str = ""
    """A hash of every event of the run, in order."""
    violations: list[str] = field(default_factory=list)
    trace_tail: list[str] = field(default_factory=list)


class MemberSim:
    """A cluster of whole members on one virtual-time loop."""

    def __init__(self, seed: int, config: SimConfig) -> None:
        self.seed = seed
        self.config = config
        self.loop = VirtualTimeLoop()
        self.rng = random.Random(seed)
        self.ids = [0x100 + i for i in range(config.members)]
        self.network = SimNetwork(self, random.Random(self.rng.getrandbits(64)), config.net)
        self.fault_rng = random.Random(self.rng.getrandbits(64))
        self.client_rng = random.Random(self.rng.getrandbits(64))
        self.disk_rng = random.Random(self.rng.getrandbits(64))
        self.files = tempfile.mkdtemp(prefix="member-sim-")
        self.members = {
            i: SimMember(i, SimDisk(self._incoming_dir(i), config.disk, self._backend_dir(i)))
            for i in self.ids
        }
        self.report = SimReport(seed, members=config.members)
        self.history: dict[bytes, list[Op]] = {}
        self.leaders: dict[int, int] = {}
        self.applied: dict[int, tuple[int, bytes, int]] = {}
        self._trace = hashlib.blake2b(digest_size=16)
        self._tail: deque[str] = deque(maxlen=60)
        self._stop_clients = False
        self.loop.on_unexpected = lambda e: self.violation(f"unexpected exception {e!r}")

    # -- events and violations ----------------------------------------------------

    def event(self, *what: object) -> None:
        line = f"t={self.loop.time():.4f} " + " ".join(str(w) for w in what)
        self._trace.update(line.encode())
        self._tail.append(line)

    def violation(self, what: str) -> None:
        self.event("VIOLATION", what)
        if len(self.report.violations) < 20:
            self.report.violations.append(f"seed={self.seed} t={self.loop.time():.4f}: {what}")

    # -- members ------------------------------------------------------------------

    def start_member(self, member_id: int) -> None:
        m = self.members[member_id]
        m.incarnation += 1
        owner = (member_id, m.incarnation)
        m.ctx = owned_context(owner)
        state = StateMachine()

        def fatal(e: ApplyFailed) -> None:
            self.violation(f"member {member_id:x} apply failed: {e}")

        applier = Applier(state, _NoEffects(), fatal)
        m.storage = SimStorage(m.disk, self.loop)
        m.writer = SimWriter(
            m.storage, self.loop, random.Random(self.disk_rng.getrandbits(64)), self.config.fsync
        )
        m.backend = m.backend_thread = None
        if m.disk.backend_dir is not None:
            m.backend_thread = SimBackendThread(
                m.storage,
                self.loop,
                random.Random(self.disk_rng.getrandbits(64)),
                self.config.backend_seconds,
            )
            m.backend = SimBackend(m.disk.backend_dir, fsync=False, map_bytes=SIM_MAP_BYTES)
            m.backend.thread = m.backend_thread
            m.backend.on_violation = self.violation
            m.backend.report = self.report
            if m.backend.consistent_index:
                self.report.backend_restarts += 1
            state.use_backend(m.backend)
        log = ObservedClusterLog(
            applier,
            member_id,
            list(self.ids),
            SimPeers(self.network, member_id),
            m.storage,  # type: ignore[arg-type]
            keep_alive=lambda lease_id: 0,
            writer=m.writer,
            backend_executor=m.backend_thread,
            snapshot_count=self.config.snapshot_count,
            rng=random.Random(self.rng.getrandbits(64)),
        )
        log.observer = lambda e, before: self._on_apply(m, log, e, before)
        log.on_leader_change = lambda leader: self._on_leader(m, log, leader)
        log.on_restored = lambda: self._on_restored(m, log)
        try:
            log.recover()
        except Exception as e:  # the disk holds what the member cannot start from
            self.violation(f"member {member_id:x} cannot recover: {e!r}")
            m.down_since = self.loop.time()
            self._close_backend(m)
            return
        m.applied_seen = state.applied_index
        m.log = log
        self.event("start", f"{member_id:x}", f"inc={m.incarnation}", f"applied={m.applied_seen}")
        self.loop.create_task(log.start(), context=m.ctx)

    def crash_member(self, member_id: int) -> None:
        m = self.members[member_id]
        assert m.log is not None and m.writer is not None and m.storage is not None
        fate = m.writer.crash(self.disk_rng)
        if m.backend_thread is not None:
            fate += ", " + m.backend_thread.crash(self.disk_rng)
        m.storage.dead = True
        m.disk.crash(self.loop.time())
        self._close_backend(m)  # what the state machine held in memory is gone
        m.log = None
        m.down_since = self.loop.time()
        for task in list(self.loop.owned.pop((member_id, m.incarnation), ())):
            task.cancel()
        self.report.crashes += 1
        self.event("crash", f"{member_id:x}", fate)

    def _close_backend(self, m: SimMember) -> None:
        """Close the incarnation's LMDB environment (the kernel's part in a
        process's death): the next one opens the file afresh."""
        if m.backend is not None:
            m.backend.close()
            m.backend = None

    def live(self) -> list[int]:
        return [i for i in self.ids if self.members[i].log is not None]

    def _on_apply(self, m: SimMember, log: ClusterLog, e: Entry, before: int) -> None:
        if m.log is not log:
            return
        if e.index <= m.applied_seen or e.index != before + 1:
            self.violation(
                f"member {m.member_id:x} applied index {e.index} after {before} "
                f"(seen {m.applied_seen})"
            )
        m.applied_seen = e.index
        digest = hashlib.blake2b(e.data, digest_size=8).digest()
        known = self.applied.setdefault(e.index, (e.term, digest, m.member_id))
        if known[:2] != (e.term, digest):
            self.violation(
                f"state machine safety: member {m.member_id:x} applied ({e.index}, {e.term}) "
                f"but member {known[2]:x} applied ({e.index}, {known[0]}) with other data"
            )

    def _on_leader(self, m: SimMember, log: ClusterLog, leader: int) -> None:
        if m.log is not log or leader != m.member_id or not log.is_leader:
            return
        self._note_leader(log.term, m.member_id)

    def _note_leader(self, term: int, member_id: int) -> None:
        known = self.leaders.setdefault(term, member_id)
        if known == member_id:
            if len(self.leaders) > self.report.leaders:
                self.report.leaders = len(self.leaders)
                self.event("leader", f"{member_id:x}", f"term={term}")
        else:
            self.violation(f"election safety: {known:x} and {member_id:x} both lead term {term}")

    def _on_restored(self, m: SimMember, log: ClusterLog) -> None:
        if m.log is not log:
            return
        applied = log.state_machine.applied_index
        if applied < m.applied_seen:
            self.violation(
                f"member {m.member_id:x} installed a snapshot at {applied} "
                f"after applying {m.applied_seen}"
            )
        m.applied_seen = applied
        self.report.snapshots_installed += 1
        self.event("installed", f"{m.member_id:x}", applied)

    async def sample(self) -> None:
        """Every few milliseconds: leaders by term, applied indexes only growing."""
        while True:
            await asyncio.sleep(0.02)
            for i in self.live():
                m = self.members[i]
                log = m.log
                assert log is not None
                if log.is_leader:
                    self._note_leader(log.term, i)
                if log.state_machine.applied_index < m.applied_seen:
                    self.violation(f"member {i:x} applied index went back")

    # -- faults -------------------------------------------------------------------

    async def faults(self) -> None:
        """Every `fault_every` seconds, one fault drawn by `fault_weights`; a
        member down longer than `max_down_seconds` comes back first."""
        rng, cfg = self.fault_rng, self.config
        names = sorted(cfg.fault_weights)
        weights = [cfg.fault_weights[k] for k in names]
        while not self._stop_clients:
            await asyncio.sleep(rng.uniform(*cfg.fault_every))
            now = self.loop.time()
            for i in self.ids:
                m = self.members[i]
                if m.log is None and now - m.down_since > cfg.max_down_seconds:
                    self.start_member(i)
            getattr(self, "_fault_" + rng.choices(names, weights)[0])(rng)

    def _fault_crash(self, rng: random.Random) -> None:
        live = self.live()
        n = len(self.ids)
        max_down = n // 2 + (1 if rng.random() < 0.2 else 0)  # sometimes a majority
        if live and n - len(live) < max_down:
            self.crash_member(rng.choice(live))

    def _fault_restart(self, rng: random.Random) -> None:
        down = [i for i in self.ids if self.members[i].log is None]
        if down:
            self.start_member(rng.choice(down))

    def _fault_partition(self, rng: random.Random) -> None:
        ids = list(self.ids)
        rng.shuffle(ids)
        side = set(ids[: rng.randint(1, len(ids) // 2)])
        self.network.blocked = {
            (a, b) for a in self.ids for b in self.ids if (a in side) != (b in side)
        }
        self.report.partitions += 1
        self.event("partition", sorted(f"{i:x}" for i in side))

    def _fault_one_way(self, rng: random.Random) -> None:
        a, b = rng.sample(self.ids, 2)
        leader = self._leader()
        if leader is not None and rng.random() < 0.5:
            a = leader  # the leader's messages stop; it still hears everyone
            b = rng.choice([i for i in self.ids if i != a])
        self.network.blocked.add((a, b))
        self.report.partitions += 1
        self.event("one-way", f"{a:x}->{b:x}")

    def _fault_heal(self, rng: random.Random) -> None:
        self.network.blocked = set()
        self.event("heal")

    def _fault_weather(self, rng: random.Random) -> None:
        self.network.config = NetConfig(
            drop=rng.choice([0.0, 0.02, 0.1, 0.3]),
            duplicate=rng.choice([0.0, 0.02, 0.1]),
            min_delay=0.0005,
            max_delay=rng.choice([0.002, 0.015, 0.1]),
        )
        self.event("weather", self.network.config)

    def _fault_snapshot_now(self, rng: random.Random) -> None:
        """Defragment: a snapshot out of turn and, on the backend, the file
        copied on the backend thread and swapped in."""
        live = self.live()
        if live:
            target = rng.choice(live)
            log = self.members[target].log
            assert log is not None
            self.event("snapshot_now", f"{target:x}")
            self.loop.create_task(self._snapshot_now(log), context=self.members[target].ctx)

    def _fault_hash_kv(self, rng: random.Random) -> None:
        """HashKV on a member, computed on its backend thread: it must equal the
        in-memory checksum at that revision when asked (every replica holds the
        same changes up to it, and the clients never compact)."""
        live = self.live()
        if not live:
            return
        target = rng.choice(live)
        log = self.members[target].log
        assert log is not None
        store = log.state_machine.store
        revision = store.revision
        want = store.hash_kv(revision)
        self.event("hash_kv", f"{target:x}", revision)
        self.loop.create_task(self._hash_kv(log, revision, want), context=self.members[target].ctx)

    async def _hash_kv(self, log: ClusterLog, revision: int, want: int) -> None:
        got = await log.hash_kv(revision)
        self.report.hashes += 1
        if got != want:
            self.violation(f"member {log.member_id:x} HashKV at {revision}: {got}, not {want}")

    async def _snapshot_now(self, log: ClusterLog) -> None:
        try:
            await log.defragment()
        except ValueError as e:  # a received snapshot is being installed
            self.event("snapshot_now refused", e)

    def _leader(self) -> int | None:
        best: tuple[int, int] | None = None
        for i in self.live():
            log = self.members[i].log
            assert log is not None
            if log.is_leader and (best is None or log.term > best[0]):
                best = (log.term, i)
        return best[1] if best else None

    # -- clients ------------------------------------------------------------------

    def key(self, k: int) -> bytes:
        return b"k%d" % k

    async def client(self, client_id: int, budget: list[int]) -> None:
        rng = self.client_rng
        n = 0
        while budget[0] > 0 and not self._stop_clients:
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            live = self.live()
            if not live:
                continue
            budget[0] -= 1
            member = rng.choice(live)
            key = self.key(rng.randrange(self.config.keys))
            if rng.random() < 0.55:
                n += 1
                await self.put(member, key, f"c{client_id}.{n}")
            else:
                await self.read(member, key)

    async def _on_member(
        self, member_id: int, coro: Callable[[ClusterLog], Coroutine[Any, Any, Any]]
    ) -> tuple[str, Any]:
        """Run an operation as a task of the member: ("ok", result),
        ("error", exception) or ("crashed", None)."""
        m = self.members[member_id]
        log = m.log
        assert log is not None
        task = self.loop.create_task(coro(log), context=m.ctx)
        await asyncio.wait({task})
        if task.cancelled():
            return "crashed", None
        e = task.exception()
        if e is not None:
            return "error", e
        return "ok", task.result()

    async def put(self, member_id: int, key: bytes, value: str) -> None:
        start = self.loop.time()
        command = Command(put=rpc_pb2.PutRequest(key=key, value=value.encode()))
        outcome, result = await self._on_member(member_id, lambda log: log.propose(command))
        end = self.loop.time()
        self.report.ops += 1
        if outcome == "ok" and isinstance(result, rpc_pb2.PutResponse):
            self.report.writes_ok += 1
            self.history.setdefault(key, []).append(Op("write", value, start, end))
        else:
            # An error may come after the entry was placed: the write may happen.
            self.report.writes_unknown += 1
            self.history.setdefault(key, []).append(Op("write", value, start, math.inf))
            result = type(result).__name__
        self.event(
            "put",
            f"{member_id:x}",
            key,
            value,
            f"from={start:.4f}",
            outcome,
            "" if outcome == "ok" else result,
        )

    async def read(self, member_id: int, key: bytes, *, final: bool = False) -> str | None:
        start = self.loop.time()

        async def linearizable_range(log: ClusterLog) -> rpc_pb2.RangeResponse:
            await log.linearize()  # as api/kv.py serves a Range that is not serializable
            return log.state_machine.read_range(rpc_pb2.RangeRequest(key=key))

        outcome, result = await self._on_member(member_id, linearizable_range)
        end = self.loop.time()
        if not final:
            self.report.ops += 1
        if outcome != "ok":
            self.report.reads_failed += 1
            self.event(
                "read", f"{member_id:x}", key, f"from={start:.4f}", outcome, type(result).__name__
            )
            return None
        value = result.kvs[0].value.decode() if result.kvs else None
        self.report.reads_ok += 1
        self.history.setdefault(key, []).append(Op("read", value, start, end))
        self.event("read", f"{member_id:x}", key, f"from={start:.4f}", value)
        return value

    # -- the whole run ------------------------------------------------------------

    async def main(self, size: int) -> None:
        """Start every member, run the clients and the faults, then settle; stop
        early on a message storm."""
        for i in self.ids:
            self.start_member(i)
        self.loop.create_task(self.sample())
        work = self.loop.create_task(self._work(size))
        storm = self.loop.create_task(self._watch_messages())
        await asyncio.wait({work, storm}, return_when=asyncio.FIRST_COMPLETED)
        for t in (work, storm):
            t.cancel()
        await asyncio.wait({work, storm})

    async def _work(self, size: int) -> None:
        faults = self.loop.create_task(self.faults())
        budget = [size]
        clients = [
            self.loop.create_task(self.client(c, budget)) for c in range(self.config.clients)
        ]
        await asyncio.gather(*clients)
        self._stop_clients = True
        await faults
        await self.settle()

    async def _watch_messages(self) -> None:
        last = 0
        while True:
            await asyncio.sleep(1.0)
            sent = self.network.sent
            if sent - last > self.config.max_messages_per_second:
                self.violation(f"livelock: {sent - last} raft messages in one second")
                return
            last = sent

    async def settle(self) -> None:
        """Heal everything, restart everyone, wait for a fresh write to reach
        every member, read every key everywhere, compare states."""
        self.network.blocked = set()
        self.network.config = NetConfig(drop=0.0, duplicate=0.0)
        for i in self.ids:
            if self.members[i].log is None:
                self.start_member(i)
        self.event("settle")
        live = self.live()  # a member that could not recover is a violation already
        if not live:
            return
        deadline = self.loop.time() + self.config.settle_seconds
        marker = 0
        while True:
            if self.loop.time() > deadline:
                self.violation("liveness: no write reached every member after healing")
                return
            marker += 1
            command = Command(put=rpc_pb2.PutRequest(key=b"settle", value=b"%d" % marker))

            def propose(log: ClusterLog, c: Command = command) -> Coroutine[Any, Any, ApplyResult]:
                return log.propose(c)

            outcome, result = await self._on_member(live[marker % len(live)], propose)
            if outcome == "ok":
                revision: int = result.header.revision

                def settled(r: int = revision) -> bool:
                    return all(self._state_of(i).store.revision >= r for i in live)

                if await self._until(settled, 10.0):
                    break
            else:
                await asyncio.sleep(0.5)
        for k in range(self.config.keys):
            key = self.key(k)
            for i in live:
                await self.read(i, key, final=True)
        await self._until(lambda: len({self._digest(i)[0] for i in live}) == 1, 10.0)
        digests = {i: self._digest(i) for i in live}
        if len(set(digests.values())) != 1:
            shown = ", ".join(f"{i:x}={d}" for i, d in digests.items())
            self.violation(f"convergence: members differ (applied, revision, HashKV): {shown}")
        self.report.state_digest = digests[live[0]]

    async def _until(self, done: Callable[[], bool], seconds: float) -> bool:
        """Poll `done` every 50 ms for up to `seconds`."""
        for _ in range(int(seconds / 0.05)):
            if done():
                return True
            await asyncio.sleep(0.05)
        return done()

    def _state_of(self, member_id: int) -> StateMachine:
        log = self.members[member_id].log
        assert log is not None
        return log.state_machine

    def _digest(self, member_id: int) -> tuple[int, int, int]:
        sm = self._state_of(member_id)
        return sm.applied_index, sm.store.revision, sm.store.hash_kv(0)

    def check_histories(self) -> None:
        for key, ops in sorted(self.history.items()):
            read_values = {op.value for op in ops if op.kind == "read"}
            # An unknown write nobody read may as well never have happened.
            kept = [
                op
                for op in ops
                if not (op.kind == "write" and op.end == math.inf and op.value not in read_values)
            ]
            if not linearizable(kept):
                self.violation(f"linearizability: the history of {key!r} has no valid order")

    def finish(self) -> SimReport:
        report = self.report
        report.applied_index = max(self.applied, default=0)
        report.end_time = round(self.loop.time(), 6)
        report.messages_sent = self.network.sent
        report.snapshots_saved = sum(m.disk.snapshots_saved for m in self.members.values())
        report.trace_digest = self._trace.hexdigest()
        report.loop_errors = dict(Counter(self.loop.errors))
        report.trace_tail = list(self._tail) if report.violations else []
        return report

    def _incoming_dir(self, member_id: int) -> str:
        path = os.path.join(self.files, f"{member_id:x}")
        os.mkdir(path)
        return path

    def _backend_dir(self, member_id: int) -> str | None:
        if not self.config.backend:
            return None
        return os.path.join(self.files, f"{member_id:x}-db")

    def close(self) -> None:
        loop = self.loop
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()
        for m in self.members.values():
            self._close_backend(m)
        shutil.rmtree(self.files, ignore_errors=True)


def run(seed: int, size: int, config: SimConfig | None = None) -> SimReport:
    """One simulated run of `size` client operations under faults."""
    sim = MemberSim(seed, config or config_for(seed))
    try:
        sim.loop.run_until_complete(sim.main(size))
        sim.check_histories()
    finally:
        sim.close()
    return sim.finish()
