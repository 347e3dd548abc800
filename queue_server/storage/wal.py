"""The write-ahead log on disk: numbered, checksummed records in segment files.

What belongs here: file formats and file operations of the log, nothing about what
the records mean. It is synchronous and blocking (callers run it off the event
loop) and holds no locks: one writer thread at a time, by contract.

Format. A segment is a file `wal/<first index, 20 digits>.log` holding records

    u32 length of payload | u32 crc32 of (index bytes + payload) | u64 index | payload

with consecutive indexes. Recovery reads the segments in order and stops at the
first record that is short or fails its checksum. If nothing good follows it,
that is a write torn by a crash (never acknowledged, because acknowledgement waits
for fsync): the torn tail is cut off so new records follow the last good one, and
the recovery logs the segment, the offset and how many bytes it dropped. If a good
record with a later index follows it, the damage is in the middle of what was
acknowledged (a bad disk, not a crash): cutting there would silently lose
acknowledged writes, so `WALCorruptError` refuses to start, as etcd refuses a WAL
with a CRC mismatch. As in etcd's torn-entry rule, a bad record holding an
all-zero 512-byte sector is still a torn write (a crash before the sector reached
the disk), whatever follows it in that unacknowledged batch.

Segments rotate when a snapshot is taken, so the segments wholly covered by the
snapshot can be deleted (`remove_covered`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from queue_server.storage.files import fsync_dir

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<IIQ")
MAX_RECORD_BYTES = 256 * 1024 * 1024
"""A record longer than this can only be garbage: the request limit is far lower."""


SECTOR_BYTES = 512
"""The unit a disk writes atomically; a torn write leaves whole sectors unwritten
(zero), which is how etcd's decoder tells a torn entry from a corrupt one."""

TORN_SCAN_INDEXES = 256
"""How many indexes past a bad record are looked for to tell corruption from a
torn tail: more bad records in a row than this (a damaged stretch of more than
about 8 KiB of the smallest records: two 4 KiB blocks) are taken for a torn tail.
The search is `find` over the bytes after the bad record: milliseconds for a torn
tail, which is short; about a second per 16 MiB of garbage in the worst case."""

TORN_SCAN_CANDIDATES = 100_000
"""Bounds the checksums that scan computes (an index's bytes also occur by chance
inside payloads)."""


class WALGapError(RuntimeError):
    """Records between the snapshot and the log are missing: refuse to start."""


class WALFullError(OSError):
    """The disk had no room for a write (ENOSPC, EDQUOT). The partial write was
    cut off again, so the log is as it was before: later writes may succeed."""


class WALCorruptError(RuntimeError):
    """A record in the middle of the log is damaged and good records follow it:
    refuse to start rather than drop acknowledged writes."""


@dataclass(frozen=True, slots=True)
class Recovery:
    """What opening the log found: the last good index and the bytes dropped."""

    last_index: int
    dropped_bytes: int
    dropped_segments: int
    dropped_offset: int = -1
    """Where the torn tail began in the last segment kept (-1: nothing dropped)."""


def _segment_name(first_index: int) -> str:
    return f"{first_index:020d}.log"


def _good_record_at(data: bytes, pos: int, index: int) -> int:
    """The end of a valid record numbered `index` at `pos`, or -1."""
    if pos < 0 or pos + _HEADER.size > len(data):
        return -1
    length, crc, found = _HEADER.unpack_from(data, pos)
    end = pos + _HEADER.size + length
    if found != index or length > MAX_RECORD_BYTES or end > len(data):
        return -1
    return end if zlib.crc32(memoryview(data)[pos + 8 : end]) == crc else -1


def _next_good_record(data: bytes, bad: int, expected: int) -> tuple[int, int] | None:
    """(offset, index) of a valid record after the bad one at `bad` whose index
    is one of the next `TORN_SCAN_INDEXES` after `expected`, or None. Searches
    for the index bytes with `bytes.find` (C speed), checking at most
    `TORN_SCAN_CANDIDATES` places where they occur."""
    candidates = 0
    for index in range(expected + 1, expected + 1 + TORN_SCAN_INDEXES):
        needle = index.to_bytes(8, "little")
        at = data.find(needle, bad + 1)
        while at >= 0 and candidates < TORN_SCAN_CANDIDATES:
            candidates += 1
            if _good_record_at(data, at - 8, index) >= 0:
                return at - 8, index
            at = data.find(needle, at + 1)
    return None


