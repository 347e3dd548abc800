"""The core's in-memory view of the Raft log: compacted prefix, entries, progress marks.

`RaftLog` holds the entries after the last snapshot (`snap_index`, `snap_term`), and
four marks over them:

- `unstable_from`: the first index the driver has not yet confirmed durable (entries
  before it were handed out in a Ready and acknowledged by `advance`). A follower that
  truncates a conflicting suffix moves it back to the truncation point.
- `committed`: the highest index known committed (never decreases).
- `applied`: the highest index the driver has applied (or the snapshot's index).
- `pending_snapshot`: a snapshot received from the leader and not yet persisted.

Indexes are 1-based; index 0 with term 0 is the empty log's sentinel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from raft.messages import Entry, Snapshot


class LogSafetyError(RuntimeError):
    """An operation would rewrite a committed entry: a Raft safety bug, never expected."""


class RaftLog:
    """Entries after the snapshot, with the stable / committed / applied marks."""

    __slots__ = (
        "_entries",
        "applied",
        "committed",
        "pending_snapshot",
        "snap_index",
        "snap_term",
        "unstable_from",
    )

    def __init__(self, snap_index: int = 0, snap_term: int = 0, entries: Iterable[Entry] = ()):
        """A log whose entries (contiguous, after `snap_index`) are all already stable."""
        self.snap_index = snap_index
        self.snap_term = snap_term
        self._entries: list[Entry] = list(entries)
        for offset, e in enumerate(self._entries):
            if e.index != snap_index + 1 + offset:
                raise ValueError(f"entries not contiguous after {snap_index}: found {e.index}")
        self.unstable_from = self.last_index + 1
        self.committed = snap_index
        self.applied = snap_index
        self.pending_snapshot: Snapshot | None = None

    # -- reading -----------------------------------------------------------------

    @property
    def first_index(self) -> int:
        """The first index still held (the one after the snapshot)."""
        return self.snap_index + 1

    @property
    def last_index(self) -> int:
        """The index of the newest entry (the snapshot's if there is none)."""
        return self.snap_index + len(self._entries)

    @property
    def last_term(self) -> int:
        """The term of the newest entry (the snapshot's if there is none)."""
        return self._entries[-1].term if self._entries else self.snap_term

    @property
    def stable_last(self) -> int:
        """The newest index the driver has confirmed durable."""
        return min(self.unstable_from - 1, self.last_index)

    def term(self, index: int) -> int | None:
        """The term of the entry at `index`; None when compacted away or not there."""
        offset = index - self.snap_index
        if offset == 0:
            return self.snap_term
        if offset < 0 or offset > len(self._entries):
            return None
        return self._entries[offset - 1].term

    def match_term(self, index: int, term: int) -> bool:
        """Whether the entry at `index` is known and has `term`."""
        return self.term(index) == term

    def entry(self, index: int) -> Entry:
        """The entry at `index` (which must be held)."""
        return self._entries[index - self.snap_index - 1]

    def slice(self, lo: int, hi: int) -> tuple[Entry, ...]:
        """Entries `lo`..`hi` inclusive; `lo` must be held, `hi` is capped at the last."""
        if lo <= self.snap_index:
            raise ValueError(f"index {lo} is compacted (first is {self.first_index})")
        base = self.snap_index + 1
        return tuple(self._entries[lo - base : hi - base + 1])

    def is_up_to_date(self, last_index: int, last_term: int) -> bool:
        """Whether a log ending at (`last_index`, `last_term`) is at least as new as ours."""
        return last_term > self.last_term or (
            last_term == self.last_term and last_index >= self.last_index
        )

    def find_conflict_by_term(self, index: int, term: int) -> int:
        """The largest index <= `index` whose term is <= `term` (fast backtracking).

        Walking stops at the compacted prefix: below it terms are unknown, so the
        snapshot index is returned and the caller falls back to a snapshot.
        """
        index = min(index, self.last_index)
        while index > self.snap_index:
            t = self.term(index)
            if t is not None and t <= term:
                break
            index -= 1
        return index

    # -- changing ----------------------------------------------------------------

    def append(self, entries: Sequence[Entry]) -> None:
        """Write `entries` at their indexes, dropping any suffix from the first one on."""
        if not entries:
            return
        first = entries[0].index
        if first <= self.committed:
            raise LogSafetyError(f"would overwrite committed index {first} <= {self.committed}")
        if first > self.last_index + 1:
            raise ValueError(f"gap: appending {first} after {self.last_index}")
        if first <= self.last_index:
            del self._entries[first - self.snap_index - 1 :]
            self.unstable_from = min(self.unstable_from, first)
        self._entries.extend(entries)

    def maybe_append(
        self, prev_index: int, prev_term: int, leader_commit: int, entries: Sequence[Entry]
    ) -> int | None:
        """A follower's handling of APP: None if (`prev_index`, `prev_term`) does not match,
        else append what is new (truncating at the first conflict), advance the commit
        index to min(`leader_commit`, last new index) and return the last new index."""
        if not self.match_term(prev_index, prev_term):
            return None
        last_new = prev_index + len(entries)
        for pos, e in enumerate(entries):
            if not self.match_term(e.index, e.term):
                self.append(entries[pos:])
                break
        self.commit_to(min(leader_commit, last_new))
        return last_new

    def commit_to(self, index: int) -> bool:
        """Raise the commit index to `index` (capped at the last index); True if it moved."""
        index = min(index, self.last_index)
        if index > self.committed:
            self.committed = index
            return True
        return False

    def unstable_entries(self) -> list[Entry]:
        """Entries not yet confirmed durable, oldest first."""
        start = max(self.unstable_from, self.first_index)
        return self._entries[start - self.snap_index - 1 :]

    def stable_to(self, index: int, term: int) -> None:
        """The driver made entries up to `index` durable, as of when they had `term`.

        Ignored when the entry has changed since (truncated, or compacted by a snapshot):
        the new entries are then still unstable and come again in the next Ready.
        """
        if index >= self.unstable_from and self.match_term(index, term):
            self.unstable_from = index + 1

    def next_committed(self) -> list[Entry]:
        """Committed, durable entries not yet handed out for applying, in order."""
        hi = min(self.committed, self.stable_last)
        if hi <= self.applied:
            return []
        return list(self.slice(self.applied + 1, hi))

    def has_next_committed(self) -> bool:
        """Whether `next_committed` is non-empty."""
        return min(self.committed, self.stable_last) > self.applied

    def restore(self, snapshot: Snapshot) -> None:
        """Replace everything by a snapshot received from the leader (pending until durable)."""
        meta = snapshot.meta
        if meta.index <= self.committed:
            raise LogSafetyError(f"snapshot {meta.index} is not past the commit {self.committed}")
        self.snap_index = meta.index
        self.snap_term = meta.term
        self._entries = []
        self.unstable_from = meta.index + 1
        self.committed = meta.index
        self.applied = meta.index
        self.pending_snapshot = snapshot

    def stable_snapshot(self, index: int) -> None:
        """The driver made the pending snapshot at `index` durable."""
        if self.pending_snapshot is not None and self.pending_snapshot.meta.index == index:
            self.pending_snapshot = None

    def compact(self, index: int) -> int:
        """Drop entries up to `index` (which must be applied); return its term."""
        if index <= self.snap_index:
            raise ValueError(f"index {index} is already compacted (snapshot at {self.snap_index})")
        if index > self.applied:
            raise ValueError(f"cannot compact to {index}: only {self.applied} is applied")
        term = self.term(index)
        assert term is not None
        del self._entries[: index - self.snap_index]
        self.snap_index = index
        self.snap_term = term
        return term
