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

This module does not import from tests/ (nor from the rest of the harness); it needs only the
standard library, the etcd and etcdctl binaries and the built tool.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.support.shared_tools import shared_tools_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TOOL = Path("/tmp/tools/etcd-benchmark")
BUILD_HINT = (
    f"bash {shared_tools_dir() / 'etcd-benchmark' / 'build.sh'} {DEFAULT_TOOL} "
    "(its sources are found through $QS_SHARED_TOOLS, default ../shared/tools: README, "
    "'Third-party tools')"
)
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
SETUP_TIMEOUT = 20.0
QUICK_RUN_TIMEOUT = 180.0
FULL_RUN_TIMEOUT = 900.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
OTHER_CPU_WARN = 0.25
"""Cores' worth of CPU used by other processes during a run above which the run is flagged."""

PUT_ARGS = ["--key-size=8", "--val-size=256", "--sequential-keys", "--key-space-size=100000"]


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


WORKLOADS: list[Workload] = [
    Workload(
        "put1",
        "put, 1 connection, 1 client (fsync latency bound)",
        lambda n: ["--conns=1", "--clients=1", "put", *PUT_ARGS, f"--total={n}"],
        full=20_000,
        quick=1_500,
    ),
    Workload(
        "put64",
        "put, 8 connections, 64 clients",
        lambda n: ["--conns=8", "--clients=64", "put", *PUT_ARGS, f"--total={n}"],
        full=150_000,
        quick=8_000,
    ),
    Workload(
        "put256",
        "put, 16 connections, 256 clients",
        lambda n: ["--conns=16", "--clients=256", "put", *PUT_ARGS, f"--total={n}"],
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


def log(msg: str) -> None:
    print(f"[etcd_tool {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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
        tool_cpu0 = children_cpu()
        busy0 = machine_busy_cpu()
        cpu0 = servers_cpu()
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)
        res.wall_s = time.monotonic() - t0
        res.server_cpu_s = servers_cpu() - cpu0
        res.tool_cpu_s = children_cpu() - tool_cpu0
        res.other_cpu_s = max(machine_busy_cpu() - busy0 - res.server_cpu_s - res.tool_cpu_s, 0.0)
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
    if res.wall_s and res.other_cpu_s / res.wall_s > OTHER_CPU_WARN:
        res.notes.append(
            f"other processes used {res.other_cpu_s:.1f} CPU-s during the run "
            f"({res.other_cpu_s / res.wall_s:.2f} cores): figures may be disturbed"
        )
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
            server = EtcdServer(work_dir, etcdctl, args.etcd)
            server.start()
        log(f"  {kind} ready on {server.endpoint} (pid {server.pid})")
        if wl.setup_key is not None:
            r = server.etcdctl_run("put", wl.setup_key, "bar", timeout=SETUP_TIMEOUT)
            if r.returncode != 0:
                raise RuntimeError(f"setup put {wl.setup_key} failed: {r.stderr.strip()}")
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


def git_commit(repo: Path) -> str:
    try:
        r = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    dirty = ""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        st = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        dirty = "+dirty" if st.stdout.strip() else ""
    return (r.stdout.strip() or "?") + dirty


def etcd_version(binary: str) -> str:
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    for line in out.splitlines():
        if line.lower().startswith("etcd version:"):
            return line.split(":", 1)[1].strip()
    return "?"


# --- main ----------------------------------------------------------------------------------


W = TypeVar("W")


def chosen_workloads(p: argparse.ArgumentParser, text: object, by_name: dict[str, W]) -> list[W]:
    """The workloads a comma-separated --workloads names, in its order; a name
    not in `by_name` (or none at all) is a usage error."""
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    unknown = [s for s in names if s not in by_name]
    if unknown or not names:
        p.error(f"unknown workload(s) {unknown}; choose from {','.join(by_name)}")
    return [by_name[s] for s in names]


def add_common_args(p: argparse.ArgumentParser, quick_timeout: float, full_timeout: float) -> None:
    """The arguments every Go-tool harness takes: the tool, etcd, our checkout, the outputs and
    the bound on one tool run. `resolve_common_args` checks them once parsed."""
    p.add_argument(
        "--tool",
        default=None,
        help=f"etcd's benchmark tool (default $ETCD_BENCHMARK, {DEFAULT_TOOL}, PATH)",
    )
    p.add_argument("--etcd", default=None, help="the etcd binary (default: etcd on PATH)")
    p.add_argument(
        "--ours-dir",
        type=Path,
        default=REPO_ROOT,
        help="run our server from this checkout (e.g. a `git clone` of a fixed commit) "
        "instead of this one",
    )
    p.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    p.add_argument("--json", type=Path, default=None, help="write the JSON results here")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds per tool run before it is killed (default {quick_timeout:.0f} quick, "
        f"{full_timeout:.0f} full)",
    )


def resolve_common_args(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    quick_timeout: float,
    full_timeout: float,
    need_tool: bool = True,
) -> None:
    """Find the tool, etcd and etcdctl, check --ours-dir, default --timeout; a usage error
    (`p.error`) names what is missing and how to get it."""
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
    args.etcd = args.etcd or shutil.which("etcd")
    if not args.etcd:
        p.error("no etcd binary (apt-get install etcd-server, or --etcd PATH)")
    args.etcdctl = shutil.which("etcdctl")
    if not args.etcdctl:
        p.error("no etcdctl on PATH (apt-get install etcd-client)")
    args.ours_dir = Path(args.ours_dir).resolve()
    if not (args.ours_dir / "queue_server" / "cli.py").exists():
        p.error(f"no queue_server/cli.py in --ours-dir {args.ours_dir}")
    if args.timeout is None:
        args.timeout = quick_timeout if args.quick else full_timeout


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.etcd_tool",
        description="queue-server vs etcd side by side, driven by etcd's tools/benchmark.",
    )
    p.add_argument("--quick", action="store_true", help="small runs (a couple of seconds each)")
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS_BY_NAME),
        help=f"comma-separated, from {','.join(WORKLOADS_BY_NAME)} (default: all)",
    )
    p.add_argument(
        "--transport",
        choices=["native", "grpcio"],
        default=None,
        help="pass --grpc-transport VALUE to our server (default: don't pass it)",
    )
    add_common_args(p, QUICK_RUN_TIMEOUT, FULL_RUN_TIMEOUT)
    args = p.parse_args(argv)
    args.workload_list = chosen_workloads(p, args.workloads, WORKLOADS_BY_NAME)
    resolve_common_args(p, args, QUICK_RUN_TIMEOUT, FULL_RUN_TIMEOUT)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mode = "quick" if args.quick else "full"
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "mode": mode,
        "cpus": os.cpu_count(),
        "etcd_version": etcd_version(args.etcd),
        "etcd": args.etcd,
        "tool": args.tool,
        "commit": git_commit(args.ours_dir),
        "ours_dir": str(args.ours_dir),
        "transport": args.transport or "default",
        "python": sys.version.split()[0],
    }
    requested_transport = args.transport
    args.transport_note = ""
    rows: list[tuple[Workload, int, RunResult, RunResult]] = []
    failed = False
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
            failed = True
            log(f"  kept {work_dir} (logs)")
    if args.transport_note:
        meta["transport"] = (
            f"{requested_transport} requested, but our server rejected --grpc-transport; "
            "it ran with its default"
        )
    md = markdown(rows, meta)
    if args.out:
        args.out.write_text(md)
        log(f"wrote {args.out}")
    if args.json:
        args.json.write_text(json.dumps(to_json(rows, meta), indent=2) + "\n")
        log(f"wrote {args.json}")
    print(md)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
