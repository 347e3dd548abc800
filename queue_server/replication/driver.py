"""The Raft driver of a cluster member: `ClusterLog`, the `Proposer` of a member
that is one of several.

It owns the member's `RaftCore` (`raft/core.py`) and drives it over three things
it is given: the raft storage (`replication/storage.py`, or a simulated disk),
the peers (`replication/peers.Peers`: `peer_wire.PeerTransport`, or a simulated
network) and the event loop's clock. It feeds the same `Applier` the single-node
`LocalLog` feeds. Services call `propose(command)` and `linearize()` exactly as
they do on one node; the transport calls `deliver` and `answer` (it is the
member's `PeerHandler`).

Theory of operation
-------------------
One event loop does everything but disk writes. A timer ticks the core every
`heartbeat_seconds`; messages from peers are stepped into it as they arrive;
proposals go into it on the leader. After each of these the Ready cycle runs
(one at a time): persist the Ready's entries and hard state (one fsync in the
writer thread when the core says it must), send its messages (a leader sends
before its write, everyone else after), apply its committed entries, hand out
read states, then `advance`. Entries that arrive while a write is in flight wait
in the core and go into the next Ready, so concurrent proposals share one append
per follower and one fsync (group commit, as in `LocalLog`).

Proposals: on the leader, `propose` appends to the core and waits for the entry
at that index to be applied; if the entry applied there has another term, a new
leader overwrote it and the proposal fails with a retryable error. On a follower
the command goes to the leader as a peer `Request` on the stream the follower
already has open; the leader answers with the index and term it got, and the
follower waits for its own state machine to apply that entry, so a client reads
its own write on the member it talks to. Applied results are kept for a short
while, for an answer that arrives after the apply.

Reads: `linearize()` asks the core for a read index (on a follower the core asks
the leader) and waits until the state machine has applied it, as etcd's
linearizable reads do; reads waiting together share one round. Serializable
reads skip it.

Snapshots: every `snapshot_count` applied entries. On the backend (every real
member) a snapshot is, as in etcd, a checkpoint committed with its raft
position: no file. Only when a lagging follower must be sent one is its file
written, from a read transaction of that checkpoint on the backend thread, and
streamed. Without a backend (the member simulation) the state machine is
exported and the storage saves it as the file. Either way the core then compacts
its log and the storage restarts its WAL (in the writer thread, after the
writes queued before it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import shutil
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import IO, Any, TypeVar

import lmdb
from google.protobuf import empty_pb2

from etcdserverpb import internal_pb2, peer_pb2
from queue_server.admission import MAX_UNAPPLIED, too_large
from queue_server.apply import (
    Applier,
    ApplyFailed,
    Checkpoint,
    sections_with_tables,
)
from queue_server.errors import (
    EtcdError,
    LeaderChanged,
    NoLeader,
    RequestTimeout,
    RequestTooLarge,
    ServerStopped,
    TooManyRequests,
)
from queue_server.proposals import ApplyResult
from queue_server.replication.peers import Peers, PeerUnavailable
from queue_server.replication.storage import (
    HeldPosition,
    RaftStorage,
    StoredEntry,
    encode_entry,
    encode_hard_state,
)
from queue_server.storage import etcd_backend
from queue_server.storage import snapshot as snapshot_format
from queue_server.storage.backend import Backend, CommitBatch
from queue_server.storage.revisions import position
from queue_server.storage.snapshot_codec import RawRevisions
from raft.core import NotLeader, ProposalDropped, RaftCore, Ready, Role
from raft.messages import (
    ConfChange,
    ConfChangeOp,
    DecodeError,
    Entry,
    EntryKind,
    HardState,
    Message,
    Snapshot,
    SnapshotMeta,
)

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.1
"""One raft tick, etcd's default --heartbeat-interval (100 ms): the leader's
heartbeat goes out every tick."""
ELECTION_TICKS = 10
"""Election timeout in ticks: etcd's default --election-timeout (1000 ms) over
its heartbeat interval."""
REQUEST_TIMEOUT = 7.0
"""How long a proposal or a linearizable read may wait (etcd: 5 s + 2 elections)."""
PEER_REQUEST_TIMEOUT = 2.0
"""How long a follower waits for the leader to place a forwarded request: past
it the leader is taken for gone and the request is tried again (within
REQUEST_TIMEOUT), on whoever leads by then."""
SNAPSHOT_IN_FILE = b""
"""The data of every raft snapshot this driver hands the core: the snapshot
itself is the file at its index (`RaftStorage.snapshot_path`), which the peer
transport streams to a follower and a follower's transport writes to a file as
it arrives, so no side holds a whole snapshot in memory."""
KEEP_RESULTS = 4096
"""Applied results kept for forwarded proposals whose answer arrives late."""

_T = TypeVar("_T")

_NO_RESULT = empty_pb2.Empty()
"""What a leader's empty entry or a membership change applies to."""


