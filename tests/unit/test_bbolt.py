"""The bbolt file format (queue_server/storage/bbolt.py): what the writer builds
the reader reads back exactly, through inline buckets, branch pages and
overflow pages; the layout is bbolt's (page headers, metas, checksums); damage
is refused as BoltFormatError. Real etcd files are read in
tests/compat/test_etcd_snapshot.py."""

from __future__ import annotations

import io
import struct

import pytest

from queue_server.storage import bbolt
from queue_server.storage.bbolt import BoltFormatError, BoltReader, BoltWriter

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


def page_header(data: bytes, pgid: int) -> tuple[int, int, int, int]:
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
