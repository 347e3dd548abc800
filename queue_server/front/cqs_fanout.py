"""The fan-out of one DTO type's publications to the CQS queues over etcd that
subscribe to it.

What belongs here: `FanOut`, which holds the registry key `/q/dto:{type}` and,
while it holds it, moves every publication `/q/dto:{type}/p/{key}` into the
inbox of each subscribed queue (`/q/{queue}/in/{revision:016x}/{type}/{key}`,
whose dispatcher takes it into its tree: `cqs_queue.py`) and deletes it, in
Txns guarded by its registry key. A publication with no subscriber is deleted
and counted as dropped, as embedded.

The subscriptions are keys beside the publications, `/q/dto:{type}/sub/{queue}`
(a JSON list of the queue's aliases of the type, written with the queue's config
by CreateOrConfigureQueue), so one range and one watch of `/q/dto:{type}/` see
both in revision order: a publication made after a subscription reaches its
queue, one made before it does not, as embedded, whatever the watch's timing.

The inbox value is the publication as a serialized `DtoChangeNotification`
naming its type, read back by the queue with the same parser as a direct
enqueue.
"""

from __future__ import annotations

import json
import logging

from etcdserverpb import cqs_pb2, kv_pb2, rpc_pb2
from queue_server.cqs.state import InvalidNotification, Published, parse_publication
from queue_server.front.cqs_queue import INBOX, SPELLING
from queue_server.front.dispatcher import txn_chunks
from queue_server.front.election import RegistryHolder
from queue_server.front.figures import figures_key, read_counts
from queue_server.front.session import (
    FrontSession,
    delete_op,
    prefix_end,
    prefix_op,
    put_op,
    range_op,
)
from queue_server.keyspace import grammar

log = logging.getLogger(__name__)

SUBSCRIPTIONS = b"sub/"


def inbox_value(p: Published) -> bytes:
    n = cqs_pb2.DtoChangeNotification(
        dto_type=p.dto_type, dto_id=p.dto_id, alias_name=p.alias, tracking_id=p.tracking_id
    )
    n.sla_timestamp.seconds, micros = divmod(p.sla_us, 1_000_000)
    n.sla_timestamp.nanos = micros * 1000
    return n.SerializeToString()


def aliases_of(value: bytes) -> set[str]:
    """A subscription key's value: the aliases (a JSON list of strings)."""
    try:
        loaded = json.loads(value)
    except ValueError:
        return set()
    return {a for a in loaded if isinstance(a, str)} if isinstance(loaded, list) else set()


class FanOut(RegistryHolder):
    """One DTO type's publications, while this front holds `/q/dto:{type}`."""

    def __init__(self, session: FrontSession, dto_type: str) -> None:
        name = b"dto:" + dto_type.encode()
        registry = grammar.registry_key(SPELLING, name)
        super().__init__(session, registry)
        self.dto_type = dto_type
        self.prefix = registry + b"/"
        self.publications = grammar.producer_key(SPELLING, name, b"")
        self.subscription_prefix = self.prefix + SUBSCRIPTIONS
        self.subscribers: dict[str, set[str]] = {}
        """Queue name -> its aliases of the type ("" for the plain notifications)."""
        self.ops: list[rpc_pb2.RequestOp] = []
        self.ours: set[int] = set()
        self.published = 0
        self.dropped = 0

    async def dispatch(self) -> None:
        self.subscribers = {}
        self.ops = []
        reply = await self.session.read(
            prefix_op(self.prefix), range_op(figures_key(self.registry))
        )
        for kv in reply.responses[1].response_range.kvs:  # count on from the last holder
            counts = read_counts(kv.value, ("published", "dropped"))
            self.published, self.dropped = counts.get("published", 0), counts.get("dropped", 0)
        kvs = reply.responses[0].response_range.kvs
        for kv in kvs:
            if kv.key.startswith(self.subscription_prefix):
                self._subscribed(kv.key, kv.value)
        for kv in sorted(
            (kv for kv in kvs if kv.key.startswith(self.publications)),
            key=lambda kv: (kv.mod_revision, kv.key),
        ):
            self._fan(kv)
        if not await self._flush():
            return
        async for events in self.watch(
            self.prefix, prefix_end(self.prefix), reply.header.revision + 1
        ):
            for event in events:
                kv = event.kv
                if kv.mod_revision in self.ours:
                    continue
                if kv.key.startswith(self.subscription_prefix):
                    self._subscribed(kv.key, kv.value if event.type == kv_pb2.Event.PUT else None)
                elif event.type == kv_pb2.Event.PUT and kv.key.startswith(self.publications):
                    self._fan(kv)
            if not await self._flush():
                return

    def _subscribed(self, key: bytes, value: bytes | None) -> None:
        queue = key[len(self.subscription_prefix) :].decode(errors="replace")
        if value is None:
            self.subscribers.pop(queue, None)
        else:
            self.subscribers[queue] = aliases_of(value)

    def _fan(self, kv: kv_pb2.KeyValue) -> None:
        self.ops.append(delete_op(kv.key))
        try:
            p = parse_publication(self.dto_type, kv.value)
        except InvalidNotification as e:  # written past the fronts' checks
            log.warning("cqs: publication %s dropped: %s", grammar.show(kv.key), e)
            return
        self.published += 1
        suffix = b"%016x/%s/%s" % (
            kv.mod_revision,
            self.dto_type.encode(),
            kv.key[len(self.publications) :],
        )
        value = inbox_value(p)
        reached = 0
        for queue, aliases in self.subscribers.items():
            if p.alias in aliases:
                inbox = grammar.registry_key(SPELLING, queue.encode()) + b"/" + INBOX
                self.ops.insert(len(self.ops) - 1, put_op(inbox + suffix, value))
                reached += 1
        if not reached:
            self.dropped += 1

    async def _flush(self) -> bool:
        """Send the moves, guarded; False when deposed."""
        ops, self.ops = self.ops, []
        if ops:  # the counts changed: the record rides along
            record = {
                "kind": "fanout",
                "name": f"dto:{self.dto_type}",
                "dispatcher": self.session.front_id.decode(errors="replace"),
                "published": self.published,
                "dropped": self.dropped,
                "subscribers": sorted(self.subscribers),
            }
            ops.append(put_op(figures_key(self.registry), json.dumps(record).encode()))
        for chunk in txn_chunks(ops):
            reply = await self.session.txn(
                rpc_pb2.TxnRequest(compare=[self.guard()], success=chunk)
            )
            if not reply.succeeded:
                log.warning("cqs: no longer fanning out %s", self.dto_type)
                return False
            self.ours.add(reply.header.revision)
        if len(self.ours) > 4096:
            self.ours = set(sorted(self.ours)[-2048:])
        return True
