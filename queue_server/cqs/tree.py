"""The SLA priority structure of one CQS queue: enqueue, grouped dequeue, ack.

What belongs here: the order of a queue's notifications and the bookkeeping of
which are pending and which are in flight. No I/O, no clock (times are passed in),
no protobuf; `queue_server/cqs/service` (to come) turns these records into
DtoChangeNotification messages.

Order (seed 000): `sla` ascending; at equal SLA the id with more path segments
first; then first enqueued first. That order is one int per record
(`priority`), so every sorted structure compares plain ints.

Grouped dequeue: the first record is the most urgent of the queue; the rest are
the next most urgent whose id shares its first `d` segments. The queue keeps, for
each depth 1..K (K = the queue's `depth`, default 4), a sorted list per id prefix,
so a group is read in priority order from one list: O(log n) per record taken.
The sorted lists hold priority ints (compared in C), mapped back to records by
one dict.
A request deeper than K (rare) scans the first record's depth-K list and filters.

Dedup: a pending record with the same (dto_type, kind, id, alias) absorbs a new
one, keeping the more urgent SLA and its tracking id. An in-flight record does not
absorb: the change may have come after the consumer read, so a new pending record
is queued.
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedList

DEFAULT_DEPTH = 4
"""Default prefix depth of a queue: t/{tenant}/s/{store} (seed 000)."""
_SEQ_BITS = 34
_SEG_BITS = 6
_MAX_SEGMENTS = (1 << _SEG_BITS) - 1
_LOW_BITS = _SEQ_BITS + _SEG_BITS


def priority_of(sla_us: int, segments: int, seq: int) -> int:
    """One int whose order is the queue's order (smaller = more urgent)."""
    seg = _MAX_SEGMENTS - min(segments, _MAX_SEGMENTS)
    return (sla_us << (_SEQ_BITS + _SEG_BITS)) | (seg << _SEQ_BITS) | (seq & ((1 << _SEQ_BITS) - 1))


class Record:
    """One notification of a queue. Hashed and equal by its dedup identity
    (dto_type, kind, id, alias), so a dict of records is the dedup index without
    a second copy of the key; the sorted indexes hold its `priority` int."""

    __slots__ = (
        "alias",
        "dto_id",
        "dto_type",
        "is_parent",
        "priority",
        "token",
        "tracking_id",
    )

    def __init__(
        self,
        dto_type: str,
        dto_id: str,
        is_parent: bool,
        alias: str,
        sla_us: int,
        tracking_id: str,
        priority: int = 0,
    ) -> None:
        self.dto_type = dto_type
        self.dto_id = dto_id
        self.is_parent = is_parent
        self.alias = alias
        self.tracking_id = tracking_id
        # the SLA lives in the priority's high bits; `sla_us` reads it back
        self.priority = priority or priority_of(sla_us, dto_id.count("/") + 1, 0)
        self.token = ""

    @property
    def sla_us(self) -> int:
        return self.priority >> _LOW_BITS

    def __hash__(self) -> int:
        return hash((self.dto_type, self.is_parent, self.dto_id, self.alias))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return (
            self.dto_id == other.dto_id
            and self.dto_type == other.dto_type
            and self.is_parent == other.is_parent
            and self.alias == other.alias
        )

    def __repr__(self) -> str:
        kind = "parent_id" if self.is_parent else "dto_id"
        return (
            f"Record({self.dto_type} {kind}={self.dto_id} alias={self.alias!r} sla={self.sla_us})"
        )


def prefix(dto_id: str, depth: int) -> str:
    """The first `depth` segments of an id ("t/a/s/b" for depth 4)."""
    parts = dto_id.split("/", depth)
    return "/".join(parts[:depth])


@dataclass
class InFlight:
    record: Record
    visible_at: float


