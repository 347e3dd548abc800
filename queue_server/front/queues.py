"""The etcd-key queue served by fronts, with all of its state in the backend etcd.

What belongs here (docs/front-queue-design.md has the design):

- `FrontSession`: this front's id and its session lease in etcd, kept alive.
- `QueueFronts`: what the Watch forwarding asks of the queues. A watch of
  exactly `/q/{name}/c/{uuid}` is a consumer: the front registers it at that key
  (its value this front's id, on the session lease) and forwards a prefix watch
  of `/q/{name}/c/{uuid}/` in its place, on which the hand-outs arrive. When the
  watch is cancelled or its stream ends, the registration is deleted; when the
  front dies, etcd deletes it with the lease.
- `Dispatcher`: one front per queue dispatches, the one holding `/q/{name}`
  with its session lease. It rebuilds the queue from one range of `/q/{name}/`
  and watches it from there: producer keys are moved to message keys
  `/q/{name}/{idx}/{key}`, messages are handed to consumers with room as
  delivery keys `/q/{name}/c/{uuid}/{idx}/{key}`, a consumer's delete of its
  delivery key acknowledges (the message key goes too), and a consumer that goes
  away gives its messages back. Every write is a Txn guarded by the dispatcher's
  key, so a deposed dispatcher changes nothing.

Not yet (issue 24): ack deadlines, delivery counts and dead letters, settings,
depth limits, refusals of malformed consumer keys, CQS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from grpc import aio
from sortedcontainers import SortedDict

from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from queue_server.front.h2_client import CallError
from queue_server.front.upstream import Upstream
from queue_server.keyspace import grammar

log = logging.getLogger(__name__)

SESSION_TTL = 2
"""Seconds of the front's session lease: a dead front's consumers and queues are
taken over this long after its last keepalive. 2 s is the shortest etcd grants
with its default timing (its minimum TTL is 1.5 election timeouts, rounded up)."""
KEEPALIVE_SECONDS = 0.5
PREFETCH = 64
"""Messages a consumer holds unacknowledged at most (the embedded default)."""
MAX_TXN_OPS = 128
"""etcd's --max-txn-ops default: the most operations one hand-out Txn carries."""
RETRY_SECONDS = 0.5
CALL_TIMEOUT = 5.0


def prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _put(key: bytes, value: bytes = b"", lease: int = 0) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def _delete(key: bytes) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))


class FrontSession:
    """This front's id and session lease in the backend."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.front_id = uuid.uuid4().hex.encode()
        self.lease = 0
        self.kv = rpc_pb2_grpc.KVStub(upstream.channel)
        self.leases = rpc_pb2_grpc.LeaseStub(upstream.channel)
        self.watches = rpc_pb2_grpc.WatchStub(upstream.channel)
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def metadata(self) -> tuple[tuple[str, str], ...]:
        return await self.upstream.own_metadata()

    async def txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        """A Txn over the front's own HTTP/2 client (the dispatcher's hot call:
        grpcio's costs several times as much CPU)."""
        reply = await self.upstream.unary.call(
            "/etcdserverpb.KV/Txn",
            request.SerializeToString(),
            await self.metadata(),
            CALL_TIMEOUT,
        )
        return rpc_pb2.TxnResponse.FromString(reply)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._keep())

    async def ready(self) -> int:
        """The session lease, granted at the first need: a front whose clients
        use no queue writes nothing to etcd of its own."""
        if self._task is None:
            self.start()
        await self._ready.wait()
        return self.lease

    async def _keep(self) -> None:
        while True:
            try:
                granted = await self.leases.LeaseGrant(
                    rpc_pb2.LeaseGrantRequest(TTL=SESSION_TTL),
                    metadata=await self.metadata(),
                    timeout=CALL_TIMEOUT,
                )
                self.lease = granted.ID
                self._ready.set()
                log.info("front session lease=%x front=%s", self.lease, self.front_id.decode())
                await self._keep_alive()
            except aio.AioRpcError as e:
                log.warning("front session lost, renewing: %s", e.details())
            self._ready.clear()
            await asyncio.sleep(RETRY_SECONDS)

    async def _keep_alive(self) -> None:
        stream = self.leases.LeaseKeepAlive(metadata=await self.metadata())
        try:
            while True:
                await stream.write(rpc_pb2.LeaseKeepAliveRequest(ID=self.lease))
                reply = await stream.read()
                if not isinstance(reply, rpc_pb2.LeaseKeepAliveResponse) or reply.TTL <= 0:
                    return  # expired: a new lease, a new registration of everything
                await asyncio.sleep(KEEPALIVE_SECONDS)
        finally:
            stream.cancel()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.lease:
            with contextlib.suppress(aio.AioRpcError):
                await self.leases.LeaseRevoke(
                    rpc_pb2.LeaseRevokeRequest(ID=self.lease),
                    metadata=await self.metadata(),
                    timeout=1.0,
                )


