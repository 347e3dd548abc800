"""Cluster rows: a 3-member cluster of ours beside a 3-member etcd, driven by Go clients.

Run it with::

    bash "$(scripts/shared_tools.sh)/etcd-benchmark/build.sh" /tmp/tools/etcd-benchmark  # once
    scripts/build_queue_bench.sh /tmp/tools/queue-bench                                  # once
    python -m benchmarks.cluster_tool [--quick] [--workloads put-spread,failover,...] \\
        [--tool PATH] [--queue-tool PATH] [--etcd PATH] [--kills N] [--out FILE.md] \\
        [--json FILE] [--ours-dir CHECKOUT] [--timeout SECONDS]

What it owns: for each workload it starts a fresh 3-member cluster of ours (`queue-server
--name nI --initial-cluster ... --listen-peer-urls ...`), then, once ours is stopped, a fresh
3-member etcd (Debian's 3.4, its default heartbeat 100 ms and election timeout 1000 ms, as
ours). Each member has its own temporary data dir and free 127.0.0.1 client and peer ports. It
launches all three, waits until each answers `etcdctl endpoint health` and all name one leader
(`etcdctl endpoint status`: `leader` against `header.member_id`), both bounded, runs the
workload, and stops each member by its own pid. The two clusters never run at the same time.
Server CPU is the three members' user+system time (with descendants, from /proc) over the run.

The workloads:

- `put-spread`: etcd's tool, `put` with 64 clients on 8 connections, endpoints = all three
  members (the tool spreads its connections over them; a follower hands a put to the leader).
- `put-leader`: the same with the leader as the only endpoint.
- `range-follower`: the tool's linearizable `range` of one key (put first) against one
  follower: every read costs that follower a ReadIndex round trip to the leader.
- `failover`: `FailoverProbe` puts a key every `ATTEMPT_INTERVAL` round robin over the two
  followers (gRPC futures, each with its own deadline, so a hanging put does not hold back the
  next); after a steady phase the leader is SIGKILLed by pid; the sample is the time from the
  kill to the first success of a put *sent after the kill* (only a new leader can commit it).
  The killed member is restarted with its data dir and must catch up (it serves a marker key
  written after its restart, read serializably) before the next kill. At the end every put
  that was answered OK is read back through every member (linearizable): any missing or changed
  value is a lost put and fails the row. The rate columns show the median seconds.
- `queue`: tools/queue-bench against the followers: our etcd-key queue (`mq`: 64 producer
  goroutines, 4 consumers, one put and one delete per message) vs etcd's queue recipe
  (`recipe`: prefix watches, claim by mod_revision Txn) with the same producer and consumer
  counts. The driver is built from this checkout unless `--queue-tool` names one. The producers use one follower, the consumers both (round robin), so every write and
  every assignment crosses to the leader. The driver checks each message is received once.

Every run is bounded in count and time: the tool's `--total` and a subprocess timeout after
which it is killed by its pid; every wait for health, a leader, a catch-up or a failover has its
own deadline. Output: a Markdown table (`--out`) and JSON (`--json`); the Markdown also goes to
stdout, progress to stderr. Exit status 1 when any run failed or lost a put.

The server processes come from `benchmarks.servers`, the command line is the set every harness
shares (`benchmarks.options`), the tool runner is `run_tool_on` of `benchmarks.etcd_tool`, the
queue driver's run comes from `benchmarks.runs`; it also needs grpc and our generated etcd
stubs (`etcdserverpb`, for the failover probe).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from benchmarks.etcd_tool import RunResult, Workload, put_args, run_tool_on
from benchmarks.options import (
    add_common_args,
    chosen_workloads,
    finish_report,
    new_server,
    queue_bench,
    resolve_common_args,
    run_meta,
    stop_on_sigterm,
)
from benchmarks.runs import driver_answer, run_measured
from benchmarks.servers import (
    STOP_TIMEOUT,
    Membership,
    Server,
    disturbed_note,
    free_port,
    named_log,
    process_tree_cpu,
)
from etcdserverpb import rpc_pb2, rpc_pb2_grpc

CLUSTER_SIZE = 3
LEADER_TIMEOUT = 30.0
"""Bound on the wait for one leader named by every live member (an election takes 1-2 s)."""
CATCH_UP_TIMEOUT = 60.0
"""Bound on a restarted member serving the marker key written after its restart."""
STATUS_TIMEOUT = 5.0
QUICK_RUN_TIMEOUT = 120.0
FULL_RUN_TIMEOUT = 600.0
QUEUE_SETUP_TIMEOUT = 60.0
KILL_MARGIN = 60.0
"""Seconds past the queue driver's own bounds after which it is killed."""

