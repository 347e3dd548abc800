"""The command line every Go-driven benchmark harness shares, and the Go tools it runs.

What it owns: the one argument set of `benchmarks.etcd_tool`, `queue_tool`, `cluster_tool` and
`keyspace_tool` (`add_common_args`, then `resolve_common_args` once parsed: a usage error names
what is missing and how to get it), the choice of workloads from `--workloads`, where etcd's
benchmark tool is found (`--tool`, `$ETCD_BENCHMARK`, /tmp/tools/etcd-benchmark, PATH) and how
our queue driver is built when `--queue-tool` names none (`queue_bench`), SIGTERM unwinding like
Ctrl-C (so every harness stops what it started), the server of a kind the options name
(`new_server`: ours from `--ours-dir`, or the `--etcd` binary), the facts each report opens with
(`run_meta`) and how each ends (`finish_report`: the Markdown and JSON where `--out` and
`--json` say, the Markdown on stdout, the exit status).

| option | meaning |
|---|---|
| `--quick` | small counts: checks the harness, claims nothing |
| `--workloads a,b` | the workloads to run, in that order (all by default) |
| `--tool PATH` | etcd's benchmark tool |
| `--queue-tool PATH` | `tools/queue-bench` (default: built into a temporary directory) |
| `--etcd PATH` | the etcd binary (default: etcd on PATH); `--no-etcd` where a harness can do without |
| `--ours-dir DIR` | run our server from this checkout (a `git clone` of a fixed commit) |
| `--out FILE`, `--json FILE` | where the Markdown report and the JSON go |
| `--timeout S` | the bound on one tool run, after which it is killed by its pid |
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from benchmarks.servers import (
    REPO_ROOT,
    EtcdServer,
    Membership,
    OursServer,
    Server,
    etcd_version,
    git_commit,
    log,
)
from tests.support.shared_tools import shared_tools_dir

DEFAULT_TOOL = Path("/tmp/tools/etcd-benchmark")
BUILD_HINT = (
    f"bash {shared_tools_dir() / 'etcd-benchmark' / 'build.sh'} {DEFAULT_TOOL} "
    "(its sources are found through $QS_SHARED_TOOLS, default ../shared/tools: README, "
    "'Third-party tools')"
)
QUEUE_BENCH_BUILD = REPO_ROOT / "scripts" / "build_queue_bench.sh"
BUILD_TIMEOUT = 600.0

W = TypeVar("W")


def chosen_workloads(p: argparse.ArgumentParser, text: object, by_name: dict[str, W]) -> list[W]:
    """The workloads a comma-separated --workloads names, in its order; a name
    not in `by_name` (or none at all) is a usage error."""
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    unknown = [s for s in names if s not in by_name]
    if unknown or not names:
        p.error(f"unknown workload(s) {unknown}; choose from {','.join(by_name)}")
    return [by_name[s] for s in names]


def add_common_args(
    p: argparse.ArgumentParser,
    quick_timeout: float,
    full_timeout: float,
    *,
    workloads: Sequence[str] | None = None,
    quick_help: str = "small counts: checks the harness, claims nothing",
    etcd_optional: bool = False,
    timeout_help: str = "seconds per tool run before it is killed",
) -> None:
    """Declare the shared options; `workloads` (the names, in their default order) adds
    --workloads, `etcd_optional` adds --no-etcd. `resolve_common_args` checks them."""
    p.add_argument("--quick", action="store_true", help=quick_help)
    if workloads is not None:
        p.add_argument(
            "--workloads",
            default=",".join(workloads),
            help=f"comma-separated, from {','.join(workloads)} (default: all)",
        )
    p.add_argument(
        "--tool",
        default=None,
        help=f"etcd's benchmark tool (default $ETCD_BENCHMARK, {DEFAULT_TOOL}, PATH)",
    )
    p.add_argument(
        "--queue-tool",
        type=Path,
        default=None,
        help="tools/queue-bench, built from this checkout (default: build it into a temporary "
        f"directory with {QUEUE_BENCH_BUILD.relative_to(REPO_ROOT)})",
    )
    p.add_argument("--etcd", default=None, help="the etcd binary (default: etcd on PATH)")
    if etcd_optional:
        p.add_argument("--no-etcd", action="store_true", help="run on our server only")
    p.add_argument(
        "--ours-dir",
        type=Path,
        default=REPO_ROOT,
        help="run our server from this checkout (e.g. a `git clone` of a fixed commit) "
        "instead of this one",
    )
    p.add_argument("--out", type=Path, default=None, help="write the Markdown report here")
    p.add_argument("--json", type=Path, default=None, help="write the JSON results here")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"{timeout_help} (default {quick_timeout:.0f} quick, {full_timeout:.0f} full)",
    )


def resolve_common_args(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    quick_timeout: float,
    full_timeout: float,
    *,
    need_tool: bool = True,
    need_queue_tool: bool = False,
) -> None:
    """Find the tools, etcd and etcdctl, check --ours-dir, default --timeout; a usage error
    (`p.error`) names what is missing and how to get it. `args.etcd` is None after --no-etcd."""
    tool = (
        args.tool
        or os.environ.get("ETCD_BENCHMARK")
        or (str(DEFAULT_TOOL) if DEFAULT_TOOL.exists() else shutil.which("etcd-benchmark"))
    )
    if need_tool and (not tool or not Path(tool).exists()):
        p.error(
            f"etcd benchmark tool not found ({args.tool or DEFAULT_TOOL}); build it: {BUILD_HINT}"
        )
    args.tool = tool
    if need_queue_tool:
        if args.queue_tool is not None and not args.queue_tool.exists():
            p.error(
                f"no queue driver at {args.queue_tool}; build one: bash {QUEUE_BENCH_BUILD} OUT"
            )
        if args.queue_tool is None and shutil.which("go") is None:
            p.error(
                "no go on PATH to build tools/queue-bench (apt-get install golang-go), and no "
                "--queue-tool"
            )
    if getattr(args, "no_etcd", False):
        args.etcd = None
    else:
        args.etcd = args.etcd or shutil.which("etcd")
        if not args.etcd:
            hint = ", or --no-etcd" if hasattr(args, "no_etcd") else ""
            p.error(f"no etcd binary (apt-get install etcd-server, or --etcd PATH{hint})")
    args.etcdctl = shutil.which("etcdctl")
    if not args.etcdctl:
        p.error("no etcdctl on PATH (apt-get install etcd-client): it checks server readiness")
    args.ours_dir = Path(args.ours_dir).resolve()
    if not (args.ours_dir / "queue_server" / "cli.py").exists():
        p.error(f"no queue_server/cli.py in --ours-dir {args.ours_dir}")
    if args.timeout is None:
        args.timeout = quick_timeout if args.quick else full_timeout


def build_queue_bench(out_dir: Path) -> Path:
    """Build tools/queue-bench from this checkout into `out_dir` (scripts/build_queue_bench.sh)."""
    out = out_dir / "queue-bench"
    log(f"building the queue driver: {QUEUE_BENCH_BUILD} {out}")
    r = subprocess.run(
        ["bash", str(QUEUE_BENCH_BUILD), str(out)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"building the queue driver failed ({r.returncode}): {r.stderr[-2000:]}")
    return out


@contextlib.contextmanager
def queue_bench(args: argparse.Namespace, needed: bool = True) -> Iterator[None]:
    """While inside, `args.queue_tool` is a built driver: the one given, or one built here from
    this checkout (an older build may lack flags the harness passes) and removed afterwards."""
    build_dir: Path | None = None
    if needed and args.queue_tool is None:
        build_dir = Path(tempfile.mkdtemp(prefix="queue-bench-build-"))
        args.queue_tool = build_queue_bench(build_dir)
    try:
        yield
    finally:
        if build_dir is not None:
            shutil.rmtree(build_dir, ignore_errors=True)


def go_version() -> str:
    try:
        r = subprocess.run(
            ["go", "version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return r.stdout.strip().removeprefix("go version ") or "?"


def stop_on_sigterm(signum: int, _frame: object) -> NoReturn:
    """A SIGTERM handler: unwind like Ctrl-C, so the `finally` blocks stop every process the
    harness started, by its pid."""
    raise KeyboardInterrupt(f"signal {signum}")


def run_meta(args: argparse.Namespace) -> dict[str, Any]:
    """What every report says first: when, in which mode, on what, against which etcd, our
    server from which checkout and commit."""
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "mode": "quick" if args.quick else "full",
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "etcd_version": etcd_version(args.etcd) if args.etcd else "not run",
        "etcd": args.etcd,
        "commit": git_commit(args.ours_dir),
        "ours_dir": str(args.ours_dir),
        "python": sys.version.split()[0],
    }


def new_server(
    kind: str, work_dir: Path, args: argparse.Namespace, membership: Membership | None = None
) -> Server:
    """A server of `kind` ("ours" from `--ours-dir`, or "etcd", the `--etcd` binary), data in
    `work_dir`, not started; alone, or a member of a cluster with `membership`."""
    if kind == "ours":
        return OursServer(work_dir, args.etcdctl, None, args.ours_dir, membership)
    return EtcdServer(work_dir, args.etcdctl, args.etcd, membership)


def finish_report(
    args: argparse.Namespace,
    markdown: str,
    doc: dict[str, Any],
    failed: Sequence[str],
    started: float,
    log: Callable[[str], None],
) -> int:
    """End a harness run: the Markdown to `--out` and `doc` as JSON to `--json` (when given),
    the Markdown on stdout; the exit status, 1 when anything in `failed` (named) failed."""
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown)
        log(f"wrote {args.out}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        log(f"wrote {args.json}")
    print(markdown)
    if failed:
        log(f"FAILED: {', '.join(failed)}")
        return 1
    log(f"done in {time.monotonic() - started:.0f}s")
    return 0
