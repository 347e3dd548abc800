"""Unit tests of the MVCC store: revisions, versions, tombstones, history, compaction.

The property test at the end runs random operation sequences against the store and
against a deliberately naive model (a dict of per-key change lists) and requires
the two to agree on every read, at every revision that is still readable.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_server.errors import Compacted, FutureRevision
from queue_server.mvcc.store import ALL_KEYS_END, Event, KeyValue, MVCCStore

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

    def delete(self, key: bytes, end: bytes | None) -> None:
        keys = [k for k in self.changes if (k == key if end is None else key <= k < end)]
        live = [k for k in keys if self.value_at(k, self.revision) is not None]
        if not live:
            return
        self.revision += 1
        for k in live:
            self.changes[k].append((self.revision, None))


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
        assert store.revision == model.revision
        # every readable revision agrees, key by key and as a range
        for rev in range(max(model.compacted, 1), model.revision + 1):
            expected = []
            for key in KEYS:
                state = model.value_at(key, rev)
                if state is not None:
                    expected.append(KeyValue(key, state[1], state[2], state[3], state[0], 0))
            got = store.range(b"\x00", ALL_KEYS_END, revision=rev)
            assert got.kvs == expected, f"at revision {rev}"
            assert got.count == len(expected)
        assert store.key_count == sum(model.value_at(k, model.revision) is not None for k in KEYS)
        if model.compacted > 1:
            with pytest.raises(Compacted):
                store.range(b"a", None, revision=model.compacted - 1)
    # history replays exactly the events that were delivered live, in order
    for after in range(max(model.compacted, 1), model.revision + 1):
        live = [e for rev, evs in committed if rev > after for e in evs]
        replayed = store.events_between(b"\x00", ALL_KEYS_END, after, model.revision)
        assert [(e.is_delete, e.kv) for e in replayed] == [(e.is_delete, e.kv) for e in live]
        # prev_kv survives in history unless compaction removed it
        for got, want in zip(replayed, live, strict=True):
            assert got.prev_kv in (want.prev_kv, None)