ATTEMPT_INTERVAL = 0.005
"""The failover probe sends a put this often: the resolution of a failover sample."""
ATTEMPT_TIMEOUT = 3.0
"""Each probe put's own deadline: longer than an election, so a put that the new leader commits
is counted, not abandoned (attempts in flight stay below ATTEMPT_TIMEOUT / ATTEMPT_INTERVAL)."""
STEADY_PUTS = 50
"""Successful puts before the kill: the probe runs steadily against a healthy cluster."""
STEADY_TIMEOUT = 15.0
FAILOVER_TIMEOUT = 20.0
"""Bound on the wait for the first successful put after a kill; past it the sample fails."""
TAIL_S = 0.3
"""The probe keeps putting this long after the first success (puts the new leader acks)."""
FAILOVER_TARGET_S = 1.3
DEFAULT_KILLS = 5
QUICK_KILLS = 2

QUEUE_FLAGS = ["--consumers=4", "--producers=64", "--inflight=1024", "--conns=4"]
"""Shared by both drivers: 64 producer goroutines with one put in flight each (one producer
process, as the put rows' 64 clients), 4 consumers, at most 1024 messages unacknowledged:
enough in flight that the servers, not the producers, set the pace (with 16 producers ours
was bound by the producers' put latency at about 2,000 msgs/s)."""


@dataclass(frozen=True)
class ClusterWorkload:
    """A row: how it runs (`tool`, `failover`, `queue`), where, and its target."""

    name: str
    description: str
    mode: str
    target: str
    meets: Callable[[Side, Side], bool | None]
    tool: Workload | None = None
    endpoints: str = "all"
    """For tool rows: `all`, `leader` or `follower`."""
    full: int = 0
    quick: int = 0


def _ratio_at_least(x: float) -> Callable[[Side, Side], bool | None]:
    def meets(ours: Side, etcd: Side) -> bool | None:
        if not ours.ok or not etcd.ok or ours.rate is None or not etcd.rate:
            return None
        return ours.rate / etcd.rate >= x

    return meets


def _failover_met(ours: Side, _etcd: Side) -> bool | None:
    if ours.figure_s is None:
        return None
    return ours.ok and ours.figure_s <= FAILOVER_TARGET_S


def _put_row(name: str, where: str, endpoints: str) -> ClusterWorkload:
    """A put row: etcd_tool's put64 flags, 30,000 puts (2,000 quick) to `endpoints`."""
    return ClusterWorkload(
        name,
        f"put, 64 clients on 8 connections, {where}",
        "tool",
        ">= 0.8x etcd",
        _ratio_at_least(0.8),
        Workload(name, "", lambda n: [*put_args(8, 64), f"--total={n}"], 30_000, 2_000),
        endpoints=endpoints,
    )


WORKLOADS: list[ClusterWorkload] = [
    _put_row("put-spread", "endpoints = the 3 members", "all"),
    _put_row("put-leader", "endpoint = the leader", "leader"),
    ClusterWorkload(
        "range-follower",
        "linearizable range of one key, 64 clients on 8 connections, endpoint = a follower",
        "tool",
        ">= 1.0x etcd",
        _ratio_at_least(1.0),
        Workload(
            "range-follower",
            "",
            lambda n: [
                "--conns=8",
                "--clients=64",
                "range",
                "foo",
                "--consistency=l",
                f"--total={n}",
            ],
            40_000,
            2_000,
            setup_key="foo",
        ),
        endpoints="follower",
    ),
    ClusterWorkload(
        "failover",
        f"leader SIGKILLed under a put every {ATTEMPT_INTERVAL * 1000:.0f} ms to the followers: "
        "seconds from the kill to the first successful put sent after it (median)",
        "failover",
        f"ours median <= {FAILOVER_TARGET_S} s, no acknowledged put lost",
        _failover_met,
    ),
    ClusterWorkload(
        "queue",
        "queue across members: producers on a follower, 4 consumers on both followers "
        "(msgs/s; ours: etcd-key queue `mq`, etcd: its recipe)",
        "queue",
        ">= 5x etcd's recipe",
        _ratio_at_least(5.0),
        full=10_000,
        quick=300,
    ),
]
WORKLOADS_BY_NAME = {w.name: w for w in WORKLOADS}


