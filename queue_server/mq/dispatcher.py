"""The node-local part of etcd-key queues: consumer watches and delivery.

The state machine (`state.py`) decides which consumer holds which message, the
same on every member. What belongs here is what only the node hosting a
consumer's watch can do:

- registering a watch on `/q/{name}/c/{uuid}` as a consumer: a put of that
  registry key naming this node (on the node's session lease in a cluster, so
  the key goes when the node dies), and of `/q/{name}`, naming the member that
  orders the assignments (the leader; this node when alone);
- pushing what the state machine assigns to a consumer hosted here into its
  watch stream, as PUT events of the message key, or of the handed-over delivery
  key `/q/{name}/c/{uuid}/{idx}/{key}` when this node is not the dispatching
  one; several deliveries share a WatchResponse (several when they are large:
  DELIVERY_RESPONSE_BYTES);
- time: an ack deadline passing, a delivery lease revoked, a stream that has
  not taken a delivery for `STUCK_SECONDS`. Each gives messages back with a
  `QueueRequeue` command (or, for a consumer that goes away, a delete of its
  registry key), and the state machine hands them out again.

No I/O: deliveries are appended to the stream's outbox; replicated changes are
proposed through `propose`, scheduled with `spawn`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from etcdserverpb import internal_pb2, kv_pb2, rpc_pb2
from queue_server.cqs.watch_view import CqsWatchConsumers
from queue_server.errors import EtcdError
from queue_server.mq import keys
from queue_server.mq.state import ConsumerSlot, QueueInfo, QueueState
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

REGISTER_RETRY_SECONDS = 0.5
"""Pause between attempts to write a consumer's registry key (no leader yet)."""

Propose = Callable[[internal_pb2.Command], Awaitable[object]]
Spawn = Callable[[Coroutine[Any, Any, None]], object]
Session = Callable[[], Awaitable[int]]


async def _no_session() -> int:
    return 0


@dataclass(eq=False, slots=True)
class LocalConsumer:
    """One consumer watch on this node, and its deliveries under an ack deadline."""

    consumer_id: bytes
    queue: bytes
    watcher: Watcher
    deadlines: dict[int, float] = field(default_factory=dict)  # idx -> ack deadline
    leases: dict[int, int] = field(default_factory=dict)  # idx -> delivery lease id
    stuck_since: float | None = None
    stuck_head: object = None


