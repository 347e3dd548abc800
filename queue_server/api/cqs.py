"""The Change Queue Service (dtoflow.changequeue.v1.DtoChangeQueueService).

Thin, like the etcd services: validate, propose a CQS command through the log,
map errors to status codes. What is replicated lives in `queue_server.cqs.state`;
this module owns what is per call: long-poll waits and ReEnqueue streams.

- CreateOrConfigureQueue writes the queue's `/q/{name}/config` key (keeping its
  other settings and, once created, its depth).
- BatchDequeue proposes a `CqsDequeue` when the queue has a visible
  notification, else waits (up to `wait_time_milliseconds`) for a change to the
  queue or for the next in-flight notification to become visible.
- ReEnqueue reads the stream in a task of its own into a bounded buffer and
  flushes items through the log every FLUSH_ITEMS items or FLUSH_SECONDS, so
  neither end holds more than one batch; the original's visibility is extended
  on its cadence, and the Footer's flush acknowledges it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ClassVar

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, internal_pb2, rpc_pb2
from queue_server.api.errors import abort, propose_checked
from queue_server.apply import Proposer, StateMachine
from queue_server.cqs import commands
from queue_server.cqs.state import (
    DTO_QUEUE_PREFIX,
    MAX_DEPTH,
    InvalidNotification,
    QueueNotFound,
    TokenNotHeld,
    check_split_item,
)
from queue_server.cqs.tree import DEFAULT_DEPTH
from queue_server.keyspace import grammar as keys
from queue_server.transport.methods import Call
from queue_server.transport.status import Status

MAX_NOTIFICATIONS = 1000
"""BatchDequeue's cap on max_notifications."""
FLUSH_ITEMS = 1000
"""ReEnqueue items per log entry, at most."""
FLUSH_SECONDS = 0.1
"""ReEnqueue flushes buffered items at least this often."""
EXTEND_ITEMS = 10_000
EXTEND_SECONDS = 10.0
"""ReEnqueue extends the original's visibility every EXTEND_SECONDS or
EXTEND_ITEMS items, and at least twice per visibility timeout."""


