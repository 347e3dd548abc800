"""`Client`: the asyncio entry point, one connection to a list of endpoints.

Everything the library does starts here: consumers and producers of etcd-key
queues, queue settings, redrive, and CQS consumers, all sharing the client's
channels and its retry rule (`connection.py`). Use it inside one event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from queue_server.client import queue
from queue_server.client.connection import DEFAULT_RETRY_FOR, DEFAULT_TIMEOUT, Connection
from queue_server.client.cqs import DEFAULT_WAIT_MS, CqsConsumer
from queue_server.client.queue import Consumer, Producer


class Client:
    """A connection to the server (or the members of a cluster).

    `endpoints`: "host:port" strings, a list or comma-separated; calls go to
    one and move on to the next when it is unavailable. `timeout` bounds each
    unary call; `retry_for` how long calls are retried on UNAVAILABLE (and
    how long a consumer's start waits for its watch). `credentials`: TLS.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry_for: float = DEFAULT_RETRY_FOR,
        options: Sequence[tuple[str, int | str]] = (),
    ) -> None:
        self.connection = Connection(
            endpoints,
            credentials=credentials,
            timeout=timeout,
            retry_for=retry_for,
            options=options,
        )

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every channel (consumers should be closed first)."""
        await self.connection.close()

    def consumer(
        self, name: str, *, consumer_id: str | None = None, prefetch: int | None = None
    ) -> Consumer:
        """A consumer of queue `name` (not started: use `async with` or `start()`)."""
        return Consumer(self.connection, name, consumer_id=consumer_id, prefetch=prefetch)

    def producer(
        self,
        name: str,
        *,
        max_txn_ops: int = queue.MAX_TXN_OPS,
        max_txn_bytes: int = queue.MAX_TXN_BYTES,
    ) -> Producer:
        """A producer for queue `name`."""
        return Producer(self.connection, name, max_txn_ops=max_txn_ops, max_txn_bytes=max_txn_bytes)

    async def settings(self, name: str) -> dict[str, Any]:
        """The queue's settings (`/q/{name}/config`; empty: all defaults)."""
        return await queue.settings(self.connection, name)

    async def configure(self, name: str, **changes: Any) -> dict[str, Any]:
        """Change some settings of queue `name`, keep the rest (None removes one)."""
        return await queue.configure(self.connection, name, **changes)

    async def redrive(self, name: str, limit: int | None = None) -> int:
        """Move `name`'s dead letters back into it (all, or at most `limit`);
        returns how many moved."""
        return await queue.redrive(self.connection, name, limit)

    def cqs(
        self,
        queue_name: str,
        *,
        max_notifications: int = 10,
        prefix_depth: int = 0,
        wait_ms: int = DEFAULT_WAIT_MS,
    ) -> CqsConsumer:
        """A consumer of the CQS queue `queue_name`."""
        return CqsConsumer(
            self.connection,
            queue_name,
            max_notifications=max_notifications,
            prefix_depth=prefix_depth,
            wait_ms=wait_ms,
        )
