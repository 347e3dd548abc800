"""The registry of suites: suite name -> its workloads, in the order they run.

Each family lives in its own module (kv, watch, lease, queue, cqs, placeholders); this
module only assembles them. `--suite NAME,...` picks from `SUITES`.
"""

from __future__ import annotations

from benchmarks.workloads.base import Budget, RunContext, Workload
from benchmarks.workloads.cqs import CQS
from benchmarks.workloads.kv import PUT, RANGE, TXN
from benchmarks.workloads.lease import LEASE
from benchmarks.workloads.placeholders import CLUSTER
from benchmarks.workloads.queue import QUEUE
from benchmarks.workloads.watch import WATCH

SUITES: dict[str, list[Workload]] = {
    "put": PUT,
    "range": RANGE,
    "txn": TXN,
    "watch": WATCH,
    "lease": LEASE,
    "queue": QUEUE,
    "cqs": CQS,
    "cluster": CLUSTER,
}

__all__ = ["SUITES", "Budget", "RunContext", "Workload"]
