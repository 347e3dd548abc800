"""Snapshot files: the format on disk and on the wire, the `snap/` directory,
and the etcdctl transfer wrapping.

This module owns the snapshot file's framing and checksum and the directory
that keeps them; `snapshot_codec.py` owns what the records say (the state
machine's exported state, field by field, in `etcdserverpb/snapshot.proto`).

A snapshot file `snap/<applied index, 20 digits>.snap` (and what a Raft leader
sends a follower behind its log) is

    magic "QSNAP2\\n"
    records: u32 little-endian length | that many bytes of one `Record`
    trailer: u32 0 | u32 crc32 of every byte before it (little endian)

The records are a header (format version, applied index, raft term and voters,
how many of each item follow), then the sections in a fixed order (see
snapshot.proto). Nothing in the file is code: decoding builds plain data and
checks it, and everything it refuses it refuses as `CorruptSnapshotError`.

The checksum is zlib's crc32, as the WAL's: it is in the standard library, runs
at memory speed, and its job is accidental damage (a torn or flipped file);
whether a peer may send a snapshot at all is the transport's business, and a
hostile one gains nothing from a valid checksum, since decoding is data only
and strict. The trailer has a fixed size, so a reader checks the checksum over
the whole file first and only then parses: damage is reported as damage, never
as whatever the parser tripped on first.

Writing and reading go record by record over a file object (`write_snapshot`,
`read_snapshot`), so a large state is never held twice; `encode` and `decode`
are the bytes conveniences (a leader's snapshot arrives as bytes).

A snapshot is written to a temporary name, fsynced and renamed, so a crash
leaves either the old snapshot or the new one, never half of one. A snapshot
that fails its checks is refused with an error naming the file: it is never
served. `load_usable` may fall back to an older snapshot, as etcd's snapshotter
does; the caller must then prove the log reaches back to it (the WAL's gap
check) before serving, and only then `set_aside` the broken one.

Before version 2 the state was pickled (magic "QSNAP1\\n"). Such a file is
refused wherever it comes from, with a line saying how to convert it: nothing
is ever unpickled. Blocking; callers run it off the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from typing import IO, Any

from queue_server.storage import snapshot_codec
from queue_server.storage.files import fsync_dir
from queue_server.storage.snapshot_codec import SnapshotContents, SnapshotFormatError

__all__ = [
    "CorruptSnapshotError",
    "SnapshotContents",
    "SnapshotStore",
    "decode",
    "encode",
    "read_header",
    "read_snapshot",
    "unwrap_transfer",
    "verify",
    "write_snapshot",
]

log = logging.getLogger(__name__)

MAGIC = b"QSNAP2\n"
LEGACY_MAGIC = b"QSNAP1\n"
_LENGTH = struct.Struct("<I")
_CRC = struct.Struct("<I")
TRAILER_BYTES = _LENGTH.size + _CRC.size
"""The end marker (a zero length: no record is empty) and the checksum."""

MAX_RECORD_BYTES = 64 << 20
"""The longest record a reader accepts. A record is one chunk (about
`snapshot_codec.CHUNK_BYTES`) plus at most one item, and an item is bounded by
--max-request-bytes (1.5 MiB by default; etcd advises staying under 10 MiB).
The bound keeps a damaged or hostile length from making the reader allocate
gigabytes."""

CHECK_READ_BYTES = 1 << 20
"""Bytes read at a time by the checksum pass: large enough to run at disk speed,
small enough to be noise next to the state."""


KEEP_SNAPSHOTS = 2
"""Older snapshots are deleted once a newer one is durable; two are kept so the
previous one can be inspected after a bad restart."""


class CorruptSnapshotError(RuntimeError):
    """A snapshot is damaged, truncated, or not a snapshot this version reads."""

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index


class SnapshotStore:
    """The `snap/` directory of a data dir."""

    def __init__(self, directory: str, fsync: bool = True) -> None:
        self.directory = directory
        self.fsync_enabled = fsync
        os.makedirs(directory, exist_ok=True)

    def path(self, index: int) -> str:
        """The file of the snapshot at `index`."""
        return os.path.join(self.directory, f"{index:020d}.snap")

    def indexes(self) -> list[int]:
        return sorted(
            int(n[:-5])
            for n in os.listdir(self.directory)
            if n.endswith(".snap") and n[:-5].isdigit()
        )

    def save(
        self, index: int, state: dict[str, Any], raft_term: int = 0, voters: Iterable[int] = ()
    ) -> int:
        """Write a snapshot of `state` at `index` durably, streaming it to the
        file; returns its size in bytes."""
        return self._replace(
            index, lambda f: write_snapshot(f, index, state, raft_term=raft_term, voters=voters)
        )

    def save_encoded(self, index: int, data: bytes) -> int:
        """Write an already encoded snapshot (see `encode`) durably."""
        return self._replace(index, lambda f: f.write(data))

    def adopt(self, index: int, received: str) -> int:
        """Make a snapshot file written elsewhere in this directory (one a peer
        sent, already checked) the snapshot at `index`: fsync, rename, prune."""
        with open(received, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if self.fsync_enabled:
                os.fsync(f.fileno())
        os.replace(received, self.path(index))
        self._settle()
        return size

    def _replace(self, index: int, write: Callable[[IO[bytes]], int]) -> int:
        """Write the file through `write(fileobj) -> size` under a temporary name,
        fsync, rename over the snapshot at `index`, prune old ones."""
        tmp = self.path(index) + ".tmp"
        try:
            with open(tmp, "wb") as f:
                size = write(f)
                f.flush()
                if self.fsync_enabled:
                    os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk: give the space back
                os.remove(tmp)
            raise
        os.replace(tmp, self.path(index))
        self._settle()
        return size

    def _settle(self) -> None:
        """After a new snapshot is in place: make the rename durable, prune."""
        if self.fsync_enabled:
            fsync_dir(self.directory)
        for old in self.indexes()[:-KEEP_SNAPSHOTS]:
            os.remove(self.path(old))

    def remove_interrupted(self) -> None:
        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):  # a save that a crash interrupted
                os.remove(os.path.join(self.directory, name))

    def _load(self, index: int) -> SnapshotContents:
        """The snapshot at `index`, checked."""
        path = self.path(index)
        with open(path, "rb") as f:
            snap = read_snapshot(f, path)
        if snap.index != index:
            raise CorruptSnapshotError(
                f"{path} is not a valid snapshot: it says index {snap.index}", index
            )
        return snap

    def load_latest(self) -> SnapshotContents | None:
        """The newest snapshot, or None if there is none."""
        self.remove_interrupted()
        indexes = self.indexes()
        if not indexes:
            return None
        return self._load(indexes[-1])

    def load_usable(self) -> tuple[SnapshotContents | None, list[CorruptSnapshotError]]:
        """The newest snapshot that passes its checks (or None), and the errors
        of the newer ones that failed. A fallback is only safe if the log holds
        every record after the older snapshot: the caller checks that."""
        self.remove_interrupted()
        broken: list[CorruptSnapshotError] = []
        for index in reversed(self.indexes()):
            try:
                return self._load(index), broken
            except CorruptSnapshotError as e:
                broken.append(e)
        return None, broken

    def set_aside(self, index: int) -> str:
        """Rename a snapshot that failed its checks to `.broken` (as etcd does)
        so it is kept for inspection and never loaded again; returns the name."""
        path = self.path(index)
        os.replace(path, path + ".broken")
        if self.fsync_enabled:
            fsync_dir(self.directory)
        return path + ".broken"


# -- the format ------------------------------------------------------------------------


def write_snapshot(
    fileobj: IO[bytes],
    index: int,
    state: dict[str, Any],
    *,
    raft_term: int = 0,
    voters: Iterable[int] = (),
) -> int:
    """Write `state` (an `export_state()`) at applied index `index` to `fileobj`,
    one record at a time; returns the bytes written."""
    fileobj.write(MAGIC)
    crc = zlib.crc32(MAGIC)
    size = len(MAGIC)
    for record in snapshot_codec.encode_records(index, state, raft_term, voters):
        raw = record.SerializeToString()
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"a {record.WhichOneof('body')} record of {len(raw)} bytes")
        head = _LENGTH.pack(len(raw))
        crc = zlib.crc32(raw, zlib.crc32(head, crc))
        fileobj.write(head)
        fileobj.write(raw)
        size += len(head) + len(raw)
    end = _LENGTH.pack(0)
    fileobj.write(end + _CRC.pack(zlib.crc32(end, crc)))
    return size + TRAILER_BYTES


def read_snapshot(fileobj: IO[bytes], name: str) -> SnapshotContents:
    """The snapshot in `fileobj` (seekable, read from its position to its end),
    checked: checksum first, then every record. Anything else, a QSNAP1 pickle
    file included, is refused with CorruptSnapshotError naming `name`."""
    try:
        return _read(fileobj)
    except SnapshotFormatError as e:
        raise CorruptSnapshotError(
            f"{name} is not a valid snapshot: {e}", _index_of(name)
        ) from None


def read_header(path: str) -> tuple[int, int, tuple[int, ...]]:
    """The applied index, raft term and voters of the snapshot file at `path`,
    checked by its checksum, without building its state (a restart whose
    backend already holds that state needs only its raft position)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, io.SEEK_END)
            f.seek(0)
            if f.read(len(MAGIC)) != MAGIC or size < len(MAGIC) + TRAILER_BYTES:
                raise SnapshotFormatError(f"it does not start with {MAGIC!r}")
            _check_crc(f, size)
            f.seek(len(MAGIC))
            (length,) = _LENGTH.unpack(_read_exactly(f, _LENGTH.size))
            if not 0 < length <= MAX_RECORD_BYTES:
                raise SnapshotFormatError("no header record")
            record = snapshot_codec.parse_record(_read_exactly(f, length))
    except SnapshotFormatError as e:
        raise CorruptSnapshotError(
            f"{path} is not a valid snapshot: {e}", _index_of(path)
        ) from None
    if record.WhichOneof("body") != "header":
        raise CorruptSnapshotError(f"{path} is not a valid snapshot: no header", _index_of(path))
    h = record.header
    return h.applied_index, h.raft_term, tuple(h.voters)


