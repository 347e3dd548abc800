"""One queue's dispatcher on a front: the queue's state rebuilt from etcd, and
every decision written back to etcd as guarded Txns.

What belongs here (docs/front-queue-design.md has the design): `Dispatcher`,
which campaigns for a queue's registry key `/q/{name}` with its front's session
lease, and while it holds it:

- rebuilds the queue from one range of `/q/{name}/` and follows a watch from
  there;
- reads the queue's settings from `/q/{name}/config` (docs/queue.md,
  "Settings": prefetch, ack deadline, max deliveries, dead-letter queue);
- moves producer keys to message keys `/q/{name}/{idx}/{key}` (the message's
  lease kept), and hands messages to consumers with room, round-robin, as
  delivery keys `/q/{name}/c/{uuid}/{idx}/{key}`;
- under an ack deadline, puts each delivery on a *delivery lease*: one etcd
  lease per consumer, granted with the deadline (plus `LEASE_REUSE`) as TTL and
  used for that consumer's hand-outs for `LEASE_REUSE` seconds. Beside the
  deliveries, the lease carries a marker key `/q/{name}/lease/{id}`. When the
  lease ends (its TTL lapsed, or a client revoked it), etcd deletes the marker
  in the same revision as the deliveries still on it: deletes of delivery keys
  in a revision that deleted their lease's marker are failed deliveries, every
  other delete of a delivery key is an acknowledgement;
- counts failed deliveries (taken back by a lease's end, or because the
  consumer went away) in the message key's etcd `version`: the message key is
  put again, with its value and lease, each time. At `max_deliveries` the
  message moves to its dead-letter queue as a produce there
  (`/q/{dead}/p/{key}`), which that queue's dispatcher moves in turn.

Produces and acks may also be handed to the dispatcher itself
(`front/direct.py`): a produce becomes a put of its message key, and an ack the
delete of its delivery and message keys, in the dispatcher's next batched Txn,
so neither costs etcd a revision of its own. The call is answered with that
Txn's header once it has succeeded.

Every write is a Txn guarded by `value(/q/{name}) == this front's id`, so a
deposed dispatcher changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedDict

from etcdserverpb import kv_pb2, rpc_pb2
from queue_server.errors import EtcdError
from queue_server.front.election import RegistryHolder
from queue_server.front.figures import WRITE_SECONDS, figures_key, read_counters
from queue_server.front.h2_client import CallError
from queue_server.front.session import (
    FrontSession,
    delete_op,
    prefix_end,
    prefix_op,
    put_op,
    range_op,
)
from queue_server.keyspace import grammar
from queue_server.mq.state import QueueSettings
from queue_server.queue_stats import COUNTERS
from queue_server.transport.status import Status

log = logging.getLogger(__name__)

MAX_TXN_OPS = 128
"""etcd's --max-txn-ops default: the most operations one hand-out Txn carries,
counting those of a nested Txn with the ones around it, as etcd does."""
MAX_TXN_BYTES = 1 << 20
"""The most bytes of operations in one Txn: under etcd's --max-request-bytes
default (1.5 MiB), with room for the guard and the meta key. A hand-out carries
its message's value, so many large messages need several Txns."""
LEASE_REUSE = 1.0
"""Seconds a consumer's delivery lease takes further hand-outs after its grant.
Its TTL is the ack deadline plus this, so no delivery gets less than the
deadline, and a busy consumer costs etcd one LeaseGrant a second, not one a
hand-out."""
UNWRITTEN = 1 << 62
"""`_Message.written` until its Txn is answered."""
PARK_SECONDS = 2.0
"""How long a direct produce may wait for the dispatcher's watch to reach the
revision of an earlier produce of the same front (`Dispatcher.produce`); past
it, the produce is written as a producer key, which keeps the order too."""
LEASE_WORD = b"lease"
"""`/q/{name}/lease/{id}`: the marker of a delivery lease (an ordinary key to
the grammar, so a client may read it, and nothing consumes it)."""


@dataclass(slots=True)
class _Message:
    """A message key of the queue, as the dispatcher keeps it."""

    key: bytes
    """The `{key}` segment."""
    value: bytes
    lease: int
    """The message's own lease (the producer's), 0 for none."""
    failures: int
    """Failed deliveries so far: the message key's etcd version less one."""
    written: int = 0
    """The revision of its message key, when the dispatcher wrote it for a
    direct produce: it is handed out once the watch has passed it, so every
    consumer registered before it is known by then (0: as soon as it is known)."""


