"""The server processes every benchmark harness runs: ours and etcd, alone or as cluster members.

What it owns: free 127.0.0.1 ports (`free_port`); one server process (`Server`, with
`OursServer` running `python -m queue_server.cli` from a checkout and `EtcdServer` running an
etcd binary) in its own data directory, launched in a session of its own, ready once it answers
`etcdctl endpoint health` (bounded), stopped by its own pid (SIGTERM, SIGKILL after a bounded
wait) or killed by it; the peer flags of a cluster member (`Membership`); and the CPU and memory
figures read from /proc (`process_tree_cpu`, `process_tree_rss`, `machine_busy_cpu`,
`children_cpu`) and the note of a run other processes disturbed (`disturbed_note`). Also what a
report says about the binaries (`git_commit`, `etcd_version`), and the progress lines every
harness writes to stderr (`named_log`).

`benchmarks.etcd_tool`, `queue_tool`, `cluster_tool` and `keyspace_tool` use it, and so do the
tests that need a free port. It needs only the standard library; it imports nothing from tests/.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
OTHER_CPU_WARN = 0.25
"""Cores' worth of CPU used by other processes during a run above which the run is flagged."""


def named_log(name: str) -> Callable[[str], None]:
    """A progress logger: each line to stderr as `[name HH:MM:SS] message`."""

    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


log = named_log("servers")


def disturbed_note(other_cpu_s: float | None, wall_s: float | None) -> str | None:
    """The note a run gets when other processes used more than OTHER_CPU_WARN cores over it."""
    if not wall_s or not other_cpu_s or other_cpu_s / wall_s <= OTHER_CPU_WARN:
        return None
    return (
        f"other processes used {other_cpu_s:.1f} CPU-s during the run "
        f"({other_cpu_s / wall_s:.2f} cores): figures may be disturbed"
    )


LISTEN_PORTS_FROM = 20_000
"""Listeners of tests and benchmarks get a port from here up to the kernel's
ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`, 32768-60999 here).
A port the kernel hands out for bind(0) comes from that range, and between
picking it and the server binding it the kernel may give the same port to some
outgoing connection as its source port: a member starting up dialling its peers
did exactly that now and then, and the member told to listen there exited."""
_picked: deque[int] = deque(maxlen=4096)
"""Ports handed out lately by this process: not handed out again while their
server may still be starting."""
_pick = random.Random()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, below the ephemeral range
    (see LISTEN_PORTS_FROM); bind(0)'s choice where that range leaves no room."""
    high = _ephemeral_low()
    for _ in range(200 if high - LISTEN_PORTS_FROM > 1000 else 0):
        port = _pick.randrange(LISTEN_PORTS_FROM, high)
        if port in _picked:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _picked.append(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- CPU time from /proc -------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3 onwards)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def _descendants(root: int) -> list[int]:
    """`root` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and its descendants, each counted once: a live
    process by its own times, a reaped one through its parent's cutime/cstime."""
    ticks = 0
    for p in _descendants(pid):
        fields = _stat_fields(p)
        if fields is not None:
            # fields[11..14] are utime, stime, cutime, cstime (stat fields 14..17)
            ticks += sum(int(x) for x in fields[11:15])
    return ticks / CLK_TCK


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def process_tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its live descendants (/proc/<pid>/statm), 0 once gone."""
    total = 0
    for p in _descendants(pid):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE_SIZE
        except (OSError, ValueError, IndexError):
            continue
    return total


def machine_busy_cpu() -> float:
    """CPU seconds all CPUs of the machine have spent busy (not idle, not iowait)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[1:9])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (the tool, once it is waited for)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# --- servers -------------------------------------------------------------------------------


class StartupRejected(RuntimeError):
    """The server exited before it was ready; `log_text` says why."""

    def __init__(self, msg: str, log_text: str) -> None:
        super().__init__(msg)
        self.log_text = log_text


@dataclass(frozen=True)
class Membership:
    """A server as one member of a cluster on loopback: its name, its peer port, and every
    member's `name=peer-url` (the same flags for ours and for etcd)."""

    name: str
    peer_port: int
    initial_cluster: str
    token: str = "bench-cluster"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def args(self) -> list[str]:
        return [
            "--name",
            self.name,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self.initial_cluster,
            "--initial-cluster-token",
            self.token,
        ]


