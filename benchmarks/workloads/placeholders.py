"""The placeholder suite, `cluster`: registered so every run's JSON has its row,
reporting "not available yet" for both servers until it is written.

To fill one in, give its `Workload` a `run` function (see kv.py for the shape); the
runner then starts servers for the suite and measures it like any other.
"""

from __future__ import annotations

from benchmarks.workloads.base import Workload

NOT_YET = "not available yet"

CLUSTER = [
    Workload(
        suite="cluster",
        name="3-member cluster put, 64 in flight",
        about="Placeholder for the cluster workloads (not available yet).",
        placeholder_note=NOT_YET,
    ),
]
