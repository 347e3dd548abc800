"""The node driver: what applied commands decided, carried out on this node.

The state machine only records what a command changed (`apply.Effects`); the
log hands each command's effects here (through `apply.Applier`), and the driver
gives each part its share, in this order:

1. committed events to the watch hub (key watchers) and the consumer directory
   (registry keys deleted under a live consumer);
2. queue holds that ended (acknowledged, or taken back) to the delivery, at
   once, so it forgets their ack deadlines and delivery leases; queue
   assignments to the delivery of the node hosting each consumer: held
   until the log has applied its batch (`batch_applied`), so a consumer gets
   what one group commit assigned it in as few WatchResponses as its window
   allows (a hold ended later in the batch is not sent);
3. CQS queues changed to the long-poll waiters and the CQS watch view;
4. leases granted and revoked to the expiry clock.

It also owns the node's one clock, `Timers`. The driver exists before the log
(the log's applier needs it) and is handed its parts once they are built
(`start`); effects of a log replayed before that are of no one's concern.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from queue_server.apply import Effects
from queue_server.lease.expiry import ExpiryClock
from queue_server.mq.delivery import Delivery
from queue_server.mq.state import Assignment
from queue_server.mvcc.store import Event
from queue_server.node.consumers import ConsumerDirectory
from queue_server.node.timers import Timers
from queue_server.watch.hub import WatchHub


@dataclass(frozen=True, slots=True)
class NodeParts:
    """The node-local parts that act on effects."""

    hub: WatchHub
    consumers: ConsumerDirectory
    delivery: Delivery
    cqs_listeners: Sequence[Callable[[str], None]]
    expiry: ExpiryClock


class NodeDriver:
    """Feeds each applied command's effects to the node's parts; keeps its clock."""

    def __init__(self, timers: Timers) -> None:
        self.timers = timers
        self._parts: NodeParts | None = None
        self._commit_listeners: tuple[Callable[[int, list[Event]], None], ...] = ()
        # assignments of the batch being applied, merged per (queue, consumer)
        self._assigned: dict[tuple[bytes, bytes], Assignment] = {}

    def start(self, parts: NodeParts) -> None:
        """The parts are built: effects reach them from now on."""
        self._parts = parts
        self._commit_listeners = (parts.hub.on_commit, parts.consumers.on_commit)

    def applied(self, effects: Effects) -> None:
        parts = self._parts
        if parts is None:
            return
        listeners = self._commit_listeners
        for revision, events in effects.commits:
            for listener in listeners:
                listener(revision, events)
        if effects.released:
            released = parts.delivery.released
            for queue, consumer_id, idx in effects.released:
                released(queue, consumer_id, idx)
        if effects.assignments:
            waiting = self._assigned
            for a in effects.assignments:
                held = waiting.get((a.queue, a.consumer))
                if held is None:
                    waiting[(a.queue, a.consumer)] = Assignment(
                        a.queue, a.consumer, a.node, a.items, a.revision
                    )
                else:
                    # a message handed out again in the batch (taken back
                    # between) goes once, at its last hand-out
                    again = {idx for idx, _ in a.items}
                    held.node = a.node
                    held.items = [item for item in held.items if item[0] not in again] + a.items
                    held.revision = a.revision
        for name in effects.cqs_changed:
            for notify in parts.cqs_listeners:
                notify(name)
        expiry = parts.expiry
        for lease_id, ttl in effects.leases_granted:
            expiry.granted(lease_id, ttl)
        for lease_id in effects.leases_revoked:
            expiry.revoked(lease_id)

    def batch_applied(self) -> None:
        parts = self._parts
        if parts is None or not self._assigned:
            return
        waiting, self._assigned = self._assigned, {}
        deliver = parts.delivery.deliver
        for assignment in waiting.values():
            deliver(assignment)
