"""An I/O-free Raft core in the style of etcd's `raft` package.

`RaftCore` is a deterministic state machine over Raft's state: it never reads a
clock, touches a disk or a socket, starts a thread or draws a random number except
from the `random.Random` it is given. A driver (one asyncio task, the server's
`queue_server/replication/driver.py`) feeds it and carries out what it asks for:

- `tick()` on a fixed timer (the election and heartbeat timeouts count ticks);
- `step(msg)` for every message received from a peer (decoded with
  `Message.from_bytes`);
- `propose(data)`, `propose_conf_change(...)`, `read_index(ctx)`,
  `transfer_leadership(to)` and `compact(index, data)` for its own requests;
- after any of these, `while core.has_ready(): rd = core.ready(); ...;
  core.advance(rd)`.

The Ready contract
------------------
Every `Ready` must be handled in this order, completely, before `advance(rd)`; and
`ready()` must not be called again before `advance(rd)` (it raises). The core may be
ticked, stepped and proposed to between `ready()` and `advance()`: `advance` only
acknowledges what that Ready contained.

1. `rd.snapshot` (a snapshot sent by the leader): persist it as the node's snapshot,
   discard **all** stored log entries, and restore the state machine from
   `rd.snapshot.data`. The core already counts it as applied.
2. `rd.entries`: delete every stored entry whose index is >= `rd.entries[0].index`,
   then append `rd.entries`. (This is how a follower's truncation of a conflicting,
   uncommitted suffix is signalled: the first entry overwrites what is stored at
   its index. `rd.entries` is always contiguous and never starts past the stored
   last index + 1, nor at or below a commit index already persisted.)
3. `rd.hard_state` (None when unchanged): persist it.
4. Make 1-3 durable (fsync) if `rd.must_sync`; a changed commit index alone needs no
   fsync.
5. Only then send `rd.messages` (in any order; losing some is fine, Raft retries).
   A message can promise what 1-3 wrote (a vote, an acknowledged entry), which is
   why it must not leave before they are durable. One exception: a node that is
   the leader when it takes the Ready may send its messages *before* 1-4 (Raft
   thesis 10.2.1, as etcd does). A leader's appends and heartbeats promise nothing
   about its own log, and the core counts the leader's own entries towards a
   commit only once `advance` reports them stable, so followers' fsyncs overlap
   the leader's.
6. Apply `rd.committed` to the state machine, in order. These entries were all made
   durable by an earlier Ready (the core only hands out committed entries that
   `advance` has confirmed persisted), so step 6 may also run concurrently with 1-5.
   A CONF_CHANGE entry's data is a `ConfChange` (`ConfChange.from_bytes`); the core
   itself applies it to its voter set in `advance`.
7. Hand `rd.read_states` to the reads waiting on their context: such a read may be
   served once the state machine has applied `ReadState.index`.
8. `core.advance(rd)`.

On restart, rebuild the core with `RaftCore.restore(node_id, hard_state, snapshot,
entries, ...)` from what steps 1-3 persisted (and nothing else). Unless `applied`
is given, the committed entries after the snapshot are handed out again for the
state machine to replay.

Design choices
--------------
- Bootstrap: `RaftCore(node_id, voters)` with the same non-empty `voters` on every
  founding member writes the same first entry, index 1 and term 1, a CONF_CHANGE
  `ConfChange(INIT, voters=...)`, committed, so the membership history lives in the
  log (as etcd does). A node joining later starts with `voters=()` and never
  campaigns before it has learned a configuration: the leader brings it the log
  from index 1 (or a snapshot) once the ADD is applied on the leader.
- Membership changes add or remove one voter at a time and take effect on a node
  when the entry is *applied*, i.e. in `advance` past it (etcd's choice): from
  then on the leader replicates to an added voter and counts it in every quorum,
  and stops both for a removed one. The leader refuses a new change
  (`ConfChangePending`) until it has applied the previous one and the first entry
  of its term (so at most one change is ever uncommitted, and a new leader's
  commit index is current before it changes anything). A node does not campaign
  while its log holds committed conf changes it has not applied yet.
- A leader that applies its own removal does not drop everything at once: it keeps
  leading without counting itself (so the remaining voters learn that the change
  committed), refuses proposals, and hands over to the most caught-up voter with
  TIMEOUT_NOW (re-sent while that voter is not yet able to campaign); it steps
  down when the successor's vote request arrives (or CheckQuorum fails). A node
  outside its configuration may still campaign, and if it wins it only hands over
  the same way: after the leader of two voters removes itself and stops at once,
  the survivor still counts it as a voter and may need its longer log to learn
  that the removal committed. (With PreVote and CheckQuorum on, such a node cannot
  disturb a working cluster; the driver should still stop a removed member once a
  leader of the new configuration has been seen.)
- ReadIndex: the leader answers only after it has committed an entry of its own
  term; it records the commit index, broadcasts a heartbeat carrying the read's
  context and answers once a quorum echoed it. Requests are queued in order and a
  quorum for a later one answers the earlier ones. Reads pending at a leader that
  loses leadership are dropped (the driver retries after a timeout). READ_INDEX and
  READ_INDEX_RESP skip the term checks: the answer is valid whenever it arrives.
- The leader counts its own entries towards the commit index only once they are
  durable (its match index is its stable index, moved by `advance`).
- A snapshot lost on the way is re-sent when the follower answers a heartbeat an
  election timeout after the snapshot went out.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from raft.log import RaftLog
from raft.messages import (
    ConfChange,
    ConfChangeOp,
    Entry,
    EntryKind,
    HardState,
    Message,
    MessageType,
    Snapshot,
    SnapshotMeta,
)
from raft.progress import Progress, ProgressState

TRANSFER_CONTEXT = b"transfer"
"""Context of VOTE messages from a leadership-transfer campaign: voters grant them
even while they still hear from the old leader."""

MT = MessageType


class Role(IntEnum):
    """A node's role in its current term."""

    FOLLOWER = 0
    PRE_CANDIDATE = 1
    CANDIDATE = 2
    LEADER = 3


