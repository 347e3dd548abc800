"""A cluster member's stable storage: raft entries, hard state and snapshots.

Layout in the data dir: `raft/wal/` holds the records, in the checksummed segment
format of `queue_server/storage/wal.py` (each record numbered by a write
sequence, not by raft index), and `raft/snap/` holds snapshots of the state
machine with the raft position they stand for.

A record's payload is one of

    b"E" | u64 raft index | u64 term | u8 kind | data      an entry
    b"H" | u64 term | u64 vote | u64 commit                 the hard state

Replay reads the records in write order. An entry at raft index i replaces the
entry at i and drops every later one (that is how a follower's conflicting suffix
is overwritten: by appending, never by rewriting the file), and the last hard
state wins. A torn tail (a crash during a write) is cut off by the WAL; what it
held was never acknowledged, because acknowledgements wait for the fsync.

After a snapshot at index s, the member starts a new segment holding the hard
state and the entries after s, then deletes the older segments: replay never needs
them again, and a crash between the two steps only leaves duplicates that replay
resolves by the replacement rule.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from queue_server.storage import snapshot
from queue_server.storage.snapshot import SnapshotStore
from queue_server.storage.wal import WALFullError, WriteAheadLog

_ENTRY = struct.Struct("<QQB")
_HARD = struct.Struct("<QQQ")
_POSITION = struct.Struct("<QQQ")


@dataclass(frozen=True, slots=True)
class HeldPosition:
    """The raft position of a snapshot a member on the backend took as a
    checkpoint (kept in the backend's `meta` db beside it, with no file): its
    index, term and voters, and the distinct keys the checkpoint holds (a
    snapshot file written from it later announces that count)."""

    index: int
    term: int
    voters: tuple[int, ...]
    key_count: int

    def encode(self) -> bytes:
        voters = struct.pack(f"<{len(self.voters)}Q", *self.voters)
        return _POSITION.pack(self.index, self.term, self.key_count) + voters

    @classmethod
    def decode(cls, data: bytes) -> HeldPosition:
        index, term, key_count = _POSITION.unpack_from(data, 0)
        count = (len(data) - _POSITION.size) // 8
        voters = struct.unpack_from(f"<{count}Q", data, _POSITION.size)
        return cls(index, term, tuple(voters), key_count)


@dataclass(slots=True)
class StoredEntry:
    index: int
    term: int
    kind: int
    data: bytes


@dataclass(slots=True)
class Loaded:
    """What a restart finds: the hard state, the newest snapshot (its raft
    position and the state machine's exported state) and the entries after it."""

    term: int = 0
    vote: int = 0
    commit: int = 0
    snapshot_index: int = 0
    snapshot_term: int = 0
    voters: tuple[int, ...] = ()
    state: Any = None
    entries: list[StoredEntry] = field(default_factory=list)


def encode_entry(e: StoredEntry) -> bytes:
    return b"E" + _ENTRY.pack(e.index, e.term, e.kind) + e.data


def encode_hard_state(term: int, vote: int, commit: int) -> bytes:
    return b"H" + _HARD.pack(term, vote, commit)


class RaftStorage:
    """The raft WAL and snapshots of one member."""

    def __init__(self, data_dir: str, fsync: bool = True) -> None:
        self.wal = WriteAheadLog(os.path.join(data_dir, "raft", "wal"), fsync)
        self.snapshots = SnapshotStore(os.path.join(data_dir, "raft", "snap"), fsync)
        self._seq = 0

    def load(self, state_held_at: int = 0, held_position: HeldPosition | None = None) -> Loaded:
        """Read everything back (and open the WAL for appending). A snapshot at
        or below `state_held_at` (the backend's consistent index) gives only its
        raft position: its state is not built, the backend has it.
        `held_position` is the raft position of the backend's own snapshot (a
        checkpoint it took as one, with no file): it stands for the newest
        snapshot when no file is newer."""
        out = Loaded()
        indexes = self.snapshots.indexes()
        if held_position is not None and (not indexes or indexes[-1] <= held_position.index):
            out.snapshot_index = held_position.index
            out.snapshot_term = held_position.term
            out.voters = held_position.voters
            self.snapshots.remove_interrupted()
            found = None
        elif indexes and 0 < indexes[-1] <= state_held_at:
            out.snapshot_index, out.snapshot_term, out.voters = snapshot.read_header(
                self.snapshots.path(indexes[-1])
            )
            self.snapshots.remove_interrupted()
            found = None
        else:
            found = self.snapshots.load_latest()
        if found is not None:
            out.snapshot_index = found.index
            out.snapshot_term = found.raft_term
            out.voters = found.voters
            out.state = found.state
        segments = self.wal.segments()
        after = segments[0] - 1 if segments else 0
        entries: list[StoredEntry] = []
        for _, payload in self.wal.replay(after):
            if payload[:1] == b"H":
                out.term, out.vote, out.commit = _HARD.unpack_from(payload, 1)
                continue
            index, term, kind = _ENTRY.unpack_from(payload, 1)
            if index <= out.snapshot_index:
                continue
            while entries and entries[-1].index >= index:
                entries.pop()
            if entries and entries[-1].index != index - 1:
                raise RuntimeError(f"raft wal: entry {index} follows {entries[-1].index}")
            if not entries and index != out.snapshot_index + 1:
                raise RuntimeError(
                    f"raft wal: first entry {index} after snapshot {out.snapshot_index}"
                )
            entries.append(StoredEntry(index, term, kind, payload[1 + _ENTRY.size :]))
        out.entries = entries
        out.commit = max(out.commit, out.snapshot_index)
        self._seq = self.wal.last_index
        self.wal.open_for_append()
        return out

    def encode(self, records: list[bytes]) -> tuple[bytes, int]:
        """Number and frame records for `write` (cheap: on the event loop)."""
        data = []
        for payload in records:
            self._seq += 1
            data.append(self.wal.encode(self._seq, payload))
        return b"".join(data), self._seq

    def write(self, data: bytes, last_seq: int) -> None:
        """Append and fsync (blocking: run it in the writer thread)."""
        try:
            self.wal.write(data, last_seq)
        except WALFullError:
            # Cut off again: number the next records after the last one on disk,
            # or replay would take the gap for damage and refuse to start.
            self._seq = self.wal.last_index
            raise

    @property
    def snapshot_dir(self) -> str:
        """Where snapshots live, and where those peers send are written as they
        arrive (as `*.tmp` files, which a restart removes)."""
        return self.snapshots.directory

    def snapshot_path(self, index: int) -> str:
        """The snapshot file at raft `index` (what a lagging follower is sent)."""
        return self.snapshots.path(index)

    def snapshot_job(
        self,
        index: int,
        state: dict[str, Any],
        raft_term: int,
        voters: Iterable[int],
        hard_state: tuple[int, int, int],
        entries_after: list[StoredEntry],
    ) -> Callable[[], int]:
        """A snapshot of `state` at raft `index`. The records that restart the WAL
        are numbered now (on the event loop, in order with every other write);
        the returned blocking function, run in the writer thread after the writes
        queued before it, streams the snapshot to its file, starts a new segment
        with those records and deletes the older segments. It returns the
        snapshot's size. `state` must not change meanwhile (an export is a copy)."""
        restart = self._wal_restart(hard_state, entries_after)
        voters = tuple(voters)

        def run() -> int:
            size = self.snapshots.save(index, state, raft_term, voters)
            restart()
            return size

        return run

    def remove_snapshots_below(self, index: int) -> None:
        """Delete the snapshot files older than raft `index` (blocking): the
        backend's own snapshot at `index` supersedes them."""
        for old in self.snapshots.indexes():
            if old < index:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.snapshots.path(old))

    def has_snapshot_file(self, index: int) -> bool:
        return os.path.exists(self.snapshots.path(index))

    def restart_job(
        self, hard_state: tuple[int, int, int], entries_after: list[StoredEntry]
    ) -> Callable[[], None]:
        """The WAL restarted after a snapshot already saved (`save_snapshot`):
        its records are numbered now, so run it on the writer thread in order."""
        return self._wal_restart(hard_state, entries_after)

    def save_snapshot(
        self, index: int, state: dict[str, Any], raft_term: int, voters: Iterable[int]
    ) -> int:
        """Write the snapshot file at `index` (blocking, any thread); its size."""
        return self.snapshots.save(index, state, raft_term, tuple(voters))

    def install_job(
        self, index: int, received: str, hard_state: tuple[int, int, int]
    ) -> Callable[[], int]:
        """A snapshot a peer sent, already written to `received` in the snapshot
        dir and checked: the blocking function makes it durable, moves it to its
        place and restarts the WAL after it (nothing of the old log is kept)."""
        restart = self._wal_restart(hard_state, [])

        def run() -> int:
            size = self.snapshots.adopt(index, received)
            restart()
            return size

        return run

    def _wal_restart(
        self, hard_state: tuple[int, int, int], entries_after: list[StoredEntry]
    ) -> Callable[[], None]:
        records = [encode_hard_state(*hard_state)] + [encode_entry(e) for e in entries_after]
        wal_data, last = self.encode(records)
        first = last - len(records) + 1

        def run() -> None:
            self.wal.last_index = first - 1
            self.wal.rotate()
            self.wal.write(wal_data, last)
            self.wal.remove_covered(first - 1)

        return run

    def close(self) -> None:
        self.wal.close()