class ClusterLog:
    """The log of a member of a Raft cluster, behind the `Proposer` protocol."""

    def __init__(
        self,
        applier: Applier,
        member_id: int,
        voters: list[int],
        peers: Peers,
        storage: RaftStorage,
        *,
        keep_alive: Callable[[int], int],
        writer: Executor | None = None,
        backend_executor: Executor | None = None,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        election_ticks: int = ELECTION_TICKS,
        snapshot_count: int = 100_000,
        max_request_bytes: int = 1_572_864,
        join: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        """`storage` is the member's raft storage (`RaftStorage`, or a simulated
        disk in tests); its blocking writes run on `writer` (one thread by
        default), and the backend's commits and snapshot streams on
        `backend_executor` (one thread by default; the member simulation runs
        both in virtual time). `keep_alive(lease_id) -> ttl` refreshes a lease on this
        member's clock: the leader answers followers' forwarded keepalives with
        it. The tick is `heartbeat_seconds` and an election takes
        `election_ticks` ticks (etcd's --heartbeat-interval and
        --election-timeout over it)."""
        self.applier = applier
        self.state_machine = applier.state
        self.member_id = member_id
        self.peers = peers
        self.storage = storage
        self.snapshot_count = snapshot_count
        self.max_request_bytes = max_request_bytes
        self.heartbeat_seconds = heartbeat_seconds
        self.election_ticks = election_ticks
        self._keep_alive = keep_alive
        self._initial_voters = [] if join else voters
        self._writer = writer or ThreadPoolExecutor(max_workers=1, thread_name_prefix="raft-wal")
        self._rng = rng or random.Random(secrets.randbits(64))
        self.core: RaftCore | None = None
        self._waiters: dict[int, tuple[int, asyncio.Future[ApplyResult]]] = {}
        self._results: OrderedDict[int, tuple[int, ApplyResult]] = OrderedDict()
        self._applied_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._reads: dict[bytes, asyncio.Future[int]] = {}
        self._next_round: asyncio.Future[int] | None = None
        self._rounds: asyncio.Task[None] | None = None
        self._leader_known = asyncio.Event()
        self._busy = False
        self._again = False
        self._closed = False
        self._snapshot_index = 0
        self.backend: Backend | None = (
            applier.state.backend if isinstance(applier.state.backend, Backend) else None
        )
        """Where the state machine keeps its state, or None: in memory (the member
        simulation). With a backend, a snapshot is a checkpoint, and the file a
        follower is sent is written from its read transaction on the backend
        thread, while the loop goes on."""
        self._backend_thread = backend_executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="backend"
        )
        self._backend_jobs = 0
        """Jobs handed to the backend thread and not yet back (`_on_backend`):
        Defragment swaps its copy in only if the copy was the one."""
        self._defragmenting = asyncio.Lock()
        """One Defragment at a time: the copies share their directory."""
        self._snapshotting: asyncio.Task[None] | None = None
        self._snapshot_files: dict[int, asyncio.Task[bool]] = {}
        """Snapshot files being written from the backend for followers, by index."""
        self._snapshot_asked: asyncio.Future[bool] | None = None
        """`snapshot_now` during a Ready: the snapshot is taken at its `advance`
        (True), or the cycle ended without one (False: the caller takes it)."""
        self._ticker: asyncio.Task[None] | None = None
        self._cycle: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._received: tuple[int, int, snapshot_format.SnapshotContents, str] | None = None
        """The snapshot a peer sent that passed its checks and the core took:
        index, term, what it holds and its file, until `_install`."""
        self.on_leader_change: Callable[[int], None] | None = None
        self.on_conf_change: Callable[[ConfChange], None] | None = None
        self.on_restored: Callable[[], None] | None = None
        self._last_leader = 0
        self._last_term = 0

    # -- start and stop ---------------------------------------------------------------

    def recover(self) -> None:
        """Load what this member persisted and rebuild the core and the state."""
        sm = self.state_machine
        backend = self.backend
        held = backend.consistent_index if backend is not None else 0
        raw_position = backend.raft_snapshot() if backend is not None else None
        position = HeldPosition.decode(raw_position) if raw_position is not None else None
        loaded = (
            self.storage.load(state_held_at=held, held_position=position)
            if held
            else self.storage.load()
        )
        snap: Snapshot | None = None
        if backend is not None and held and held >= loaded.snapshot_index:
            # The backend holds the state at or after the newest snapshot.
            image = backend.sections()
            if image is None:
                raise snapshot_format.CorruptSnapshotError(f"{backend.path}: no sections")
            contents = snapshot_format.decode(image, os.path.join(backend.path, "sections"))
            sm.restore_state(contents.state, backend.scan_keys(), backend.table_rows)
            backend.release_mapped_pages()  # the scan's pages: page cache, not ours
        elif loaded.state is not None:
            sm.restore_state(loaded.state)
            if backend is not None:  # the backend did not hold it yet: now it does
                self._commit_checkpoint(
                    sm.checkpoint(),
                    position=HeldPosition(
                        loaded.snapshot_index,
                        loaded.snapshot_term,
                        loaded.voters,
                        sm.store.history_key_count,
                    ),
                )
        if loaded.snapshot_index:
            self._snapshot_index = loaded.snapshot_index
            meta = SnapshotMeta(loaded.snapshot_index, loaded.snapshot_term, loaded.voters)
            snap = Snapshot(meta, SNAPSHOT_IN_FILE)
        fresh = loaded.term == 0 and not loaded.entries and snap is None
        if fresh:
            self.core = RaftCore(
                self.member_id,
                self._initial_voters,
                rng=self._rng,
                election_ticks=self.election_ticks,
            )
        else:
            entries = [Entry(e.term, e.index, EntryKind(e.kind), e.data) for e in loaded.entries]
            # The commit index is written only with a Ready that must sync, so
            # it may lag what the backend applied (a checkpoint committed, then
            # a crash before the WAL restart wrote the hard state after it).
            # Whatever was applied was committed and is in the log.
            hs = HardState(loaded.term, loaded.vote, max(loaded.commit, sm.applied_index))
            self.core = RaftCore.restore(
                self.member_id,
                hs,
                snap,
                entries,
                rng=self._rng,
                applied=sm.applied_index if sm.applied_index >= self._snapshot_index else None,
                election_ticks=self.election_ticks,
            )
        log.info(
            "raft recovered member=%x term=%d snapshot=%d entries=%d voters=%s",
            self.member_id,
            loaded.term,
            loaded.snapshot_index,
            len(loaded.entries),
            ",".join(f"{v:x}" for v in sorted(self.core.voters)),
        )

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ticker = loop.create_task(self._tick_forever())
        self._kick()

    async def close(self) -> None:
        self._closed = True
        if self._ticker is not None:
            self._ticker.cancel()
        while self._cycle is not None and not self._cycle.done():
            await asyncio.shield(self._cycle)
        for _, fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(ServerStopped())
        if self._snapshotting is not None:
            await asyncio.wait([self._snapshotting])
        self._writer.shutdown(wait=True)
        self._backend_thread.shutdown(wait=True)
        self.storage.close()
        if self.backend is not None:
            self.backend.close()

    # -- what the rest of the server asks -------------------------------------------

    @property
    def last_index(self) -> int:
        return self.core.last_index if self.core is not None else 0

    @property
    def term(self) -> int:
        return self.core.term if self.core is not None else 0

    @property
    def leader_id(self) -> int:
        return self.core.leader_id if self.core is not None else 0

    @property
    def is_leader(self) -> bool:
        return self.core is not None and self.core.role is Role.LEADER

    @property
    def voters(self) -> frozenset[int]:
        return self.core.voters if self.core is not None else frozenset()

    async def propose(self, command: internal_pb2.Command) -> ApplyResult:
        """Replicate `command`; its result once this member has applied it."""
        if self._closed or self.state_machine.failed is not None:
            raise ServerStopped()
        if len(self._waiters) >= MAX_UNAPPLIED:
            raise TooManyRequests()
        data = command.SerializeToString()
        if too_large(command, data, self.max_request_bytes):
            raise RequestTooLarge()
        request = peer_pb2.Request()
        request.propose.command = data
        return await self._replicate(request)

    async def change_membership(self, op: ConfChangeOp, member_id: int, context: bytes) -> None:
        """Add or remove one voter, through the leader; returns once applied here."""
        request = peer_pb2.Request()
        change = request.conf_change
        change.op = (
            peer_pb2.ConfChangeRequest.ADD
            if op is ConfChangeOp.ADD
            else peer_pb2.ConfChangeRequest.REMOVE
        )
        change.member_id = member_id
        change.context = context
        await self._replicate(request)

    async def _replicate(self, request: peer_pb2.Request) -> ApplyResult:
        """Place `request` in the leader's log (here or through the leader) and
        wait for this member to apply it."""
        deadline = asyncio.get_running_loop().time() + REQUEST_TIMEOUT
        while True:
            placed = await self._place(request, deadline)
            if placed is not None:
                index, term = placed
                return await self._result(index, term, deadline)

    def _propose_local(self, request: peer_pb2.Request) -> int:
        """Append a proposal or a membership change to this leader's log; its
        index. Raises NotLeader / ProposalDropped (and ValueError for a
        meaningless membership change)."""
        core = self.core
        assert core is not None
        if request.HasField("conf_change"):
            change = request.conf_change
            if change.op == peer_pb2.ConfChangeRequest.ADD:
                return core.propose_conf_change(add=change.member_id, context=change.context)
            return core.propose_conf_change(remove=change.member_id, context=change.context)
        return core.propose(request.propose.command)

    async def _place(self, request: peer_pb2.Request, deadline: float) -> tuple[int, int] | None:
        """Put a request in the leader's log: (index, term), or None to try
        again. A request the leader may have taken but did not answer is not
        tried again (it could be applied twice): the caller gets `etcdserver:
        request timed out`, as from etcd when its leader goes away mid-write."""
        core = self.core
        assert core is not None
        loop = asyncio.get_running_loop()
        if core.role is Role.LEADER:
            try:
                index = self._propose_local(request)
            except (NotLeader, ProposalDropped):
                await self._pause(deadline)
                return None
            self._kick()
            return index, core.term
        leader = core.leader_id
        if leader == 0:
            await self._wait_leader(deadline)
            return None
        timeout = min(PEER_REQUEST_TIMEOUT, max(0.0, deadline - loop.time()))
        try:
            answer = await self.peers.request(leader, request, timeout)
        except PeerUnavailable as e:
            log.debug("forward to leader failed leader=%x sent=%s error=%s", leader, e.sent, e)
            if e.sent:
                raise RequestTimeout() from None
            await self._pause(deadline)
            return None
        if not answer.HasField("placed"):
            await self._pause(deadline)
            return None
        if loop.time() > deadline:
            raise RequestTimeout()
        return answer.placed.index, answer.placed.term

    async def _pause(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() + self.heartbeat_seconds > deadline:
            raise RequestTimeout()
        await asyncio.sleep(self.heartbeat_seconds)

    async def _wait_leader(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise NoLeader()
        self._leader_known.clear()
        try:
            await asyncio.wait_for(
                self._leader_known.wait(), min(remaining, self.heartbeat_seconds * 5)
            )
        except TimeoutError:
            if loop.time() >= deadline:
                raise NoLeader() from None

    async def _result(self, index: int, term: int, deadline: float) -> ApplyResult:
        kept = self._results.get(index)
        if kept is not None:
            if kept[0] != term:
                raise LeaderChanged()
            return kept[1]
        if index <= self.state_machine.applied_index:
            raise LeaderChanged()  # applied and forgotten: cannot tell; rare, retryable
        fut: asyncio.Future[ApplyResult] = asyncio.get_running_loop().create_future()
        self._waiters[index] = (term, fut)
        try:
            return await asyncio.wait_for(
                asyncio.shield(fut), deadline - asyncio.get_running_loop().time()
            )
        except TimeoutError:
            raise RequestTimeout() from None
        finally:
            if self._waiters.get(index, (0, None))[1] is fut:
                del self._waiters[index]

    async def linearize(self) -> None:
        """Wait until this member's state reflects every write committed before now.

        Reads share ReadIndex rounds, as etcd's do: a read joins the next round,
        which starts after it arrived, so one leader confirmation serves every
        read that was waiting when the round began."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REQUEST_TIMEOUT
        if self._next_round is None:
            self._next_round = loop.create_future()
        round_ = self._next_round
        if self._rounds is None or self._rounds.done():
            self._rounds = loop.create_task(self._read_rounds())
        try:
            index = await asyncio.wait_for(asyncio.shield(round_), REQUEST_TIMEOUT)
        except TimeoutError:
            raise RequestTimeout() from None
        await self._applied(index, deadline)

    async def _read_rounds(self) -> None:
        """One ReadIndex at a time, each answering the reads gathered before it."""
        while self._next_round is not None:
            round_, self._next_round = self._next_round, None
            try:
                index = await self._read_index()
            except EtcdError as e:
                if not round_.done():
                    round_.set_exception(e)
                continue
            if not round_.done():
                round_.set_result(index)

    async def _read_index(self) -> int:
        """The leader's commit index, confirmed by a quorum (retried across
        leader changes until REQUEST_TIMEOUT)."""
        core = self.core
        assert core is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REQUEST_TIMEOUT
        while True:
            ctx = secrets.token_bytes(12)
            fut: asyncio.Future[int] = loop.create_future()
            self._reads[ctx] = fut
            try:
                core.read_index(ctx)
            except NotLeader:
                self._reads.pop(ctx, None)
                await self._wait_leader(deadline)
                continue
            self._kick()
            try:
                return await asyncio.wait_for(fut, min(1.0, max(0.0, deadline - loop.time())))
            except TimeoutError:
                if loop.time() >= deadline:
                    raise RequestTimeout() from None
                continue  # leadership moved: ask again
            finally:
                self._reads.pop(ctx, None)

    async def _applied(self, index: int, deadline: float) -> None:
        if self.state_machine.applied_index >= index:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._applied_waiters.append((index, fut))
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            raise RequestTimeout() from None

    async def snapshot_now(self) -> None:
        """Take a snapshot at the applied index (Defragment, tests).

        Not in the middle of a Ready: its committed entries are applied to the
        state machine before its write ends, and the core counts them (and their
        membership changes) applied only at its `advance`, so a snapshot there
        would name the wrong voters and could not be compacted to. It is taken
        at that `advance` instead, or once the cycle has ended."""
        loop = asyncio.get_running_loop()
        if self._snapshotting is not None:
            await asyncio.wait([self._snapshotting])
        while self._busy and not self._closed:
            if self._snapshot_asked is None:
                self._snapshot_asked = loop.create_future()
            if await asyncio.shield(self._snapshot_asked):
                break
        else:
            applied = self.state_machine.applied_index
            if applied > self._snapshot_index and self.core is not None:
                self._snapshot(applied)
        if self._snapshotting is not None:
            await asyncio.wait([self._snapshotting])
        await loop.run_in_executor(self._writer, lambda: None)

    # -- whole-state operations (api.maintenance.StateFiles) ---------------------------

    async def defragment(self) -> None:
        """etcd's Defragment: a snapshot (the log trimmed), then the backend file
        rewritten without its free pages on the backend thread. A copy that a
        checkpoint overtook (a snapshot or an install committed meanwhile) is
        dropped, never swapped in."""
        await self.snapshot_now()
        backend = self.backend
        if backend is None:
            return
        async with self._defragmenting:
            before = self._committed_index()
            copy = backend.path + ".defrag"
            await self._on_backend(backend.copy_compacted, copy)
            # Another job on the backend thread (an installed snapshot's
            # commit) may be running: the file is not closed under it.
            busy = self._backend_jobs or self._snapshotting is not None
            if self._committed_index() != before or busy:
                shutil.rmtree(copy, ignore_errors=True)
                log.info("defragment skipped: a checkpoint committed during the copy")
                return
            backend.swap_in(copy)

    async def _on_backend(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the backend thread, counted in `_backend_jobs`."""
        self._backend_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._backend_thread, fn, *args)
        finally:
            self._backend_jobs -= 1

    def _committed_index(self) -> int:
        assert self.backend is not None
        txn = self.backend.begin_read()
        try:
            return self.backend.consistent_index_in(txn)
        finally:
            txn.abort()

    async def hash_kv(self, revision: int) -> int:
        """The store's checksum at `revision` (checked already, 0: now). With a
        backend it is not computed on the loop, where it takes time in proportion
        to the data (over a second at 200,000 keys: the leader's heartbeats stop
        and the followers elect another): a snapshot, as Defragment takes one,
        makes the backend hold the state, and the backend thread sums a read
        transaction of it, the value `MVCCStore.hash_kv` gives."""
        sm, backend = self.state_machine, self.backend
        if backend is None:
            return sm.store.hash_kv(revision)
        bound = position(sm.store.check_revision(revision)) << 1 | 1
        return await self._read_applied(lambda held, txn: backend.hash_revisions(txn, bound))

    async def _read_applied(self, read: Callable[[int, lmdb.Transaction], _T]) -> _T:
        """`read(index, txn)` on the backend thread over a read transaction of the
        applied state: a snapshot (a checkpoint) first makes the backend hold it.
        Refused if that checkpoint failed (logged): never a read of an older state."""
        backend = self.backend
        assert backend is not None
        applied = self.state_machine.applied_index
        await self.snapshot_now()

        def job() -> _T:
            txn = backend.begin_read()
            try:
                held = backend.consistent_index_in(txn)
                if held < applied:
                    raise RuntimeError(f"the backend holds index {held}, not {applied}")
                return read(held, txn)
            finally:
                txn.abort()

        return await self._on_backend(job)

    async def export_etcd_db(self, fileobj: IO[bytes]) -> int:
        """The state as an etcd backend database into `fileobj` (Maintenance.
        Snapshot). With a backend: a snapshot makes the backend hold the applied
        state (as `hash_kv`), then the backend thread writes the file from a read
        transaction of it, the `key` bucket copied straight from the `key` db;
        nothing in proportion to the data runs on the loop. Without one (the
        member simulation): exported on the loop, written on a thread."""
        sm, backend = self.state_machine, self.backend
        if backend is None:
            index = sm.applied_index
            state = sm.export_state()
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: etcd_backend.write_etcd_db(fileobj, index, state)
            )

        def write(held: int, txn: lmdb.Transaction) -> int:
            image = backend.sections(txn)
            if image is None:
                raise RuntimeError(f"the backend at index {held} has no sections")
            sections = snapshot_format.decode(image, "backend sections").state
            state = sections_with_tables(sections, lambda t: backend.table_rows(t, txn))
            return etcd_backend.write_etcd_db(
                fileobj, held, state, key_items=backend.raw_revisions(txn)
            )

        return await self._read_applied(write)

    # -- peers ------------------------------------------------------------------------

    def deliver(self, messages: list[bytes]) -> None:
        """Raft messages from a peer."""
        core = self.core
        if core is None or self._closed:
            return
        for raw in messages:
            try:
                m = Message.from_bytes(raw)
            except DecodeError as e:
                log.warning("dropping a malformed raft message: %s", e)
                continue
            if m.dst != self.member_id:  # the wire's Hello already named this member
                log.debug("raft message for another member dropped dst=%x", m.dst)
                continue
            if m.snapshot is not None:
                log.warning(
                    "raft snapshot refused from=%x index=%d error=snapshots come streamed, "
                    "not inside a raft batch",
                    m.src,
                    m.snapshot.meta.index,
                )
                continue
            core.step(m)
        self._kick()

    def deliver_snapshot(self, message: bytes, path: str) -> None:
        """A snapshot message from a peer, its snapshot in the file at `path`.
        The file is checked before the core may take the message: it must be a
        valid snapshot in today's format (parsed as data, record by record, never
        executed: a pickle or any other bytes are refused) at the index the
        message says. The parsed contents and the file are kept for `_install`."""
        core = self.core
        try:
            m = Message.from_bytes(message)
        except DecodeError as e:
            log.warning("dropping a malformed raft snapshot message: %s", e)
            os.remove(path)
            return
        if core is None or self._closed or m.snapshot is None or m.dst != self.member_id:
            os.remove(path)
            return
        if core.log.pending_snapshot is not None:
            os.remove(path)  # one is being installed; the leader sends again if need be
            return
        meta = m.snapshot.meta
        name = f"snapshot from member {m.src:x} at index {meta.index}"
        try:
            with open(path, "rb") as f:
                contents = snapshot_format.read_snapshot(f, name)
            if contents.index != meta.index:
                raise snapshot_format.CorruptSnapshotError(
                    f"{name} is not a valid snapshot: it says index {contents.index}", meta.index
                )
        except snapshot_format.CorruptSnapshotError as e:
            log.warning("raft snapshot refused from=%x index=%d error=%s", m.src, meta.index, e)
            os.remove(path)
            return
        self._received = (meta.index, meta.term, contents, path)
        core.step(m)
        if core.log.pending_snapshot is None:  # not past what this member has: not taken
            self._received = None
            os.remove(path)
        self._kick()

    async def answer(self, request: peer_pb2.Request) -> peer_pb2.Answer:
        """A follower's request: place a proposal or a membership change in this
        leader's log, or refresh a lease on this leader's clock. Anything else,
        or any request while not the leader, is refused: the follower asks again."""
        core = self.core
        answer = peer_pb2.Answer()
        if core is None or self._closed or core.role is not Role.LEADER:
            answer.refused.reason = "not the leader"
            answer.refused.leader = core.leader_id if core is not None else 0
            return answer
        if request.HasField("keep_alive"):
            answer.keep_alive.ttl = self._keep_alive(request.keep_alive.lease_id)
            return answer
        if not (request.HasField("propose") or request.HasField("conf_change")):
            answer.refused.reason = "unknown request"
            return answer
        try:
            index = self._propose_local(request)
        except (NotLeader, ProposalDropped, ValueError) as e:
            answer.refused.reason = str(e) or type(e).__name__
            answer.refused.leader = core.leader_id
            return answer
        self._kick()
        answer.placed.index = index
        answer.placed.term = core.term
        return answer

    def peer_closed(self, member_id: int) -> None:
        """The leader closed its connection to this member: likely dead, so the
        election need not wait for a whole timeout of silence."""
        core = self.core
        if core is not None and member_id == core.leader_id and core.role is not Role.LEADER:
            log.info("raft leader closed its connection leader=%x", member_id)
            core.leader_unreachable()

    def forward_keep_alive(self, lease_id: int) -> None:
        """A client kept a lease alive on this follower: refresh it on the
        leader's clock too, which decides expiry. Best effort: the client keeps
        alive again within a third of the TTL, and a new leader re-arms every
        lease with a full TTL."""
        if self.is_leader or self.leader_id == 0 or self._closed:
            return
        request = peer_pb2.Request()
        request.keep_alive.lease_id = lease_id
        task = asyncio.get_running_loop().create_task(self._keep_alive_on(self.leader_id, request))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _keep_alive_on(self, leader: int, request: peer_pb2.Request) -> None:
        try:
            await self.peers.request(leader, request, PEER_REQUEST_TIMEOUT)
        except PeerUnavailable as e:
            log.debug("keepalive forward failed leader=%x error=%s", leader, e)

    # -- the Ready cycle --------------------------------------------------------------

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            if self.core is not None:
                self.core.tick()
                self._kick()

    def _kick(self) -> None:
        """Run the Ready cycle soon (once, however many times it is kicked)."""
        if self.state_machine.failed is not None:
            return  # fail-stop: nothing more is written or applied
        if self._busy:
            self._again = True
            return
        self._busy = True
        self._cycle = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        core = self.core
        assert core is not None
        try:
            while True:
                self._again = False
                while core.has_ready():
                    rd = core.ready()
                    await self._handle(rd)
                    core.advance(rd)
                    self._after_advance()
                if not self._again:
                    return
        except ApplyFailed:  # the applier logged it and stops the server
            self._stop_cycle()
        except Exception as e:
            # A write that failed, a snapshot that cannot be installed: the member
            # cannot go on without skipping part of a Ready, so it stops, as etcd
            # panics. Its log is what it was before this Ready.
            log.critical("raft ready cycle failed; stopping the member", exc_info=True)
            failure = ApplyFailed(self.state_machine.applied_index, e)
            failure.reported = True
            self.state_machine.failed = failure
            self._stop_cycle()
            if self.applier.on_fatal is not None:
                self.applier.on_fatal(failure)
        finally:
            self._busy = False
            asked, self._snapshot_asked = self._snapshot_asked, None
            if asked is not None and not asked.done():
                asked.set_result(False)

    def _stop_cycle(self) -> None:
        """Nothing more is written or applied; waiting proposals fail."""
        self._closed = True
        for _, fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(ServerStopped())

    async def _handle(self, rd: Ready) -> None:
        loop = asyncio.get_running_loop()
        # A leader sends before its own write (Raft thesis 10.2.1, as etcd does):
        # its appends promise nothing about its own log, and the core counts the
        # leader towards a commit only once `advance` says its entries are stable.
        # So the followers' fsyncs overlap the leader's. Any other member's
        # messages (votes, acknowledgements) promise what this Ready persists,
        # and wait for it.
        early = self.core is not None and self.core.role is Role.LEADER
        if early:
            self._send(rd)
        if rd.snapshot is not None:
            await self._install(rd.snapshot)
        records: list[bytes] = [
            encode_entry(StoredEntry(e.index, e.term, int(e.kind), e.data)) for e in rd.entries
        ]
        if rd.hard_state is not None and rd.must_sync:
            hs = rd.hard_state
            records.append(encode_hard_state(hs.term, hs.vote, hs.commit))
        write: asyncio.Future[None] | None = None
        if records:
            data, last = self.storage.encode(records)
            write = loop.run_in_executor(self._writer, self.storage.write, data, last)
        # The committed entries were made durable by an earlier Ready (the core
        # hands out no other), so they are applied while this Ready's write and
        # fsync run in the writer thread: the two overlap on two cores, and a
        # client's answer does not wait for an fsync of later entries.
        for e in rd.committed:
            self._apply(e)
        if rd.committed:
            self.applier.batch_applied()
        if write is not None:
            await write
        if not early:
            self._send(rd)
        for rs in rd.read_states:
            fut = self._reads.get(rs.context)
            if fut is not None and not fut.done():
                fut.set_result(rs.index)

    def _send(self, rd: Ready) -> None:
        send = self.peers.send
        for m in rd.messages:
            if m.snapshot is not None:
                index = m.snapshot.meta.index
                if self.backend is not None and not self.storage.has_snapshot_file(index):
                    self._send_from_backend(m)
                else:
                    self.peers.send_snapshot(m.dst, m.to_bytes(), self.storage.snapshot_path(index))
            else:
                send(m.dst, m.to_bytes())

    def _apply(self, e: Entry) -> None:
        sm = self.state_machine
        if e.index <= sm.applied_index:
            return  # already in the restored state
        result: ApplyResult
        if e.kind is EntryKind.NORMAL and e.data:
            # An ApplyFailed goes up: the member stops (fail-stop, as etcd panics).
            result = self.applier.apply(e.index, internal_pb2.Command.FromString(e.data))
        elif e.kind is EntryKind.CONF_CHANGE:
            change = ConfChange.from_bytes(e.data)
            urls = tuple(json.loads(change.context or b"{}").get("peer_urls", ()))
            effects = sm.apply_member_change(
                e.index, change.node_id, change.op is ConfChangeOp.ADD, urls
            )
            self.applier.sink.applied(effects)
            result = _NO_RESULT
            if self.on_conf_change is not None:
                self.on_conf_change(change)
        else:
            sm.skip(e.index)  # a leader's empty entry
            result = _NO_RESULT
        self._results[e.index] = (e.term, result)
        if len(self._results) > KEEP_RESULTS:
            self._results.popitem(last=False)
        waiter = self._waiters.pop(e.index, None)
        if waiter is not None:
            term, fut = waiter
            if not fut.done():
                if term == e.term:
                    fut.set_result(result)
                else:
                    fut.set_exception(LeaderChanged())

    def _after_advance(self) -> None:
        core = self.core
        assert core is not None
        applied = self.state_machine.applied_index
        if self._applied_waiters:
            still = []
            for index, fut in self._applied_waiters:
                if index <= applied:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    still.append((index, fut))
            self._applied_waiters = still
        leader = core.leader_id
        if leader:
            self._leader_known.set()
        if leader != self._last_leader or core.term != self._last_term:
            self._last_leader, self._last_term = leader, core.term
            log.info("raft leader member=%x term=%d", leader, core.term)
            if self.on_leader_change is not None:
                self.on_leader_change(leader)
        asked, self._snapshot_asked = self._snapshot_asked, None
        if applied - self._snapshot_index >= self.snapshot_count or (
            asked is not None and applied > self._snapshot_index
        ):
            self._snapshot(applied)
        if asked is not None and not asked.done():
            asked.set_result(True)

    def _snapshot(self, index: int) -> None:
        """Snapshot the state at applied `index`: the core drops its log up to it,
        and the writer thread streams the exported state to the snapshot file,
        then restarts the WAL after it."""
        core = self.core
        assert core is not None
        if self.backend is not None:
            if self._snapshotting is None:
                # The contents are taken now, at `index`; the task writes them.
                sm = self.state_machine
                assert sm.applied_index == index
                self._snapshotting = asyncio.get_running_loop().create_task(
                    self._snapshot_from_backend(
                        index,
                        sm.checkpoint(),
                        sm.store.history_key_count,
                        core.log.term(index) or 0,
                        tuple(core.conf_at(index)),
                    )
                )
            return
        state = self.state_machine.export_state()
        hs = core.hard_state
        term = core.log.term(index) or 0
        voters = core.conf_at(index)
        core.compact(index, SNAPSHOT_IN_FILE)
        # Every entry the core holds after `index` goes into the restarted WAL,
        # those whose write is still in flight included: that write lands in the
        # segment this job deletes (found by the member simulation, with
        # Defragment during a write). Replay's replacement rule resolves an entry
        # written twice.
        later = [
            StoredEntry(e.index, e.term, int(e.kind), e.data)
            for e in core.log.slice(index + 1, core.log.last_index)
        ]
        job = self.storage.snapshot_job(
            index, state, term, voters, (hs.term, hs.vote, hs.commit), later
        )
        self._writer.submit(job)
        self._snapshot_index = index

    async def _snapshot_from_backend(
        self,
        index: int,
        checkpoint: Checkpoint,
        key_count: int,
        term: int,
        voters: tuple[int, ...],
    ) -> None:
        """A snapshot at applied `index` with the state on the backend, as
        etcd's: the checkpoint's contents are taken on the loop (the key
        revisions made since the last one, the sections), the backend thread
        commits them with the snapshot's raft position, and that commit is the
        snapshot. No file is written: a follower that needs one gets it written
        from a read transaction when it is sent (`_send_from_backend`). Only
        then does the core compact its log and the WAL restart after it."""
        core, sm, backend = self.core, self.state_machine, self.backend
        assert core is not None and backend is not None
        try:
            held = HeldPosition(index, term, voters, key_count)

            def commit() -> None:
                self._commit_checkpoint(checkpoint, renew=False, position=held)
                try:  # the commit supersedes them; a file left over is only space
                    self.storage.remove_snapshots_below(index)
                except OSError as e:
                    log.warning("old raft snapshot files not removed error=%r", e)

            try:
                await self._on_backend(commit)
            except (lmdb.Error, OSError) as e:
                sm.checkpoint_failed(checkpoint)
                log.error("raft snapshot failed, will retry index=%d error=%r", index, e)
                return
            backend.renew_reader()
            sm.checkpoint_done()
            if self.core is not core or self._closed or self._snapshot_index >= index:
                return  # a snapshot from the leader replaced the state meanwhile
            if core.log.pending_snapshot is not None:
                return  # one from the leader is being installed: it waits for this to end
            hs = core.hard_state
            core.compact(index, SNAPSHOT_IN_FILE)
            later = [
                StoredEntry(e.index, e.term, int(e.kind), e.data)
                for e in core.log.slice(index + 1, core.log.last_index)
            ]
            self._writer.submit(self.storage.restart_job((hs.term, hs.vote, hs.commit), later))
            self._snapshot_index = index
            log.info("raft snapshot index=%d (the backend's checkpoint)", index)
        finally:
            self._snapshotting = None

    def _send_from_backend(self, m: Message) -> None:
        """Send raft snapshot message `m` once its file is written from the
        backend's checkpoint at its index (one file for every follower that
        needs it); dropped, as a failed send, when the backend has moved past
        that checkpoint (Raft sends the newer snapshot then)."""
        assert m.snapshot is not None
        index = m.snapshot.meta.index
        written = self._snapshot_files.get(index)
        if written is None:
            written = asyncio.get_running_loop().create_task(self._write_snapshot_file(index))
            self._snapshot_files[index] = written
            written.add_done_callback(lambda _: self._snapshot_files.pop(index, None))
        dst, message, path = m.dst, m.to_bytes(), self.storage.snapshot_path(index)

        def send(task: asyncio.Task[bool]) -> None:
            if not task.cancelled() and task.exception() is None and task.result():
                self.peers.send_snapshot(dst, message, path)

        written.add_done_callback(send)

    async def _write_snapshot_file(self, index: int) -> bool:
        """The snapshot file at raft `index`, streamed on the backend thread from
        a read transaction of the checkpoint taken as that snapshot; False if
        the backend holds another one by now."""
        backend = self.backend
        assert backend is not None

        def write() -> bool:
            txn = backend.begin_read()
            try:
                raw = backend.raft_snapshot(txn)
                if raw is None or backend.consistent_index_in(txn) != index:
                    return False
                held = HeldPosition.decode(raw)
                image = backend.sections(txn)
                if held.index != index or image is None:
                    return False
                sections = snapshot_format.decode(image, "backend sections").state
                revision, compact_revision, _ = sections["mvcc"]
                keys = RawRevisions(held.key_count, backend.raw_revisions(txn))
                # The parts' rows, from the same commit, back in their sections.
                whole = sections_with_tables(sections, lambda t: backend.table_rows(t, txn))
                state = dict(whole, mvcc=(revision, compact_revision, keys))
                size = self.storage.save_snapshot(index, state, held.term, held.voters)
                log.info("raft snapshot file written index=%d bytes=%d", index, size)
                return True
            finally:
                txn.abort()

        try:
            return await self._on_backend(write)
        except (lmdb.Error, OSError) as e:
            log.error("raft snapshot file failed index=%d error=%r", index, e)
            return False

    def _commit_checkpoint(
        self, checkpoint: Checkpoint, renew: bool = True, position: HeldPosition | None = None
    ) -> None:
        """Write `checkpoint` to the backend on this thread (with the raft
        position it stands for, if it is taken as a raft snapshot)."""
        backend = self.backend
        assert backend is not None
        image = snapshot_format.encode(checkpoint.index, checkpoint.sections)
        backend.commit(
            CommitBatch(
                checkpoint.index,
                checkpoint.writes,
                checkpoint.dropped,
                image,
                checkpoint.tables,
                checkpoint.replace,
                position.encode() if position is not None else None,
            )
        )
        if renew:
            backend.renew_reader()
            self.state_machine.checkpoint_done()

    async def _install(self, snap: Snapshot) -> None:
        """A snapshot from the leader (checked when it arrived): persist it, then
        become it."""
        meta = snap.meta
        received, self._received = self._received, None
        if received is None or received[:2] != (meta.index, meta.term):
            # The core only takes snapshots that `deliver_snapshot` checked and kept.
            raise RuntimeError(f"no checked snapshot file for index {meta.index}")
        contents, path = received[2], received[3]
        hs = self.core.hard_state if self.core is not None else HardState()
        job = self.storage.install_job(
            meta.index, path, (hs.term, hs.vote, max(hs.commit, meta.index))
        )
        loop = asyncio.get_running_loop()
        if self._snapshotting is not None:  # our own one is older: let it end
            await asyncio.wait([self._snapshotting])
        await loop.run_in_executor(self._writer, job)
        self.state_machine.restore_state(contents.state)
        self._snapshot_index = meta.index
        if self.backend is not None:
            # Until this commits, a restart finds the backend behind the
            # snapshot file and restores from the file.
            checkpoint = self.state_machine.checkpoint()
            held = HeldPosition(
                meta.index,
                meta.term,
                tuple(meta.voters),
                self.state_machine.store.history_key_count,
            )
            await self._on_backend(self._commit_checkpoint, checkpoint, False, held)
            self.backend.renew_reader()
            self.state_machine.checkpoint_done()
        if self.on_restored is not None:
            self.on_restored()  # node-local views rebuild from the new state
        log.info("raft installed snapshot index=%d term=%d", meta.index, meta.term)
