"""The middleware that watches every call of the client port.

What it owns, per call: a request id (set in `queue_server.logs.request_id` while
the call is served, so every record logged meanwhile carries it); the counters
`grpc_server_started_total` and `grpc_server_handled_total` (grpc-prometheus'
names and labels, as etcd exports them: type, service, method, and grpc-go's
spelling of the code); and etcd's slow-request warning, "apply request took too
long", for a unary call that took longer than
`--experimental-warning-apply-duration` (streams and long polls live as long
as their client wants and are not timed).

Each method's wrapper is built once, when the method table is wrapped, so a
call costs two counter increments, one clock read pair and a context variable
set beyond the call.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from queue_server.logs import request_id
from queue_server.transport.methods import Handler, Method
from queue_server.transport.status import RpcError, Status

log = logging.getLogger(__name__)

Labels = tuple[str, str, str]


def code_name(code: Status) -> str:
    """grpc-go's spelling of a code, as grpc-prometheus labels it (OK, NotFound...)."""
    name = "".join(w.capitalize() for w in code.name.split("_"))
    return {"Ok": "OK", "Cancelled": "Canceled"}.get(name, name)


def _outcome(error: BaseException | None) -> str:
    if error is None:
        return "OK"
    if isinstance(error, RpcError):
        return code_name(error.code)
    if isinstance(error, asyncio.CancelledError):
        return "Canceled"
    return "Unknown"


class RpcObserver:
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
        self._handled: dict[tuple[Labels, str], Any] = {}

    def middleware(self, method: Method) -> Handler:
        """`method`'s handler, observed."""
        labels = (method.kind, method.service, method.name)
        if inspect.isasyncgenfunction(method.handler):
            return self._stream(method.handler, labels)
        return self._call(method.handler, labels, timed=method.kind == "unary" and not method.waits)

    def _next_id(self) -> str:
        return f"{next(self._ids):x}"

    def _done(self, labels: Labels, error: BaseException | None) -> None:
        outcome = _outcome(error)
        child = self._handled.get((labels, outcome))
        if child is None:
            child = self._handled[labels, outcome] = self.handled.labels(*labels, outcome)
        child.inc()

    def _call(self, behavior: Any, labels: Labels, timed: bool) -> Handler:
        started = self.started.labels(*labels)
        ok = self.handled.labels(*labels, "OK")
        clock = self.clock
        method = f"/{labels[1]}/{labels[2]}"
        next_id = self._next_id

        async def call(request: Any, context: Any) -> Any:
            started.inc()
            token = request_id.set(next_id())
            begin = clock()
            try:
                result = await behavior(request, context)
            except BaseException as e:
                self._done(labels, e)
                raise
            finally:
                if timed:
                    took = clock() - begin
                    if took > self.warn_after:
                        self._slow(method, took, request)
                request_id.reset(token)
            ok.inc()
            return result

        return call

    def _stream(self, behavior: Any, labels: Labels) -> Handler:
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
                self._done(labels, error)

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