log = named_log("cluster_tool")


# --- one cluster ---------------------------------------------------------------------------


class Cluster:
    """`CLUSTER_SIZE` members of one kind, each in `root/nI`, bootstrapped together."""

    def __init__(self, kind: str, root: Path, args: argparse.Namespace) -> None:
        self.kind = kind
        names = [f"n{i + 1}" for i in range(CLUSTER_SIZE)]
        peers = {name: free_port() for name in names}
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in peers.items())
        self.members: list[Server] = []
        for name in names:
            work = root / f"{kind}-{name}"
            work.mkdir(parents=True)
            m = Membership(name, peers[name], initial, token=f"bench-{kind}")
            self.members.append(new_server(kind, work, args, m))

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self.members if m.alive]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> Server:
        """Launch every member, wait until each is healthy and all name one leader."""
        try:
            for m in self.members:
                m.launch()
            for m in self.members:
                m.wait_ready()
            return self.wait_leader()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def ready_line(self, leader: Server) -> str:
        """What the progress line says of a started cluster: its members and its leader."""
        return (
            f"  {self.kind} cluster ready: "
            + ", ".join(f"{m.work_dir.name} {m.endpoint} pid {m.pid}" for m in self.members)
            + f"; leader {leader.work_dir.name}"
        )

    @staticmethod
    def endpoint_status(m: Server) -> dict[str, Any]:
        """`etcdctl endpoint status -w json`'s Status of `m`: header (member_id, revision,
        raft_term), leader, raftTerm, raftIndex, ... (zero fields are left out)."""
        r = m.etcdctl_run("endpoint", "status", "-w", "json", timeout=STATUS_TIMEOUT)
        if r.returncode != 0:
            raise RuntimeError((r.stderr or r.stdout).strip())
        st: dict[str, Any] = json.loads(r.stdout)[0]["Status"]
        return st

    def status(self, m: Server) -> tuple[int, int, int]:
        """(member_id, leader, revision) as `m` reports them (etcdctl endpoint status)."""
        st = self.endpoint_status(m)
        return int(st["header"]["member_id"]), int(st["leader"]), int(st["header"]["revision"])

    def wait_leader(self, timeout: float = LEADER_TIMEOUT) -> Server:
        """The live member that every live member names as leader."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                live = [m for m in self.members if m.alive]
                seen = {m: self.status(m) for m in live}
                leaders = {leader for _id, leader, _rev in seen.values()}
                if len(leaders) == 1 and 0 not in leaders:
                    for m, (member_id, _l, _r) in seen.items():
                        if member_id in leaders:
                            return m
                last = f"members name leaders {sorted(leaders)}"
            except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
                last = str(e)
            time.sleep(0.1)  # poll interval, bounded by the deadline
        raise TimeoutError(f"{self.kind}: no single leader after {timeout:.0f}s: {last}")

    def followers(self, leader: Server) -> list[Server]:
        return [m for m in self.members if m is not leader and m.alive]

    def log_tails(self, lines: int = 5) -> str:
        return " || ".join(f"{m.work_dir.name}: {m.log_tail(lines)}" for m in self.members)


# --- a row's result on one cluster ---------------------------------------------------------


@dataclass
class Side:
    """One cluster's result for one workload (the form every mode reports in)."""

    server: str
    workload: str
    ok: bool = False
    error: str | None = None
    rate: float | None = None
    """Requests (messages) per second; None for failover."""
    figure_s: float | None = None
    """Failover: the median seconds from kill to first successful put."""
    requests: int = 0
    server_cpu_s: float | None = None
    tool_cpu_s: float | None = None
    wall_s: float | None = None
    other_cpu_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    command: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)

    def per_request_us(self, cpu_s: float | None) -> float | None:
        if cpu_s is None or not self.requests:
            return None
        return cpu_s * 1e6 / self.requests

    @property
    def server_us(self) -> float | None:
        return self.per_request_us(self.server_cpu_s)

    @property
    def tool_us(self) -> float | None:
        return self.per_request_us(self.tool_cpu_s)

    def flag_disturbed(self) -> None:
        if note := disturbed_note(self.other_cpu_s, self.wall_s):
            self.notes.append(note)


