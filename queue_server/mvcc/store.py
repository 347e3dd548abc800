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

Where the values live (etcd's treeIndex and backend)
----------------------------------------------------
The index in memory holds, per key, only the positions of its changes (as
`entry codes`, `position << 1 | tombstone`), as etcd's treeIndex holds only
revisions. A change's `KeyValue` is in one of three places: `_pending` (made
since the last checkpoint), `_committing` (handed to a checkpoint being
written), or the committed revisions behind `CommittedRevisions` (the LMDB
backend, `storage/backend.py`, read through the loop's read transaction).
`take_batch` moves `_pending` to `_committing` and returns it for the
checkpoint; `batch_committed` drops `_committing` once the backend holds it
and its reader sees it. A store with no committed revisions (unit tests, a
cluster member) keeps every value in `_pending`: the whole store in memory.
"""

from __future__ import annotations

import zlib
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from sortedcontainers import SortedDict

from queue_server.errors import Compacted, FutureRevision
from queue_server.storage.revisions import (
    SUB_BITS,
    KeyValueFields,
    hash_change,
    position,
)


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


RECORD_OVERHEAD_BYTES = 64
"""What one history entry costs besides its value, in the store's size estimate."""


def _tomb(code: int) -> bool:
    return bool(code & 1)


class CommittedRevisions(Protocol):
    """The key revisions a checkpoint made durable (storage.backend.Backend).
    `get_kv` answers, on the event loop, the put at a position that is
    committed; `in_use_bytes` is what the file's pages hold."""

    def get_kv(self, position: int) -> KeyValueFields: ...

    @property
    def in_use_bytes(self) -> int: ...


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


History = tuple[int] | list[int]
"""One key's entry codes in the index, ascending: a tuple while the key has one
revision (most keys of a large keyspace), a list from its second. A tuple of
ints is untracked by Python's cyclic collector after its first young
collection, a list never is: with a million one-revision keys as lists every
full collection walked them all (150 ms at 1,000,000 keys, growing with the
data, and the slowest request with it); as tuples it does not."""


def _at(codes: History, revision: int) -> int | None:
    """The entry code of the last change at or before `revision`, or None."""
    bound = position(revision) << 1 | 1
    if codes[-1] <= bound:
        return codes[-1]
    i = bisect_right(codes, bound)
    return codes[i - 1] if i else None


class MVCCStore:
    """The key space with its history; the only owner of revisions.

    Writes go through `write()`, which returns a `WriteTxn`; every change made in one
    `WriteTxn` carries the same revision, and the store's revision moves once, when
    the transaction ends, if anything changed.

    Invariant: every key of `_index` has a non-empty, strictly ascending list of
    entry codes, and every code's KeyValue is in `_pending`, `_committing` or
    `committed` (tombstones too, so a checkpoint can write them).
    """

    def __init__(self, committed: CommittedRevisions | None = None) -> None:
        self._index: SortedDict = SortedDict()  # bytes -> History (entry codes)
        self._pending: dict[int, KeyValue] = {}
        self._committing: dict[int, KeyValue] = {}
        self._dropped: list[int] = []  # committed codes compaction removed
        self.committed = committed
        # Called with (revision, events) after each write transaction that changed
        # something; the state machine subscribes here.
        self.on_commit: Callable[[int, list[Event]], None] | None = None
        self.revision = 1
        # etcd's compactMainRev: -1 until the first compaction, so that
        # Compact(0) succeeds once on a fresh store, as in etcd.
        self.compact_revision = -1
        self._key_count = 0  # keys whose latest change is a put
        # Estimated bytes of what is not in committed pages: keys, values and a
        # fixed cost per change (all of it when nothing is committed).
        self._pending_bytes = 0
        self._scanned_leases: dict[bytes, int] | None = None
        # Built from an exported state: the backend's revisions are not this
        # store's, and the next checkpoint replaces them all.
        self.replaces_committed = False

    # -- reads ----------------------------------------------------------------

    @property
    def key_count(self) -> int:
        """How many keys exist now (tombstoned keys not counted)."""
        return self._key_count

    @property
    def size_bytes(self) -> int:
        """What the quota (--quota-backend-bytes) is checked against: the
        backend's pages in use plus an estimate of what is not yet checkpointed."""
        committed = self.committed.in_use_bytes if self.committed is not None else 0
        return committed + self._pending_bytes

    @property
    def history_key_count(self) -> int:
        """Keys with any history kept (a snapshot's key count)."""
        return len(self._index)

    @property
    def pending_bytes(self) -> int:
        """Estimated bytes of key revisions not yet handed to a checkpoint."""
        return self._pending_bytes

    def _load(self, code: int) -> KeyValue:
        """The KeyValue of the put with entry `code`."""
        kv = self._pending.get(code)
        if kv is not None:
            return kv
        kv = self._committing.get(code)
        if kv is not None:
            return kv
        assert self.committed is not None, f"no value for entry {code:#x}"
        f = self.committed.get_kv(code >> 1)
        return KeyValue(f.key, f.create_revision, f.mod_revision, f.version, f.value, f.lease)

    def _histories(self, key: bytes, end: bytes | None) -> Iterator[tuple[bytes, History]]:
        """The entry codes of keys in [key, end); `end` None means just `key`,
        `ALL_KEYS_END` means no upper bound."""
        if end is None:
            codes = self._index.get(key)
            if codes is not None:
                yield key, codes
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
        current = rev == self.revision
        if count_only and current and end == ALL_KEYS_END and key <= b"\x00":
            # every key, now: counted already (keys are never empty)
            return RangeResult([], self._key_count, self.revision)
        kvs: list[KeyValue] = []
        count = 0
        load = self._load
        for _, codes in self._histories(key, end):
            code = codes[-1] if current else _at(codes, rev)
            if code is None or code & 1:
                continue
            count += 1
            if not count_only and (limit <= 0 or len(kvs) < limit):
                kvs.append(load(code))
        return RangeResult(kvs, count, self.revision)

    def events_between(self, key: bytes, end: bytes | None, after: int, upto: int) -> list[Event]:
        """Every change to keys in [key, end) made at a revision in (after, upto],
        in the order they were made: what a watcher that missed them must receive.
        `after` must not be below the compaction revision."""
        found: list[tuple[int, Event]] = []
        after_code = position(after) << 1 | 1
        load = self._load
        for k, codes in self._histories(key, end):
            if codes[-1] <= after_code:
                continue
            start = bisect_right(codes, after_code)
            for i in range(start, len(codes)):
                code = codes[i]
                revision = code >> (SUB_BITS + 1)
                if revision > upto:
                    break
                prev_code = codes[i - 1] if i else None
                prev = load(prev_code) if prev_code is not None and not prev_code & 1 else None
                if code & 1:
                    event = Event(True, KeyValue(k, 0, revision, 0, b"", 0), prev)
                else:
                    event = Event(False, load(code), prev)
                found.append((code, event))
        found.sort(key=lambda ce: ce[0])
        return [e for _, e in found]

    def get(self, key: bytes) -> KeyValue | None:
        """The key's current value, or None."""
        codes = self._index.get(key)
        if codes is None or codes[-1] & 1:
            return None
        return self._load(codes[-1])

    def keys_in(self, key: bytes, end: bytes | None) -> Iterator[bytes]:
        """The keys that exist now in [key, end) (as `range`'s bounds), in key
        order, from the index alone: no value is loaded."""
        for k, codes in self._histories(key, end):
            if not codes[-1] & 1:
                yield k

    # -- writes ---------------------------------------------------------------

    def write(self) -> WriteTxn:
        """Begin a write transaction at the next revision."""
        return WriteTxn(self)

    def _put(self, key: bytes, value: bytes, lease: int, revision: int, sub: int) -> Event:
        codes = self._index.get(key)
        code = position(revision, sub) << 1
        if codes is None or codes[-1] & 1:  # no key, or a tombstone: a new generation
            prev = None
            kv = KeyValue(key, revision, revision, 1, value, lease)
            self._key_count += 1
        else:
            prev = self._load(codes[-1])
            kv = KeyValue(key, prev.create_revision, revision, prev.version + 1, value, lease)
        if codes is None:
            self._index[key] = (code,)  # see `History`
        elif isinstance(codes, tuple):
            self._index[key] = [codes[0], code]
        else:
            codes.append(code)
        self._pending[code] = kv
        self._pending_bytes += len(key) + len(value) + RECORD_OVERHEAD_BYTES
        return Event(False, kv, prev)

    def _delete(self, key: bytes, end: bytes | None, revision: int, sub: int) -> list[Event]:
        events: list[Event] = []
        grown: list[tuple[bytes, list[int]]] = []
        histories: Iterable[tuple[bytes, History]]
        if end is None:  # one key (every ack): no generator to walk the index
            codes = self._index.get(key)
            histories = () if codes is None else ((key, codes),)
        else:
            histories = self._histories(key, end)
        for k, codes in histories:
            last = codes[-1]
            if last & 1:
                continue
            prev = self._load(last)
            code = position(revision, sub + len(events)) << 1 | 1
            if isinstance(codes, tuple):  # not while iterating the index: after
                grown.append((k, [codes[0], code]))
            else:
                codes.append(code)
            tombstone = KeyValue(k, 0, revision, 0, b"", 0)
            self._pending[code] = tombstone
            self._key_count -= 1
            self._pending_bytes += len(k) + RECORD_OVERHEAD_BYTES
            events.append(Event(True, tombstone, prev))
        for k, codes in grown:
            self._index[k] = codes
        return events

    def _undo(self, events: list[Event]) -> None:
        """Take back the history entries `events` appended (an aborted write)."""
        for e in reversed(events):
            key = e.kv.key
            codes = self._index[key]
            if isinstance(codes, tuple):
                code, codes = codes[0], []
            else:
                code = codes.pop()
            kv = self._pending.pop(code)
            self._pending_bytes -= len(key) + len(kv.value) + RECORD_OVERHEAD_BYTES
            if not code & 1:
                if e.prev_kv is None:
                    self._key_count -= 1
            else:
                self._key_count += 1
            if not codes:
                del self._index[key]

    # -- compaction -----------------------------------------------------------

    def compact(self, revision: int) -> None:
        """Forget history before `revision`; reads below it fail from now on."""
        if revision <= self.compact_revision:
            raise Compacted()
        if revision > self.revision:
            raise FutureRevision()
        self.compact_revision = revision
        bound = position(revision) << 1 | 1
        emptied: list[bytes] = []
        shrunk: list[tuple[bytes, History]] = []
        for key, codes in self._index.items():
            if codes[0] > bound:
                continue
            i = bisect_right(codes, bound)
            keep_from = i if codes[i - 1] & 1 else i - 1
            if not keep_from:
                continue
            for code in codes[:keep_from]:
                self._drop(key, code)
            if keep_from == len(codes):
                emptied.append(key)
            elif len(codes) - keep_from == 1:
                shrunk.append((key, (codes[-1],)))
            else:
                del codes[:keep_from]
        for key in emptied:
            del self._index[key]
        for key, one in shrunk:
            self._index[key] = one

    def _drop(self, key: bytes, code: int) -> None:
        kv = self._pending.pop(code, None)
        if kv is not None:
            self._pending_bytes -= len(key) + len(kv.value) + RECORD_OVERHEAD_BYTES
        else:  # committed, or being committed: the next checkpoint deletes it
            self._dropped.append(code)

    def hash_kv(self, revision: int = 0) -> int:
        """A checksum of every change kept at or below `revision` (0: now), for
        comparing replicas (HashKV): over the changes in revision order, as
        `storage.backend` computes it from the file. Equal histories give equal
        hashes."""
        bound = position(self.check_revision(revision)) << 1 | 1
        changes = [
            (code, key) for key, codes in self._index.items() for code in codes if code <= bound
        ]
        changes.sort()
        h = zlib.crc32(b"key")  # like etcd, which starts with its bucket name: never 0
        for code, key in changes:
            h = hash_change(h, key, code, None if code & 1 else self._load(code).value)
        return h

    # -- checkpoints ----------------------------------------------------------

    def take_batch(self) -> tuple[dict[int, KeyValue], list[int]]:
        """What a checkpoint must write: the changes made since the last one
        (entry code -> KeyValue, tombstones too) and the committed codes
        compaction dropped. They stay readable here until `batch_committed`."""
        assert not self._committing, "a checkpoint is already being written"
        batch, dropped = self._pending, self._dropped
        self._committing, self._pending, self._dropped = batch, {}, []
        self.replaces_committed = False
        self._pending_bytes = 0
        return batch, dropped

    def batch_committed(self) -> None:
        """The backend holds the batch `take_batch` gave and its reader sees it."""
        self._committing = {}

    def batch_failed(self, dropped: list[int]) -> None:
        """The checkpoint was not written (a full disk): its changes and drops
        (`dropped`, as `take_batch` gave them) go back to pending, ahead of what
        was made since; what compaction dropped meanwhile is not written at all."""
        batch, self._committing = self._committing, {}
        since = []
        for code in self._dropped:
            if batch.pop(code, None) is None:
                since.append(code)
        batch.update(self._pending)
        self._pending = batch
        self._dropped = dropped + since
        self._pending_bytes = sum(
            len(kv.key) + len(kv.value) + RECORD_OVERHEAD_BYTES for kv in batch.values()
        )

    def load_revisions(self, revisions: Iterator[tuple[int, bool, bytes, int]]) -> None:
        """Rebuild the index from the committed revisions in revision order
        (position, tombstone, key, lease): a restart's one scan of the backend.
        The leases of the current keys are kept for `leased_keys`."""
        index: dict[bytes, History] = {}
        leased: dict[bytes, int] = {}
        for pos, tombstone, key, lease in revisions:
            codes = index.get(key)
            if codes is None:
                index[key] = (pos << 1 | tombstone,)  # see `History`
            elif isinstance(codes, tuple):
                index[key] = [codes[0], pos << 1 | tombstone]
            else:
                codes.append(pos << 1 | tombstone)
            if lease and not tombstone:
                leased[key] = lease
            elif key in leased:
                del leased[key]
        self._index = SortedDict(index)
        self._key_count = sum(1 for codes in index.values() if not codes[-1] & 1)
        self._scanned_leases = leased
        self.replaces_committed = False  # these are the backend's own revisions

    def leased_keys(self) -> Iterator[tuple[bytes, int]]:
        """(key, lease) of every current key attached to a lease (the lease
        table's rebuild), from the restart's scan when there was one."""
        scanned, self._scanned_leases = self._scanned_leases, None
        if scanned is not None:
            yield from scanned.items()
            return
        for kv in self.range(b"\x00", ALL_KEYS_END).kvs:
            if kv.lease:
                yield kv.key, kv.lease

    # -- snapshots ------------------------------------------------------------

    def export_state(
        self,
    ) -> tuple[
        int, int, list[tuple[bytes, list[int], list[tuple[int, int, int, bytes, int] | None]]]
    ]:
        """Everything the store holds as plain tuples (for a snapshot)."""
        keys = []
        load = self._load
        for key, codes in self._index.items():
            changes: list[tuple[int, int, int, bytes, int] | None] = []
            for code in codes:
                if code & 1:
                    changes.append(None)
                else:
                    kv = load(code)
                    changes.append(
                        (kv.create_revision, kv.mod_revision, kv.version, kv.value, kv.lease)
                    )
            keys.append((key, [code >> 1 for code in codes], changes))
        return self.revision, self.compact_revision, keys

    @classmethod
    def from_state(
        cls,
        state: tuple[
            int, int, list[tuple[bytes, list[int], list[tuple[int, int, int, bytes, int] | None]]]
        ],
        committed: CommittedRevisions | None = None,
    ) -> MVCCStore:
        """The inverse of `export_state`: every change pending (the caller
        checkpoints it into the backend)."""
        store = cls(committed)
        store.revision, store.compact_revision, keys = state
        items = []
        pending = store._pending
        size = 0
        for key, positions, changes in keys:
            codes = []
            for pos, c in zip(positions, changes, strict=True):
                if c is None:
                    code = pos << 1 | 1
                    pending[code] = KeyValue(key, 0, pos >> SUB_BITS, 0, b"", 0)
                    size += len(key) + RECORD_OVERHEAD_BYTES
                else:
                    code = pos << 1
                    pending[code] = KeyValue(key, c[0], c[1], c[2], c[3], c[4])
                    size += len(key) + len(c[3]) + RECORD_OVERHEAD_BYTES
                codes.append(code)
            if not codes[-1] & 1:
                store._key_count += 1
            items.append((key, (codes[0],) if len(codes) == 1 else codes))
        store._pending_bytes = size
        store._index = SortedDict(items)
        store.replaces_committed = True
        # Revision order, as a checkpoint writes and the backend reads back.
        store._pending = dict(sorted(pending.items()))
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
