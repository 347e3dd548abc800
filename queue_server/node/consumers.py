"""Queue consumers among this node's watches, and their registry keys.

A watch on exactly `/q/{name}/c/{uuid}` (or `/queue/{name}/consumer/{uuid}`) is
a consumer, of whichever product owns the queue: the key grammar says which
keys are consumer keys, CQS's state says which queues are its own
(`CqsState.owns_consumer`; `cqs/watch_view.py` delivers to them) and the
etcd-key queue has the rest (`mq/delivery.py`). Nothing here asks the keyspace
router, whose answers belong to apply. The watch hub hands every exact-key
watch to `take` and every ending consumer watch to `release`; a stuck
consumer's watch is ended by the hub (`WatchHub.cancel_consumer`), which
releases it here.

What belongs here is registration, the same for both products:

- a new consumer writes its registry key `/q/{name}/c/{uuid}` naming this node
  (on the node's session lease in a cluster, so the key goes when the node
  dies), then makes `/q/{name}` name the member that orders the assignments
  (the leader; this node when alone). Retried while the watch lasts;
- its last watch here ending deletes the key if it still names this node, and
  the state machine gives back what the consumer held;
- a registry key of a consumer still watching here that went away (the
  session lease expired while the node was cut off, or an operator deleted it)
  is written again; keys naming this node with no watch here (left by a crash)
  are deleted at start (`rebuild`).

Node-local code never creates a queue: the key is spelled as the queue is if
it exists, else as the watch is, and apply creates the queue when the key is
written, in log order on every replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.cqs.state import CqsState
from queue_server.cqs.watch_view import CqsWatchConsumers
from queue_server.errors import EtcdError
from queue_server.keyspace import grammar as keys
from queue_server.mq.delivery import Delivery
from queue_server.mq.state import QueueState
from queue_server.mvcc.store import Event, MVCCStore
from queue_server.proposals import Propose, Spawn
from queue_server.watch.hub import Watcher

log = logging.getLogger(__name__)

REGISTER_RETRY_SECONDS = 0.5
"""Pause between attempts to write a consumer's registry key (no leader yet)."""

Session = Callable[[], Awaitable[int]]


async def _no_session() -> int:
    return 0


class ConsumerDirectory:
    """The consumer watches of this node, of both products, by registry key."""

    def __init__(
        self,
        queues: QueueState,
        cqs: CqsState,
        delivery: Delivery,
        cqs_view: CqsWatchConsumers,
        store_of: Callable[[], MVCCStore],
        propose: Propose,
        spawn: Spawn,
        session: Session | None = None,
        dispatching_node: Callable[[], bytes] | None = None,
    ) -> None:
        self.queues = queues
        self.cqs = cqs
        self.delivery = delivery
        self.cqs_view = cqs_view
        self._store_of = store_of
        self.node_name = delivery.node_name
        self.propose = propose
        self.spawn = spawn
        self.session = session or _no_session
        self.dispatching_node = dispatching_node or (lambda: self.node_name)
        # the registry key each consumer watch wrote, and the watches of each key
        self._key_of: dict[Watcher, bytes] = {}
        self._watches: dict[bytes, list[Watcher]] = {}

    # -- the watch hub's questions ----------------------------------------------

    def take(self, watcher: Watcher) -> bool:
        """A new watch on exactly `watcher.key`: True if it is a queue consumer,
        which gets deliveries from now on instead of key events."""
        qk = keys.parse_consumer(watcher.key)
        if qk is None or not keys.valid_consumer_id(qk.consumer):
            # The Watch service refuses a consumer key whose id is not a UUID
            # before the hub sees it; a watch made here some other way (no
            # client's) stays an ordinary watch.
            return False
        consumer_id = qk.consumer
        if self.cqs.owns_consumer(qk):
            spelling = keys.SHORT
            self.cqs_view.register(watcher, qk.name.decode(), consumer_id)
        else:
            spelling = self.queues.spelling_of(qk.name, qk.spelling)
            self.delivery.attach(watcher, qk.name, consumer_id)
        key = keys.consumer_key(spelling, qk.name, consumer_id)
        self._key_of[watcher] = key
        self._watches.setdefault(key, []).append(watcher)
        self.spawn(self._register(key, qk.name, spelling, watcher))
        return True

    def release(self, watcher: Watcher) -> None:
        """A consumer watch ended: its registry key goes with its last watch here."""
        key = self._key_of.pop(watcher, None)
        if key is None:
            return
        watches = self._watches[key]
        watches.remove(watcher)
        if not watches:
            del self._watches[key]
        if self.cqs_view.unregister(watcher) is not None:
            if not watches:
                self._delete_consumer_key(key)
            return
        if self.delivery.detach(watcher) is not None:
            self._delete_consumer_key(key)

    # -- registry keys ----------------------------------------------------------

    async def _register(self, key: bytes, name: bytes, spelling: bytes, watcher: Watcher) -> None:
        """Write the consumer's registry key (on the session lease) and the
        queue's; retried while the watch lasts, e.g. until a leader exists."""
        while watcher in self._key_of:
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
        key = keys.registry_key(self.queues.spelling_of(name, spelling), name)
        dispatching = self.dispatching_node()
        kv = self._store_of().get(key)
        if kv is None or kv.value != dispatching:
            self.spawn(
                self.delivery.propose_quietly(
                    internal_pb2.Command(put=rpc_pb2.PutRequest(key=key, value=dispatching))
                )
            )

    def claim_registries(self) -> None:
        """This member now orders the assignments (it became the leader): the
        registry keys of queues with consumers, and of CQS queues, name it."""
        store = self._store_of()
        names = self.queues.queues_with_consumers()
        names.extend((name.encode(), keys.SHORT) for name in self.cqs.queues)
        for name, spelling in names:
            if store.get(keys.registry_key(spelling, name)) is not None:
                self._claim_registry(name, spelling)

    def rebuild(self) -> None:
        """After a start or a snapshot restore: registry keys naming this node
        with no watch here are left from before a restart (a crash runs no
        unregister) and are deleted, which gives their messages back; what a
        consumer here was assigned in the log a snapshot skipped is given back,
        so it is delivered again."""
        store = self._store_of()
        for spelling in keys.PREFIXES:
            for kv in store.range(spelling, spelling[:-1] + b"0").kvs:
                if kv.value != self.node_name or kv.key in self._watches:
                    continue
                qk = keys.parse(kv.key)
                if qk is not None and qk.kind == "consume":
                    self._delete_consumer_key(kv.key)
        self.delivery.give_back_held()

    def on_commit(self, revision: int, events: list[Event]) -> None:
        """A registry key of a consumer still watching here was deleted: write it
        again."""
        watching = self._watches
        if not watching:
            return
        for e in events:
            if e.is_delete and e.kv.key in watching:
                key = e.kv.key
                qk = keys.parse(key)
                assert qk is not None
                self.spawn(self._register(key, qk.name, qk.spelling, watching[key][-1]))

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
        self.spawn(self.delivery.propose_quietly(internal_pb2.Command(txn=txn)))
