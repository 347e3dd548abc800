"""One run of a Go tool against servers under test, and what tools/queue-bench answers.

What it owns: running a tool process once (`run_measured`): its output to the files given,
bounded by a timeout past which (or on Ctrl-C or SIGTERM) it is killed by its pid, with the
wall time, the servers' CPU (a callable, so one server, the members of a cluster, or a front
and its backend can be counted), the tool's own CPU and the CPU other processes used over the
run; and reading the one JSON object queue-bench prints (`driver_answer`), a failure named
when there is none, it was killed, or it reports one.

`benchmarks.etcd_tool`, `queue_tool`, `cluster_tool` and `front_queue_tool` use it. It needs
only the standard library and `benchmarks.servers`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks.servers import STOP_TIMEOUT, children_cpu, machine_busy_cpu


@dataclass(frozen=True)
class Measured:
    """A finished tool run: its exit code (None when it was killed past its bound) and the
    CPU seconds over it."""

    rc: int | None
    wall_s: float
    server_cpu_s: float
    tool_cpu_s: float
    other_cpu_s: float
    """Busy CPU of the whole machine over the run minus the servers' and the tool's."""


def run_measured(
    cmd: Sequence[str],
    stdout: IO[bytes],
    stderr: IO[bytes] | None,
    timeout: float,
    servers_cpu: Callable[[], float],
) -> Measured:
    """Run `cmd` once (stderr None: the tool's stderr goes to ours), at most `timeout`
    seconds; past that, or when this process is being stopped, the tool is killed by its pid."""
    tool0, busy0, srv0 = children_cpu(), machine_busy_cpu(), servers_cpu()
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    rc: int | None = None
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:  # timed out, or we are being stopped: end it by its pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_TIMEOUT)
    wall = time.monotonic() - t0
    server_cpu = servers_cpu() - srv0
    tool_cpu = children_cpu() - tool0
    other = max(machine_busy_cpu() - busy0 - server_cpu - tool_cpu, 0.0)
    return Measured(rc, wall, server_cpu, tool_cpu, other)


def driver_answer(out_path: Path, run: Measured) -> tuple[dict[str, Any] | None, str | None]:
    """queue-bench's JSON object (its last line of stdout, in `out_path`) and the failure of
    the run, None when it succeeded: killed past its bounds, no JSON, or a failure it reports."""
    text = out_path.read_text(errors="replace").strip()
    driver: dict[str, Any] | None = None
    error: str | None = None
    if text:
        try:
            driver = json.loads(text.splitlines()[-1])
        except json.JSONDecodeError as e:
            error = f"the driver's output is not JSON ({e}): {text[-300:]}"
    if run.rc is None:
        return driver, f"the driver was killed after {run.wall_s:.0f}s (past its own bounds)"
    if driver is None:
        return None, error or f"the driver exited with code {run.rc} and no JSON output"
    if run.rc != 0 or not driver.get("ok"):
        return driver, "; ".join(str(f) for f in driver.get("failures") or [f"exit code {run.rc}"])
    return driver, None
