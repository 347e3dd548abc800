"""The servers under test: start/stop our server and etcd, measure them via psutil.

Each server listens on a free 127.0.0.1 port, keeps its data in a fresh temporary
directory, logs to a file, and is stopped by its own pid (SIGTERM, then SIGKILL if
it does not exit). Readiness is awaited by calling Maintenance.Status until it
answers, bounded in time. `ResourceMonitor` samples the server's CPU time and RSS
(including any child processes) during a workload's timed window.

A `Target` is what a suite's workloads run against: one `BenchServer` process, or
a `BenchCluster` of members of one kind started together with one
--initial-cluster on loopback peer ports (the cluster suite). A cluster is ready
when every member answers Status and all of them name the same leader.

This module stands alone on purpose (the harness does not import tests/): the
free-port and readiness logic is a small copy of tests/support/processes.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil  # type: ignore[import-untyped,unused-ignore]

from benchmarks.etcd_tool import free_port
from etcdserverpb import rpc_pb2, rpc_pb2_grpc

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
LEADER_TIMEOUT = 30.0
"""How long a cluster may take to agree on one leader."""
CLUSTER_TOKEN = "bench"
REPO_ROOT = Path(__file__).resolve().parents[1]


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


class Target(ABC):
    """What a suite's workloads run against: one server process, or a cluster."""

    kind: str  # "ours" or "etcd"

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """host:port a client connects to (for a cluster: one of its live members)."""

    @property
    @abstractmethod
    def pid(self) -> int: ...

    @property
    def pids(self) -> list[int]:
        """Every process whose CPU and RSS count as the server's."""
        return [self.pid]

    def describe(self) -> str:
        """Where it listens and its pid(s), for progress lines."""
        return f"{self.endpoint} (pid {self.pid})"

    def pid_text(self) -> str:
        pids = self.pids
        return f"pid {pids[0]}" if len(pids) == 1 else f"pids {', '.join(map(str, pids))}"

    def start(self) -> None:
        self.launch()
        self.await_ready()

    @abstractmethod
    def launch(self) -> None:
        """Start the process(es), without waiting until they answer."""

    @abstractmethod
    def await_ready(self) -> None:
        """Wait (bounded) until it serves; stop what was launched and raise if not."""

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def exit_code(self) -> int | None: ...

    @abstractmethod
    def log_tail(self, lines: int = 20) -> str: ...


class BenchServer(Target):
    """One server process under test."""

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

    def launch(self) -> None:
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

    def await_ready(self) -> None:
        if self.proc is None:
            raise RuntimeError(f"{self.kind} server not launched")
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

    def kill(self) -> None:
        """SIGKILL our process by pid (a crash, as the failover workload wants it)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.kill()
        self.proc.wait(timeout=STOP_TIMEOUT)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class Membership:
    """A member's place in a cluster bootstrapped with one --initial-cluster."""

    name: str
    peer_port: int
    initial_cluster: str
    """name=http://127.0.0.1:port,... of every member."""

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def flags(self) -> list[str]:
        """The peer flags, the same for our server and etcd."""
        return [
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self.initial_cluster,
            "--initial-cluster-token",
            CLUSTER_TOKEN,
            "--initial-cluster-state",
            "new",
        ]


class OursServer(BenchServer):
    """Our server, `python -m queue_server.cli`, with its default settings (alone,
    or as a member of a cluster)."""

    kind = "ours"

    def __init__(
        self, data_dir: Path, log_path: Path, membership: Membership | None = None
    ) -> None:
        super().__init__(data_dir, log_path)
        self.membership = membership

    def command(self) -> list[str]:
        url = f"http://{self.endpoint}"
        m = self.membership
        return [
            sys.executable,
            "-m",
            "queue_server.cli",
            "--name",
            m.name if m else "bench",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            *(m.flags() if m else []),
        ]


class EtcdServer(BenchServer):
    """A real etcd with its default settings, on loopback URLs: a single member, or
    a member of a cluster."""

    kind = "etcd"

    def __init__(
        self, data_dir: Path, log_path: Path, binary: str, membership: Membership | None = None
    ) -> None:
        super().__init__(data_dir, log_path)
        self.binary = binary
        self.membership = membership
        self.peer_port = membership.peer_port if membership else free_port()

    def command(self) -> list[str]:
        url = f"http://{self.endpoint}"
        client = [
            self.binary,
            "--name",
            self.membership.name if self.membership else "bench",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
        ]
        if self.membership:
            return [*client, *self.membership.flags()]
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            *client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"bench={peer}",
        ]


MemberFactory = Callable[[Path, Path, Membership], BenchServer]
"""(data dir, log path, membership) -> a member not yet started."""


