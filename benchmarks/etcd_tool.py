"""Side-by-side benchmark driven by etcd's own Go load generator (etcd v3.4.23 tools/benchmark).

Run it with::

    bash "$(scripts/shared_tools.sh)/etcd-benchmark/build.sh" /tmp/tools/etcd-benchmark  # once
    python -m benchmarks.etcd_tool [--quick] [--workloads put1,range64] \\
        [--transport native|grpcio] [--tool PATH] [--etcd PATH] [--out FILE.md] [--json FILE] \\
        [--ours-dir CHECKOUT] [--timeout SECONDS]

`--ours-dir` runs our server from another checkout (say `git clone . /tmp/qs-base` of a fixed
commit), so a baseline is not disturbed by edits in progress in this working tree.

What it owns: for each workload it starts a fresh real etcd and a fresh our server (each in
its own new temporary data directory, on free 127.0.0.1 ports), waits until each answers
`etcdctl endpoint health` (bounded), runs the Go tool against our server and then against etcd
with the same flags, and stops each server by its own pid (SIGTERM, SIGKILL after a bounded
wait). The two servers never run at the same time, so neither steals CPU from the other's run.
It measures the server process's CPU time (user + system of the process and all its
descendants, read from /proc) over exactly the tool run, the tool's own CPU time, and parses
the tool's report (requests/sec, latency percentiles, error distribution). It writes a Markdown
table and JSON; progress goes to stderr. The Go tool costs far less CPU per request than a
Python client, so on a small machine the figures measure the servers rather than the client.

Every tool run is bounded in count (`--total` / `--put-total`) and in time (a subprocess
timeout, after which the tool is killed by its pid and the run is recorded as failed).

The `watch` workload uses the tool's `watch` subcommand (not `watch-latency`): 100 watchers
(10 gRPC streams x 10 watchers, over 10 connections) all on one key, while 10 clients put to
that key as fast as they can; each put fans out to 100 events, and the tool's "Watch events
received summary" gives events/sec. `watch-latency` paces puts at a fixed --put-rate and reports
put-to-event latency, so it cannot measure a throughput. The watch report's latencies are the
time to hand each event of a received response to the tool, not a server latency, so the table
shows no p50 for it.

The server processes and /proc readings come from `benchmarks.servers`, the command line is the
set every harness shares (`benchmarks.options`), the measured tool run from `benchmarks.runs`;
besides those it needs only the standard library, the etcd and etcdctl binaries and the built
tool.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.options import (
    add_common_args,
    chosen_workloads,
    finish_report,
    new_server,
    resolve_common_args,
    run_meta,
    stop_on_sigterm,
)
from benchmarks.runs import run_measured
from benchmarks.servers import (
    OursServer,
    Server,
    StartupRejected,
    disturbed_note,
    named_log,
    process_tree_cpu,
)

SETUP_TIMEOUT = 20.0
QUICK_RUN_TIMEOUT = 180.0
FULL_RUN_TIMEOUT = 900.0

PUT_ARGS = ["--key-size=8", "--val-size=256", "--sequential-keys", "--key-space-size=100000"]


def put_args(conns: int, clients: int) -> list[str]:
    """The tool's `put` of the put rows (8 B keys, 256 B values) over `conns` connections."""
    return [f"--conns={conns}", f"--clients={clients}", "put", *PUT_ARGS]


@dataclass(frozen=True)
class Workload:
    """One workload: the tool's arguments for a given request count."""

    name: str
    description: str
    args: Callable[[int], list[str]]
    full: int
    quick: int
    unit: str = "req"
    setup_key: str | None = None
    """A key to put (with etcdctl) before the measured run, if the workload reads one."""
    summary: str = "Summary:"
    """The header of the report section to parse (the watch tool prints two)."""
    has_latency: bool = True

    def set_up(self, server: Server) -> None:
        """Put the key the workload reads (if it reads one) through `server`, with etcdctl."""
        if self.setup_key is None:
            return
        r = server.etcdctl_run("put", self.setup_key, "bar", timeout=SETUP_TIMEOUT)
        if r.returncode != 0:
            raise RuntimeError(f"setup put {self.setup_key} failed: {r.stderr.strip()}")