def single_member(name: str) -> Membership:
    """A cluster of one (what etcd needs for its own peer flags when it runs alone)."""
    port = free_port()
    return Membership(name, port, f"{name}=http://127.0.0.1:{port}")


class Server:
    """One server process under test, on a free loopback port, data in `work_dir`."""

    def __init__(self, kind: str, work_dir: Path, etcdctl: str) -> None:
        self.kind = kind
        self.work_dir = work_dir
        self.etcdctl = etcdctl
        self.port = free_port()
        self.log_path = work_dir / f"{kind}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.cwd = REPO_ROOT
        self.env = dict(os.environ)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.kind} not started")
        return self.proc.pid

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        """Launch, and wait until it answers `etcdctl endpoint health` (stopped if it does not)."""
        self.launch()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def launch(self) -> None:
        """Start the process without waiting for it to serve: the members of a cluster are all
        launched before any can answer health (which needs a leader). A relaunch (after
        `kill`) keeps the ports and the data dir and appends to the same log."""
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                env=self.env,
                start_new_session=True,
            )

    def etcdctl_run(self, *args: str, timeout: float = 5.0) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "ETCDCTL_API": "3"}
        return subprocess.run(
            [self.etcdctl, f"--endpoints={self.endpoint}", "--command-timeout=3s", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StartupRejected(
                    f"{self.kind} exited with code {self.proc.returncode} before it was ready",
                    self.log_tail(),
                )
            try:
                r = self.etcdctl_run("endpoint", "health")
            except subprocess.TimeoutExpired:
                last = "etcdctl endpoint health timed out"
            else:
                if r.returncode == 0:
                    return
                last = (r.stderr or r.stdout).strip()
            time.sleep(0.1)  # poll interval, bounded by the deadline
        raise TimeoutError(f"{self.kind} not ready after {timeout:.0f}s: {last}")

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM by pid, wait (up to `timeout`), then SIGKILL by pid."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"{self.kind} (pid {self.proc.pid}) ignored SIGTERM; sending SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT)

    def kill(self) -> None:
        """SIGKILL by pid (a crash: no clean shutdown), and reap it (bounded)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=STOP_TIMEOUT)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class OursServer(Server):
    def __init__(
        self,
        work_dir: Path,
        etcdctl: str,
        transport: str | None,
        source: Path = REPO_ROOT,
        membership: Membership | None = None,
    ) -> None:
        """Without `membership`, a single member on its local log."""
        super().__init__("ours", work_dir, etcdctl)
        self.transport = transport
        self.membership = membership
        # Run the queue_server package found in `source` (a checkout), ahead of any install.
        self.cwd = source
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(source), *filter(None, [os.environ.get("PYTHONPATH")])]
        )

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "queue_server.cli",
            "--data-dir",
            str(self.work_dir / "ours-data"),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
        ]
        if self.transport is not None:
            cmd += ["--grpc-transport", self.transport]
        if self.membership is not None:
            cmd += self.membership.args()
        return cmd


class EtcdServer(Server):
    def __init__(
        self, work_dir: Path, etcdctl: str, binary: str, membership: Membership | None = None
    ) -> None:
        """Without `membership`, a cluster of one named `bench`. etcd's own defaults otherwise
        (heartbeat 100 ms, election timeout 1000 ms, as ours)."""
        super().__init__("etcd", work_dir, etcdctl)
        self.binary = binary
        self.membership = membership or single_member("bench")

    def command(self) -> list[str]:
        return [
            self.binary,
            "--data-dir",
            str(self.work_dir / "etcd-data"),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            *self.membership.args(),
        ]


# --- what a report says about the binaries -------------------------------------------------


def _output_of(cmd: list[str]) -> str | None:
    """What `cmd` prints on stdout (bounded by 10 s), or None when it could not be run."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def git_commit(repo: Path) -> str:
    head = _output_of(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    if head is None:
        return "?"
    status = _output_of(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    return (head.strip() or "?") + ("+dirty" if status and status.strip() else "")


def etcd_version(binary: str) -> str:
    out = _output_of([binary, "--version"])
    if out is None:
        return "?"
    for line in out.splitlines():
        if line.lower().startswith("etcd version:"):
            return line.split(":", 1)[1].strip()
    return "?"
