"""The Change Queue Service on a front over etcd: any front serves any call, and
one front at a time dispatches each queue.

What belongs here: `CqsFronts`, which follows the index of CQS queues
(`/queue-server/cqs/{name}`) and campaigns, on every front, for each queue
(`cqs_queue.py`) and each type it subscribes to (`cqs_fanout.py`); and
`FrontCqsService`, the four calls of seed 000:

- CreateOrConfigureQueue is answered by the front that receives it: one Txn
  writes the queue's config (checked and built as embedded), its index entry and
  its subscription keys at each type's fan-out, compared against the config read
  first so that two concurrent calls cannot interleave.
- BatchDequeue, BatchAcknowledge and ReEnqueue are served by the queue's
  dispatching front. Another front forwards the call to it over gRPC (its
  address is in the front id the registry key holds), with what is left of the
  client's deadline and a `queue-server-cqs-hop` header: a front that receives a
  forwarded call and no longer dispatches answers UNAVAILABLE, which the client
  retries, rather than forwarding it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, ClassVar, TypeVar

import grpc
from google.protobuf.message import Message
from grpc import aio

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, kv_pb2, rpc_pb2
from queue_server.api.cqs import (
    MAX_NOTIFICATIONS,
    Frames,
    check_configure,
    check_dequeue,
    configured,
    read_header,
    split,
)
from queue_server.api.errors import abort
from queue_server.cqs.state import QueueNotFound, TokenNotHeld
from queue_server.errors import EtcdError
from queue_server.front.cqs_fanout import FanOut
from queue_server.front.cqs_queue import (
    INDEX_PREFIX,
    SPELLING,
    CqsDispatcher,
    NotDispatching,
    subscription_key,
    subscriptions_of,
    wall_ms,
)
from queue_server.front.election import watch_events
from queue_server.front.h2_client import CallError
from queue_server.front.session import (
    RETRY_SECONDS,
    FrontSession,
    delete_op,
    prefix_end,
    prefix_op,
    put_op,
    range_op,
)
from queue_server.keyspace import grammar
from queue_server.transport.methods import Call
from queue_server.transport.status import Status

log = logging.getLogger(__name__)

Reply = TypeVar("Reply", bound=Message)

CQS_PATH = "/dtoflow.changequeue.v1.DtoChangeQueueService"
HOP = "queue-server-cqs-hop"
"""The metadata of a call one front forwards to another."""
FIND_SECONDS = 3.0
"""How long a call waits for its queue to have a dispatcher (a takeover)."""
HOLDER_TTL = 1.0
"""Seconds a front trusts what it read of a queue's dispatching front."""


