"""Runs the chosen suites against our server and etcd, one workload at a time.

For each suite the runner starts a fresh pair of servers (ours and, when the etcd
binary is there, etcd) in a temporary directory, runs every workload of the suite
on ours and then on etcd (back to back, so both see the same machine conditions),
and stops both servers by pid before the next suite. Placeholder suites start
nothing. One progress line per workload start and end goes to stderr.
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
from benchmarks.results import NOT_IMPLEMENTED, Failed, Measurement, Outcome, Row, Unavailable
from benchmarks.servers import BenchServer, EtcdServer, OursServer
from benchmarks.workloads import SUITES, Budget, RunContext, Workload

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
        parts = [f"{outcome.ops_s:,.0f} ops/s"]
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

    def _start(self, kind: str, tmp: Path, suite: str) -> BenchServer | Outcome:
        logs = self.options.out_dir / "logs"
        server: BenchServer
        if kind == "ours":
            server = OursServer(tmp / "ours", logs / f"{suite}-ours.log")
        elif self.options.etcd_binary:
            server = EtcdServer(tmp / "etcd", logs / f"{suite}-etcd.log", self.options.etcd_binary)
        else:
            return Unavailable("etcd not installed")
        self.progress.line(f"{suite} | starting {kind} server")
        try:
            server.start()
        except Exception as e:  # recorded as the suite's failure
            tail = server.log_tail()
            self.progress.line(f"{suite} | {kind} server did not start: {e}\n{tail}")
            return Failed(f"server did not start: {e}")
        self.progress.line(f"{suite} | {kind} server ready on {server.endpoint} (pid {server.pid})")
        return server

    def _run_suite(self, suite: str, workloads: list[Workload]) -> None:
        if all(w.placeholder for w in workloads):
            self.rows.extend(self._placeholder_row(w) for w in workloads)
            return
        with tempfile.TemporaryDirectory(prefix=f"bench-{suite}-") as tmp_name:
            tmp = Path(tmp_name)
            servers: dict[str, BenchServer | Outcome] = {}
            try:
                for kind in KINDS:
                    servers[kind] = self._start(kind, tmp, suite)
                contexts = {
                    kind: RunContext(
                        server=srv,
                        pool=self.pool,
                        budget=self.options.budget,
                        max_client_procs=self.options.client_procs,
                    )
                    for kind, srv in servers.items()
                    if isinstance(srv, BenchServer)
                }
                for w in workloads:
                    if w.placeholder:
                        self.rows.append(self._placeholder_row(w))
                        continue
                    outcomes: dict[str, Outcome] = {}
                    for kind in KINDS:
                        srv = servers[kind]
                        if not isinstance(srv, BenchServer):
                            outcomes[kind] = srv
                        else:
                            outcomes[kind] = self._run_one(w, contexts[kind])
                    self.rows.append(Row(suite, w.name, outcomes["ours"], outcomes["etcd"]))
            finally:
                for kind, srv in servers.items():
                    if isinstance(srv, BenchServer):
                        srv.stop()
                        self.progress.line(f"{suite} | {kind} server stopped (pid {srv.pid})")

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
