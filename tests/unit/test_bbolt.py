"""The bbolt file format (queue_server/storage/bbolt.py): what the writer builds
the reader reads back exactly, through inline buckets, branch pages and
overflow pages; the layout is bbolt's (page headers, metas, checksums); damage
is refused as BoltFormatError. Real etcd files are read in
tests/compat/test_etcd_snapshot.py."""

from __future__ import annotations

import hashlib
import io
import struct
from pathlib import Path

import pytest

from queue_server.apply import StateMachine
from queue_server.restore import restore
from queue_server.storage import bbolt, etcd_backend
from queue_server.storage.bbolt import BoltFormatError, BoltReader, BoltWriter
from queue_server.storage.revisions import position, revision_key
from queue_server.storage.snapshot import CorruptSnapshotError, SnapshotStore
from tests.support.states import rich_machine

pytestmark = pytest.mark.unit

PAGE = bbolt.DEFAULT_PAGE_SIZE


def build(buckets: dict[bytes, list[tuple[bytes, bytes]]]) -> bytes:
    out = io.BytesIO()
    writer = BoltWriter(out)
    for name, items in buckets.items():
        writer.bucket(name, items)
    size = writer.finish()
    data = out.getvalue()
    assert len(data) == size and size % PAGE == 0
    return data


def page_header(data: bytes | bytearray, pgid: int) -> tuple[int, int, int, int]:
    return struct.unpack_from("<QHHI", data, pgid * PAGE)


def test_fnv64a_matches_go() -> None:
    # hash/fnv New64a test vectors
    assert bbolt.fnv64a(b"") == 0xCBF29CE484222325
    assert bbolt.fnv64a(b"a") == 0xAF63DC4C8601EC8C
    assert bbolt.fnv64a(b"foobar") == 0x85944171F73967E8


def test_small_buckets_round_trip_inline() -> None:
    data = build({b"meta": [(b"a", b"1"), (b"b", b"2")], b"empty": [], b"key": [(b"k", b"v")]})
    reader = BoltReader(data)
    assert reader.buckets() == [b"empty", b"key", b"meta"]
    assert list(reader.items(b"meta")) == [(b"a", b"1"), (b"b", b"2")]
    assert list(reader.items(b"empty")) == []
    assert reader.get(b"key", b"k") == b"v"
    assert list(reader.items(b"missing")) == []
    # meta pages, an empty freelist, the root bucket's page: small buckets are inline
    assert data[:PAGE].count(b"\xed\xda\x0c\xed") == 1
    assert page_header(data, 0)[1] == bbolt.META_PAGE
    assert page_header(data, 1)[1] == bbolt.META_PAGE
    assert page_header(data, 2)[1:] == (bbolt.FREELIST_PAGE, 0, 0)
    assert reader.freelist() == []
    assert reader.meta.high_water == 4 and reader.meta.root == 3
    assert reader.meta.txid == 3  # meta 1 is the newer


def test_many_keys_make_branch_pages() -> None:
    items = [(f"key{i:06d}".encode(), f"value-{i}".encode() * 3) for i in range(20_000)]
    data = build({b"key": items, b"other": [(b"x", b"y")]})
    reader = BoltReader(data)
    assert list(reader.items(b"key")) == items
    assert list(reader.items(b"other")) == [(b"x", b"y")]
    flags = {page_header(data, p)[1] for p in range(3, reader.meta.high_water)}
    assert flags == {bbolt.LEAF_PAGE, bbolt.BRANCH_PAGE}


def test_large_values_use_overflow_pages() -> None:
    items = [(b"a", b"x" * 10_000), (b"b", b"small"), (b"c", bytes(range(256)) * 100)]
    data = build({b"key": items})
    reader = BoltReader(data)
    assert list(reader.items(b"key")) == items
    overflows = [page_header(data, p)[3] for p in range(3, reader.meta.high_water)]
    assert max(overflows) >= 2


def test_writer_refuses_unsorted_or_repeated() -> None:
    writer = BoltWriter(io.BytesIO())
    with pytest.raises(ValueError, match="out of order"):
        writer.bucket(b"key", [(b"b", b""), (b"a", b"")])
    with pytest.raises(ValueError, match="out of order"):
        writer.bucket(b"key2", [(b"a", b""), (b"a", b"")])
    writer.bucket(b"k", [])
    with pytest.raises(ValueError, match="repeated"):
        writer.bucket(b"k", [])


def test_damaged_meta_falls_back_then_is_refused() -> None:
    data = bytearray(build({b"key": [(b"a", b"1")]}))
    # damage meta 1 (the newer): the reader uses meta 0, as bbolt does
    data[PAGE + 16 + 40] ^= 0xFF
    reader = BoltReader(bytes(data))
    assert reader.meta.txid == 2
    assert list(reader.items(b"key")) == [(b"a", b"1")]
    # damage meta 0 too: nothing valid is left
    data[16 + 40] ^= 0xFF
    with pytest.raises(BoltFormatError, match="checksum"):
        BoltReader(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[:100],  # truncated inside the first page
        lambda d: d[: 3 * PAGE],  # fewer pages than the high-water mark
        lambda d: (b"QSNAP2\n" * len(d))[: len(d)],  # not a bbolt file
    ],
)
def test_refuses_what_is_not_a_database(damage: object) -> None:
    data = build({b"key": [(b"a", b"1")]})
    assert callable(damage)
    with pytest.raises(BoltFormatError):
        BoltReader(damage(data))


