"""A Change Queue Service consumer (seeds 000 and 001; docs/cqs.md).

- `CqsConsumer.dequeue` and `acknowledge` are BatchDequeue and BatchAcknowledge,
  retried on another endpoint while the server is unavailable (acknowledging
  a token twice is harmless; a dequeue whose answer was lost comes back after
  the visibility timeout).
- `CqsConsumer.process` runs one batch through a handler with seed 000's rule
  built in, decided per notification: success is acknowledged; a transient
  failure (`errors.is_transient`: UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL
  along the cause chain) is left out of the acknowledgement, so it comes back
  after the visibility timeout; a permanent one is surfaced (logged, handed to
  `on_permanent`, listed in the `BatchOutcome`) and acknowledged, so it does
  not come back forever.
- `CqsConsumer.re_enqueue` is ReEnqueue as an async context manager: the Header
  goes on entry, items as they are added, and the Footer, which commits (the
  original is acknowledged after every item is queued), only when the block
  ends without an exception. On an exception the stream is half-closed
  without a Footer: the server ends it with CANCELLED, keeps the items it
  received and does not acknowledge the original (it comes back after the
  visibility timeout); the exception propagates.

Imports nothing of the server.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, cast

import grpc
import grpc.aio

from etcdserverpb import cqs_pb2
from queue_server.client.connection import Connection, Stubs
from queue_server.client.errors import TRANSIENT_CODES, is_transient

log = logging.getLogger(__name__)

Notification = cqs_pb2.DtoChangeNotification
Handler = Callable[[Notification], Awaitable[None] | None]
"""Processes one notification; raises to report a failure."""
OnPermanent = Callable[[Notification, BaseException], Awaitable[None] | None]
"""Records a notification that failed for good (e.g. parks it), before it is
acknowledged; if it raises, the notification is left for redelivery."""

DEFAULT_WAIT_MS = 30_000
"""BatchDequeue's long-poll wait: the seed's recommended loop."""
ABORT_WAIT = 5.0
"""Seconds to wait for the server's answer to a ReEnqueue ended without a Footer."""


@dataclass
class BatchOutcome:
    """What became of one dequeued batch."""

    notifications: list[Notification] = field(default_factory=list)
    acknowledged: list[Notification] = field(default_factory=list)
    transient: list[tuple[Notification, BaseException]] = field(default_factory=list)
    """Left unacknowledged: visible again after the visibility timeout."""
    permanent: list[tuple[Notification, BaseException]] = field(default_factory=list)
    """Failed for good: acknowledged once `on_permanent` returned (if it raised,
    not acknowledged, and in `unrecorded` too)."""
    unrecorded: list[tuple[Notification, BaseException]] = field(default_factory=list)
    """Permanent failures whose `on_permanent` raised (that error): left for redelivery."""

    @property
    def tokens(self) -> list[str]:
        """The ack tokens to acknowledge."""
        return [n.ack_token for n in self.acknowledged]


def _describe(n: Notification) -> str:
    return (
        f"dto_type={n.dto_type} dto_id={n.dto_id} parent_id={n.parent_id} "
        f"tracking_id={n.tracking_id}"
    )


def classify(outcome: BatchOutcome, n: Notification, error: BaseException | None) -> bool:
    """Record how processing `n` ended (`error` None: success). True when it
    is to be acknowledged as things stand (a permanent failure still needs its
    `on_permanent` to succeed)."""
    if error is None:
        outcome.acknowledged.append(n)
        return True
    if is_transient(error):
        log.warning("cqs transient failure, will redeliver %s error=%r", _describe(n), error)
        outcome.transient.append((n, error))
        return False
    log.error("cqs permanent failure, acknowledged %s error=%r", _describe(n), error)
    outcome.permanent.append((n, error))
    outcome.acknowledged.append(n)
    return True


def unrecord(outcome: BatchOutcome, n: Notification, error: BaseException) -> None:
    """`on_permanent` failed for `n`: do not acknowledge it after all."""
    log.error(
        "cqs permanent failure not recorded, left for redelivery %s error=%r", _describe(n), error
    )
    outcome.acknowledged.remove(n)
    outcome.unrecorded.append((n, error))