WORKLOADS: list[Workload] = [
    Workload(
        "put1",
        "put, 1 connection, 1 client (fsync latency bound)",
        lambda n: [*put_args(1, 1), f"--total={n}"],
        full=20_000,
        quick=1_500,
    ),
    Workload(
        "put64",
        "put, 8 connections, 64 clients",
        lambda n: [*put_args(8, 64), f"--total={n}"],
        full=150_000,
        quick=8_000,
    ),
    Workload(
        "put256",
        "put, 16 connections, 256 clients",
        lambda n: [*put_args(16, 256), f"--total={n}"],
        full=200_000,
        quick=8_000,
    ),
    Workload(
        "range64",
        "linearizable range of one key `foo`, 8 connections, 64 clients",
        lambda n: ["--conns=8", "--clients=64", "range", "foo", "--consistency=l", f"--total={n}"],
        full=120_000,
        quick=8_000,
        setup_key="foo",
    ),
    Workload(
        "txnput",
        "txn of 4 puts, 2 connections, 16 clients (key space 100000: the tool's default of 1 "
        "key makes every txn a duplicate-key error)",
        lambda n: [
            "--conns=2",
            "--clients=16",
            "txn-put",
            "--txn-ops=4",
            "--key-size=8",
            "--val-size=256",
            "--key-space-size=100000",
            f"--total={n}",
        ],
        full=50_000,
        quick=3_000,
    ),
    Workload(
        "keepalive",
        "lease keepalive (one lease per client), 1 connection, 16 clients",
        lambda n: ["--clients=16", "lease-keepalive", f"--total={n}"],
        full=100_000,
        quick=6_000,
    ),
    Workload(
        "stm",
        "STM transactions (tool defaults: 1 key, repeatable reads), 1 connection, 16 clients",
        lambda n: ["--clients=16", "stm", f"--total={n}"],
        full=40_000,
        quick=3_000,
    ),
    Workload(
        "watch",
        "100 watchers on one key (10 streams x 10, 10 connections), 10 putters; events/s",
        lambda n: [
            "--conns=10",
            "--clients=10",
            "watch",
            "--streams=10",
            "--watch-per-stream=10",
            "--watched-key-total=1",
            f"--put-total={n}",
            "--put-rate=1000000",
        ],
        full=10_000,
        quick=800,
        unit="event",
        summary="Watch events received summary:",
        has_latency=False,
    ),
]
WORKLOADS_BY_NAME = {w.name: w for w in WORKLOADS}


log = named_log("etcd_tool")


# --- the tool's report ---------------------------------------------------------------------

_FLOAT = r"([0-9.eE+-]+)"


@dataclass
class ToolReport:
    requests: int = 0
    """Successful requests (the histogram's counts)."""
    total_s: float | None = None
    rps: float | None = None
    average_ms: float | None = None
    slowest_ms: float | None = None
    percentiles_ms: dict[str, float] = field(default_factory=dict)
    """"50" -> ms, "99.9" -> ms, ..."""
    errors: dict[str, int] = field(default_factory=dict)


def parse_report(text: str, header: str) -> ToolReport:
    """Parse the tool's report section that starts at the last `header` line."""
    rep = ToolReport()
    at = text.rfind(header)
    if at >= 0:
        text = text[at:]
    for line in text.splitlines():
        s = line.strip()
        if m := re.match(rf"Total:\s+{_FLOAT} secs", s):
            rep.total_s = float(m.group(1))
        elif m := re.match(rf"Requests/sec:\s+{_FLOAT}", s):
            rep.rps = float(m.group(1))
        elif m := re.match(rf"Average:\s+{_FLOAT} secs", s):
            rep.average_ms = float(m.group(1)) * 1000
        elif m := re.match(rf"Slowest:\s+{_FLOAT} secs", s):
            rep.slowest_ms = float(m.group(1)) * 1000
        elif m := re.match(rf"([0-9.]+)% in {_FLOAT} secs", s):
            rep.percentiles_ms[m.group(1)] = float(m.group(2)) * 1000
        elif m := re.match(rf"{_FLOAT} \[(\d+)\]\s*\|", s):
            rep.requests += int(m.group(2))
        elif m := re.match(r"\[(\d+)\]\s+(.*)", s):
            rep.errors[m.group(2)] = rep.errors.get(m.group(2), 0) + int(m.group(1))
    if rep.requests == 0 and rep.rps is not None and rep.total_s is not None:
        rep.requests = round(rep.rps * rep.total_s)
    return rep