def _read(fileobj: IO[bytes]) -> SnapshotContents:
    start = fileobj.tell()
    size = fileobj.seek(0, io.SEEK_END) - start
    fileobj.seek(start)
    magic = fileobj.read(len(MAGIC))
    if magic == LEGACY_MAGIC:
        raise SnapshotFormatError(
            "it is in the pickle format of releases before QSNAP2 (QSNAP1), which is "
            "never read: nothing is ever unpickled. Start the release that wrote it on "
            "its data dir once (it rewrites the file as QSNAP2), then use that file"
        )
    if magic != MAGIC:
        raise SnapshotFormatError(f"it does not start with {MAGIC!r}")
    if size < len(MAGIC) + TRAILER_BYTES:
        raise SnapshotFormatError(f"truncated at {size} bytes")
    _check_crc(fileobj, size)

    fileobj.seek(start + len(MAGIC))
    reader = snapshot_codec.StateReader()
    at = len(MAGIC)
    end = size - TRAILER_BYTES  # where the end marker must be
    while at < end:
        (length,) = _LENGTH.unpack(_read_exactly(fileobj, _LENGTH.size))
        at += _LENGTH.size
        if length == 0:
            raise SnapshotFormatError(f"an end marker at byte {at} before the trailer")
        if length > MAX_RECORD_BYTES or at + length > end:
            raise SnapshotFormatError(f"a record of {length} bytes at byte {at} runs past the end")
        reader.add(snapshot_codec.parse_record(_read_exactly(fileobj, length)))
        at += length
    if at != end or _read_exactly(fileobj, _LENGTH.size) != _LENGTH.pack(0):
        raise SnapshotFormatError("the records do not end at the trailer")
    return reader.finish()


