"""Unit tests of the MVCC store: revisions, versions, tombstones, history, compaction.

The property tests at the end run random operation sequences against the store and
against a deliberately naive model (a dict of per-key change lists) and require
the two to agree on every read, at every revision that is still readable: once
with the whole store in memory, once with its values moving to a real LMDB
backend by checkpoints (taken in steps, some failing) and rebuilt from it.
"""

from __future__ import annotations

import tempfile

import lmdb
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from queue_server.errors import Compacted, FutureRevision
from queue_server.mvcc.store import ALL_KEYS_END, Event, KeyValue, MVCCStore
from queue_server.storage.backend import Backend, CommitBatch, encode_kv
from queue_server.storage.revisions import revision_key

pytestmark = pytest.mark.unit


def put(store: MVCCStore, key: bytes, value: bytes, lease: int = 0) -> int:
    with store.write() as txn:
        txn.put(key, value, lease)
    return store.revision


def delete(store: MVCCStore, key: bytes, end: bytes | None = None) -> int:
    with store.write() as txn:
        txn.delete_range(key, end)
    return store.revision


def test_fresh_store_is_at_revision_one() -> None:
    store = MVCCStore()
    assert store.revision == 1
    assert store.range(b"a", None).kvs == []


def test_put_sets_create_mod_and_version() -> None:
    store = MVCCStore()
    assert put(store, b"a", b"1") == 2
    assert put(store, b"a", b"2") == 3
    assert store.get(b"a") == KeyValue(b"a", 2, 3, 2, b"2", 0)


def test_delete_is_a_tombstone_and_put_after_it_starts_a_new_generation() -> None:
    store = MVCCStore()
    put(store, b"a", b"1")  # rev 2
    assert delete(store, b"a") == 3
    assert store.get(b"a") is None
    assert store.key_count == 0
    put(store, b"a", b"2")  # rev 4
    assert store.get(b"a") == KeyValue(b"a", 4, 4, 1, b"2", 0)
    # history is still readable
    assert store.range(b"a", None, revision=2).kvs == [KeyValue(b"a", 2, 2, 1, b"1", 0)]
    assert store.range(b"a", None, revision=3).kvs == []


def test_delete_of_missing_key_does_not_move_the_revision() -> None:
    store = MVCCStore()
    assert delete(store, b"nothing") == 1


def test_range_bounds_limit_and_count() -> None:
    store = MVCCStore()
    for k in (b"a", b"b", b"c", b"d"):
        put(store, k, k)
    r = store.range(b"b", b"d")
    assert [kv.key for kv in r.kvs] == [b"b", b"c"]
    r = store.range(b"b", ALL_KEYS_END)
    assert [kv.key for kv in r.kvs] == [b"b", b"c", b"d"]
    r = store.range(b"a", ALL_KEYS_END, limit=2)
    assert [kv.key for kv in r.kvs] == [b"a", b"b"] and r.count == 4
    r = store.range(b"a", ALL_KEYS_END, count_only=True)
    assert r.kvs == [] and r.count == 4
    assert store.range(b"d", b"b").kvs == []  # end before key: nothing


def test_a_count_of_every_key_now_is_the_key_count() -> None:
    """A count-only Range of every key at the current revision is answered from
    the live key count (it walked the index: 2 s at 1,000,000 keys); it must
    agree with the walk after puts, overwrites, deletes and an aborted write."""
    store = MVCCStore()
    for k in (b"a", b"b", b"c", b"d", b"b"):
        put(store, k, k)
    delete(store, b"c")
    w = store.write()
    w.put(b"e", b"e", 0)
    w.abort()
    walked = len(store.range(b"\x00", ALL_KEYS_END).kvs)
    for key in (b"", b"\x00"):
        assert store.range(key, ALL_KEYS_END, count_only=True).count == walked == 3
    older = store.revision - 1  # before the delete: the walk, at that revision
    assert store.range(b"\x00", ALL_KEYS_END, revision=older, count_only=True).count == 4


