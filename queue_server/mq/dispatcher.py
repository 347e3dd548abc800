"""The node-local part of etcd-key queues: who holds which message, and delivery.

What belongs here: per queue, the pending messages in idx order, the consumers
(watch streams on `/q/{name}/c/{uuid}`) with the messages each holds, and the
policy that hands pending messages out. No I/O: deliveries are appended to the
consumer's watch stream outbox; changes that must be replicated (registry keys,
requeues) are proposed through `propose`, scheduled with `spawn`.

Theory of operation
-------------------
The dispatcher learns every change from the state machine's committed events: a
new message key is pending; a deleted one (an ack, a cancel, a lease expiry, a
dead-lettering) leaves pending or the consumer holding it. Pending messages go out
oldest first, round-robin over the queue's consumers, each holding at most
`prefetch` unacknowledged messages; messages given to one consumer in one pass
share one WatchResponse (several when they are large: DELIVERY_RESPONSE_BYTES).

A consumer that goes away (watch cancelled, stream closed, or a stream that has
not taken a delivery for `STUCK_SECONDS`) gives its messages back: a
`QueueRequeue` command counts the failed delivery (and dead-letters at
max_deliveries), and once it is applied the messages still queued are pending
again, in idx order. A queue with an `ack_deadline` takes a message back the same
way when it is held too long. Nothing here is replicated: after a restart every
message is pending, which is at-least-once delivery.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedDict

from etcdserverpb import internal_pb2, kv_pb2, rpc_pb2
from queue_server.cqs.watch_view import CqsWatchConsumers
from queue_server.mq import keys
from queue_server.mq.state import QueueState
from queue_server.mvcc.store import Event, MVCCStore
from queue_server.watch.hub import Watcher

log = logging.getLogger(__name__)

STUCK_SECONDS = 5.0
"""A consumer whose stream has not taken a waiting delivery for this long is
dropped and its messages go to others (the seed's 5 s rule)."""

DELIVERY_RESPONSE_BYTES = 2 * 1024 * 1024
"""Bytes of keys and values one delivery WatchResponse may carry; more deliveries
go in further responses. gRPC clients refuse messages over 4 MiB by default (the
python etcd3 client, generated stubs; etcd's Go client accepts 2 GiB), and a
response over that breaks the consumer's stream, which gives its messages back,
and they come back in one response again. Half of 4 MiB leaves room for the
framing; one message alone (at most --max-request-bytes, 1.5 MiB by default) is
always sent."""

Propose = Callable[[internal_pb2.Command], Awaitable[object]]
Spawn = Callable[[Coroutine[Any, Any, None]], object]


@dataclass(eq=False, slots=True)
class Consumer:
    """One consumer: a watch on `/q/{name}/c/{uuid}` and what it holds."""

    consumer_id: bytes
    queue: bytes
    watcher: Watcher
    held: dict[int, bytes] = field(default_factory=dict)  # idx -> message key
    deadlines: dict[int, float] = field(default_factory=dict)  # idx -> ack deadline
    leases: dict[int, int] = field(default_factory=dict)  # idx -> delivery lease id
    stuck_since: float | None = None
    stuck_head: object = None


@dataclass(eq=False, slots=True)
class QueueRuntime:
    """The dispatching state of one queue on this node."""

    name: bytes
    pending: SortedDict = field(default_factory=SortedDict)  # idx -> message key
    holder: dict[int, Consumer] = field(default_factory=dict)
    consumers: list[Consumer] = field(default_factory=list)
    next_consumer: int = 0
    dispatcher_registered: bool = False


class Dispatcher:
    """All queues dispatched by this node."""

    def __init__(
        self,
        store_of: Callable[[], MVCCStore],
        queues: QueueState,
        node_name: str,
        propose: Propose,
        spawn: Spawn,
        clock: Callable[[], float] = time.monotonic,
        new_lease_id: Callable[[], int] | None = None,
    ) -> None:
        self._store_of = store_of
        self.queues = queues
        self.node_name = node_name.encode()
        self.propose = propose
        self.spawn = spawn
        self.clock = clock
        self.new_lease_id = new_lease_id
        # delivery leases: lease id -> (consumer, idx) of a delivery under an ack deadline
        self.delivery_leases: dict[int, tuple[Consumer, int]] = {}
        self.runtimes: dict[bytes, QueueRuntime] = {}
        self.by_watcher: dict[Watcher, Consumer] = {}
        self.delivered = 0
        self.redelivered = 0
        # consumers of CQS queues are served by the CQS watch view
        self.cqs_view: CqsWatchConsumers | None = None

    def runtime(self, name: bytes) -> QueueRuntime:
        rt = self.runtimes.get(name)
        if rt is None:
            rt = self.runtimes[name] = QueueRuntime(name)
        return rt

    def rebuild(self) -> None:
        """Every stored message is pending (after a start or a restore).

        Consumer registry keys that name this node but no consumer connected here
        are left from before a restart (a crash runs no unregister): they are
        deleted, so the registry lists live consumers only."""
        store = self._store_of()
        live = {c.consumer_id for c in self.by_watcher.values()}
        for spelling in (keys.SHORT, keys.LONG):
            for kv in store.range(spelling, spelling[:-1] + b"0").kvs:
                qk = keys.parse(kv.key)
                if qk is None:
                    continue
                if qk.kind == "message":
                    self.runtime(qk.name).pending[qk.idx] = kv.key
                elif (
                    qk.kind == "consume" and kv.value == self.node_name and qk.consumer not in live
                ):
                    self._delete(kv.key)

    # -- consumers --------------------------------------------------------------

    def register(self, watcher: Watcher, qk: keys.QueueKey) -> None:
        """A watch on a consumer key: a new consumer of the queue."""
        consumer_id = (
            qk.consumer if keys.valid_consumer_id(qk.consumer) else str(uuid.uuid4()).encode()
        )
        if (
            self.cqs_view is not None
            and qk.spelling == keys.SHORT
            and self.queues.cqs.is_cqs(qk.name)
        ):
            self.cqs_view.register(watcher, qk.name.decode(), consumer_id)
            self._put(keys.consumer_key(keys.SHORT, qk.name, consumer_id), self.node_name)
            self._put(keys.registry_key(keys.SHORT, qk.name), self.node_name)
            return
        q = self.queues.queue(qk.name, qk.spelling)
        consumer = Consumer(consumer_id, qk.name, watcher)
        rt = self.runtime(qk.name)
        rt.consumers.append(consumer)
        self.by_watcher[watcher] = consumer
        self._put(keys.consumer_key(q.spelling, q.name, consumer_id), self.node_name)
        if not rt.dispatcher_registered:
            rt.dispatcher_registered = True
            self._put(keys.registry_key(q.spelling, q.name), self.node_name)
        self._dispatch(rt)

    def unregister(self, watcher: Watcher) -> None:
        """The consumer's watch ended: it gives back what it held."""
        view = self.cqs_view
        viewer = view.unregister(watcher) if view is not None else None
        if view is not None and viewer is not None:
            if not any(c.consumer_id == viewer.consumer_id for c in view.by_watcher.values()):
                name = viewer.queue.encode()
                self._delete(keys.consumer_key(keys.SHORT, name, viewer.consumer_id))
            return
        consumer = self.by_watcher.pop(watcher, None)
        if consumer is None:
            return
        rt = self.runtime(consumer.queue)
        rt.consumers.remove(consumer)
        q = self.queues.queues.get(consumer.queue)
        # another watch on the same consumer key (a client that reconnected before
        # its old stream was noticed closing) keeps the registry key
        same_id = any(c.consumer_id == consumer.consumer_id for c in rt.consumers)
        if q is not None and not same_id:
            self._delete(keys.consumer_key(q.spelling, q.name, consumer.consumer_id))
        self._give_back(rt, consumer, list(consumer.held))

    def _give_back(self, rt: QueueRuntime, consumer: Consumer, idxs: list[int]) -> None:
        if not idxs:
            return
        returned: dict[int, bytes] = {}
        for idx in idxs:
            key = consumer.held.pop(idx, None)
            self._release(consumer, idx)
            if key is not None and rt.holder.get(idx) is consumer:
                del rt.holder[idx]
                returned[idx] = key
        if not returned:
            return
        self.redelivered += len(returned)
        command = internal_pb2.Command()
        command.queue_requeue.queue = rt.name
        command.queue_requeue.idx.extend(sorted(returned))

        async def requeue() -> None:
            try:
                await self.propose(command)
            finally:
                store = self._store_of()
                for idx, key in returned.items():
                    if store.get(key) is not None and idx not in rt.holder:
                        rt.pending[idx] = key
                self._dispatch(rt)

        self.spawn(requeue())

    def _put(self, key: bytes, value: bytes) -> None:
        self.spawn(
            self._propose_quietly(
                internal_pb2.Command(put=rpc_pb2.PutRequest(key=key, value=value))
            )
        )

    def _delete(self, key: bytes) -> None:
        command = internal_pb2.Command(delete_range=rpc_pb2.DeleteRangeRequest(key=key))
        self.spawn(self._propose_quietly(command))

    async def _propose_quietly(self, command: internal_pb2.Command) -> None:
        try:
            await self.propose(command)
        except Exception as e:  # the registry is advisory; delivery does not depend on it
            log.warning("queue registry write failed error=%s", e)

    # -- delivery ---------------------------------------------------------------

    def on_commit(self, revision: int, events: list[Event]) -> None:
        """State machine hook: new messages become pending, deleted ones leave."""
        touched: set[QueueRuntime] = set()
        for e in events:
            key = e.kv.key
            if not key.startswith((keys.SHORT, keys.LONG)):
                continue
            qk = keys.parse(key)
            if qk is None:
                continue
            if qk.kind == "message":
                rt = self.runtime(qk.name)
                if e.is_delete:
                    if rt.pending.pop(qk.idx, None) is None:
                        holder = rt.holder.pop(qk.idx, None)
                        if holder is not None:
                            holder.held.pop(qk.idx, None)
                            self._release(holder, qk.idx)
                            touched.add(rt)
                elif e.prev_kv is None:
                    rt.pending[qk.idx] = key
                    touched.add(rt)
            elif qk.kind == "config":
                touched.add(self.runtime(qk.name))
        for rt in touched:
            self._dispatch(rt)

    def _dispatch(self, rt: QueueRuntime) -> None:
        """Hand pending messages out, oldest first, round-robin over consumers
        with room in their prefetch window."""
        if not rt.pending or not rt.consumers:
            return
        q = self.queues.queues.get(rt.name)
        prefetch = q.settings.prefetch if q is not None else 1
        deadline = q.settings.ack_deadline if q is not None else 0.0
        batches: dict[Consumer, list[tuple[bytes, int]]] = {}
        consumers = rt.consumers
        n = len(consumers)
        without_room = 0
        pending = rt.pending
        now = self.clock() if deadline else 0.0
        while pending and without_room < n:
            c = consumers[rt.next_consumer % n]
            rt.next_consumer += 1
            if len(c.held) >= prefetch:
                without_room += 1
                continue
            without_room = 0
            idx, key = pending.popitem(0)
            c.held[idx] = key
            lease_id = 0
            if deadline:
                c.deadlines[idx] = now + deadline
                if self.new_lease_id is not None:
                    lease_id = self.new_lease_id()
                    c.leases[idx] = lease_id
                    self.delivery_leases[lease_id] = (c, idx)
            rt.holder[idx] = c
            batches.setdefault(c, []).append((key, lease_id))
        store = self._store_of()
        for c, message_keys in batches.items():
            self._deliver(c, store, message_keys)

    def _deliver(
        self, consumer: Consumer, store: MVCCStore, message_keys: list[tuple[bytes, int]]
    ) -> None:
        """Push the messages to the consumer's stream: one WatchResponse, or more
        when they would carry over DELIVERY_RESPONSE_BYTES. A delivery under an
        ack deadline carries its delivery lease instead of the message's own."""
        response = rpc_pb2.WatchResponse(watch_id=consumer.watcher.watch_id)
        response.header.revision = store.revision
        size = 0
        for key, delivery_lease in message_keys:
            kv = store.get(key)
            if kv is None:  # pragma: no cover - deletes leave pending before this
                continue
            entry = len(kv.key) + len(kv.value)
            if response.events and size + entry > DELIVERY_RESPONSE_BYTES:
                self.delivered += len(response.events)
                consumer.watcher.stream.push(response, size)
                response = rpc_pb2.WatchResponse(watch_id=consumer.watcher.watch_id)
                response.header.revision = store.revision
                size = 0
            ev = response.events.add()
            ev.type = kv_pb2.Event.PUT
            dst = ev.kv
            dst.key = kv.key
            dst.create_revision = kv.create_revision
            dst.mod_revision = kv.mod_revision
            dst.version = kv.version
            dst.value = kv.value
            if delivery_lease or kv.lease:
                dst.lease = delivery_lease or kv.lease
            size += entry
        if response.events:
            self.delivered += len(response.events)
            consumer.watcher.stream.push(response, size)

    def _release(self, consumer: Consumer, idx: int) -> None:
        """Forget the deadline and delivery lease of a message the consumer no
        longer holds."""
        consumer.deadlines.pop(idx, None)
        lease_id = consumer.leases.pop(idx, None)
        if lease_id is not None:
            self.delivery_leases.pop(lease_id, None)

    # -- delivery leases: the ack deadline as an etcd lease -----------------------

    def _delivery(self, lease_id: int) -> tuple[Consumer, int, float] | None:
        found = self.delivery_leases.get(lease_id)
        if found is None:
            return None
        consumer, idx = found
        q = self.queues.queues.get(consumer.queue)
        ttl = q.settings.ack_deadline if q is not None else 0.0
        return consumer, idx, ttl

    def keep_alive(self, lease_id: int, now: float) -> int | None:
        """LeaseKeepAlive on a delivery lease: the ack deadline starts over.
        Returns the TTL, or None if `lease_id` is not a delivery lease."""
        found = self._delivery(lease_id)
        if found is None:
            return None
        consumer, idx, ttl = found
        consumer.deadlines[idx] = now + ttl
        return max(1, round(ttl))

    def time_to_live(self, lease_id: int, now: float) -> tuple[int, int, bytes] | None:
        """(remaining s, granted s, message key) of a delivery lease, or None."""
        found = self._delivery(lease_id)
        if found is None:
            return None
        consumer, idx, ttl = found
        remaining = max(0, int(consumer.deadlines.get(idx, now) - now))
        return remaining, max(1, round(ttl)), consumer.held.get(idx, b"")

    def revoke(self, lease_id: int) -> bool:
        """LeaseRevoke on a delivery lease: the consumer gives the message back
        now (a negative acknowledgement). False if not a delivery lease."""
        found = self.delivery_leases.get(lease_id)
        if found is None:
            return False
        consumer, idx = found
        self._give_back(self.runtime(consumer.queue), consumer, [idx])
        return True

    # -- time -------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Drop consumers whose stream is stuck; take back messages held past
        their queue's ack deadline."""
        for consumer in list(self.by_watcher.values()):
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
            expired = [idx for idx, d in consumer.deadlines.items() if d <= now]
            if expired:
                self._give_back(self.runtime(consumer.queue), consumer, expired)

    def drop(self, consumer: Consumer) -> None:
        """Unregister a consumer and end its watch with a cancel response."""
        watcher = consumer.watcher
        stream = watcher.stream
        stream.watchers.pop(watcher.watch_id, None)
        self.unregister(watcher)
        response = rpc_pb2.WatchResponse(watch_id=watcher.watch_id, canceled=True)
        response.cancel_reason = "queue: consumer did not take a delivery within 5s"
        stream.push(response)
