"""Snapshots of the state machine on disk: write atomically, find, load, verify.

A snapshot file `snap/<applied index, 20 digits>.snap` is

    magic "QSNAP1\\n" | u64 applied index | u32 crc32 of payload | u64 payload length | payload

The payload is the state machine's own serialization (`StateMachine.export_state`,
pickled here: the data directory is trusted, as etcd trusts its bbolt file). A
snapshot is written to a temporary name, fsynced and renamed, so a crash leaves
either the old snapshot or the new one, never half of one. A snapshot whose
checksum fails is refused with an error naming the file: it is never served.
Blocking; callers run it off the event loop.
"""

from __future__ import annotations

import os
import pickle
import struct
import zlib
from typing import Any

_MAGIC = b"QSNAP1\n"
_HEADER = struct.Struct("<QIQ")
KEEP_SNAPSHOTS = 2
"""Older snapshots are deleted once a newer one is durable; two are kept so the
previous one can be inspected after a bad restart."""


class CorruptSnapshotError(RuntimeError):
    """A snapshot file failed its checksum or is truncated."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        payload = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        tmp = self._path(index) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_MAGIC)
            f.write(_HEADER.pack(index, zlib.crc32(payload), len(payload)))
            f.write(payload)
            f.flush()
            if self.fsync_enabled:
                os.fsync(f.fileno())
        os.replace(tmp, self._path(index))
        if self.fsync_enabled:
            _fsync_dir(self.directory)
        for old in self.indexes()[:-KEEP_SNAPSHOTS]:
            os.remove(self._path(old))
        return len(payload) + len(_MAGIC) + _HEADER.size

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
        head = len(_MAGIC) + _HEADER.size
        if len(data) < head or not data.startswith(_MAGIC):
            raise CorruptSnapshotError(f"snapshot {path} has no valid header")
        index, crc, length = _HEADER.unpack_from(data, len(_MAGIC))
        payload = data[head:]
        if len(payload) != length or zlib.crc32(payload) != crc:
            raise CorruptSnapshotError(
                f"snapshot {path} fails its checksum (expected {length} bytes, crc {crc:#x})"
            )
        return index, pickle.loads(payload)