class BenchCluster(Target):
    """`size` members of one kind (n1, n2, ...), bootstrapped together on loopback.

    `start` launches every member, waits until each answers Status and then until
    all of them name the same leader (bounded). CPU and RSS count every member
    (`pids`). A member the failover workload kills (`kill`) is left out of
    `alive`, `pids` and `endpoint` from then on.
    """

    def __init__(
        self,
        kind: str,
        data_dir: Path,
        log_dir: Path,
        log_stem: str,
        make: MemberFactory,
        size: int,
    ) -> None:
        self.kind = kind
        names = [f"n{i + 1}" for i in range(size)]
        ports = {name: free_port() for name in names}
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in ports.items())
        self.members: list[BenchServer] = [
            make(data_dir / n, log_dir / f"{log_stem}-{n}.log", Membership(n, ports[n], initial))
            for n in names
        ]
        self._names = dict(zip(self.members, names, strict=True))
        self.killed: list[BenchServer] = []
        self._ids: dict[int, BenchServer] = {}
        self._leader: BenchServer | None = None

    def name_of(self, member: BenchServer) -> str:
        return self._names.get(member, "?")

    @property
    def member_ids(self) -> dict[int, BenchServer]:
        """Raft member id (Status header.member_id) -> member, known once started."""
        return dict(self._ids)

    def live(self) -> list[BenchServer]:
        """The members the harness has not killed."""
        return [m for m in self.members if m not in self.killed]

    @property
    def endpoint(self) -> str:
        live = self.live()
        return (live or self.members)[0].endpoint

    @property
    def pid(self) -> int:
        return (self.live() or self.members)[0].pid

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self.live() if m.proc is not None]

    def pid_text(self) -> str:
        return "pids " + ", ".join(str(m.pid) for m in self.members if m.proc is not None)

    def describe(self) -> str:
        where = ", ".join(f"{self.name_of(m)} {m.endpoint}" for m in self.members)
        leader = f", leader {self.name_of(self._leader)}" if self._leader else ""
        return f"{len(self.members)} members ({where}; {self.pid_text()}){leader}"

    def launch(self) -> None:
        try:
            for m in self.members:
                m.launch()
        except BaseException:
            self.stop()
            raise

    def await_ready(self) -> None:
        try:
            for m in self.members:
                m.await_ready()
            for m in self.members:
                self._ids[self.status(m).header.member_id] = m
            self.wait_leader()
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def status(member: BenchServer, timeout: float = 2.0) -> rpc_pb2.StatusResponse:
        with grpc.insecure_channel(member.endpoint) as ch:
            resp: rpc_pb2.StatusResponse = rpc_pb2_grpc.MaintenanceStub(ch).Status(
                rpc_pb2.StatusRequest(), timeout=timeout
            )
            return resp

    def wait_leader(self, timeout: float = LEADER_TIMEOUT) -> BenchServer:
        """The member every live member names as leader, once they agree (bounded)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                leaders = {self.status(m).leader for m in self.live()}
            except grpc.RpcError as e:
                last = f"Status failed: {e}"
            else:
                found = self._ids.get(next(iter(leaders))) if len(leaders) == 1 else None
                if found is not None and found not in self.killed:
                    self._leader = found
                    return found
                last = f"members name {sorted(f'{x:x}' for x in leaders)}"
            for m in self.live():
                if not m.alive():
                    raise RuntimeError(f"member {self.name_of(m)} exited with code {m.exit_code()}")
            time.sleep(0.05)  # a poll interval, bounded by the deadline
        raise TimeoutError(f"no single leader after {timeout:.0f}s: {last}")

    def followers(self, leader: BenchServer) -> list[BenchServer]:
        return [m for m in self.live() if m is not leader]

    def kill(self, member: BenchServer) -> None:
        """SIGKILL one member by its pid; it stays dead until the cluster stops."""
        self.killed.append(member)
        member.kill()

    def alive(self) -> bool:
        return all(m.alive() for m in self.live())

    def exit_code(self) -> int | None:
        return next((m.exit_code() for m in self.live() if not m.alive()), None)

    def stop(self) -> None:
        errors: list[BaseException] = []
        for m in self.members:
            try:
                m.stop()
            except Exception as e:  # stop the others anyway
                errors.append(e)
        if errors:
            raise errors[0]

    def log_tail(self, lines: int = 20) -> str:
        per = max(lines // max(len(self.members), 1), 5)
        return "\n".join(f"--- {self.name_of(m)} ---\n{m.log_tail(per)}" for m in self.members)


def ours_cluster(data_dir: Path, log_dir: Path, log_stem: str, size: int) -> BenchCluster:
    return BenchCluster(
        "ours", data_dir, log_dir, log_stem, lambda d, log, m: OursServer(d, log, m), size
    )


def etcd_cluster(
    data_dir: Path, log_dir: Path, log_stem: str, size: int, binary: str
) -> BenchCluster:
    return BenchCluster(
        "etcd", data_dir, log_dir, log_stem, lambda d, log, m: EtcdServer(d, log, binary, m), size
    )


class ResourceMonitor:
    """CPU seconds and peak RSS of a server process (and its children) over a window;
    given several pids (a cluster's members), their sums.

    `start()` snapshots the CPU times and starts a sampling thread for RSS;
    `stop()` returns (CPU seconds spent since start, peak RSS in MB).
    """

    def __init__(self, pid: int | Sequence[int], interval: float = 0.05) -> None:
        self.pids = [pid] if isinstance(pid, int) else list(pid)
        self.interval = interval
        self._cpu0 = 0.0
        self._cpu_seen: dict[int, float] = {}
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _processes(self) -> list[psutil.Process]:
        found: list[psutil.Process] = []
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                found += [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
        return found

    def _cpu(self) -> float:
        """CPU seconds of the processes, each as last seen: a process that died in
        the window (a killed member) keeps what it had used."""
        for p in self._processes():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                self._cpu_seen[p.pid] = float(t.user + t.system)
        return sum(self._cpu_seen.values())

    def _rss(self) -> int:
        total = 0
        for p in self._processes():
            with contextlib.suppress(psutil.Error):
                total += int(p.memory_info().rss)
        return total

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, self._rss())
            if len(self.pids) > 1:
                self._cpu()  # keeps each member's CPU as last seen

    def start(self) -> None:
        self._cpu_seen.clear()
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