def test_keys_in_lists_what_range_finds_without_values() -> None:
    store = MVCCStore()
    for k in (b"a", b"b", b"c", b"d"):
        put(store, k, k)
    delete(store, b"c")
    for key, end in ((b"a", ALL_KEYS_END), (b"b", b"d"), (b"b", None), (b"c", None)):
        assert list(store.keys_in(key, end)) == [kv.key for kv in store.range(key, end).kvs]
    assert list(store.keys_in(b"a", ALL_KEYS_END)) == [b"a", b"b", b"d"]


def test_future_and_compacted_revisions_are_refused() -> None:
    store = MVCCStore()
    put(store, b"a", b"1")
    put(store, b"a", b"2")
    with pytest.raises(FutureRevision):
        store.range(b"a", None, revision=4)
    store.compact(3)
    with pytest.raises(Compacted):
        store.range(b"a", None, revision=2)
    assert store.range(b"a", None, revision=3).kvs[0].value == b"2"
    with pytest.raises(Compacted):
        store.compact(3)
    with pytest.raises(FutureRevision):
        store.compact(10)


def test_compaction_drops_tombstoned_keys_but_keeps_live_values() -> None:
    store = MVCCStore()
    put(store, b"a", b"1")  # 2
    put(store, b"b", b"1")  # 3
    delete(store, b"a")  # 4
    put(store, b"b", b"2")  # 5
    store.compact(5)
    assert b"a" not in store._index
    assert [code >> 33 for code in store._index[b"b"]] == [5]  # entry codes: position << 1
    assert store.range(b"a", ALL_KEYS_END).count == 1


def test_writes_in_one_txn_share_a_revision_and_reads_see_them() -> None:
    store = MVCCStore()
    with store.write() as txn:
        txn.put(b"a", b"1")
        txn.put(b"b", b"2")
        assert [kv.key for kv in txn.range(b"a", ALL_KEYS_END).kvs] == [b"a", b"b"]
        assert txn.range(b"a", ALL_KEYS_END).revision == 2
    assert store.revision == 2
    assert {kv.mod_revision for kv in store.range(b"a", ALL_KEYS_END).kvs} == {2}


def test_delete_then_put_of_one_key_in_one_txn_keeps_the_put() -> None:
    # etcd allows this shape (a delete with range_end "\0" and a put inside it)
    store = MVCCStore()
    put(store, b"a", b"old")
    with store.write() as txn:
        txn.delete_range(b"a", ALL_KEYS_END)
        txn.put(b"a", b"new")
    kv = store.get(b"a")
    assert kv == KeyValue(b"a", 3, 3, 1, b"new", 0)
    assert store.range(b"a", None, revision=3).kvs == [kv]


def test_commit_hook_sees_events_with_prev_kv() -> None:
    store = MVCCStore()
    seen: list[tuple[int, list[tuple[bool, bytes, bytes | None]]]] = []
    store.on_commit = lambda rev, events: seen.append(
        (rev, [(e.is_delete, e.kv.key, e.prev_kv.value if e.prev_kv else None) for e in events])
    )
    put(store, b"a", b"1")
    put(store, b"a", b"2")
    delete(store, b"a")
    delete(store, b"a")  # nothing deleted: no event, no revision
    assert seen == [
        (2, [(False, b"a", None)]),
        (3, [(False, b"a", b"1")]),
        (4, [(True, b"a", b"2")]),
    ]


def test_events_between_orders_by_revision_then_by_change() -> None:
    store = MVCCStore()
    put(store, b"b", b"1")  # 2
    with store.write() as txn:  # 3: b then a, in that order
        txn.put(b"b", b"2")
        txn.put(b"a", b"1")
    delete(store, b"a", b"c")  # 4: deletes a and b
    events = store.events_between(b"a", b"c", 1, 4)
    assert [(e.is_delete, e.kv.key, e.kv.mod_revision) for e in events] == [
        (False, b"b", 2),
        (False, b"b", 3),
        (False, b"a", 3),
        (True, b"a", 4),
        (True, b"b", 4),
    ]
    assert events[1].prev_kv is not None and events[1].prev_kv.value == b"1"
    assert store.events_between(b"a", b"c", 3, 3) == []


