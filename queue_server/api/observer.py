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
call costs two counter increments (integer tallies, added to the counters when
they are read), one clock read pair and a context variable set beyond the call.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric

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


class Tally:
    """Increments of one counter child as a plain integer, added to the child
    when its counter is read (`TalliedCounter.collect`): prometheus_client's
    `inc` is four calls and a lock, and every call counts twice."""

    __slots__ = ("_added", "child", "count")

    def __init__(self, child: Counter) -> None:
        self.child = child
        self.count = 0
        """Only ever incremented (on the loop); `settle` adds what is new."""
        self._added = 0

    def settle(self) -> None:
        count = self.count
        if count != self._added:
            self.child.inc(count - self._added)
            self._added = count


class TalliedCounter(Counter):
    """A Counter that settles its children's tallies before it is read."""

    def tally(self, *labelvalues: str) -> Tally:
        """The tally of the child with these labels (created, at 0, as `labels` does)."""
        tally = Tally(self.labels(*labelvalues))
        with _SETTLING:
            self.__dict__.setdefault("_tallies", []).append(tally)
        return tally

    def collect(self) -> Iterable[Metric]:
        with _SETTLING:
            for tally in self.__dict__.get("_tallies", ()):
                tally.settle()
        return super().collect()


_SETTLING = threading.Lock()
"""Held while tallies are settled: a scrape may run on any thread."""


class RpcObserver:
    """Request ids, RPC counters and slow-request warnings for one server."""

    def __init__(
        self,
        registry: CollectorRegistry,
        warn_after: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = TalliedCounter(
            "grpc_server_started_total",
            "Total number of RPCs started on the server.",
            labels,
            registry=registry,
        )
        self.handled = TalliedCounter(
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

    def _next_id(self) -> int:
        return next(self._ids)

    def _done(self, labels: Labels, error: BaseException | None) -> None:
        outcome = _outcome(error)
        child = self._handled.get((labels, outcome))
        if child is None:
            child = self._handled[labels, outcome] = self.handled.labels(*labels, outcome)
        child.inc()

    def _call(self, behavior: Any, labels: Labels, timed: bool) -> Handler:
        started = self.started.tally(*labels)
        ok = self.handled.tally(*labels, "OK")
        clock = self.clock
        method = f"/{labels[1]}/{labels[2]}"
        next_id = self._ids.__next__

        async def call(request: Any, context: Any) -> Any:
            started.count += 1
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
            ok.count += 1
            return result

        return call

    def _stream(self, behavior: Any, labels: Labels) -> Handler:
        started = self.started.tally(*labels)

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            started.count += 1
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
