"""The bbolt file format (go.etcd.io/bbolt, as etcd 3.4 and 3.5 vendor it): a
writer of fresh, compact databases and a reader of what bbolt writes.

This module owns the bytes of a bbolt file and nothing of what etcd keeps in it
(`storage/etcd_backend.py` does). It does no I/O of its own beyond the file
object or buffer it is handed, and imports nothing of the server.

Theory of operation. A bbolt file is an array of pages of `page_size` bytes
(etcd uses the OS page size, 4096 here). Every page starts with a 16-byte
header, little endian as bbolt writes on every platform etcd supports:

    id u64 | flags u16 | count u16 | overflow u32

`overflow` is how many further pages the page spans (a node larger than a page
is written into contiguous pages). Page 0 and 1 are the two meta pages; a
reader uses the valid one with the higher txid. A meta is

    magic u32 0xED0CDAED | version u32 2 | page_size u32 | flags u32 |
    root bucket (root pgid u64, sequence u64) | freelist pgid u64 |
    high-water pgid u64 (pages in use) | txid u64 | checksum u64

and the checksum is fnv-64a over the 56 bytes before it. A branch page holds
`count` elements `pos u32 | ksize u32 | pgid u64` (the first key of each child);
a leaf page holds `count` elements `flags u32 | pos u32 | ksize u32 | vsize u32`,
`pos` counting from the element itself to its key, the value following the key.
A leaf element with flag 1 is a bucket: its value is the bucket header (root
pgid, sequence) and, when root is 0, the bucket's whole leaf page inline right
after it (bbolt inlines a bucket whose page fits in a quarter page). The meta's
root bucket lists the top-level buckets by name. The freelist page lists free
pgids (count 0xFFFF means the true count is the first u64).

Writing. `BoltWriter` builds a fresh database in one pass: page 2 is an empty
freelist, then each bucket's leaf pages in key order as its items arrive, then
its branch pages bottom up, then the root bucket's page, and last the two meta
pages (the file is seeked back to 0, so it must be seekable). Pages are packed
full (bbolt's compaction does the same with FillPercent 1.0); every page is
reachable and none is free, which `bbolt check` and `etcdctl snapshot status`
verify. Memory: one page of items, plus one (first key, pgid) per page of the
level above, so about 1/100 of the keys of a bucket of small items.

Reading. `BoltReader` reads a buffer (bytes or an mmap) holding a whole file: it
checks both metas (magic, version, checksum), walks branch pages, overflow pages
and inline buckets, and bounds-checks every page and element it reads, raising
`BoltFormatError` on anything out of place; it never trusts a length to
allocate. Nested buckets are read as bucket values (etcd uses none).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "BoltFormatError",
    "BoltReader",
    "BoltWriter",
    "fnv64a",
]

MAGIC = 0xED0CDAED
VERSION = 2
DEFAULT_PAGE_SIZE = 4096
"""What etcd writes on this platform: bbolt's DefaultPageSize is os.Getpagesize(),
4096 on Linux amd64 and arm64 (4 KiB pages)."""

NO_FREELIST = 0xFFFFFFFFFFFFFFFF
"""The meta's freelist pgid when the freelist is not written (bbolt's PgidNoFreelist)."""

BRANCH_PAGE = 0x01
LEAF_PAGE = 0x02
META_PAGE = 0x04
FREELIST_PAGE = 0x10
BUCKET_LEAF_FLAG = 0x01

_PAGE = struct.Struct("<QHHI")  # id, flags, count, overflow
_BRANCH_ELEMENT = struct.Struct("<IIQ")  # pos, ksize, pgid
_LEAF_ELEMENT = struct.Struct("<IIII")  # flags, pos, ksize, vsize
_BUCKET = struct.Struct("<QQ")  # root pgid, sequence
_META = struct.Struct("<IIIIQQQQQQ")
_META_CHECKSUM_AT = _META.size - 8
PAGE_HEADER_BYTES = _PAGE.size
ELEMENT_BYTES = _LEAF_ELEMENT.size  # the same for branch elements
BUCKET_HEADER_BYTES = _BUCKET.size

MAX_ELEMENTS_PER_PAGE = 0xFFFF
"""The page header's count is a u16 (bbolt's freelist uses 0xFFFF as an escape)."""

MAX_DEPTH = 64
"""Deeper trees than this are refused: a B+tree of 4 KiB pages is a handful of
levels for any file that fits a disk, so more is a cycle in a damaged file."""

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1


class BoltFormatError(ValueError):
    """The bytes are not a bbolt database this reader accepts (damaged,
    truncated, another format or version)."""


def fnv64a(data: bytes) -> int:
    """The 64-bit FNV-1a hash (Go's hash/fnv New64a), the meta's checksum."""
    h = _FNV_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _U64
    return h


@dataclass(frozen=True, slots=True)
class Meta:
    """One meta page's fields."""

    page_size: int
    flags: int
    root: int
    sequence: int
    freelist: int
    high_water: int
    txid: int

    def pack(self) -> bytes:
        head = _META.pack(
            MAGIC,
            VERSION,
            self.page_size,
            self.flags,
            self.root,
            self.sequence,
            self.freelist,
            self.high_water,
            self.txid,
            0,
        )[:_META_CHECKSUM_AT]
        return head + struct.pack("<Q", fnv64a(head))

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Meta:
        """The meta in `raw` (at least 64 bytes), checked as bbolt's Validate does."""
        magic, version, page_size, flags, root, seq, freelist, high, txid, checksum = (
            _META.unpack_from(raw)
        )
        if magic != MAGIC:
            raise BoltFormatError("invalid database (bad magic)")
        if version != VERSION:
            raise BoltFormatError(f"version mismatch ({version}, not {VERSION})")
        if checksum != fnv64a(bytes(raw[:_META_CHECKSUM_AT])):
            raise BoltFormatError("meta page checksum error")
        if page_size < 512 or page_size & (page_size - 1):
            raise BoltFormatError(f"page size {page_size} is not a power of two >= 512")
        return cls(page_size, flags, root, seq, freelist, high, txid)


# -- writing ---------------------------------------------------------------------------


def _leaf_bytes(items: list[tuple[int, bytes, bytes]], page_id: int) -> bytes:
    """A leaf page (unpadded) of (flags, key, value) elements."""
    out = bytearray(_PAGE.pack(page_id, LEAF_PAGE, len(items), 0))
    data_at = ELEMENT_BYTES * len(items)  # from the first element to the first key
    for i, (flags, key, value) in enumerate(items):
        pos = data_at - ELEMENT_BYTES * i
        out += _LEAF_ELEMENT.pack(flags, pos, len(key), len(value))
        data_at += len(key) + len(value)
    for _, key, value in items:
        out += key
        out += value
    return bytes(out)


def _branch_bytes(children: list[tuple[bytes, int]], page_id: int) -> bytes:
    out = bytearray(_PAGE.pack(page_id, BRANCH_PAGE, len(children), 0))
    data_at = ELEMENT_BYTES * len(children)
    for i, (key, pgid) in enumerate(children):
        out += _BRANCH_ELEMENT.pack(data_at - ELEMENT_BYTES * i, len(key), pgid)
        data_at += len(key)
    for key, _ in children:
        out += key
    return bytes(out)


class BoltWriter:
    """Builds a fresh bbolt database into a seekable, empty file object.

    Call `bucket(name, items)` once per top-level bucket (any order), each with
    its items in strictly ascending key order, then `finish()`.
    """

    FREELIST_PGID = 2
    FIRST_DATA_PGID = 3

    def __init__(self, fileobj: IO[bytes], page_size: int = DEFAULT_PAGE_SIZE) -> None:
        self._file = fileobj
        self.page_size = page_size
        self._next_pgid = self.FIRST_DATA_PGID
        self._buckets: dict[bytes, bytes] = {}  # name -> the bucket's value in the root
        self._finished = False

    def _write_page(self, raw: bytes) -> int:
        """Put one page (spanning overflow pages if long) at the next pgid."""
        pgid = self._next_pgid
        pages = -(-len(raw) // self.page_size)
        _, flags, count, _ = _PAGE.unpack_from(raw)  # the id and overflow are set here
        self._file.seek(pgid * self.page_size)
        self._file.write(_PAGE.pack(pgid, flags, count, pages - 1))
        self._file.write(raw[PAGE_HEADER_BYTES:])
        self._file.write(bytes(pages * self.page_size - len(raw)))
        self._next_pgid += pages
        return pgid

    def _fits(self, size: int, count: int) -> bool:
        return size <= self.page_size and count < MAX_ELEMENTS_PER_PAGE

    def _tree(self, items: Iterable[tuple[int, bytes, bytes]]) -> tuple[int, bytes | None]:
        """Write a B+tree of `items` (ascending keys); returns its root pgid, or
        (0, the inline page) when it fits inline as bbolt would keep it."""
        children: list[tuple[bytes, int]] = []
        page: list[tuple[int, bytes, bytes]] = []
        size = PAGE_HEADER_BYTES
        last: bytes | None = None
        for flags, key, value in items:
            if last is not None and key <= last:
                raise ValueError(f"keys out of order: {key!r} after {last!r}")
            if not key:
                raise ValueError("an empty key")
            last = key
            grow = ELEMENT_BYTES + len(key) + len(value)
            if page and not self._fits(size + grow, len(page) + 1):
                children.append((page[0][1], self._write_page(_leaf_bytes(page, 0))))
                page, size = [], PAGE_HEADER_BYTES
            page.append((flags, key, value))
            size += grow
        if not children:
            inline = _leaf_bytes(page, 0)
            if len(inline) <= self.page_size // 4 and not any(
                f & BUCKET_LEAF_FLAG for f, _, _ in page
            ):
                return 0, inline
            return self._write_page(inline), None
        children.append((page[0][1], self._write_page(_leaf_bytes(page, 0))))
        while len(children) > 1:
            level: list[tuple[bytes, int]] = []
            branch: list[tuple[bytes, int]] = []
            size = PAGE_HEADER_BYTES
            for key, pgid in children:
                grow = ELEMENT_BYTES + len(key)
                if branch and not self._fits(size + grow, len(branch) + 1):
                    level.append((branch[0][0], self._write_page(_branch_bytes(branch, 0))))
                    branch, size = [], PAGE_HEADER_BYTES
                branch.append((key, pgid))
                size += grow
            level.append((branch[0][0], self._write_page(_branch_bytes(branch, 0))))
            children = level
        return children[0][1], None

    def bucket(self, name: bytes, items: Iterable[tuple[bytes, bytes]], sequence: int = 0) -> None:
        """Write a top-level bucket holding `items` (strictly ascending keys)."""
        if self._finished:
            raise RuntimeError("the database is finished")
        if not name or name in self._buckets:
            raise ValueError(f"bucket name {name!r} is empty or repeated")
        root, inline = self._tree((0, k, v) for k, v in items)
        self._buckets[name] = _BUCKET.pack(root, sequence) + (inline or b"")

    def finish(self, txid: int = 2) -> int:
        """Write the root bucket, the freelist and both metas; returns the
        file's size. `txid` is the meta's transaction id (meta page 1 gets
        txid + 1, so a reader picks it; both describe the same tree)."""
        self._finished = True
        entries = [(BUCKET_LEAF_FLAG, n, v) for n, v in sorted(self._buckets.items())]
        root, inline = self._tree(entries)
        if inline is not None:  # the root bucket is always a page of its own
            root = self._write_page(inline)
        self._file.seek(self.FREELIST_PGID * self.page_size)
        self._file.write(_PAGE.pack(self.FREELIST_PGID, FREELIST_PAGE, 0, 0))
        self._file.write(bytes(self.page_size - PAGE_HEADER_BYTES))
        high_water = self._next_pgid
        for pgid in (0, 1):
            meta = Meta(self.page_size, 0, root, 0, self.FREELIST_PGID, high_water, txid + pgid)
            raw = _PAGE.pack(pgid, META_PAGE, 0, 0) + meta.pack()
            self._file.seek(pgid * self.page_size)
            self._file.write(raw + bytes(self.page_size - len(raw)))
        self._file.seek(high_water * self.page_size)
        return high_water * self.page_size


# -- reading ---------------------------------------------------------------------------


class BoltReader:
    """A bbolt database in a buffer holding the whole file (bytes or an mmap)."""

    def __init__(self, data: bytes | memoryview) -> None:
        self._data = memoryview(data).cast("B")
        self.meta = self._choose_meta()
        self.page_size = self.meta.page_size
        if self.meta.high_water * self.page_size > len(self._data):
            raise BoltFormatError(
                f"file size too small: {len(self._data)} bytes for "
                f"{self.meta.high_water} pages of {self.page_size}"
            )

    def _choose_meta(self) -> Meta:
        """The valid meta with the higher txid (bbolt's db.meta())."""
        data = self._data
        if len(data) < PAGE_HEADER_BYTES + _META.size:
            raise BoltFormatError(f"file size too small: {len(data)} bytes")
        found: list[Meta] = []
        errors: list[str] = []
        try:
            found.append(Meta.unpack(data[PAGE_HEADER_BYTES:]))
            sizes = [found[0].page_size]
        except BoltFormatError as e:
            errors.append(f"meta 0: {e}")
            sizes = [DEFAULT_PAGE_SIZE, 8192, 16384, 65536]
        for size in sizes:
            at = size + PAGE_HEADER_BYTES
            if len(data) < at + _META.size:
                continue
            try:
                meta = Meta.unpack(data[at:])
            except BoltFormatError as e:
                errors.append(f"meta 1: {e}")
                continue
            if meta.page_size == size:
                found.append(meta)
                break
        if not found:
            raise BoltFormatError("; ".join(errors) or "no valid meta page")
        return max(found, key=lambda m: m.txid)

    def _page(self, pgid: int) -> tuple[memoryview, int, int]:
        """The bytes of page `pgid` (with its overflow), its flags and count."""
        if not 2 <= pgid < self.meta.high_water:
            raise BoltFormatError(f"page {pgid} out of bounds (high water {self.meta.high_water})")
        at = pgid * self.page_size
        page_id, flags, count, overflow = _PAGE.unpack_from(self._data, at)
        end = at + (overflow + 1) * self.page_size
        if page_id != pgid or pgid + overflow >= self.meta.high_water:
            raise BoltFormatError(f"page {pgid} says id {page_id}, overflow {overflow}")
        return self._data[at:end], flags, count

    def freelist(self) -> list[int]:
        """The free pgids the freelist page lists (none when the file keeps no
        freelist: etcd opens bbolt with NoFreelistSync, and bbolt then rebuilds
        the list by scanning when it opens the file)."""
        if self.meta.freelist == NO_FREELIST:
            return []
        page, flags, count = self._page(self.meta.freelist)
        if flags != FREELIST_PAGE:
            raise BoltFormatError(f"page {self.meta.freelist} is not a freelist ({flags:#x})")
        start = PAGE_HEADER_BYTES
        if count == 0xFFFF:
            (count,) = struct.unpack_from("<Q", page, start)
            start += 8
        if start + 8 * count > len(page):
            raise BoltFormatError("freelist runs past its page")
        return list(struct.unpack_from(f"<{count}Q", page, start))

    def _elements(
        self, page: memoryview, flags: int, count: int, depth: int
    ) -> Iterator[tuple[int, bytes, bytes]]:
        """The (flags, key, value) leaf elements under a page, in key order."""
        if depth > MAX_DEPTH:
            raise BoltFormatError("the tree is deeper than any real one (a cycle?)")
        if PAGE_HEADER_BYTES + count * ELEMENT_BYTES > len(page):
            raise BoltFormatError(f"{count} elements run past their page")
        if flags == BRANCH_PAGE:
            for i in range(count):
                at = PAGE_HEADER_BYTES + i * ELEMENT_BYTES
                _, _, pgid = _BRANCH_ELEMENT.unpack_from(page, at)
                yield from self._elements(*self._page(pgid), depth + 1)
        elif flags == LEAF_PAGE:
            for i in range(count):
                at = PAGE_HEADER_BYTES + i * ELEMENT_BYTES
                elem_flags, pos, ksize, vsize = _LEAF_ELEMENT.unpack_from(page, at)
                start = at + pos
                if start + ksize + vsize > len(page):
                    raise BoltFormatError("a leaf element runs past its page")
                yield (
                    elem_flags,
                    bytes(page[start : start + ksize]),
                    bytes(page[start + ksize : start + ksize + vsize]),
                )
        else:
            raise BoltFormatError(f"a page of type {flags:#x} inside a tree")

    def _bucket_items(self, value: bytes, depth: int) -> Iterator[tuple[int, bytes, bytes]]:
        if len(value) < BUCKET_HEADER_BYTES:
            raise BoltFormatError("a bucket value shorter than a bucket header")
        root, _ = _BUCKET.unpack_from(value)
        if root:
            yield from self._elements(*self._page(root), depth + 1)
            return
        inline = memoryview(value)[BUCKET_HEADER_BYTES:]
        if len(inline) < PAGE_HEADER_BYTES:
            raise BoltFormatError("an inline bucket without its page")
        _, flags, count, _ = _PAGE.unpack_from(inline)
        if flags != LEAF_PAGE:
            raise BoltFormatError(f"an inline bucket page of type {flags:#x}")
        yield from self._elements(inline, flags, count, depth + 1)

    def _root(self) -> Iterator[tuple[int, bytes, bytes]]:
        return self._elements(*self._page(self.meta.root), 0)

    def buckets(self) -> list[bytes]:
        """The top-level buckets' names, in order."""
        return [name for flags, name, _ in self._root() if flags & BUCKET_LEAF_FLAG]

    def items(self, bucket: bytes) -> Iterator[tuple[bytes, bytes]]:
        """The (key, value) pairs of a top-level bucket in key order (a nested
        bucket's value is its bucket header); nothing if there is no such bucket."""
        for flags, name, value in self._root():
            if name == bucket and flags & BUCKET_LEAF_FLAG:
                for _, key, item in self._bucket_items(value, 0):
                    yield key, item
                return

    def get(self, bucket: bytes, key: bytes) -> bytes | None:
        """One value (a linear scan: the buckets read this way are small)."""
        for k, v in self.items(bucket):
            if k == key:
                return v
        return None