class QueueWaiters:
    """Long-polls waiting for a queue to change; woken by the state machine."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}

    def notify(self, name: str) -> None:
        for f in self._waiting.pop(name, ()):
            if not f.done():
                f.set_result(None)

    async def wait(self, name: str, timeout: float) -> None:
        """Return when `name` changes or after `timeout` seconds."""
        f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(name, set())
        waiting.add(f)
        try:
            await asyncio.wait_for(f, timeout)
        except TimeoutError:
            pass
        finally:
            waiting.discard(f)
            if not waiting and self._waiting.get(name) is waiting:
                del self._waiting[name]


class CqsService(cqs_pb2_grpc.DtoChangeQueueServiceServicer):
    """CQS over the node's log and state machine."""

    waiting_methods: ClassVar[frozenset[str]] = frozenset({"BatchDequeue", "ReEnqueue"})
    """Methods that wait for the queue to fill or for the client's Footer (a
    stop ends them at once: `Method.waits`)."""

    def __init__(
        self,
        state: StateMachine,
        log: Proposer,
        waiters: QueueWaiters,
        visibility_timeout: float,
        wall_ms: Callable[[], int],
    ) -> None:
        self.state = state
        self.log = log
        self.waiters = waiters
        self.visibility_ms = int(visibility_timeout * 1000)
        self.wall_ms = wall_ms
        """The node's wall clock (`Timers.wall_ms`): the stamp of every CQS command,
        and the time visibility is judged at."""

    async def _propose(self, command: internal_pb2.Command, context: Call) -> object:
        return await propose_checked(self.log, command, context)

    async def _known(self, name: str, context: Call) -> None:
        if name not in self.state.cqs.queues:
            await abort(context, QueueNotFound(f"cqs: queue {name!r} not found"))

    # -- CreateOrConfigureQueue ---------------------------------------------------

    async def CreateOrConfigureQueue(
        self, request: cqs_pb2.CreateOrConfigureQueueRequest, context: Call
    ) -> cqs_pb2.CreateOrConfigureQueueResponse:
        why = check_configure(request)
        if why is not None:
            await context.abort(Status.INVALID_ARGUMENT, f"cqs: {why}")
        name = request.queue_name
        config_key = b"/q/" + name.encode() + b"/config"
        found = self.state.store.get(config_key)
        existing = self.state.cqs.queues.get(name)
        settings = configured(
            request, found.value if found else None, existing.depth if existing else None
        )
        if settings is None:
            return cqs_pb2.CreateOrConfigureQueueResponse()  # already so: no write
        command = internal_pb2.Command(put=rpc_pb2.PutRequest(key=config_key, value=settings))
        await self._propose(command, context)
        return cqs_pb2.CreateOrConfigureQueueResponse()

    # -- BatchDequeue -------------------------------------------------------------

    async def BatchDequeue(
        self, request: cqs_pb2.BatchDequeueRequest, context: Call
    ) -> cqs_pb2.BatchDequeueResponse:
        name = request.queue_name
        await self._known(name, context)
        why = check_dequeue(request)
        if why is not None:
            await context.abort(Status.INVALID_ARGUMENT, why)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0, request.wait_time_milliseconds) / 1000
        max_records = min(request.max_notifications, MAX_NOTIFICATIONS)
        while True:
            q = self.state.cqs.queues.get(name)
            if q is None:
                await self._known(name, context)
                raise AssertionError("unreachable")
            now = self.wall_ms()
            next_visible = q.tree.earliest_visible()
            if len(q.tree) or (next_visible is not None and next_visible <= now):
                command = commands.dequeue(
                    name, max_records, request.prefix_depth, self.visibility_ms, now
                )
                result = await self._propose(command, context)
                assert isinstance(result, internal_pb2.CqsDequeueResponse)
                if result.notifications:
                    return cqs_pb2.BatchDequeueResponse(notifications=result.notifications)
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                return cqs_pb2.BatchDequeueResponse()
            if next_visible is not None:
                remaining = min(remaining, max(0.0, (next_visible - now) / 1000) + 0.001)
            await self.waiters.wait(name, remaining)

    # -- BatchAcknowledge ---------------------------------------------------------

    async def BatchAcknowledge(
        self, request: cqs_pb2.BatchAcknowledgeRequest, context: Call
    ) -> cqs_pb2.BatchAcknowledgeResponse:
        await self._known(request.queue_name, context)
        if request.ack_tokens:
            command = commands.settle(request.queue_name, request.ack_tokens, self.wall_ms())
            await self._propose(command, context)
        return cqs_pb2.BatchAcknowledgeResponse()

    # -- ReEnqueue ----------------------------------------------------------------

    async def ReEnqueue(
        self, request_iterator: AsyncIterator[cqs_pb2.ReEnqueueRequest], context: Call
    ) -> cqs_pb2.ReEnqueueResponse:
        stream = Frames(request_iterator)
        try:
            name, token = await read_header(stream, context)
            await self._known(name, context)
            q = self.state.cqs.queues[name]
            if q.tree.held(token, self.wall_ms()) is None:
                await abort(context, TokenNotHeld())

            async def flush(items: list[cqs_pb2.SplitItem], extend: bool, commit: bool) -> int:
                command = internal_pb2.Command()
                c = command.cqs_enqueue
                c.queue, c.original = name, token
                c.items.extend(items)
                c.now_ms = now = self.wall_ms()
                if extend:
                    c.visible_until_ms = now + self.visibility_ms
                c.commit = commit
                result = await self._propose(command, context)
                assert isinstance(result, internal_pb2.CqsEnqueueResponse)
                return int(result.enqueued)

            return await split(stream, flush, self.visibility_ms, context)
        finally:
            stream.close()


# -- what a CQS call checks and how a ReEnqueue stream is read: shared with the
# front's CQS (front/cqs.py), which runs the same calls over etcd


