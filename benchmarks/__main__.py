"""The command: ``python -m benchmarks [--quick] [--suite NAME,...] [--json OUT]
[--out-dir DIR]``.

Parses the options, runs the suites (see runner), prints the table on stdout and
writes results.json, results.md and one PNG per suite into the out dir (plus the
JSON to --json OUT when given). Exit status: 0 when every workload ran or was
unavailable (not implemented, placeholder, etcd absent); 1 when any failed; 2 on a
usage error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from benchmarks.report import (
    machine_info,
    markdown_table,
    print_table,
    results_document,
    write_charts,
    write_json,
)
from benchmarks.runner import Progress, Runner, RunOptions
from benchmarks.servers import etcd_binary, etcd_version
from benchmarks.workloads import SUITES, Budget


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark our server against a real etcd on loopback.",
    )
    p.add_argument("--quick", action="store_true", help="small counts, short time bounds (CI)")
    p.add_argument(
        "--suite",
        default=",".join(SUITES),
        help=f"comma-separated suites to run (default: all: {','.join(SUITES)})",
    )
    p.add_argument("--json", type=Path, help="also write the JSON results to this file")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=Path("bench-results"),
        help="where results.json, results.md, charts and server logs go (default: bench-results/)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=2,
        help="client processes for workloads with many requests in flight (default: 2)",
    )
    p.add_argument("--etcd", default=None, help="etcd binary (default: etcd on PATH)")
    p.add_argument("--no-etcd", action="store_true", help="do not run etcd (its column is null)")
    p.add_argument("--list", action="store_true", help="list suites and workloads, then exit")
    return p.parse_args(argv)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Unwind through the finally blocks, which stop the servers we started.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, workloads in SUITES.items():
            print(name)
            for w in workloads:
                print(f"  {w.name}: {w.about}")
        return 0
    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    unknown = [s for s in suites if s not in SUITES]
    if unknown or not suites:
        print(
            f"unknown suite(s): {', '.join(unknown) or '(none given)'}; known: {', '.join(SUITES)}",
            file=sys.stderr,
        )
        return 2
    if args.client_procs < 1:
        print("--client-procs must be at least 1", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)

    etcd = None if args.no_etcd else etcd_binary(args.etcd)
    budget = Budget.quick_mode() if args.quick else Budget.full()
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    machine = machine_info(etcd)
    progress.line(
        f"{'quick' if args.quick else 'full'} run of {','.join(suites)}; "
        f"etcd: {machine['etcd_version'] or 'not installed'}; out dir: {out_dir}"
    )
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    options = RunOptions(
        suites=suites,
        budget=budget,
        out_dir=out_dir,
        client_procs=args.client_procs,
        etcd_binary=etcd,
    )
    rows = Runner(options, progress).run()
    duration = time.monotonic() - t0

    document = results_document(
        rows,
        machine,
        {
            "mode": "quick" if args.quick else "full",
            "suites": suites,
            "started_at": started.isoformat(timespec="seconds"),
            "duration_s": round(duration, 1),
            "budget": {
                "seconds_per_workload": budget.seconds,
                "warmup_seconds": budget.warmup_seconds,
                "drain_seconds": budget.drain_seconds,
                "client_procs": args.client_procs,
            },
        },
    )
    write_json(out_dir / "results.json", document)
    if args.json:
        write_json(args.json, document)
    (out_dir / "results.md").write_text(markdown_table(rows))
    version = etcd_version(etcd)
    charts = write_charts(
        rows,
        out_dir,
        title_suffix=f" {version}" if version else " (etcd not installed)",
    )

    print_table(rows, sys.stdout)
    failures = sum(row.failures() for row in rows)
    progress.line(
        f"done in {duration:.0f}s: {len(rows)} rows, {failures} failed; "
        f"wrote {out_dir / 'results.json'}, {len(charts)} charts"
        + (f", {args.json}" if args.json else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
