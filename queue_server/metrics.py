"""Prometheus metrics of one member, served at `/metrics` on --listen-metrics-urls.

What belongs here: the registry of this server (not prometheus-client's global
one, so two servers in one process do not mix), the gRPC interceptor that counts
started and handled RPCs under grpc-prometheus' names (`grpc_server_started_total`,
`grpc_server_handled_total`, as etcd exports them), and a collector that reads the
state when scraped: etcd's names where they apply (`etcd_server_has_leader`,
`etcd_mvcc_db_total_size_in_bytes`, `etcd_debugging_mvcc_keys_total`, ...) and
ours for the queues (`queue_server_queue_*` per etcd-key queue, `queue_server_cqs_*`
per CQS queue). Nothing is computed on the request path but two counter
increments; everything else is read at scrape time.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from queue_server.apply import StateMachine
from queue_server.mq.dispatcher import Dispatcher

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _rpc_type(handler: grpc.RpcMethodHandler[Any, Any]) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


class GrpcMetrics(aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts every RPC when it starts and, with its status code, when it ends."""

    def __init__(self, registry: CollectorRegistry) -> None:
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
        # method -> (the handler it had, its counting wrapper): one wrapper per method
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
        labels = (_rpc_type(handler), service, method)
        kind = labels[0]
        if kind == "unary":
            return grpc.unary_unary_rpc_method_handler(
                self._call(handler.unary_unary, labels),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if kind == "client_stream":
            return grpc.stream_unary_rpc_method_handler(
                self._call(handler.stream_unary, labels),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        behavior = handler.unary_stream if kind == "server_stream" else handler.stream_stream
        behavior_wrapper = (
            self._stream(behavior, labels)
            if inspect.isasyncgenfunction(behavior)
            else self._call(behavior, labels)
        )
        make = (
            grpc.unary_stream_rpc_method_handler
            if kind == "server_stream"
            else grpc.stream_stream_rpc_method_handler
        )
        return make(
            behavior_wrapper,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _done(
        self, labels: tuple[str, str, str], context: Any, error: BaseException | None
    ) -> None:
        code = context.code()
        if isinstance(error, asyncio.CancelledError):
            name = "Canceled"
        elif code is not None:
            name = _code_name(code)
        elif error is not None and not isinstance(error, aio.AbortError):
            name = "Unknown"
        else:
            name = "OK"
        self.handled.labels(*labels, name).inc()

    def _call(self, behavior: Any, labels: tuple[str, str, str]) -> Any:
        started = self.started.labels(*labels)

        async def call(request: Any, context: Any) -> Any:
            started.inc()
            error: BaseException | None = None
            try:
                return await behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                self._done(labels, context, error)

        return call

    def _stream(self, behavior: Any, labels: tuple[str, str, str]) -> Any:
        started = self.started.labels(*labels)

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            started.inc()
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


def _code_name(code: grpc.StatusCode) -> str:
    """grpc-go's spelling of a code, as grpc-prometheus labels it (OK, NotFound...)."""
    words = code.name.split("_")
    name = "".join(w.capitalize() for w in words)
    return "Canceled" if name == "Cancelled" else name


@dataclass
class Membership:
    """What the collector needs to know about the cluster, read at scrape time."""

    leader_id: Callable[[], int]
    member_id: int
    leader_changes: Callable[[], int]


class StateCollector(Collector):
    """Reads the state machine and the node's dispatcher when scraped."""

    def __init__(
        self,
        state: StateMachine,
        dispatcher: Callable[[], Dispatcher | None],
        membership: Membership,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.membership = membership
        self.clock = clock
        self.wall = wall

    def collect(self) -> Iterator[Metric]:
        state, m = self.state, self.membership
        leader = m.leader_id()
        yield _gauge(
            "etcd_server_has_leader", "Whether a leader exists (1) or not (0).", leader != 0
        )
        yield _gauge(
            "etcd_server_is_leader", "Whether this member is the leader.", leader == m.member_id
        )
        changes = CounterMetricFamily(
            "etcd_server_leader_changes_seen", "The number of leader changes seen."
        )
        changes.add_metric([], m.leader_changes())
        yield changes
        store = state.store
        yield _gauge(
            "etcd_mvcc_db_total_size_in_bytes",
            "Total size of the keyspace's records in bytes (history included).",
            store.size_bytes,
        )
        yield _gauge("etcd_debugging_mvcc_keys_total", "Total number of keys.", store.key_count)
        yield _gauge(
            "etcd_debugging_mvcc_current_revision",
            "The current revision of the store.",
            store.revision,
        )
        yield _gauge(
            "etcd_server_proposals_applied_total",
            "The total number of consensus proposals applied.",
            state.applied_index,
        )
        yield from self._queues()
        yield from self._cqs()

    def _queues(self) -> Iterator[Metric]:
        labels = ["queue"]
        depth = GaugeMetricFamily(
            "queue_server_queue_depth", "Messages pending or in flight.", labels=labels
        )
        pending = GaugeMetricFamily(
            "queue_server_queue_pending", "Messages waiting for a consumer.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "queue_server_queue_in_flight",
            "Messages delivered and not acknowledged.",
            labels=labels,
        )
        consumers = GaugeMetricFamily(
            "queue_server_queue_consumers", "Consumers registered, on any member.", labels=labels
        )
        age = GaugeMetricFamily(
            "queue_server_queue_oldest_pending_age_seconds",
            "Seconds since the oldest pending message was produced (0 when none).",
            labels=labels,
        )
        counters = {
            name: CounterMetricFamily(f"queue_server_queue_{name}", text, labels=labels)
            for name, text in (
                ("delivered", "Messages handed to consumers (redeliveries included)."),
                ("acked", "Messages acknowledged by the consumer holding them."),
                ("redelivered", "Messages taken back unacknowledged (failed deliveries)."),
                ("dead_lettered", "Messages moved to their dead-letter queue."),
            )
        }
        dispatcher = self.dispatcher()
        now = self.clock()
        cqs = self.state.cqs
        for q in self.state.queues.queues.values():
            if cqs.is_cqs(q.name):
                continue
            name = [q.name.decode(errors="replace")]
            depth.add_metric(name, q.depth)
            pending.add_metric(name, len(q.pending))
            in_flight.add_metric(name, len(q.holder))
            consumers.add_metric(name, len(q.consumers))
            age.add_metric(name, dispatcher.oldest_pending_age(q, now) if dispatcher else 0.0)
            for counter_name, family in counters.items():
                family.add_metric(name, getattr(q, counter_name))
        yield from (depth, pending, in_flight, consumers, age, *counters.values())

    def _cqs(self) -> Iterator[Metric]:
        labels = ["queue"]
        pending = GaugeMetricFamily(
            "queue_server_cqs_pending", "Notifications waiting for a dequeue.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "queue_server_cqs_in_flight",
            "Notifications dequeued and not acknowledged.",
            labels=labels,
        )
        lag = GaugeMetricFamily(
            "queue_server_cqs_sla_lag_seconds",
            "Now minus the SLA of the most urgent pending notification (negative: ahead "
            "of it; 0 when none is pending).",
            labels=labels,
        )
        now = self.wall()
        for q in self.state.cqs.queues.values():
            name = [q.name]
            pending.add_metric(name, len(q.tree))
            in_flight.add_metric(name, q.tree.in_flight)
            sla = q.tree.most_urgent_sla_us()
            lag.add_metric(name, 0.0 if sla is None else now - sla / 1e6)
        published = CounterMetricFamily(
            "queue_server_cqs_published", "Publications applied to CQS queues."
        )
        published.add_metric([], self.state.cqs.published)
        dropped = CounterMetricFamily(
            "queue_server_cqs_dropped", "Publications no CQS queue subscribed to."
        )
        dropped.add_metric([], self.state.cqs.dropped)
        yield from (pending, in_flight, lag, published, dropped)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=float(value))


class ServerMetrics:
    """The registry of one server and what feeds it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.grpc = GrpcMetrics(self.registry)

    def watch_state(self, collector: StateCollector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)