class Dispatcher:
    """The consumers whose watches are on this node, and their deliveries."""

    def __init__(
        self,
        store_of: Callable[[], MVCCStore],
        queues: QueueState,
        node_name: str,
        propose: Propose,
        spawn: Spawn,
        clock: Callable[[], float] = time.monotonic,
        new_lease_id: Callable[[], int] | None = None,
        session: Session | None = None,
        dispatching_node: Callable[[], bytes] | None = None,
    ) -> None:
        self._store_of = store_of
        self.queues = queues
        self.node_name = node_name.encode()
        self.propose = propose
        self.spawn = spawn
        self.clock = clock
        self.started = clock()
        self.new_lease_id = new_lease_id
        self.session = session or _no_session
        self.dispatching_node = dispatching_node or (lambda: self.node_name)
        # delivery leases: lease id -> (consumer, idx) of a delivery under an ack deadline
        self.delivery_leases: dict[int, tuple[LocalConsumer, int]] = {}
        # (queue, consumer id) -> its watches here, the newest last (it gets deliveries)
        self.local: dict[tuple[bytes, bytes], list[LocalConsumer]] = {}
        self.by_watcher: dict[Watcher, LocalConsumer] = {}
        self.delivered = 0
        # consumers of CQS queues are served by the CQS watch view
        self.cqs_view: CqsWatchConsumers | None = None
        # queue -> idx -> when this node saw the message produced (for metrics)
        self.first_seen: dict[bytes, dict[int, float]] = {}
        queues.on_deliver = self._on_deliver

    def rebuild(self) -> None:
        """After a start or a snapshot restore: registry keys naming this node
        with no watch here are left from before a restart (a crash runs no
        unregister) and are deleted, which gives their messages back; what a
        consumer here was assigned in the log a snapshot skipped is given back,
        so it is delivered again."""
        store = self._store_of()
        live = {c.consumer_id for c in self.by_watcher.values()}
        if self.cqs_view is not None:
            live.update(c.consumer_id for c in self.cqs_view.by_watcher.values())
        for spelling in (keys.SHORT, keys.LONG):
            for kv in store.range(spelling, spelling[:-1] + b"0").kvs:
                qk = keys.parse(kv.key)
                if (
                    qk is not None
                    and qk.kind == "consume"
                    and kv.value == self.node_name
                    and qk.consumer not in live
                ):
                    self._delete_consumer_key(kv.key)
        for (name, consumer_id), _watches in self.local.items():
            q = self.queues.queues.get(name)
            slot = q.consumers.get(consumer_id) if q is not None else None
            if slot is not None and slot.node == self.node_name and slot.held:
                self._requeue(name, consumer_id, list(slot.held))

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
            self.spawn(self._register(qk.name, keys.SHORT, consumer_id, watcher))
            return
        q = self.queues.queue(qk.name, qk.spelling)
        consumer = LocalConsumer(consumer_id, q.name, watcher)
        watches = self.local.setdefault((q.name, consumer_id), [])
        first_here = not watches
        watches.append(consumer)
        self.by_watcher[watcher] = consumer
        slot = q.consumers.get(consumer_id)
        if first_here and slot is not None and slot.node == self.node_name and slot.held:
            # assigned while no watch of it was here (a restart): deliver again
            self._requeue(q.name, consumer_id, list(slot.held))
        self.spawn(self._register(q.name, q.spelling, consumer_id, watcher))

    def _live(self, watcher: Watcher) -> bool:
        view = self.cqs_view
        return watcher in self.by_watcher or (view is not None and watcher in view.by_watcher)

    async def _register(
        self, name: bytes, spelling: bytes, consumer_id: bytes, watcher: Watcher
    ) -> None:
        """Write the consumer's registry key (on the session lease) and the
        queue's; retried while the watch lasts, e.g. until a leader exists."""
        key = keys.consumer_key(spelling, name, consumer_id)
        while self._live(watcher):
            try:
                lease = await self.session()
                result = await self.propose(
                    internal_pb2.Command(
                        put=rpc_pb2.PutRequest(key=key, value=self.node_name, lease=lease)
                    )
                )
                if isinstance(result, EtcdError):
                    raise result
            except Exception as e:
                log.info("queue consumer registration failed, retrying: %s", e)
                await asyncio.sleep(REGISTER_RETRY_SECONDS)
                continue
            self._claim_registry(name, spelling)
            return

    def _claim_registry(self, name: bytes, spelling: bytes) -> None:
        """Make `/q/{name}` name the dispatching member, if it does not."""
        key = keys.registry_key(spelling, name)
        dispatching = self.dispatching_node()
        kv = self._store_of().get(key)
        if kv is None or kv.value != dispatching:
            self.spawn(
                self._propose_quietly(
                    internal_pb2.Command(put=rpc_pb2.PutRequest(key=key, value=dispatching))
                )
            )

    def claim_registries(self) -> None:
        """This member now orders the assignments (it became the leader): the
        registry keys of queues with consumers name it."""
        for q in list(self.queues.queues.values()):
            if q.consumers or self.queues.cqs.is_cqs(q.name):
                kv = self._store_of().get(keys.registry_key(q.spelling, q.name))
                if kv is not None:
                    self._claim_registry(q.name, q.spelling)

    def unregister(self, watcher: Watcher) -> None:
        """The consumer's watch ended: what it was given goes back."""
        view = self.cqs_view
        viewer = view.unregister(watcher) if view is not None else None
        if view is not None and viewer is not None:
            if not any(c.consumer_id == viewer.consumer_id for c in view.by_watcher.values()):
                name = viewer.queue.encode()
                self._delete_consumer_key(keys.consumer_key(keys.SHORT, name, viewer.consumer_id))
            return
        consumer = self.by_watcher.pop(watcher, None)
        if consumer is None:
            return
        for lease_id in consumer.leases.values():
            self.delivery_leases.pop(lease_id, None)
        ident = (consumer.queue, consumer.consumer_id)
        watches = self.local[ident]
        watches.remove(consumer)
        q = self.queues.queues.get(consumer.queue)
        if q is None:
            return
        if not watches:
            del self.local[ident]
            self._delete_consumer_key(keys.consumer_key(q.spelling, q.name, consumer.consumer_id))
            return
        # another watch of the same consumer (a client that reconnected before its
        # old stream was noticed closing) stays: what the old one got comes back
        slot = q.consumers.get(consumer.consumer_id)
        if slot is not None and slot.node == self.node_name and slot.held:
            self._requeue(q.name, consumer.consumer_id, list(slot.held))

    def _requeue(self, name: bytes, consumer_id: bytes, idxs: list[int]) -> None:
        command = internal_pb2.Command()
        command.queue_requeue.queue = name
        command.queue_requeue.consumer = consumer_id
        command.queue_requeue.idx.extend(sorted(idxs))
        self.spawn(self._propose_quietly(command))

    def _delete_consumer_key(self, key: bytes) -> None:
        """Delete a consumer registry key if it still names this node (the
        consumer may have moved to another member meanwhile)."""
        txn = rpc_pb2.TxnRequest()
        compare = txn.compare.add()
        compare.key = key
        compare.target = rpc_pb2.Compare.VALUE
        compare.result = rpc_pb2.Compare.EQUAL
        compare.value = self.node_name
        txn.success.add().request_delete_range.key = key
        self.spawn(self._propose_quietly(internal_pb2.Command(txn=txn)))

    async def _propose_quietly(self, command: internal_pb2.Command) -> None:
        try:
            result = await self.propose(command)
        except Exception as e:
            result = e
        if isinstance(result, Exception):  # a later event (a restart, a session expiry) redoes it
            log.warning("queue bookkeeping write failed error=%s", result)

    # -- delivery ---------------------------------------------------------------

    def on_commit(self, revision: int, events: list[Event]) -> None:
        """State machine hook: note when messages were produced (the age of the
        oldest pending one is a metric); a registry key of a consumer still
        watching here that went away (the node's session lease expired while it
        was cut off, or an operator deleted it) is written again."""
        for e in events:
            key = e.kv.key
            if not key.startswith((keys.SHORT, keys.LONG)):
                continue
            qk = keys.parse(key)
            if qk is not None and qk.kind == "message":
                if e.is_delete:
                    self.first_seen.get(qk.name, {}).pop(qk.idx, None)
                elif e.prev_kv is None:
                    self.first_seen.setdefault(qk.name, {})[qk.idx] = self.clock()
                continue
            if qk is None or not e.is_delete or qk.kind != "consume":
                continue
            watches = self.local.get((qk.name, qk.consumer))
            if watches:
                self.spawn(self._register(qk.name, qk.spelling, qk.consumer, watches[-1].watcher))
            elif self.cqs_view is not None:
                for viewer in self.cqs_view.by_watcher.values():
                    if viewer.consumer_id == qk.consumer and viewer.queue.encode() == qk.name:
                        self.spawn(self._register(qk.name, keys.SHORT, qk.consumer, viewer.watcher))
                        break

    def oldest_pending_age(self, q: QueueInfo, now: float) -> float:
        """Seconds since the oldest pending message was produced (0: none pending;
        a message from before this process started counts from its start)."""
        if not q.pending:
            return 0.0
        seen = self.first_seen.get(q.name, {}).get(q.pending.peekitem(0)[0])
        return now - (seen if seen is not None else self.started)

    def _on_deliver(self, q: QueueInfo, slot: ConsumerSlot, items: list[tuple[int, bytes]]) -> None:
        """The state machine assigned messages to a consumer: push them to its
        newest watch, if that is on this node."""
        if slot.node != self.node_name:
            return
        watches = self.local.get((q.name, slot.consumer_id))
        if not watches:
            return  # its registry key is being deleted; the messages come back
        consumer = watches[-1]
        deadline = q.settings.ack_deadline
        lease_ids: list[int] = []
        if deadline:
            now = self.clock()
            for idx, _key in items:
                consumer.deadlines[idx] = now + deadline
                lease_id = 0
                if self.new_lease_id is not None:
                    lease_id = self.new_lease_id()
                    old = consumer.leases.get(idx)
                    if old is not None:
                        self.delivery_leases.pop(old, None)
                    consumer.leases[idx] = lease_id
                    self.delivery_leases[lease_id] = (consumer, idx)
                lease_ids.append(lease_id)
        handover = None
        if self.dispatching_node() != self.node_name:
            handover = keys.consumer_key(q.spelling, q.name, slot.consumer_id) + b"/"
        self._deliver(consumer, self._store_of(), items, lease_ids, handover)

    def _deliver(
        self,
        consumer: LocalConsumer,
        store: MVCCStore,
        items: list[tuple[int, bytes]],
        lease_ids: list[int],
        handover: bytes | None,
    ) -> None:
        """Push the messages to the consumer's stream: one WatchResponse, or more
        when they would carry over DELIVERY_RESPONSE_BYTES. A delivery under an
        ack deadline carries its delivery lease instead of the message's own;
        one handed over from another node carries the delivery key."""
        watch_id = consumer.watcher.watch_id
        response = rpc_pb2.WatchResponse(watch_id=watch_id)
        response.header.revision = store.revision
        size = 0
        for i, (_idx, key) in enumerate(items):
            kv = store.get(key)
            if kv is None:  # pragma: no cover - the state machine assigns stored keys
                continue
            entry = len(kv.key) + len(kv.value)
            if response.events and size + entry > DELIVERY_RESPONSE_BYTES:
                self.delivered += len(response.events)
                consumer.watcher.stream.push(response, size)
                response = rpc_pb2.WatchResponse(watch_id=watch_id)
                response.header.revision = store.revision
                size = 0
            ev = response.events.add()
            ev.type = kv_pb2.Event.PUT
            dst = ev.kv
            if handover is None:
                dst.key = kv.key
            else:  # /q/{name}/c/{uuid}/ + {idx}/{key}
                dst.key = handover + kv.key[kv.key.rindex(b"/", 0, kv.key.rindex(b"/")) + 1 :]
            dst.create_revision = kv.create_revision
            dst.mod_revision = kv.mod_revision
            dst.version = kv.version
            dst.value = kv.value
            delivery_lease = lease_ids[i] if lease_ids else 0
            if delivery_lease or kv.lease:
                dst.lease = delivery_lease or kv.lease
            size += entry
        if response.events:
            self.delivered += len(response.events)
            consumer.watcher.stream.push(response, size)

    def _holds(self, consumer: LocalConsumer, idx: int) -> bool:
        """Whether the state machine still has `idx` with this consumer, here."""
        q = self.queues.queues.get(consumer.queue)
        slot = q.consumers.get(consumer.consumer_id) if q is not None else None
        return slot is not None and slot.node == self.node_name and idx in slot.held

    def _forget(self, consumer: LocalConsumer, idx: int) -> None:
        consumer.deadlines.pop(idx, None)
        lease_id = consumer.leases.pop(idx, None)
        if lease_id is not None:
            self.delivery_leases.pop(lease_id, None)

    # -- delivery leases: the ack deadline as an etcd lease -----------------------

    def _delivery(self, lease_id: int) -> tuple[LocalConsumer, int, float] | None:
        found = self.delivery_leases.get(lease_id)
        if found is None:
            return None
        consumer, idx = found
        if not self._holds(consumer, idx):
            self._forget(consumer, idx)
            return None
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
        q = self.queues.queues[consumer.queue]
        return remaining, max(1, round(ttl)), q.holder[idx].held[idx]

    def revoke(self, lease_id: int) -> bool:
        """LeaseRevoke on a delivery lease: the consumer gives the message back
        now (a negative acknowledgement). False if not a delivery lease."""
        found = self._delivery(lease_id)
        if found is None:
            return False
        consumer, idx, _ttl = found
        self._forget(consumer, idx)
        self._requeue(consumer.queue, consumer.consumer_id, [idx])
        return True

    # -- time -------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Drop consumers whose stream is stuck; give back messages held past
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
            if consumer.deadlines:
                expired = []
                for idx, deadline in list(consumer.deadlines.items()):
                    if not self._holds(consumer, idx):
                        self._forget(consumer, idx)  # acknowledged, or taken back
                    elif deadline <= now:
                        self._forget(consumer, idx)
                        expired.append(idx)
                if expired:
                    self._requeue(consumer.queue, consumer.consumer_id, expired)

    def drop(self, consumer: LocalConsumer) -> None:
        """Unregister a consumer and end its watch with a cancel response."""
        watcher = consumer.watcher
        stream = watcher.stream
        stream.watchers.pop(watcher.watch_id, None)
        self.unregister(watcher)
        response = rpc_pb2.WatchResponse(watch_id=watcher.watch_id, canceled=True)
        response.cancel_reason = "queue: consumer did not take a delivery within 5s"
        stream.push(response)