@dataclass(slots=True)
class WatchStreamState:
    """The consumers one forwarded Watch stream registered."""

    creating: list[bytes | None] = field(default_factory=list)
    """The registration key of each create sent and not yet answered (None: not a consumer)."""
    consumers: dict[int, bytes] = field(default_factory=dict)
    """Backend watch id -> registration key."""


class ConsumerTap:
    """One forwarded Watch stream as the queues see it (a `forward.StreamTap`)."""

    def __init__(self, queues: QueueFronts) -> None:
        self.queues = queues
        self.state = WatchStreamState()

    async def request(self, data: bytes) -> bytes:
        return await self.queues.on_watch_request(data, self.state)

    def response(self, data: bytes) -> None:
        self.queues.on_watch_response(data, self.state)

    def end(self) -> None:
        self.queues.on_watch_stream_end(self.state)


class QueueFronts:
    """The queue side of a front: consumer registrations and dispatchers."""

    def __init__(self, upstream: Upstream) -> None:
        self.session = FrontSession(upstream)
        self.dispatchers: dict[bytes, Dispatcher] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- what the Watch forwarding asks ---------------------------------------------------

    def watch_tap(self) -> ConsumerTap:
        return ConsumerTap(self)

    async def on_watch_request(self, data: bytes, state: WatchStreamState) -> bytes:
        """The request to send the backend in place of `data`."""
        request = rpc_pb2.WatchRequest.FromString(data)
        which = request.WhichOneof("request_union")
        if which == "create_request":
            create = request.create_request
            parsed = grammar.parse(create.key)
            if parsed is None or parsed.kind != "consume" or create.range_end:
                state.creating.append(None)
                return data
            if not grammar.valid_consumer_id(parsed.consumer):
                state.creating.append(None)
                return data
            registration = bytes(create.key)
            revision = await self.register(registration, parsed)
            log.info("consumer registered key=%s", grammar.show(registration))
            state.creating.append(registration)
            create.key = registration + b"/"
            create.range_end = prefix_end(create.key)
            # the dispatcher may hand out before this watch reaches etcd: watch
            # from the registration on, so no hand-out is missed
            create.start_revision = max(create.start_revision, revision + 1)
            # deliveries are PUTs; the deletes of acks and give-backs are not the
            # consumer's business (embedded, its watch never sees them either)
            if rpc_pb2.WatchCreateRequest.NODELETE not in create.filters:
                create.filters.append(rpc_pb2.WatchCreateRequest.NODELETE)
            return bytes(request.SerializeToString())
        if which == "cancel_request":
            watch_id = request.cancel_request.watch_id
            if watch_id in state.consumers:
                self._spawn(self.unregister(state.consumers.pop(watch_id)))
        return data

    def on_watch_response(self, data: bytes, state: WatchStreamState) -> None:
        if not state.creating:
            return
        response = rpc_pb2.WatchResponse.FromString(data)
        if response.created:
            registration = state.creating.pop(0)
            if registration is not None:
                if response.canceled:
                    self._spawn(self.unregister(registration))
                else:
                    state.consumers[response.watch_id] = registration

    def on_watch_stream_end(self, state: WatchStreamState) -> None:
        for registration in [*state.consumers.values(), *filter(None, state.creating)]:
            self._spawn(self.unregister(registration))
        state.consumers.clear()
        state.creating.clear()

    async def register(self, registration: bytes, parsed: grammar.QueueKey) -> int:
        """Write the registration; returns its revision."""
        lease = await self.session.ready()
        reply = await self.session.kv.Put(
            rpc_pb2.PutRequest(key=registration, value=self.session.front_id, lease=lease),
            metadata=await self.session.metadata(),
            timeout=CALL_TIMEOUT,
        )
        name = grammar.registry_key(parsed.spelling, parsed.name)
        if name not in self.dispatchers:
            dispatcher = Dispatcher(self.session, parsed.spelling, parsed.name)
            self.dispatchers[name] = dispatcher
            self._spawn(dispatcher.campaign())
        return int(reply.header.revision)

    async def unregister(self, registration: bytes) -> None:
        """Delete the registration if it is still this front's."""
        log.info("consumer gone key=%s", grammar.show(registration))
        with contextlib.suppress(aio.AioRpcError):
            await self.session.kv.Txn(
                rpc_pb2.TxnRequest(
                    compare=[
                        rpc_pb2.Compare(
                            key=registration,
                            target=rpc_pb2.Compare.VALUE,
                            result=rpc_pb2.Compare.EQUAL,
                            value=self.session.front_id,
                        )
                    ],
                    success=[_delete(registration)],
                ),
                metadata=await self.session.metadata(),
                timeout=CALL_TIMEOUT,
            )

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.session.stop()


