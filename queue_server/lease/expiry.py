"""When leases expire: the node's clock over the replicated lease table.

This is the one place that reads the clock for leases. It keeps a deadline per
lease (granted or last kept alive + TTL), sleeps until the earliest one, and
proposes a revoke for each lease past its deadline; the revoke is applied through
the log like a client's. Deadlines are not replicated: after a restart (or, in a
cluster, on becoming leader) every lease gets a full TTL again, as etcd does.

`ExpiryClock` is the policy with time injected (`now` is passed in); the small
`run` coroutine is the only part that sleeps.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

REVOKE_RETRY_SECONDS = 1.0
"""How long an expired lease waits before its revoke is proposed again, if the
first proposal did not remove it (e.g. the log was busy or failed)."""


class ExpiryClock:
    """Deadlines of live leases; a min-heap with lazy deletion."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._deadline: dict[int, float] = {}
        self._ttl: dict[int, int] = {}
        self._heap: list[tuple[float, int]] = []
        self._changed: asyncio.Event | None = None
        # in a cluster, a keepalive on a follower is also sent to the leader
        self.forward_keep_alive: Callable[[int], None] | None = None

    def _push(self, lease_id: int, deadline: float) -> None:
        first = not self._heap or deadline < self._heap[0][0]
        self._deadline[lease_id] = deadline
        heapq.heappush(self._heap, (deadline, lease_id))
        if first and self._changed is not None:
            self._changed.set()

    def granted(self, lease_id: int, ttl: int) -> None:
        self._ttl[lease_id] = ttl
        self._push(lease_id, self.clock() + ttl)

    def revoked(self, lease_id: int) -> None:
        self._deadline.pop(lease_id, None)
        self._ttl.pop(lease_id, None)

    def keep_alive(self, lease_id: int) -> int:
        """Refresh a lease; returns its TTL, or 0 if it is unknown (expired)."""
        ttl = self._ttl.get(lease_id)
        if ttl is None:
            return 0
        if self.forward_keep_alive is not None:
            self.forward_keep_alive(lease_id)
        self._push(lease_id, self.clock() + ttl)
        return ttl

    def remaining(self, lease_id: int) -> int:
        """Whole seconds left, -1 if unknown (etcd's TimeToLive convention)."""
        deadline = self._deadline.get(lease_id)
        if deadline is None:
            return -1
        return max(0, math.floor(deadline - self.clock()))

    def expired(self) -> list[int]:
        """Leases past their deadline; each is pushed back by REVOKE_RETRY_SECONDS
        so it is reported again only if its revoke did not happen."""
        now = self.clock()
        out: list[int] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            if self._deadline.get(lease_id) != deadline:
                continue  # superseded by a keepalive, or revoked
            out.append(lease_id)
            self._push(lease_id, now + REVOKE_RETRY_SECONDS)
        return out

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and self._deadline.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    async def run(self, revoke: Callable[[int], Awaitable[None]]) -> None:
        """Propose a revoke for each lease as it expires (cancel to stop)."""
        self._changed = asyncio.Event()
        while True:
            deadline = self.next_deadline()
            self._changed.clear()
            timeout = None if deadline is None else max(0.0, deadline - self.clock())
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
                continue  # an earlier deadline arrived: recompute
            except TimeoutError:
                pass
            expired = self.expired()
            results = await asyncio.gather(*(revoke(i) for i in expired), return_exceptions=True)
            for lease_id, result in zip(expired, results, strict=True):
                if isinstance(result, BaseException):
                    log.warning("lease revoke failed lease=%x error=%s", lease_id, result)