class CqsFronts:
    """The CQS side of a front: which queues exist, and their dispatchers here."""

    def __init__(self, session: FrontSession) -> None:
        self.session = session
        self.queues: dict[str, CqsDispatcher] = {}
        self.fanouts: dict[str, FanOut] = {}
        self.known: set[str] = set()
        """The CQS queues in the index, as last seen."""
        self._campaigns: dict[bytes, asyncio.Task[None]] = {}
        self._holders: dict[str, tuple[bytes, float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._follow_index())

    async def stop(self) -> None:
        self._stopped = True
        for holder in (*self.queues.values(), *self.fanouts.values()):
            holder.stop()
        tasks = [*self._campaigns.values(), *([self._task] if self._task else [])]
        for task in tasks:
            task.cancel()

    # -- which queues exist ------------------------------------------------------------------

    async def _follow_index(self) -> None:
        while not self._stopped:
            try:
                reply = await self.session.read(prefix_op(INDEX_PREFIX))
                for kv in reply.responses[0].response_range.kvs:
                    self._indexed(kv.key, kv.value)
                async for events in watch_events(
                    self.session, INDEX_PREFIX, prefix_end(INDEX_PREFIX), reply.header.revision + 1
                ):
                    for event in events:
                        deleted = event.type == kv_pb2.Event.DELETE
                        self._indexed(event.kv.key, None if deleted else event.kv.value)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("cqs: index not followed yet: %s", e)
            await asyncio.sleep(RETRY_SECONDS)

    def _indexed(self, key: bytes, value: bytes | None) -> None:
        name = key[len(INDEX_PREFIX) :].decode(errors="replace")
        if value is None:
            self.known.discard(name)
            dispatcher = self.queues.pop(name, None)
            if dispatcher is not None:
                dispatcher.stop()
                self._end_campaign(dispatcher.registry)
            return
        self.known.add(name)
        self.ensure_queue(name)
        for dto_type, _ in (subscriptions_of(name, value) or ([], 0))[0]:
            self.ensure_fanout(dto_type)

    def ensure_queue(self, name: str) -> CqsDispatcher:
        dispatcher = self.queues.get(name)
        if dispatcher is None:
            dispatcher = self.queues[name] = CqsDispatcher(self.session, name)
            self._campaigns[dispatcher.registry] = asyncio.ensure_future(dispatcher.campaign())
        return dispatcher

    def ensure_fanout(self, dto_type: str) -> None:
        if dto_type not in self.fanouts:
            fanout = self.fanouts[dto_type] = FanOut(self.session, dto_type)
            self._campaigns[fanout.registry] = asyncio.ensure_future(fanout.campaign())

    def _end_campaign(self, registry: bytes) -> None:
        task = self._campaigns.pop(registry, None)
        if task is not None:
            task.cancel()
        self._spawn(self._give_up(registry))

    async def _give_up(self, registry: bytes) -> None:
        """Delete the registry key if this front holds it."""
        guard = rpc_pb2.Compare(
            key=registry,
            target=rpc_pb2.Compare.VALUE,
            result=rpc_pb2.Compare.EQUAL,
            value=self.session.front_id,
        )
        with contextlib.suppress(CallError):
            await self.session.txn(
                rpc_pb2.TxnRequest(compare=[guard], success=[delete_op(registry)])
            )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- where a queue's calls go -----------------------------------------------------------

    async def locate(self, name: str, call: Call) -> CqsDispatcher | aio.Channel:
        """The queue's dispatcher here, or a channel to the front that dispatches it."""
        loop = asyncio.get_running_loop()
        remaining = call.time_remaining()
        give_up = loop.time() + min(FIND_SECONDS, remaining if remaining is not None else 1e9)
        forwarded = any(k == HOP for k, _ in call.invocation_metadata())
        while True:
            mine = self.queues.get(name)
            if mine is not None and mine.ready.is_set():
                return mine
            holder = await self._holder(name)
            if holder is not None and holder != self.session.front_id and not forwarded:
                return self._peer(holder)
            if holder is None:
                self.ensure_queue(name)  # the index may not have reached us yet
            if loop.time() >= give_up:
                raise NotDispatching()
            if mine is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(mine.ready.wait(), 0.1)
            else:
                await asyncio.sleep(0.05)
            self._holders.pop(name, None)

    async def _holder(self, name: str) -> bytes | None:
        """The front id holding the queue's registry key (None: vacant);
        raises QueueNotFound when the queue has no config."""
        cached = self._holders.get(name)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        registry = grammar.registry_key(SPELLING, name.encode())
        reply = await self.session.read(
            range_op(registry), range_op(grammar.config_key(SPELLING, name.encode()))
        )
        config = reply.responses[1].response_range.kvs
        if not config or subscriptions_of(name, config[0].value) is None:
            raise QueueNotFound(f"cqs: queue {name!r} not found")
        held = reply.responses[0].response_range.kvs
        if not held:
            return None
        holder = bytes(held[0].value)
        self._holders[name] = (holder, time.monotonic() + HOLDER_TTL)
        return holder

    def _peer(self, front_id: bytes) -> aio.Channel:
        return self.session.peers.channel(front_id)

    def forget_holder(self, name: str) -> None:
        self._holders.pop(name, None)


@contextlib.asynccontextmanager
async def _answered(call: Call) -> AsyncIterator[None]:
    """An etcd error, or the backend's status, raised in the block ends the call with it."""
    try:
        yield
    except EtcdError as e:
        await abort(call, e)
    except CallError as e:
        await call.abort(e.code, e.message)


def _hop_metadata(call: Call) -> tuple[tuple[str, str], ...]:
    return (*((k, v) for k, v in call.invocation_metadata() if k != HOP), (HOP, "1"))


RESEND_SECONDS = 5.0
"""How long after its dispatching front could not be reached a ReEnqueue stream waits for
the next one (a dead front's registry key lasts its session TTL, 2 s, then the new
dispatcher rebuilds the queue) before it fails with the error it got."""
REPLAY_FRAMES = 10_000
"""The most frames of a ReEnqueue a front keeps to send again to a new dispatching front
(about 1 MB of items); a longer stream whose dispatching front dies fails as it would
embedded."""


class PassedFrames:
    """The frames of one ReEnqueue after its Header, as a front passes them on to the queue's
    dispatching front, kept so that the stream can go again whole to the next one when that
    front dies before the Footer went to it. Sending items again is safe: the dispatcher
    merges a notification with a pending equal one, and without the Footer the original
    is still held (until its visibility runs out).

    One read of the client's stream is under way at a time, made when an attempt needs
    the next frame, and the frame is kept before any attempt sends it: a failed attempt's
    request iterator may still be waiting for a frame (grpc ends it at its next write),
    and the frame it would have taken goes to the current attempt, in its place."""

    def __init__(self, stream: Frames) -> None:
        self._rest = stream.rest()
        self._kept: list[cqs_pb2.ReEnqueueRequest] = []
        self._first = 0
        """Position in the stream of `_kept[0]` (frames are dropped once past the cap)."""
        self._keeping = True
        self._footer_sent = False
        self._ended = False
        self._reading: asyncio.Task[None] | None = None
        self.attempts = 0

    def may_send_again(self) -> bool:
        return self._keeping and not self._footer_sent

    async def _read(self) -> None:
        try:
            self._kept.append(await anext(self._rest))
        except StopAsyncIteration:
            self._ended = True
        if self._keeping and len(self._kept) >= REPLAY_FRAMES:
            self._keeping = False

    async def attempt(self) -> AsyncIterator[cqs_pb2.ReEnqueueRequest]:
        """The whole stream for a new attempt: the frames kept, then the client's next."""
        self.attempts += 1
        mine = self.attempts
        at = self._first
        while mine == self.attempts:
            if at - self._first >= len(self._kept):
                if self._ended:
                    return
                if self._reading is None or self._reading.done():
                    self._reading = asyncio.ensure_future(self._read())
                await asyncio.shield(self._reading)
                continue
            frame = self._kept[at - self._first]
            at += 1
            if frame.WhichOneof("payload") == "footer":
                self._footer_sent = True
            if not self._keeping:  # never sent again: drop what this attempt has read
                del self._kept[: at - self._first]
                self._first = at
            yield frame

    def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()


class FrontCqsService(cqs_pb2_grpc.DtoChangeQueueServiceServicer):
    """Seed 000's four calls over etcd (module docstring)."""

    waiting_methods: ClassVar[frozenset[str]] = frozenset({"BatchDequeue", "ReEnqueue"})

    def __init__(self, fronts: CqsFronts, visibility_timeout: float) -> None:
        self.fronts = fronts
        self.session = fronts.session
        self.visibility_ms = int(visibility_timeout * 1000)

    async def _locate(self, name: str, call: Call) -> CqsDispatcher | aio.Channel:
        async with _answered(call):
            return await self.fronts.locate(name, call)
        raise AssertionError("unreachable")

    async def _forwarded(self, name: str, call: Call, error: aio.AioRpcError) -> None:
        self.fronts.forget_holder(name)
        await call.abort(Status(error.code().value[0]), error.details() or "")

    async def _forward(
        self,
        name: str,
        channel: aio.Channel,
        method: str,
        request: Message,
        response: type[Reply],
        call: Call,
        give_up: float,
    ) -> Reply | None:
        """A unary call, passed on to the queue's dispatching front; None when
        that front could not be reached (it died, and its registry key outlives
        it a moment) and `give_up` (loop time) is not yet passed: the caller
        looks the queue up again. A call that never arrived is safe to send again."""
        send = channel.unary_unary(
            f"{CQS_PATH}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response.FromString,
        )
        try:
            reply: Reply = await send(
                request, metadata=_hop_metadata(call), timeout=call.time_remaining()
            )
            return reply
        except aio.AioRpcError as e:
            unreached = e.code() == grpc.StatusCode.UNAVAILABLE and not (
                e.details() or ""
            ).startswith("cqs:")
            if not unreached or asyncio.get_running_loop().time() >= give_up:
                await self._forwarded(name, call, e)
        self.fronts.forget_holder(name)
        await asyncio.sleep(0.1)
        return None

    async def _local(
        self,
        name: str,
        method: str,
        request: Message,
        response: type[Reply],
        call: Call,
    ) -> CqsDispatcher | Reply:
        """The queue's dispatcher when it is this front, else the call's answer
        from the front that dispatches it."""
        give_up = asyncio.get_running_loop().time() + FIND_SECONDS
        while True:
            where = await self._locate(name, call)
            if isinstance(where, CqsDispatcher):
                return where
            reply = await self._forward(name, where, method, request, response, call, give_up)
            if reply is not None:
                return reply

    # -- CreateOrConfigureQueue ---------------------------------------------------------------

    async def CreateOrConfigureQueue(
        self, request: cqs_pb2.CreateOrConfigureQueueRequest, context: Call
    ) -> cqs_pb2.CreateOrConfigureQueueResponse:
        why = check_configure(request)
        if why is not None:
            await context.abort(Status.INVALID_ARGUMENT, f"cqs: {why}")
        name = request.queue_name
        key = grammar.config_key(SPELLING, name.encode())
        for _ in range(10):
            try:
                reply = await self.session.read(range_op(key))
                found = reply.responses[0].response_range.kvs
                old = subscriptions_of(name, found[0].value) if found else None
                value = configured(
                    request, found[0].value if found else None, old[1] if old else None
                )
                if value is None:
                    return cqs_pb2.CreateOrConfigureQueueResponse()  # already so: no write
                ops = [put_op(key, value), put_op(INDEX_PREFIX + name.encode(), value)]
                new = subscriptions_of(name, value) or ([], 0)
                aliases: dict[str, list[str]] = {}
                for dto_type, alias in new[0]:
                    aliases.setdefault(dto_type, []).append(alias)
                for dto_type, names in aliases.items():
                    ops.append(put_op(subscription_key(dto_type, name), json.dumps(names).encode()))
                gone = {dto_type for dto_type, _ in old[0]} - set(aliases) if old else set()
                ops.extend(delete_op(subscription_key(dto_type, name)) for dto_type in gone)
                unchanged = rpc_pb2.Compare(
                    key=key,
                    target=rpc_pb2.Compare.MOD,
                    result=rpc_pb2.Compare.EQUAL,
                    mod_revision=found[0].mod_revision if found else 0,
                )
                done = await self.session.txn(rpc_pb2.TxnRequest(compare=[unchanged], success=ops))
                if done.succeeded:
                    self.fronts.ensure_queue(name)
                    for dto_type in aliases:
                        self.fronts.ensure_fanout(dto_type)
                    return cqs_pb2.CreateOrConfigureQueueResponse()
            except CallError as e:
                await context.abort(e.code, e.message)
        await context.abort(Status.ABORTED, "cqs: the queue's config kept changing")
        raise AssertionError("unreachable")

    # -- BatchDequeue -----------------------------------------------------------------------

    async def BatchDequeue(
        self, request: cqs_pb2.BatchDequeueRequest, context: Call
    ) -> cqs_pb2.BatchDequeueResponse:
        name = request.queue_name
        why = check_dequeue(request)
        if why is not None:
            await self._locate(name, context)  # an unknown queue is NOT_FOUND first
            await context.abort(Status.INVALID_ARGUMENT, why)
        where = await self._local(
            name, "BatchDequeue", request, cqs_pb2.BatchDequeueResponse, context
        )
        if isinstance(where, cqs_pb2.BatchDequeueResponse):
            return where
        assert isinstance(where, CqsDispatcher)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0, request.wait_time_milliseconds) / 1000
        max_records = min(request.max_notifications, MAX_NOTIFICATIONS)
        async with _answered(context):
            while True:
                now = wall_ms()
                visible, next_visible = where.visible(now)
                if visible:
                    taken = await where.dequeue(
                        max_records, request.prefix_depth, self.visibility_ms
                    )
                    if taken:
                        return cqs_pb2.BatchDequeueResponse(notifications=taken)
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return cqs_pb2.BatchDequeueResponse()
                if next_visible is not None:
                    remaining = min(remaining, max(0.0, (next_visible - now) / 1000) + 0.001)
                await where.changed(remaining)
        raise AssertionError("unreachable")

    # -- BatchAcknowledge -------------------------------------------------------------------

    async def BatchAcknowledge(
        self, request: cqs_pb2.BatchAcknowledgeRequest, context: Call
    ) -> cqs_pb2.BatchAcknowledgeResponse:
        name = request.queue_name
        where = await self._local(
            name, "BatchAcknowledge", request, cqs_pb2.BatchAcknowledgeResponse, context
        )
        if isinstance(where, cqs_pb2.BatchAcknowledgeResponse):
            return where
        assert isinstance(where, CqsDispatcher)
        if request.ack_tokens:
            async with _answered(context):
                await where.acknowledge(list(request.ack_tokens))
        return cqs_pb2.BatchAcknowledgeResponse()

    # -- ReEnqueue --------------------------------------------------------------------------

    async def ReEnqueue(
        self, request_iterator: AsyncIterator[cqs_pb2.ReEnqueueRequest], context: Call
    ) -> cqs_pb2.ReEnqueueResponse:
        stream = Frames(request_iterator)
        again: Frames | None = None
        passed: PassedFrames | None = None
        try:
            name, token = await read_header(stream, context)
            passed = PassedFrames(stream)
            give_up: float | None = None
            while True:
                where = await self._locate(name, context)
                if isinstance(where, aio.Channel):
                    reply = await self._forward_split(where, passed, name, token, context, give_up)
                    if reply is not None:
                        return reply
                    give_up = give_up or asyncio.get_running_loop().time() + RESEND_SECONDS
                    self.fronts.forget_holder(name)
                    await asyncio.sleep(0.1)
                    continue
                frames = stream
                if passed.attempts:  # a front that died had part of it: all of it again here
                    frames = again = Frames(passed.attempt())
                return await self._split_here(where, frames, token, context)
        finally:
            stream.close()
            if again is not None:
                again.close()
            if passed is not None:
                passed.close()

    async def _split_here(
        self, where: CqsDispatcher, frames: Frames, token: str, context: Call
    ) -> cqs_pb2.ReEnqueueResponse:
        """The stream's items and Footer, enqueued by this front's dispatcher."""
        async with _answered(context):
            if not where.holds(token):
                raise TokenNotHeld()

            async def flush(items: list[cqs_pb2.SplitItem], extend: bool, commit: bool) -> int:
                until = wall_ms() + self.visibility_ms if extend else 0
                return await where.enqueue(token, items, until, commit)

            return await split(frames, flush, self.visibility_ms, context)
        raise AssertionError("unreachable")

    async def _forward_split(
        self,
        channel: aio.Channel,
        passed: PassedFrames,
        name: str,
        token: str,
        context: Call,
        give_up: float | None,
    ) -> cqs_pb2.ReEnqueueResponse | None:
        """The stream, passed on as it comes (its Header first) to the dispatching front;
        None when that front could not be reached before the Footer went to it, the stream
        may be sent again whole (`PassedFrames`) to the next one, and `give_up` (loop time,
        set at the first such failure) has not passed."""

        async def frames() -> AsyncIterator[cqs_pb2.ReEnqueueRequest]:
            yield cqs_pb2.ReEnqueueRequest(
                header=cqs_pb2.ReEnqueueRequest.Header(queue_name=name, ack_token=token)
            )
            async for frame in passed.attempt():
                yield frame  # no Footer at the end: the dispatching front answers CANCELLED

        re_enqueue = channel.stream_unary(
            f"{CQS_PATH}/ReEnqueue",
            request_serializer=cqs_pb2.ReEnqueueRequest.SerializeToString,
            response_deserializer=cqs_pb2.ReEnqueueResponse.FromString,
        )
        try:
            reply: cqs_pb2.ReEnqueueResponse = await re_enqueue(
                frames(), metadata=_hop_metadata(context), timeout=context.time_remaining()
            )
            return reply
        except aio.AioRpcError as e:
            unreached = e.code() == grpc.StatusCode.UNAVAILABLE and not (
                e.details() or ""
            ).startswith("cqs:")
            late = give_up is not None and asyncio.get_running_loop().time() >= give_up
            if not unreached or late or not passed.may_send_again():
                await self._forwarded(name, context, e)
        return None