def side_of_tool(res: RunResult) -> Side:
    rep = res.report
    side = Side(
        server=res.server,
        workload=res.workload,
        ok=res.ok,
        error=res.error,
        rate=rep.rps if res.ok else None,
        requests=rep.requests,
        server_cpu_s=res.server_cpu_s,
        tool_cpu_s=res.tool_cpu_s,
        wall_s=res.wall_s,
        other_cpu_s=res.other_cpu_s,
        p50_ms=rep.percentiles_ms.get("50"),
        p99_ms=rep.percentiles_ms.get("99"),
        command=res.command,
        notes=list(res.notes),
        detail={"report": asdict(rep)},
    )
    return side


# --- tool rows -----------------------------------------------------------------------------


def run_tool_row(
    cw: ClusterWorkload, cluster: Cluster, leader: Server, n: int, args: argparse.Namespace
) -> Side:
    assert cw.tool is not None
    if cw.endpoints == "leader":
        targets = [leader]
    elif cw.endpoints == "follower":
        targets = cluster.followers(leader)[:1]
    else:
        targets = cluster.members
    cw.tool.set_up(leader)
    endpoints = ",".join(m.endpoint for m in targets)
    work = cluster.members[0].work_dir.parent
    res = run_tool_on(args.tool, cluster.members, endpoints, cw.tool, n, args.timeout, work)
    side = side_of_tool(res)
    side.detail["endpoints"] = [m.work_dir.name for m in targets]
    side.detail["leader"] = leader.work_dir.name
    return side


# --- the queue row -------------------------------------------------------------------------


def run_queue_row(cluster: Cluster, leader: Server, n: int, args: argparse.Namespace) -> Side:
    """queue-bench `mq` (ours) or `recipe` (etcd) with producers and consumers on followers."""
    followers = cluster.followers(leader)
    sub = "mq" if cluster.kind == "ours" else "recipe"
    extra = ["--put-batch=1", "--ack-batch=1", "--acks-in-flight=16"] if sub == "mq" else []
    cmd = [
        str(args.queue_tool),
        sub,
        f"--total={n}",
        *QUEUE_FLAGS,
        *extra,
        f"--endpoint={followers[0].endpoint}",
        f"--producer-endpoints={followers[0].endpoint}",
        f"--consumer-endpoints={','.join(m.endpoint for m in followers)}",
        f"--server-pid={','.join(str(p) for p in cluster.pids)}",
        f"--timeout={args.timeout:.0f}s",
        f"--setup-timeout={QUEUE_SETUP_TIMEOUT:.0f}s",
        f"--label=queue on {cluster.kind} cluster",
    ]
    side = Side(server=cluster.kind, workload="queue", command=cmd)
    work = cluster.members[0].work_dir.parent
    out_path = work / f"queue-{cluster.kind}.json"
    with open(out_path, "wb") as out, open(work / f"queue-{cluster.kind}.err", "wb") as err:
        done = run_measured(
            cmd,
            out,
            err,
            args.timeout + QUEUE_SETUP_TIMEOUT + KILL_MARGIN,
            lambda: sum(process_tree_cpu(p) for p in cluster.pids),
        )
    side.wall_s, side.other_cpu_s = done.wall_s, done.other_cpu_s
    driver, side.error = driver_answer(out_path, done)
    side.ok = side.error is None
    if driver is not None:
        # The driver's own window (first produce to last ack/claim) for rate and CPU.
        side.detail["driver"] = driver
        side.requests = int(driver.get("count") or 0)
        side.server_cpu_s = driver.get("server_cpu_s")
        side.tool_cpu_s = driver.get("client_cpu_s")
        lat = driver.get("latency_ms") or {}
        side.p50_ms, side.p99_ms = lat.get("p50"), lat.get("p99")
        if side.ok:
            side.rate = float(driver["per_second"])
        counts = driver.get("counts", {})
        if "claim_conflicts" in counts:
            side.notes.append(f"claim conflicts {counts['claim_conflicts']:,}")
    side.flag_disturbed()
    return side


