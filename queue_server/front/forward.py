"""Every method of etcd's API, served by forwarding the call to the backend.

What belongs here: the method table of a front (`forward_methods`). Each
handler hands the request's bytes to the backend as they came, with the
client's metadata (its auth token, `hasleader`) and what is left of its
deadline, and hands back the backend's response bytes, or its status code and
message unchanged. Nothing is parsed on the gRPC path; requests from the
HTTP/JSON gateway arrive as messages and are serialized once.

Streams are forwarded message by message in both directions: one backend
stream per client stream, but for Watch, whose watches of one shape share a
backend watch (`watch_coalesce.py`). When either side ends, the other is ended too. The
stream handlers are coroutines that write (`Call.write`), not async generators:
a cancelled call then runs their `finally` at once, where a generator's would
wait for the garbage collector, and with it the end of the backend stream and
a consumer's unregistration.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc import aio

from etcdserverpb import rpc_pb2, v3election_pb2, v3lock_pb2
from queue_server.errors import EtcdError
from queue_server.front.admission import names_a_queue
from queue_server.front.direct import DELETE_PATH, PUT_PATH, TXN_PATH
from queue_server.front.h2_client import CallError
from queue_server.front.queues import QueueFronts, Refused
from queue_server.front.upstream import Upstream
from queue_server.front.watch_coalesce import WatchHub
from queue_server.transport.methods import Call, Handler, Method
from queue_server.transport.status import Status

SERVICES: tuple[ServiceDescriptor, ...] = (
    *rpc_pb2.DESCRIPTOR.services_by_name.values(),
    v3lock_pb2.DESCRIPTOR.services_by_name["Lock"],
    v3election_pb2.DESCRIPTOR.services_by_name["Election"],
)
"""What etcd 3.5 serves on its client port, all of it forwarded."""

WAITING = frozenset(
    {
        "/etcdserverpb.Watch/Watch",
        "/etcdserverpb.Lease/LeaseKeepAlive",
        "/v3lockpb.Lock/Lock",
        "/v3electionpb.Election/Campaign",
        "/v3electionpb.Election/Observe",
    }
)
"""Calls that last as long as the client wants: a stop ends them at once."""

UNAVAILABLE_TEXT = "etcdserver: backend unavailable: "
"""How a front says the backend did not answer (the code is UNAVAILABLE, which
every etcd client retries or reports as it does for etcd's own)."""


def _identity(data: bytes) -> bytes:
    return data


def _as_bytes(request: Any) -> bytes:
    return request if type(request) is bytes else bytes(request.SerializeToString())


def _metadata(call: Call) -> tuple[tuple[str, str], ...]:
    return tuple(call.invocation_metadata())


async def _abort_with(call: Call, error: aio.AioRpcError) -> None:
    code = Status(error.code().value[0])
    details = error.details() or ""
    if code is Status.UNAVAILABLE and not details.startswith("etcdserver:"):
        details = UNAVAILABLE_TEXT + details  # grpc's own words, not etcd's
    await call.abort(code, details)


Route = Callable[[bytes, Call, Callable[[], Awaitable[bytes]]], Awaitable[bytes]]
"""Serves a request's bytes itself, or by the forwarding it is given; raises
an EtcdError to refuse it (`direct.py`). Asked only of requests whose bytes may
name a queue key (`names_a_queue`): the others go straight to etcd."""


def _routes(queues: QueueFronts | None) -> dict[str, Route]:
    """The writes the queues see before etcd does: checked as admission.py
    checks them, and produces and acks served without a revision of their own
    (`direct.py`)."""
    if queues is None:
        return {}
    return {
        PUT_PATH: queues.direct.put,
        TXN_PATH: queues.direct.txn,
        DELETE_PATH: queues.direct.delete,
    }


def _unary(upstream: Upstream, path: str, route: Route | None = None) -> Handler:
    send = upstream.unary.call

    async def handler(request: Any, call: Call) -> bytes:
        data = _as_bytes(request)
        try:
            if route is not None and names_a_queue(data):

                def plain() -> Awaitable[bytes]:
                    return send(path, data, call.invocation_metadata(), call.time_remaining())

                return await route(data, call, plain)
            return await send(path, data, call.invocation_metadata(), call.time_remaining())
        except EtcdError as e:
            await call.abort(Status[e.code], e.text)
        except CallError as e:  # the backend's status, or its failure, as etcd's own
            message = e.message
            if e.code is Status.UNAVAILABLE and not message.startswith("etcdserver:"):
                message = UNAVAILABLE_TEXT + message
            await call.abort(e.code, message)

    return handler


def _server_stream(upstream: Upstream, path: str) -> Handler:
    open_stream = upstream.channel.unary_stream(path, _identity, _identity)

    async def handler(request: Any, call: Call) -> None:
        stream = open_stream(
            _as_bytes(request), metadata=_metadata(call), timeout=call.time_remaining()
        )
        try:
            async for reply in stream:
                await call.write(reply)
        except aio.AioRpcError as e:
            await _abort_with(call, e)
        finally:
            stream.cancel()

    return handler


class StreamTap(Protocol):
    """What may see, and rewrite, the requests of one forwarded bidi stream."""

    async def request(self, data: bytes) -> bytes:
        """The request to send the backend in place of `data`; raises
        `Refused` to answer the client itself and send nothing."""

    def response(self, data: bytes) -> None:
        """A response on its way to the client."""

    def end(self) -> None:
        """The stream ended, either way."""


WATCH_PATH = "/etcdserverpb.Watch/Watch"


def _bidi_stream(
    upstream: Upstream, path: str, tap: Callable[[], StreamTap] | None = None
) -> Handler:
    """A bidi stream forwarded both ways; `tap` makes each stream's `StreamTap`."""
    open_stream = upstream.channel.stream_stream(path, _identity, _identity)

    async def handler(requests: AsyncIterator[Any], call: Call) -> None:
        seen = tap() if tap is not None else None
        stream = open_stream(None, metadata=_metadata(call), timeout=call.time_remaining())

        async def pump() -> None:
            try:
                async for request in requests:
                    data = _as_bytes(request)
                    if seen is not None:
                        try:
                            data = await seen.request(data)
                        except Refused as refused:
                            await call.write(refused.response)
                            continue
                    await stream.write(data)
                await stream.done_writing()
            except (aio.AioRpcError, asyncio.InvalidStateError):
                stream.cancel()  # the stream (or what the tap asked of etcd) failed: end it

        pumping = asyncio.ensure_future(pump())
        try:
            while True:
                reply = await stream.read()
                if type(reply) is not bytes:  # grpc.aio.EOF: the backend ended the stream
                    break
                if seen is not None:
                    seen.response(reply)
                await call.write(reply)
        except aio.AioRpcError as e:
            await _abort_with(call, e)
        finally:
            pumping.cancel()
            stream.cancel()
            if seen is not None:
                seen.end()

    return handler


def _handler(upstream: Upstream, path: str, client_streams: bool, server_streams: bool) -> Handler:
    make: Callable[[Upstream, str], Handler]
    if client_streams:
        make = _bidi_stream  # etcd has no client-streaming-only method
    elif server_streams:
        make = _server_stream
    else:
        make = _unary
    return make(upstream, path)


def _watch(upstream: Upstream, queues: QueueFronts | None) -> Handler:
    """Watch: client watches of one shape share a backend watch (watch_coalesce.py);
    the queues see the rest, on the client's own backend stream."""
    if queues is None:
        return WatchHub(upstream).handler
    return WatchHub(upstream, queues.watch_tap, queues.shares_watch).handler


def forward_methods(upstream: Upstream, queues: QueueFronts | None = None) -> list[Method]:
    """Every method of `SERVICES`, forwarded to `upstream`; with `queues`, Watch
    lets the queues see consumer watches."""
    methods = []
    routes = _routes(queues)
    for service in SERVICES:
        for m in service.methods:
            path = f"/{service.full_name}/{m.name}"
            if path in routes:
                handler = _unary(upstream, path, routes[path])
            else:
                handler = _handler(upstream, path, m.client_streaming, m.server_streaming)
            if path == WATCH_PATH:
                handler = _watch(upstream, queues)
            methods.append(
                Method(
                    service=service.full_name,
                    name=m.name,
                    request_streaming=m.client_streaming,
                    response_streaming=m.server_streaming,
                    parse=bytes,
                    handler=handler,
                    serialize=_identity,
                    request_class=GetMessageClass(m.input_type),
                    response_class=GetMessageClass(m.output_type),
                    waits=path in WAITING,
                )
            )
    return methods
