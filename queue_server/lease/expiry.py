"""When leases expire: the node's clock over the replicated lease table.

`ExpiryClock` keeps a deadline per lease (granted or last kept alive + TTL) on
the node's clock (injected). `ExpiryPolicy`, a timer policy of the node driver,
proposes a revoke for each lease past its deadline; the revoke is applied through
the log like a client's. Deadlines are not replicated: after a restart (or, in a
cluster, on becoming leader) every lease gets a full TTL again, as etcd does.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Awaitable, Callable

from queue_server.proposals import Spawn

log = logging.getLogger(__name__)

REVOKE_RETRY_SECONDS = 1.0
"""How long an expired lease waits before its revoke is proposed again, if the
first proposal did not remove it (e.g. the log was busy or failed)."""

CHECK_SECONDS = 0.1
"""How often deadlines are looked at (etcd's lessor checks every 500 ms)."""


class ExpiryClock:
    """Deadlines of live leases; a min-heap with lazy deletion."""

    def __init__(
        self,
        clock: Callable[[], float],
        forward_keep_alive: Callable[[int], None] | None = None,
    ) -> None:
        """`forward_keep_alive(lease_id)`, in a cluster, also refreshes the lease
        on the leader, whose clock decides expiry."""
        self.clock = clock
        self._deadline: dict[int, float] = {}
        self._ttl: dict[int, int] = {}
        self._heap: list[tuple[float, int]] = []
        self.forward_keep_alive = forward_keep_alive

    def _push(self, lease_id: int, deadline: float) -> None:
        self._deadline[lease_id] = deadline
        heapq.heappush(self._heap, (deadline, lease_id))

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

    def expired(self, now: float) -> list[int]:
        """Leases past their deadline at `now`; each is pushed back by
        REVOKE_RETRY_SECONDS so it is reported again only if its revoke did not
        happen."""
        out: list[int] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            if self._deadline.get(lease_id) != deadline:
                continue  # superseded by a keepalive, or revoked
            out.append(lease_id)
            self._push(lease_id, now + REVOKE_RETRY_SECONDS)
        return out


class ExpiryPolicy:
    """Timer policy: a revoke proposed for each lease past its deadline."""

    interval = CHECK_SECONDS

    def __init__(
        self,
        clock: ExpiryClock,
        revoke: Callable[[int], Awaitable[None]],
        spawn: Spawn,
    ) -> None:
        self.clock = clock
        self.revoke = revoke
        self.spawn = spawn

    def due(self, now: float) -> None:
        for lease_id in self.clock.expired(now):
            self.spawn(self._revoke(lease_id))

    async def _revoke(self, lease_id: int) -> None:
        try:
            await self.revoke(lease_id)
        except Exception as e:
            log.warning("lease revoke failed lease=%x error=%s", lease_id, e)