class RaftError(Exception):
    """Base class of the errors the core raises for requests it refuses."""


class NotLeader(RaftError):
    """This node cannot take the request; `leader_id` is the leader it knows, or 0."""

    def __init__(self, leader_id: int) -> None:
        super().__init__(f"not the leader (leader is {leader_id or 'unknown'})")
        self.leader_id = leader_id


class ProposalDropped(RaftError):
    """The leader refuses the proposal for now (a leadership transfer is under way)."""


class ConfChangePending(ProposalDropped):
    """A membership change (or the leader's first entry) has not been applied yet."""


@dataclass(frozen=True, slots=True)
class ReadState:
    """A confirmed linearizable read: serve it once `index` is applied."""

    context: bytes
    index: int


@dataclass(slots=True)
class Ready:
    """What the driver must persist, send and apply; see the module docstring."""

    hard_state: HardState | None = None
    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None
    committed: list[Entry] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    read_states: list[ReadState] = field(default_factory=list)
    must_sync: bool = False
    """Whether steps 1-3 must be fsynced before the messages go out: new entries, a
    snapshot, or a changed term or vote (a changed commit index alone needs none)."""


@dataclass(slots=True)
class _ReadRequest:
    """A ReadIndex request waiting for a quorum of heartbeat acknowledgements."""

    context: bytes
    index: int
    origin: int
    acks: set[int]


class _Poll(IntEnum):
    PENDING = 0
    WON = 1
    LOST = 2


