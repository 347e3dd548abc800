"""The queue workloads side by side with real etcd, driven by our Go load generator.

Run it with::

    python -m benchmarks.queue_tool [--quick] [--workloads mq,mq-64,mq-batched,recipe,...]
        [--queue-tool PATH] [--no-etcd] [--etcd PATH] [--ours-dir CHECKOUT] [--out FILE]
        [--json FILE] [--timeout SECONDS]

(the options every harness shares: `benchmarks/options.py`). The driver is `tools/queue-bench`
(Go; `scripts/build_queue_bench.sh` builds it offline, and this module builds it into a temporary
directory unless `--queue-tool` names a built one). A Python gRPC client costs more CPU per
message than either server and saturates a 2-core machine; the Go driver costs a fraction of the
server's CPU per message, and reports its own so that can be checked.

What it owns: for each run it starts a fresh server (`benchmarks.servers`: ours is
`python -m queue_server.cli`, etcd is Debian's 3.4), each in a new temporary data directory on
free 127.0.0.1 ports; it runs the driver once against it (bounded: the driver's own `--timeout`,
and a subprocess timeout after which the driver is killed by its pid), then stops the server by
its pid. Servers never run at the same time. The driver reads the server's CPU time (utime +
stime of the pid and its descendants, /proc/PID/stat) at the start and the end of its measured
phase, so CPU per message leaves out setup and prefill; this module reads the whole machine's
busy CPU over the driver run and flags runs that other processes disturbed.

The runs:

- `recipe`: etcd's queue recipe (prefix put, 8 consumers each prefix-watching, claim with a
  mod_revision Txn) on real etcd, and on ours. etcd's run is the baseline of the `mq` rows.
- `mq`: our etcd-key queue, 8 producers, 8 consumers, one Put and one DeleteRange per message.
- `mq-64`: the same with 64 producers, 16 acks in flight per consumer and 1024 messages
  unacknowledged at most; its baseline is `recipe-64`, etcd's recipe with the same clients.
- `mq-batched`: the same with 16 puts per Txn and acks of up to 16 deletes per Txn; its server CPU
  per message is a target row of its own.
- `mq-deep`, `mq-batched-prefetch`: the two rows above with a deeper pipeline (more producers and
  messages in flight; a prefetch window of 1000): reported, to show where the server's limit is.
- `cqs-dequeue`: CQS BatchDequeue(max 20) + BatchAcknowledge, 4 consumers, from a prefilled queue.
- `cqs-reenqueue`: one CQS ReEnqueue stream of items.

Any run whose driver reports a lost, duplicated or unknown message, an RPC error or a timeout
fails: the row says FAILED with the reason and the exit status is 1.

Output: Markdown (the targets of issues 14 and 25 with ours, etcd's recipe, ratio and met?, then
every run in detail) and JSON. A full run writes `docs/bench/queue-tool.md` and
`docs/bench/queue-tool.json` unless `--out`/`--json` say otherwise; a `--quick` run (small
counts, well under a minute in all) writes only where `--out`/`--json` say. The Markdown also
goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
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
    go_version,
    new_server,
    queue_bench,
    resolve_common_args,
    run_meta,
    stop_on_sigterm,
)
from benchmarks.runs import driver_answer, run_measured
from benchmarks.servers import (
    REPO_ROOT,
    Server,
    disturbed_note,
    named_log,
    process_tree_cpu,
)

DOCS_MD = REPO_ROOT / "docs" / "bench" / "queue-tool.md"
DOCS_JSON = REPO_ROOT / "docs" / "bench" / "queue-tool.json"
QUICK_DRIVER_TIMEOUT = 60.0
FULL_DRIVER_TIMEOUT = 400.0
SETUP_TIMEOUT = 120.0
"""The driver's own bound on its setup (connect, watches, prefill)."""
KILL_MARGIN = 60.0
"""Seconds past the driver's own bounds after which it is killed."""


@dataclass(frozen=True)
class Run:
    """One way to drive one server: a driver subcommand and its flags for a given count."""

    name: str
    subcommand: str
    flags: Callable[[int], list[str]]
    full: int
    quick: int
    unit: str

    def args(self, quick: bool) -> list[str]:
        n = self.quick if quick else self.full
        return [self.subcommand, f"--total={n}", *self.flags(n)]


RECIPE = Run(
    "recipe",
    "recipe",
    lambda n: ["--consumers=8", "--producers=4", "--inflight=128", "--conns=4"],
    full=20_000,
    quick=300,
    unit="msg",
)


