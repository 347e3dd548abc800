"""A deterministic network simulator for `RaftCore`, with Raft's invariants checked.

`SimCluster` runs N cores the way a driver would: each node has a simulated stable
storage (`SimStorage`) that takes each Ready in the contract's order (persist, then
send, then apply committed entries to a `SimStateMachine`, then advance). Messages
travel through a seeded network that can drop, duplicate, delay (and so reorder)
them and that honours partitions; nodes can crash (losing everything not in their
storage, possibly in the middle of handling a Ready) and restart with
`RaftCore.restore` from their storage alone.

`Checker` verifies, as the run goes:

- election safety: at most one leader per term;
- log matching: an (index, term) pair names one entry with one predecessor term in
  every persisted log (checked on each write, so two logs sharing an entry share
  the whole prefix up to it), plus a full pairwise comparison on demand;
- leader completeness: a node that becomes leader holds every entry known committed;
- state machine safety: every node applies, at each index, the same entry (a hash
  chain over the applied entries, which snapshots carry, makes this a prefix check);
- committed entries are never different at one index, Ready.committed only hands out
  entries already persisted, a node only applies what it knows committed;
- linearizable reads: a ReadState index is at least the commit index known anywhere
  when the read was requested.

`run_random(seed, ...)` is the randomized test: faults for a while, then the network
heals and every node restarts, and within a bound a leader must exist and a fresh
proposal must be applied on every voter. It raises `InvariantViolation` with the seed
and the last events.
"""

from __future__ import annotations

import hashlib
import heapq
import random
import struct
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from raft.core import NotLeader, RaftCore, RaftError, ReadState, Ready, Role
from raft.messages import Entry, EntryKind, HardState, Message, MessageType, Snapshot


class InvariantViolation(AssertionError):
    """A Raft safety or liveness property failed in a simulation."""