class RaftCore:
    """One Raft node's consensus state; see the module docstring for the driver side."""

    # -- construction ------------------------------------------------------------

    def __init__(
        self,
        node_id: int,
        voters: Iterable[int],
        *,
        rng: random.Random,
        election_ticks: int = 10,
        heartbeat_ticks: int = 1,
        pre_vote: bool = True,
        check_quorum: bool = True,
        max_entries_per_msg: int = 64,
        max_inflight: int = 64,
    ) -> None:
        """A fresh node. Founding members pass the same `voters`; a node that will be
        added to a running cluster passes `voters=()` and waits for the leader."""
        self._setup(
            node_id,
            rng,
            election_ticks,
            heartbeat_ticks,
            pre_vote,
            check_quorum,
            max_entries_per_msg,
            max_inflight,
        )
        members = frozenset(voters)
        if any(v <= 0 for v in members):
            raise ValueError("node ids must be positive")
        self.log = RaftLog()
        self._voters: frozenset[int] = frozenset()
        self._conf_history: list[tuple[int, tuple[int, ...]]] = [(0, ())]
        if members:
            init = ConfChange(ConfChangeOp.INIT, voters=tuple(sorted(members)))
            self.log.append([Entry(1, 1, EntryKind.CONF_CHANGE, init.to_bytes())])
            self.log.committed = 1
            self._term = 1
            self._voters = members
            self._conf_history = [(0, tuple(sorted(members)))]
        self._prev_hs = HardState()
        self._become_follower(self._term, 0)

    @classmethod
    def restore(
        cls,
        node_id: int,
        hard_state: HardState,
        snapshot: Snapshot | SnapshotMeta | None,
        entries: Sequence[Entry],
        *,
        rng: random.Random,
        applied: int | None = None,
        election_ticks: int = 10,
        heartbeat_ticks: int = 1,
        pre_vote: bool = True,
        check_quorum: bool = True,
        max_entries_per_msg: int = 64,
        max_inflight: int = 64,
    ) -> RaftCore:
        """Rebuild a node after a restart from what its driver persisted.

        `entries` are the stored entries (those at or below the snapshot's index are
        ignored). Pass the full `Snapshot` so that this node, as a leader, can send it
        to followers behind its log; with `SnapshotMeta` alone it cannot (until the
        driver calls `compact` again). `applied` is the index the driver's state
        machine already reflects (default: the snapshot's index, so the committed
        entries after it are handed out again); the voters are those of the snapshot
        followed by the conf changes up to `applied`.
        """
        self = cls.__new__(cls)
        self._setup(
            node_id,
            rng,
            election_ticks,
            heartbeat_ticks,
            pre_vote,
            check_quorum,
            max_entries_per_msg,
            max_inflight,
        )
        meta = snapshot.meta if isinstance(snapshot, Snapshot) else snapshot
        snap_index, snap_term = (meta.index, meta.term) if meta else (0, 0)
        log = RaftLog(snap_index, snap_term, (e for e in entries if e.index > snap_index))
        commit = max(hard_state.commit, snap_index)
        if commit > log.last_index:
            raise ValueError(f"commit {commit} is past the last stored index {log.last_index}")
        applied = snap_index if applied is None else applied
        if not snap_index <= applied <= commit:
            raise ValueError(f"applied {applied} not within [{snap_index}, {commit}]")
        log.committed = commit
        log.applied = applied
        self.log = log
        voters = frozenset(meta.voters) if meta else frozenset()
        self._conf_history = [(snap_index, tuple(sorted(voters)))]
        if applied > snap_index:
            for e in log.slice(snap_index + 1, applied):
                if e.kind is EntryKind.CONF_CHANGE:
                    voters = ConfChange.from_bytes(e.data).apply(voters)
                    self._conf_history.append((e.index, tuple(sorted(voters))))
        self._voters = voters
        self._snapshot = snapshot if isinstance(snapshot, Snapshot) else None
        self._term = hard_state.term
        self._vote = hard_state.vote
        self._prev_hs = HardState(hard_state.term, hard_state.vote, commit)
        self._become_follower(hard_state.term, 0)
        return self

    def _setup(
        self,
        node_id: int,
        rng: random.Random,
        election_ticks: int,
        heartbeat_ticks: int,
        pre_vote: bool,
        check_quorum: bool,
        max_entries_per_msg: int,
        max_inflight: int,
    ) -> None:
        if node_id <= 0:
            raise ValueError("node_id must be positive")
        if heartbeat_ticks < 1 or election_ticks <= heartbeat_ticks:
            raise ValueError("need 1 <= heartbeat_ticks < election_ticks")
        if max_entries_per_msg < 1 or max_inflight < 1:
            raise ValueError("max_entries_per_msg and max_inflight must be >= 1")
        self.id = node_id
        self.rng = rng
        self.election_ticks = election_ticks
        self.heartbeat_ticks = heartbeat_ticks
        self.pre_vote = pre_vote
        self.check_quorum = check_quorum
        self.max_entries_per_msg = max_entries_per_msg
        self.max_inflight = max_inflight
        self._term = 0
        self._vote = 0
        self._leader = 0
        self._role = Role.FOLLOWER
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._randomized_timeout = election_ticks
        self._ticks = 0
        self._votes: dict[int, bool] = {}
        self._progress: dict[int, Progress] = {}
        self._pending_conf_index = 0
        self._lead_transferee = 0
        self._timeout_now_at = 0
        self._msgs: list[Message] = []
        self._read_states: list[ReadState] = []
        self._read_queue: deque[_ReadRequest] = deque()
        self._read_by_ctx: dict[bytes, _ReadRequest] = {}
        self._reads_waiting_commit: list[tuple[bytes, int]] = []
        self._snapshot: Snapshot | None = None
        self._ready_out = False
        # proposals appended since the last Ready, not yet sent to the followers
        self._bcast_pending = False

    # -- read-only state -----------------------------------------------------------

    @property
    def node_id(self) -> int:
        """This node's id."""
        return self.id

    @property
    def leader_id(self) -> int:
        """The leader this node knows in its term, or 0."""
        return self._leader

    @property
    def term(self) -> int:
        """The current term."""
        return self._term

    @property
    def vote(self) -> int:
        """Whom this node voted for in its current term, or 0."""
        return self._vote

    @property
    def role(self) -> Role:
        """FOLLOWER, PRE_CANDIDATE, CANDIDATE or LEADER."""
        return self._role

    @property
    def commit_index(self) -> int:
        """The highest index known committed."""
        return self.log.committed

    @property
    def applied_index(self) -> int:
        """The highest index applied (as acknowledged by `advance`, or the snapshot's)."""
        return self.log.applied

    @property
    def voters(self) -> frozenset[int]:
        """The voters of the configuration applied on this node."""
        return self._voters

    @property
    def last_index(self) -> int:
        """The index of the newest entry in the log."""
        return self.log.last_index

    @property
    def first_index(self) -> int:
        """The oldest index still in the log (the one after the snapshot)."""
        return self.log.first_index

    @property
    def snapshot(self) -> Snapshot | None:
        """The newest snapshot this node holds (made by `compact` or received), if any."""
        return self._snapshot

    @property
    def lead_transferee(self) -> int:
        """The voter a leadership transfer is under way to, or 0."""
        return self._lead_transferee

    @property
    def hard_state(self) -> HardState:
        """The current term, vote and commit index."""
        return HardState(self._term, self._vote, self.log.committed)

    def progress(self, peer: int) -> Progress | None:
        """The leader's replication state for `peer` (None when not leader or not tracked)."""
        return self._progress.get(peer)

    def conf_at(self, index: int) -> tuple[int, ...]:
        """The voters in effect on this node just after applying `index` (index must be
        at or after the oldest configuration this node still knows)."""
        for at, voters in reversed(self._conf_history):
            if at <= index:
                return voters
        raise ValueError(f"no configuration known at {index}")

    # -- inputs ------------------------------------------------------------------

    def tick(self) -> None:
        """Advance the logical clock by one tick."""
        self._ticks += 1
        if self._role is Role.LEADER:
            self._tick_leader()
        else:
            self._election_elapsed += 1
            if self._promotable() and self._election_elapsed >= self._randomized_timeout:
                self._election_elapsed = 0
                self._hup(transfer=False)

    def leader_unreachable(self) -> None:
        """The driver has a hint that the leader is gone (its connection was
        closed, as when its process dies): end this follower's leader lease now,
        so it campaigns after what is left of its randomized timeout (0 to one
        election timeout) and votes for others, instead of first waiting a whole
        election timeout of silence. A wrong hint costs nothing: with PreVote the
        other followers, still hearing the leader, refuse to move to a new term,
        and the leader's next heartbeat resets this follower's timer."""
        if self._role is Role.FOLLOWER and self._leader != 0:
            self._election_elapsed = max(self._election_elapsed, self.election_ticks)

    def campaign(self) -> None:
        """Start an election now (as the election timeout would), if allowed."""
        self._hup(transfer=False)

    def propose(self, data: bytes) -> int:
        """Append `data` as a NORMAL entry and return its index (leader only).

        The entry is committed when it appears in a Ready's `committed`; it may also
        never be (leadership lost), which the driver detects when the entry applied
        at that index is a different one (compare its term).
        """
        self._check_proposable()
        e = Entry(self._term, self.log.last_index + 1, EntryKind.NORMAL, data)
        self.log.append([e])
        # Sent at the next ready(): the proposals of one Ready share one append per
        # follower, instead of one append (and one answer) per proposal.
        self._bcast_pending = True
        return e.index

    def propose_conf_change(
        self, add: int | None = None, remove: int | None = None, *, context: bytes = b""
    ) -> int:
        """Propose adding or removing one voter; return the entry's index (leader only).

        Raises `ConfChangePending` while the previous change (or the leader's first
        entry of its term) is not applied, `ValueError` for a meaningless change.
        """
        self._check_proposable()
        if (add is None) == (remove is None):
            raise ValueError("give exactly one of add and remove")
        if self._pending_conf_index > self.log.applied:
            raise ConfChangePending(
                f"entry {self._pending_conf_index} not applied yet (applied {self.log.applied})"
            )
        if add is not None:
            if add <= 0 or add in self._voters:
                raise ValueError(f"cannot add {add}: already a voter or not a valid id")
            cc = ConfChange(ConfChangeOp.ADD, add, context=context)
        else:
            assert remove is not None
            if remove not in self._voters:
                raise ValueError(f"cannot remove {remove}: not a voter")
            if self._voters == {remove}:
                raise ValueError("cannot remove the last voter")
            cc = ConfChange(ConfChangeOp.REMOVE, remove, context=context)
        index = self._append(EntryKind.CONF_CHANGE, cc.to_bytes())
        self._pending_conf_index = index
        return index

    def read_index(self, context: bytes) -> None:
        """Request a linearizable read; a `ReadState(context, index)` comes in a Ready.

        On a follower the request goes to the leader; `NotLeader(0)` when no leader is
        known. Contexts must be unique among pending reads (a duplicate is ignored).
        Nothing comes back if leadership changes meanwhile: retry after a timeout.
        """
        if self._role is Role.LEADER:
            self._leader_read(context, self.id)
        elif self._leader == 0:
            raise NotLeader(0)
        else:
            self._send(MT.READ_INDEX, self._leader, context=context)

    def transfer_leadership(self, to: int) -> None:
        """Hand leadership to voter `to`: once its log is caught up it is told to
        campaign at once. Proposals are refused meanwhile; the transfer is abandoned
        after an election timeout."""
        if self._role is not Role.LEADER:
            raise NotLeader(self._leader)
        if to == self.id or to == self._lead_transferee:
            return
        pr = self._progress.get(to)
        if pr is None:
            raise ValueError(f"{to} is not a voter")
        self._lead_transferee = to
        self._election_elapsed = 0
        if pr.match == self.log.last_index:
            self._send_timeout_now(to)
        else:
            self._send_append(to)

    def compact(self, index: int, data: bytes) -> Snapshot:
        """The driver snapshotted its state machine at applied `index` into `data`:
        drop the log up to `index` and keep the snapshot to send to slow followers.

        Returns the snapshot with its metadata (term, voters), which the driver
        persists (before deleting its stored entries up to `index`).
        """
        if self.log.pending_snapshot is not None:
            raise ValueError("a received snapshot is not persisted yet: advance first")
        voters = self.conf_at(index)
        term = self.log.compact(index)
        snap = Snapshot(SnapshotMeta(index, term, voters), data)
        self._snapshot = snap
        keep = [c for c in self._conf_history if c[0] > index]
        self._conf_history = [(index, voters), *keep]
        return snap

    def step(self, m: Message) -> None:
        """Process one message from a peer."""
        if m.dst != self.id:
            raise ValueError(f"message for {m.dst} stepped into node {self.id}")
        t = m.type
        if t is MT.READ_INDEX:
            if self._role is Role.LEADER:
                self._leader_read(m.context, m.src)
            return
        if t is MT.READ_INDEX_RESP:
            self._read_states.append(ReadState(m.context, m.index))
            return

        if m.term > self._term:
            if t is MT.VOTE or t is MT.PRE_VOTE:
                in_lease = (
                    self.check_quorum
                    and self._leader != 0
                    and self._election_elapsed < self.election_ticks
                )
                if in_lease and m.context != TRANSFER_CONTEXT:
                    return  # a leader is alive: do not let this candidate disrupt it
            if t is MT.PRE_VOTE or (t is MT.PRE_VOTE_RESP and not m.reject):
                pass  # pre-votes never move terms
            elif t is MT.APP or t is MT.HEARTBEAT or t is MT.SNAP:
                self._become_follower(m.term, m.src)
            else:
                self._become_follower(m.term, 0)
        elif m.term < self._term:
            if (t is MT.APP or t is MT.HEARTBEAT) and (self.check_quorum or self.pre_vote):
                # Tell a stale leader about the newer term, so that a node whose term
                # went up while it was cut off is not locked out forever.
                self._send(MT.APP_RESP, m.src)
            elif t is MT.PRE_VOTE:
                self._send(MT.PRE_VOTE_RESP, m.src, reject=True)
            return

        if t is MT.VOTE or t is MT.PRE_VOTE:
            self._on_vote_request(m)
            return

        role = self._role
        if role is Role.LEADER:
            pr = self._progress.get(m.src)
            if pr is None:
                return
            pr.recent_active = True
            if t is MT.APP_RESP:
                self._on_append_response(m, pr)
            elif t is MT.HEARTBEAT_RESP:
                self._on_heartbeat_response(m, pr)
            return
        if role is not Role.FOLLOWER:
            if t is MT.APP or t is MT.HEARTBEAT or t is MT.SNAP:
                self._become_follower(self._term, m.src)
            elif (t is MT.VOTE_RESP and role is Role.CANDIDATE) or (
                t is MT.PRE_VOTE_RESP and role is Role.PRE_CANDIDATE
            ):
                self._on_vote_response(m)
                return
            else:
                return
        if t is MT.APP:
            self._election_elapsed = 0
            self._leader = m.src
            self._on_append(m)
        elif t is MT.HEARTBEAT:
            self._election_elapsed = 0
            self._leader = m.src
            self.log.commit_to(m.commit)
            self._send(MT.HEARTBEAT_RESP, m.src, context=m.context)
        elif t is MT.SNAP:
            self._election_elapsed = 0
            self._leader = m.src
            self._on_snapshot(m)
        elif t is MT.TIMEOUT_NOW:
            self._hup(transfer=True)

    # -- the Ready cycle -------------------------------------------------------------

    def has_ready(self) -> bool:
        """Whether `ready()` has anything for the driver."""
        log = self.log
        return bool(
            self._msgs
            or self._bcast_pending
            or self._read_states
            or log.unstable_from <= log.last_index
            or log.pending_snapshot is not None
            or log.has_next_committed()
            or self._prev_hs.term != self._term
            or self._prev_hs.vote != self._vote
            or self._prev_hs.commit != log.committed
        )

    def ready(self) -> Ready:
        """Take what must be persisted, sent and applied now (see the module docstring)."""
        if self._ready_out:
            raise RuntimeError("advance() the previous Ready before taking another")
        if self._bcast_pending:
            self._bcast_pending = False
            if self._role is Role.LEADER:
                self._bcast_append()
        hs, prev = self.hard_state, self._prev_hs
        rd = Ready(
            hard_state=hs if hs != prev else None,
            entries=self.log.unstable_entries(),
            snapshot=self.log.pending_snapshot,
            committed=self.log.next_committed(),
            messages=self._msgs,
            read_states=self._read_states,
        )
        rd.must_sync = bool(
            rd.entries or rd.snapshot or hs.term != prev.term or hs.vote != prev.vote
        )
        self._msgs = []
        self._read_states = []
        self._ready_out = True
        return rd

    def advance(self, rd: Ready) -> None:
        """The driver has handled `rd` completely (persisted, sent, applied)."""
        if not self._ready_out:
            raise RuntimeError("advance() without an outstanding Ready")
        self._ready_out = False
        log = self.log
        if rd.hard_state is not None:
            self._prev_hs = rd.hard_state
        if rd.snapshot is not None:
            log.stable_snapshot(rd.snapshot.meta.index)
        stable_before = log.stable_last
        if rd.entries:
            last = rd.entries[-1]
            log.stable_to(last.index, last.term)
        for e in rd.committed:
            if e.index <= log.applied:
                continue  # covered by a snapshot installed meanwhile
            if e.index != log.applied + 1:
                raise RuntimeError(f"applied {e.index} after {log.applied}")
            log.applied = e.index
            if e.kind is EntryKind.CONF_CHANGE:
                self._apply_conf_change(e)
        if self._role is Role.LEADER and log.stable_last != stable_before and self._maybe_commit():
            self._bcast_append()

    # -- roles -------------------------------------------------------------------

    def _reset(self, term: int) -> None:
        if term != self._term:
            self._term = term
            self._vote = 0
        self._leader = 0
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        self._randomized_timeout = self.rng.randrange(self.election_ticks, 2 * self.election_ticks)
        self._lead_transferee = 0
        self._votes = {}
        self._progress = {}
        self._pending_conf_index = 0
        self._read_queue.clear()
        self._read_by_ctx.clear()
        self._reads_waiting_commit.clear()

    def _become_follower(self, term: int, leader: int) -> None:
        self._reset(term)
        self._role = Role.FOLLOWER
        self._leader = leader

    def _become_pre_candidate(self) -> None:
        # Neither the term nor the vote changes: a pre-vote binds nobody.
        self._reset(self._term)
        self._role = Role.PRE_CANDIDATE
        self._votes = {self.id: True}

    def _become_candidate(self) -> None:
        self._reset(self._term + 1)
        self._vote = self.id
        self._role = Role.CANDIDATE
        self._votes = {self.id: True}

    def _become_leader(self) -> None:
        self._reset(self._term)
        self._role = Role.LEADER
        self._leader = self.id
        nxt = self.log.last_index + 1
        for v in self._voters:
            if v != self.id:
                self._progress[v] = Progress(nxt, self.max_inflight)
        # The empty entry of the new term: committing it commits everything before it,
        # and conf changes wait until it is applied.
        self._pending_conf_index = self._append(EntryKind.NORMAL, b"")
        if self.id not in self._voters:
            self._hand_over()

    def _promotable(self) -> bool:
        # A node outside its configuration may still campaign (and then only hands
        # over): after the leader of two voters removes itself and stops, the survivor
        # may still need the removed node's log to learn that the change committed.
        return bool(self._voters)

    def _has_unapplied_conf_changes(self) -> bool:
        log = self.log
        if log.committed <= log.applied:
            return False
        return any(
            e.kind is EntryKind.CONF_CHANGE for e in log.slice(log.applied + 1, log.committed)
        )

    def _hup(self, *, transfer: bool) -> None:
        if self._role is Role.LEADER or not self._promotable():
            return
        if self._has_unapplied_conf_changes():
            return  # its quorum would be computed from a configuration already replaced
        self._campaign(pre=self.pre_vote and not transfer, transfer=transfer)

    def _campaign(self, *, pre: bool, transfer: bool) -> None:
        if pre:
            self._become_pre_candidate()
            kind, term = MT.PRE_VOTE, self._term + 1
        else:
            self._become_candidate()
            kind, term = MT.VOTE, self._term
        if self._poll_result() is _Poll.WON:
            self._won()
            return
        ctx = TRANSFER_CONTEXT if transfer else b""
        last_index, last_term = self.log.last_index, self.log.last_term
        for v in sorted(self._voters):
            if v != self.id:
                self._msgs.append(
                    Message(
                        kind,
                        self.id,
                        v,
                        term=term,
                        index=last_index,
                        log_term=last_term,
                        context=ctx,
                    )
                )

    def _won(self) -> None:
        if self._role is Role.PRE_CANDIDATE:
            self._campaign(pre=False, transfer=False)
        else:
            self._become_leader()

    def _poll_result(self) -> _Poll:
        granted = sum(1 for v, ok in self._votes.items() if ok and v in self._voters)
        rejected = sum(1 for v, ok in self._votes.items() if not ok and v in self._voters)
        q = len(self._voters) // 2 + 1
        if granted >= q:
            return _Poll.WON
        if rejected > len(self._voters) - q:
            return _Poll.LOST
        return _Poll.PENDING

    def _on_vote_request(self, m: Message) -> None:
        pre = m.type is MT.PRE_VOTE
        can_vote = (
            self._vote == m.src
            or (self._vote == 0 and self._leader == 0)
            or (pre and m.term > self._term)
        )
        resp = MT.PRE_VOTE_RESP if pre else MT.VOTE_RESP
        if can_vote and self.log.is_up_to_date(m.index, m.log_term):
            self._msgs.append(Message(resp, self.id, m.src, term=m.term))
            if not pre:
                self._election_elapsed = 0
                self._vote = m.src
        else:
            self._send(resp, m.src, reject=True)

    def _on_vote_response(self, m: Message) -> None:
        self._votes.setdefault(m.src, not m.reject)
        result = self._poll_result()
        if result is _Poll.WON:
            self._won()
        elif result is _Poll.LOST:
            self._become_follower(self._term, 0)

    # -- follower side -------------------------------------------------------------

    def _on_append(self, m: Message) -> None:
        log = self.log
        if m.index < log.committed:
            self._send(MT.APP_RESP, m.src, index=log.committed)
            return
        last_new = log.maybe_append(m.index, m.log_term, m.commit, m.entries)
        if last_new is not None:
            self._send(MT.APP_RESP, m.src, index=last_new)
            return
        hint = log.find_conflict_by_term(m.index, m.log_term)
        self._send(
            MT.APP_RESP,
            m.src,
            index=m.index,
            reject=True,
            reject_hint=hint,
            log_term=log.term(hint) or 0,
        )

    def _on_snapshot(self, m: Message) -> None:
        snap = m.snapshot
        if snap is None:
            return
        log, meta = self.log, snap.meta
        if meta.index <= log.committed:
            self._send(MT.APP_RESP, m.src, index=log.committed)
            return
        if log.match_term(meta.index, meta.term):
            # Our log already has it: just learn that it is committed.
            log.commit_to(meta.index)
            self._send(MT.APP_RESP, m.src, index=log.committed)
            return
        log.restore(snap)
        self._snapshot = snap
        self._voters = frozenset(meta.voters)
        self._conf_history = [(meta.index, tuple(sorted(meta.voters)))]
        self._send(MT.APP_RESP, m.src, index=meta.index)

    # -- leader side ---------------------------------------------------------------

    def _check_proposable(self) -> None:
        if self._role is not Role.LEADER:
            raise NotLeader(self._leader)
        if self._lead_transferee or self.id not in self._voters:
            raise ProposalDropped(f"leadership transfer to {self._lead_transferee} under way")

    def _append(self, kind: EntryKind, data: bytes) -> int:
        e = Entry(self._term, self.log.last_index + 1, kind, data)
        self.log.append([e])
        self._bcast_append()
        return e.index

    def _tick_leader(self) -> None:
        self._heartbeat_elapsed += 1
        self._election_elapsed += 1
        if self._election_elapsed >= self.election_ticks:
            self._election_elapsed = 0
            if self.check_quorum:
                active = {v for v, pr in self._progress.items() if pr.recent_active}
                if not self._is_quorum(active | {self.id}):
                    self._become_follower(self._term, 0)  # cut off: stop acting as leader
                    return
                for pr in self._progress.values():
                    pr.recent_active = False
            self._lead_transferee = 0
            if self.id not in self._voters:
                self._hand_over()
        if self._heartbeat_elapsed >= self.heartbeat_ticks:
            self._heartbeat_elapsed = 0
            self._bcast_heartbeat(self._read_queue[-1].context if self._read_queue else b"")

    def _is_quorum(self, ids: set[int]) -> bool:
        return sum(1 for v in self._voters if v in ids) >= len(self._voters) // 2 + 1

    def _maybe_commit(self) -> bool:
        log = self.log
        matches = sorted(
            (log.stable_last if v == self.id else self._match(v) for v in self._voters),
            reverse=True,
        )
        if not matches:
            return False
        n = matches[len(matches) // 2]
        # Only an entry of the current term is committed by counting replicas.
        if n > log.committed and log.term(n) == self._term:
            log.committed = n
            self._on_committed_in_term()
            return True
        return False

    def _match(self, peer: int) -> int:
        pr = self._progress.get(peer)
        return pr.match if pr is not None else 0

    def _bcast_append(self) -> None:
        for peer in sorted(self._progress):
            self._send_append(peer)

    def _bcast_heartbeat(self, context: bytes) -> None:
        commit = self.log.committed
        for peer in sorted(self._progress):
            pr = self._progress[peer]
            self._send(MT.HEARTBEAT, peer, commit=min(pr.match, commit), context=context)

    def _send_append(self, to: int, *, allow_empty: bool = True) -> bool:
        pr = self._progress[to]
        if pr.paused():
            return False
        log = self.log
        pr.next = min(pr.next, log.last_index + 1)
        prev = pr.next - 1
        prev_term = log.term(prev)
        if prev_term is None:
            return self._send_snapshot(to, pr)
        ents = log.slice(pr.next, prev + self.max_entries_per_msg)
        if not ents and not allow_empty:
            return False
        self._send(MT.APP, to, index=prev, log_term=prev_term, entries=ents, commit=log.committed)
        pr.sent(ents[-1].index if ents else prev, len(ents))
        return True

    def _send_snapshot(self, to: int, pr: Progress) -> bool:
        snap = self._snapshot
        if snap is None or snap.meta.index < self.log.snap_index:
            return False  # restored from metadata only: wait for the driver's next compact
        self._msgs.append(Message(MT.SNAP, self.id, to, term=self._term, snapshot=snap))
        pr.become_snapshot(snap.meta.index, self._ticks)
        return True

    def _on_append_response(self, m: Message, pr: Progress) -> None:
        log = self.log
        if m.reject:
            hint = m.reject_hint
            if m.log_term > 0:
                hint = log.find_conflict_by_term(hint, m.log_term)
            if pr.maybe_decr_to(m.index, hint):
                if pr.state is ProgressState.REPLICATE:
                    pr.become_probe()
                self._send_append(m.src)
            return
        if not pr.maybe_update(m.index):
            return
        if pr.state is ProgressState.PROBE:
            pr.become_replicate()
        elif pr.state is ProgressState.SNAPSHOT:
            if pr.match + 1 >= log.first_index:
                pr.become_probe()
                pr.become_replicate()
        else:
            pr.free_to(m.index)
        if self._maybe_commit():
            self._bcast_append()
        else:
            while self._send_append(m.src, allow_empty=False):
                pass
        if m.src == self._lead_transferee and pr.match == log.last_index:
            self._send_timeout_now(m.src)

    def _on_heartbeat_response(self, m: Message, pr: Progress) -> None:
        pr.probe_sent = False
        if pr.state is ProgressState.REPLICATE and pr.paused():
            pr.free_first()
        elif (
            pr.state is ProgressState.SNAPSHOT
            and self._ticks - pr.snapshot_sent_at >= self.election_ticks
        ):
            pr.become_probe()  # the snapshot was probably lost: find out again
        if pr.match < self.log.last_index:
            self._send_append(m.src)
        elif (
            m.src == self._lead_transferee
            and self._ticks - self._timeout_now_at >= self.election_ticks // 2
        ):
            self._send_timeout_now(m.src)  # lost, or it could not campaign yet: again
        if m.context:
            self._on_read_ack(m.src, m.context)

    # -- ReadIndex -------------------------------------------------------------------

    def _leader_read(self, context: bytes, origin: int) -> None:
        log = self.log
        if log.term(log.committed) != self._term:
            # Until an entry of this term commits, our commit index may be behind.
            self._reads_waiting_commit.append((context, origin))
            return
        if self._voters == {self.id}:
            self._answer_read(context, log.committed, origin)
            return
        if context in self._read_by_ctx:
            return
        req = _ReadRequest(context, log.committed, origin, {self.id})
        self._read_queue.append(req)
        self._read_by_ctx[context] = req
        self._bcast_heartbeat(context)

    def _on_read_ack(self, src: int, context: bytes) -> None:
        req = self._read_by_ctx.get(context)
        if req is None:
            return
        req.acks.add(src)
        if not self._is_quorum(req.acks):
            return
        while self._read_queue:
            r = self._read_queue.popleft()
            del self._read_by_ctx[r.context]
            self._answer_read(r.context, r.index, r.origin)
            if r is req:
                break

    def _answer_read(self, context: bytes, index: int, origin: int) -> None:
        if origin == self.id:
            self._read_states.append(ReadState(context, index))
        else:
            self._send(MT.READ_INDEX_RESP, origin, index=index, context=context)

    def _on_committed_in_term(self) -> None:
        if self._reads_waiting_commit:
            waiting, self._reads_waiting_commit = self._reads_waiting_commit, []
            for context, origin in waiting:
                self._leader_read(context, origin)

    # -- membership ------------------------------------------------------------------

    def _apply_conf_change(self, e: Entry) -> None:
        old = self._voters
        new = ConfChange.from_bytes(e.data).apply(old)
        self._voters = new
        self._conf_history.append((e.index, tuple(sorted(new))))
        if self._role is not Role.LEADER:
            if self.id not in new and self._role is not Role.FOLLOWER:
                self._become_follower(self._term, 0)
            return
        for gone in old - new:
            self._progress.pop(gone, None)
            if gone == self._lead_transferee:
                self._lead_transferee = 0
        if self.id not in new:
            # Removed: keep leading (not counting ourselves) until the most caught-up
            # voter has everything, including the commit index, and takes over.
            self._hand_over()
        for added in sorted(new - old - {self.id}):
            pr = Progress(self.log.last_index + 1, self.max_inflight)
            pr.recent_active = True
            self._progress[added] = pr
        if self._maybe_commit():
            self._bcast_append()
        else:
            for added in sorted(new - old - {self.id}):
                self._send_append(added)

    def _hand_over(self) -> None:
        """A leader outside its configuration picks the most caught-up voter as its
        successor; proposals are refused meanwhile (this is the transfer machinery)."""
        if not self._progress:
            return
        best = max(sorted(self._progress), key=lambda p: self._progress[p].match)
        self._lead_transferee = best
        self._election_elapsed = 0
        if self._progress[best].match == self.log.last_index:
            self._send_timeout_now(best)
        else:
            self._send_append(best)

    def _send_timeout_now(self, to: int) -> None:
        self._timeout_now_at = self._ticks
        self._send(MT.TIMEOUT_NOW, to)

    # -- output --------------------------------------------------------------------

    def _send(
        self,
        kind: MessageType,
        to: int,
        *,
        index: int = 0,
        log_term: int = 0,
        entries: tuple[Entry, ...] = (),
        commit: int = 0,
        reject: bool = False,
        reject_hint: int = 0,
        context: bytes = b"",
    ) -> None:
        self._msgs.append(
            Message(
                kind,
                self.id,
                to,
                term=self._term,
                log_term=log_term,
                index=index,
                entries=entries,
                commit=commit,
                reject=reject,
                reject_hint=reject_hint,
                context=context,
            )
        )
