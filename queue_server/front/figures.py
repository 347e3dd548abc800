"""Each queue's figures, cluster-wide, on every front: written to etcd by the
queue's dispatcher, read back by any front for its `/metrics` and dashboard.

What belongs here:

- `FIGURES_PREFIX` and the record's shape: one key per queue,
  `/queue-server/queues/{registry}` (the registry key `/q/{name}` appended), whose
  value is a JSON object: the dispatching front, the queue's depth, pending and
  in-flight counts, its consumers with what each holds, and the embedded
  server's counters (produced, delivered, acked, redelivered, dead-lettered). It
  sits outside `/q/`, so that one range reads every queue's figures and nothing
  else. The dispatcher puts it in one of its own Txns at most once a
  `WRITE_SECONDS` (no extra revision), and a dispatcher that takes a queue over
  goes on counting from it.
- `FrontFigures`, a front's reader: `/metrics` and the dashboard are rendered
  from the figures last read, and a render starts a new read when those are over
  `READ_SECONDS` old, so a front nobody scrapes reads nothing.

The embedded server's metrics have the same names; what a front cannot know
cheaply it leaves out: the age of the oldest pending message (etcd keeps no
produce time) and the dashboard's per-queue history.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from etcdserverpb import rpc_pb2
from queue_server.front.session import FrontSession, prefix_end
from queue_server.metrics import cqs_families
from queue_server.queue_stats import COUNTERS

log = logging.getLogger(__name__)

FIGURES_PREFIX = b"/queue-server/queues"
"""`FIGURES_PREFIX + registry key` is a queue's figures record."""
WRITE_SECONDS = 1.0
"""The dispatcher writes a queue's record at most this often."""
READ_SECONDS = 2.0
"""A render older figures than this starts a new read."""


def figures_key(registry: bytes) -> bytes:
    return FIGURES_PREFIX + registry


def read_counts(value: bytes, names: tuple[str, ...]) -> dict[str, int]:
    """The integer fields `names` of a record (absent or broken: none)."""
    try:
        record = json.loads(value)
    except ValueError:
        return {}
    if not isinstance(record, dict):
        return {}
    return {name: int(record[name]) for name in names if isinstance(record.get(name), int)}


def read_counters(value: bytes) -> dict[str, int]:
    """The etcd-key queue's counters of a record."""
    return read_counts(value, COUNTERS)


class FrontFigures:
    """The queues' figures as this front last read them from etcd."""

    def __init__(self, session: FrontSession, clock: Callable[[], float] = time.monotonic) -> None:
        self.session = session
        self.clock = clock
        self.rows: list[dict[str, Any]] = []
        """The etcd-key queues' records."""
        self.cqs_rows: list[dict[str, Any]] = []
        self.fanout_rows: list[dict[str, Any]] = []
        self.revision = 0
        self._read_at = float("-inf")
        self._reading: asyncio.Task[None] | None = None

    def refresh(self) -> None:
        """Start a read if the figures are old and none is under way."""
        if self.clock() - self._read_at < READ_SECONDS:
            return
        if self._reading is not None and not self._reading.done():
            return
        self._reading = asyncio.ensure_future(self.read())

    async def read(self) -> None:
        """Read every queue's record (one range)."""
        self._read_at = self.clock()
        try:
            reply = await self.session.kv.Range(
                rpc_pb2.RangeRequest(
                    key=FIGURES_PREFIX + b"/", range_end=prefix_end(FIGURES_PREFIX + b"/")
                ),
                metadata=await self.session.metadata(),
                timeout=5.0,
            )
        except Exception as e:  # the figures are best effort: the next render tries again
            log.warning("queue figures not read: %s", e)
            return
        kinds: dict[str, list[dict[str, Any]]] = {"queue": [], "cqs": [], "fanout": []}
        for kv in reply.kvs:
            try:
                record = json.loads(kv.value)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("name"), str):
                kinds.get(str(record.pop("kind", "queue")), []).append(record)
        self.rows, self.cqs_rows, self.fanout_rows = (
            sorted(kinds[k], key=lambda r: str(r["name"])) for k in ("queue", "cqs", "fanout")
        )
        self.revision = int(reply.header.revision)

    def collect(self) -> Iterator[Metric]:
        """The metric families of the figures last read (a prometheus collector)."""
        self.refresh()
        labels = ["queue"]
        gauges = {
            "depth": GaugeMetricFamily(
                "queue_server_queue_depth", "Messages pending or in flight.", labels=labels
            ),
            "pending": GaugeMetricFamily(
                "queue_server_queue_pending", "Messages waiting for a consumer.", labels=labels
            ),
            "in_flight": GaugeMetricFamily(
                "queue_server_queue_in_flight",
                "Messages delivered and not acknowledged.",
                labels=labels,
            ),
        }
        consumers = GaugeMetricFamily(
            "queue_server_queue_consumers", "Consumers registered, on any front.", labels=labels
        )
        dispatcher = GaugeMetricFamily(
            "queue_server_queue_dispatcher",
            "1 for the front that dispatches the queue.",
            labels=["queue", "front"],
        )
        counters = {
            name: CounterMetricFamily(
                f"queue_server_queue_{name}", f"The queue's {name} messages.", labels=labels
            )
            for name in COUNTERS
        }
        for row in self.rows:
            name = [row["name"]]
            for field, family in gauges.items():
                family.add_metric(name, _number(row.get(field)))
            consumers.add_metric(name, len(row.get("consumers") or ()))
            dispatcher.add_metric([row["name"], str(row.get("dispatcher", ""))], 1)
            for field, counter in counters.items():
                counter.add_metric(name, _number(row.get(field)))
        for row in self.cqs_rows:
            dispatcher.add_metric([row["name"], str(row.get("dispatcher", ""))], 1)
        yield from (*gauges.values(), consumers, dispatcher, *counters.values())
        yield from self._cqs()

    def _cqs(self) -> Iterator[Metric]:
        """The embedded server's `queue_server_cqs_*` families, from the CQS records."""
        return cqs_families(
            _cqs_rows(self.cqs_rows),
            sum(_number(r.get("published")) for r in self.fanout_rows),
            sum(_number(r.get("dropped")) for r in self.fanout_rows),
        )

    def dashboard(self, with_history: bool = True) -> dict[str, Any]:
        """The dashboard's JSON, as the embedded server's has it, from the figures."""
        self.refresh()
        front = self.session.front_id.decode(errors="replace")
        return {
            "time": time.time(),
            "member": {"id": front, "name": "front"},
            "leader": {"id": "", "name": ""},
            "members": [],
            "revision": self.revision,
            "keys": 0,
            "alarms": [],
            "quota": {"used_bytes": 0, "quota_bytes": 0},
            "auth_enabled": False,
            "history_seconds": 0,
            "queues": [dict(row, oldest_pending_age_s=0.0) for row in self.rows],
            "cqs": _cqs_rows(self.cqs_rows),
        }


def _cqs_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dashboard's CQS rows (queue_stats.cqs_queue_stats' shape) from the records."""
    now = time.time()
    rows = []
    for r in records:
        sla = r.get("most_urgent_sla_us")
        rows.append(
            {
                "name": r["name"],
                "pending": int(_number(r.get("pending"))),
                "in_flight": int(_number(r.get("in_flight"))),
                "subscriptions": r.get("subscriptions") or [],
                "sla_lag_s": round(now - sla / 1e6, 3) if isinstance(sla, int) else None,
                "dispatcher": r.get("dispatcher", ""),
            }
        )
    return rows


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0