def test_export_and_restore_round_trip() -> None:
    store = MVCCStore()
    put(store, b"a", b"1", lease=7)
    put(store, b"b", b"1")
    delete(store, b"a")
    put(store, b"b", b"2")
    store.compact(3)
    copy = MVCCStore.from_state(store.export_state())
    assert copy.revision == store.revision and copy.compact_revision == 3
    assert copy.key_count == store.key_count
    for rev in (3, 4, 5):
        assert copy.range(b"", ALL_KEYS_END, revision=rev) == store.range(
            b"", ALL_KEYS_END, revision=rev
        )


# -- property test against a naive model ------------------------------------------

KEYS = [b"a", b"ab", b"b", b"ba", b"c"]


class Model:
    """Per key, every change ever made: (revision, value or None)."""

    def __init__(self) -> None:
        self.changes: dict[bytes, list[tuple[int, bytes | None]]] = {}
        self.revision = 1
        self.compacted = -1

    def value_at(self, key: bytes, rev: int) -> tuple[bytes, int, int, int] | None:
        """(value, create_revision, mod_revision, version) at rev, or None."""
        state = None
        for r, v in self.changes.get(key, []):
            if r > rev:
                break
            if v is None:
                state = None
            elif state is None:
                state = (v, r, r, 1)
            else:
                state = (v, state[1], r, state[3] + 1)
        return state

    def put(self, key: bytes, value: bytes) -> None:
        self.revision += 1
        self.changes.setdefault(key, []).append((self.revision, value))

    def lease_of(self, key: bytes, mod_revision: int) -> int:
        """The lease of the put at `mod_revision` (0 here; see LeasedModel)."""
        return 0

    def delete(self, key: bytes, end: bytes | None) -> None:
        keys = [k for k in self.changes if (k == key if end is None else key <= k < end)]
        live = [k for k in keys if self.value_at(k, self.revision) is not None]
        if not live:
            return
        self.revision += 1
        for k in live:
            self.changes[k].append((self.revision, None))


def agrees(store: MVCCStore, model: Model) -> None:
    """The store and the model agree at every readable revision, key by key
    and as a range, and on what exists now."""
    assert store.revision == model.revision
    for rev in range(max(model.compacted, 1), model.revision + 1):
        expected = []
        for key in KEYS:
            state = model.value_at(key, rev)
            if state is not None:
                lease = model.lease_of(key, state[2])
                expected.append(KeyValue(key, state[1], state[2], state[3], state[0], lease))
        got = store.range(b"\x00", ALL_KEYS_END, revision=rev)
        assert got.kvs == expected, f"at revision {rev}"
        assert got.count == len(expected)
    assert store.key_count == sum(model.value_at(k, model.revision) is not None for k in KEYS)
    if model.compacted > 1:
        with pytest.raises(Compacted):
            store.range(b"a", None, revision=model.compacted - 1)


ops = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS), st.binary(max_size=3)),
    st.tuples(st.just("del"), st.sampled_from(KEYS), st.none()),
    st.tuples(st.just("delrange"), st.sampled_from(KEYS), st.sampled_from(KEYS)),
    st.tuples(st.just("compact"), st.integers(min_value=0, max_value=40), st.none()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=40))
def test_store_agrees_with_model(operations: list[tuple[str, object, object]]) -> None:
    store, model = MVCCStore(), Model()
    committed: list[tuple[int, list[Event]]] = []
    store.on_commit = lambda rev, events: committed.append((rev, list(events)))
    for op, a, b in operations:
        if op == "put":
            assert isinstance(a, bytes) and isinstance(b, bytes)
            put(store, a, b)
            model.put(a, b)
        elif op == "del":
            assert isinstance(a, bytes)
            delete(store, a)
            model.delete(a, None)
        elif op == "delrange":
            assert isinstance(a, bytes) and isinstance(b, bytes)
            delete(store, a, b)
            model.delete(a, b)
        else:
            assert isinstance(a, int)
            if model.compacted < a <= model.revision:
                store.compact(a)
                model.compacted = a
            else:
                with pytest.raises((Compacted, FutureRevision)):
                    store.compact(a)
        agrees(store, model)
    # history replays exactly the events that were delivered live, in order
    for after in range(max(model.compacted, 1), model.revision + 1):
        live = [e for rev, evs in committed if rev > after for e in evs]
        replayed = store.events_between(b"\x00", ALL_KEYS_END, after, model.revision)
        assert [(e.is_delete, e.kv) for e in replayed] == [(e.is_delete, e.kv) for e in live]
        # prev_kv survives in history unless compaction removed it
        for got, want in zip(replayed, live, strict=True):
            assert got.prev_kv in (want.prev_kv, None)


