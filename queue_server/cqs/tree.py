"""The SLA priority structure of one CQS queue: enqueue, grouped dequeue, ack.

What belongs here: the order of a queue's notifications and the bookkeeping of
which are pending and which are in flight. No I/O, no clock (times are passed in),
no protobuf; `queue_server/cqs/state.py` turns these records into
DtoChangeNotification messages.

Order (seed 000): `sla` ascending; at equal SLA the id with more path segments
first; then first enqueued first. That order is one int per record
(`priority = sla_us << 40 | (63 - segments) << 34 | seq`).

A pending notification is ONE bytes object, its *entry* (a queue holds millions,
so each costs one allocation and no dicts of its own):

    priority + 2**103      13 bytes, big endian: memcmp order is the queue's order
    kind                   n: index into the queue's (dto_type, alias, is_parent) table
    group                  n: index into the queue's depth-K prefix table
    len(tracking_id), tracking_id (UTF-8)
    the id after its depth-K prefix (UTF-8), to the end

`n` is one byte below 255, else 255 and four bytes big endian. Strings are
UTF-8 with `surrogatepass` (a JSON id may hold a lone surrogate), so every str
round-trips. Since "/" is ASCII, prefixes, segment counts and prefix order are
the same on the bytes as on the str. Callers see `Record`s, built from an entry
when one is returned (dequeue, pending(), held()).

Indexes: `_all`, a sorted list of every pending entry, whose head is the most
urgent notification; per depth-K prefix (K = the queue's `depth`, default 4) a
sorted list of that group's entries. Sorting compares bytes (memcmp, in C).

Grouped dequeue: the first record is the most urgent of the queue; the rest are
the next most urgent whose id shares its first `d` segments. At depth K that is
one sorted list, read in order: O(log n) per record taken. Shallower, it is a
`heapq.merge` of the depth-K lists under the shorter prefix; deeper (rare), the
depth-K list filtered.

Dedup: a pending record with the same (dto_type, kind, id, alias) absorbs a new
one, keeping the more urgent SLA and its tracking id. An in-flight record does not
absorb: the change may have come after the consumer read, so a new pending record
is queued. The dedup index maps a 60-bit hash of (kind, group, rest of the id)
to the entry (a list of entries on the rare collision; the entries are compared
before one is taken as a duplicate). While a record is pending its group index
stands for its prefix, so that triple is its identity.

In flight records (few: what consumers hold) are `Record`s with their token,
in `token -> InFlight`, plus a heap of `(visible_at, token)` with lazy deletion.

Rows: after `keep_rows`, every change writes the row it changed (a pending
entry's, an in-flight record's, or None) into the state's `RowJournal`, the
way `state.py`'s docstring lays the `cqs` table out; `load_rows` rebuilds a
queue from its rows in key order.
"""

from __future__ import annotations

import heapq
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList

DEFAULT_DEPTH = 4
"""Default prefix depth of a queue: t/{tenant}/s/{store} (seed 000)."""
_SEQ_BITS = 34
_SEG_BITS = 6
_MAX_SEGMENTS = (1 << _SEG_BITS) - 1
_LOW_BITS = _SEQ_BITS + _SEG_BITS
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_LOW_MASK = (1 << _LOW_BITS) - 1

KEY_BYTES = 13
"""Bytes of an entry's priority: any int64 SLA (and every 40-bit tail) fits."""
_KEY_BIAS = 1 << (63 + _LOW_BITS)
_HASH_MASK = (1 << 60) - 1
"""Dedup hashes stay below 2**60: two-digit ints, 32 bytes each."""
_ESCAPE = 255
_SMALL = [bytes((i,)) for i in range(_ESCAPE)]
_UTF8 = "utf-8"
_SP = "surrogatepass"

Entry = bytes
"""A pending notification's packed form (see the module docstring)."""


