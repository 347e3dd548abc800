"""The gRPC interceptor that watches every call of the client port.

What it owns, per call: a request id (set in `queue_server.logs.request_id` while
the call is served, so every record logged meanwhile carries it); the counters
`grpc_server_started_total` and `grpc_server_handled_total` (grpc-prometheus'
names and labels, as etcd exports them: type, service, method, and grpc-go's
spelling of the code); and etcd's slow-request warning, "apply request took too
long", for a unary call that took longer than
`--experimental-warning-apply-duration` (streams live as long as their client
wants and are not timed).

Each method's wrapper is built once and cached, so a call costs two counter
increments, one clock read pair and a context variable set beyond the call.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter

from queue_server.logs import request_id

log = logging.getLogger(__name__)

Labels = tuple[str, str, str]


def rpc_type(handler: grpc.RpcMethodHandler[Any, Any]) -> str:
    """grpc-prometheus' grpc_type label of a method."""
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


def code_name(code: grpc.StatusCode) -> str:
    """grpc-go's spelling of a code, as grpc-prometheus labels it (OK, NotFound...)."""
    name = "".join(w.capitalize() for w in code.name.split("_"))
    return {"Ok": "OK", "Cancelled": "Canceled"}.get(name, name)


class RpcObserver(aio.ServerInterceptor):  # type: ignore[type-arg]
    """Request ids, RPC counters and slow-request warnings for one server."""

    def __init__(
        self,
        registry: CollectorRegistry,
        warn_after: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter(
            "grpc_server_started_total",
            "Total number of RPCs started on the server.",
            labels,
            registry=registry,
        )
        self.handled = Counter(
            "grpc_server_handled_total",
            "Total number of RPCs completed on the server, regardless of success or failure.",
            [*labels, "grpc_code"],
            registry=registry,
        )
        self.warn_after = warn_after
        self.clock = clock
        self._ids = itertools.count(1)
        # method -> (the handler it had, its wrapper): one wrapper per method
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, details.method)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler: Any, full_method: str) -> Any:
        service, _, method = full_method.lstrip("/").rpartition("/")
        kind = rpc_type(handler)
        labels = (kind, service, method)
        serializers = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if kind == "unary":
            return grpc.unary_unary_rpc_method_handler(
                self._call(handler.unary_unary, labels, timed=True), **serializers
            )
        if kind == "client_stream":
            return grpc.stream_unary_rpc_method_handler(
                self._call(handler.stream_unary, labels, timed=False), **serializers
            )
        behavior = handler.unary_stream if kind == "server_stream" else handler.stream_stream
        wrapper = (
            self._stream(behavior, labels)
            if inspect.isasyncgenfunction(behavior)
            else self._call(behavior, labels, timed=False)
        )
        if kind == "server_stream":
            return grpc.unary_stream_rpc_method_handler(wrapper, **serializers)
        return grpc.stream_stream_rpc_method_handler(wrapper, **serializers)

    def _next_id(self) -> str:
        return f"{next(self._ids):x}"

    def _done(self, labels: Labels, context: Any, error: BaseException | None) -> None:
        code = context.code()
        if isinstance(error, asyncio.CancelledError):
            name = "Canceled"
        elif code is not None:
            name = code_name(code)
        elif error is not None and not isinstance(error, aio.AbortError):
            name = "Unknown"
        else:
            name = "OK"
        self.handled.labels(*labels, name).inc()

    def _call(self, behavior: Any, labels: Labels, timed: bool) -> Any:
        started = self.started.labels(*labels)
        clock = self.clock
        method = f"/{labels[1]}/{labels[2]}"

        async def call(request: Any, context: Any) -> Any:
            started.inc()
            token = request_id.set(self._next_id())
            error: BaseException | None = None
            begin = clock()
            try:
                return await behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                if timed:
                    took = clock() - begin
                    if took > self.warn_after:
                        self._slow(method, took, request)
                self._done(labels, context, error)
                request_id.reset(token)

        return call

    def _stream(self, behavior: Any, labels: Labels) -> Any:
        started = self.started.labels(*labels)

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            started.inc()
            request_id.set(self._next_id())  # the stream's task is its own context
            error: BaseException | None = None
            try:
                async for item in behavior(request, context):
                    yield item
            except BaseException as e:
                error = e
                raise
            finally:
                self._done(labels, context, error)

        return stream

    def _slow(self, method: str, took: float, request: Any) -> None:
        size = request.ByteSize() if hasattr(request, "ByteSize") else 0
        log.warning(
            "apply request took too long",
            extra={
                "took": f"{took * 1000:.3f}ms",
                "expected-duration": f"{self.warn_after * 1000:.0f}ms",
                "method": method,
                "request_bytes": size,
            },
        )