def check_configure(request: cqs_pb2.CreateOrConfigureQueueRequest) -> str | None:
    """Why a CreateOrConfigureQueue is refused (INVALID_ARGUMENT), or None."""
    why = _bad_queue_name(request.queue_name)
    if why is None and not 0 <= request.depth <= MAX_DEPTH:
        why = f"depth must be 0..{MAX_DEPTH}"
    if why is None and any(not s.dto_type for s in request.subscriptions):
        why = "a subscription needs a dto_type"
    return why


def configured(
    request: cqs_pb2.CreateOrConfigureQueueRequest, found: bytes | None, depth: int | None
) -> bytes | None:
    """The queue's config document after the request, from the one `found`
    (None: no config yet) and the queue's depth (None: not created yet), which
    stays; None when the request changes nothing."""
    settings: dict[str, object] = {}
    if found is not None:
        try:
            loaded = json.loads(found or b"{}")
            settings = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            settings = {}
    cqs: dict[str, object] = {
        "subscriptions": [
            {"dto_type": s.dto_type, **({"alias_name": s.alias_name} if s.alias_name else {})}
            for s in request.subscriptions
        ],
        "depth": depth if depth is not None else (request.depth or DEFAULT_DEPTH),
    }
    old = settings.get("cqs")
    if isinstance(old, dict) and "prefetch" in old:
        cqs["prefetch"] = old["prefetch"]
    if old == cqs:
        return None
    settings["cqs"] = cqs
    return json.dumps(settings).encode()


def check_dequeue(request: cqs_pb2.BatchDequeueRequest) -> str | None:
    """Why a BatchDequeue is refused (INVALID_ARGUMENT), or None."""
    if request.max_notifications < 1:
        return "cqs: max_notifications must be at least 1"
    if request.prefix_depth < 0:
        return "cqs: prefix_depth is negative"
    return None


async def read_header(stream: Frames, context: Call) -> tuple[str, str]:
    """A ReEnqueue stream's Header: (queue name, ack token)."""
    first = await stream.next(None)
    if first is _END:
        await context.abort(Status.CANCELLED, "cqs: stream ended without a Footer")
    if not isinstance(first, cqs_pb2.ReEnqueueRequest) or first.WhichOneof("payload") != "header":
        await context.abort(Status.INVALID_ARGUMENT, "cqs: the first message must be a Header")
    assert isinstance(first, cqs_pb2.ReEnqueueRequest)
    return first.header.queue_name, first.header.ack_token


SplitFlush = Callable[[list[cqs_pb2.SplitItem], bool, bool], Awaitable[int]]
"""Write a batch of a ReEnqueue's items durably: (items, extend the original's
visibility, commit: acknowledge the original after them) -> items enqueued."""


async def split(
    stream: Frames, flush: SplitFlush, visibility_ms: int, context: Call
) -> cqs_pb2.ReEnqueueResponse:
    """The items after the Header, flushed in batches on their cadence (module
    docstring), then the Footer's commit."""
    loop = asyncio.get_running_loop()
    extend_every = min(EXTEND_SECONDS, visibility_ms / 2000)
    last_extend = loop.time()
    since_extend = 0
    enqueued = 0

    async def write(items: list[cqs_pb2.SplitItem], commit: bool) -> None:
        nonlocal last_extend, since_extend, enqueued
        since_extend += len(items)
        extend = not commit and (
            since_extend >= EXTEND_ITEMS or loop.time() - last_extend >= extend_every
        )
        if extend:
            last_extend, since_extend = loop.time(), 0
        enqueued += await flush(items, extend, commit)

    while True:
        wake = last_extend + extend_every
        if stream.partial_since is not None:
            wake = min(wake, stream.partial_since + FLUSH_SECONDS)
        frame = await stream.next(max(0.0, wake - loop.time()))
        if frame is _STARTED:
            continue
        if frame is _TIMEOUT:
            await write(stream.take_partial(), False)  # due: buffered items, or an extension
        elif isinstance(frame, list):
            for i, item in enumerate(frame):
                try:
                    check_split_item(item)
                except InvalidNotification as e:
                    if i:
                        await write(frame[:i], False)
                    await abort(context, e)
            await write(frame, False)
        elif frame is _END:
            await context.abort(Status.CANCELLED, "cqs: stream ended without a Footer")
        else:
            assert isinstance(frame, cqs_pb2.ReEnqueueRequest)
            kind = frame.WhichOneof("payload")
            if kind == "footer":
                await write([], True)
                return cqs_pb2.ReEnqueueResponse(acknowledged=True, items_enqueued=enqueued)
            await context.abort(
                Status.INVALID_ARGUMENT,
                "cqs: a second Header" if kind == "header" else "cqs: an empty message",
            )