def _has_zero_sector(data: bytes, start: int, end: int) -> bool:
    """Whether an aligned sector within data[start:end] is all zeros."""
    first = -(-start // SECTOR_BYTES) * SECTOR_BYTES
    zero = bytes(SECTOR_BYTES)
    return any(
        data[s : s + SECTOR_BYTES] == zero
        for s in range(first, min(end, len(data)) - SECTOR_BYTES + 1, SECTOR_BYTES)
    )


class WriteAheadLog:
    """A directory of log segments; append, fsync, replay, rotate, trim."""

    write_fd: Callable[[int, memoryview], int] = staticmethod(os.write)
    """The one call that puts log bytes on disk; tests give a real, smaller disk
    here (a wrapper that writes until its budget is spent, then ENOSPC)."""

    def __init__(self, directory: str, fsync: bool = True) -> None:
        self.directory = directory
        self.fsync_enabled = fsync
        os.makedirs(directory, exist_ok=True)
        self._fd = -1
        self._size = 0  # bytes in the open segment: where a failed write is cut back to
        self._segment_first = 0
        self.last_index = 0
        self.end_index = 0

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
        if firsts and firsts[0] > after_index + 1:
            # Segment names are their first index: even an empty newest segment
            # says the records before it existed, and they are gone.
            raise WALGapError(
                f"wal starts at index {firsts[0]} but the snapshot ends at {after_index}"
            )
        dropped_bytes = 0
        dropped_segments = 0
        dropped_offset = -1
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
                self._check_torn(
                    path, data, good_end, first if expected is None else expected, firsts[n + 1 :]
                )
                dropped_bytes += len(data) - good_end
                dropped_offset = good_end
                log.warning(
                    "wal torn tail dropped segment=%s offset=%d dropped_bytes=%d last_index=%d",
                    path,
                    good_end,
                    len(data) - good_end,
                    last,
                )
                with open(path, "r+b") as f:
                    f.truncate(good_end)
                    os.fsync(f.fileno())
                # Later segments can only be empty (checked above): remove them.
                for later in firsts[n + 1 :]:
                    dropped_segments += 1
                    dropped_bytes += os.path.getsize(self._path(later))
                    os.remove(self._path(later))
                break
        self.last_index = max(last, after_index)
        # What the log reaches: its last record, or what the newest segment's
        # name says came before it (a segment started after a checkpoint).
        self.end_index = max(last, firsts[-1] - 1 if firsts else 0)
        self.recovery = Recovery(self.last_index, dropped_bytes, dropped_segments, dropped_offset)

    def _check_torn(
        self, path: str, data: bytes, bad: int, expected: int, later: list[int]
    ) -> None:
        """Raise `WALCorruptError` unless the bad bytes from `bad` on are a torn
        tail: nothing valid after them, or a zeroed sector in the bad record."""
        later_bytes = sum(os.path.getsize(self._path(f)) for f in later)
        if later_bytes:
            raise WALCorruptError(
                f"wal segment {path} is damaged at offset {bad} (after index "
                f"{expected - 1}) but later segments hold {later_bytes} bytes of "
                "records: refusing to start, acknowledged writes would be lost"
            )
        found = _next_good_record(data, bad, expected)
        if found is None:
            return
        offset, index = found
        if _has_zero_sector(data, bad, offset):
            return
        raise WALCorruptError(
            f"wal segment {path} has a damaged record at offset {bad} (index "
            f"{expected}) but a good record (index {index}) "
            f"follows at offset {offset}: this is corruption, not a torn write; refusing to "
            f"start rather than drop {len(data) - bad} bytes of acknowledged records. Restore "
            f"from a backup, or drop them knowingly with `truncate -s {bad} {path}`"
        )

    # -- writing --------------------------------------------------------------

    def open_for_append(self) -> None:
        """Open the newest segment (or a new one) for appending."""
        firsts = self.segments()
        if firsts:
            self._segment_first = firsts[-1]
            self._fd = os.open(self._path(firsts[-1]), os.O_WRONLY | os.O_APPEND)
            self._size = os.fstat(self._fd).st_size
        else:
            self._open_new(self.last_index + 1)

    def _open_new(self, first_index: int) -> None:
        # Open the new segment before closing the old one: if the disk refuses
        # the new file, appending goes on in the old segment.
        fd = os.open(self._path(first_index), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._size = 0
        self._segment_first = first_index
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
        Python runs here, so the writer thread seldom needs the GIL.

        Raises `WALFullError` when the disk is full, after cutting off what part
        of `data` was written (records after a partial one would be lost at the
        next recovery). Any other error, and any error of fdatasync, leaves the
        file in an unknown state: the caller must stop writing."""
        view = memoryview(data)
        try:
            while view:
                n = self.write_fd(self._fd, view)
                view = view[n:]
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            os.ftruncate(self._fd, self._size)  # if this fails, the caller stops
            raise WALFullError(e.errno, f"wal write of {len(data)} bytes: {e.strerror}") from e
        if self.fsync_enabled:
            os.fdatasync(self._fd)
        self._size += len(data)
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