# --- the failover row ----------------------------------------------------------------------


class FailoverProbe:
    """Puts `/bench/failover/{seq}` every ATTEMPT_INTERVAL, round robin over `endpoints`, each
    put a gRPC future with its own deadline. Records when each was sent and answered."""

    PREFIX = b"/bench/failover/"

    def __init__(self, endpoints: list[str], seq0: int) -> None:
        self.channels = [grpc.insecure_channel(e) for e in endpoints]
        self.stubs = [rpc_pb2_grpc.KVStub(ch) for ch in self.channels]
        self.seq = seq0
        self.lock = threading.Lock()
        self.acked: dict[bytes, bytes] = {}
        """Every put answered OK: key -> value (all must be readable afterwards)."""
        self.answered: list[tuple[float, float]] = []
        """(sent, answered) monotonic times of every successful put."""
        self.failed = 0
        self.pending = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="failover-probe", daemon=True)

    def start(self) -> FailoverProbe:
        self.thread.start()
        return self

    def _loop(self) -> None:
        i = 0
        while not self.stopping.is_set():
            key = self.PREFIX + b"%010d" % self.seq
            value = b"v%010d" % self.seq
            self.seq += 1
            stub = self.stubs[i % len(self.stubs)]
            i += 1
            sent = time.monotonic()
            fut = stub.Put.future(rpc_pb2.PutRequest(key=key, value=value), timeout=ATTEMPT_TIMEOUT)
            with self.lock:
                self.pending += 1
            fut.add_done_callback(self._done_callback(key, value, sent))
            self.stopping.wait(ATTEMPT_INTERVAL)

    def _done_callback(self, key: bytes, value: bytes, sent: float) -> Callable[[Any], None]:
        def done(fut: Any) -> None:
            now = time.monotonic()
            ok = fut.exception() is None if not fut.cancelled() else False
            with self.lock:
                self.pending -= 1
                if ok:
                    self.acked[key] = value
                    self.answered.append((sent, now))
                else:
                    self.failed += 1

        return done

    def successes(self) -> int:
        with self.lock:
            return len(self.answered)

    def first_success_after(self, t: float) -> float | None:
        """When the first put sent at or after `t` was answered OK."""
        with self.lock:
            done = [a for s, a in self.answered if s >= t]
        return min(done) if done else None

    def stop(self) -> None:
        """Stop sending; wait (bounded) for the puts in flight to be answered or time out."""
        self.stopping.set()
        self.thread.join(timeout=STOP_TIMEOUT)
        deadline = time.monotonic() + ATTEMPT_TIMEOUT + 2.0
        while time.monotonic() < deadline:
            with self.lock:
                if self.pending == 0:
                    break
            time.sleep(0.02)
        for ch in self.channels:
            ch.close()


def wait_until(what: str, cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.005)  # poll interval, bounded by the deadline
    raise TimeoutError(f"{what} not within {timeout:.0f}s")


def catch_up(cluster: Cluster, member: Server) -> float:
    """Relaunch a killed `member`; wait until it is healthy and serves a key written after its
    restart (a serializable read: its own applied state). Returns the seconds it took."""
    t0 = time.monotonic()
    member.launch()
    member.wait_ready()
    leader = cluster.wait_leader()
    marker = f"/bench/catch-up/{time.monotonic_ns()}"
    r = leader.etcdctl_run("put", marker, "x", timeout=20.0)
    if r.returncode != 0:
        raise RuntimeError(f"marker put failed: {r.stderr.strip()}")

    def has_marker() -> bool:
        got = member.etcdctl_run("get", marker, "--consistency=s", "--print-value-only")
        return got.returncode == 0 and got.stdout.strip() == "x"

    wait_until(f"{member.work_dir.name} catching up", has_marker, CATCH_UP_TIMEOUT)
    return time.monotonic() - t0


def read_back(member: Server, prefix: bytes) -> dict[bytes, bytes]:
    """Every key under `prefix`, linearizable, through `member`."""
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    with grpc.insecure_channel(member.endpoint) as ch:
        resp = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=prefix, range_end=end), timeout=30.0
        )
    return {kv.key: kv.value for kv in resp.kvs}


