"""Result types of a benchmark run and their JSON shape.

A workload run against one server ends in one `Outcome`: a `Measurement` (it ran),
or an `Unavailable` (it could not run there: not implemented, etcd not installed,
placeholder) or a `Failed` (it should have run and did not). A `Row` pairs the
outcomes on our server and on etcd for one workload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def ops_text(x: float) -> str:
    """A row's figure for the table: whole numbers, with two decimals below 10 (the
    failover row's 1/seconds)."""
    return f"{x:,.0f}" if x >= 10 else f"{x:.2f}"


@dataclass
class Measurement:
    """What one workload measured against one server."""

    ops: int
    """Operations (or events, messages) completed in the timed window."""
    seconds: float
    """Length of the timed window, from the start barrier to the last completion."""
    errors: int
    p50_ms: float | None
    p99_ms: float | None
    p999_ms: float | None
    cpu_s: float
    """Server CPU seconds (user + system) spent in the timed window."""
    rss_mb: float
    """Peak server resident set size sampled during the timed window."""
    client_cpu_s: float
    """CPU seconds of all client processes in the timed window."""
    client_procs: int
    concurrency: int
    extra: dict[str, float] = field(default_factory=dict)
    """Workload-specific counters (e.g. CAS conflicts)."""
    note: str = ""
    """What the workload has to say about this measurement (in the row's note)."""

    @property
    def ops_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "ops_s": _round(self.ops_s, 1),
            "p50_ms": _round(self.p50_ms),
            "p99_ms": _round(self.p99_ms),
            "p999_ms": _round(self.p999_ms),
            "cpu_s": _round(self.cpu_s, 2),
            "rss_mb": _round(self.rss_mb, 1),
            "client_cpu_s": _round(self.client_cpu_s, 2),
            "ops": self.ops,
            "seconds": _round(self.seconds),
            "errors": self.errors,
            "client_procs": self.client_procs,
            "concurrency": self.concurrency,
            "extra": {k: _round(v) for k, v in sorted(self.extra.items())},
        }


@dataclass
class Unavailable:
    """The workload cannot run on this server (yet); not a harness failure."""

    note: str


@dataclass
class Failed:
    """The workload should have run and did not (server error, harness bug)."""

    note: str


Outcome = Measurement | Unavailable | Failed

NOT_IMPLEMENTED = "not implemented"

BEHIND_COUNTERS = ("timed_out_streams", "timed_out_tasks")
"""`extra` counters of receivers (watch streams, queue tasks) that had not seen
everything when the drain time ran out: the row gets a note."""


@dataclass
class Row:
    """One workload on both servers."""

    suite: str
    workload: str
    ours: Outcome
    etcd: Outcome
    notes: list[str] = field(default_factory=list)

    @property
    def ratio_ops(self) -> float | None:
        ours, etcd = self.ours, self.etcd
        if isinstance(ours, Measurement) and isinstance(etcd, Measurement) and etcd.ops_s > 0:
            return ours.ops_s / etcd.ops_s
        return None

    def note(self) -> str | None:
        parts = list(self.notes)
        for name, outcome in (("ours", self.ours), ("etcd", self.etcd)):
            if isinstance(outcome, Unavailable | Failed):
                prefix = "failed: " if isinstance(outcome, Failed) else ""
                parts.append(f"{name}: {prefix}{outcome.note}")
            else:
                if outcome.note:
                    parts.append(f"{name}: {outcome.note}")
                if outcome.errors:
                    parts.append(f"{name}: {outcome.errors} errors")
                behind = int(sum(outcome.extra.get(k, 0.0) for k in BEHIND_COUNTERS))
                if behind:
                    parts.append(f"{name}: {behind} receivers still behind at the drain deadline")
        return "; ".join(parts) if parts else None

    def failures(self) -> int:
        return sum(isinstance(o, Failed) for o in (self.ours, self.etcd))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "suite": self.suite,
            "workload": self.workload,
            "ours": self.ours.to_json() if isinstance(self.ours, Measurement) else None,
            "etcd": self.etcd.to_json() if isinstance(self.etcd, Measurement) else None,
            "ratio_ops": _round(self.ratio_ops),
        }
        note = self.note()
        if note:
            out["note"] = note
        return out
