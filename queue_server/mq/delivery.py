"""Delivery of etcd-key queue messages into this node's consumer watches.

The state machine decides which consumer holds which message, the same on every
member (`state.py`), and says so in each command's effects (`Assignment`). What
belongs here is what only the node hosting a consumer's watch does with that:

- the table of consumer watches on this node (`LocalConsumer`), the newest watch
  of a consumer getting its deliveries;
- turning an assignment into WatchResponses: PUT events of the message keys, or
  of the handed-over delivery keys `/q/{name}/c/{uuid}/{idx}/{key}` when this
  node is not the dispatching one; as few responses as DELIVERY_RESPONSE_BYTES
  allows;
- delivery leases: under an ack deadline a delivery carries a lease of its own,
  which LeaseKeepAlive extends, LeaseTimeToLive reads and LeaseRevoke gives back
  (a negative acknowledgement);
- giving messages back (`requeue`, a `QueueRequeue` command);
- forgetting a delivery's deadline and lease when the state machine says its
  hold ended (`released`: acknowledged, or taken back; one of a command's
  effects), so a delivery lease is live exactly while its message is held.

No I/O and no clock of its own: times come in as `now`; replicated changes are
proposed through `propose`, scheduled with `spawn`. Replicated state is read
through `QueueState`'s queries (`held_by`, `spelling_of`, `ack_deadline_of`),
which never change it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from etcdserverpb import internal_pb2, kv_pb2, rpc_pb2
from queue_server.keyspace import grammar as keys
from queue_server.mq.state import Assignment, QueueState
from queue_server.mvcc.store import MVCCStore
from queue_server.proposals import ApplyResult, Propose, Spawn
from queue_server.watch.hub import Watcher

log = logging.getLogger(__name__)

DELIVERY_RESPONSE_BYTES = 2 * 1024 * 1024
"""Bytes of keys and values one delivery WatchResponse may carry; more deliveries
go in further responses. gRPC clients refuse messages over 4 MiB by default (the
python etcd3 client, generated stubs; etcd's Go client accepts 2 GiB), and a
response over that breaks the consumer's stream, which gives its messages back,
and they come back in one response again. Half of 4 MiB leaves room for the
framing; one message alone (at most --max-request-bytes, 1.5 MiB by default) is
always sent."""


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


class Delivery:
    """The etcd-key queue consumers whose watches are on this node, and what
    they are delivered."""

    def __init__(
        self,
        store_of: Callable[[], MVCCStore],
        queues: QueueState,
        node_name: bytes,
        propose: Propose,
        spawn: Spawn,
        clock: Callable[[], float],
        new_lease_id: Callable[[], int] | None = None,
        dispatching_node: Callable[[], bytes] | None = None,
    ) -> None:
        self._store_of = store_of
        self.queues = queues
        self.node_name = node_name
        self.propose = propose
        self.spawn = spawn
        self.clock = clock
        self.new_lease_id = new_lease_id
        self.dispatching_node = dispatching_node or (lambda: self.node_name)
        # delivery leases: lease id -> (consumer, idx) of a delivery under an ack
        # deadline, while the state machine has the message with that consumer
        self.delivery_leases: dict[int, tuple[LocalConsumer, int]] = {}
        # (queue, consumer id) -> its watches here, the newest last (it gets deliveries)
        self.local: dict[tuple[bytes, bytes], list[LocalConsumer]] = {}
        self.by_watcher: dict[Watcher, LocalConsumer] = {}
        self.delivered = 0

    # -- the table of consumer watches ------------------------------------------

    def attach(self, watcher: Watcher, name: bytes, consumer_id: bytes) -> None:
        """A new watch of a consumer: it gets the consumer's deliveries from now.
        What the consumer holds from before any watch of it was here (a restart)
        is given back, so it is delivered again."""
        watches = self.local.setdefault((name, consumer_id), [])
        first_here = not watches
        consumer = LocalConsumer(consumer_id, name, watcher)
        watches.append(consumer)
        self.by_watcher[watcher] = consumer
        if first_here:
            held = self._held_here(name, consumer_id)
            if held:
                self.requeue(name, consumer_id, held)

    def detach(self, watcher: Watcher) -> LocalConsumer | None:
        """The watch ended. If another watch of the same consumer stays (a client
        that reconnected before its old stream was noticed closing), what the
        consumer holds comes back to be delivered to that one. Returns the
        consumer when this was its last watch here (its registry key must go)."""
        consumer = self.by_watcher.pop(watcher, None)
        if consumer is None:
            return None
        for lease_id in consumer.leases.values():
            self.delivery_leases.pop(lease_id, None)
        ident = (consumer.queue, consumer.consumer_id)
        watches = self.local[ident]
        watches.remove(consumer)
        if not watches:
            del self.local[ident]
            return consumer
        held = self._held_here(consumer.queue, consumer.consumer_id)
        if held:
            self.requeue(consumer.queue, consumer.consumer_id, held)
        return None

    def _held_here(self, name: bytes, consumer_id: bytes) -> list[int]:
        return list(self.queues.held_by(name, consumer_id, self.node_name))

    def give_back_held(self) -> None:
        """After a snapshot restore: what consumers here were assigned in the log
        the snapshot skipped was never delivered; give it back. No delivery
        made before stands (the restored state ended some holds with no
        effects to say so): every deadline and delivery lease goes."""
        self.delivery_leases.clear()
        for consumer in self.by_watcher.values():
            consumer.deadlines.clear()
            consumer.leases.clear()
        for name, consumer_id in self.local:
            held = self._held_here(name, consumer_id)
            if held:
                self.requeue(name, consumer_id, held)

    def requeue(self, name: bytes, consumer_id: bytes, idxs: list[int]) -> None:
        """Give messages back to their queue (a failed delivery each)."""
        command = internal_pb2.Command()
        command.queue_requeue.queue = name
        command.queue_requeue.consumer = consumer_id
        command.queue_requeue.idx.extend(sorted(idxs))
        self.spawn(self.propose_quietly(command))

    async def propose_quietly(self, command: internal_pb2.Command) -> None:
        """Propose a bookkeeping write whose failure is only logged: a later
        event (a restart, a session expiry, the next deadline) redoes it."""
        result: ApplyResult | Exception
        try:
            result = await self.propose(command)
        except Exception as e:
            result = e
        if isinstance(result, Exception):  # a later event (a restart, a session expiry) redoes it
            log.warning("queue bookkeeping write failed error=%s", result)

    # -- effects of apply --------------------------------------------------------

    def deliver(self, a: Assignment) -> None:
        """The state machine assigned messages to a consumer: push them to its
        newest watch, if that is on this node."""
        if a.node != self.node_name:
            return
        watches = self.local.get((a.queue, a.consumer))
        if not watches:
            return  # its registry key is being deleted; the messages come back
        consumer = watches[-1]
        # empty if it left, or moved, later in the same batch
        held = self.queues.held_by(a.queue, a.consumer, self.node_name)
        items = [item for item in a.items if item[0] in held]
        if not items:
            return
        deadline = self.queues.ack_deadline_of(a.queue)
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
            spelling = self.queues.spelling_of(a.queue, keys.SHORT)
            handover = keys.consumer_key(spelling, a.queue, a.consumer) + b"/"
        self._push(consumer, self._store_of(), items, lease_ids, handover, a.revision)

    def _push(
        self,
        consumer: LocalConsumer,
        store: MVCCStore,
        items: list[tuple[int, bytes]],
        lease_ids: list[int],
        handover: bytes | None,
        revision: int,
    ) -> None:
        """Push the messages to the consumer's stream: one WatchResponse, or more
        when they would carry over DELIVERY_RESPONSE_BYTES. A delivery under an
        ack deadline carries its delivery lease instead of the message's own;
        one handed over from another node carries the delivery key. Its
        `mod_revision` is the revision it was handed out at (the produce's, for
        a consumer that was waiting), never older than the watch: a proxy that
        shares one watch among clients (etcd's grpc-proxy) drops events older
        than what it has already passed on, and clientv3 resumes a broken watch
        from the last event's revision."""
        watch_id = consumer.watcher.watch_id
        response = rpc_pb2.WatchResponse(watch_id=watch_id)
        response.header.revision = store.revision
        size = 0
        get = store.get
        for i, (_idx, key) in enumerate(items):
            kv = get(key)
            if kv is None:  # acknowledged by a later entry of the same batch
                continue
            entry = len(kv.key) + len(kv.value)
            if response.events and size + entry > DELIVERY_RESPONSE_BYTES:
                self.delivered += len(response.events)
                consumer.watcher.stream.push(response, size)
                response = rpc_pb2.WatchResponse(watch_id=watch_id)
                response.header.revision = store.revision
                size = 0
            delivery_lease = lease_ids[i] if lease_ids else 0
            lease = delivery_lease or kv.lease
            if handover is None:
                dst_key = kv.key
            else:  # /q/{name}/c/{uuid}/ + {idx}/{key}
                dst_key = handover + kv.key[kv.key.rindex(b"/", 0, kv.key.rindex(b"/")) + 1 :]
            dst = response.events.add(type=kv_pb2.Event.PUT).kv
            dst.key = dst_key
            dst.create_revision = kv.create_revision
            dst.mod_revision = revision
            dst.version = kv.version
            dst.value = kv.value
            if lease:
                dst.lease = lease
            size += entry
        if response.events:
            self.delivered += len(response.events)
            consumer.watcher.stream.push(response, size)

    # -- delivery leases: the ack deadline as an etcd lease -----------------------

    def released(self, name: bytes, consumer_id: bytes, idx: int) -> None:
        """The state machine ended the consumer's hold of `idx` (an effect of
        apply): acknowledged, or taken back. Its deadline and lease go."""
        for consumer in self.local.get((name, consumer_id), ()):
            self.forget(consumer, idx)

    def forget(self, consumer: LocalConsumer, idx: int) -> None:
        consumer.deadlines.pop(idx, None)
        lease_id = consumer.leases.pop(idx, None)
        if lease_id is not None:
            self.delivery_leases.pop(lease_id, None)

    def _delivery(self, lease_id: int) -> tuple[LocalConsumer, int, float] | None:
        found = self.delivery_leases.get(lease_id)
        if found is None:
            return None
        consumer, idx = found
        return consumer, idx, self.queues.ack_deadline_of(consumer.queue)

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
        # a delivery lease lives while its message is held (`released`)
        key = self.queues.held_by(consumer.queue, consumer.consumer_id, self.node_name)[idx]
        return remaining, max(1, round(ttl)), key

    def revoke(self, lease_id: int) -> bool:
        """LeaseRevoke on a delivery lease: the consumer gives the message back
        now (a negative acknowledgement). False if not a delivery lease."""
        found = self._delivery(lease_id)
        if found is None:
            return False
        consumer, idx, _ttl = found
        self.forget(consumer, idx)
        self.requeue(consumer.queue, consumer.consumer_id, [idx])
        return True