class SimStateMachine:
    """The applied state: a hash chain over applied entries, plus the client data."""

    __slots__ = ("applied", "digest", "items")

    _HEAD = struct.Struct("<QQB")

    def __init__(self, applied: int = 0, digest: bytes = b"", items: Iterable[bytes] = ()):
        """The state after applying `applied` entries (empty state by default)."""
        self.applied = applied
        self.digest = digest
        self.items: list[bytes] = list(items)

    def apply(self, e: Entry) -> None:
        """Apply the next entry."""
        if e.index != self.applied + 1:
            raise InvariantViolation(f"applied {e.index} after {self.applied}")
        h = hashlib.blake2b(self.digest, digest_size=16)
        h.update(self._HEAD.pack(e.index, e.term, e.kind))
        h.update(e.data)
        self.digest = h.digest()
        self.applied = e.index
        if e.kind is EntryKind.NORMAL and e.data:
            self.items.append(e.data)

    def to_bytes(self) -> bytes:
        """A snapshot of this state."""
        out = bytearray(struct.pack("<QB", self.applied, len(self.digest)))
        out += self.digest
        out += struct.pack("<I", len(self.items))
        for item in self.items:
            out += struct.pack("<I", len(item))
            out += item
        return bytes(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> SimStateMachine:
        """Restore from `to_bytes`."""
        applied, n = struct.unpack_from("<QB", data, 0)
        pos = 9
        digest = data[pos : pos + n]
        pos += n
        (count,) = struct.unpack_from("<I", data, pos)
        pos += 4
        items = []
        for _ in range(count):
            (size,) = struct.unpack_from("<I", data, pos)
            pos += 4
            items.append(data[pos : pos + size])
            pos += size
        return cls(applied, digest, items)


class SimStorage:
    """A node's durable state, written only as the Ready contract says."""

    __slots__ = ("entries", "hard_state", "snapshot")

    def __init__(self) -> None:
        """Empty storage."""
        self.hard_state = HardState()
        self.snapshot: Snapshot | None = None
        self.entries: list[Entry] = []

    @property
    def base(self) -> int:
        """The index just before the first stored entry (the snapshot's)."""
        return self.snapshot.meta.index if self.snapshot else 0

    @property
    def last_index(self) -> int:
        """The newest stored index."""
        return self.base + len(self.entries)

    def term(self, index: int) -> int | None:
        """The stored term at `index`, None if not stored."""
        base = self.base
        if index == base:
            return self.snapshot.meta.term if self.snapshot else 0
        if base < index <= base + len(self.entries):
            return self.entries[index - base - 1].term
        return None

    def save(self, rd: Ready) -> None:
        """Steps 1-3 of the contract: snapshot, entries (truncating), hard state."""
        if rd.snapshot is not None:
            self.snapshot = rd.snapshot
            self.entries = []
        if rd.entries:
            first = rd.entries[0].index
            if first > self.last_index + 1:
                raise InvariantViolation(f"Ready entries start at {first} past {self.last_index}")
            if first <= self.hard_state.commit:
                raise InvariantViolation(f"Ready rewrites committed index {first}")
            del self.entries[first - self.base - 1 :]
            self.entries.extend(rd.entries)
        if rd.hard_state is not None:
            self.hard_state = rd.hard_state

    def compact(self, snap: Snapshot) -> None:
        """The driver's own snapshot: store it, then drop the entries it covers."""
        drop = snap.meta.index - self.base
        self.snapshot = snap
        del self.entries[:drop]


@dataclass
class NetConfig:
    """The network's behaviour: probabilities per message, delays in steps."""

    drop: float = 0.0
    duplicate: float = 0.0
    min_delay: int = 0
    max_delay: int = 0
    wire: bool = False
    """Send every message through `to_bytes`/`from_bytes`."""


@dataclass
class FaultPlan:
    """Per-step probabilities of the random events of `run_random`."""

    crash: float = 0.003
    restart: float = 0.04
    crash_in_ready: float = 0.001
    partition: float = 0.004
    heal: float = 0.02
    propose: float = 0.25
    read: float = 0.05
    compact: float = 0.01
    conf_change: float = 0.0
    transfer: float = 0.002
    min_voters: int = 3
    max_voters: int = 5


class SimNode:
    """A simulated server: a core (None while crashed), its storage and state machine."""

    __slots__ = ("core", "id", "restarts", "sm", "storage")

    def __init__(self, node_id: int, core: RaftCore) -> None:
        """A running node with empty storage."""
        self.id = node_id
        self.core: RaftCore | None = core
        self.storage = SimStorage()
        self.sm = SimStateMachine()
        self.restarts = 0

    @property
    def alive(self) -> bool:
        """Whether the node is running."""
        return self.core is not None

    def live(self) -> RaftCore:
        """The core of a running node."""
        assert self.core is not None, f"node {self.id} is down"
        return self.core


class Checker:
    """Raft's safety invariants, checked incrementally as the simulation runs."""

    def __init__(self, cluster: SimCluster) -> None:
        """Checks for `cluster`."""
        self.cluster = cluster
        self.leaders: dict[int, int] = {}
        self.seen_leaders: set[tuple[int, int]] = set()
        self.committed: dict[int, int] = {}
        self.max_committed = 0
        self.entries: dict[tuple[int, int], tuple[int, EntryKind, bytes]] = {}
        self.digests: dict[int, bytes] = {0: b""}
        self.reads: dict[bytes, int] = {}
        self.reads_answered = 0

    def fail(self, what: str) -> None:
        """Report a violation with the recent trace."""
        raise InvariantViolation(self.cluster.describe(what))

    def note_commit(self, index: int, term: int, node: int) -> None:
        """`node` knows entry (`index`, `term`) is committed."""
        known = self.committed.setdefault(index, term)
        if known != term:
            self.fail(f"node {node}: index {index} committed with term {term}, before {known}")
        self.max_committed = max(self.max_committed, index)

    def after_input(self, node: SimNode) -> None:
        """Election safety and leader completeness, after anything that can make a leader."""
        core = node.core
        if core is None:
            return
        log = core.log
        seen = self.cluster.commit_seen
        done = seen.get(node.id, 0)
        if log.committed > done:
            for i in range(max(done, log.snap_index) + 1, log.committed + 1):
                term = log.term(i)
                assert term is not None
                self.note_commit(i, term, node.id)
            seen[node.id] = log.committed
        if core.role is not Role.LEADER:
            return
        key = (node.id, core.term)
        if key in self.seen_leaders:
            return
        self.seen_leaders.add(key)
        self.cluster.event("leader", node.id, core.term)
        other = self.leaders.setdefault(core.term, node.id)
        if other != node.id:
            self.fail(f"election safety: {other} and {node.id} both lead term {core.term}")
        for i in range(log.first_index, self.max_committed + 1):
            want = self.committed.get(i)
            if want is not None and log.term(i) != want:
                self.fail(
                    f"leader completeness: leader {node.id} of term {core.term} has term "
                    f"{log.term(i)} at committed index {i} (want {want})"
                )

    def on_ready(self, node: SimNode, rd: Ready) -> None:
        """Before persisting: the committed entries handed out must already be durable."""
        st = node.storage
        core = node.live()
        for e in rd.committed:
            if st.term(e.index) != e.term:
                self.fail(f"node {node.id}: Ready.committed has {e} not persisted before")
            if e.index > core.commit_index:
                self.fail(f"node {node.id}: {e} handed out beyond commit {core.commit_index}")

    def on_persist(self, node: SimNode, rd: Ready) -> None:
        """Log matching: each persisted (index, term) has one predecessor term and data."""
        st = node.storage
        for e in rd.entries:
            prev = st.term(e.index - 1)
            assert prev is not None
            value = (prev, e.kind, e.data)
            known = self.entries.setdefault((e.index, e.term), value)
            if known != value:
                self.fail(
                    f"log matching: node {node.id} persisted ({e.index}, {e.term}) with "
                    f"predecessor term {prev}, elsewhere {known[0]} (or other data)"
                )

    def on_apply(self, node: SimNode, e: Entry) -> None:
        """State machine safety: every node reaches the same state at each index."""
        want = self.committed.get(e.index)
        if want is not None and want != e.term:
            self.fail(f"node {node.id} applied ({e.index}, {e.term}), committed term {want}")
        self.note_commit(e.index, e.term, node.id)
        self._digest(node, e.index)

    def on_install(self, node: SimNode, snap: Snapshot) -> None:
        """A snapshot must hold the same state as the nodes that applied up to it."""
        if node.sm.applied != snap.meta.index:
            self.fail(f"node {node.id}: snapshot at {snap.meta.index} holds {node.sm.applied}")
        self.note_commit(snap.meta.index, snap.meta.term, node.id)
        self._digest(node, snap.meta.index)

    def _digest(self, node: SimNode, index: int) -> None:
        known = self.digests.setdefault(index, node.sm.digest)
        if known != node.sm.digest:
            self.fail(f"state machine safety: node {node.id} diverges at index {index}")

    def on_read(self, node: SimNode, context: bytes, index: int) -> None:
        """A read is linearizable if it sees everything committed before it was asked."""
        bound = self.reads.get(context)
        if bound is None:
            self.fail(f"node {node.id}: ReadState for unknown context {context!r}")
            return
        if index < bound:
            self.fail(f"stale read {context!r} on {node.id}: index {index} < committed {bound}")
        self.reads_answered += 1

    def full_log_matching(self) -> None:
        """Pairwise: logs that share an (index, term) are identical up to it."""
        stores = [(i, n.storage) for i, n in sorted(self.cluster.nodes.items())]
        for a, (ia, sa) in enumerate(stores):
            for ib, sb in stores[a + 1 :]:
                lo = max(sa.base, sb.base) + 1
                hi = min(sa.last_index, sb.last_index)
                for i in range(hi, lo - 1, -1):
                    if sa.term(i) == sb.term(i):
                        for j in range(lo, i + 1):
                            ea = sa.entries[j - sa.base - 1]
                            eb = sb.entries[j - sb.base - 1]
                            if ea != eb:
                                self.fail(f"log matching: nodes {ia},{ib} differ at {j} below {i}")
                        break


class SimCluster:
    """N simulated nodes on a seeded network; the test's handle on a whole cluster."""

    def __init__(
        self,
        ids: Iterable[int],
        *,
        seed: int = 0,
        net: NetConfig | None = None,
        trace_len: int = 80,
        **options: Any,
    ) -> None:
        """Founding members `ids`, each `RaftCore(id, ids, **options)`."""
        self.seed = seed
        self.rng = random.Random(seed)
        self.net = net or NetConfig()
        self.options = options
        self.now = 0
        self.nodes: dict[int, SimNode] = {}
        self.group: dict[int, int] = {}
        self.queue: list[tuple[int, int, Message]] = []
        self.seq = 0
        self.trace: deque[tuple[Any, ...]] = deque(maxlen=trace_len)
        self.commit_seen: dict[int, int] = {}
        self.check = Checker(self)
        self.crash_in_ready = 0.0
        self.read_seq = 0
        self.delivered: Counter[MessageType] = Counter()
        self.read_results: list[tuple[int, ReadState]] = []
        founders = sorted(ids)
        for i in founders:
            self.nodes[i] = SimNode(i, RaftCore(i, founders, rng=self._core_rng(i, 0), **options))
            self.group[i] = 0

    # -- plumbing ----------------------------------------------------------------

    def _core_rng(self, node_id: int, restarts: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + node_id * 1009 + restarts)

    def event(self, *what: Any) -> None:
        """Append to the trace that a failure report shows."""
        self.trace.append((self.now, *what))

    def describe(self, what: str) -> str:
        """A failure report: seed, time, the violation and the last events."""
        lines = [f"seed={self.seed} t={self.now}: {what}", "last events:"]
        for ev in self.trace:
            t, kind, *rest = ev
            if kind == "msg":
                m: Message = rest[0]
                detail = (
                    f"{m.type.name} {m.src}->{m.dst} term={m.term} idx={m.index} "
                    f"lt={m.log_term} n={len(m.entries)} commit={m.commit}"
                    f"{' REJECT hint=' + str(m.reject_hint) if m.reject else ''}"
                )
            else:
                detail = " ".join(str(x) for x in [kind, *rest])
            lines.append(f"  t={t} {detail}")
        for i, n in sorted(self.nodes.items()):
            c = n.core
            if c is None:
                lines.append(f"  node {i}: down, stored {n.storage.hard_state}")
            else:
                lines.append(
                    f"  node {i}: {c.role.name} term={c.term} lead={c.leader_id} "
                    f"commit={c.commit_index} applied={c.applied_index} last={c.last_index} "
                    f"voters={sorted(c.voters)}"
                )
        return "\n".join(lines)

    def core(self, node_id: int) -> RaftCore:
        """The running core of `node_id`."""
        return self.nodes[node_id].live()

    def live_ids(self) -> list[int]:
        """Ids of the running nodes."""
        return [i for i, n in sorted(self.nodes.items()) if n.alive]

    def leader(self) -> int | None:
        """The running leader of the highest term, if any."""
        best: tuple[int, int] | None = None
        for i in self.live_ids():
            c = self.core(i)
            if c.role is Role.LEADER and (best is None or c.term > best[0]):
                best = (c.term, i)
        return best[1] if best else None

    def leaders(self) -> list[int]:
        """All running nodes that believe they lead."""
        return [i for i in self.live_ids() if self.core(i).role is Role.LEADER]

    # -- network -----------------------------------------------------------------

    def can_reach(self, a: int, b: int) -> bool:
        """Whether the partition lets a message from `a` reach `b`."""
        return self.group.get(a, 0) == self.group.get(b, 0)

    def partition(self, *groups: Iterable[int]) -> None:
        """Split the nodes: each group reaches only itself (unlisted nodes: group 0)."""
        self.group = dict.fromkeys(self.nodes, 0)
        for g, members in enumerate(groups, start=1):
            for i in members:
                self.group[i] = g
        self.event("partition", [sorted(g) for g in groups])

    def isolate(self, node_id: int) -> None:
        """Cut `node_id` off from everyone."""
        self.partition([node_id])

    def heal(self) -> None:
        """Remove every partition."""
        self.group = dict.fromkeys(self.nodes, 0)
        self.event("heal")

    def send(self, m: Message) -> None:
        """Put a message on the network (which may lose, copy or delay it)."""
        net, rng = self.net, self.rng
        if net.drop and rng.random() < net.drop:
            return
        copies = 2 if net.duplicate and rng.random() < net.duplicate else 1
        for _ in range(copies):
            delay = rng.randint(net.min_delay, net.max_delay) if net.max_delay else net.min_delay
            self.seq += 1
            heapq.heappush(self.queue, (self.now + delay, self.seq, m))

    def deliver_due(self) -> int:
        """Deliver every message due by now; return how many were stepped."""
        n = 0
        while self.queue and self.queue[0][0] <= self.now:
            _, _, m = heapq.heappop(self.queue)
            node = self.nodes.get(m.dst)
            if node is None or node.core is None or not self.can_reach(m.src, m.dst):
                continue
            if self.net.wire:
                m = Message.from_bytes(m.to_bytes())
            self.event("msg", m)
            self.delivered[m.type] += 1
            node.core.step(m)
            self.check.after_input(node)
            n += 1
        return n

    # -- the driver ----------------------------------------------------------------

    def process(self, node: SimNode) -> None:
        """Handle every Ready of `node` as a driver does."""
        while node.core is not None and node.core.has_ready():
            core = node.core
            rd = core.ready()
            self.check.on_ready(node, rd)
            if self.crash_in_ready and self.rng.random() < self.crash_in_ready:
                if self.rng.random() < 0.5:
                    node.storage.save(rd)
                    self.check.on_persist(node, rd)
                    self.crash(node.id, "after persisting a Ready")
                else:
                    self.crash(node.id, "before persisting a Ready")
                return
            node.storage.save(rd)
            self.check.on_persist(node, rd)
            for m in rd.messages:
                self.send(m)
            if rd.snapshot is not None:
                node.sm = SimStateMachine.from_bytes(rd.snapshot.data)
                self.check.on_install(node, rd.snapshot)
            for e in rd.committed:
                if e.index <= node.sm.applied:
                    continue
                node.sm.apply(e)
                self.check.on_apply(node, e)
            for rs in rd.read_states:
                self.check.on_read(node, rs.context, rs.index)
                self.read_results.append((node.id, rs))
            core.advance(rd)
            self.check.after_input(node)

    def process_all(self) -> None:
        """Handle the Readies of every running node."""
        for i in sorted(self.nodes):
            self.process(self.nodes[i])

    def tick(self) -> None:
        """One tick on every running node."""
        for i in sorted(self.nodes):
            node = self.nodes[i]
            if node.core is not None:
                node.core.tick()
                self.check.after_input(node)

    def step(self) -> None:
        """One unit of simulated time: deliver what is due, tick, handle Readies."""
        self.now += 1
        self.deliver_due()
        self.tick()
        self.process_all()

    def stabilize(self, max_rounds: int = 10_000) -> None:
        """Without ticking, deliver and process until nothing is left (for a network
        with no delay: the focused tests' synchronous mode)."""
        for _ in range(max_rounds):
            self.process_all()
            if not self.deliver_due():
                self.process_all()
                if not any(q[0] <= self.now for q in self.queue):
                    return
        raise InvariantViolation(self.describe("did not stabilize"))

    def tick_stable(self, n: int = 1) -> None:
        """`n` times: tick every node, then stabilize (synchronous mode)."""
        for _ in range(n):
            self.now += 1
            self.tick()
            self.stabilize()

    def run_until(self, pred: Callable[[], bool], max_steps: int, *, stable: bool = True) -> bool:
        """Advance time until `pred()`; False if `max_steps` went by first."""
        for _ in range(max_steps):
            if pred():
                return True
            if stable:
                self.tick_stable()
            else:
                self.step()
        return pred()

    # -- faults and clients ------------------------------------------------------------

    def crash(self, node_id: int, why: str = "") -> None:
        """Stop a node: its core and state machine are gone, its storage stays."""
        node = self.nodes[node_id]
        node.core = None
        node.sm = SimStateMachine()
        self.event("crash", node_id, why)

    def restart(self, node_id: int) -> None:
        """Start a crashed node again from its storage alone."""
        node = self.nodes[node_id]
        st = node.storage
        node.restarts += 1
        node.core = RaftCore.restore(
            node_id,
            st.hard_state,
            st.snapshot,
            list(st.entries),
            rng=self._core_rng(node_id, node.restarts),
            **self.options,
        )
        node.sm = SimStateMachine.from_bytes(st.snapshot.data) if st.snapshot else SimStateMachine()
        self.commit_seen[node_id] = min(self.commit_seen.get(node_id, 0), node.core.commit_index)
        self.event("restart", node_id, f"term={st.hard_state.term} vote={st.hard_state.vote}")

    def add_node(self, node_id: int) -> SimNode:
        """Start a node that will join a running cluster (it waits for the leader)."""
        node = SimNode(
            node_id, RaftCore(node_id, (), rng=self._core_rng(node_id, 0), **self.options)
        )
        self.nodes[node_id] = node
        self.group[node_id] = 0
        self.event("spawn", node_id)
        return node

    def compact(self, node_id: int) -> Snapshot | None:
        """Snapshot a node's state machine at its applied index and compact its log."""
        node = self.nodes[node_id]
        core = node.live()
        if node.sm.applied <= core.log.snap_index or core.log.pending_snapshot is not None:
            return None
        snap = core.compact(node.sm.applied, node.sm.to_bytes())
        node.storage.compact(snap)
        self.event("compact", node_id, snap.meta.index)
        return snap

    def propose(self, data: bytes, at: int | None = None) -> tuple[int, int] | None:
        """A client proposes on node `at` (default: a random running node), forwarded
        once to the leader it names; returns (node, index) or None if refused."""
        live = self.live_ids()
        if not live:
            return None
        target = at if at is not None else self.rng.choice(live)
        for _ in range(2):
            node = self.nodes.get(target)
            if node is None or node.core is None:
                return None
            try:
                index = node.core.propose(data)
            except NotLeader as e:
                target = e.leader_id
                continue
            except RaftError:
                return None
            self.event("propose", target, index, data)
            return target, index
        return None

    def read(self, at: int) -> bytes | None:
        """A client asks node `at` for a linearizable read; returns its context."""
        self.read_seq += 1
        ctx = b"r%d" % self.read_seq
        bound = max(
            [self.check.max_committed] + [self.core(i).commit_index for i in self.live_ids()]
        )
        self.check.reads[ctx] = bound
        try:
            self.core(at).read_index(ctx)
        except NotLeader:
            return None
        self.event("read", at, ctx)
        return ctx

    def applied_items(self, node_id: int) -> list[bytes]:
        """The client data node `node_id` has applied, in order."""
        return self.nodes[node_id].sm.items


@dataclass
class SimReport:
    """What a random run did (for tuning and for tests that want to see coverage)."""

    seed: int
    steps: int = 0
    leaders: int = 0
    committed: int = 0
    crashes: int = 0
    snapshots_sent: int = 0
    conf_changes: int = 0
    reads: int = 0
    liveness_steps: int = 0
    digest: bytes = b""
    """The state machine's hash chain at the highest index any node applied."""
    flags: dict[str, bool] = field(default_factory=dict)


def run_random(
    seed: int,
    *,
    nodes: int = 3,
    steps: int = 1000,
    plan: FaultPlan | None = None,
    net: NetConfig | None = None,
    liveness_steps: int = 600,
    **options: Any,
) -> SimReport:
    """One randomized run: `steps` steps of faults and clients, then heal everything
    and require a leader and a fresh commit on every voter within `liveness_steps`."""
    plan = plan or FaultPlan()
    net = net or NetConfig(drop=0.05, duplicate=0.02, min_delay=1, max_delay=3)
    sim = SimCluster(range(1, nodes + 1), seed=seed, net=net, **options)
    sim.crash_in_ready = plan.crash_in_ready
    rng = random.Random(seed ^ 0x5EED)
    report = SimReport(seed, flags={k: v for k, v in options.items() if isinstance(v, bool)})
    next_id = nodes + 1
    proposal = 0
    max_down = (nodes - 1) // 2 + 1  # sometimes a majority is down: safety must still hold

    for step in range(steps):
        if step % 100 == 99:
            sim.check.full_log_matching()
        live = sim.live_ids()
        down = [i for i in sim.nodes if i not in live]
        if live and len(down) < max_down and rng.random() < plan.crash:
            sim.crash(rng.choice(live), "random")
            report.crashes += 1
        if down and rng.random() < plan.restart:
            sim.restart(rng.choice(sorted(down)))
        if rng.random() < plan.partition:
            ids = sorted(sim.nodes)
            rng.shuffle(ids)
            cut = rng.randint(1, len(ids) - 1)
            sim.partition(ids[:cut])
        if rng.random() < plan.heal:
            sim.heal()
        live = sim.live_ids()
        if live and rng.random() < plan.propose:
            proposal += 1
            sim.propose(b"p%d" % proposal)
        if live and rng.random() < plan.read:
            sim.read(rng.choice(live))
        if live and rng.random() < plan.compact:
            sim.compact(rng.choice(live))
        leader = sim.leader()
        if leader is not None and rng.random() < plan.transfer:
            core = sim.core(leader)
            others = sorted(core.voters - {leader})
            if others:
                core.transfer_leadership(rng.choice(others))
                sim.event("transfer", leader)
        if leader is not None and rng.random() < plan.conf_change:
            core = sim.core(leader)
            voters = sorted(core.voters)
            try:
                if len(voters) < plan.max_voters and (
                    len(voters) <= plan.min_voters or rng.random() < 0.5
                ):
                    new = next_id
                    idx = core.propose_conf_change(add=new)
                    next_id += 1
                    sim.add_node(new)
                    sim.event("conf", "add", new, idx)
                elif len(voters) > plan.min_voters:
                    gone = rng.choice(voters)
                    idx = core.propose_conf_change(remove=gone)
                    sim.event("conf", "remove", gone, idx)
                report.conf_changes += 1
            except (RaftError, ValueError):
                pass
        sim.step()

    # Liveness: no more faults, everything heals and restarts.
    sim.net = NetConfig(min_delay=1, max_delay=net.max_delay, wire=net.wire)
    sim.crash_in_ready = 0.0
    sim.heal()
    for i in sorted(sim.nodes):
        if not sim.nodes[i].alive:
            sim.restart(i)
    pending: tuple[bytes, int] | None = None
    done = False
    for k in range(liveness_steps):
        sim.step()
        leader = sim.leader()
        if leader is None:
            continue
        core = sim.core(leader)
        if pending is None or k - pending[1] > 4 * core.election_ticks:
            proposal += 1
            data = b"live%d" % proposal
            if sim.propose(data, at=leader) is not None:
                pending = (data, k)
            continue
        members = sorted(core.voters)
        if all(pending[0] in sim.applied_items(i) for i in members):
            report.liveness_steps = k + 1
            done = True
            break
    if not done:
        raise InvariantViolation(
            sim.describe(f"liveness: no commit on all voters {liveness_steps} steps after healing")
        )
    sim.check.full_log_matching()
    report.steps = sim.now
    report.leaders = len(sim.check.seen_leaders)
    report.committed = sim.check.max_committed
    report.reads = sim.check.reads_answered
    report.digest = sim.check.digests[max(sim.check.digests)]
    report.snapshots_sent = sim.delivered[MessageType.SNAP]
    return report
