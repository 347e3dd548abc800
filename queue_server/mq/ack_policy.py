"""When deliveries come back on their own: ack deadlines and stuck consumers.

A timer policy of the node driver (`node/timers.py`): `due(now)` is called with
the driver's clock, at most every `interval` seconds, and reads no clock itself,
so tests drive it with a fake one.

- A delivery held past its queue's `ack_deadline` goes back (`QueueRequeue`).
- A consumer whose stream has not taken a waiting delivery for `STUCK_SECONDS`
  is dropped: its watch is cancelled, its registry key deleted, and what it held
  goes to other consumers (the seed's 5 s rule).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from queue_server.mq.delivery import Delivery, LocalConsumer

log = logging.getLogger(__name__)

STUCK_SECONDS = 5.0
"""A consumer whose stream has not taken a waiting delivery for this long is
dropped and its messages go to others."""

TICK_SECONDS = 0.5
"""How often the policy runs: half a second is fine against the 5 s stuck rule
and second-granularity deadlines."""


class AckPolicy:
    """Ack deadlines and stuck streams of the consumers `delivery` holds."""

    interval = TICK_SECONDS

    def __init__(self, delivery: Delivery, drop: Callable[[LocalConsumer], None]) -> None:
        self.delivery = delivery
        self.drop = drop

    def due(self, now: float) -> None:
        delivery = self.delivery
        for consumer in list(delivery.by_watcher.values()):
            stream = consumer.watcher.stream
            if stream.outbox:
                head = stream.outbox[0]
                if consumer.stuck_head is not head:
                    consumer.stuck_head, consumer.stuck_since = head, now
                elif (
                    consumer.stuck_since is not None and now - consumer.stuck_since >= STUCK_SECONDS
                ):
                    log.info(
                        "queue consumer dropped queue=%s consumer=%s reason=stuck",
                        consumer.queue.decode(errors="replace"),
                        consumer.consumer_id.decode(errors="replace"),
                    )
                    self.drop(consumer)
                    continue
            else:
                consumer.stuck_head = consumer.stuck_since = None
            if consumer.deadlines:
                expired = []
                for idx, deadline in list(consumer.deadlines.items()):
                    if not delivery.holds(consumer, idx):
                        delivery.forget(consumer, idx)  # acknowledged, or taken back
                    elif deadline <= now:
                        delivery.forget(consumer, idx)
                        expired.append(idx)
                if expired:
                    delivery.requeue(consumer.queue, consumer.consumer_id, expired)