@dataclass(slots=True)
class _Message:
    key: bytes
    value: bytes


class Dispatcher:
    """One queue's dispatcher, while this front holds its registry key."""

    def __init__(self, session: FrontSession, spelling: bytes, name: bytes) -> None:
        self.session = session
        self.spelling = spelling
        self.name = name
        self.registry = grammar.registry_key(spelling, name)
        self.prefix = self.registry + b"/"
        self.meta_key = self.registry + b"/meta"
        self.reset()

    def reset(self) -> None:
        self.messages: SortedDict[int, _Message] = SortedDict()
        self.holder: dict[int, bytes] = {}
        self.held: dict[bytes, set[int]] = {}
        self.next_idx = 1
        self.ours: set[int] = set()
        """Revisions of our own Txns: their events are already in our state."""
        self.ops: list[rpc_pb2.RequestOp] = []
        self.turn = 0

    # -- the election ---------------------------------------------------------------------

    async def campaign(self) -> None:
        while True:
            try:
                lease = await self.session.ready()
                won = await self.session.kv.Txn(
                    rpc_pb2.TxnRequest(
                        compare=[
                            rpc_pb2.Compare(
                                key=self.registry,
                                target=rpc_pb2.Compare.CREATE,
                                result=rpc_pb2.Compare.EQUAL,
                                create_revision=0,
                            )
                        ],
                        success=[_put(self.registry, self.session.front_id, lease)],
                        failure=[
                            rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=self.registry))
                        ],
                    ),
                    metadata=await self.session.metadata(),
                    timeout=CALL_TIMEOUT,
                )
                holder = (
                    won.responses[0].response_range.kvs[0].value
                    if not won.succeeded and won.responses[0].response_range.kvs
                    else self.session.front_id
                )
                if won.succeeded or holder == self.session.front_id:
                    log.info("dispatching queue=%s", grammar.show(self.registry))
                    await self.dispatch()
                else:
                    await self._wait_for_vacancy(won.header.revision)
            except aio.AioRpcError as e:
                log.warning("queue %s: %s", grammar.show(self.registry), e.details())
            except CallError as e:
                log.warning("queue %s: %s", grammar.show(self.registry), e.message)
            except Exception:
                log.exception("queue %s: dispatcher failed", grammar.show(self.registry))
            await asyncio.sleep(RETRY_SECONDS)

    async def _wait_for_vacancy(self, revision: int) -> None:
        """Until the registry key is deleted (its holder's lease expired)."""
        async for event in self._watch(self.registry, b"", revision + 1):
            if event.type == kv_pb2.Event.DELETE:
                return

    async def _watch(self, key: bytes, range_end: bytes, start: int) -> AsyncIterator[kv_pb2.Event]:
        create = rpc_pb2.WatchCreateRequest(key=key, range_end=range_end, start_revision=start)
        stream = self.session.watches.Watch(metadata=await self.session.metadata())
        try:
            await stream.write(rpc_pb2.WatchRequest(create_request=create))
            while True:
                reply = await stream.read()
                if not isinstance(reply, rpc_pb2.WatchResponse):
                    return  # grpc.aio.EOF: the stream ended
                if reply.canceled:
                    return
                for event in reply.events:
                    yield event
        finally:
            stream.cancel()

    # -- dispatching --------------------------------------------------------------------------

    async def dispatch(self) -> None:
        """Rebuild from one range, then follow the watch until we are deposed."""
        self.reset()
        snapshot = await self.session.kv.Range(
            rpc_pb2.RangeRequest(key=self.prefix, range_end=prefix_end(self.prefix)),
            metadata=await self.session.metadata(),
            timeout=CALL_TIMEOUT,
        )
        for kv in snapshot.kvs:
            self._rebuilt(kv)
        self._hand_out()
        if not await self._flush():
            return
        events: asyncio.Queue[kv_pb2.Event | None] = asyncio.Queue()

        async def follow() -> None:
            try:
                async for event in self._watch(
                    self.prefix, prefix_end(self.prefix), snapshot.header.revision + 1
                ):
                    events.put_nowait(event)
            finally:
                events.put_nowait(None)

        watching = asyncio.ensure_future(follow())
        try:
            while True:
                event = await events.get()
                while True:
                    if event is None:
                        return
                    self._on_event(event)
                    if events.empty():
                        break
                    event = events.get_nowait()
                self._hand_out()
                if not await self._flush():
                    return
        finally:
            watching.cancel()

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
            self.messages[parsed.idx] = _Message(parsed.key, kv.value)
            self.next_idx = max(self.next_idx, parsed.idx + 1)
        elif parsed.kind == "consume":
            self.held.setdefault(bytes(kv.key), set())
        elif parsed.kind == "delivery":
            # keys sort message keys ("0".."9") before registrations ("c/{uuid}")
            # before their deliveries ("c/{uuid}/..."): both are known by now
            registration = grammar.consumer_key(self.spelling, self.name, parsed.consumer)
            self.next_idx = max(self.next_idx, parsed.idx + 1)
            if parsed.idx not in self.messages or registration not in self.held:
                self.ops.append(_delete(kv.key))  # its message or its consumer is gone
                return
            self.holder[parsed.idx] = registration
            self.held[registration].add(parsed.idx)

    def _move(self, kv: kv_pb2.KeyValue) -> None:
        parsed = grammar.parse(kv.key)
        assert parsed is not None
        idx = self.next_idx
        self.next_idx += 1
        self.ops.append(_delete(kv.key))
        self.ops.append(
            _put(grammar.message_key(self.spelling, self.name, idx, parsed.key), kv.value)
        )
        self.messages[idx] = _Message(parsed.key, kv.value)

    def _delivery_key(self, registration: bytes, idx: int, key: bytes) -> bytes:
        return b"%s/%0*d/%s" % (registration, grammar.IDX_DIGITS, idx, key)

    def _give_back(self, registration: bytes) -> None:
        for idx in sorted(self.held.pop(registration, ())):
            self.holder.pop(idx, None)
            message = self.messages.get(idx)
            if message is not None:
                self.ops.append(_delete(self._delivery_key(registration, idx, message.key)))

    def _on_event(self, event: kv_pb2.Event) -> None:
        kv = event.kv
        if kv.mod_revision in self.ours:
            return
        parsed = grammar.parse(kv.key)
        if parsed is None:
            return
        deleted = event.type == kv_pb2.Event.DELETE
        if parsed.kind == "produce" and not deleted:
            self._move(kv)
        elif parsed.kind == "consume":
            registration = bytes(kv.key)
            if deleted:
                self._give_back(registration)
            else:
                self.held.setdefault(registration, set())
        elif parsed.kind == "delivery" and deleted:
            registration = grammar.consumer_key(self.spelling, self.name, parsed.consumer)
            if self.holder.get(parsed.idx) == registration:
                self._acknowledged(parsed.idx)
        elif parsed.kind == "message" and deleted:
            self._acknowledged(parsed.idx, message_gone=True)

    def _acknowledged(self, idx: int, message_gone: bool = False) -> None:
        message = self.messages.pop(idx, None)
        registration = self.holder.pop(idx, None)
        if registration is not None:
            self.held.get(registration, set()).discard(idx)
        if message is None:
            return
        if not message_gone:
            self.ops.append(
                _delete(grammar.message_key(self.spelling, self.name, idx, message.key))
            )
        elif registration is not None:
            self.ops.append(_delete(self._delivery_key(registration, idx, message.key)))

    def _hand_out(self) -> None:
        consumers = [r for r, held in self.held.items() if len(held) < PREFETCH]
        if not consumers:
            return
        for idx, message in self.messages.items():
            if idx in self.holder:
                continue
            if not consumers:
                return
            self.turn %= len(consumers)
            registration = consumers[self.turn]
            held = self.held[registration]
            held.add(idx)
            if len(held) >= PREFETCH:
                consumers.pop(self.turn)  # full: the next one takes the turn
            else:
                self.turn += 1
            self.holder[idx] = registration
            self.ops.append(_put(self._delivery_key(registration, idx, message.key), message.value))

    async def _flush(self) -> bool:
        """Send what the state changes need, guarded; False when deposed."""
        if not self.ops:
            return True
        ops, self.ops = self.ops, []
        guard = rpc_pb2.Compare(
            key=self.registry,
            target=rpc_pb2.Compare.VALUE,
            result=rpc_pb2.Compare.EQUAL,
            value=self.session.front_id,
        )
        for start in range(0, len(ops), MAX_TXN_OPS - 1):
            chunk = ops[start : start + MAX_TXN_OPS - 1]
            chunk.append(_put(self.meta_key, b"%d" % self.next_idx))
            reply = await self.session.txn(rpc_pb2.TxnRequest(compare=[guard], success=chunk))
            if not reply.succeeded:
                log.warning("queue %s: no longer dispatching", grammar.show(self.registry))
                return False
            self.ours.add(reply.header.revision)
            if len(self.ours) > 4096:
                self.ours = {r for r in self.ours if r > reply.header.revision - 2048}
        return True