Answer = Callable[[rpc_pb2.TxnResponse | CallError | None, rpc_pb2.ResponseOp | None], None]
"""What to do with the reply of the Txn that carried a direct request's op
(None: the Txn failed its guard, or was never sent: nothing was written; a
CallError: it was sent, and may have been applied)."""
DISPATCHER_STOPPED = "the queue's dispatcher stopped"
"""An UNAVAILABLE's text (forward.py says it is the backend's, as for any)."""


@dataclass(slots=True)
class _Produce:
    """A produce handed to the dispatcher (`Dispatcher.produce`)."""

    request: rpc_pb2.PutRequest
    after: int
    """The revision the dispatcher's state must have reached first."""
    until: float
    answer: asyncio.Future[bytes | None]


@dataclass(slots=True)
class _Ack:
    """An acknowledgement handed to the dispatcher (`Dispatcher.acknowledge`)."""

    parsed: grammar.QueueKey
    answer: asyncio.Future[bytes | None]


@dataclass(slots=True)
class _DeliveryLease:
    """A lease the dispatcher granted for one consumer's deliveries."""

    registration: bytes
    granted: float
    """time.monotonic() of the grant: it takes hand-outs for LEASE_REUSE."""
    idxs: set[int]


class Dispatcher(RegistryHolder):
    """One queue's dispatcher, while this front holds its registry key.

    `ensure_dispatcher(spelling, name)` asks the front to dispatch another queue
    too: a dead-letter queue, whose produces this one writes."""

    def __init__(
        self,
        session: FrontSession,
        spelling: bytes,
        name: bytes,
        ensure_dispatcher: Callable[[bytes, bytes], None],
    ) -> None:
        super().__init__(session, grammar.registry_key(spelling, name))
        self.spelling = spelling
        self.name = name
        self.ensure_dispatcher = ensure_dispatcher
        self.prefix = self.registry + b"/"
        self.meta_key = self.registry + b"/meta"
        self.config_key = grammar.config_key(spelling, name)
        self.lease_prefix = self.prefix + LEASE_WORD + b"/"
        self.producers = grammar.producer_key(spelling, name, b"")
        self.reset()

    def reset(self) -> None:
        self.settings = QueueSettings()
        self.messages: SortedDict[int, _Message] = SortedDict()
        self.holder: dict[int, bytes] = {}
        self.held: dict[bytes, set[int]] = {}
        self.delivery_lease: dict[int, int] = {}
        """idx -> the delivery lease its delivery key is on (under a deadline)."""
        self.leases: dict[int, _DeliveryLease] = {}
        self.current: dict[bytes, int] = {}
        """Registration -> the delivery lease its next hand-outs go on."""
        self.next_idx = 1
        self.ours: set[int] = set()
        """Revisions of our own Txns: their events are already in our state."""
        self.ops: list[rpc_pb2.RequestOp] = []
        self.turn = 0
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        """produced, delivered, acked, redelivered, dead_lettered (figures.py)."""
        self.fronts: dict[bytes, bytes] = {}
        """Registration -> its front's id."""
        self.figures_dirty = True
        self.figures_written = float("-inf")
        self.accepting = False
        """Direct produces and acks are taken: the queue is rebuilt and ours."""
        self.seen = 0
        """The revision the state has followed the watch to."""
        self.direct: list[_Produce | _Ack] = []
        self.answers: dict[int, Answer] = {}
        """id() of an op in `ops` -> what its Txn's reply answers."""
        self.wake: Callable[[], None] = _nothing

    # -- direct requests (front/direct.py) ----------------------------------------------------

    async def produce(self, request: rpc_pb2.PutRequest, after: int) -> bytes | None:
        """A produce written as a put of its message key in the next Txn: the
        serialized PutResponse, or None when this front no longer dispatches
        the queue (nothing was written; the caller writes the producer key).
        It waits until the state has followed the watch to `after`, the last
        producer key the caller wrote, so one front's produces keep their order."""
        if not self.accepting:
            return None
        until = time.monotonic() + PARK_SECONDS
        answer: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self.direct.append(_Produce(request, after, until, answer))
        self.wake()
        return await answer

    async def acknowledge(self, parsed: grammar.QueueKey) -> bytes | None:
        """The delete of a delivery key (an ack) with its message key, in the
        next Txn: the serialized DeleteRangeResponse, or None when the
        dispatcher does not know the delivery (the caller deletes the key
        itself, and the watch brings the delete here)."""
        if not self.accepting:
            return None
        answer: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self.direct.append(_Ack(parsed, answer))
        self.wake()
        return await answer

    def _take_direct(self) -> None:
        """Turn the direct requests into ops; a produce whose `after` the watch
        has not reached yet waits for a later turn."""
        waiting: list[_Produce | _Ack] = []
        now = time.monotonic()
        for request in self.direct:
            if request.answer.done():
                continue  # its caller went away before it was taken
            if isinstance(request, _Ack):
                self._take_ack(request)
            elif request.after <= self.seen:
                self._take_produce(request)
            elif now < request.until:
                waiting.append(request)
            else:
                request.answer.set_result(None)
        self.direct = waiting

    def _take_produce(self, request: _Produce) -> None:
        parsed = grammar.parse(request.request.key)
        assert parsed is not None
        idx = self.next_idx
        self.next_idx += 1
        op = put_op(
            grammar.message_key(self.spelling, self.name, idx, parsed.key), request.request.value
        )
        self.ops.append(op)
        message = self.messages[idx] = _Message(
            parsed.key, request.request.value, 0, 0, written=UNWRITTEN
        )
        self._count("produced")
        answer = request.answer

        def answered(
            reply: rpc_pb2.TxnResponse | CallError | None, _: rpc_pb2.ResponseOp | None
        ) -> None:
            if not isinstance(reply, rpc_pb2.TxnResponse):
                _settle(answer, reply)
                return
            message.written = reply.header.revision
            if not answer.done():
                answer.set_result(rpc_pb2.PutResponse(header=reply.header).SerializeToString())

        self.answers[id(op)] = answered

    def _take_ack(self, request: _Ack) -> None:
        parsed = request.parsed
        registration = grammar.consumer_key(self.spelling, self.name, parsed.consumer)
        idx = parsed.idx
        message = self.messages.get(idx)
        if self.holder.get(idx) != registration or message is None or message.key != parsed.key:
            request.answer.set_result(None)
            return
        delivery = self._delivery_key(registration, idx, message.key)
        # the delivery may be gone already: its lease ended in a revision the
        # watch has not brought yet. Then the message is not acknowledged.
        op = rpc_pb2.RequestOp(request_txn=ack_txn(delivery, self._message_key(idx, message)))
        self.ops.append(op)
        del self.messages[idx]
        self._release(idx)
        self._count("acked")
        answer = request.answer

        def answered(
            reply: rpc_pb2.TxnResponse | CallError | None, response: rpc_pb2.ResponseOp | None
        ) -> None:
            if not isinstance(reply, rpc_pb2.TxnResponse):
                _settle(answer, reply)
                return
            deleted = int(response is not None and response.response_txn.succeeded)
            if not deleted:  # taken back by its lease's end: pending again
                self.counters["acked"] -= 1
                self.messages[idx] = message
                self._failed(idx)
                self.wake()
            if not answer.done():
                answer.set_result(
                    rpc_pb2.DeleteRangeResponse(
                        header=reply.header, deleted=deleted
                    ).SerializeToString()
                )

        self.answers[id(op)] = answered

    def _refuse_direct(self) -> None:
        """No longer dispatching: every direct request not written is answered None."""
        self.accepting = False
        for request in self.direct:
            if not request.answer.done():
                request.answer.set_result(None)
        self.direct = []
        answers, self.answers = self.answers, {}
        for answered in answers.values():
            answered(None, None)

    # -- dispatching --------------------------------------------------------------------------

    async def dispatch(self) -> None:
        """Rebuild from one range, then follow the watch until we are deposed."""
        self.reset()
        both = await self.session.read(prefix_op(self.prefix), range_op(figures_key(self.registry)))
        snapshot = both.responses[0].response_range
        snapshot.header.revision = both.header.revision
        for kv in both.responses[1].response_range.kvs:
            self.counters.update(read_counters(kv.value))
        # the config first: it decides what the rest means (a deadline, a limit)
        for kv in snapshot.kvs:
            if kv.key == self.config_key:
                self._configure(kv.value)
        # the delivery leases next: their keys sort after the deliveries on them.
        # They take no new hand-outs (granted 0.0); the deliveries join below.
        for kv in snapshot.kvs:
            if kv.key.startswith(self.lease_prefix) and (lease := self._marker_lease(kv.key)):
                self.leases[lease] = _DeliveryLease(bytes(kv.value), 0.0, set())
        # producer keys not moved yet take their idxs in the order they were written
        produces = []
        for kv in snapshot.kvs:
            if kv.key.startswith(self.producers):
                produces.append(kv)
            else:
                self._rebuilt(kv)
        for kv in sorted(produces, key=lambda kv: kv.mod_revision):
            self._rebuilt(kv)
        self.seen = snapshot.header.revision
        await self._hand_out()
        if not await self._flush():
            return
        responses: asyncio.Queue[list[kv_pb2.Event] | None] = asyncio.Queue()
        self.wake = lambda: responses.put_nowait([])
        self.accepting = True

        async def follow() -> None:
            try:
                async for events in self.watch(
                    self.prefix, prefix_end(self.prefix), snapshot.header.revision + 1
                ):
                    responses.put_nowait(events)
            finally:
                responses.put_nowait(None)

        watching = asyncio.ensure_future(follow())
        try:
            while True:
                try:
                    events = await asyncio.wait_for(responses.get(), WRITE_SECONDS)
                except TimeoutError:  # quiet: the figures may still be due
                    if not await self._flush():
                        return
                    continue
                while True:
                    if events is None:
                        return
                    self._on_events(events)
                    if responses.empty():
                        break
                    events = responses.get_nowait()
                self._take_direct()
                await self._hand_out()
                if not await self._flush():
                    return
                if self.ops:  # an ack that lost to its lease's end put its message back
                    self.wake()
        finally:
            watching.cancel()
            self._refuse_direct()
            self.wake = _nothing

    def _marker_lease(self, key: bytes) -> int:
        try:
            return int(key[len(self.lease_prefix) :], 16)
        except ValueError:
            return 0

    def _configure(self, value: bytes | None) -> None:
        if value is None:
            self.settings = QueueSettings()
            return
        try:
            self.settings = QueueSettings.parse(value, self.config_key)
        except EtcdError as e:  # written to etcd past the fronts' checks
            log.warning("queue %s: config ignored: %s", grammar.show(self.registry), e)
            self.settings = QueueSettings()
        if self.settings.max_deliveries:
            self.ensure_dispatcher(self.spelling, self._dead_letter_name())

    def _dead_letter_name(self) -> bytes:
        return self.settings.dead_letter or self.name + b".dead"

    def _rebuilt(self, kv: kv_pb2.KeyValue) -> None:
        if kv.key == self.meta_key:
            with contextlib.suppress(ValueError):
                self.next_idx = max(self.next_idx, int(kv.value))
            return
        parsed = grammar.parse(kv.key)
        if parsed is None:
            return
        if parsed.kind == "produce":
            self._move(kv)
        elif parsed.kind == "message":
            self.messages[parsed.idx] = _Message(parsed.key, kv.value, kv.lease, kv.version - 1)
            self.next_idx = max(self.next_idx, parsed.idx + 1)
        elif parsed.kind == "consume":
            self.held.setdefault(bytes(kv.key), set())
            self.fronts[bytes(kv.key)] = bytes(kv.value)
            self.probe_front(kv)
        elif parsed.kind == "delivery":
            # keys sort message keys ("0".."9") before registrations ("c/{uuid}")
            # before their deliveries ("c/{uuid}/..."): both are known by now
            registration = grammar.consumer_key(self.spelling, self.name, parsed.consumer)
            self.next_idx = max(self.next_idx, parsed.idx + 1)
            if parsed.idx not in self.messages or registration not in self.held:
                self.ops.append(delete_op(kv.key))  # its message or its consumer is gone
                return
            self.holder[parsed.idx] = registration
            self.held[registration].add(parsed.idx)
            if kv.lease in self.leases:
                self.delivery_lease[parsed.idx] = kv.lease
                self.leases[kv.lease].idxs.add(parsed.idx)

    def _move(self, kv: kv_pb2.KeyValue) -> None:
        parsed = grammar.parse(kv.key)
        assert parsed is not None
        idx = self.next_idx
        self.next_idx += 1
        self.ops.append(delete_op(kv.key))
        self.ops.append(
            put_op(
                grammar.message_key(self.spelling, self.name, idx, parsed.key), kv.value, kv.lease
            )
        )
        self.messages[idx] = _Message(parsed.key, kv.value, kv.lease, 0)
        self._count("produced")

    def _delivery_key(self, registration: bytes, idx: int, key: bytes) -> bytes:
        return b"%s/%0*d/%s" % (registration, grammar.IDX_DIGITS, idx, key)

    def _message_key(self, idx: int, message: _Message) -> bytes:
        return grammar.message_key(self.spelling, self.name, idx, message.key)

    def _release(self, idx: int) -> bytes | None:
        """Forget who holds `idx`; returns the holder."""
        registration = self.holder.pop(idx, None)
        if registration is not None:
            self.held.get(registration, set()).discard(idx)
        lease = self.delivery_lease.pop(idx, None)
        if lease is not None and lease in self.leases:
            self.leases[lease].idxs.discard(idx)
        return registration

    def _give_back(self, registration: bytes) -> None:
        """The consumer is gone: what it held is pending again, each a failed delivery."""
        for idx in sorted(self.held.get(registration, ())):
            message = self.messages.get(idx)
            if message is not None:
                self.ops.append(delete_op(self._delivery_key(registration, idx, message.key)))
            self._failed(idx)
        self.held.pop(registration, None)
        self.current.pop(registration, None)

    def _failed(self, idx: int) -> None:
        """A delivery of `idx` ended unacknowledged: count it, and dead-letter
        the message at the queue's `max_deliveries`."""
        self._release(idx)
        message = self.messages.get(idx)
        if message is None:
            return
        message.failures += 1
        self._count("redelivered")
        limit = self.settings.max_deliveries
        if limit and message.failures >= limit:
            del self.messages[idx]
            dead = self._dead_letter_name()
            self.ops.append(delete_op(self._message_key(idx, message)))
            self.ops.append(
                put_op(
                    grammar.producer_key(self.spelling, dead, message.key),
                    message.value,
                    message.lease,
                )
            )
            self.ensure_dispatcher(self.spelling, dead)
            self._count("dead_lettered")
            log.info(
                "queue %s: message %d dead-lettered after %d deliveries",
                grammar.show(self.registry),
                idx,
                message.failures,
            )
        else:  # the count is the key's version: put it again as it is
            self.ops.append(put_op(self._message_key(idx, message), message.value, message.lease))

    def _on_events(self, events: list[kv_pb2.Event]) -> None:
        """One watch response, revision by revision."""
        if events:
            self.seen = max(self.seen, events[-1].kv.mod_revision)
        start = 0
        while start < len(events):
            revision = events[start].kv.mod_revision
            end = start + 1
            while end < len(events) and events[end].kv.mod_revision == revision:
                end += 1
            if revision not in self.ours:
                self._on_revision(events[start:end])
            start = end

    def _on_revision(self, events: list[kv_pb2.Event]) -> None:
        ended = {
            self._marker_lease(e.kv.key)
            for e in events
            if e.type == kv_pb2.Event.DELETE and e.kv.key.startswith(self.lease_prefix)
        }
        for lease in ended:
            gone = self.leases.pop(lease, None)
            if gone is not None and self.current.get(gone.registration) == lease:
                del self.current[gone.registration]
        for event in events:
            self._on_event(event, ended)

    def _on_event(self, event: kv_pb2.Event, ended: set[int]) -> None:
        kv = event.kv
        deleted = event.type == kv_pb2.Event.DELETE
        if kv.key == self.config_key:
            self._configure(None if deleted else kv.value)
            return
        parsed = grammar.parse(kv.key)
        if parsed is None:
            return
        if parsed.kind == "produce" and not deleted:
            self._move(kv)
        elif parsed.kind == "consume":
            registration = bytes(kv.key)
            if deleted:
                self._give_back(registration)
                self.fronts.pop(registration, None)
            else:
                self.held.setdefault(registration, set())
                self.fronts[registration] = bytes(kv.value)
                self.probe_front(kv)
            self.figures_dirty = True
        elif parsed.kind == "delivery" and deleted:
            registration = grammar.consumer_key(self.spelling, self.name, parsed.consumer)
            if self.holder.get(parsed.idx) != registration:
                return
            if self.delivery_lease.get(parsed.idx) in ended:
                self._failed(parsed.idx)  # its lease ended: taken back
            else:
                self._acknowledged(parsed.idx)
        elif parsed.kind == "message" and deleted:
            # a client deleted it (a cancel, or an ack's Txn: `ack_txn`) or its
            # lease expired: a put of it still waiting in our ops would bring it
            # back, and a delete of it would delete nothing
            key = kv.key
            self.ops = [
                op
                for op in self.ops
                if op.request_put.key != key and op.request_delete_range.key != key
            ]
            self._acknowledged(parsed.idx, message_gone=True)

    def _acknowledged(self, idx: int, message_gone: bool = False) -> None:
        message = self.messages.pop(idx, None)
        registration = self._release(idx)
        if message is None:
            return
        if not message_gone:
            self._count("acked")
        if not message_gone:
            self.ops.append(delete_op(self._message_key(idx, message)))
        elif registration is not None:
            self.ops.append(delete_op(self._delivery_key(registration, idx, message.key)))

    async def _lease_for(self, registration: bytes) -> int:
        """The delivery lease of `registration`'s next hand-outs (0: none, no deadline)."""
        deadline = self.settings.ack_deadline
        if not deadline:
            return 0
        now = time.monotonic()
        lease = self.current.get(registration)
        if lease is not None and now - self.leases[lease].granted < LEASE_REUSE:
            return lease
        ttl = math.ceil(deadline + LEASE_REUSE)
        lease = await self.session.grant(ttl)
        self.leases[lease] = _DeliveryLease(registration, now, set())
        self.current[registration] = lease
        self.ops.append(put_op(b"%s%x" % (self.lease_prefix, lease), registration, lease))
        return lease

    async def _hand_out(self) -> None:
        prefetch = self.settings.prefetch
        consumers = [r for r, held in self.held.items() if len(held) < prefetch]
        if not consumers:
            return
        chosen: list[tuple[bytes, int]] = []
        for idx, message in self.messages.items():
            if idx in self.holder:
                continue
            if not consumers or message.written > self.seen:
                break  # the rest waits, in order, for the watch to pass it
            self.turn %= len(consumers)
            registration = consumers[self.turn]
            held = self.held[registration]
            held.add(idx)
            if len(held) >= prefetch:
                consumers.pop(self.turn)  # full: the next one takes the turn
            else:
                self.turn += 1
            self.holder[idx] = registration
            chosen.append((registration, idx))
        for registration, idx in chosen:
            message = self.messages[idx]
            lease = await self._lease_for(registration) or message.lease
            if lease != message.lease:
                self.delivery_lease[idx] = lease
                self.leases[lease].idxs.add(idx)
            key = self._delivery_key(registration, idx, message.key)
            self.ops.append(put_op(key, message.value, lease))
            self._count("delivered")

    def _count(self, counter: str) -> None:
        self.counters[counter] += 1
        self.figures_dirty = True

    def figures(self) -> dict[str, Any]:
        """This queue's figures record (figures.py)."""
        in_flight = len(self.holder)
        return {
            "name": self.name.decode(errors="replace"),
            "dispatcher": self.session.front_id.decode(errors="replace"),
            "depth": len(self.messages),
            "pending": len(self.messages) - in_flight,
            "in_flight": in_flight,
            "consumers": [
                {
                    "id": registration.rsplit(b"/", 1)[1].decode(errors="replace"),
                    "member": self.fronts.get(registration, b"").decode(errors="replace"),
                    "holding": len(held),
                }
                for registration, held in sorted(self.held.items())
            ],
            **self.counters,
        }

    def _figures_due(self) -> bool:
        return self.figures_dirty and time.monotonic() - self.figures_written >= WRITE_SECONDS

    async def _flush(self) -> bool:
        """Send what the state changes need, guarded; False when deposed."""
        if self.ops:
            self.figures_dirty = True  # depth and holdings change with any op
        if self._figures_due():
            record = json.dumps(self.figures(), separators=(",", ":")).encode()
            self.ops.append(put_op(figures_key(self.registry), record))
            self.figures_dirty = False
            self.figures_written = time.monotonic()
        if not self.ops:
            return True
        ops, self.ops = self.ops, []
        guard = self.guard()
        for chunk in txn_chunks(ops):
            chunk.append(put_op(self.meta_key, b"%d" % self.next_idx))
            try:
                reply = await self.session.txn(rpc_pb2.TxnRequest(compare=[guard], success=chunk))
            except CallError as e:
                self._answer_chunk(chunk, None if e.retry else e)
                raise
            except BaseException:
                self._answer_chunk(chunk, CallError(Status.UNAVAILABLE, DISPATCHER_STOPPED))
                raise
            if not reply.succeeded:
                log.warning("queue %s: no longer dispatching", grammar.show(self.registry))
                return False
            self.ours.add(reply.header.revision)
            if len(self.ours) > 4096:
                self.ours = {r for r in self.ours if r > reply.header.revision - 2048}
            if self.answers:
                for op, response in zip(chunk, reply.responses, strict=False):
                    answered = self.answers.pop(id(op), None)
                    if answered is not None:
                        answered(reply, response)
        return True

    def _answer_chunk(self, chunk: list[rpc_pb2.RequestOp], error: CallError | None) -> None:
        """A Txn that was sent and not answered may have been applied: its
        direct callers hear `error`. One that etcd never processed (None) is
        answered like a deposed dispatcher's, and its callers write themselves."""
        for op in chunk:
            answered = self.answers.pop(id(op), None)
            if answered is not None:
                answered(error, None)