def _bad_queue_name(name: str) -> str | None:
    if not name:
        return "queue_name is required"
    if "/" in name or name.encode().startswith(DTO_QUEUE_PREFIX):
        return "queue_name is one path segment and does not start with 'dto:'"
    if keys.parse(b"/q/" + name.encode()) is None:
        return "queue_name is not a valid queue name"
    return None


_END = object()
_TIMEOUT = object()
_STARTED = object()  # a partial batch has begun


class Frames:
    """The client stream, read by a task of its own. Items are gathered into
    batches of FLUSH_ITEMS; full batches and the other frames (each after the
    items sent before it) wait in a queue of two, so a fast client is held back
    by HTTP/2 flow control, not buffered. A partial batch can be taken when its
    flush is due."""

    def __init__(self, source: AsyncIterator[cqs_pb2.ReEnqueueRequest]) -> None:
        self._ready: asyncio.Queue[object] = asyncio.Queue(maxsize=2)
        self._partial: list[cqs_pb2.SplitItem] = []
        self.partial_since: float | None = None
        loop = asyncio.get_running_loop()
        self._clock = loop.time
        self._task = loop.create_task(self._pump(source))

    async def _pump(self, source: AsyncIterator[cqs_pb2.ReEnqueueRequest]) -> None:
        try:
            async for frame in source:
                if frame.WhichOneof("payload") == "item":
                    if not self._partial:
                        self.partial_since = self._clock()
                        if self._ready.empty():  # wake the reader: a flush is now due
                            self._ready.put_nowait(_STARTED)
                    self._partial.append(frame.item)
                    if len(self._partial) >= FLUSH_ITEMS:
                        await self._ready.put(self.take_partial())
                    continue
                if self._partial:
                    await self._ready.put(self.take_partial())
                await self._ready.put(frame)
        except Exception:  # the client went away: the same as an end without Footer
            pass
        if self._partial:
            await self._ready.put(self.take_partial())
        await self._ready.put(_END)

    def take_partial(self) -> list[cqs_pb2.SplitItem]:
        batch, self._partial = self._partial, []
        self.partial_since = None
        return batch

    async def next(self, timeout: float | None) -> object:
        """A list of items, another frame, _STARTED when a partial batch begins,
        _END at the end of the stream, or _TIMEOUT after `timeout` seconds."""
        if not self._ready.empty():  # no timed wait (a task) when a frame is there
            return self._ready.get_nowait()
        try:
            return await asyncio.wait_for(self._ready.get(), timeout)
        except TimeoutError:
            # A frame queued in the loop turn the timeout fired in stays queued
            # when the wait is cancelled: it comes before the partial batch, so
            # it is next, or that batch would be flushed ahead of it.
            if not self._ready.empty():
                return self._ready.get_nowait()
            return _TIMEOUT

    async def rest(self) -> AsyncIterator[cqs_pb2.ReEnqueueRequest]:
        """The frames still to come, as they came (items one by one, a partial batch
        once its flush is due), until the stream ends: what a front passes on to the
        queue's dispatching front."""
        while True:
            since = self.partial_since
            frame = await self.next(
                None if since is None else max(0.0, since + FLUSH_SECONDS - self._clock())
            )
            if frame is _TIMEOUT:
                frame = self.take_partial()
            if frame is _END:
                return
            if isinstance(frame, list):
                for item in frame:
                    yield cqs_pb2.ReEnqueueRequest(item=item)
            elif isinstance(frame, cqs_pb2.ReEnqueueRequest):
                yield frame

    def close(self) -> None:
        self._task.cancel()