def kill_leader(leader: Server, probe: FailoverProbe, k: int) -> tuple[float, float]:
    """Once the probe runs steadily, SIGKILL `leader`; wait (bounded) for the first successful
    put sent after the kill. Returns (seconds from kill to that success, the leader's CPU
    seconds when it was killed)."""
    wait_until(
        f"{STEADY_PUTS} steady puts", lambda: probe.successes() >= STEADY_PUTS, STEADY_TIMEOUT
    )
    cpu_at_kill = process_tree_cpu(leader.pid)
    t_kill = time.monotonic()
    leader.kill()
    wait_until(
        f"a successful put after kill {k}",
        lambda: probe.first_success_after(t_kill) is not None,
        FAILOVER_TIMEOUT,
    )
    first = probe.first_success_after(t_kill)
    assert first is not None
    time.sleep(TAIL_S)  # the new leader acks more puts: they are read back at the end too
    return first - t_kill, cpu_at_kill


def run_failover_row(cluster: Cluster, leader: Server, kills: int) -> Side:
    side = Side(server=cluster.kind, workload="failover")
    samples: list[float] = []
    killed: list[str] = []
    catch_ups: list[float] = []
    acked: dict[bytes, bytes] = {}
    failed_puts = 0
    seq = 0
    t_start = time.monotonic()
    cpu0 = sum(process_tree_cpu(p) for p in cluster.pids)
    cpu_dead = 0.0
    for k in range(kills):
        followers = cluster.followers(leader)
        probe = FailoverProbe([m.endpoint for m in followers], seq).start()
        try:
            sample, cpu_at_kill = kill_leader(leader, probe, k + 1)
            samples.append(sample)
            cpu_dead += cpu_at_kill
            killed.append(leader.work_dir.name)
        finally:
            probe.stop()
            seq = probe.seq
            acked.update(probe.acked)
            failed_puts += probe.failed
        log(
            f"  {cluster.kind}: kill {k + 1}/{kills} of {killed[-1]}: first put after "
            f"{samples[-1]:.3f} s ({len(probe.acked)} puts acked, {probe.failed} failed)"
        )
        dead = leader
        catch_ups.append(catch_up(cluster, dead))
        leader = cluster.wait_leader()
    side.wall_s = time.monotonic() - t_start
    side.server_cpu_s = sum(process_tree_cpu(p) for p in cluster.pids) - cpu0 + cpu_dead
    lost: list[str] = []
    for m in cluster.members:
        got = read_back(m, FailoverProbe.PREFIX)
        missing = [k for k, v in acked.items() if got.get(k) != v]
        if missing:
            lost.append(f"{m.work_dir.name}: {len(missing)} (first {missing[0]!r})")
    side.figure_s = statistics.median(samples)
    side.requests = len(acked)
    side.detail = {
        "samples_s": [round(s, 4) for s in samples],
        "median_s": side.figure_s,
        "killed": killed,
        "catch_up_s": [round(c, 2) for c in catch_ups],
        "acked_puts": len(acked),
        "failed_or_timed_out_puts": failed_puts,
        "lost_puts": lost,
        "attempt_interval_s": ATTEMPT_INTERVAL,
        "attempt_timeout_s": ATTEMPT_TIMEOUT,
    }
    side.notes.append(
        "samples " + ", ".join(f"{s:.2f}" for s in samples) + f" s; {len(acked):,} puts acked, "
        f"{failed_puts:,} failed or timed out (not acknowledged), lost: "
        + ("; ".join(lost) if lost else "none")
    )
    if lost:
        side.error = "acknowledged puts lost: " + "; ".join(lost)
    else:
        side.ok = True
    return side


# --- one row on one cluster ----------------------------------------------------------------


def run_on(kind: str, cw: ClusterWorkload, args: argparse.Namespace, root: Path) -> Side:
    """A fresh cluster of `kind`, one measured run of `cw`, then stop every member by pid."""
    n = cw.quick if args.quick else cw.full
    if cw.tool is not None:
        n = cw.tool.quick if args.quick else cw.tool.full
    cluster: Cluster | None = None
    try:
        cluster = Cluster(kind, root, args)
        leader = cluster.start()
        log(cluster.ready_line(leader))
        if cw.mode == "tool":
            side = run_tool_row(cw, cluster, leader, n, args)
        elif cw.mode == "queue":
            side = run_queue_row(cluster, leader, n, args)
        else:
            side = run_failover_row(cluster, leader, args.kills)
    except Exception as e:
        side = Side(server=kind, workload=cw.name, error=f"{type(e).__name__}: {e}")
    finally:
        if cluster is not None:
            cluster.stop()
    if not side.ok and cluster is not None:
        side.notes.append(f"member log tails: {cluster.log_tails(3)}")
    return side