def test_out_of_bounds_pgid_is_refused() -> None:
    items = [(f"{i:05d}".encode(), b"v" * 100) for i in range(200)]
    data = bytearray(build({b"key": items}))
    reader = BoltReader(bytes(data))
    # point the first branch element of the bucket's root at a page past the end
    root = next(p for p in range(3, reader.meta.high_water) if page_header(data, p)[1] == 1)
    struct.pack_into("<Q", data, root * PAGE + 16 + 8, 10_000)
    with pytest.raises(BoltFormatError, match="out of bounds"):
        list(BoltReader(bytes(data)).items(b"key"))


# -- our state as an etcd backend database (storage/etcd_backend.py) -----------------


def test_a_real_state_round_trips_through_an_etcd_database(tmp_path: Path) -> None:
    """Keys with tombstones and compaction in etcd's buckets, the rest (queues,
    CQS, leases, members, alarms, auth) in ours: `queue-server restore` of
    what Maintenance.Snapshot streams gives back the same state."""
    sm = rich_machine()
    state = sm.export_state()
    out = io.BytesIO()
    size = etcd_backend.write_etcd_db(out, sm.applied_index, state)
    data = out.getvalue()
    assert len(data) == size
    got = etcd_backend.read_etcd_db(data, "test")
    assert got.index == sm.applied_index
    assert got.state == state
    again = StateMachine()
    again.restore_state(got.state)
    assert again.export_state() == state
    assert again.queues.queues[b"jobs"].pending

    # etcd's view: its buckets as etcd 3.4 lays them out
    reader = BoltReader(data)
    assert set(reader.buckets()) >= {b"key", b"meta", b"lease", b"auth", b"cluster"}
    _, compact, keys = state["mvcc"]
    rev_keys = [k for k, _ in reader.items(b"key")]
    assert rev_keys == sorted(rev_keys) and len(rev_keys) == sum(len(p) for _, p, _ in keys)
    assert reader.get(b"meta", b"finishedCompactRev") == revision_key(position(compact, 0), False)
    assert reader.get(b"meta", b"consistent_index") == struct.pack(">Q", sm.applied_index)

    # through `queue-server restore`, with etcd's sha256 after the db
    source = tmp_path / "snapshot.db"
    source.write_bytes(data + hashlib.sha256(data).digest())
    assert restore(str(source), str(tmp_path / "data")) == sm.applied_index
    loaded = SnapshotStore(str(tmp_path / "data" / "snap")).load_latest()
    assert loaded is not None and loaded.state == state
    damaged = bytearray(source.read_bytes())
    damaged[5000] ^= 1
    source.write_bytes(bytes(damaged))
    with pytest.raises(CorruptSnapshotError, match="sha256"):
        restore(str(source), str(tmp_path / "data2"))


def test_etcd_only_database_builds_the_state_from_etcds_buckets() -> None:
    """Without our bucket (a real etcd's file): keys, revisions, tombstones,
    the compaction point, leases and auth come from etcd's buckets."""
    sm = rich_machine()
    state = sm.export_state()
    out = io.BytesIO()
    etcd_backend.write_etcd_db(out, sm.applied_index, state)
    reader = BoltReader(out.getvalue())
    bare = io.BytesIO()
    writer = BoltWriter(bare)
    for name in reader.buckets():
        if name != etcd_backend.OUR_BUCKET:
            writer.bucket(name, reader.items(name))
    writer.finish()
    got = etcd_backend.read_etcd_db(bare.getvalue(), "etcd")
    assert got.index == sm.applied_index
    assert got.state["mvcc"][1:] == state["mvcc"][1:]
    assert sorted(got.state["leases"]) == sorted(state["leases"])
    auth = got.state["auth"]
    assert auth["enabled"] == state["auth"]["enabled"]
    assert {u[0] for u in auth["users"]} == {u[0] for u in state["auth"]["users"]}
    assert auth["roles"] == {k: [tuple(p) for p in v] for k, v in state["auth"]["roles"].items()}
    machine = StateMachine()
    machine.restore_state(got.state)
    assert machine.store.hash_kv() == sm.store.hash_kv()


def test_lease_messages_match_leasepb() -> None:
    raw = etcd_backend.encode_lease(0x516EA234C0A8CF08, 600)
    # what etcd 3.4.23 wrote for this lease (read from a real snapshot)
    assert raw == b"\x08\x88\x9e\xa3\x85\xcc\xc6\xa8\xb7Q\x10\xd8\x04"
    assert etcd_backend.decode_lease(raw) == (0x516EA234C0A8CF08, 600)
    assert etcd_backend.decode_lease(raw + b"\x18\x05") == (0x516EA234C0A8CF08, 600)
