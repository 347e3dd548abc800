"""The blocking API: the asyncio library driven from a thread of its own.

A `SyncClient` starts one event loop in a daemon thread and runs every call of
the async `Client` there, waiting for the result; the objects it hands out
(`SyncConsumer`, `SyncMessage`, `SyncProducer`, `SyncCqsConsumer`,
`SyncReEnqueue`) mirror the async ones with plain methods. Handlers given to
`SyncCqsConsumer.process` run in the caller's thread, not the loop's, so they
may block. Errors are the async API's, raised in the caller's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import grpc

from etcdserverpb import cqs_pb2, rpc_pb2
from queue_server.client.client import Client
from queue_server.client.connection import DEFAULT_RETRY_FOR, DEFAULT_TIMEOUT
from queue_server.client.cqs import (
    DEFAULT_WAIT_MS,
    BatchOutcome,
    CqsConsumer,
    Notification,
    ReEnqueue,
    classify,
    unrecord,
)
from queue_server.client.errors import ConsumerClosed
from queue_server.client.queue import Consumer, Message, MessageInfo, Produce, Producer

T = TypeVar("T")

CLOSE_WAIT = 10.0
"""Seconds `SyncClient.close` waits for the loop thread to end."""


class _LoopThread:
    """An event loop running in a daemon thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="queue-client-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (at most `timeout` s:
        then it is cancelled and TimeoutError raised)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_WAIT)
        if not self._thread.is_alive():
            self.loop.close()


class SyncClient:
    """The blocking twin of `Client` (same arguments); use `with`, or `close()`."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry_for: float = DEFAULT_RETRY_FOR,
        options: Sequence[tuple[str, int | str]] = (),
    ) -> None:
        self._loop = _LoopThread()
        self.client = Client(
            endpoints,
            credentials=credentials,
            timeout=timeout,
            retry_for=retry_for,
            options=options,
        )

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine of the async API on the client's loop, and wait."""
        return self._loop.run(coro, timeout)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.run(self.client.close(), CLOSE_WAIT)
        finally:
            self._loop.stop()

    def consumer(
        self, name: str, *, consumer_id: str | None = None, prefetch: int | None = None
    ) -> SyncConsumer:
        """A consumer of queue `name` (not started: use `with` or `start()`)."""
        return SyncConsumer(
            self, self.client.consumer(name, consumer_id=consumer_id, prefetch=prefetch)
        )

    def producer(self, name: str, **kwargs: int) -> SyncProducer:
        """A producer for queue `name` (`max_txn_ops`, `max_txn_bytes` as `Client.producer`)."""
        return SyncProducer(self, self.client.producer(name, **kwargs))

    def settings(self, name: str) -> dict[str, Any]:
        return self.run(self.client.settings(name))

    def configure(self, name: str, **changes: Any) -> dict[str, Any]:
        return self.run(self.client.configure(name, **changes))

    def redrive(self, name: str, limit: int | None = None) -> int:
        """Move `name`'s dead letters back into it; returns how many moved."""
        return self.run(self.client.redrive(name, limit))

    def cqs(
        self,
        queue_name: str,
        *,
        max_notifications: int = 10,
        prefix_depth: int = 0,
        wait_ms: int = DEFAULT_WAIT_MS,
    ) -> SyncCqsConsumer:
        return SyncCqsConsumer(
            self,
            self.client.cqs(
                queue_name,
                max_notifications=max_notifications,
                prefix_depth=prefix_depth,
                wait_ms=wait_ms,
            ),
        )


@dataclass(eq=False)
class SyncMessage(MessageInfo):
    """A delivery, with blocking `ack()`, `nack()`, `extend()` (see `Message`)."""

    message: Message = field(repr=False, kw_only=True)
    client: SyncClient = field(repr=False, kw_only=True)

    @classmethod
    def of(cls, message: Message, client: SyncClient) -> SyncMessage:
        return cls(**message.info(), message=message, client=client)

    def compare(self) -> rpc_pb2.Compare:
        return self.message.compare()

    def ack_op(self) -> rpc_pb2.RequestOp:
        return self.message.ack_op()

    def ack(self) -> bool:
        return self.client.run(self.message.ack())

    def ack_with(self, *ops: rpc_pb2.RequestOp) -> bool:
        return self.client.run(self.message.ack_with(*ops))

    def nack(self) -> bool:
        return self.client.run(self.message.nack())

    def extend(self) -> int:
        return self.client.run(self.message.extend())

    @contextlib.contextmanager
    def extending(self, every: float | None = None) -> Iterator[None]:
        """Keep the delivery while the block runs (see `Message.extending`); the
        extensions run on the client's loop thread."""
        task = self.client.run(self.message.start_extending(every))
        try:
            yield
        finally:
            self.client.run(_stop(task), CLOSE_WAIT)


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class SyncConsumer:
    """A blocking consumer: `for message in consumer`, or `get(timeout)`."""

    def __init__(self, client: SyncClient, consumer: Consumer) -> None:
        self.client = client
        self.consumer = consumer

    @property
    def consumer_id(self) -> str:
        return self.consumer.consumer_id

    @property
    def endpoint(self) -> str | None:
        return self.consumer.endpoint

    @property
    def watches(self) -> int:
        return self.consumer.watches

    def start(self, timeout: float | None = None) -> SyncConsumer:
        self.client.run(self.consumer.start(timeout))
        return self

    def wait_watching(self, timeout: float | None = None) -> None:
        self.client.run(self.consumer.wait_watching(timeout))

    def close(self) -> None:
        self.client.run(self.consumer.close(), CLOSE_WAIT)

    def __enter__(self) -> SyncConsumer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, timeout: float | None = None) -> SyncMessage | None:
        """The next delivery, or None after `timeout` s (None: wait for one)."""
        found = self.client.run(self.consumer.get(timeout))
        return None if found is None else SyncMessage.of(found, self.client)

    def __iter__(self) -> Iterator[SyncMessage]:
        while True:
            try:
                found = self.client.run(self.consumer.get())
            except ConsumerClosed:
                return
            if found is not None:
                yield SyncMessage.of(found, self.client)


