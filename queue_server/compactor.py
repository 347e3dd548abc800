"""Auto-compaction: when to compact, and to which revision (etcd's two modes).

`CompactionPlanner` is the policy with time injected: it is told the time and the
store's revision, and answers the revision to compact to, if any. `CompactionPolicy`
is the node driver's timer policy that feeds it the clock and proposes `Compaction` commands, so
the decision is made where the clock is read (the leader, in a cluster) and
applied through the log like any other write.

- periodic (retention a duration, or a number of hours): keep `retention` of
  history. The revision is sampled every retention/10 (at most every 6 minutes
  for long retentions); on each sample the planner compacts to the newest
  revision sampled at least `retention` ago.
- revision (retention a revision count): every 5 minutes, compact to
  current revision - retention.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from queue_server.durations import parse_go_duration
from queue_server.proposals import Spawn

log = logging.getLogger(__name__)

REVISION_CHECK_INTERVAL = 300.0
"""etcd's revision compactor looks every 5 minutes."""
PERIODIC_SAMPLES = 10
"""A retention window is sampled this many times (etcd's retention/10 cadence)."""
MAX_SAMPLE_INTERVAL = 360.0
"""Sample at least every 6 minutes (one tenth of an hour) for long retentions."""


def parse_retention(mode: str, retention: str) -> float:
    """Seconds (periodic) or a revision count (revision); 0 means off."""
    text = retention.strip()
    if mode == "revision":
        if not text.isdigit():
            raise ValueError(
                f"--auto-compaction-retention {retention!r}: expected a revision count"
            )
        return float(int(text))
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text) * 3600.0  # a bare number means hours, as in etcd
    seconds = parse_go_duration(text)
    if seconds is None or seconds < 0:
        raise ValueError(f"--auto-compaction-retention {retention!r}: expected e.g. 1h or 30m")
    return seconds


@dataclass(slots=True)
class CompactionPlanner:
    """The compaction policy; feed it `tick(now, revision)` every `interval` s."""

    mode: str
    retention: float
    last_compacted: int = 0
    _samples: deque[tuple[float, int]] = field(default_factory=deque, init=False)

    @property
    def interval(self) -> float:
        if self.mode == "revision":
            return REVISION_CHECK_INTERVAL
        return min(self.retention / PERIODIC_SAMPLES, MAX_SAMPLE_INTERVAL)

    def tick(self, now: float, revision: int) -> int | None:
        """The revision to compact to now, or None."""
        if self.retention <= 0:
            return None
        if self.mode == "revision":
            target = revision - int(self.retention)
        else:
            self._samples.append((now, revision))
            target = 0
            # the newest sample that is at least `retention` old
            while self._samples and now - self._samples[0][0] >= self.retention - 1e-9:
                target = self._samples.popleft()[1]
        if target <= self.last_compacted or target <= 0:
            return None
        self.last_compacted = target
        return target


class CompactionPolicy:
    """Timer policy: ticks the planner and proposes the compactions it asks for."""

    def __init__(
        self,
        planner: CompactionPlanner,
        current_revision: Callable[[], int],
        compact: Callable[[int], Awaitable[None]],
        spawn: Spawn,
    ) -> None:
        self.planner = planner
        self.interval = planner.interval
        self.current_revision = current_revision
        self.compact = compact
        self.spawn = spawn

    def due(self, now: float) -> None:
        target = self.planner.tick(now, self.current_revision())
        if target is not None:
            self.spawn(self._compact(target))

    async def _compact(self, target: int) -> None:
        try:
            await self.compact(target)
            log.info("auto-compaction revision=%d mode=%s", target, self.planner.mode)
        except Exception as e:  # e.g. already compacted by a client: try next time
            log.warning("auto-compaction failed revision=%d error=%s", target, e)
