"""When deliveries come back on their own: ack deadlines and stuck consumers.

A timer policy of the node driver (`node/timers.py`): `due(now)` is called with
the driver's clock, at most every `interval` seconds, and reads no clock itself,
so tests drive it with a fake one.

- A delivery held past its queue's `ack_deadline` goes back (`QueueRequeue`).
  This polls only the deadlines: an acknowledged delivery is forgotten when
  its ack is applied (`Delivery.released`), not noticed here.
- A consumer whose stream has not taken a waiting delivery for `STUCK_SECONDS`
  is dropped: the watch hub cancels its watch (`WatchHub.cancel_consumer`),
  which has its registry key deleted, and what it held goes to other consumers
  (the seed's 5 s rule).
"""

from __future__ import annotations

import logging

from queue_server.mq.delivery import Delivery
from queue_server.watch.hub import WatchHub

log = logging.getLogger(__name__)

STUCK_SECONDS = 5.0
"""A consumer whose stream has not taken a waiting delivery for this long is
dropped and its messages go to others."""

TICK_SECONDS = 0.5
"""How often the policy runs: half a second is fine against the 5 s stuck rule
and second-granularity deadlines."""

STUCK_REASON = f"queue: consumer did not take a delivery within {STUCK_SECONDS:g}s"
"""The cancel_reason a dropped consumer's watch ends with."""


class AckPolicy:
    """Ack deadlines and stuck streams of the consumers `delivery` holds."""

    interval = TICK_SECONDS

    def __init__(self, delivery: Delivery, hub: WatchHub) -> None:
        self.delivery = delivery
        self.hub = hub

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
                    self.hub.cancel_consumer(consumer.watcher, STUCK_REASON)
                    continue
            else:
                consumer.stuck_head = consumer.stuck_since = None
            if consumer.deadlines:
                # an acknowledged delivery is already gone from `deadlines`
                # (Delivery.released, an effect of the ack's command)
                expired = [idx for idx, at in consumer.deadlines.items() if at <= now]
                for idx in expired:
                    delivery.forget(consumer, idx)
                if expired:
                    delivery.requeue(consumer.queue, consumer.consumer_id, expired)
