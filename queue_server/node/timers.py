"""The node's one clock: a timer loop over periodic policies.

A policy is an object with an `interval` (seconds) and `due(now)`: the loop calls
`due` with the clock's time once `interval` has passed since its last call. The
policies read no clock themselves (ack deadlines, stuck consumers, lease expiry,
session keepalive, progress notification, compaction, CQS visibility), so tests
drive them, and `Timers.run_due(now)`, with a fake clock.

The clock has two faces: `clock` (monotonic seconds) times the policies, and
`wall_ms` (Unix milliseconds) is what a policy stamps on a command it proposes
(apply reads no clock: the CQS visibility expiry carries the proposer's time).
A test hands in one fake for both.

Nothing else of the node keeps a clock of its own: the lease expiry clock, the
Lease service, the lease id generator's seed, the auth tokens, the metrics
collector, the dashboard and the native transport's HTTP/2 rate limits and
pings take this one's faces as a required argument (`server.py` hands them in;
the transport gets the bare callable, as it sits below the node).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

RESOLUTION_SECONDS = 0.05
"""How often the loop looks at the clock: finer than any policy's interval."""


class TimerPolicy(Protocol):
    """Something the node does as time passes."""

    @property
    def interval(self) -> float:
        """Seconds between two calls of `due`."""
        ...

    def due(self, now: float) -> None:
        """Act on the time `now` (seconds, the driver's clock)."""
        ...


@dataclass(eq=False, slots=True)
class _Entry:
    name: str
    policy: TimerPolicy
    next_at: float


class Timers:
    """Every periodic policy of one node, on one clock."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self.clock = clock
        self.wall = wall
        self._entries: list[_Entry] = []

    def wall_ms(self) -> int:
        """The wall clock in Unix milliseconds: the stamp of a proposed command."""
        return int(self.wall() * 1000)

    def add(self, name: str, policy: TimerPolicy) -> None:
        """Call `policy.due` every `policy.interval` seconds from now."""
        self._entries.append(_Entry(name, policy, self.clock() + policy.interval))

    def run_due(self, now: float) -> None:
        """Call every policy whose time has come (a failing one is logged and
        keeps its schedule: one bad tick must not stop the others)."""
        for entry in self._entries:
            if entry.next_at > now:
                continue
            entry.next_at = now + entry.policy.interval
            try:
                entry.policy.due(now)
            except Exception:
                log.exception("timer policy failed policy=%s", entry.name)

    async def run(self) -> None:
        """The loop (cancel the task to stop it)."""
        while True:
            await asyncio.sleep(RESOLUTION_SECONDS)
            self.run_due(self.clock())


@dataclass(slots=True)
class Every:
    """A policy from a function: `action(now)` every `interval` seconds."""

    interval: float
    action: Callable[[float], None]

    def due(self, now: float) -> None:
        self.action(now)