def _mq(
    name: str,
    producers: int,
    batch: int,
    acks_in_flight: int,
    inflight: int,
    full: int,
    quick: int,
    prefetch: int | None = None,
) -> Run:
    """An `mq` run: 8 consumers on 4 connections, `batch` puts per produce request and deletes
    per ack (batched acks linger 20 ms to fill), at most `inflight` messages unacknowledged."""
    linger = ["--ack-linger=20ms"] if batch > 1 else []
    window = [] if prefetch is None else [f"--prefetch={prefetch}"]
    flags = [
        "--consumers=8",
        f"--producers={producers}",
        f"--put-batch={batch}",
        f"--ack-batch={batch}",
        f"--acks-in-flight={acks_in_flight}",
        *linger,
        f"--inflight={inflight}",
        *window,
        "--conns=4",
    ]
    return Run(name, "mq", lambda n: flags, full=full, quick=quick, unit="msg")


MQ = _mq("mq", producers=8, batch=1, acks_in_flight=4, inflight=128, full=60_000, quick=1_000)
MQ_WIDE = _mq(
    "mq-64", producers=64, batch=1, acks_in_flight=16, inflight=1024, full=60_000, quick=1_000
)
"""Issue 25's single-message row: as many producers as etcd_tool's put64 has clients, 16 acks
in flight per consumer, at most 1024 messages unacknowledged (cluster_tool's queue row)."""
RECIPE_WIDE = Run(
    "recipe-64",
    "recipe",
    lambda n: ["--consumers=8", "--producers=64", "--inflight=1024", "--conns=4"],
    full=20_000,
    quick=300,
    unit="msg",
)
"""etcd's recipe with the clients of `MQ_WIDE`: the baseline of its ratio."""
MQ_BATCHED = _mq(
    "mq-batched", producers=4, batch=16, acks_in_flight=2, inflight=512, full=200_000, quick=3_200
)
MQ_DEEP = _mq(
    "mq-deep", producers=16, batch=1, acks_in_flight=4, inflight=512, full=60_000, quick=1_000
)
MQ_BATCHED_PREFETCH = _mq(
    "mq-batched-prefetch",
    producers=8,
    batch=16,
    acks_in_flight=2,
    inflight=4096,
    full=200_000,
    quick=3_200,
    prefetch=1000,
)
CQS_DEQUEUE = Run(
    "cqs-dequeue",
    "cqs-dequeue",
    lambda n: ["--consumers=4", "--batch=20", "--depth=4", "--prefill=put", "--conns=4"],
    full=200_000,
    quick=2_000,
    unit="notification",
)
CQS_REENQUEUE = Run(
    "cqs-reenqueue",
    "cqs-reenqueue",
    lambda n: [],
    full=1_000_000,
    quick=10_000,
    unit="item",
)


@dataclass(frozen=True)
class Workload:
    """A row of the report: what runs on ours, and what on etcd (its recipe) to compare."""

    name: str
    title: str
    ours: Run
    etcd: Run | None
    target: str
    meets: Callable[[float | None, float | None, float | None], bool | None] | None = None
    """(ours per second, ours/etcd, ours' server CPU µs per unit) -> met?, or None when the
    target is only reported."""


def _mq_target(rate: float | None, ratio: float | None, _cpu_us: float | None) -> bool | None:
    if rate is None:
        return None
    return rate >= 3_000 and ratio is not None and ratio >= 10


def _mq_wide_target(rate: float | None, ratio: float | None, cpu_us: float | None) -> bool | None:
    if rate is None:
        return None
    return (
        rate >= 4_000
        and ratio is not None
        and ratio >= 7
        and cpu_us is not None
        and (cpu_us <= 200)
    )


