"""Placeholder suites, `cqs` and `cluster`: registered so every run's JSON has their
rows, reporting "not available yet" for both servers until they are written.

To fill one in, give its `Workload` a `run` function (see kv.py for the shape); the
runner then starts servers for the suite and measures it like any other.
"""

from __future__ import annotations

from benchmarks.workloads.base import Workload

NOT_YET = "not available yet"

CQS = [
    Workload(
        suite="cqs",
        name="cqs send/receive/delete",
        about="Placeholder for the CQS workloads (not available yet).",
        placeholder_note=NOT_YET,
    ),
]

CLUSTER = [
    Workload(
        suite="cluster",
        name="3-member cluster put, 64 in flight",
        about="Placeholder for the cluster workloads (not available yet).",
        placeholder_note=NOT_YET,
    ),
]