# --- one run -------------------------------------------------------------------------------


@dataclass
class RunResult:
    server: str
    workload: str
    command: list[str]
    ok: bool
    error: str | None = None
    wall_s: float | None = None
    server_cpu_s: float | None = None
    tool_cpu_s: float | None = None
    other_cpu_s: float | None = None
    """Busy CPU of the whole machine over the run minus the server's and the tool's: other
    processes that may have disturbed the figures."""
    report: ToolReport = field(default_factory=ToolReport)
    notes: list[str] = field(default_factory=list)

    @property
    def cpu_us_per_request(self) -> float | None:
        if self.server_cpu_s is None or not self.report.requests:
            return None
        return self.server_cpu_s * 1e6 / self.report.requests


def run_tool(
    tool: str, server: Server, wl: Workload, n: int, timeout: float, work_dir: Path
) -> RunResult:
    """Run the tool once against a ready `server`; measure the server's CPU over the run."""
    return run_tool_on(tool, [server], server.endpoint, wl, n, timeout, work_dir)


def run_tool_on(
    tool: str,
    servers: Sequence[Server],
    endpoints: str,
    wl: Workload,
    n: int,
    timeout: float,
    work_dir: Path,
) -> RunResult:
    """Run the tool once with `--endpoints=endpoints`; `servers` (all of one kind: the members
    of a cluster, or one server) are measured, their CPU summed over the run."""
    kind = servers[0].kind
    cmd = [tool, f"--endpoints={endpoints}", *wl.args(n)]
    res = RunResult(server=kind, workload=wl.name, command=cmd, ok=False)
    out_path = work_dir / f"{wl.name}-{kind}.tool.out"
    err_path = work_dir / f"{wl.name}-{kind}.tool.err"

    def servers_cpu() -> float:
        return sum(process_tree_cpu(s.pid) for s in servers)

    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        run = run_measured(cmd, out, err, timeout, servers_cpu)
    rc = run.rc
    res.wall_s, res.server_cpu_s = run.wall_s, run.server_cpu_s
    res.tool_cpu_s, res.other_cpu_s = run.tool_cpu_s, run.other_cpu_s
    text = out_path.read_text(errors="replace")
    res.report = parse_report(text, wl.summary)
    if rc is None:
        res.error = f"tool timed out after {timeout:.0f}s (killed)"
    elif rc != 0:
        tail = err_path.read_text(errors="replace").strip().splitlines()[-5:]
        res.error = f"tool exited with code {rc}: " + " | ".join(tail)
    elif res.report.rps is None:
        res.error = "no Requests/sec in the tool's output"
    else:
        res.ok = True
    for server in servers:
        if server.proc is not None and server.proc.poll() is not None:
            res.ok = False
            res.error = f"server exited with code {server.proc.returncode} during the run"
    if note := disturbed_note(res.other_cpu_s, res.wall_s):
        res.notes.append(note)
    if res.report.errors:
        res.notes.append(
            "tool errors: " + "; ".join(f"{c}x {m}" for m, c in res.report.errors.items())
        )
    return res