WORKLOADS: list[Workload] = [
    Workload(
        "mq",
        "etcd-key queue, 8 consumers, one put and one delete per message (msgs/s)",
        MQ,
        RECIPE,
        ">= 3,000 msgs/s and >= 10x etcd's recipe on real etcd",
        _mq_target,
    ),
    Workload(
        "mq-64",
        "etcd-key queue, 64 producers and 8 consumers, one put and one delete per message "
        "(msgs/s; etcd's recipe with the same clients)",
        MQ_WIDE,
        RECIPE_WIDE,
        ">= 4,000 msgs/s, >= 7x etcd's recipe, <= 200 µs of server CPU per message",
        _mq_wide_target,
    ),
    Workload(
        "mq-batched",
        "the same, 16 puts per Txn and 16 acks (deletes) per Txn (msgs/s)",
        MQ_BATCHED,
        RECIPE,
        ">= 10,000 msgs/s",
        lambda rate, _ratio, _cpu_us: None if rate is None else rate >= 10_000,
    ),
    Workload(
        "mq-deep",
        "variant of the first row: 16 producers, 512 messages unacked at most (msgs/s)",
        MQ_DEEP,
        RECIPE,
        "(reported: how the first row moves with a deeper pipeline)",
    ),
    Workload(
        "mq-batched-prefetch",
        "variant of the batched row: prefetch 1000 per consumer, 8 producers, 4096 unacked "
        "at most (msgs/s)",
        MQ_BATCHED_PREFETCH,
        RECIPE,
        "(reported: how the batched row moves with a larger prefetch window)",
    ),
    Workload(
        "recipe",
        "etcd's queue recipe, 8 consumers, claim by mod_revision Txn (msgs/s)",
        RECIPE,
        RECIPE,
        "(the baseline of the rows above)",
    ),
    Workload(
        "cqs-dequeue",
        "CQS BatchDequeue + BatchAcknowledge, batches of 20, 4 consumers (notifications/s)",
        CQS_DEQUEUE,
        None,
        "notifications/s (reported)",
    ),
    Workload(
        "cqs-reenqueue",
        "CQS ReEnqueue, one client stream (items/s)",
        CQS_REENQUEUE,
        None,
        "items/s (reported)",
    ),
]
WORKLOADS_BY_NAME = {w.name: w for w in WORKLOADS}


log = named_log("queue_tool")


# --- one driver run against one fresh server -------------------------------------------------


@dataclass
class RunResult:
    run: str
    server: str
    command: list[str]
    ok: bool = False
    error: str | None = None
    driver: dict[str, Any] | None = None
    """The driver's JSON object."""
    wall_s: float | None = None
    server_cpu_run_s: float | None = None
    """The server's CPU over the whole driver run (setup and prefill included)."""
    driver_cpu_s: float | None = None
    other_cpu_s: float | None = None
    """Busy CPU of the machine over the driver run minus the server's and the driver's."""
    notes: list[str] = field(default_factory=list)

    def figure(self, key: str) -> float | None:
        if not self.ok or self.driver is None:
            return None
        value = self.driver.get(key)
        return float(value) if isinstance(value, int | float) else None

    @property
    def per_second(self) -> float | None:
        return self.figure("per_second")

    @property
    def server_us(self) -> float | None:
        return self.figure("server_cpu_us_per_unit")


def drive(
    tool: Path, server: Server, run: Run, quick: bool, timeout: float, work: Path
) -> RunResult:
    """One driver run against a ready `server`."""
    cmd = [
        str(tool),
        *run.args(quick),
        f"--endpoint={server.endpoint}",
        f"--server-pid={server.pid}",
        f"--timeout={timeout:.0f}s",
        f"--setup-timeout={SETUP_TIMEOUT:.0f}s",
        f"--label={run.name} on {server.kind}",
    ]
    res = RunResult(run=run.name, server=server.kind, command=cmd)
    out_path = work / f"{run.name}-{server.kind}.json"
    with open(out_path, "wb") as out:
        # stderr (the driver's progress lines) goes straight to ours
        done = run_measured(
            cmd,
            out,
            None,
            timeout + SETUP_TIMEOUT + KILL_MARGIN,
            lambda: process_tree_cpu(server.pid),
        )
    res.wall_s, res.server_cpu_run_s = done.wall_s, done.server_cpu_s
    res.driver_cpu_s, res.other_cpu_s = done.tool_cpu_s, done.other_cpu_s
    res.driver, res.error = driver_answer(out_path, done)
    res.ok = res.error is None
    if server.proc is not None and server.proc.poll() is not None:
        res.ok = False
        res.error = f"the server exited with code {server.proc.returncode} during the run"
    if note := disturbed_note(res.other_cpu_s, res.wall_s):
        res.notes.append(note)
    return res


def run_on(kind: str, run: Run, args: argparse.Namespace) -> RunResult:
    """A fresh server of `kind` in a new data directory, one driver run, then stop it."""
    work = Path(tempfile.mkdtemp(prefix=f"queue-tool-{run.name}-{kind}-"))
    server: Server | None = None
    log(f"{run.name} on {kind}: {run.quick if args.quick else run.full:,} {run.unit}s in {work}")
    try:
        server = new_server(kind, work, args)
        server.start()
        log(f"  {kind} ready on {server.endpoint} (pid {server.pid})")
        res = drive(args.queue_tool, server, run, args.quick, args.timeout, work)
    except Exception as e:
        res = RunResult(run=run.name, server=kind, command=[], error=f"{type(e).__name__}: {e}")
    finally:
        if server is not None:
            server.stop()
    if res.ok:
        d = res.driver or {}
        log(
            f"  {kind}: {d.get('per_second', 0):,.0f} {run.unit}s/s, server CPU "
            f"{res.server_us or 0:,.0f} µs/{run.unit}, driver CPU "
            f"{d.get('client_cpu_us_per_unit', 0):,.0f} µs/{run.unit}"
        )
        shutil.rmtree(work, ignore_errors=True)
    else:
        log(f"  {kind}: FAILED: {res.error}")
        if server is not None:
            res.notes.append(f"server log tail: {server.log_tail(5)}")
        log(f"  kept {work} (server log, driver output)")
    for note in res.notes:
        log(f"  {kind}: note: {note}")
    return res