# --- output --------------------------------------------------------------------------------


@dataclass
class Row:
    workload: ClusterWorkload
    ours: Side
    etcd: Side

    @property
    def ratio(self) -> float | None:
        if self.workload.mode == "failover":
            a, b = self.ours.figure_s, self.etcd.figure_s
        else:
            a, b = self.ours.rate, self.etcd.rate
        if not self.ours.ok or not self.etcd.ok or a is None or not b:
            return None
        return a / b

    @property
    def met(self) -> bool | None:
        return self.workload.meets(self.ours, self.etcd)


def _num(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def _rate(s: Side) -> str:
    if not s.ok:
        return "FAILED"
    if s.figure_s is not None:
        return f"{s.figure_s:.2f} s"
    return _num(s.rate)


def _lat(s: Side) -> str:
    if not s.ok or s.p50_ms is None:
        return "—"
    return f"{s.p50_ms:.1f} / {_num(s.p99_ms, '{:.1f}')}"


def markdown(rows: list[Row], meta: dict[str, Any]) -> str:
    lines = [
        "# 3-member clusters: queue-server vs etcd, driven by Go clients",
        "",
        f"{meta['date']}; {meta['mode']} mode; {meta['cpus']} CPUs (all 3 members and the "
        f"client on them); load average at start {meta['load_average_at_start']}; etcd "
        f"{meta['etcd_version']}; our server from {meta['ours_dir']} at commit "
        f"{meta['commit']}. Generated by `python -m benchmarks.cluster_tool"
        f"{' --quick' if meta['mode'] == 'quick' else ''}`.",
        "",
        "| workload | etcd | ours | ours/etcd | target | met | server CPU µs/req, 3 members "
        "(etcd / ours) | tool CPU µs/req (etcd / ours) | p50 / p99 ms etcd | p50 / p99 ms ours |",
        "|---|--:|--:|--:|---|---|--:|--:|--:|--:|",
    ]
    for row in rows:
        o, e = row.ours, row.etcd
        met = row.met
        failover = row.workload.mode == "failover"
        cpu = "—" if failover else f"{_num(e.server_us)} / {_num(o.server_us)}"
        tool = "—" if failover else f"{_num(e.tool_us)} / {_num(o.tool_us)}"
        ratio = _num(row.ratio, "{:.2f}") + (" (time)" if failover and row.ratio else "")
        lines.append(
            f"| {row.workload.name} | {_rate(e)} | {_rate(o)} | {ratio} | {row.workload.target} | "
            f"{'—' if met is None else 'yes' if met else 'no'} | {cpu} | {tool} | {_lat(e)} | "
            f"{_lat(o)} |"
        )
    lines += ["", "Each row:", ""]
    for row in rows:
        lines.append(f"- **{row.workload.name}**: {row.workload.description}.")
        for s in (row.etcd, row.ours):
            parts: list[str] = []
            if not s.ok:
                parts.append(f"FAILED: {s.error}")
            if s.command:
                shown = [a for a in s.command[1:] if not a.startswith(("--server-pid", "--label"))]
                parts.append(f"`{Path(s.command[0]).name} {' '.join(shown)}`")
            if "endpoints" in s.detail:
                parts.append(
                    f"endpoints {', '.join(s.detail['endpoints'])} (leader {s.detail['leader']})"
                )
            if s.ok and s.rate is not None:
                parts.append(
                    f"{s.requests:,} in {_num(s.wall_s, '{:.1f}')} s wall; server CPU "
                    f"{_num(s.server_cpu_s, '{:.1f}')} s, tool CPU {_num(s.tool_cpu_s, '{:.1f}')} s"
                )
            parts += [n.replace("|", "/") for n in s.notes]
            lines.append(f"  - {s.server}: " + "; ".join(parts))
    lines += [
        "",
        "Each cluster is 3 fresh members on 127.0.0.1 (new data dirs, fsync on, default "
        "settings: heartbeat 100 ms, election 1000 ms for both), started per row and stopped "
        "by pid before the other kind starts. Server CPU is the 3 members' user+system over "
        "the run (/proc); the queue row's rate and CPU are over the driver's measured phase. "
        "Failover: the rate columns are the median seconds from SIGKILL of the leader to the "
        "first successful put sent after it; ratio ours/etcd of those seconds (lower is "
        "better).",
        "",
    ]
    return "\n".join(lines)


def to_json(rows: list[Row], meta: dict[str, Any]) -> dict[str, Any]:
    out = []
    for row in rows:
        entry: dict[str, Any] = {
            "workload": row.workload.name,
            "mode": row.workload.mode,
            "target": row.workload.target,
            "ours_over_etcd": row.ratio,
            "met": row.met,
        }
        for s in (row.ours, row.etcd):
            d = asdict(s)
            d["server_cpu_us_per_request"] = s.server_us
            d["tool_cpu_us_per_request"] = s.tool_us
            entry[s.server] = d
        out.append(entry)
    return {"meta": meta, "rows": out}


# --- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster_tool",
        description="3-member clusters of queue-server and etcd side by side, Go clients.",
    )
    add_common_args(
        p,
        QUICK_RUN_TIMEOUT,
        FULL_RUN_TIMEOUT,
        workloads=list(WORKLOADS_BY_NAME),
        quick_help="small counts, 2 kills (CI)",
    )
    p.add_argument(
        "--kills",
        type=int,
        default=None,
        help=f"leader kills in the failover row (default {DEFAULT_KILLS}, quick {QUICK_KILLS})",
    )
    args = p.parse_args(argv)
    args.workload_list = chosen_workloads(p, args.workloads, WORKLOADS_BY_NAME)
    modes = {w.mode for w in args.workload_list}
    resolve_common_args(
        p,
        args,
        QUICK_RUN_TIMEOUT,
        FULL_RUN_TIMEOUT,
        need_tool="tool" in modes,
        need_queue_tool="queue" in modes,
    )
    if args.kills is None:
        args.kills = QUICK_KILLS if args.quick else DEFAULT_KILLS
    if args.kills < 1:
        p.error("--kills must be at least 1")
    return args