def start_ours(
    work_dir: Path, etcdctl: str, transport: str | None, source: Path
) -> tuple[OursServer, str]:
    """Start our server; if it rejects --grpc-transport, start it again without the flag."""
    ours = OursServer(work_dir, etcdctl, transport, source)
    try:
        ours.start()
        return ours, ""
    except StartupRejected as e:
        if transport is None or "transport" not in e.log_text:
            raise RuntimeError(f"{e}\n{e.log_text}") from e
        note = f"our server rejected --grpc-transport {transport}; ran without it (default)"
        log(note + ": " + e.log_text.strip().splitlines()[-1])
    ours = OursServer(work_dir, etcdctl, None, source)
    ours.start()
    return ours, note


def run_one(
    kind: str,
    wl: Workload,
    n: int,
    args: argparse.Namespace,
    work_dir: Path,
    etcdctl: str,
) -> RunResult:
    """A fresh server of `kind`, its setup, one measured tool run, then stop it."""
    note = ""
    server: Server | None = None
    try:
        if kind == "ours":
            server, note = start_ours(work_dir, etcdctl, args.transport, args.ours_dir)
        else:
            server = new_server(kind, work_dir, args)
            server.start()
        log(f"  {kind} ready on {server.endpoint} (pid {server.pid})")
        wl.set_up(server)
        res = run_tool(args.tool, server, wl, n, args.timeout, work_dir)
    except Exception as e:
        res = RunResult(server=kind, workload=wl.name, command=[], ok=False, error=str(e))
    finally:
        if server is not None:
            server.stop()
    if note:
        # Don't offer the flag again in this session: later runs go straight to the default.
        args.transport_note = note
        args.transport = None
    if kind == "ours" and args.transport_note:
        res.notes.append(args.transport_note)
    if not res.ok and server is not None:
        res.notes.append(f"server log tail: {server.log_tail(5)}")
    return res


# --- output --------------------------------------------------------------------------------


def _num(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}"


