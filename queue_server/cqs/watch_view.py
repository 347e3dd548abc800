"""The etcd view of CQS queues: consumers that are plain etcd watches.

A watch on `/q/{queue}/c/{uuid}` of a CQS queue receives the queue's
notifications in SLA order (the queue's order, without prefix grouping), as PUT events of a
delivery key `/q/{queue}/{seq}/{ack_token}` whose value is the notification as
JSON (proto field names, `sla_timestamp` in RFC 3339, `ack_token` included).
Deleting that key acknowledges it, exactly like BatchAcknowledge (the KV service
turns the delete into a `CqsSettle`). Unacknowledged deliveries come back after
the visibility timeout, like any CQS delivery.

What belongs here (node-local, nothing replicated): the consumers of each queue
and the tokens each holds. A consumer holds at most its queue's `prefetch`
deliveries; more are taken by proposing a `CqsDequeue` for it, one proposal per
queue at a time. A consumer that goes away gives what it holds back at once
(`CqsSettle` with `release`). A queue whose next notification becomes visible
later is looked at again then: this is the node driver's visibility policy
(`due(now)`, on the node's clock).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from google.protobuf import json_format

from etcdserverpb import internal_pb2, kv_pb2, rpc_pb2
from queue_server.cqs import commands
from queue_server.cqs.state import CqsState
from queue_server.keyspace import grammar as keys
from queue_server.mvcc.store import MVCCStore
from queue_server.proposals import Propose, Spawn
from queue_server.watch.hub import Watcher

log = logging.getLogger(__name__)

VISIBILITY_CHECK_SECONDS = 0.05
"""How often queues waiting for a notification to become visible are looked at."""


def delivery_key(queue: str, seq: int, token: str) -> bytes:
    return keys.message_key(keys.SHORT, queue.encode(), seq, token.encode())


@dataclass(eq=False, slots=True)
class ViewConsumer:
    """One etcd watch consuming a CQS queue, and the tokens it holds."""

    consumer_id: bytes
    queue: str
    watcher: Watcher
    held: set[str] = field(default_factory=set)


class CqsWatchConsumers:
    """All etcd-watch consumers of CQS queues on this node."""

    def __init__(
        self,
        cqs: CqsState,
        store_of: Callable[[], MVCCStore],
        propose: Propose,
        spawn: Spawn,
        visibility_timeout: float,
        clock: Callable[[], float],
        wall_ms: Callable[[], int],
    ) -> None:
        self.clock = clock
        """The node's monotonic clock (`Timers.clock`): when to look at a queue again."""
        self.wall_ms = wall_ms
        """The node's wall clock (`Timers.wall_ms`): the stamp of every CQS command,
        and the time visibility is judged at."""
        self.cqs = cqs
        self._store_of = store_of
        self.propose = propose
        self.spawn = spawn
        self.visibility_ms = int(visibility_timeout * 1000)
        self.by_queue: dict[str, list[ViewConsumer]] = {}
        self.by_watcher: dict[Watcher, ViewConsumer] = {}
        self._pumping: set[str] = set()
        self._again: set[str] = set()
        self._wake: dict[str, float] = {}  # queue -> when to look again (clock())

    def register(self, watcher: Watcher, queue: str, consumer_id: bytes) -> None:
        c = ViewConsumer(consumer_id, queue, watcher)
        self.by_queue.setdefault(queue, []).append(c)
        self.by_watcher[watcher] = c
        self.on_change(queue)

    def unregister(self, watcher: Watcher) -> ViewConsumer | None:
        """The watch ended: what it held is visible again at once."""
        c = self.by_watcher.pop(watcher, None)
        if c is None:
            return None
        consumers = self.by_queue.get(c.queue, [])
        if c in consumers:
            consumers.remove(c)
        if not consumers:
            self.by_queue.pop(c.queue, None)
        if c.held and c.queue in self.cqs.queues:
            command = commands.settle(c.queue, sorted(c.held), self.wall_ms(), release=True)
            self.spawn(self._propose_quietly(command))
        return c

    async def _propose_quietly(self, command: internal_pb2.Command) -> None:
        try:
            await self.propose(command)
        except Exception as e:  # the visibility timeout brings them back anyway
            log.warning("cqs release failed error=%s", e)

    def on_change(self, queue: str) -> None:
        """The queue may have visible notifications, or a consumer has room."""
        if queue not in self.by_queue:
            return
        if queue in self._pumping:
            self._again.add(queue)
            return
        self._pumping.add(queue)
        self.spawn(self._pump(queue))

    async def _pump(self, queue: str) -> None:
        try:
            while True:
                self._again.discard(queue)
                if not await self._deliver_once(queue) and queue not in self._again:
                    return
        finally:
            self._pumping.discard(queue)

    async def _deliver_once(self, queue: str) -> bool:
        """Give the consumer with the most room one batch; False if nothing to do."""
        q = self.cqs.queues.get(queue)
        consumers = self.by_queue.get(queue)
        if q is None or not consumers:
            return False
        now = self.wall_ms()
        for c in consumers:
            c.held = {t for t in c.held if q.tree.held(t, now) is not None}
        c = max(consumers, key=lambda c: q.prefetch - len(c.held))
        room = q.prefetch - len(c.held)
        if room <= 0:
            return False
        next_visible = q.tree.earliest_visible()
        if not len(q.tree) and (next_visible is None or next_visible > now):
            if next_visible is not None:
                self._wake_at(queue, next_visible - now)
            return False
        command = commands.dequeue(queue, room, commands.UNGROUPED, self.visibility_ms, now)
        try:
            result = await self.propose(command)
        except Exception as e:
            log.warning("cqs delivery failed queue=%s error=%s", queue, e)
            return False
        if not isinstance(result, internal_pb2.CqsDequeueResponse):
            return False
        if c.watcher not in self.by_watcher:  # gone while we waited: give them back
            c.held.update(n.ack_token for n in result.notifications)
            self.by_watcher[c.watcher] = c
            self.unregister(c.watcher)
            return True
        self._push(c, result)
        return bool(result.notifications)

    def _push(self, c: ViewConsumer, result: internal_pb2.CqsDequeueResponse) -> None:
        if not result.notifications:
            return
        store = self._store_of()
        response = rpc_pb2.WatchResponse(watch_id=c.watcher.watch_id)
        response.header.revision = store.revision
        size = 0
        for n, seq in zip(result.notifications, result.seq, strict=True):
            c.held.add(n.ack_token)
            ev = response.events.add()
            ev.type = kv_pb2.Event.PUT
            ev.kv.key = delivery_key(c.queue, seq, n.ack_token)
            ev.kv.value = json_format.MessageToJson(
                n, preserving_proto_field_name=True, indent=None
            ).encode()
            ev.kv.create_revision = ev.kv.mod_revision = store.revision
            ev.kv.version = 1
            size += len(ev.kv.key) + len(ev.kv.value)
        c.watcher.stream.push(response, size)

    def _wake_at(self, queue: str, delay_ms: float) -> None:
        """Look at the queue again once `delay_ms` have passed (a notification
        becomes visible then)."""
        if queue not in self._wake:
            self._wake[queue] = self.clock() + max(0.0, delay_ms) / 1000 + 0.001

    # -- the timer policy of the node driver: visibility timeouts --------------

    interval = VISIBILITY_CHECK_SECONDS

    def due(self, now: float) -> None:
        """Queues whose next notification has become visible get a delivery."""
        if not self._wake:
            return
        ready = [queue for queue, at in self._wake.items() if at <= now]
        for queue in ready:
            del self._wake[queue]
            self.on_change(queue)
