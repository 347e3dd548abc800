"""Plain KV through a front, against straight to etcd and through etcd's own grpc-proxy.

Run it with::

    python -m benchmarks.front_tool [--quick] [--workloads put64,range64] [--tool PATH] \\
        [--etcd PATH] [--members 1|3] [--out FILE.md] [--json FILE] [--timeout SECONDS]

What it owns: for each workload and each path (`etcd`: the tool straight to etcd; `front`: the
tool to our server run as `--backend-endpoints` over that etcd; `grpc-proxy`: the tool to
`etcd grpc-proxy start` over it) it starts a fresh etcd (one member, or with `--members 3` a
3-member cluster) in a new temporary directory, the front or proxy if the path has one, runs
etcd's benchmark tool with the same flags as `benchmarks.etcd_tool`'s workload of that name,
and stops each process by its pid. It reads the CPU time of etcd and of the front or proxy
separately over the run, and writes a Markdown table (requests/s, ratio to straight-to-etcd,
p50/p99, CPU per request of each process) and JSON. The paths run one after another, never at
the same time.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.cluster_tool import CLUSTER_SIZE, Cluster
from benchmarks.etcd_tool import (
    FULL_RUN_TIMEOUT,
    QUICK_RUN_TIMEOUT,
    WORKLOADS_BY_NAME,
    RunResult,
    Workload,
    run_tool_on,
)
from benchmarks.options import (
    add_common_args,
    chosen_workloads,
    finish_report,
    resolve_common_args,
    run_meta,
    stop_on_sigterm,
)
from benchmarks.servers import (
    EtcdServer,
    OursServer,
    Server,
    disturbed_note,
    free_port,
    log,
    process_tree_cpu,
)

PATHS = ("etcd", "front", "grpc-proxy")
DEFAULT_WORKLOADS = ("put64", "range64")


class FrontServer(OursServer):
    """Our server as a front over `backend` (no data dir of its own; `work_dir`, made here if
    need be, holds its log)."""

    def __init__(self, work_dir: Path, etcdctl: str, backend: str) -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(work_dir, etcdctl, None)
        self.kind = "front"
        self.log_path = work_dir / "front.log"
        self.backend = backend

    def leader_seen(self, members: list[Server]) -> str:
        """The member the front's log last says its unary calls went to (front/leader.py)."""
        said = "the backend's leader address="
        lines = self.log_path.read_text(errors="replace").splitlines()
        moves = [line.split(said, 1)[1].split()[0] for line in lines if said in line]
        if not moves:
            return "the first endpoint (the front never moved them)"
        return next((member_name(m) for m in members if m.endpoint == moves[-1]), moves[-1])

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "queue_server.cli",
            "--backend-endpoints",
            self.backend,
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
        ]


class GrpcProxyServer(Server):
    """`etcd grpc-proxy start` over `backend`, as etcd ships it."""

    def __init__(self, work_dir: Path, etcdctl: str, binary: str, backend: str) -> None:
        super().__init__("grpc-proxy", work_dir, etcdctl)
        self.binary = binary
        self.backend = backend
        self.metrics_port = free_port()

    def command(self) -> list[str]:
        return [
            self.binary,
            "grpc-proxy",
            "start",
            f"--endpoints={self.backend}",
            f"--listen-addr={self.endpoint}",
            f"--metrics-addr=http://127.0.0.1:{self.metrics_port}",
        ]