class CqsConsumer:
    """A consumer of the CQS queue `queue_name`."""

    def __init__(
        self,
        connection: Connection,
        queue_name: str,
        *,
        max_notifications: int = 10,
        prefix_depth: int = 0,
        wait_ms: int = DEFAULT_WAIT_MS,
    ) -> None:
        """Defaults for `dequeue`: at most `max_notifications` per batch, grouped
        by `prefix_depth` path segments (0: the queue's depth), waiting up to
        `wait_ms` for the first."""
        self.connection = connection
        self.queue_name = queue_name
        self.max_notifications = max_notifications
        self.prefix_depth = prefix_depth
        self.wait_ms = wait_ms

    async def configure(
        self,
        subscriptions: Sequence[str | tuple[str, str] | cqs_pb2.DtoTypeSubscription],
        depth: int = 0,
    ) -> None:
        """CreateOrConfigureQueue: create the queue or replace its subscriptions
        (a dto_type, or (dto_type, alias_name)); `depth` counts at creation only."""
        subs = []
        for s in subscriptions:
            if isinstance(s, str):
                subs.append(cqs_pb2.DtoTypeSubscription(dto_type=s))
            elif isinstance(s, tuple):
                subs.append(cqs_pb2.DtoTypeSubscription(dto_type=s[0], alias_name=s[1]))
            else:
                subs.append(s)
        request = cqs_pb2.CreateOrConfigureQueueRequest(
            queue_name=self.queue_name, subscriptions=subs, depth=depth
        )
        conn = self.connection
        await conn.call(lambda s: s.cqs.CreateOrConfigureQueue(request, timeout=conn.timeout))

    async def dequeue(
        self,
        max_notifications: int | None = None,
        prefix_depth: int | None = None,
        wait_ms: int | None = None,
    ) -> list[Notification]:
        """BatchDequeue: the most urgent notification and same-prefix followers,
        waiting up to `wait_ms` for one (empty: none came)."""
        wait = self.wait_ms if wait_ms is None else wait_ms
        request = cqs_pb2.BatchDequeueRequest(
            queue_name=self.queue_name,
            max_notifications=max_notifications or self.max_notifications,
            prefix_depth=self.prefix_depth if prefix_depth is None else prefix_depth,
            wait_time_milliseconds=wait,
        )
        conn = self.connection
        timeout = wait / 1000 + conn.timeout  # longer than the server's wait

        async def call(s: Stubs) -> cqs_pb2.BatchDequeueResponse:
            return cast(
                cqs_pb2.BatchDequeueResponse, await s.cqs.BatchDequeue(request, timeout=timeout)
            )

        return list((await conn.call(call)).notifications)

    async def acknowledge(self, tokens: Iterable[str]) -> None:
        """BatchAcknowledge `tokens` (unknown, repeated and expired ones are
        ignored by the server), retried while it fails transiently."""
        request = cqs_pb2.BatchAcknowledgeRequest(
            queue_name=self.queue_name, ack_tokens=list(tokens)
        )
        if not request.ack_tokens:
            return
        conn = self.connection
        await conn.call(
            lambda s: s.cqs.BatchAcknowledge(request, timeout=conn.timeout),
            retry_codes=TRANSIENT_CODES,
        )

    async def process(
        self,
        handler: Handler,
        *,
        on_permanent: OnPermanent | None = None,
        batch: Sequence[Notification] | None = None,
        **dequeue: Any,
    ) -> BatchOutcome:
        """Dequeue one batch (or take `batch`), run `handler` on each notification
        and acknowledge by seed 000's rule (see the module docstring). `dequeue`
        takes `dequeue()`'s arguments."""
        notifications = list(batch) if batch is not None else await self.dequeue(**dequeue)
        outcome = BatchOutcome(notifications=notifications)
        for n in notifications:
            error: BaseException | None = None
            try:
                result = handler(n)
                if inspect.isawaitable(result):
                    await result
            except Exception as e:
                error = e
            if classify(outcome, n, error) and error is not None and on_permanent is not None:
                try:
                    recorded = on_permanent(n, error)
                    if inspect.isawaitable(recorded):
                        await recorded
                except Exception as e:
                    unrecord(outcome, n, e)
        await self.acknowledge(outcome.tokens)
        return outcome

    async def run(
        self,
        handler: Handler,
        *,
        on_permanent: OnPermanent | None = None,
        stop: asyncio.Event | None = None,
    ) -> None:
        """`process` batches until `stop` is set (checked between batches)."""
        while stop is None or not stop.is_set():
            await self.process(handler, on_permanent=on_permanent)

    def re_enqueue(self, notification: Notification | str) -> ReEnqueue:
        """A ReEnqueue stream replacing `notification` (or an ack token) with
        items: `async with consumer.re_enqueue(n) as split: await split.add(...)`."""
        token = notification if isinstance(notification, str) else notification.ack_token
        return ReEnqueue(self.connection, self.queue_name, token)


