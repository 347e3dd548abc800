"""Prometheus metrics of one member, served at `/metrics` on --listen-metrics-urls.

What belongs here: the registry of this server (not prometheus-client's global
one, so two servers in one process do not mix; the gRPC counters are registered
in it by `queue_server/api/observer.py`), and a collector that reads the state
when scraped: etcd's names where they apply (`etcd_server_has_leader`,
`etcd_mvcc_db_total_size_in_bytes`, `etcd_debugging_mvcc_keys_total`, ...) and
ours for the queues (`queue_server_queue_*` per etcd-key queue, `queue_server_cqs_*`
per CQS queue), read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from queue_server.apply import StateMachine
from queue_server.queue_stats import cqs_queue_stats, etcd_queue_stats


@dataclass
class Membership:
    """What the collector needs to know about the cluster, read at scrape time."""

    leader_id: Callable[[], int]
    member_id: int
    leader_changes: Callable[[], int]


class StateCollector(Collector):
    """Reads the state machine when scraped."""

    def __init__(
        self,
        state: StateMachine,
        membership: Membership,
        wall: Callable[[], float],
    ) -> None:
        self.state = state
        self.membership = membership
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
                ("produced", "Messages that entered the queue (dead letters, redrives included)."),
                ("delivered", "Messages handed to consumers (redeliveries included)."),
                ("acked", "Messages acknowledged by the consumer holding them."),
                ("redelivered", "Messages taken back unacknowledged (failed deliveries)."),
                ("dead_lettered", "Messages moved to their dead-letter queue."),
            )
        }
        for row in etcd_queue_stats(self.state, self.wall()):
            name = [row["name"]]
            depth.add_metric(name, row["depth"])
            pending.add_metric(name, row["pending"])
            in_flight.add_metric(name, row["in_flight"])
            consumers.add_metric(name, len(row["consumers"]))
            age.add_metric(name, row["oldest_pending_age_s"])
            for counter_name, family in counters.items():
                family.add_metric(name, row[counter_name])
        yield from (depth, pending, in_flight, consumers, age, *counters.values())

    def _cqs(self) -> Iterator[Metric]:
        cqs = self.state.cqs
        return cqs_families(cqs_queue_stats(self.state, self.wall()), cqs.published, cqs.dropped)


def cqs_families(
    rows: Iterable[dict[str, Any]], published: float, dropped: float
) -> Iterator[Metric]:
    """The `queue_server_cqs_*` families of CQS queues' rows (queue_stats.cqs_queue_stats'
    shape) and the publication counts: the embedded server's, and a front's from etcd."""
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
    for row in rows:
        name = [row["name"]]
        pending.add_metric(name, row["pending"])
        in_flight.add_metric(name, row["in_flight"])
        lag.add_metric(name, row["sla_lag_s"] or 0.0)
    published_family = CounterMetricFamily(
        "queue_server_cqs_published", "Publications applied to CQS queues."
    )
    published_family.add_metric([], published)
    dropped_family = CounterMetricFamily(
        "queue_server_cqs_dropped", "Publications no CQS queue subscribed to."
    )
    dropped_family.add_metric([], dropped)
    yield from (pending, in_flight, lag, published_family, dropped_family)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=float(value))


class ServerMetrics:
    """The registry of one server and what feeds it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)

    def watch_state(self, collector: StateCollector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)
