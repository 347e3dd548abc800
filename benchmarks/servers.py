"""The servers under test: start/stop our server and etcd, measure them via psutil.

Each server listens on a free 127.0.0.1 port, keeps its data in a fresh temporary
directory, logs to a file, and is stopped by its own pid (SIGTERM, then SIGKILL if
it does not exit). Readiness is awaited by calling Maintenance.Status until it
answers, bounded in time. `ResourceMonitor` samples the server's CPU time and RSS
(including any child processes) during a workload's timed window.

This module stands alone on purpose (the harness does not import tests/): the
free-port and readiness logic is a small copy of tests/support/processes.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

import grpc
import psutil  # type: ignore[import-untyped,unused-ignore]

from etcdserverpb import rpc_pb2, rpc_pb2_grpc

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    endpoint: str, proc: subprocess.Popen[bytes], timeout: float = READY_TIMEOUT
) -> None:
    """Block until the server at `endpoint` answers Status; raise if it exits or
    does not answer within `timeout`."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before it was ready")
        with grpc.insecure_channel(endpoint) as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=1.0)
                rpc_pb2_grpc.MaintenanceStub(ch).Status(rpc_pb2.StatusRequest(), timeout=2.0)
                return
            except (grpc.FutureTimeoutError, grpc.RpcError) as e:
                last = e
                time.sleep(0.05)
    raise TimeoutError(f"not ready after {timeout:.0f}s: {last}")


def etcd_binary(explicit: str | None = None) -> str | None:
    """The etcd binary to compare against: `explicit`, else `etcd` on PATH."""
    if explicit:
        return explicit if Path(explicit).exists() else shutil.which(explicit)
    return shutil.which("etcd")


def etcd_version(binary: str | None) -> str | None:
    if not binary:
        return None
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        if line.lower().startswith("etcd version:"):
            return line.split(":", 1)[1].strip()
    return out.strip().splitlines()[0] if out.strip() else None


class BenchServer(ABC):
    """One server process under test."""

    kind: str  # "ours" or "etcd"

    def __init__(self, data_dir: Path, log_path: Path) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.kind} server not started")
        return self.proc.pid

    @abstractmethod
    def command(self) -> list[str]: ...

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                env=os.environ.copy(),
            )
        try:
            wait_ready(self.endpoint, self.proc)
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        """SIGTERM our process by pid, wait, SIGKILL if it hangs."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class OursServer(BenchServer):
    """Our server, `python -m queue_server.cli`, with its default settings."""

    kind = "ours"

    def command(self) -> list[str]:
        url = f"http://{self.endpoint}"
        return [
            sys.executable,
            "-m",
            "queue_server.cli",
            "--name",
            "bench",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
        ]


class EtcdServer(BenchServer):
    """A real single-member etcd with its default settings, on loopback URLs."""

    kind = "etcd"

    def __init__(self, data_dir: Path, log_path: Path, binary: str) -> None:
        super().__init__(data_dir, log_path)
        self.binary = binary
        self.peer_port = free_port()

    def command(self) -> list[str]:
        url = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name",
            "bench",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"bench={peer}",
        ]


class ResourceMonitor:
    """CPU seconds and peak RSS of a server process (and its children) over a window.

    `start()` snapshots the CPU times and starts a sampling thread for RSS;
    `stop()` returns (CPU seconds spent since start, peak RSS in MB).
    """

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self._cpu0 = 0.0
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def _cpu(self) -> float:
        total = 0.0
        for p in self._processes():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += float(t.user + t.system)
        return total

    def _rss(self) -> int:
        total = 0
        for p in self._processes():
            with contextlib.suppress(psutil.Error):
                total += int(p.memory_info().rss)
        return total

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, self._rss())

    def start(self) -> None:
        self._cpu0 = self._cpu()
        self._peak = self._rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._peak = max(self._peak, self._rss())
        return max(self._cpu() - self._cpu0, 0.0), self._peak / (1024 * 1024)