def ack_txn(delivery: bytes, message: bytes) -> rpc_pb2.TxnRequest:
    """An ack as one Txn: the delivery key and its message key deleted together,
    if the delivery is still there. Whoever writes it (the dispatcher, or a
    front forwarding a consumer's delete: `direct.py`), no dispatcher rebuilt
    from etcd afterwards can take the message for one never handed out."""
    still_there = rpc_pb2.Compare(
        key=delivery, target=rpc_pb2.Compare.VERSION, result=rpc_pb2.Compare.GREATER, version=0
    )
    return rpc_pb2.TxnRequest(
        compare=[still_there], success=[delete_op(delivery), delete_op(message)]
    )


def _settle(answer: asyncio.Future[bytes | None], error: CallError | None) -> None:
    """A direct request not written (None), or failed with `error`."""
    if answer.done():
        return
    if error is None:
        answer.set_result(None)
    else:
        answer.set_exception(error)


def _nothing() -> None:
    pass


def _keys(op: rpc_pb2.RequestOp) -> list[tuple[bytes, bool]]:
    """(key, whether put) of each write `op` makes; a nested Txn's success branch
    counts as its own (etcd checks duplicates across nesting too)."""
    if op.HasField("request_put"):
        return [(op.request_put.key, True)]
    if op.HasField("request_txn"):
        return [k for nested in op.request_txn.success for k in _keys(nested)]
    return [(op.request_delete_range.key, False)]


