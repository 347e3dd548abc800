"""Everything a run leaves behind: machine facts, the text table, JSON, Markdown and
one PNG chart per suite (matplotlib, Agg backend, no display needed).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, TextIO

import grpc

from benchmarks.loadgen import uses_uvloop
from benchmarks.results import Measurement, Row, ops_text
from benchmarks.servers import REPO_ROOT, etcd_version


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def _filesystem_of(path: str) -> str | None:
    """Type of the filesystem holding `path` (where the servers keep their data:
    fsync on tmpfs is free, on a disk it is not)."""
    import psutil  # type: ignore[import-untyped,unused-ignore]

    real = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for part in psutil.disk_partitions(all=True):
        mount = str(part.mountpoint)
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and (
            best is None or len(mount) > best[0]
        ):
            best = (len(mount), str(part.fstype))
    return best[1] if best else None


def machine_info(etcd_binary: str | None) -> dict[str, Any]:
    import psutil  # type: ignore[import-untyped,unused-ignore]

    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "os": platform.platform(),
        "etcd_version": etcd_version(etcd_binary),
        "grpcio": grpc.__version__,
        "client_event_loop": "uvloop" if uses_uvloop() else "asyncio",
        "data_dir_filesystem": _filesystem_of(tempfile.gettempdir()),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "commit": _git_commit(),
    }


# -- JSON -------------------------------------------------------------------------


def results_document(
    rows: list[Row], machine: dict[str, Any], meta: dict[str, Any]
) -> dict[str, Any]:
    return {"machine": machine, **meta, "rows": [row.to_json() for row in rows]}


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


# -- text table -------------------------------------------------------------------


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def print_table(rows: list[Row], out: TextIO) -> None:
    """One line per workload and server; the ratio ours/etcd on the `ours` line."""
    headers = [
        "suite",
        "workload",
        "server",
        "ops/s",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "cpu s",
        "rss MB",
        "cli cpu s",
        "ours/etcd",
    ]
    lines: list[list[str]] = []
    notes: list[str] = []
    for row in rows:
        for kind, outcome in (("ours", row.ours), ("etcd", row.etcd)):
            first = kind == "ours"
            cells = [row.suite if first else "", row.workload if first else "", kind]
            if isinstance(outcome, Measurement):
                cells += [
                    ops_text(outcome.ops_s),
                    _num(outcome.p50_ms),
                    _num(outcome.p99_ms),
                    _num(outcome.p999_ms),
                    _num(outcome.cpu_s, "{:.1f}"),
                    _num(outcome.rss_mb, "{:.0f}"),
                    _num(outcome.client_cpu_s, "{:.1f}"),
                ]
            else:
                cells += ["n/a", "", "", "", "", "", ""]
            cells.append(_num(row.ratio_ops) if first else "")
            lines.append(cells)
        note = row.note()
        if note:
            notes.append(f"{row.suite} / {row.workload}: {note}")
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    right = {3, 4, 5, 6, 7, 8, 9, 10}

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ).rstrip()

    print(fmt(headers), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for line in lines:
        print(fmt(line), file=out)
    if notes:
        print("\nnotes:", file=out)
        for n in notes:
            print(f"  {n}", file=out)


# -- Markdown ---------------------------------------------------------------------


def _lat(m: Measurement) -> str:
    return f"{_num(m.p50_ms)} / {_num(m.p99_ms)} / {_num(m.p999_ms)}"


def markdown_table(rows: list[Row]) -> str:
    """The table docs/benchmarks.md shows (one line per workload)."""
    out = [
        "| suite | workload | ours ops/s | etcd ops/s | ours/etcd | ours p50 / p99 / p99.9 ms "
        "| etcd p50 / p99 / p99.9 ms | server cpu s (ours / etcd) | peak RSS MB (ours / etcd) "
        "| client cpu s (ours / etcd) | note |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for row in rows:
        o = row.ours if isinstance(row.ours, Measurement) else None
        e = row.etcd if isinstance(row.etcd, Measurement) else None

        def pair(a: float | None, b: float | None, fmt: str) -> str:
            return f"{_num(a, fmt)} / {_num(b, fmt)}"

        out.append(
            "| "
            + " | ".join(
                [
                    row.suite,
                    row.workload,
                    ops_text(o.ops_s) if o else "n/a",
                    ops_text(e.ops_s) if e else "n/a",
                    _num(row.ratio_ops),
                    _lat(o) if o else "n/a",
                    _lat(e) if e else "n/a",
                    pair(o.cpu_s if o else None, e.cpu_s if e else None, "{:.1f}"),
                    pair(o.rss_mb if o else None, e.rss_mb if e else None, "{:.0f}"),
                    pair(o.client_cpu_s if o else None, e.client_cpu_s if e else None, "{:.1f}"),
                    (row.note() or "").replace("|", "/"),
                ]
            )
            + " |"
        )
    return "\n".join(out) + "\n"


# -- charts -----------------------------------------------------------------------

OURS_COLOR = "#1f77b4"
ETCD_COLOR = "#ff7f0e"


def write_charts(rows: list[Row], out_dir: Path, title_suffix: str = "") -> list[Path]:
    """One PNG per suite: throughput (left) and latency p99 with p50 marks (right),
    ours and etcd side by side for each workload. A suite without any measurement
    (a placeholder) gets a small image that says why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    suites: dict[str, list[Row]] = {}
    for row in rows:
        suites.setdefault(row.suite, []).append(row)
    written: list[Path] = []
    for suite, suite_rows in suites.items():
        path = out_dir / f"{suite}.png"
        written.append(path)
        if not any(isinstance(m, Measurement) for r in suite_rows for m in (r.ours, r.etcd)):
            fig = plt.figure(figsize=(8, 1.2 + 0.3 * len(suite_rows)))
            lines = [f"{suite}: no measurements"] + [
                f"{r.workload}: {r.note() or 'n/a'}" for r in suite_rows
            ]
            fig.text(0.02, 0.9, "\n".join(lines), va="top", fontsize=9, family="monospace")
            fig.savefig(path, dpi=100)
            plt.close(fig)
            continue
        n = len(suite_rows)
        fig, (ax_ops, ax_lat) = plt.subplots(
            1, 2, figsize=(12, 1.9 + 0.75 * n), gridspec_kw={"width_ratios": [1, 1]}
        )
        fig.suptitle(f"{suite}: ours vs etcd{title_suffix}", fontsize=11, x=0.02, ha="left")
        labels = [r.workload for r in suite_rows]
        ys = list(range(n))
        h = 0.38
        for offset, kind, color in ((-h / 2, "ours", OURS_COLOR), (h / 2, "etcd", ETCD_COLOR)):
            ops: list[float] = []
            p99: list[float] = []
            p50: list[float | None] = []
            for r in suite_rows:
                m = r.ours if kind == "ours" else r.etcd
                if isinstance(m, Measurement):
                    ops.append(m.ops_s)
                    p99.append(m.p99_ms or 0.0)
                    p50.append(m.p50_ms)
                else:
                    ops.append(0.0)
                    p99.append(0.0)
                    p50.append(None)
            pos = [y + offset for y in ys]
            ax_ops.barh(pos, ops, height=h, color=color, label=kind)
            ax_lat.barh(pos, p99, height=h, color=color, label=kind)
            marks = [(v, y) for v, y in zip(p50, pos, strict=True) if v is not None]
            if marks:
                ax_lat.plot(
                    [v for v, _ in marks],
                    [y for _, y in marks],
                    "k|",
                    markersize=10,
                    label="p50" if kind == "ours" else None,
                )
            for y, v, r in zip(pos, ops, suite_rows, strict=True):
                m = r.ours if kind == "ours" else r.etcd
                if not isinstance(m, Measurement):
                    ax_ops.text(0, y, f" {kind}: n/a", va="center", fontsize=7, color="gray")
                else:
                    ax_ops.text(v, y, f" {ops_text(v)}", va="center", fontsize=7)
        for ax in (ax_ops, ax_lat):
            ax.set_yticks(ys)
            ax.set_yticklabels(labels, fontsize=8)
            ax.invert_yaxis()
            ax.grid(axis="x", alpha=0.3)
        ax_lat.set_yticklabels([])
        ax_ops.set_xlabel("throughput (ops/s; events/s for watch, msgs/s for queue)", fontsize=9)
        ax_ops.margins(x=0.18)
        latencies = [
            v
            for r in suite_rows
            for m in (r.ours, r.etcd)
            if isinstance(m, Measurement)
            for v in (m.p50_ms, m.p99_ms)
            if v
        ]
        if latencies and max(latencies) / min(latencies) > 30:
            ax_lat.set_xscale("log")
            ax_lat.set_xlabel("latency ms, log scale (bar: p99, tick: p50)", fontsize=9)
        else:
            ax_lat.set_xlabel("latency ms (bar: p99, tick: p50)", fontsize=9)
        handles, names = ax_lat.get_legend_handles_labels()
        fig.legend(
            handles,
            names,
            loc="upper right",
            bbox_to_anchor=(0.98, 1.0),
            ncol=3,
            fontsize=8,
            frameon=False,
        )
        fig.tight_layout(rect=(0, 0, 1, 0.94))
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return written