def markdown(rows: list[tuple[Workload, int, RunResult, RunResult]], meta: dict[str, Any]) -> str:
    lines = [
        "# queue-server vs etcd, driven by etcd's tools/benchmark",
        "",
        f"{meta['date']}; {meta['mode']} mode; {meta['cpus']} CPUs; etcd {meta['etcd_version']}; "
        f"our server from {meta['ours_dir']} at commit {meta['commit']}; "
        f"transport {meta['transport']}.",
        "",
        "| workload | etcd req/s | ours req/s | ours/etcd | p50 ms etcd / ours "
        "| server CPU µs per request etcd / ours |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for wl, _n, ours, etcd in rows:

        def rps(r: RunResult) -> float | None:
            return r.report.rps if r.ok else None

        def p50(r: RunResult) -> str:
            return _num(r.report.percentiles_ms.get("50") if r.ok else None, "{:.2f}")

        def cpu(r: RunResult) -> str:
            return _num(r.cpu_us_per_request if r.ok else None, "{:,.0f}")

        p50s = f"{p50(etcd)} / {p50(ours)}" if wl.has_latency else "n/a"
        name = wl.name + (" (events/s)" if wl.unit == "event" else "")
        lines.append(
            f"| {name} | {_num(rps(etcd))} | {_num(rps(ours))} | "
            f"{_ratio(rps(ours), rps(etcd))} | {p50s} | {cpu(etcd)} / {cpu(ours)} |"
        )
    lines += ["", "Workloads (tool flags after `--endpoints=...`; the same for both servers):", ""]
    for wl, n, ours, etcd in rows:
        lines.append(f"- **{wl.name}**: {wl.description}: `{' '.join(wl.args(n))}`")
        for r in (etcd, ours):
            extra = []
            if not r.ok:
                extra.append(f"FAILED: {r.error}")
            extra += r.notes
            if r.ok:
                pct = ", ".join(
                    f"p{k} {v:.2f} ms" for k, v in r.report.percentiles_ms.items() if k in PCTS
                )
                extra.append(
                    f"{r.report.requests:,} {wl.unit}s in {_num(r.report.total_s, '{:.1f}')} s"
                    + (f"; {pct}" if wl.has_latency and pct else "")
                    + f"; server CPU {_num(r.server_cpu_s, '{:.1f}')} s,"
                    f" tool CPU {_num(r.tool_cpu_s, '{:.1f}')} s"
                )
            lines.append(f"  - {r.server}: " + "; ".join(extra))
    lines += [
        "",
        "Each server is started fresh for each workload (new temp data dir) and runs alone; "
        "server CPU is user+system of the server process and its descendants over the tool run "
        "(from /proc). The watch row counts events delivered to the 100 watchers; its latency "
        "figures are not server latencies and are left out.",
        "",
    ]
    return "\n".join(lines)


PCTS = ("50", "90", "99", "99.9")


def to_json(
    rows: list[tuple[Workload, int, RunResult, RunResult]], meta: dict[str, Any]
) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for wl, n, ours, etcd in rows:
        entry: dict[str, Any] = {"workload": wl.name, "count": n, "unit": wl.unit}
        for r in (ours, etcd):
            d = asdict(r)
            d["cpu_us_per_request"] = r.cpu_us_per_request
            entry[r.server] = d
        rps_o, rps_e = ours.report.rps, etcd.report.rps
        entry["ours_over_etcd"] = rps_o / rps_e if ours.ok and etcd.ok and rps_o and rps_e else None
        out.append(entry)
    return {"meta": meta, "results": out}


# --- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.etcd_tool",
        description="queue-server vs etcd side by side, driven by etcd's tools/benchmark.",
    )
    add_common_args(
        p,
        QUICK_RUN_TIMEOUT,
        FULL_RUN_TIMEOUT,
        workloads=list(WORKLOADS_BY_NAME),
        quick_help="small runs (a couple of seconds each)",
    )
    p.add_argument(
        "--transport",
        choices=["native", "grpcio"],
        default=None,
        help="pass --grpc-transport VALUE to our server (default: don't pass it)",
    )
    args = p.parse_args(argv)
    args.workload_list = chosen_workloads(p, args.workloads, WORKLOADS_BY_NAME)
    resolve_common_args(p, args, QUICK_RUN_TIMEOUT, FULL_RUN_TIMEOUT)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    mode = "quick" if args.quick else "full"
    meta = run_meta(args)
    meta["tool"] = args.tool
    meta["transport"] = args.transport or "default"
    requested_transport = args.transport
    args.transport_note = ""
    started = time.monotonic()
    rows: list[tuple[Workload, int, RunResult, RunResult]] = []
    failed: list[str] = []
    for wl in args.workload_list:
        n = wl.quick if args.quick else wl.full
        work_dir = Path(tempfile.mkdtemp(prefix=f"etcd-tool-{wl.name}-"))
        log(f"{wl.name}: {n:,} ({mode}) in {work_dir}")
        results: dict[str, RunResult] = {}
        for kind in ("ours", "etcd"):
            res = run_one(kind, wl, n, args, work_dir, args.etcdctl)
            results[kind] = res
            if res.ok:
                log(
                    f"  {kind}: {res.report.rps:,.0f} {wl.unit}/s, {res.report.requests:,} in "
                    f"{res.report.total_s}s, p50 {res.report.percentiles_ms.get('50', 0):.2f} ms, "
                    f"server CPU {res.server_cpu_s:.2f}s, tool CPU {res.tool_cpu_s:.2f}s"
                )
            else:
                log(f"  {kind}: FAILED: {res.error}")
            for note in res.notes:
                log(f"  {kind}: note: {note}")
        rows.append((wl, n, results["ours"], results["etcd"]))
        if results["ours"].ok and results["etcd"].ok:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            failed += [f"{wl.name} on {kind}" for kind, r in results.items() if not r.ok]
            log(f"  kept {work_dir} (logs)")
    if args.transport_note:
        meta["transport"] = (
            f"{requested_transport} requested, but our server rejected --grpc-transport; "
            "it ran with its default"
        )
    return finish_report(args, markdown(rows, meta), to_json(rows, meta), failed, started, log)


if __name__ == "__main__":
    sys.exit(main())
