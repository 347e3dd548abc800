"""The multi-version key space: revisions, per-key history, tombstones, compaction.

What belongs here: the data structure that answers "what did key range [key, end)
hold at revision R" and that records every change with the revision it was made at.
It does no I/O, reads no clock, and imports neither grpc nor protobuf: callers hand
it bytes and ints and get back `KeyValue` records.

Theory of operation
-------------------
The store's revision starts at 1 and rises by one for each write transaction that
changes something (a put, or a delete that removed at least one key), as etcd's
does. A key's history is the list of its changes in the order they were made, each
with the revision it was made at; a change is either a `KeyValue` (a put) or a
tombstone (a delete, stored as None). etcd refuses most Txns that change one key
twice, but not all (a delete with range_end "\\0" and a put of a key inside it),
so two changes may share a revision; the later one is what reads see.

Worked example, key "a":

    rev 2  put a=1   -> history [(2, kv(create=2, mod=2, version=1))]
    rev 3  put a=2   -> history [..., (3, kv(create=2, mod=3, version=2))]
    rev 4  del a     -> history [..., (4, None)]
    rev 5  put a=3   -> history [..., (5, kv(create=5, mod=5, version=1))]

A read at revision R finds the last change made at or before R: a tombstone or no
change means the key did not exist then. A put after a tombstone starts a new
generation: create_revision is the put's revision and version restarts at 1.

Compaction at revision C forgets what no read at C or later can see: for each key,
every change made before the last change at or before C. That last change is kept
if it is a put (reads at C see it) and dropped if it is a tombstone; a key left
with no history leaves the index. Reads below C fail with `Compacted`.
"""

from __future__ import annotations

import zlib
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sortedcontainers import SortedDict

from queue_server.errors import Compacted, FutureRevision


@dataclass(slots=True)
class KeyValue:
    """One version of a key, as etcd's mvccpb.KeyValue describes it. Never
    changed once made (not frozen only because a frozen dataclass costs six
    times as much to create, and the store makes one per write)."""

    key: bytes
    create_revision: int
    mod_revision: int
    version: int
    value: bytes
    lease: int


SUB_BITS = 32
"""A history entry's position is `revision << SUB_BITS | sub`: `sub` numbers the
changes inside one write transaction (etcd's sub-revision), so a delete of many
keys in one revision still orders its events as they were made."""
_SUB_MASK = (1 << SUB_BITS) - 1


def position(revision: int, sub: int = _SUB_MASK) -> int:
    """The history position of change `sub` of `revision` (default: its last)."""
    return (revision << SUB_BITS) | sub


RECORD_OVERHEAD_BYTES = 64
"""What one history entry costs besides its value, in the store's size estimate."""


@dataclass(slots=True)
class KeyHistory:
    """Every change of one key not yet compacted away, oldest first.

    Invariant: `positions` is strictly ascending (see `position`) and has one entry
    per entry of `changes`; a change is a `KeyValue` or None for a tombstone.
    """

    positions: list[int] = field(default_factory=list)
    changes: list[KeyValue | None] = field(default_factory=list)

    def at(self, revision: int) -> KeyValue | None:
        """The key's value as of `revision`, or None if it did not exist then."""
        bound = position(revision)
        if self.positions[-1] <= bound:
            return self.changes[-1]
        i = bisect_right(self.positions, bound)
        return self.changes[i - 1] if i else None

    def compact(self, revision: int) -> int:
        """Drop the changes no read at `revision` or later can see; returns the
        bytes of values dropped (for the size estimate)."""
        i = bisect_right(self.positions, position(revision))
        if i == 0:
            return 0
        keep_from = i - 1 if self.changes[i - 1] is not None else i
        if not keep_from:
            return 0
        dropped = sum(len(kv.value) for kv in self.changes[:keep_from] if kv is not None)
        dropped += keep_from * RECORD_OVERHEAD_BYTES
        del self.positions[:keep_from]
        del self.changes[:keep_from]
        return dropped

    def events_between(self, key: bytes, after: int, upto: int) -> list[tuple[int, Event]]:
        """(position, event) for each change made at a revision in (after, upto]."""
        start = bisect_right(self.positions, position(after))
        out: list[tuple[int, Event]] = []
        positions, changes = self.positions, self.changes
        for i in range(start, len(positions)):
            pos = positions[i]
            revision = pos >> SUB_BITS
            if revision > upto:
                break
            prev = changes[i - 1] if i else None
            kv = changes[i]
            if kv is None:
                out.append((pos, Event(True, KeyValue(key, 0, revision, 0, b"", 0), prev)))
            else:
                out.append((pos, Event(False, kv, prev)))
        return out


@dataclass(slots=True)
class Event:
    """One change made by a write transaction, for watchers: a put or a delete.

    For a delete, `kv` is the tombstone as watchers see it (key and the delete's
    mod_revision, everything else zero); `prev_kv` is what the key held before.
    """

    is_delete: bool
    kv: KeyValue
    prev_kv: KeyValue | None