def priority_of(sla_us: int, segments: int, seq: int) -> int:
    """One int whose order is the queue's order (smaller = more urgent)."""
    seg = _MAX_SEGMENTS - min(segments, _MAX_SEGMENTS)
    return (sla_us << (_SEQ_BITS + _SEG_BITS)) | (seg << _SEQ_BITS) | (seq & _SEQ_MASK)


def priority_key(priority: int) -> bytes:
    """The 13 bytes whose memcmp order is `priority`'s order."""
    return (priority + _KEY_BIAS).to_bytes(KEY_BYTES, "big")


def key_priority(key: bytes) -> int:
    return int.from_bytes(key[:KEY_BYTES], "big") - _KEY_BIAS


def seq_of_key(key: bytes) -> int:
    """The seq of a row key."""
    return key_priority(key) & _SEQ_MASK


def pack_n(n: int) -> bytes:
    """A count or index: one byte below 255, else 255 and four bytes."""
    return _SMALL[n] if n < _ESCAPE else b"\xff" + n.to_bytes(4, "big")


def unpack_n(buf: bytes, at: int) -> tuple[int, int]:
    """(the number at `at`, the offset after it)."""
    n = buf[at]
    if n != _ESCAPE:
        return n, at + 1
    return int.from_bytes(buf[at + 1 : at + 5], "big"), at + 5


def _parse(e: Entry) -> tuple[int, int, int, int, int]:
    """(kind, group, where the tracking id's length starts, where the tracking
    id starts, where the rest of the id starts) of an entry."""
    kind, group, count = e[13], e[14], e[15]
    if kind != _ESCAPE and group != _ESCAPE and count != _ESCAPE:
        return kind, group, 15, 16, 16 + count
    kind, at = unpack_n(e, KEY_BYTES)
    group, at = unpack_n(e, at)
    count, start = unpack_n(e, at)
    return kind, group, at, start, start + count


def _ident_hash(kind: int, group: int, rest: bytes) -> int:
    return hash((kind, group, rest)) & _HASH_MASK


def _whole_ms(value: float) -> int:
    """A visibility time as the integer it is (the commands' clock is Unix ms)."""
    whole = int(value)
    if whole != value:
        raise ValueError(f"visibility time {value!r} is not a whole number of ms")
    return whole


def text(raw: bytes) -> str:
    return raw.decode(_UTF8, _SP)


def utf8(s: str) -> bytes:
    return s.encode(_UTF8, _SP)


class Record:
    """One notification of a queue as callers see it (a pending one is built
    from its entry when returned; an in-flight one is kept as it is). Equal by
    its dedup identity (dto_type, kind, id, alias)."""

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


def _prefix_b(dto_id: bytes, depth: int) -> bytes:
    parts = dto_id.split(b"/", depth)
    return b"/".join(parts[:depth])


_new_record = Record.__new__


@dataclass(slots=True)
class InFlight:
    record: Record
    visible_at: float


def _by_priority(item: tuple[str, InFlight]) -> int:
    return item[1].record.priority


ExportRow = tuple[str, str, bool, str, int, str, int]
"""A notification in `export_state`: (dto_type, dto_id, is_parent, alias,
sla_us, tracking_id, seq)."""