def run_path(
    path: str, wl: Workload, n: int, args: argparse.Namespace, work_dir: Path
) -> tuple[RunResult, float | None]:
    """One measured run on a fresh etcd of `args.members`; (result, etcd's CPU seconds over
    the run, every member's summed). With 3 members every path is given all three: the tool's
    endpoints straight, the front's `--backend-endpoints` (a follower first), the proxy's
    `--endpoints`."""
    root = work_dir / path
    root.mkdir(parents=True, exist_ok=True)
    members: list[Server]
    cluster: Cluster | None = None
    if args.members == 1:
        members = [EtcdServer(root, args.etcdctl, args.etcd)]
    else:
        cluster = Cluster("etcd", root, args)
        members = cluster.members
    middle: Server | None = None
    leader_note = ""
    try:
        if cluster is None:
            members[0].start()
        else:
            leader = cluster.start()
            # A follower first: the front has to find the leader itself (front/leader.py);
            # puts through a follower would cost etcd a hop to the leader each (the proxy
            # spreads its calls over the members anyway).
            members = [m for m in members if m is not leader] + [leader]
            leader_note = (
                f"etcd's leader is {member_name(leader)}; {member_name(members[0])}, a "
                "follower, is the first endpoint"
            )
        backend = ",".join(m.url for m in members)
        if path == "front":
            middle = FrontServer(root / "front", args.etcdctl, backend)
        elif path == "grpc-proxy":
            middle = GrpcProxyServer(root, args.etcdctl, args.etcd, backend)
        if middle is not None:
            middle.start()
        measured = [middle] if middle is not None else members
        endpoints = ",".join(s.endpoint for s in measured)
        log(f"  {path}: serving on {endpoints} (pid {', '.join(str(s.pid) for s in measured)})")
        wl.set_up(measured[0])

        def etcd_cpu_now() -> float:
            return sum(process_tree_cpu(m.pid) for m in members)

        etcd_cpu0 = etcd_cpu_now()
        res = run_tool_on(args.tool, measured, endpoints, wl, n, args.timeout, work_dir)
        etcd_cpu = etcd_cpu_now() - etcd_cpu0
        res.server = path
        if middle is not None:  # etcd is not a disturbance behind a middle: it is measured
            res.notes = [n for n in res.notes if not n.startswith("other processes")]
            other = None if res.other_cpu_s is None else res.other_cpu_s - etcd_cpu
            if note := disturbed_note(other, res.wall_s):
                res.notes.append(note)
        if leader_note:
            if isinstance(middle, FrontServer):
                leader_note += f"; the front's unary calls went to {middle.leader_seen(members)}"
            res.notes.append(leader_note)
        return res, etcd_cpu
    except Exception as e:
        return RunResult(server=path, workload=wl.name, command=[], ok=False, error=str(e)), None
    finally:
        if middle is not None:
            middle.stop()
        if cluster is None:
            members[0].stop()
        else:
            cluster.stop()


def member_name(member: Server) -> str:
    return member.work_dir.name.removeprefix("etcd-")


def _per_request_us(cpu: float | None, res: RunResult) -> str:
    if cpu is None or not res.report.requests:
        return "—"
    return f"{cpu * 1e6 / res.report.requests:,.0f}"


def _cores_busy(res: RunResult) -> str:
    """The machine's busy CPU over the run (the measured server, the tool, and everything
    else, etcd behind a front or proxy among it) over the run's wall time."""
    parts = (res.server_cpu_s, res.tool_cpu_s, res.other_cpu_s)
    if None in parts or not res.wall_s:
        return "—"
    return f"{sum(p or 0.0 for p in parts) / res.wall_s:.2f}"


