"""What a workload is, the budget it runs under, and the context it runs in.

A `Workload` is a named function that runs against one server (`RunContext`) and
returns an `Outcome`. It usually prepares data through a plain (sync) gRPC channel
from the orchestrator, then hands a client program to the client processes through
`RunContext.run_clients`. A workload with no function is a placeholder: its row
reports `unavailable` for both servers without starting anything.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from benchmarks.loadgen import ClientPool, ClientRun
from benchmarks.results import Outcome
from benchmarks.servers import ResourceMonitor, Target

T = TypeVar("T")

Program = Callable[[ClientRun], Awaitable[None]]


@dataclass(frozen=True)
class Budget:
    """How long and how much each workload may run."""

    quick: bool
    seconds: float
    """The timed window of one workload on one server (the time bound)."""
    warmup_seconds: float
    drain_seconds: float
    """After the window: how long receivers wait for events still in flight."""
    setup_timeout: float

    def pick(self, full: T, quick: T) -> T:
        return quick if self.quick else full

    @staticmethod
    def full() -> Budget:
        return Budget(
            quick=False, seconds=15.0, warmup_seconds=1.0, drain_seconds=3.0, setup_timeout=60.0
        )

    @staticmethod
    def quick_mode() -> Budget:
        return Budget(
            quick=True, seconds=1.5, warmup_seconds=0.2, drain_seconds=1.5, setup_timeout=30.0
        )


@dataclass
class RunContext:
    """One server (or cluster), the client pool, the budget, and state shared by the
    workloads of a suite on this server (e.g. lease ids granted by one workload, kept
    by the next)."""

    server: Target
    pool: ClientPool
    budget: Budget
    max_client_procs: int
    state: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    """Extra detail about the last outcome, for the progress line (not in the JSON)."""

    @property
    def kind(self) -> str:
        return self.server.kind

    def procs(self, concurrency: int) -> int:
        """Client processes for a closed loop of `concurrency` requests in flight:
        one for a single request in flight, all of them otherwise."""
        return 1 if concurrency <= 1 else self.max_client_procs

    @contextmanager
    def channel(self, endpoint: str | None = None) -> Iterator[grpc.Channel]:
        """A plain channel from the orchestrator, for preparing data (to `endpoint`,
        by default the server's)."""
        with grpc.insecure_channel(endpoint or self.server.endpoint) as ch:
            grpc.channel_ready_future(ch).result(timeout=self.budget.setup_timeout)
            yield ch

    def run_clients(
        self,
        program: Program,
        *,
        procs: int,
        concurrency: int,
        max_ops: int,
        params: dict[str, Any] | None = None,
        per_proc: list[dict[str, Any]] | None = None,
        channels: int = 1,
        warmup: bool = True,
        endpoints: list[str] | None = None,
    ) -> tuple[Outcome, list[Any]]:
        """Run `program` in client processes against this server; returns the
        outcome and what the programs handed back (their payloads, concatenated).
        `endpoints` (a cluster's members) spreads each process's channels over them,
        `channels` to each; the server's CPU and RSS are those of all its `pids`."""
        result = self.pool.run(
            program,
            endpoint=self.server.endpoint,
            endpoints=endpoints or (),
            monitor=ResourceMonitor(self.server.pids),
            procs=procs,
            concurrency=concurrency,
            max_ops=max_ops,
            seconds=self.budget.seconds,
            warmup_seconds=self.budget.warmup_seconds if warmup else 0.0,
            params=params,
            per_proc=per_proc,
            channels=channels,
            setup_timeout=self.budget.setup_timeout,
            drain_seconds=self.budget.drain_seconds,
        )
        self.detail = result.detail
        return result.outcome, result.payload


@dataclass(frozen=True)
class Workload:
    """One row of the results: a named load run against each server."""

    suite: str
    name: str
    about: str
    """What it measures, in a sentence (shown by --list)."""
    run: Callable[[RunContext], Outcome] | None = None
    """None for a placeholder."""
    placeholder_note: str = "not available yet"

    @property
    def placeholder(self) -> bool:
        return self.run is None


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that selects every key starting with `prefix` (etcd's rule)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"