class RowJournal:
    """The `cqs` table's rows changed since the last checkpoint, shared by the
    queues of one state: row key -> the row's bytes as they are now, or None
    (gone). Each change writes its row's new bytes, so the dict always holds
    current rows, and a checkpoint takes it whole (`CqsState.take_rows`)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: dict[bytes, bytes | None] = {}


def table_key(table_id: int) -> bytes:
    """The queue's part of its row keys (and its header row's key)."""
    return table_id.to_bytes(4, "big")


class DamagedRow(ValueError):
    """A row of the `cqs` table that no queue of this version writes."""


def decode_row(key: bytes, value: bytes) -> tuple[ExportRow, str, int]:
    """One notification row (`key` after the queue's part) as export_state's
    row, its token ("" while pending) and when it becomes visible (0 pending)."""
    if len(key) != KEY_BYTES:
        raise DamagedRow(f"a cqs row key of {len(key)} bytes, not {KEY_BYTES}")
    try:
        if value[0] > 1:
            raise DamagedRow(f"a cqs row has flags {value[0]}")
        n, at = unpack_n(value, 1)
        dto_type, at = text(value[at : at + n]), at + n
        n, at = unpack_n(value, at)
        alias, at = text(value[at : at + n]), at + n
        n, at = unpack_n(value, at)
        tracking_id, at = text(value[at : at + n]), at + n
        n, at = unpack_n(value, at)
        token, at = text(value[at : at + n]), at + n
        visible_at = 0
        if n:
            visible_at, at = int.from_bytes(value[at : at + 8], "big", signed=True), at + 8
        if at > len(value):
            raise DamagedRow("a cqs row is shorter than its lengths")
        dto_id = text(value[at:])
    except (IndexError, UnicodeDecodeError) as e:
        raise DamagedRow(f"a cqs row does not parse: {e!r}") from e
    priority = key_priority(key)
    row = (
        dto_type,
        dto_id,
        bool(value[0]),
        alias,
        priority >> _LOW_BITS,
        tracking_id,
        priority & _SEQ_MASK,
    )
    return row, token, visible_at


class SlaQueue:
    """One CQS queue's notifications."""

    def __init__(self, depth: int = DEFAULT_DEPTH) -> None:
        self.depth = depth
        self._seq = 0
        self._all = SortedList()  # every pending entry
        self._lists: list[SortedList | None] = []  # group -> its entries
        self._prefixes: list[bytes] = []  # group -> its depth-K prefix (b"" when free)
        self._group_of: dict[bytes, int] = {}  # depth-K prefix -> group
        self._group_keys = SortedList()  # the prefixes of the groups
        self._free_groups: list[int] = []
        self._kinds: list[tuple[str, str, bool]] = []  # kind -> (dto_type, alias, is_parent)
        self._kind_of: dict[tuple[str, str, bool], int] = {}
        self._dedup: dict[int, Entry | list[Entry]] = {}
        self._in_flight: dict[str, InFlight] = {}
        self._expiry: list[tuple[float, str]] = []  # heap of (visible_at, token)
        self._kind_rows: list[bytes] = []  # kind -> its part of a row value
        self._kind_by_row: dict[bytes, int] = {}  # the same, back (loading rows)
        self._journal: dict[bytes, bytes | None] | None = None  # RowJournal.rows
        self._owner: RowJournal | None = None
        self._table = b""  # the row keys' queue part

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
        return key_priority(self._all[0]) >> _LOW_BITS

    def seq_of(self, record: Record) -> int:
        """The record's enqueue number in this queue (stable across deliveries)."""
        return record.priority & _SEQ_MASK

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

    # -- entries ------------------------------------------------------------------

    def _kind(self, dto_type: str, alias: str, is_parent: bool) -> int:
        probe = (dto_type, alias, is_parent)
        kind = self._kind_of.get(probe)
        if kind is None:
            kind = self._kind_of[probe] = len(self._kinds)
            self._kinds.append(probe)
            t, a = utf8(dto_type), utf8(alias)
            self._kind_rows.append(
                b"".join((_SMALL[int(is_parent)], pack_n(len(t)), t, pack_n(len(a)), a))
            )
        return kind

    def _group(self, p: bytes) -> int:
        """The group of depth-K prefix `p`, made if it has none."""
        group = self._group_of.get(p)
        if group is not None:
            return group
        if self._free_groups:
            group = self._free_groups.pop()
            self._lists[group] = SortedList()
            self._prefixes[group] = p
        else:
            group = len(self._lists)
            self._lists.append(SortedList())
            self._prefixes.append(p)
        self._group_of[p] = group
        self._group_keys.add(p)
        return group

    def _entry(self, priority: int, kind: int, group: int, tracking: bytes, rest: bytes) -> Entry:
        return b"".join(
            (
                priority_key(priority),
                pack_n(kind),
                pack_n(group),
                pack_n(len(tracking)),
                tracking,
                rest,
            )
        )

    def _find(self, h: int, kind: int, group: int, rest: bytes) -> Entry | None:
        """The pending entry of identity (kind, group, rest), if any."""
        found = self._dedup.get(h)
        if found is None:
            return None
        for e in (found,) if isinstance(found, bytes) else found:
            k, g, _, _, start = _parse(e)
            if k == kind and g == group and len(e) - start == len(rest) and e.endswith(rest):
                return e
        return None

    def _view(self, e: Entry) -> Record:
        kind, group, _, start, rest = _parse(e)
        dto_type, alias, is_parent = self._kinds[kind]
        r = _new_record(Record)
        r.dto_type = dto_type
        r.dto_id = (self._prefixes[group] + e[rest:]).decode(_UTF8, _SP)
        r.is_parent = is_parent
        r.alias = alias
        r.tracking_id = e[start:rest].decode(_UTF8, _SP) if rest > start else ""
        r.priority = int.from_bytes(e[:KEY_BYTES], "big") - _KEY_BIAS
        r.token = ""
        return r

    def _link(self, e: Entry, group: int, h: int) -> None:
        self._all.add(e)
        lst = self._lists[group]
        assert lst is not None
        lst.add(e)
        found = self._dedup.get(h)
        if found is None:
            self._dedup[h] = e
        elif isinstance(found, bytes):
            self._dedup[h] = [found, e]
        else:
            found.append(e)
        if self._journal is not None:
            self._journal[self._table + e[:KEY_BYTES]] = self._pending_row(e)

    def _unlink(self, e: Entry, group: int, h: int) -> None:
        self._all.remove(e)
        lst = self._lists[group]
        assert lst is not None
        lst.remove(e)
        if not lst:
            p = self._prefixes[group]
            del self._group_of[p]
            self._group_keys.remove(p)
            self._lists[group] = None
            self._prefixes[group] = b""
            self._free_groups.append(group)
        found = self._dedup[h]
        if isinstance(found, bytes):
            del self._dedup[h]
        else:
            found.remove(e)
            if len(found) == 1:
                self._dedup[h] = found[0]
        if self._journal is not None:
            self._journal[self._table + e[:KEY_BYTES]] = None

    def _add(
        self, priority: int, kind: int, dto_id: bytes, p: bytes, tracking: bytes
    ) -> tuple[Entry, int, int]:
        """Link a new pending entry (its identity is not pending; `p` is its
        depth-K prefix); returns it with its group and hash."""
        group = self._group(p)
        rest = dto_id[len(p) :]
        h = _ident_hash(kind, group, rest)
        e = self._entry(priority, kind, group, tracking, rest)
        self._link(e, group, h)
        return e, group, h

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
        """Queue a notification, or merge it into a pending duplicate; returns
        the pending record as it now is (a copy)."""
        return self._view(self.insert(dto_type, dto_id, sla_us, is_parent, alias, tracking_id))

    def insert(
        self, dto_type: str, dto_id: str, sla_us: int, is_parent: bool, alias: str, tracking_id: str
    ) -> Entry:
        """`enqueue` without building the record: the pending entry."""
        kind = self._kind(dto_type, alias, is_parent)
        raw = dto_id.encode(_UTF8, _SP)
        p = _prefix_b(raw, self.depth)
        group = self._group_of.get(p)
        if group is not None:
            rest = raw[len(p) :]
            existing = self._find(_ident_hash(kind, group, rest), kind, group, rest)
            if existing is not None:
                if sla_us < key_priority(existing) >> _LOW_BITS:
                    existing = self._reprioritize(existing, sla_us, tracking_id)
                return existing
        self._seq += 1
        priority = priority_of(sla_us, raw.count(b"/") + 1, self._seq)
        return self._add(priority, kind, raw, p, tracking_id.encode(_UTF8, _SP))[0]

    def _reprioritize(self, e: Entry, sla_us: int, tracking_id: str) -> Entry:
        """A more urgent SLA for a pending entry; its place among equals stays."""
        kind, group, _, _, start = _parse(e)
        rest = e[start:]
        h = _ident_hash(kind, group, rest)
        priority = (sla_us << _LOW_BITS) | (key_priority(e) & _LOW_MASK)
        new = self._entry(priority, kind, group, utf8(tracking_id), rest)
        self._all.remove(e)
        self._all.add(new)
        lst = self._lists[group]
        assert lst is not None
        lst.remove(e)
        lst.add(new)
        found = self._dedup[h]
        if isinstance(found, bytes):
            self._dedup[h] = new
        else:
            found[found.index(e)] = new
        if self._journal is not None:
            self._journal[self._table + e[:KEY_BYTES]] = None
            self._journal[self._table + new[:KEY_BYTES]] = self._pending_row(new)
        return new

    # -- dequeue ------------------------------------------------------------------

    def _members(self, first: Entry, depth: int) -> Iterator[Entry]:
        """Pending entries sharing `first`'s first `depth` segments, most urgent first."""
        _, group, _, _, start = _parse(first)
        lst = self._lists[group]
        assert lst is not None
        dto_id = self._prefixes[group] + first[start:]
        segments = dto_id.count(b"/") + 1
        if depth > segments:
            depth = segments  # a depth past the id groups by the whole id
        if depth == self.depth:
            yield from lst
            return
        want = _prefix_b(dto_id, depth)
        if depth < self.depth:
            # the depth-K groups under `want`, merged in priority order
            under = want + b"/"
            lists: list[SortedList] = []
            for p in self._group_keys.irange(minimum=want):
                if p != want and not p.startswith(under):
                    if not p.startswith(want):
                        break
                    continue  # "t/ab" after "t/a": same characters, another segment
                member = self._lists[self._group_of[p]]
                assert member is not None
                lists.append(member)
            yield from heapq.merge(*lists)
            return
        under = want + b"/"
        head = self._prefixes[group]
        for e in lst:
            whole = head + e[_parse(e)[4] :]
            if whole == want or whole.startswith(under):
                yield e

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
        taken: list[Entry] = []
        group = iter(self._all) if depth < 0 else self._members(self._all[0], depth)
        for e in group:
            taken.append(e)
            if len(taken) >= max_records:
                break
        base = secrets.token_hex(8) if token_base is None else token_base
        records = []
        for e in taken:
            record = self._view(e)
            kind, g, _, _, start = _parse(e)
            self._unlink(e, g, _ident_hash(kind, g, e[start:]))
            record.token = f"{base}{self.seq_of(record):x}"
            self._hold(record, visible_at)
            records.append(record)
        return records

    def _hold(self, record: Record, visible_at: float) -> None:
        held = self._in_flight[record.token] = InFlight(record, visible_at)
        heapq.heappush(self._expiry, (visible_at, record.token))
        if self._journal is not None:
            self._journal[self._table + priority_key(record.priority)] = self._held_row(held)

    def _gone(self, record: Record) -> None:
        """An in-flight record's row is gone (acknowledged or merged)."""
        if self._journal is not None:
            self._journal[self._table + priority_key(record.priority)] = None

    # -- acknowledge and redelivery -------------------------------------------------

    def ack(self, tokens: list[str]) -> int:
        """Remove the notifications of these tokens; unknown ones are ignored."""
        done = 0
        for token in tokens:
            held = self._in_flight.pop(token, None)
            if held is not None:
                self._gone(held.record)
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
            if self._journal is not None:
                key = self._table + priority_key(held.record.priority)
                self._journal[key] = self._held_row(held)
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
        kind = self._kind(record.dto_type, record.alias, record.is_parent)
        raw = utf8(record.dto_id)
        p = _prefix_b(raw, self.depth)
        group = self._group_of.get(p)
        if group is not None:
            rest = raw[len(p) :]
            existing = self._find(_ident_hash(kind, group, rest), kind, group, rest)
            if existing is not None:  # a newer copy is pending: keep the more urgent SLA
                if record.sla_us < key_priority(existing) >> _LOW_BITS:
                    self._reprioritize(existing, record.sla_us, record.tracking_id)
                self._gone(record)
                return
        self._add(record.priority, kind, raw, p, utf8(record.tracking_id))

    def pending(self) -> Iterator[Record]:
        """Pending records in queue order."""
        return (self._view(e) for e in self._all)

    def in_flight_records(self) -> Iterator[tuple[Record, float]]:
        """In-flight records with the time each becomes visible again."""
        return ((h.record, h.visible_at) for h in self._in_flight.values())

    # -- snapshots ------------------------------------------------------------------

    def _row(self, e: Entry) -> ExportRow:
        kind, group, _, start, rest = _parse(e)
        dto_type, alias, is_parent = self._kinds[kind]
        priority = key_priority(e)
        return (
            dto_type,
            text(self._prefixes[group] + e[rest:]),
            is_parent,
            alias,
            priority >> _LOW_BITS,
            text(e[start:rest]),
            priority & _SEQ_MASK,
        )

    def export_state(self) -> dict[str, Any]:
        """Plain data: the records with their seq, pending in queue order, and
        the in-flight ones with their tokens, in queue order too (as rows read
        back, whatever order they were taken in)."""

        def row(r: Record) -> ExportRow:
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
            "pending": [self._row(e) for e in self._all],
            "in_flight": [
                (t, h.visible_at, *row(h.record))
                for t, h in sorted(self._in_flight.items(), key=_by_priority)
            ],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SlaQueue:
        q = cls(depth=state["depth"])
        q._seq = state["seq"]
        for dto_type, dto_id, is_parent, alias, sla_us, tracking_id, seq in state["pending"]:
            raw = utf8(dto_id)
            priority = priority_of(sla_us, raw.count(b"/") + 1, seq)
            p = _prefix_b(raw, q.depth)
            q._add(priority, q._kind(dto_type, alias, is_parent), raw, p, utf8(tracking_id))
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
        kind = self._kinds[self._kind(dto_type, alias, is_parent)]  # interned strings
        r = Record(kind[0], dto_id, is_parent, kind[1], sla_us, tracking_id)
        r.priority = priority_of(sla_us, dto_id.count("/") + 1, seq)
        return r

    # -- rows of the `cqs` table (the layout: state.py's docstring) -----------------

    def _pending_row(self, e: Entry) -> bytes:
        kind, group, count_at, _, rest = _parse(e)
        return b"".join(
            (
                self._kind_rows[kind],
                e[count_at:rest],  # the tracking id with its length
                b"\x00",  # no token
                self._prefixes[group],
                e[rest:],
            )
        )

    def _held_row(self, held: InFlight) -> bytes:
        r = held.record
        tracking, token = utf8(r.tracking_id), utf8(r.token)
        return b"".join(
            (
                self._kind_rows[self._kind(r.dto_type, r.alias, r.is_parent)],
                pack_n(len(tracking)),
                tracking,
                pack_n(len(token)),
                token,
                _whole_ms(held.visible_at).to_bytes(8, "big", signed=True),
                utf8(r.dto_id),
            )
        )

    def rows(self) -> Iterator[tuple[bytes, bytes]]:
        """Every row of this queue (key after the queue's part, value): pending
        in queue order, then in flight."""
        for e in self._all:
            yield e[:KEY_BYTES], self._pending_row(e)
        for held in self._in_flight.values():
            yield priority_key(held.record.priority), self._held_row(held)

    def row_keys(self) -> Iterator[bytes]:
        """The keys of `rows()`."""
        for e in self._all:
            yield e[:KEY_BYTES]
        for held in self._in_flight.values():
            yield priority_key(held.record.priority)

    def keep_rows(self, journal: RowJournal, table_id: int) -> None:
        """From now on, write every changed row of this queue into `journal`,
        under keys starting with `table_key(table_id)`."""
        self._owner = journal
        self._journal = journal.rows
        self._table = table_key(table_id)

    def journal_swapped(self) -> None:
        """The journal's dict was taken: write into its new one."""
        assert self._owner is not None
        self._journal = self._owner.rows

    def export_sections(self) -> dict[str, Any]:
        """`export_state` without the notifications (they are rows)."""
        return {"depth": self.depth, "seq": self._seq, "pending": [], "in_flight": []}

    def load_rows(self, rows: Iterable[tuple[bytes, bytes]]) -> None:
        """Add the notifications of this queue's rows (keys after the queue's
        part), as the queue wrote them, in key order (a restart's cursor walk);
        nothing is journaled. The sorted lists are built once at the end, from
        lists already in order."""
        pending: list[Entry] = []
        by_group: dict[int, list[Entry]] = {}
        top = 0
        try:
            for key, value in rows:
                if len(key) != KEY_BYTES:
                    raise DamagedRow(f"a cqs row key of {len(key)} bytes, not {KEY_BYTES}")
                seq = seq_of_key(key)
                if seq > top:
                    top = seq
                e, group = self._load_row(key, value)
                if e is not None:
                    pending.append(e)
                    members = by_group.get(group)
                    if members is None:
                        members = by_group[group] = []
                    members.append(e)
        except (IndexError, UnicodeDecodeError) as e:
            raise DamagedRow(f"a cqs row does not parse: {e!r}") from e
        # seq numbers go on after the rows' (the sections may not say: rows in etcd)
        self._seq = max(self._seq, top)
        self._all.update(pending)
        for group, members in by_group.items():
            lst = self._lists[group]
            assert lst is not None
            lst.update(members)

    def _load_row(self, key: bytes, value: bytes) -> tuple[Entry | None, int]:
        """One row: its entry and group if pending (for the caller to put in
        the sorted lists), else (None, 0) and the record is held."""
        n = value[1]
        if n < _ESCAPE and value[2 + n] < _ESCAPE:  # short type and alias
            at = 3 + n + value[2 + n]
        else:
            n, at = unpack_n(value, 1)
            n, at = unpack_n(value, at + n)
            at += n
        head = value[:at]
        kind = self._kind_by_row.get(head)
        if kind is None:
            if value[0] > 1:
                raise DamagedRow(f"a cqs row has flags {value[0]}")
            n, t_at = unpack_n(head, 1)
            dto_type = text(head[t_at : t_at + n])
            n, a_at = unpack_n(head, t_at + n)
            kind = self._kind(dto_type, text(head[a_at : a_at + n]), bool(head[0]))
            self._kind_by_row[head] = kind
        count_at = at
        n, start = unpack_n(value, at)
        end = start + n
        n, at = unpack_n(value, end)
        if at + n + (8 if n else 0) > len(value):
            raise DamagedRow("a cqs row is shorter than its lengths")
        if n:
            dto_type, alias, is_parent = self._kinds[kind]
            r = _new_record(Record)
            r.dto_type, r.alias, r.is_parent = dto_type, alias, is_parent
            r.token = text(value[at : at + n])
            at += n
            visible_at = int.from_bytes(value[at : at + 8], "big", signed=True)
            r.dto_id = text(value[at + 8 :])
            r.tracking_id = text(value[start:end])
            r.priority = key_priority(key)
            self._hold(r, visible_at)
            return None, 0
        raw = value[at:]
        p = _prefix_b(raw, self.depth)
        group = self._group_of.get(p)
        if group is None:
            group = self._group(p)
        rest = raw[len(p) :]
        e = b"".join(
            (
                key,
                _SMALL[kind] if kind < _ESCAPE else pack_n(kind),
                pack_n(group),
                value[count_at:end],
                rest,
            )
        )
        h = _ident_hash(kind, group, rest)
        found = self._dedup.get(h)
        if found is None:
            self._dedup[h] = e
        else:
            if self._find(h, kind, group, rest) is not None:
                raise DamagedRow(f"two pending rows of one notification ({text(raw)!r})")
            self._dedup[h] = [found, e] if isinstance(found, bytes) else [*found, e]
        return e, group
