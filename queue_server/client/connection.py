"""Channels to a list of endpoints, and unary calls retried across them.

A `Connection` keeps one grpc.aio channel per endpoint, opened on first use, and
a current endpoint. A call that fails with a code in `RETRY_CODES` moves the
current endpoint on to the next one and is tried again after a backoff, until
`retry_for` seconds have passed; then the last error is raised. Streams (a
consumer's watch, a ReEnqueue) are not retried here: their owners reconnect.

The channel options shorten grpc's reconnect backoff (its default grows to two
minutes), so a member that comes back after a restart is used again within a
second. Imports nothing of the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TypeVar, cast

import grpc
import grpc.aio

from etcdserverpb import cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from queue_server.client.errors import RETRY_CODES

T = TypeVar("T")

EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]
"""What a stream's read() returns at its end (not in grpc's type stubs)."""

DEFAULT_TIMEOUT = 10.0
"""Seconds one unary call may take before it fails with DEADLINE_EXCEEDED."""
DEFAULT_RETRY_FOR = 30.0
"""Seconds a call keeps being retried on UNAVAILABLE: longer than an election
and a member's restart, short enough that a dead cluster is reported."""
BACKOFF_FIRST = 0.05
BACKOFF_MAX = 1.0
"""Pauses between attempts: doubling from 50 ms up to 1 s."""
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # a member that hangs (stopped, cut off) is noticed within 15 s: a ping
    # every 10 s, even on an idle watch, is within the server's ping policy
    # (a strike is a ping less than 5 s after the last one)
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # deliveries come in responses of at most about 2 MiB, but one message may
    # be up to --max-request-bytes (1.5 MiB) plus its key: 16 MiB is plenty
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
)


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """`host:port` strings from a list or a comma-separated string; an
    `http://` prefix (etcdctl's form) is dropped."""
    raw = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for e in raw:
        e = e.strip()
        for scheme in ("http://", "https://"):
            e = e.removeprefix(scheme)
        if e:
            out.append(e.rstrip("/"))
    if not out:
        raise ValueError("no endpoint given")
    return out


class Stubs:
    """The generated stubs on one channel, with typed results."""

    def __init__(self, endpoint: str, channel: grpc.aio.Channel) -> None:
        self.endpoint = endpoint
        self.channel = channel
        self.kv = rpc_pb2_grpc.KVStub(channel)
        self.watch = rpc_pb2_grpc.WatchStub(channel)
        self.lease = rpc_pb2_grpc.LeaseStub(channel)
        self.cqs = cqs_pb2_grpc.DtoChangeQueueServiceStub(channel)

    async def range(self, request: rpc_pb2.RangeRequest, timeout: float) -> rpc_pb2.RangeResponse:
        return cast(rpc_pb2.RangeResponse, await self.kv.Range(request, timeout=timeout))

    async def put(self, request: rpc_pb2.PutRequest, timeout: float) -> rpc_pb2.PutResponse:
        return cast(rpc_pb2.PutResponse, await self.kv.Put(request, timeout=timeout))

    async def delete(
        self, request: rpc_pb2.DeleteRangeRequest, timeout: float
    ) -> rpc_pb2.DeleteRangeResponse:
        return cast(
            rpc_pb2.DeleteRangeResponse, await self.kv.DeleteRange(request, timeout=timeout)
        )

    async def txn(self, request: rpc_pb2.TxnRequest, timeout: float) -> rpc_pb2.TxnResponse:
        return cast(rpc_pb2.TxnResponse, await self.kv.Txn(request, timeout=timeout))

    async def lease_revoke(self, lease_id: int, timeout: float) -> rpc_pb2.LeaseRevokeResponse:
        request = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        return cast(
            rpc_pb2.LeaseRevokeResponse, await self.lease.LeaseRevoke(request, timeout=timeout)
        )

    async def lease_keep_alive(self, lease_id: int, timeout: float) -> int:
        """One keepalive on a stream of its own: the TTL answered (0: no such lease)."""
        call = self.lease.LeaseKeepAlive(timeout=timeout)
        try:
            await call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
            response = await call.read()
            await call.done_writing()
        finally:
            call.cancel()
        if response is EOF:
            return 0
        return int(cast(rpc_pb2.LeaseKeepAliveResponse, response).TTL)


class Connection:
    """Channels to `endpoints`, one current, and retried unary calls."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry_for: float = DEFAULT_RETRY_FOR,
        options: Sequence[tuple[str, int | str]] = (),
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.credentials = credentials
        self.timeout = timeout
        self.retry_for = retry_for
        self.options: list[tuple[str, int | str]] = [*CHANNEL_OPTIONS, *options]
        self._current = 0
        self._stubs: dict[str, Stubs] = {}
        self.closed = False

    def stubs(self, endpoint: str | None = None) -> Stubs:
        """The stubs of `endpoint` (default: the current one), opening its channel."""
        if self.closed:
            raise RuntimeError("the client is closed")
        endpoint = endpoint or self.endpoints[self._current]
        found = self._stubs.get(endpoint)
        if found is None:
            if self.credentials is None:
                channel = grpc.aio.insecure_channel(endpoint, options=self.options)
            else:
                channel = grpc.aio.secure_channel(endpoint, self.credentials, options=self.options)
            found = self._stubs[endpoint] = Stubs(endpoint, channel)
        return found

    def failed(self, endpoint: str) -> None:
        """`endpoint` did not answer: move the current endpoint past it."""
        if self.endpoints[self._current] == endpoint:
            self._current = (self._current + 1) % len(self.endpoints)

    async def call(
        self,
        fn: Callable[[Stubs], Awaitable[T]],
        endpoint: str | None = None,
        retry_codes: Collection[grpc.StatusCode] = RETRY_CODES,
    ) -> T:
        """`fn` on the current endpoint's stubs (or on `endpoint` first), retried
        on another endpoint while it fails with a code in `retry_codes`, for up
        to `retry_for` seconds."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.retry_for
        delay = BACKOFF_FIRST
        while True:
            stubs = self.stubs(endpoint)
            try:
                return await fn(stubs)
            except grpc.aio.AioRpcError as e:
                if e.code() not in retry_codes or loop.time() + delay > give_up:
                    raise
                self.failed(stubs.endpoint)
                endpoint = None
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    async def range(
        self, request: rpc_pb2.RangeRequest, endpoint: str | None = None
    ) -> rpc_pb2.RangeResponse:
        """A retried Range."""
        return await self.call(lambda s: s.range(request, self.timeout), endpoint)

    async def delete(
        self, request: rpc_pb2.DeleteRangeRequest, endpoint: str | None = None
    ) -> rpc_pb2.DeleteRangeResponse:
        """A retried DeleteRange."""
        return await self.call(lambda s: s.delete(request, self.timeout), endpoint)

    async def txn(
        self, request: rpc_pb2.TxnRequest, endpoint: str | None = None
    ) -> rpc_pb2.TxnResponse:
        """A retried Txn."""
        return await self.call(lambda s: s.txn(request, self.timeout), endpoint)

    async def close(self) -> None:
        self.closed = True
        stubs, self._stubs = list(self._stubs.values()), {}
        for s in stubs:
            await s.channel.close(None)