class SyncProducer:
    """A blocking producer (see `Producer`)."""

    def __init__(self, client: SyncClient, producer: Producer) -> None:
        self.client = client
        self.producer = producer

    def send(self, value: bytes | str, key: str | bytes | None = None, lease: int = 0) -> int:
        return self.client.run(self.producer.send(value, key, lease))

    def send_batch(self, messages: Iterable[Produce], lease: int = 0) -> list[int]:
        return self.client.run(self.producer.send_batch(list(messages), lease))


class SyncCqsConsumer:
    """A blocking CQS consumer (see `CqsConsumer`); handlers run in the caller's thread."""

    def __init__(self, client: SyncClient, consumer: CqsConsumer) -> None:
        self.client = client
        self.consumer = consumer

    def configure(
        self,
        subscriptions: Sequence[str | tuple[str, str] | cqs_pb2.DtoTypeSubscription],
        depth: int = 0,
    ) -> None:
        self.client.run(self.consumer.configure(subscriptions, depth))

    def dequeue(
        self,
        max_notifications: int | None = None,
        prefix_depth: int | None = None,
        wait_ms: int | None = None,
    ) -> list[Notification]:
        return self.client.run(self.consumer.dequeue(max_notifications, prefix_depth, wait_ms))

    def acknowledge(self, tokens: Iterable[str]) -> None:
        self.client.run(self.consumer.acknowledge(list(tokens)))

    def process(
        self,
        handler: Callable[[Notification], object],
        *,
        on_permanent: Callable[[Notification, BaseException], object] | None = None,
        batch: Sequence[Notification] | None = None,
        **dequeue: Any,
    ) -> BatchOutcome:
        """As `CqsConsumer.process`, with a blocking `handler(n)` and
        `on_permanent(n, error)` run in this thread."""
        notifications = list(batch) if batch is not None else self.dequeue(**dequeue)
        outcome = BatchOutcome(notifications=notifications)
        for n in notifications:
            error: BaseException | None = None
            try:
                handler(n)
            except Exception as e:
                error = e
            if classify(outcome, n, error) and error is not None and on_permanent is not None:
                try:
                    on_permanent(n, error)
                except Exception as e:
                    unrecord(outcome, n, e)
        self.acknowledge(outcome.tokens)
        return outcome

    def re_enqueue(self, notification: Notification | str) -> SyncReEnqueue:
        """ReEnqueue as a context manager: `with consumer.re_enqueue(n) as split:`."""
        return SyncReEnqueue(self.client, self.consumer.re_enqueue(notification))


class SyncReEnqueue:
    """A ReEnqueue stream; the Footer is sent only when the `with` block ends cleanly."""

    def __init__(self, client: SyncClient, stream: ReEnqueue) -> None:
        self.client = client
        self.stream = stream

    @property
    def response(self) -> cqs_pb2.ReEnqueueResponse | None:
        return self.stream.response

    @property
    def items_sent(self) -> int:
        return self.stream.items_sent

    def __enter__(self) -> SyncReEnqueue:
        self.client.run(self.stream.__aenter__())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.client.run(self.stream.__aexit__(exc_type, exc, tb))

    def add(self, item: cqs_pb2.SplitItem) -> None:
        self.client.run(self.stream.add(item))

    def add_dto(self, dto_type: str, dto_id: str, alias_name: str = "") -> None:
        self.client.run(self.stream.add_dto(dto_type, dto_id, alias_name))

    def add_parent(self, dto_type: str, parent_id: str, alias_name: str = "") -> None:
        self.client.run(self.stream.add_parent(dto_type, parent_id, alias_name))

    def add_all(self, items: Iterable[cqs_pb2.SplitItem]) -> None:
        for item in items:
            self.add(item)