# -- the same property on a real backend, with checkpoints --------------------------


class LeasedModel(Model):
    """The model, with the lease each put attached."""

    def __init__(self) -> None:
        super().__init__()
        self.leases: dict[tuple[bytes, int], int] = {}

    def put_leased(self, key: bytes, value: bytes, lease: int) -> None:
        self.put(key, value)
        self.leases[key, self.revision] = lease

    def lease_of(self, key: bytes, mod_revision: int) -> int:
        return self.leases.get((key, mod_revision), 0)

    def leased_now(self) -> dict[bytes, int]:
        found = {}
        for key in KEYS:
            state = self.value_at(key, self.revision)
            if state is not None and self.lease_of(key, state[2]):
                found[key] = self.lease_of(key, state[2])
        return found


class FullDiskBackend(Backend):
    """A real backend whose commit, when `full`, finds the disk full half-way
    through its write transaction, as LMDB reports it: nothing is written."""

    full = False

    def commit(self, batch: CommitBatch) -> None:
        if not self.full:
            return super().commit(batch)
        with self.env.begin(write=True) as txn:
            for code, kv in list(batch.writes.items())[:2]:
                txn.put(revision_key(code >> 1, bool(code & 1)), encode_kv(kv), db=self._key)
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")


class Checkpoints:
    """The local log's checkpoint, one step at a time: `take` (take_batch, on
    the loop), `write` (Backend.commit, the backend thread), `done`
    (renew_reader, then batch_committed, on the loop), or `fail` (the commit
    refused, then batch_failed)."""

    def __init__(self, store: MVCCStore, backend: FullDiskBackend) -> None:
        self.store = store
        self.backend = backend
        self.index = 0
        self.taken: tuple[dict[int, KeyValue], list[int]] | None = None
        self.written = False

    def step(self, step: str) -> None:
        if step == "whole":
            if self.taken is None:
                self.step("take")
                self.step("write")
                self.step("done")
        elif step == "take" and self.taken is None:
            self.index += 1
            self.taken = self.store.take_batch()
        elif step == "write" and self.taken is not None and not self.written:
            writes, dropped = self.taken
            self.backend.commit(CommitBatch(self.index, writes, dropped))
            self.written = True
        elif step == "done" and self.written:
            self.backend.renew_reader()
            self.store.batch_committed()
            self.taken, self.written = None, False
        elif step == "fail" and self.taken is not None and not self.written:
            writes, dropped = self.taken
            self.backend.full = True
            with pytest.raises(lmdb.DiskError):
                self.backend.commit(CommitBatch(self.index, writes, dropped))
            self.backend.full = False
            self.store.batch_failed(dropped)
            self.taken = None

    def finish(self) -> None:
        """Whatever is in flight committed, then one more checkpoint."""
        if self.taken is not None:
            self.step("write")
            self.step("done")
        self.step("whole")


checkpoint_steps = st.tuples(
    st.just("checkpoint"), st.sampled_from(["whole", "take", "write", "done", "fail"]), st.none()
)
few_keys = st.sampled_from(KEYS[:2])  # so that changes meet the same keys' earlier ones
backend_ops = st.one_of(
    ops,
    st.tuples(st.just("put"), few_keys, st.binary(max_size=2)),
    st.tuples(st.just("del"), few_keys, st.none()),
    st.tuples(st.just("lput"), st.sampled_from(KEYS), st.integers(min_value=1, max_value=3)),
    # a compaction a few revisions back (ops' own ones are mostly refused)
    st.tuples(st.just("recent"), st.integers(min_value=0, max_value=3), st.none()),
    checkpoint_steps,
    checkpoint_steps,
)


