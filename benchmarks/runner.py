"""Runs the chosen suites against our server and etcd, one workload at a time.

For each suite the runner starts a fresh pair of servers (ours and, when the etcd
binary is there, etcd) in a temporary directory, runs every workload of the suite
on ours and then on etcd (back to back, so both see the same machine conditions),
and stops both servers by pid before the next suite. A suite listed in
`CLUSTER_SIZE` (the cluster suite) gets a pair of clusters instead: that many
members of each kind on loopback, all stopped by pid at the end. Placeholder
suites start nothing. One progress line per workload start and end goes to stderr.
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc

from benchmarks.loadgen import ClientPool, Unimplemented
from benchmarks.results import (
    NOT_IMPLEMENTED,
    Failed,
    Measurement,
    Outcome,
    Row,
    Unavailable,
    ops_text,
)
from benchmarks.servers import EtcdServer, OursServer, Target, etcd_cluster, ours_cluster
from benchmarks.workloads import CLUSTER_SIZE, SUITES, Budget, RunContext, Workload

KINDS = ("ours", "etcd")


class Progress:
    """Progress lines on stderr, stamped with the time since the run started."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()

    def line(self, message: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {message}", file=self.stream, flush=True)


def describe(outcome: Outcome) -> str:
    if isinstance(outcome, Measurement):
        parts = [f"{ops_text(outcome.ops_s)} ops/s"]
        if outcome.p50_ms is not None and outcome.p99_ms is not None:
            parts.append(f"p50 {outcome.p50_ms:.2f} ms, p99 {outcome.p99_ms:.2f} ms")
        parts.append(f"server cpu {outcome.cpu_s:.1f}s, client cpu {outcome.client_cpu_s:.1f}s")
        if outcome.errors:
            parts.append(f"{outcome.errors} errors")
        return ", ".join(parts)
    if isinstance(outcome, Unavailable):
        return outcome.note
    return f"FAILED: {outcome.note}"


@dataclass
class RunOptions:
    suites: list[str]
    budget: Budget
    out_dir: Path
    client_procs: int
    etcd_binary: str | None


class Runner:
    def __init__(self, options: RunOptions, progress: Progress | None = None) -> None:
        self.options = options
        self.progress = progress or Progress()
        self.rows: list[Row] = []
        self._pool: ClientPool | None = None

    @property
    def pool(self) -> ClientPool:
        if self._pool is None:
            self._pool = ClientPool(self.options.client_procs)
        return self._pool

    def run(self) -> list[Row]:
        completed = False
        try:
            for suite in self.options.suites:
                self._run_suite(suite, SUITES[suite])
            completed = True
        finally:
            if self._pool is not None:
                self._pool.close(force=not completed)
        return self.rows

    def _placeholder_row(self, w: Workload) -> Row:
        note = w.placeholder_note
        self.progress.line(f"{w.suite} | {w.name} | {note}")
        return Row(w.suite, w.name, Unavailable(note), Unavailable(note))

    def _make(self, kind: str, tmp: Path, suite: str) -> Target | Outcome:
        logs = self.options.out_dir / "logs"
        size = CLUSTER_SIZE.get(suite, 1)
        binary = self.options.etcd_binary
        if kind == "ours":
            if size > 1:
                return ours_cluster(tmp / "ours", logs, f"{suite}-ours", size)
            return OursServer(tmp / "ours", logs / f"{suite}-ours.log")
        if binary:
            if size > 1:
                return etcd_cluster(tmp / "etcd", logs, f"{suite}-etcd", size, binary)
            return EtcdServer(tmp / "etcd", logs / f"{suite}-etcd.log", binary)
        return Unavailable("etcd not installed")

    def _not_started(self, suite: str, kind: str, server: Target, e: Exception) -> Outcome:
        tail = server.log_tail()
        self.progress.line(f"{suite} | {kind} server did not start: {e}\n{tail}")
        return Failed(f"server did not start: {e}")

    def _launch(self, suite: str, kind: str, server: Target) -> Target | Outcome:
        self.progress.line(f"{suite} | starting {kind} server")
        try:
            server.launch()
        except Exception as e:  # recorded as the suite's failure
            return self._not_started(suite, kind, server, e)
        return server

    def _await(self, suite: str, kind: str, server: Target) -> Target | Outcome:
        try:
            server.await_ready()
        except Exception as e:  # recorded as the suite's failure
            return self._not_started(suite, kind, server, e)
        self.progress.line(f"{suite} | {kind} server ready on {server.describe()}")
        return server

    def _start_all(self, tmp: Path, suite: str, servers: dict[str, Target | Outcome]) -> None:
        """Fill `servers` (kind -> server, or why there is none). One server at a
        time; clusters are all launched first, then awaited, so their start-ups
        (imports, the first election) overlap. A server is in `servers` from its
        launch on, so the caller's cleanup stops it whatever happens next."""
        overlap = CLUSTER_SIZE.get(suite, 1) > 1
        for kind in KINDS:
            made = self._make(kind, tmp, suite)
            servers[kind] = made
            if isinstance(made, Target):
                launched = self._launch(suite, kind, made)
                servers[kind] = launched
                if not overlap and isinstance(launched, Target):
                    servers[kind] = self._await(suite, kind, launched)
        if overlap:
            self.pool.prestart()
            for kind in KINDS:
                srv = servers[kind]
                if isinstance(srv, Target):
                    servers[kind] = self._await(suite, kind, srv)

    def _run_suite(self, suite: str, workloads: list[Workload]) -> None:
        if all(w.placeholder for w in workloads):
            self.rows.extend(self._placeholder_row(w) for w in workloads)
            return
        with tempfile.TemporaryDirectory(prefix=f"bench-{suite}-") as tmp_name:
            tmp = Path(tmp_name)
            servers: dict[str, Target | Outcome] = {}
            try:
                self._start_all(tmp, suite, servers)
                contexts = {
                    kind: RunContext(
                        server=srv,
                        pool=self.pool,
                        budget=self.options.budget,
                        max_client_procs=self.options.client_procs,
                    )
                    for kind, srv in servers.items()
                    if isinstance(srv, Target)
                }
                for w in workloads:
                    if w.placeholder:
                        self.rows.append(self._placeholder_row(w))
                        continue
                    outcomes: dict[str, Outcome] = {}
                    for kind in KINDS:
                        srv = servers[kind]
                        if not isinstance(srv, Target):
                            outcomes[kind] = srv
                        else:
                            outcomes[kind] = self._run_one(w, contexts[kind])
                    self.rows.append(Row(suite, w.name, outcomes["ours"], outcomes["etcd"]))
            finally:
                for kind, srv in servers.items():
                    if isinstance(srv, Target):
                        srv.stop()
                        self.progress.line(f"{suite} | {kind} server stopped ({srv.pid_text()})")

    def _run_one(self, w: Workload, ctx: RunContext) -> Outcome:
        assert w.run is not None
        label = f"{w.suite} | {w.name} | {ctx.kind}"
        if not ctx.server.alive():
            outcome: Outcome = Failed(f"server exited with code {ctx.server.exit_code()}")
            self.progress.line(f"{label} | {describe(outcome)}")
            return outcome
        self.progress.line(f"{label} | start")
        t0 = time.monotonic()
        ctx.detail = ""
        try:
            outcome = w.run(ctx)
        except Unimplemented as e:
            outcome, ctx.detail = Unavailable(NOT_IMPLEMENTED), str(e)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                outcome = Unavailable(NOT_IMPLEMENTED)
            else:
                outcome = Failed(f"{getattr(code, 'name', 'rpc error')}: {e}")
        except Exception as e:  # one workload's bug must not stop the run
            traceback.print_exc(file=self.progress.stream)
            outcome = Failed(f"{type(e).__name__}: {e}")
        if isinstance(outcome, Failed) and ctx.detail:
            self.progress.stream.write(ctx.detail.rstrip() + "\n")
        if isinstance(outcome, Failed) and not ctx.server.alive():
            outcome = Failed(f"{outcome.note} (server exited with code {ctx.server.exit_code()})")
        took = time.monotonic() - t0
        extra = (
            f" ({ctx.detail.strip().splitlines()[-1]})"
            if isinstance(outcome, Unavailable) and ctx.detail
            else ""
        )
        self.progress.line(f"{label} | done in {took:.1f}s: {describe(outcome)}{extra}")
        return outcome