def _check_crc(fileobj: IO[bytes], size: int) -> None:
    """Compare the crc32 of everything before the checksum with the trailer's."""
    remaining = size - len(MAGIC) - _CRC.size
    crc = zlib.crc32(MAGIC)
    while remaining:
        block = fileobj.read(min(CHECK_READ_BYTES, remaining))
        if not block:
            raise SnapshotFormatError("truncated while reading")
        crc = zlib.crc32(block, crc)
        remaining -= len(block)
    (expected,) = _CRC.unpack(_read_exactly(fileobj, _CRC.size))
    if crc != expected:
        raise SnapshotFormatError(
            f"it fails its checksum ({size} bytes, crc32 {crc:#010x}, trailer says {expected:#010x})"
        )


def _read_exactly(fileobj: IO[bytes], n: int) -> bytes:
    data = fileobj.read(n)
    if len(data) != n:
        raise SnapshotFormatError("truncated while reading")
    return data


def encode(
    index: int, state: dict[str, Any], raft_term: int = 0, voters: Iterable[int] = ()
) -> bytes:
    """The snapshot's bytes for `state` at applied index `index`."""
    out = io.BytesIO()
    write_snapshot(out, index, state, raft_term=raft_term, voters=voters)
    return out.getvalue()


def decode(data: bytes, name: str) -> SnapshotContents:
    """The snapshot in `data` (e.g. a leader's), checked as `read_snapshot` does."""
    return read_snapshot(io.BytesIO(data), name)


def verify(data: bytes, name: str) -> int:
    """Check a snapshot's bytes in full; returns its applied index."""
    return decode(data, name).index


def _index_of(name: str) -> int:
    """The index in a snapshot file's name (-1 if it has none)."""
    stem = os.path.basename(name).split(".")[0]
    return int(stem) if stem.isdigit() else -1


# -- etcdctl's transfer wrapping -------------------------------------------------------

SECTOR_BYTES = 512
SHA256_BYTES = 32


def unwrap_transfer(data: bytes, name: str) -> bytes:
    """A file as `etcdctl snapshot save` writes it, without the sha256 etcd
    streams after the database (checked here, as `etcdctl snapshot restore`
    does). Such a file is a whole number of 512-byte sectors and the digest:
    etcd's or our bbolt database, or an older server's legacy snapshot padded
    with zeros. Our QSNAP2 files are never streamed, and pass through whatever
    their length, as does anything that is not 32 past a multiple of 512."""
    if data.startswith(MAGIC) or len(data) % SECTOR_BYTES != SHA256_BYTES:
        return data
    body, digest = data[:-SHA256_BYTES], data[-SHA256_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptSnapshotError(f"snapshot {name} fails its sha256 check")
    return body