def _log_side(s: Side) -> None:
    if s.ok:
        what = f"{s.figure_s:.3f} s median" if s.figure_s is not None else f"{s.rate:,.0f}/s"
        log(
            f"  {s.server}: {what}, server CPU {_num(s.server_us)} µs/req, "
            f"tool CPU {_num(s.tool_us)} µs/req, p50/p99 {_lat(s)} ms"
        )
    else:
        log(f"  {s.server}: FAILED: {s.error}")
    for note in s.notes:
        log(f"  {s.server}: note: {note}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    mode = "quick" if args.quick else "full"
    started = time.monotonic()
    # Built from this checkout unless given: an older build lacks --producer-endpoints.
    with queue_bench(args, needed=any(w.mode == "queue" for w in args.workload_list)):
        return run_all(args, mode, started)


def run_all(args: argparse.Namespace, mode: str, started: float) -> int:
    meta = run_meta(args)
    meta["tool"] = args.tool
    meta["queue_tool"] = str(args.queue_tool) if args.queue_tool else None
    meta["kills"] = args.kills
    rows: list[Row] = []
    for cw in args.workload_list:
        root = Path(tempfile.mkdtemp(prefix=f"cluster-tool-{cw.name}-"))
        log(f"{cw.name} ({mode}) in {root}")
        sides = {kind: run_on(kind, cw, args, root) for kind in ("ours", "etcd")}
        for s in sides.values():
            _log_side(s)
        rows.append(Row(cw, sides["ours"], sides["etcd"]))
        if all(s.ok for s in sides.values()):
            shutil.rmtree(root, ignore_errors=True)
        else:
            log(f"  kept {root} (member logs, tool output)")
    meta["duration_s"] = round(time.monotonic() - started, 1)
    meta["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    failed = [
        f"{r.workload.name} on {s.server}" for r in rows for s in (r.ours, r.etcd) if not s.ok
    ]
    return finish_report(args, markdown(rows, meta), to_json(rows, meta), failed, started, log)


if __name__ == "__main__":
    sys.exit(main())