# --- report --------------------------------------------------------------------------------


@dataclass
class Row:
    workload: Workload
    ours: RunResult | None
    etcd: RunResult | None

    @property
    def ratio(self) -> float | None:
        a = self.ours.per_second if self.ours else None
        b = self.etcd.per_second if self.etcd else None
        return a / b if a is not None and b else None

    @property
    def met(self) -> bool | None:
        if self.workload.meets is None or self.ours is None:
            return None
        return self.workload.meets(self.ours.per_second, self.ratio, self.ours.server_us)


def _num(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def _met(row: Row) -> str:
    if row.ours is not None and not row.ours.ok:
        return "FAILED"
    m = row.met
    return (
        "reported" if row.workload.meets is None else ("—" if m is None else "yes" if m else "no")
    )


def _rate(r: RunResult | None) -> str:
    if r is None:
        return "—"
    return _num(r.per_second) if r.ok else "FAILED"


def _checks(r: RunResult) -> str:
    c = (r.driver or {}).get("counts", {})
    keys = ("duplicates", "missing", "unknown", "left_in_queue", "rpc_errors")
    parts = [f"{k} {c[k]}" for k in keys if k in c]
    if "claim_conflicts" in c:
        parts.append(f"claim conflicts {c['claim_conflicts']:,}")
    return ", ".join(parts)


def _batching(r: RunResult) -> str:
    """Messages per produce request, per ack request and per delivery response (mq runs)."""
    d = r.driver or {}
    c = d.get("counts", {})
    if (
        not c.get("produce_requests")
        or not c.get("ack_requests")
        or not c.get("delivery_responses")
    ):
        return "—"
    return (
        f"{c['produced'] / c['produce_requests']:.1f} / {d.get('count', 0) / c['ack_requests']:.1f}"
        f" / {c['deliveries'] / c['delivery_responses']:.1f}"
    )


def markdown(rows: list[Row], runs: list[RunResult], meta: dict[str, Any]) -> str:
    lines = [
        "# Queue workloads: queue-server vs etcd, driven by tools/queue-bench",
        "",
        f"{meta['date']}; {meta['mode']} mode; {meta['cpus']} CPUs; etcd {meta['etcd_version']}; "
        f"our server from {meta['ours_dir']} at commit {meta['commit']}; driver "
        f"`tools/queue-bench` (Go, {meta['go']}). Generated by `python -m benchmarks.queue_tool"
        f"{' --quick' if meta['mode'] == 'quick' else ''}`.",
        "",
        "## Against the targets (issues 14 and 25)",
        "",
        "| workload | ours | etcd's recipe | ours/etcd | target | met |",
        "|---|--:|--:|--:|---|---|",
    ]
    for row in rows:
        ratio = _num(row.ratio, "{:.2f}x")
        lines.append(
            f"| {row.workload.title} | {_rate(row.ours)} | {_rate(row.etcd)} | {ratio} | "
            f"{row.workload.target} | {_met(row)} |"
        )
        if row.workload.name in ("mq-64", "mq-batched") and row.ours is not None:
            which = (
                "the batched row" if row.workload.name == "mq-batched" else "the 64-producer row"
            )
            etcd_us = row.etcd.server_us if row.etcd else None
            lines.append(
                f"| server CPU per message in {which} (µs; etcd: per message of its "
                f"recipe) | {_num(row.ours.server_us)} | {_num(etcd_us)} | | µs per message "
                f"(reported) | {'FAILED' if not row.ours.ok else 'reported'} |"
            )
    lines += [
        "",
        "## Every run",
        "",
        "Rates are completions over the measured phase (first produce to last ack, claim or "
        "answer). Server CPU is the server process's user+system time over that phase, read "
        "from /proc by the driver; driver CPU is the Go driver's own over the same phase.",
        "",
        "| run | server | rate /s | latency p50 / p99 ms | server CPU µs per unit | driver CPU "
        "µs per unit | count | messages per put / ack / delivery response | checks | notes |",
        "|---|---|--:|--:|--:|--:|--:|--:|---|---|",
    ]
    for r in runs:
        d = r.driver or {}
        lat = d.get("latency_ms") or {}
        lat_s = (
            f"{lat['p50']:.2f} / {lat['p99']:.2f}"
            if r.ok and "p50" in lat and "p99" in lat
            else "—"
        )
        notes = list(r.notes)
        if not r.ok:
            notes.insert(0, f"FAILED: {r.error}")
        unit = d.get("unit", "")
        lines.append(
            f"| {r.run} | {r.server} | {_rate(r)} | {lat_s} | {_num(r.server_us)} | "
            f"{_num(r.figure('client_cpu_us_per_unit'))} | {d.get('count', 0):,} {unit}s | "
            f"{_batching(r)} | {_checks(r)} | {'; '.join(n.replace('|', '/') for n in notes)} |"
        )
    lines += ["", "Driver commands (the endpoint, server pid and bounds are added per run):", ""]
    seen: set[str] = set()
    for r in runs:
        if r.run in seen or not r.command:
            continue
        seen.add(r.run)
        shown = [
            a for a in r.command[1:] if not a.startswith(("--endpoint", "--server-pid", "--label"))
        ]
        lines.append(f"- **{r.run}**: `queue-bench {' '.join(shown)}`")
    lines += [
        "",
        "Each run has a fresh server (new temporary data directory, fsync on, default settings) "
        "and runs alone. Latency: mq, produce to delivery; recipe, produce to successful claim; "
        "cqs-dequeue, one BatchDequeue + BatchAcknowledge. Every message is tracked by number: "
        "a run fails when one is missing, received twice or unknown, or when anything is left "
        "in the queue.",
        "",
    ]
    return "\n".join(lines)


def to_json(rows: list[Row], runs: list[RunResult], meta: dict[str, Any]) -> dict[str, Any]:
    out_rows = []
    for row in rows:
        entry: dict[str, Any] = {
            "workload": row.workload.name,
            "title": row.workload.title,
            "target": row.workload.target,
            "ours_per_second": row.ours.per_second if row.ours else None,
            "etcd_recipe_per_second": row.etcd.per_second if row.etcd else None,
            "ours_over_etcd": row.ratio,
            "ours_server_cpu_us_per_unit": row.ours.server_us if row.ours else None,
            "etcd_server_cpu_us_per_unit": row.etcd.server_us if row.etcd else None,
            "met": row.met,
            "ok": bool(row.ours and row.ours.ok and (row.etcd is None or row.etcd.ok)),
        }
        out_rows.append(entry)
    return {"meta": meta, "rows": out_rows, "runs": [asdict(r) for r in runs]}


# --- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.queue_tool",
        description="The queue workloads on queue-server and etcd, driven by tools/queue-bench.",
    )
    add_common_args(
        p,
        QUICK_DRIVER_TIMEOUT,
        FULL_DRIVER_TIMEOUT,
        workloads=list(WORKLOADS_BY_NAME),
        quick_help="small counts (well under a minute)",
        etcd_optional=True,
        timeout_help="the driver's bound on each measured phase, seconds",
    )
    args = p.parse_args(argv)
    args.workload_list = chosen_workloads(p, args.workloads, WORKLOADS_BY_NAME)
    resolve_common_args(
        p,
        args,
        QUICK_DRIVER_TIMEOUT,
        FULL_DRIVER_TIMEOUT,
        need_tool=False,
        need_queue_tool=True,
    )
    if not args.quick:
        args.out = args.out or DOCS_MD
        args.json = args.json or DOCS_JSON
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    started = time.monotonic()
    with queue_bench(args):
        meta = run_meta(args)
        meta["go"] = go_version()
        meta["queue_tool"] = str(args.queue_tool)
        # etcd's recipe run is the baseline of every row that compares with it: run it once.
        cache: dict[tuple[str, str], RunResult] = {}
        runs: list[RunResult] = []

        def result(kind: str, run: Run) -> RunResult:
            key = (kind, run.name)
            if key not in cache:
                cache[key] = run_on(kind, run, args)
                runs.append(cache[key])
            return cache[key]

        rows: list[Row] = []
        for wl in args.workload_list:
            etcd = result("etcd", wl.etcd) if wl.etcd is not None and args.etcd else None
            ours = result("ours", wl.ours)
            rows.append(Row(wl, ours, etcd))
        meta["duration_s"] = round(time.monotonic() - started, 1)
        failed = [f"{r.run} on {r.server}" for r in runs if not r.ok]
        return finish_report(
            args, markdown(rows, runs, meta), to_json(rows, runs, meta), failed, started, log
        )


if __name__ == "__main__":
    sys.exit(main())