def cp(step: str) -> tuple[str, str, None]:
    return ("checkpoint", step, None)


@settings(max_examples=300, deadline=None)
@given(st.lists(backend_ops, max_size=50))
# a failed checkpoint carried deletes of committed revisions compaction dropped
@example(
    [
        ("put", b"a", b"1"),
        cp("whole"),
        ("put", b"a", b"2"),
        ("recent", 0, None),
        cp("take"),
        cp("fail"),
    ]
)
# compaction dropped revisions of the checkpoint in flight, which then failed
@example([("put", b"a", b"1"), cp("take"), ("put", b"a", b"2"), ("recent", 0, None), cp("fail")])
# ... which then committed, read before and after the reader saw it
@example(
    [
        ("put", b"a", b"1"),
        cp("take"),
        ("put", b"a", b"2"),
        ("recent", 0, None),
        cp("write"),
        cp("done"),
    ]
)
# a tombstone committed, then compacted away
@example([("put", b"a", b"1"), ("del", b"a", None), cp("whole"), ("recent", 0, None), cp("whole")])
def test_store_on_a_backend_agrees_with_model(operations: list[tuple[str, object, object]]) -> None:
    """As test_store_agrees_with_model, with the values moving to a real LMDB
    backend by checkpoints taken in steps, reads in between every step, and
    checkpoints that fail on a full disk; then a store rebuilt from the
    backend's one scan (a restart) agrees too."""
    with tempfile.TemporaryDirectory() as directory:
        backend = FullDiskBackend(directory, fsync=False)
        try:
            store, model = MVCCStore(backend), LeasedModel()
            checkpoints = Checkpoints(store, backend)
            for op, a, b in operations:
                if op == "put":
                    assert isinstance(a, bytes) and isinstance(b, bytes)
                    put(store, a, b)
                    model.put(a, b)
                elif op == "lput":
                    assert isinstance(a, bytes) and isinstance(b, int)
                    put(store, a, b"leased", lease=b)
                    model.put_leased(a, b"leased", b)
                elif op == "del":
                    assert isinstance(a, bytes)
                    delete(store, a)
                    model.delete(a, None)
                elif op == "delrange":
                    assert isinstance(a, bytes) and isinstance(b, bytes)
                    delete(store, a, b)
                    model.delete(a, b)
                elif op in ("compact", "recent"):
                    assert isinstance(a, int)
                    if op == "recent":
                        a = model.revision - a
                    if model.compacted < a <= model.revision:
                        store.compact(a)
                        model.compacted = a
                    else:
                        with pytest.raises((Compacted, FutureRevision)):
                            store.compact(a)
                else:
                    assert isinstance(a, str)
                    checkpoints.step(a)
                agrees(store, model)
            checkpoints.finish()
            agrees(store, model)
            assert store.pending_bytes == 0
            # a restart: the sections give the revisions, the backend's scan the rest
            again = MVCCStore.from_state((store.revision, store.compact_revision, []), backend)
            again.load_revisions(backend.scan_keys())
            agrees(again, model)
            assert again.key_count == store.key_count
            assert again.export_state() == store.export_state()
            low = max(model.compacted, 1)
            for rev in range(low, model.revision + 1):
                assert again.hash_kv(rev) == store.hash_kv(rev)
            assert again.events_between(b"\x00", ALL_KEYS_END, low, model.revision) == (
                store.events_between(b"\x00", ALL_KEYS_END, low, model.revision)
            )
            assert dict(again.leased_keys()) == model.leased_now()
            # nothing compaction dropped is left in the file
            kept = {code for _, codes in store._index.items() for code in codes}
            assert {pos << 1 | tomb for pos, tomb, _, _ in backend.scan_keys()} == kept
        finally:
            backend.close()
