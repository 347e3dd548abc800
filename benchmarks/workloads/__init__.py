"""The registry of suites: suite name -> its workloads, in the order they run.

Each family lives in its own module (kv, watch, lease, queue, cqs, cluster); this
module only assembles them. `--suite NAME,...` picks from `SUITES`.
"""

from __future__ import annotations

from benchmarks.workloads.base import Budget, RunContext, Workload
from benchmarks.workloads.cluster import CLUSTER, MEMBERS
from benchmarks.workloads.cqs import CQS
from benchmarks.workloads.kv import PUT, RANGE, TXN
from benchmarks.workloads.lease import LEASE
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

CLUSTER_SIZE: dict[str, int] = {"cluster": MEMBERS}
"""Suites that run against a cluster of this many members of each kind (the others
get one server of each kind)."""

__all__ = ["CLUSTER_SIZE", "SUITES", "Budget", "RunContext", "Workload"]