@dataclass
class SlaQueue:
    """One CQS queue's notifications."""

    depth: int = DEFAULT_DEPTH
    _seq: int = 0
    _all: SortedList = field(default_factory=SortedList)  # priorities (ints)
    _groups: dict[str, SortedList] = field(default_factory=dict)  # depth-K prefix -> priorities
    _group_keys: SortedList = field(default_factory=SortedList)  # the prefixes of _groups
    _by_priority: dict[int, Record] = field(default_factory=dict)
    _pending: dict[Record, Record] = field(default_factory=dict)
    _in_flight: dict[str, InFlight] = field(default_factory=dict)
    _expiry: list[tuple[float, str]] = field(default_factory=list)  # heap of (visible_at, token)
    _interned: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        """Pending notifications (not in flight)."""
        return len(self._all)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def most_urgent_sla_us(self) -> int | None:
        """The SLA of the most urgent pending record (None: nothing pending)."""
        if not self._all:
            return None
        return self._by_priority[self._all[0]].sla_us

    def seq_of(self, record: Record) -> int:
        """The record's enqueue number in this queue (stable across deliveries)."""
        return record.priority & ((1 << _SEQ_BITS) - 1)

    def held(self, token: str, now: float) -> Record | None:
        """The in-flight record of `token`, if the token is alive at `now`."""
        held = self._in_flight.get(token)
        if held is None or held.visible_at <= now:
            return None
        return held.record

    def earliest_visible(self) -> float | None:
        """When the next in-flight record becomes visible again (None: none held)."""
        while self._expiry:
            at, token = self._expiry[0]
            held = self._in_flight.get(token)
            if held is not None and held.visible_at == at:
                return at
            heapq.heappop(self._expiry)  # acked or extended since
        return None

    def _intern(self, text: str) -> str:
        return self._interned.setdefault(text, text)

    # -- enqueue ------------------------------------------------------------------

    def enqueue(
        self,
        dto_type: str,
        dto_id: str,
        sla_us: int,
        *,
        is_parent: bool = False,
        alias: str = "",
        tracking_id: str = "",
    ) -> Record:
        """Queue a notification, or merge it into a pending duplicate."""
        probe = Record(
            self._intern(dto_type), dto_id, is_parent, self._intern(alias), sla_us, tracking_id
        )
        existing = self._pending.get(probe)
        if existing is not None:
            if sla_us < existing.sla_us:
                self._reprioritize(existing, sla_us, tracking_id)
            return existing
        self._seq += 1
        probe.priority = priority_of(sla_us, dto_id.count("/") + 1, self._seq)  # with its seq
        self._pending[probe] = probe
        self._link(probe)
        return probe

    def _reprioritize(self, record: Record, sla_us: int, tracking_id: str) -> None:
        """A more urgent SLA for a pending record; its place among equals stays."""
        self._unlink(record)
        record.tracking_id = tracking_id
        seq = record.priority & ((1 << _SEQ_BITS) - 1)
        record.priority = priority_of(sla_us, record.dto_id.count("/") + 1, seq)
        self._link(record)

    def _link(self, record: Record) -> None:
        key = record.priority
        self._by_priority[key] = record
        self._all.add(key)
        p = prefix(record.dto_id, self.depth)
        lst = self._groups.get(p)
        if lst is None:
            lst = self._groups[p] = SortedList()
            self._group_keys.add(p)
        lst.add(key)

    def _unlink(self, record: Record) -> None:
        key = record.priority
        del self._by_priority[key]
        self._all.remove(key)
        p = prefix(record.dto_id, self.depth)
        lst = self._groups[p]
        lst.remove(key)
        if not lst:
            del self._groups[p]
            self._group_keys.remove(p)

    # -- dequeue ------------------------------------------------------------------

    def _group(self, first: Record, depth: int) -> Iterator[Record]:
        """Pending records sharing `first`'s first `depth` segments, most urgent first."""
        segments = first.dto_id.count("/") + 1
        if depth > segments:
            depth = segments  # a depth past the id groups by the whole id
        records = self._by_priority
        if depth == self.depth:
            for key in self._groups[prefix(first.dto_id, depth)]:
                yield records[key]
            return
        want = prefix(first.dto_id, depth)
        if depth < self.depth:
            # the depth-K groups under `want`, merged in priority order
            under = want + "/"
            lists = []
            for p in self._group_keys.irange(minimum=want):
                if p != want and not p.startswith(under):
                    if not p.startswith(want):
                        break
                    continue  # "t/ab" after "t/a": same characters, another segment
                lists.append(self._groups[p])
            for key in heapq.merge(*lists):
                yield records[key]
            return
        for key in self._groups[prefix(first.dto_id, self.depth)]:
            record = records[key]
            if record.dto_id == want or record.dto_id.startswith(want + "/"):
                yield record

    def dequeue(
        self, max_records: int, depth: int, visible_at: float, token_base: str | None = None
    ) -> list[Record]:
        """Take up to `max_records`: the most urgent, then its prefix group (`depth`
        0: the queue's depth; negative: no grouping, plain queue order). Each
        gets a fresh ack token (`token_base` + its seq, so a replica mints the
        same ones; random without a base) and stays in flight until acked or
        `visible_at`."""
        if not self._all or max_records < 1:
            return []
        if depth == 0:
            depth = self.depth
        first = self._by_priority[self._all[0]]
        taken: list[Record] = []
        group = self.pending() if depth < 0 else self._group(first, depth)
        for record in group:
            taken.append(record)
            if len(taken) >= max_records:
                break
        base = secrets.token_hex(8) if token_base is None else token_base
        for record in taken:
            self._unlink(record)
            del self._pending[record]
            record.token = f"{base}{self.seq_of(record):x}"
            self._hold(record, visible_at)
        return taken

    def _hold(self, record: Record, visible_at: float) -> None:
        self._in_flight[record.token] = InFlight(record, visible_at)
        heapq.heappush(self._expiry, (visible_at, record.token))

    # -- acknowledge and redelivery -------------------------------------------------

    def ack(self, tokens: list[str]) -> int:
        """Remove the notifications of these tokens; unknown ones are ignored."""
        done = 0
        for token in tokens:
            if self._in_flight.pop(token, None) is not None:
                done += 1
        return done

    def extend(self, token: str, visible_at: float) -> bool:
        """Keep an in-flight notification invisible longer (ReEnqueue leases)."""
        held = self._in_flight.get(token)
        if held is None:
            return False
        if visible_at > held.visible_at:
            held.visible_at = visible_at
            heapq.heappush(self._expiry, (visible_at, token))
        return True

    def release(self, tokens: list[str]) -> int:
        """Make these in-flight notifications pending again now (a nack)."""
        done = 0
        for token in tokens:
            held = self._in_flight.pop(token, None)
            if held is not None:
                self._requeue(held.record)
                done += 1
        return done

    def expire(self, now: float) -> int:
        """Make in-flight notifications past their visibility timeout pending
        again, with their SLA; their tokens die. They come back in the order
        they became visible, those of one instant in token order; one with a
        copy already pending merges into it (the more urgent SLA, the copy's
        place). Returns how many."""
        expired = 0
        heap = self._expiry
        while heap and heap[0][0] <= now:
            at, token = heapq.heappop(heap)
            held = self._in_flight.get(token)
            if held is None or held.visible_at != at:
                continue  # acked, released or extended since
            del self._in_flight[token]
            self._requeue(held.record)
            expired += 1
        return expired

    def _requeue(self, record: Record) -> None:
        """An in-flight record is pending again with its SLA and place."""
        record.token = ""
        existing = self._pending.get(record)
        if existing is not None:  # a newer copy is pending: keep the more urgent SLA
            if record.sla_us < existing.sla_us:
                self._reprioritize(existing, record.sla_us, record.tracking_id)
            return
        self._pending[record] = record
        self._link(record)

    def pending(self) -> Iterator[Record]:
        """Pending records in queue order."""
        records = self._by_priority
        return (records[key] for key in self._all)

    def in_flight_records(self) -> Iterator[tuple[Record, float]]:
        """In-flight records with the time each becomes visible again."""
        return ((h.record, h.visible_at) for h in self._in_flight.values())

    # -- snapshots ------------------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        """Plain data: the records with their seq, and the in-flight tokens."""

        def row(r: Record) -> tuple[str, str, bool, str, int, str, int]:
            return (
                r.dto_type,
                r.dto_id,
                r.is_parent,
                r.alias,
                r.sla_us,
                r.tracking_id,
                self.seq_of(r),
            )

        return {
            "depth": self.depth,
            "seq": self._seq,
            "pending": [row(r) for r in self.pending()],
            "in_flight": [(t, h.visible_at, *row(h.record)) for t, h in self._in_flight.items()],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SlaQueue:
        q = cls(depth=state["depth"])
        q._seq = state["seq"]
        for dto_type, dto_id, is_parent, alias, sla_us, tracking_id, seq in state["pending"]:
            r = q._record(dto_type, dto_id, is_parent, alias, sla_us, tracking_id, seq)
            q._pending[r] = r
            q._link(r)
        for token, visible_at, *rest in state["in_flight"]:
            r = q._record(*rest)
            r.token = token
            q._hold(r, visible_at)
        return q

    def _record(
        self,
        dto_type: str,
        dto_id: str,
        is_parent: bool,
        alias: str,
        sla_us: int,
        tracking_id: str,
        seq: int,
    ) -> Record:
        r = Record(
            self._intern(dto_type), dto_id, is_parent, self._intern(alias), sla_us, tracking_id
        )
        r.priority = priority_of(sla_us, dto_id.count("/") + 1, seq)
        return r
