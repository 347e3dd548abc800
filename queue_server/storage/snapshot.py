"""Snapshots of the state machine on disk: write atomically, find, load, verify.

A snapshot file `snap/<applied index, 20 digits>.snap` is

    magic "QSNAP1\\n" | u64 applied index | u32 crc32 of payload | u64 payload length | payload

The payload is the state machine's own serialization (`StateMachine.export_state`,
pickled here: the data directory is trusted, as etcd trusts its bbolt file). A
snapshot is written to a temporary name, fsynced and renamed, so a crash leaves
either the old snapshot or the new one, never half of one. A snapshot whose
checksum fails is refused with an error naming the file: it is never served.
`load_usable` may fall back to an older snapshot, as etcd's snapshotter does; the
caller must then prove the log reaches back to it (the WAL's gap check) before
serving, and only then `set_aside` the broken one. Blocking; callers run it off
the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import struct
import zlib
from typing import Any

from queue_server.storage.files import fsync_dir

_MAGIC = b"QSNAP1\n"
_HEADER = struct.Struct("<QIQ")
KEEP_SNAPSHOTS = 2
"""Older snapshots are deleted once a newer one is durable; two are kept so the
previous one can be inspected after a bad restart."""


class CorruptSnapshotError(RuntimeError):
    """A snapshot file failed its checksum or is truncated."""

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index


class SnapshotStore:
    """The `snap/` directory of a data dir."""

    def __init__(self, directory: str, fsync: bool = True) -> None:
        self.directory = directory
        self.fsync_enabled = fsync
        os.makedirs(directory, exist_ok=True)

    def _path(self, index: int) -> str:
        return os.path.join(self.directory, f"{index:020d}.snap")

    def indexes(self) -> list[int]:
        return sorted(
            int(n[:-5])
            for n in os.listdir(self.directory)
            if n.endswith(".snap") and n[:-5].isdigit()
        )

    def save(self, index: int, state: Any) -> int:
        """Write a snapshot of `state` at `index` durably; returns its size in bytes."""
        return self.save_encoded(index, encode(index, state))

    def save_encoded(self, index: int, data: bytes) -> int:
        """Write an already encoded snapshot (see `encode`) durably."""
        tmp = self._path(index) + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync_enabled:
                    os.fsync(f.fileno())
        except OSError:
            with contextlib.suppress(OSError):  # a full disk: give the space back
                os.remove(tmp)
            raise
        os.replace(tmp, self._path(index))
        if self.fsync_enabled:
            fsync_dir(self.directory)
        for old in self.indexes()[:-KEEP_SNAPSHOTS]:
            os.remove(self._path(old))
        return len(data)

    def load_latest(self) -> tuple[int, Any] | None:
        """(index, state) of the newest snapshot, or None if there is none."""
        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):  # a save that a crash interrupted
                os.remove(os.path.join(self.directory, name))
        indexes = self.indexes()
        if not indexes:
            return None
        path = self._path(indexes[-1])
        with open(path, "rb") as f:
            data = f.read()
        return decode(data, path)

    def load_usable(self) -> tuple[tuple[int, Any] | None, list[CorruptSnapshotError]]:
        """The newest snapshot that passes its checksum (or None), and the errors
        of the newer ones that failed. A fallback is only safe if the log holds
        every record after the older snapshot: the caller checks that."""
        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):
                os.remove(os.path.join(self.directory, name))
        broken: list[CorruptSnapshotError] = []
        for index in reversed(self.indexes()):
            path = self._path(index)
            with open(path, "rb") as f:
                data = f.read()
            try:
                return decode(data, path), broken
            except CorruptSnapshotError as e:
                broken.append(e)
        return None, broken

    def set_aside(self, index: int) -> str:
        """Rename a snapshot that failed its checksum to `.broken` (as etcd does)
        so it is kept for inspection and never loaded again; returns the name."""
        path = self._path(index)
        os.replace(path, path + ".broken")
        if self.fsync_enabled:
            fsync_dir(self.directory)
        return path + ".broken"


def encode(index: int, state: Any) -> bytes:
    """The snapshot file's bytes for `state` at applied index `index`."""
    payload = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    return _MAGIC + _HEADER.pack(index, zlib.crc32(payload), len(payload)) + payload


def _index_of(name: str) -> int:
    """The index in a snapshot file's name (-1 if it has none)."""
    stem = os.path.basename(name).split(".")[0]
    return int(stem) if stem.isdigit() else -1


def verify(data: bytes, name: str) -> int:
    """Check a snapshot's header and checksum; returns its applied index."""
    head = len(_MAGIC) + _HEADER.size
    if len(data) < head or not data.startswith(_MAGIC):
        raise CorruptSnapshotError(f"snapshot {name} has no valid header", _index_of(name))
    index, crc, length = _HEADER.unpack_from(data, len(_MAGIC))
    payload = memoryview(data)[head : head + length]
    if len(payload) != length or zlib.crc32(payload) != crc:
        raise CorruptSnapshotError(
            f"snapshot {name} fails its checksum (expected {length} bytes, crc {crc:#x})",
            _index_of(name),
        )
    return int(index)


def decode(data: bytes, name: str) -> tuple[int, Any]:
    """(applied index, state) of a snapshot's bytes, after `verify`."""
    index = verify(data, name)
    return index, pickle.loads(memoryview(data)[len(_MAGIC) + _HEADER.size :])


SECTOR_BYTES = 512
SHA256_BYTES = 32


def for_transfer(data: bytes) -> bytes:
    """The snapshot as Maintenance.Snapshot streams it: padded to a multiple of
    512 bytes, then its sha256. etcd's clients (etcdctl snapshot save) refuse a
    stream whose length is not 32 past a multiple of 512 (`hasChecksum`), since
    etcd streams a page-aligned db file followed by its sha256."""
    padded = data + bytes(-len(data) % SECTOR_BYTES)
    return padded + hashlib.sha256(padded).digest()


def from_transfer(data: bytes, name: str) -> bytes:
    """Undo `for_transfer` (checking the sha256); plain snapshot files pass through."""
    if len(data) % SECTOR_BYTES == SHA256_BYTES:
        body, digest = data[:-SHA256_BYTES], data[-SHA256_BYTES:]
        if hashlib.sha256(body).digest() != digest:
            raise CorruptSnapshotError(f"snapshot {name} fails its sha256 check")
        return body
    return data