@dataclass(slots=True)
class RangeResult:
    """What a range read found: the keys (in key order), how many keys the range
    holds in all, and the store's revision when read."""

    kvs: list[KeyValue]
    count: int
    revision: int


ALL_KEYS_END = b""
"""`end` for "every key from `key` on": etcd's "\\0" range_end after translation."""


class MVCCStore:
    """The key space with its history; the only owner of revisions.

    Writes go through `write()`, which returns a `WriteTxn`; every change made in one
    `WriteTxn` carries the same revision, and the store's revision moves once, when
    the transaction ends, if anything changed.
    """

    def __init__(self) -> None:
        self._index: SortedDict = SortedDict()  # bytes -> KeyHistory
        # Called with (revision, events) after each write transaction that changed
        # something; the watch hub subscribes here.
        self.on_commit: Callable[[int, list[Event]], None] | None = None
        self.revision = 1
        # etcd's compactMainRev: -1 until the first compaction, so that
        # Compact(0) succeeds once on a fresh store, as in etcd.
        self.compact_revision = -1
        self._key_count = 0  # keys whose latest change is a put
        # Estimated bytes held: values and keys of every change kept, plus a fixed
        # cost per change. The quota (--quota-backend-bytes) is checked against it.
        self.size_bytes = 0

    # -- reads ----------------------------------------------------------------

    @property
    def key_count(self) -> int:
        """How many keys exist now (tombstoned keys not counted)."""
        return self._key_count

    def _histories(self, key: bytes, end: bytes | None) -> Iterator[tuple[bytes, KeyHistory]]:
        """The histories of keys in [key, end); `end` None means just `key`,
        `ALL_KEYS_END` means no upper bound."""
        if end is None:
            history = self._index.get(key)
            if history is not None:
                yield key, history
            return
        if end != ALL_KEYS_END and end <= key:
            return
        upper = None if end == ALL_KEYS_END else end
        index = self._index
        for k in index.irange(key, upper, inclusive=(True, False)):
            yield k, index[k]

    def check_revision(self, revision: int) -> int:
        """The revision a read at `revision` (0 or less: now) sees, or the error."""
        if revision > self.revision:
            raise FutureRevision()
        if revision <= 0:
            return self.revision
        if revision < self.compact_revision:
            raise Compacted()
        return revision

    def range(
        self,
        key: bytes,
        end: bytes | None,
        revision: int = 0,
        limit: int = 0,
        count_only: bool = False,
    ) -> RangeResult:
        """Keys in [key, end) as of `revision`; at most `limit` of them (0: all).

        `count` always counts every key of the range, whatever the limit.
        """
        rev = self.check_revision(revision)
        kvs: list[KeyValue] = []
        count = 0
        current = rev == self.revision
        for _, history in self._histories(key, end):
            kv = history.changes[-1] if current else history.at(rev)
            if kv is None:
                continue
            count += 1
            if not count_only and (limit <= 0 or len(kvs) < limit):
                kvs.append(kv)
        return RangeResult(kvs, count, self.revision)

    def events_between(self, key: bytes, end: bytes | None, after: int, upto: int) -> list[Event]:
        """Every change to keys in [key, end) made at a revision in (after, upto],
        in the order they were made: what a watcher that missed them must receive.
        `after` must not be below the compaction revision."""
        found: list[tuple[int, Event]] = []
        for k, history in self._histories(key, end):
            if history.positions[-1] > position(after):
                found.extend(history.events_between(k, after, upto))
        found.sort(key=lambda pe: pe[0])
        return [e for _, e in found]

    def get(self, key: bytes) -> KeyValue | None:
        """The key's current value, or None."""
        history = self._index.get(key)
        return history.changes[-1] if history is not None else None

    # -- writes ---------------------------------------------------------------

    def write(self) -> WriteTxn:
        """Begin a write transaction at the next revision."""
        return WriteTxn(self)

    def _put(self, key: bytes, value: bytes, lease: int, revision: int, sub: int) -> Event:
        history = self._index.get(key)
        if history is None:
            history = KeyHistory()
            self._index[key] = history
            self.size_bytes += len(key)
        self.size_bytes += len(value) + RECORD_OVERHEAD_BYTES
        prev = history.changes[-1] if history.changes else None
        if prev is None:
            kv = KeyValue(key, revision, revision, 1, value, lease)
            self._key_count += 1
        else:
            kv = KeyValue(key, prev.create_revision, revision, prev.version + 1, value, lease)
        history.positions.append(position(revision, sub))
        history.changes.append(kv)
        return Event(False, kv, prev)

    def _delete(self, key: bytes, end: bytes | None, revision: int, sub: int) -> list[Event]:
        events: list[Event] = []
        for k, history in self._histories(key, end):
            prev = history.changes[-1]
            if prev is None:
                continue
            history.positions.append(position(revision, sub + len(events)))
            history.changes.append(None)
            self._key_count -= 1
            self.size_bytes += RECORD_OVERHEAD_BYTES
            events.append(Event(True, KeyValue(k, 0, revision, 0, b"", 0), prev))
        return events

    def _undo(self, events: list[Event]) -> None:
        """Take back the history entries `events` appended (an aborted write)."""
        for e in reversed(events):
            key = e.kv.key
            history = self._index[key]
            history.positions.pop()
            change = history.changes.pop()
            self.size_bytes -= RECORD_OVERHEAD_BYTES
            if change is not None:
                self.size_bytes -= len(change.value)
                if e.prev_kv is None:
                    self._key_count -= 1
            else:
                self._key_count += 1
            if not history.changes:
                del self._index[key]
                self.size_bytes -= len(key)

    # -- compaction -----------------------------------------------------------

    def compact(self, revision: int) -> None:
        """Forget history before `revision`; reads below it fail from now on."""
        if revision <= self.compact_revision:
            raise Compacted()
        if revision > self.revision:
            raise FutureRevision()
        self.compact_revision = revision
        emptied: list[bytes] = []
        for key, history in self._index.items():
            self.size_bytes -= history.compact(revision)
            if not history.changes:
                emptied.append(key)
        for key in emptied:
            del self._index[key]
            self.size_bytes -= len(key)

    def hash_kv(self, revision: int = 0) -> int:
        """A checksum of every change kept at or below `revision` (0: now), for
        comparing replicas (HashKV). Equal histories give equal hashes."""
        bound = position(self.check_revision(revision))
        h = zlib.crc32(b"key")  # like etcd, which starts with its bucket name: never 0
        for key, history in self._index.items():
            for pos, kv in zip(history.positions, history.changes, strict=True):
                if pos > bound:
                    break
                h = zlib.crc32(key, h)
                h = zlib.crc32(pos.to_bytes(12, "big"), h)
                h = zlib.crc32(b"\x00" if kv is None else b"\x01" + kv.value, h)
        return h

    # -- snapshots ------------------------------------------------------------

    def export_state(
        self,
    ) -> tuple[
        int, int, list[tuple[bytes, list[int], list[tuple[int, int, int, bytes, int] | None]]]
    ]:
        """Everything the store holds as plain tuples (for a snapshot)."""
        keys = []
        for key, history in self._index.items():
            changes = [
                None
                if kv is None
                else (kv.create_revision, kv.mod_revision, kv.version, kv.value, kv.lease)
                for kv in history.changes
            ]
            keys.append((key, list(history.positions), changes))
        return self.revision, self.compact_revision, keys

    @classmethod
    def from_state(
        cls,
        state: tuple[
            int, int, list[tuple[bytes, list[int], list[tuple[int, int, int, bytes, int] | None]]]
        ],
    ) -> MVCCStore:
        """The inverse of `export_state`."""
        store = cls()
        store.revision, store.compact_revision, keys = state
        items = []
        for key, positions, changes in keys:
            history = KeyHistory(
                positions,
                [
                    None if c is None else KeyValue(key, c[0], c[1], c[2], c[3], c[4])
                    for c in changes
                ],
            )
            if history.changes[-1] is not None:
                store._key_count += 1
            store.size_bytes += len(key) + sum(
                RECORD_OVERHEAD_BYTES + (len(kv.value) if kv is not None else 0)
                for kv in history.changes
            )
            items.append((key, history))
        store._index = SortedDict(items)
        return store


