"""The write-ahead log on disk: numbered, checksummed records in segment files.

What belongs here: file formats and file operations of the log, nothing about what
the records mean. It is synchronous and blocking (callers run it off the event
loop) and holds no locks: one writer thread at a time, by contract.

Format. A segment is a file `wal/<first index, 20 digits>.log` holding records

    u32 length of payload | u32 crc32 of (index bytes + payload) | u64 index | payload

with consecutive indexes. Recovery reads the segments in order and stops at the
first record that is short or fails its checksum: that is a write torn by a crash
(the write was never acknowledged, because acknowledgement waits for fsync). The
torn tail is cut off so new records follow the last good one, and the recovery
reports how many bytes it dropped.

Segments rotate when a snapshot is taken, so the segments wholly covered by the
snapshot can be deleted (`remove_covered`).
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from queue_server.storage.files import fsync_dir

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<IIQ")
MAX_RECORD_BYTES = 256 * 1024 * 1024
"""A record longer than this can only be garbage: the request limit is far lower."""


class WALGapError(RuntimeError):
    """Records between the snapshot and the log are missing: refuse to start."""


@dataclass(frozen=True, slots=True)
class Recovery:
    """What opening the log found: the last good index and the bytes dropped."""

    last_index: int
    dropped_bytes: int
    dropped_segments: int


def _segment_name(first_index: int) -> str:
    return f"{first_index:020d}.log"


class WriteAheadLog:
    """A directory of log segments; append, fsync, replay, rotate, trim."""

    def __init__(self, directory: str, fsync: bool = True) -> None:
        self.directory = directory
        self.fsync_enabled = fsync
        os.makedirs(directory, exist_ok=True)
        self._fd = -1
        self._segment_first = 0
        self.last_index = 0

    # -- reading --------------------------------------------------------------

    def segments(self) -> list[int]:
        """First indexes of the segments on disk, ascending."""
        firsts = []
        for name in os.listdir(self.directory):
            if name.endswith(".log") and name[:-4].isdigit():
                firsts.append(int(name[:-4]))
        return sorted(firsts)

    def _path(self, first_index: int) -> str:
        return os.path.join(self.directory, _segment_name(first_index))

    def replay(self, after_index: int) -> Iterator[tuple[int, bytes]]:
        """Yield (index, payload) of every good record with index > after_index,
        in order. Afterwards `recovery` says what was dropped and the log is open
        for appending after the last good record."""
        firsts = self.segments()
        dropped_bytes = 0
        dropped_segments = 0
        last = 0
        expected: int | None = None
        last_yielded: int | None = None
        for n, first in enumerate(firsts):
            path = self._path(first)
            with open(path, "rb") as f:
                data = f.read()
            pos = 0
            good_end = 0
            while pos + _HEADER.size <= len(data):
                length, crc, index = _HEADER.unpack_from(data, pos)
                end = pos + _HEADER.size + length
                if length > MAX_RECORD_BYTES or end > len(data):
                    break
                body = data[pos + 8 : end]
                if zlib.crc32(body) != crc:
                    break
                if expected is not None and index != expected:
                    break
                expected = index + 1
                last = index
                pos = good_end = end
                if index > after_index:
                    if last_yielded is None and index != after_index + 1:
                        raise WALGapError(
                            f"wal starts at index {index} but the snapshot ends at {after_index}"
                        )
                    last_yielded = index
                    yield index, data[pos - length : pos]
            if good_end < len(data):
                dropped_bytes += len(data) - good_end
                log.warning("wal torn tail segment=%s dropped_bytes=%d", path, len(data) - good_end)
                with open(path, "r+b") as f:
                    f.truncate(good_end)
                    os.fsync(f.fileno())
                # Anything after a torn record is unreachable: later segments too.
                for later in firsts[n + 1 :]:
                    dropped_segments += 1
                    dropped_bytes += os.path.getsize(self._path(later))
                    os.remove(self._path(later))
                break
        self.last_index = max(last, after_index)
        self.recovery = Recovery(self.last_index, dropped_bytes, dropped_segments)

    # -- writing --------------------------------------------------------------

    def open_for_append(self) -> None:
        """Open the newest segment (or a new one) for appending."""
        firsts = self.segments()
        if firsts:
            self._segment_first = firsts[-1]
            self._fd = os.open(self._path(firsts[-1]), os.O_WRONLY | os.O_APPEND)
        else:
            self._open_new(self.last_index + 1)

    def _open_new(self, first_index: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._segment_first = first_index
        self._fd = os.open(self._path(first_index), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if self.fsync_enabled:
            fsync_dir(self.directory)

    def rotate(self) -> None:
        """Start a new segment at the next index (after a snapshot)."""
        self._open_new(self.last_index + 1)

    @staticmethod
    def encode(index: int, payload: bytes) -> bytes:
        """One record's bytes (cheap; done on the event loop as proposals arrive)."""
        crc = zlib.crc32(payload, zlib.crc32(index.to_bytes(8, "little")))
        return _HEADER.pack(len(payload), crc, index) + payload

    def append(self, records: list[tuple[int, bytes]]) -> None:
        """Write records (consecutive indexes following `last_index`) and make them
        durable: when this returns, they survive a crash."""
        self.write(b"".join(self.encode(i, p) for i, p in records), records[-1][0])

    def write(self, data: bytes, last_index: int) -> None:
        """Append encoded records ending at `last_index` and fsync them. Little
        Python runs here, so the writer thread seldom needs the GIL."""
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self.fsync_enabled:
            os.fdatasync(self._fd)
        self.last_index = last_index

    def remove_covered(self, snapshot_index: int) -> int:
        """Delete segments whose every record is at or below `snapshot_index`;
        returns how many were removed."""
        firsts = self.segments()
        removed = 0
        for first, next_first in itertools.pairwise(firsts):
            if next_first - 1 <= snapshot_index and first != self._segment_first:
                os.remove(self._path(first))
                removed += 1
        return removed

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