class ReEnqueue:
    """One ReEnqueue stream, as an async context manager. The Footer is sent
    only when the block ends cleanly; `response` is then the server's answer."""

    def __init__(self, connection: Connection, queue_name: str, ack_token: str) -> None:
        self.connection = connection
        self.queue_name = queue_name
        self.ack_token = ack_token
        self.items_sent = 0
        self.response: cqs_pb2.ReEnqueueResponse | None = None
        self._call: Any = None

    async def __aenter__(self) -> ReEnqueue:
        stubs = self.connection.stubs()
        self._call = stubs.cqs.ReEnqueue()
        header = cqs_pb2.ReEnqueueRequest.Header(
            queue_name=self.queue_name, ack_token=self.ack_token
        )
        await self._write(cqs_pb2.ReEnqueueRequest(header=header))
        return self

    async def _write(self, request: cqs_pb2.ReEnqueueRequest) -> None:
        try:
            await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            await self._call  # the call ended: raise its status
            raise

    async def add(self, item: cqs_pb2.SplitItem) -> None:
        """Send one replacement item (HTTP/2 flow control paces a fast sender)."""
        await self._write(cqs_pb2.ReEnqueueRequest(item=item))
        self.items_sent += 1

    async def add_dto(self, dto_type: str, dto_id: str, alias_name: str = "") -> None:
        """An item addressing one DTO."""
        await self.add(cqs_pb2.SplitItem(dto_type=dto_type, dto_id=dto_id, alias_name=alias_name))

    async def add_parent(self, dto_type: str, parent_id: str, alias_name: str = "") -> None:
        """An item addressing a group under `parent_id` (a tier of a split)."""
        await self.add(
            cqs_pb2.SplitItem(dto_type=dto_type, parent_id=parent_id, alias_name=alias_name)
        )

    async def add_all(
        self, items: Iterable[cqs_pb2.SplitItem] | AsyncIterable[cqs_pb2.SplitItem]
    ) -> None:
        """Send every item of a (possibly async) iterable, one at a time."""
        if isinstance(items, AsyncIterable):
            async for item in items:
                await self.add(item)
        else:
            for item in items:
                await self.add(item)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        call = self._call
        if exc_type is None:
            await self._write(cqs_pb2.ReEnqueueRequest(footer=cqs_pb2.ReEnqueueRequest.Footer()))
            await call.done_writing()
            self.response = cast(cqs_pb2.ReEnqueueResponse, await call)
            return
        if not issubclass(exc_type, Exception):  # cancelled, interrupted: go at once
            call.cancel()
            return
        # No Footer: half-close, and let the server end the stream (CANCELLED,
        # items kept, original not acknowledged) before the exception goes on.
        try:
            await call.done_writing()
            await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(_ended(call))), ABORT_WAIT)
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass
        finally:
            call.cancel()


async def _ended(call: Any) -> None:
    """Await the end of a call, whatever its status."""
    try:
        await call
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            log.info("cqs re-enqueue ended without a Footer code=%s", e.code().name)