class WriteTxn:
    """Changes made at one revision. Reads through it see its own changes.

    Use as a context manager, or call `end()`: the store's revision moves to this
    transaction's revision only if it changed something. A context that ends
    with an exception rolls the changes back (`abort()`) instead: readers never
    saw them, since they read at the store's revision.
    """

    __slots__ = ("events", "revision", "store")

    def __init__(self, store: MVCCStore) -> None:
        self.store = store
        self.revision = store.revision + 1
        self.events: list[Event] = []

    @property
    def read_revision(self) -> int:
        """The revision reads inside this transaction see (its own changes included)."""
        return self.revision if self.events else self.store.revision

    def range(
        self,
        key: bytes,
        end: bytes | None,
        revision: int = 0,
        limit: int = 0,
        count_only: bool = False,
    ) -> RangeResult:
        store = self.store
        if not self.events:
            return store.range(key, end, revision, limit, count_only)
        # Our changes are already in the histories at self.revision, one past the
        # store's revision: read with the store's revision temporarily advanced.
        saved = store.revision
        store.revision = self.revision
        try:
            return store.range(key, end, revision, limit, count_only)
        finally:
            store.revision = saved

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Event:
        event = self.store._put(key, value, lease, self.revision, len(self.events))
        self.events.append(event)
        return event

    def delete_range(self, key: bytes, end: bytes | None) -> list[Event]:
        events = self.store._delete(key, end, self.revision, len(self.events))
        self.events.extend(events)
        return events

    def end(self) -> int:
        """Finish; returns the store's revision afterwards."""
        store = self.store
        if self.events:
            store.revision = self.revision
            if store.on_commit is not None:
                store.on_commit(self.revision, self.events)
        return store.revision

    def abort(self) -> None:
        """Undo every change of this transaction (newest first)."""
        self.store._undo(self.events)
        self.events = []

    def __enter__(self) -> WriteTxn:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abort()
            return
        self.end()