def markdown(
    rows: list[tuple[Workload, int, dict[str, tuple[RunResult, float | None]]]],
    meta: dict[str, Any],
) -> str:
    out = [
        "# Plain KV through a front, straight to etcd, and through etcd's grpc-proxy",
        "",
        f"- commit {meta.get('commit')}, etcd {meta.get('etcd_version')}, {meta.get('date')}",
        f"- tool: etcd's benchmark ({meta.get('tool')}), {meta.get('mode')} counts",
        f"- etcd: {meta.get('members')} member(s); with 3, every path is given all three "
        "(the tool's endpoints, the front's backend, a follower first, the proxy's "
        "endpoints), and `etcd` is the three members' CPU together",
        "- CPU per request, in µs: of the front or proxy (`middle`), of etcd, of the load",
        "  generator (`tool`), and of the three together (`all`); `cores busy` is the machine's",
        "  busy CPU over the run (every process) over its wall time. Where the cores are all",
        "  busy, requests/s follow `all`: a path's ratio is about straight's `all` over its own.",
        "",
        "| workload | path | req/s | vs straight | p50 ms | p99 ms "
        "| middle µs/req | etcd µs/req | tool µs/req | all µs/req | cores busy |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for wl, _, results in rows:
        straight = results["etcd"][0].report.rps
        for path in PATHS:
            res, etcd_cpu = results[path]
            if not res.ok or res.report.rps is None:
                out.append(f"| {wl.name} | {path} | failed: {res.error} | | | | | | | | |")
                continue
            ratio = f"{res.report.rps / straight:.2f}x" if straight else "—"
            p = res.report.percentiles_ms
            middle_cpu = None if path == "etcd" else res.server_cpu_s
            etcd_cpu_s = res.server_cpu_s if path == "etcd" else etcd_cpu
            parts = [middle_cpu or 0.0, etcd_cpu_s, res.tool_cpu_s]
            together = None if None in parts else sum(c or 0.0 for c in parts)
            middle = "—" if path == "etcd" else _per_request_us(middle_cpu, res)
            out.append(
                f"| {wl.name} | {path} | {res.report.rps:,.0f} | {ratio} | "
                f"{p.get('50', 0):.2f} | {p.get('99', 0):.2f} | {middle} | "
                f"{_per_request_us(etcd_cpu_s, res)} | {_per_request_us(res.tool_cpu_s, res)} | "
                f"{_per_request_us(together, res)} | {_cores_busy(res)} |"
            )
    notes = [
        f"- {wl.name}, {path}: {note}"
        for wl, _, results in rows
        for path in PATHS
        for note in results[path][0].notes
    ]
    if notes:
        out += ["", *notes]
    return "\n".join(out) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.front_tool",
        description="KV through a front vs straight to etcd vs grpc-proxy, with etcd's tool.",
    )
    add_common_args(p, QUICK_RUN_TIMEOUT, FULL_RUN_TIMEOUT, workloads=list(WORKLOADS_BY_NAME))
    p.add_argument(
        "--members",
        type=int,
        choices=(1, CLUSTER_SIZE),
        default=1,
        help=f"etcd members under every path: 1, or {CLUSTER_SIZE} (a cluster, as fronts are "
        "meant to serve)",
    )
    args = p.parse_args(argv)
    if args.workloads == ",".join(WORKLOADS_BY_NAME):
        args.workloads = ",".join(DEFAULT_WORKLOADS)
    args.workload_list = chosen_workloads(p, args.workloads, WORKLOADS_BY_NAME)
    resolve_common_args(p, args, QUICK_RUN_TIMEOUT, FULL_RUN_TIMEOUT)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    meta = run_meta(args)
    meta["tool"] = args.tool
    meta["mode"] = "quick" if args.quick else "full"
    meta["members"] = args.members
    started = time.monotonic()
    rows = []
    failed: list[str] = []
    for wl in args.workload_list:
        n = wl.quick if args.quick else wl.full
        work_dir = Path(tempfile.mkdtemp(prefix=f"front-tool-{wl.name}-"))
        log(f"{wl.name}: {n:,} ({meta['mode']}) in {work_dir}")
        results = {}
        for path in PATHS:
            res, etcd_cpu = run_path(path, wl, n, args, work_dir)
            results[path] = (res, etcd_cpu)
            if res.ok and res.report.rps is not None:
                log(f"  {path}: {res.report.rps:,.0f} req/s, CPU {res.server_cpu_s:.2f}s")
            else:
                failed.append(f"{wl.name} on {path}")
                log(f"  {path}: FAILED: {res.error}")
        rows.append((wl, n, results))
        if not failed:
            shutil.rmtree(work_dir, ignore_errors=True)
    payload = {
        "meta": meta,
        "rows": [
            {
                "workload": wl.name,
                "total": n,
                "paths": {
                    path: {"result": asdict(res), "etcd_cpu_s": cpu}
                    for path, (res, cpu) in results.items()
                },
            }
            for wl, n, results in rows
        ],
    }
    return finish_report(args, markdown(rows, meta), payload, failed, started, log)


if __name__ == "__main__":
    sys.exit(main())