def txn_chunks(ops: list[rpc_pb2.RequestOp]) -> list[list[rpc_pb2.RequestOp]]:
    """`ops` in order, cut into Txns etcd takes (one more operation, the meta
    key, is added to each):

    - etcd counts a nested Txn's operations against what the Txn around it
      leaves: the outer count plus the largest nested one at most MAX_TXN_OPS
      ("too many operations in txn request");
    - at most MAX_TXN_BYTES of operations ("request is too large"); one larger
      operation goes alone;
    - a new Txn wherever a key would be put twice, or put and deleted, in one
      (etcd refuses those: "duplicate key given in txn request"). Two produces
      or dead letters of one `{key}` can meet so."""
    out: list[list[rpc_pb2.RequestOp]] = []
    chunk: list[rpc_pb2.RequestOp] = []
    puts: set[bytes] = set()
    deletes: set[bytes] = set()
    nested = 0  # the largest nested Txn's operation count in `chunk`
    size = 0
    for op in ops:
        keys = _keys(op)
        inner = _nested_ops(op)
        op_size = op.ByteSize()
        if chunk and (
            len(chunk) + 2 + max(nested, inner) > MAX_TXN_OPS  # itself and the meta key
            or size + op_size > MAX_TXN_BYTES
            or any(key in puts or (put and key in deletes) for key, put in keys)
        ):
            out.append(chunk)
            chunk, puts, deletes, nested, size = [], set(), set(), 0, 0
        chunk.append(op)
        nested = max(nested, inner)
        size += op_size
        for key, put in keys:
            (puts if put else deletes).add(key)
    if chunk:
        out.append(chunk)
    return out


def _nested_ops(op: rpc_pb2.RequestOp) -> int:
    """The operation count etcd charges a nested Txn `op` (0: not a Txn)."""
    if not op.HasField("request_txn"):
        return 0
    txn = op.request_txn
    return max(len(txn.compare), len(txn.success), len(txn.failure))
