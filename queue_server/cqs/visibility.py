"""CQS visibility timeouts as time passes: the node proposes the expiry.

A dequeued notification is in flight until its visibility passes; then it is
pending again. That change is replicated state (`state.py`), so apply makes it,
and apply reads no clock: every CQS command first expires what is due at the
`now_ms` it carries. Without a timer, a queue nobody calls keeps showing its
notifications in flight long past their timeout (pending 0, no SLA lag), and a
consumer that is stuck goes unnoticed.

`VisibilityTimer` is a timer policy of the node driver (`node/timers.py`): at
each `due(now)` it looks, for every CQS queue, at when its next in-flight
notification becomes visible, and for each queue where that has passed it
proposes `commands.expire` stamped with the proposer's clock, so every member
applies the same expiry. One proposal per queue is in flight at a time. In a
cluster only the member that may decide does (`may_propose`: the leader, as
only the leader proposes lease revokes); the others apply what it proposes.

What must not be here: any change of state other than through a proposal;
imports of the node driver (it is above this package).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from queue_server.cqs import commands
from queue_server.cqs.state import CqsState, QueueNotFound
from queue_server.proposals import ApplyResult, Propose, Spawn

log = logging.getLogger(__name__)

EXPIRY_CHECK_SECONDS = 0.1
"""How often queues are looked at: an expiry shows in the figures (and the
notification can be dequeued again) at most this long after its time, plus one
proposal. Looking costs one heap peek per CQS queue."""


class VisibilityTimer:
    """Proposes the expiry of in-flight CQS notifications whose time has come."""

    interval = EXPIRY_CHECK_SECONDS

    def __init__(
        self,
        cqs: CqsState,
        propose: Propose,
        spawn: Spawn,
        wall_ms: Callable[[], int],
        may_propose: Callable[[], bool] | None = None,
    ) -> None:
        self.cqs = cqs
        self.propose = propose
        self.spawn = spawn
        self.wall_ms = wall_ms
        self.may_propose = may_propose
        self._proposing: set[str] = set()  # queues with an expiry proposal under way

    def due(self, now: float) -> None:
        """Propose an expiry for each queue whose next visibility has passed."""
        if self.may_propose is not None and not self.may_propose():
            return
        wall = self.wall_ms()
        for name, q in self.cqs.queues.items():
            if name in self._proposing:
                continue
            at = q.tree.earliest_visible()
            if at is not None and at <= wall:
                self._proposing.add(name)
                self.spawn(self._expire(name, wall))

    async def _expire(self, name: str, wall: int) -> None:
        result: ApplyResult | Exception
        try:
            result = await self.propose(commands.expire(name, wall))
        except Exception as e:  # the next tick tries again
            result = e
        finally:
            self._proposing.discard(name)
        if isinstance(result, Exception) and not isinstance(result, QueueNotFound):
            log.warning("cqs expiry failed queue=%s error=%s", name, result)
