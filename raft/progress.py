"""The leader's view of one follower: how far its log matches, and flow control.

A follower's `Progress` is in one of three states:

- PROBE: the leader does not know where the logs match. It sends one APP at a time
  (`probe_sent` pauses it) and waits for the answer, or for the next heartbeat
  response, before trying again with an index moved back by the follower's hint.
- REPLICATE: the logs match up to `match`; the leader streams APPs optimistically
  (`next` moves past what was sent) with at most `max_inflight` unacknowledged.
- SNAPSHOT: the follower needs entries the leader compacted away; a snapshot was
  sent and nothing else goes out until the follower answers (or, if the snapshot
  was lost, until a heartbeat response arrives `retry_ticks` after it was sent).
"""

from __future__ import annotations

from collections import deque
from enum import IntEnum


class ProgressState(IntEnum):
    """The replication mode of one follower, as seen by the leader."""

    PROBE = 0
    REPLICATE = 1
    SNAPSHOT = 2


class Progress:
    """Match/next indexes, the replication mode and the inflight window of a follower."""

    __slots__ = (
        "inflights",
        "match",
        "max_inflight",
        "next",
        "pending_snapshot",
        "probe_sent",
        "recent_active",
        "snapshot_sent_at",
        "state",
    )

    def __init__(self, next_index: int, max_inflight: int) -> None:
        """A follower probed from `next_index`, matching nothing yet."""
        self.match = 0
        self.next = next_index
        self.state = ProgressState.PROBE
        self.probe_sent = False
        self.pending_snapshot = 0
        self.snapshot_sent_at = 0
        self.inflights: deque[int] = deque()
        self.max_inflight = max_inflight
        self.recent_active = False

    def __repr__(self) -> str:
        return (
            f"Progress({self.state.name} match={self.match} next={self.next} "
            f"inflight={len(self.inflights)} paused={self.paused()})"
        )

    def paused(self) -> bool:
        """Whether the leader must not send an APP now."""
        if self.state is ProgressState.PROBE:
            return self.probe_sent
        if self.state is ProgressState.REPLICATE:
            return len(self.inflights) >= self.max_inflight
        return True

    def become_probe(self) -> None:
        """Fall back to one-at-a-time probing from just after what is known to match."""
        if self.state is ProgressState.SNAPSHOT:
            self.next = max(self.match + 1, self.pending_snapshot + 1)
        else:
            self.next = self.match + 1
        self.state = ProgressState.PROBE
        self.probe_sent = False
        self.pending_snapshot = 0
        self.inflights.clear()

    def become_replicate(self) -> None:
        """Stream entries from just after `match`."""
        self.state = ProgressState.REPLICATE
        self.next = self.match + 1
        self.probe_sent = False
        self.inflights.clear()

    def become_snapshot(self, index: int, now: int) -> None:
        """A snapshot at `index` was sent at leader tick `now`; pause until it lands."""
        self.state = ProgressState.SNAPSHOT
        self.pending_snapshot = index
        self.snapshot_sent_at = now
        self.probe_sent = False
        self.inflights.clear()

    def maybe_update(self, index: int) -> bool:
        """The follower matches up to `index`; True if that is news."""
        updated = index > self.match
        if updated:
            self.match = index
            self.probe_sent = False
        self.next = max(self.next, index + 1)
        return updated

    def maybe_decr_to(self, rejected: int, hint: int) -> bool:
        """The follower rejected an APP whose previous index was `rejected`; move `next`
        back (to just after `hint` if that is lower). False if the rejection is stale."""
        if self.state is ProgressState.REPLICATE:
            if rejected <= self.match:
                return False
            self.next = self.match + 1
            return True
        if self.next - 1 != rejected:
            return False
        self.next = max(min(rejected, hint + 1), self.match + 1)
        self.probe_sent = False
        return True

    def sent(self, last: int, count: int) -> None:
        """An APP with `count` entries ending at `last` went out."""
        if self.state is ProgressState.REPLICATE:
            if count:
                self.next = last + 1
                self.inflights.append(last)
        elif self.state is ProgressState.PROBE:
            self.probe_sent = True

    def free_to(self, index: int) -> None:
        """The follower acknowledged everything up to `index`: release those APPs."""
        while self.inflights and self.inflights[0] <= index:
            self.inflights.popleft()

    def free_first(self) -> None:
        """Release the oldest inflight APP (a heartbeat answered: the link works)."""
        if self.inflights:
            self.inflights.popleft()
