"""Large keyspace (issue 23): load a big keyspace into ours and into etcd, restart, read.

Run it with::

    bash "$(scripts/shared_tools.sh)"/etcd-benchmark/build.sh /tmp/tools/etcd-benchmark   # once
    python -m benchmarks.keyspace_tool [--quick] [--members 1|3|1,3] [--growth] \\
        [--keys N] [--parts P] [--cluster-keys M] [--cluster-parts Q] \\
        [--growth-keys G] [--growth-probe K] [--same-keys] \\
        [--tool PATH] [--etcd PATH] [--ours-dir CHECKOUT] [--out FILE.md] [--json FILE] \\
        [--timeout SECONDS]

Each scenario runs on ours and then on etcd, one after the other, each on a fresh data dir
(a new temporary directory) and free 127.0.0.1 ports; the two never run at the same time.

- `single` (`--members 1`, the default unless `--growth` is given alone): one member. N keys (default 1,000,000; 16 B keys,
  256 B values) go in with etcd's tool in P parts (default 4) of N/P puts each: `put
  --conns=8 --clients=64 --key-size=K --val-size=256 --sequential-keys --key-space-size=N
  --total=N/P`. After each part: the tool's puts/s, slowest request and p99, the server's CPU
  per put (user+system of its process tree, /proc, over the tool run) and its resident memory
  (RSS of the process tree, /proc). Then the server gets SIGTERM by its pid (the seconds until
  it exits are reported; SIGKILL after `SHUTDOWN_TIMEOUT`), is started again on the same data
  dir and ports, and a linearizable Range of the first key is tried every `POLL_INTERVAL` (a
  new connection each time, each try with its own deadline, all bounded by the restart
  timeout): the seconds from the launch to the first answer are the restart time. RSS right
  after that answer; then one count-only Range over the whole keyspace (key `\\0`, range end
  `\\0`), which must count every key loaded; RSS after it.
- `cluster` (`--members 3`): three members of each kind, started as `cluster_tool` starts them,
  M keys (default 600,000) in Q parts (default 3), the tool's one endpoint being the leader
  (found again before each part). Per part the same figures (CPU and RSS summed over the three
  members) and the raft term before and after it (the highest `raftTerm` of `etcdctl endpoint
  status -w json` over the members): a term that moves is an election during the load. At the
  end a count-only Range through the leader must count M keys.
- `growth` (`--growth`; with `--members` as well, after those): one member, G keys (default 2,000,000) in three runs: the first K
  (default 100,000) into an empty store, the G - 2K in between, the last K into a store of
  G - K. The put rate of the last K over that of the first K says how the rate holds as the
  keyspace grows (issue 23: within 15%). A count-only Range at the end must count G keys.

The keys of one run of the tool are `--sequential-keys`: the tool writes key i % key-space-size
for i = 0..total-1, the varint of i padded with zeros to `--key-size`. Every run starts again
at i = 0, so runs with the same key size write the same keys. To load distinct keys part after
part, part p (from 0) uses `--key-size=16+p`: 16 B keys in the first part, one byte more in
each next one (the second part's key i sorts right after the first part's key i). With
`--same-keys` every part uses 16 B keys and rewrites the same N/P keys (N puts over N/P keys,
N revisions), which is what four runs of the tool's `put --total=N/4` do when nothing changes
between them.

Every tool run is bounded by its count and by `--timeout` (it is killed by its pid past it);
every wait (health, leader, first read, count, shutdown) has its own deadline. Output: a
Markdown table per scenario with etcd, ours and ours/etcd per row (`--out`, also on stdout)
and JSON (`--json`); progress on stderr. Exit status 1 when a run failed or a count is short.
A temporary directory is removed once its side succeeded, kept (logs, tool output) otherwise.

The server classes and the /proc readings come from `benchmarks.servers`, the argument set from
`benchmarks.options`, the tool runner from `benchmarks.etcd_tool` and the 3-member clusters from
`benchmarks.cluster_tool`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from benchmarks.cluster_tool import Cluster
from benchmarks.etcd_tool import RunResult, Workload, run_tool_on
from benchmarks.options import (
    add_common_args,
    finish_report,
    new_server,
    resolve_common_args,
    run_meta,
    stop_on_sigterm,
)
from benchmarks.servers import Server, named_log, process_tree_rss
from etcdserverpb import rpc_pb2, rpc_pb2_grpc

KEY_SIZE = 16
VAL_SIZE = 256
LOAD_FLAGS = ["--conns=8", "--clients=64"]
MAX_PARTS = 16
"""Part p uses --key-size=16+p: at most 31 B keys."""

DEFAULT_KEYS, DEFAULT_PARTS = 1_000_000, 4
DEFAULT_CLUSTER_KEYS, DEFAULT_CLUSTER_PARTS = 600_000, 3
DEFAULT_GROWTH_KEYS, DEFAULT_GROWTH_PROBE = 2_000_000, 100_000
QUICK_KEYS, QUICK_CLUSTER_KEYS = 8_000, 3_000
QUICK_GROWTH_KEYS, QUICK_GROWTH_PROBE = 6_000, 1_000

QUICK_RUN_TIMEOUT = 120.0
FULL_RUN_TIMEOUT = 1_200.0
"""Bound on one tool run (the growth run's middle part is 1,800,000 puts)."""
SHUTDOWN_TIMEOUT = 120.0
"""SIGTERM to exit, before SIGKILL: a server with a million keys may write on its way out."""
RESTART_TIMEOUT = 300.0
"""Launch to the first answered read, at most."""
POLL_INTERVAL = 0.02
"""A read is tried this often while the restarted server comes up."""
READ_ATTEMPT_TIMEOUT = 2.0
"""Each try's own deadline: a try on a connection that is accepted before the server serves
waits for it (and answers as soon as it does) rather than being abandoned."""
COUNT_TIMEOUT = 300.0
"""The count-only Range over every key."""
FIRST_KEY = b"\0" * KEY_SIZE
"""The tool's key 0 of the first part: the varint of 0, padded with zeros."""

MB = 1024 * 1024


log = named_log("keyspace_tool")


# --- what is loaded ------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One run of the tool: `total` sequential puts of `key_size` B keys."""

    name: str
    total: int
    key_size: int
    key_space: int

    def workload(self) -> Workload:
        args = [
            *LOAD_FLAGS,
            "put",
            f"--key-size={self.key_size}",
            f"--val-size={VAL_SIZE}",
            "--sequential-keys",
            f"--key-space-size={self.key_space}",
        ]
        return Workload(
            self.name.replace(" ", "-"),
            f"{self.total:,} puts of {self.key_size} B keys",
            lambda n: [*args, f"--total={n}"],
            full=self.total,
            quick=self.total,
        )


def even_parts(keys: int, parts: int, same_keys: bool = False) -> list[Part]:
    """`parts` runs of keys/parts puts; distinct keys per part unless `same_keys`."""
    each = keys // parts
    return [
        Part(f"part {i + 1}", each, KEY_SIZE if same_keys else KEY_SIZE + i, keys)
        for i in range(parts)
    ]


def growth_parts(keys: int, probe: int) -> list[Part]:
    """The first `probe` keys, the ones in between, the last `probe` (distinct key sizes)."""
    return [
        Part(f"first {probe:,}", probe, KEY_SIZE, keys),
        Part("in between", keys - 2 * probe, KEY_SIZE + 1, keys),
        Part(f"last {probe:,}", probe, KEY_SIZE + 2, keys),
    ]


def distinct_keys(parts: Sequence[Part]) -> int:
    """Keys in the store once every part is in: per key size, the longest run's count."""
    most: dict[int, int] = {}
    for p in parts:
        most[p.key_size] = max(most.get(p.key_size, 0), min(p.total, p.key_space))
    return sum(most.values())


# --- results -------------------------------------------------------------------------------


@dataclass
class PartResult:
    part: str
    key_size: int
    ok: bool = False
    error: str | None = None
    requests: int = 0
    puts_per_s: float | None = None
    tool_s: float | None = None
    slowest_ms: float | None = None
    p99_ms: float | None = None
    p50_ms: float | None = None
    server_cpu_s: float | None = None
    cpu_us_per_put: float | None = None
    rss_mb_after: float | None = None
    raft_term_before: int | None = None
    raft_term_after: int | None = None
    leader: str | None = None
    """The member the tool was pointed at (cluster)."""
    command: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class RestartResult:
    stop_s: float | None = None
    """SIGTERM to the process's exit."""
    stop_exit_code: int | None = None
    first_read_s: float | None = None
    """Launch to the first answered Range."""
    first_read_tries: int = 0
    first_key_found: bool = False
    rss_mb_after_first_read: float | None = None
    count: int | None = None
    count_s: float | None = None
    rss_mb_after_count: float | None = None


@dataclass
class Side:
    """One kind's run of one scenario."""

    server: str
    scenario: str
    ok: bool = False
    error: str | None = None
    keys_expected: int = 0
    keys_counted: int | None = None
    parts: list[PartResult] = field(default_factory=list)
    restart: RestartResult | None = None
    raft_term_start: int | None = None
    raft_term_end: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def puts_per_s(self) -> float | None:
        """Over the whole load: every part's puts over the sum of the tool's run times."""
        done = [p for p in self.parts if p.ok and p.tool_s]
        if not done or len(done) != len(self.parts):
            return None
        return sum(p.requests for p in done) / sum(p.tool_s or 0.0 for p in done)

    @property
    def slowest_ms(self) -> float | None:
        seen = [p.slowest_ms for p in self.parts if p.slowest_ms is not None]
        return max(seen) if seen else None

    @property
    def growth_ratio(self) -> float | None:
        """Put rate of the last part over the first's (the growth scenario)."""
        first, last = self.parts[0].puts_per_s, self.parts[-1].puts_per_s
        return last / first if self.ok and first and last else None


def part_of(part: Part, res: RunResult) -> PartResult:
    rep = res.report
    return PartResult(
        part=part.name,
        key_size=part.key_size,
        ok=res.ok,
        error=res.error,
        requests=rep.requests,
        puts_per_s=rep.rps if res.ok else None,
        tool_s=rep.total_s,
        slowest_ms=rep.slowest_ms,
        p99_ms=rep.percentiles_ms.get("99"),
        p50_ms=rep.percentiles_ms.get("50"),
        server_cpu_s=res.server_cpu_s,
        cpu_us_per_put=res.cpu_us_per_request,
        command=res.command,
        notes=list(res.notes),
    )


# --- reads over gRPC -----------------------------------------------------------------------


def first_read(server: Server, launched: float, timeout: float) -> tuple[float, int, bool]:
    """Try a linearizable Range of FIRST_KEY every POLL_INTERVAL, each on a new connection
    with its own deadline, until one answers (bounded by `timeout` from `launched`). Returns
    (seconds from `launched` to the answer, tries, whether the key was there)."""
    deadline = launched + timeout
    tries = 0
    last = ""
    while time.monotonic() < deadline:
        if server.proc is None or server.proc.poll() is not None:
            code = None if server.proc is None else server.proc.returncode
            raise RuntimeError(f"{server.kind} exited with code {code} on restart")
        tries += 1
        left = deadline - time.monotonic()
        with grpc.insecure_channel(server.endpoint) as ch:
            try:
                resp = rpc_pb2_grpc.KVStub(ch).Range(
                    rpc_pb2.RangeRequest(key=FIRST_KEY),
                    timeout=max(min(READ_ATTEMPT_TIMEOUT, left), 0.01),
                )
            except grpc.RpcError as e:
                last = f"{e.code()}"  # refused, not serving yet, or past its deadline
            else:
                return time.monotonic() - launched, tries, len(resp.kvs) == 1
        time.sleep(POLL_INTERVAL)  # the poll interval, bounded by the deadline
    raise TimeoutError(f"{server.kind}: no read answered {timeout:.0f}s after launch ({last})")


def count_keys(endpoint: str, timeout: float = COUNT_TIMEOUT) -> tuple[int, float]:
    """A linearizable count-only Range over every key; (count, seconds it took)."""
    t0 = time.monotonic()
    with grpc.insecure_channel(endpoint) as ch:
        resp = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=b"\0", range_end=b"\0", count_only=True), timeout=timeout
        )
    return int(resp.count), time.monotonic() - t0


def rss_mb(pids: Sequence[int]) -> float:
    return sum(process_tree_rss(p) for p in pids) / MB


# --- one member ----------------------------------------------------------------------------


def load(
    side: Side,
    parts: Sequence[Part],
    servers: Sequence[Server],
    target: Callable[[], Server],
    args: argparse.Namespace,
    work: Path,
    term: Callable[[], int] | None = None,
) -> bool:
    """Run the parts one after the other into `target()` (asked again before each part);
    CPU and RSS count `servers`. False once a part failed (the rest are not run)."""
    for part in parts:
        into = target()
        before = term() if term else None
        res = run_tool_on(
            args.tool, servers, into.endpoint, part.workload(), part.total, args.timeout, work
        )
        pr = part_of(part, res)
        pr.rss_mb_after = rss_mb([s.pid for s in servers if s.alive])
        pr.raft_term_before = before
        if term is not None:
            try:
                pr.raft_term_after = term()
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                pr.notes.append(f"raft term after the part not read: {e}")
        pr.leader = into.work_dir.name if term else None
        side.parts.append(pr)
        log(
            f"  {side.server} {part.name}: "
            + (
                f"{pr.puts_per_s:,.0f} puts/s, slowest {pr.slowest_ms:.0f} ms, p99 "
                f"{pr.p99_ms or 0:.1f} ms, {pr.cpu_us_per_put or 0:.0f} µs CPU/put, "
                f"RSS {pr.rss_mb_after:.0f} MB"
                + (f", term {before} -> {pr.raft_term_after}" if term else "")
                if pr.ok and pr.puts_per_s and pr.slowest_ms is not None
                else f"FAILED: {pr.error}"
            )
        )
        if not pr.ok:
            side.error = f"{part.name}: {pr.error}"
            return False
    return True


def check_count(side: Side, counted: int) -> None:
    side.keys_counted = counted
    if counted != side.keys_expected:
        side.error = f"counted {counted:,} keys, expected {side.keys_expected:,}"
    else:
        side.ok = True


def run_single(kind: str, parts: Sequence[Part], args: argparse.Namespace, work: Path) -> Side:
    """Load, SIGTERM, restart on the same data dir, first read, count every key."""
    side = Side(server=kind, scenario="single", keys_expected=distinct_keys(parts))
    server = new_server(kind, work, args)
    try:
        server.start()
        log(f"  {kind} ready on {server.endpoint} (pid {server.pid}), data in {work}")
        if not load(side, parts, [server], lambda: server, args, work):
            return side
        rs = side.restart = RestartResult()
        t0 = time.monotonic()
        server.stop(timeout=SHUTDOWN_TIMEOUT)
        rs.stop_s = time.monotonic() - t0
        rs.stop_exit_code = None if server.proc is None else server.proc.returncode
        launched = time.monotonic()
        server.launch()
        rs.first_read_s, rs.first_read_tries, rs.first_key_found = first_read(
            server, launched, RESTART_TIMEOUT
        )
        rs.rss_mb_after_first_read = rss_mb([server.pid])
        rs.count, rs.count_s = count_keys(server.endpoint)
        rs.rss_mb_after_count = rss_mb([server.pid])
        log(
            f"  {kind}: SIGTERM to exit {rs.stop_s:.1f} s (code {rs.stop_exit_code}); restarted "
            f"(pid {server.pid}): first read after {rs.first_read_s:.2f} s ({rs.first_read_tries} "
            f"tries), RSS {rs.rss_mb_after_first_read:.0f} MB; {rs.count:,} keys counted in "
            f"{rs.count_s:.2f} s, RSS {rs.rss_mb_after_count:.0f} MB"
        )
        if not rs.first_key_found:
            side.notes.append("the first read did not find the first key")
        check_count(side, rs.count)
    except Exception as e:
        side.error = f"{type(e).__name__}: {e}"
    finally:
        server.stop()
        if not side.ok:
            side.notes.append(f"server log tail: {server.log_tail(5)}")
    return side


def run_growth(kind: str, parts: Sequence[Part], args: argparse.Namespace, work: Path) -> Side:
    """Load the three growth parts into one fresh member, then count."""
    side = Side(server=kind, scenario="growth", keys_expected=distinct_keys(parts))
    server = new_server(kind, work, args)
    try:
        server.start()
        log(f"  {kind} ready on {server.endpoint} (pid {server.pid}), data in {work}")
        if load(side, parts, [server], lambda: server, args, work):
            check_count(side, count_keys(server.endpoint)[0])
            if side.growth_ratio is not None:
                log(f"  {kind}: last/first put rate {side.growth_ratio:.2f}")
    except Exception as e:
        side.error = f"{type(e).__name__}: {e}"
    finally:
        server.stop()
        if not side.ok:
            side.notes.append(f"server log tail: {server.log_tail(5)}")
    return side


# --- three members -------------------------------------------------------------------------


def raft_term(cluster: Cluster) -> int:
    """The highest raft term any live member reports."""
    terms = []
    for m in cluster.members:
        if m.alive:
            st = cluster.endpoint_status(m)
            terms.append(int(st.get("raftTerm") or st.get("header", {}).get("raft_term") or 0))
    if not terms:
        raise RuntimeError("no live member")
    return max(terms)


def run_cluster(kind: str, parts: Sequence[Part], args: argparse.Namespace, root: Path) -> Side:
    """Three fresh members; the parts through the leader; terms around each part; count."""
    side = Side(server=kind, scenario="cluster", keys_expected=distinct_keys(parts))
    cluster: Cluster | None = None
    try:
        cluster = Cluster(kind, root, args)
        log(cluster.ready_line(cluster.start()))
        c = cluster
        side.raft_term_start = raft_term(c)
        if load(side, parts, c.members, c.wait_leader, args, root, lambda: raft_term(c)):
            side.raft_term_end = raft_term(c)
            check_count(side, count_keys(c.wait_leader().endpoint)[0])
    except Exception as e:
        side.error = f"{type(e).__name__}: {e}"
    finally:
        if cluster is not None:
            cluster.stop()
            if not side.ok:
                side.notes.append(f"member log tails: {cluster.log_tails(3)}")
    return side


# --- the report ----------------------------------------------------------------------------


@dataclass
class Row:
    """One line of a table: a figure of each side, and which way is better."""

    name: str
    etcd: float | None
    ours: float | None
    fmt: str = "{:,.0f}"
    better: str = "higher"
    target: str = ""

    @property
    def ratio(self) -> float | None:
        """ours/etcd; none for rows with no better way (counts, raft terms)."""
        if self.better == "—" or self.ours is None or not self.etcd:
            return None
        return self.ours / self.etcd

    def cells(self) -> list[str]:
        def num(x: float | None) -> str:
            return "—" if x is None else self.fmt.format(x)

        ratio = "—" if self.ratio is None else f"{self.ratio:.2f}"
        return [self.name, num(self.etcd), num(self.ours), ratio, self.better, self.target]


@dataclass
class Scenario:
    name: str
    title: str
    parts: list[Part]
    ours: Side
    etcd: Side

    def rows(self) -> list[Row]:
        o, e = self.ours, self.etcd
        rows: list[Row] = []

        def both(
            name: str, get: Callable[[Side], float | None], fmt: str, better: str, target: str = ""
        ) -> None:
            rows.append(Row(name, get(e), get(o), fmt, better, target))

        def part_rows(i: int, p: Part) -> None:
            def at(s: Side) -> PartResult | None:
                return s.parts[i] if i < len(s.parts) else None

            def pick(attr: str) -> Callable[[Side], float | None]:
                def get(s: Side) -> float | None:
                    pr = at(s)
                    return None if pr is None else getattr(pr, attr)

                return get

            label = p.name
            slow_target = {"single": "<= 200 ms, flat", "cluster": "<= 300 ms"}.get(self.name, "")
            both(f"{label}: puts/s", pick("puts_per_s"), "{:,.0f}", "higher")
            both(
                f"{label}: slowest request, ms", pick("slowest_ms"), "{:,.0f}", "lower", slow_target
            )
            both(f"{label}: p99, ms", pick("p99_ms"), "{:,.1f}", "lower")
            summed = " (3 members)" if self.name == "cluster" else ""
            both(
                f"{label}: server CPU per put, µs{summed}",
                pick("cpu_us_per_put"),
                "{:,.0f}",
                "lower",
            )
            both(f"{label}: RSS after, MB{summed}", pick("rss_mb_after"), "{:,.0f}", "lower")
            if self.name == "cluster":
                both(f"{label}: raft term before", pick("raft_term_before"), "{:.0f}", "—")
                both(
                    f"{label}: raft term after", pick("raft_term_after"), "{:.0f}", "—", "unchanged"
                )

        for i, p in enumerate(self.parts):
            part_rows(i, p)
        target = {"single": ">= 0.9x", "cluster": ""}.get(self.name, "")
        both("whole load: puts/s", lambda s: s.puts_per_s, "{:,.0f}", "higher", target)
        both("whole load: slowest request, ms", lambda s: s.slowest_ms, "{:,.0f}", "lower")
        if self.name == "single":

            def rs(attr: str) -> Callable[[Side], float | None]:
                def get(s: Side) -> float | None:
                    return None if s.restart is None else getattr(s.restart, attr)

                return get

            both("SIGTERM to exit, s", rs("stop_s"), "{:,.2f}", "lower")
            both("restart to first read, s", rs("first_read_s"), "{:,.2f}", "lower", "<= etcd's")
            both(
                "RSS after the first read, MB",
                rs("rss_mb_after_first_read"),
                "{:,.0f}",
                "lower",
                "<= etcd's",
            )
            both("count-only read of every key, s", rs("count_s"), "{:,.3f}", "lower")
            both(
                "RSS after the count, MB", rs("rss_mb_after_count"), "{:,.0f}", "lower", "<= etcd's"
            )
        if self.name == "cluster":
            both(
                "elections during the load",
                lambda s: (
                    None
                    if s.raft_term_end is None or s.raft_term_start is None
                    else s.raft_term_end - s.raft_term_start
                ),
                "{:.0f}",
                "lower",
                "0",
            )
        if self.name == "growth":
            both("last / first put rate", lambda s: s.growth_ratio, "{:.2f}", "higher", ">= 0.85")
        both(
            "keys counted", lambda s: s.keys_counted, "{:,.0f}", "—", f"{self.ours.keys_expected:,}"
        )
        return rows


def markdown(scenarios: list[Scenario], meta: dict[str, Any]) -> str:
    lines = [
        "# Large keyspace: queue-server vs etcd, driven by etcd's tools/benchmark",
        "",
        f"{meta['date']}; {meta['mode']} mode; {meta['cpus']} CPUs; load average at start "
        f"{meta['load_average_at_start']}; etcd {meta['etcd_version']}; our server from "
        f"{meta['ours_dir']} at commit {meta['commit']}; temporary data dirs under "
        f"{meta['tmpdir']}. Generated by `{meta['command']}`.",
        "",
    ]
    for sc in scenarios:
        lines += [
            f"## {sc.title}",
            "",
            "| row | etcd | ours | ours/etcd | better | issue 23's target |",
            "|---|--:|--:|--:|---|---|",
        ]
        lines += ["| " + " | ".join(r.cells()) + " |" for r in sc.rows()]
        lines += ["", "Runs of the tool (flags after `--endpoints=...`, the same for both):", ""]
        for p in sc.parts:
            lines.append(f"- {p.name}: `{' '.join(p.workload().args(p.total))}`")
        for s in (sc.etcd, sc.ours):
            extra: list[str] = []
            if not s.ok:
                extra.append(f"FAILED: {s.error}")
            if s.restart is not None and s.restart.stop_exit_code is not None:
                extra.append(
                    f"exit code after SIGTERM {s.restart.stop_exit_code}; "
                    f"{s.restart.first_read_tries} read tries until the first answer"
                )
            for pr in s.parts:
                if pr.notes or not pr.ok:
                    extra.append(
                        f"{pr.part}: " + "; ".join([*([pr.error] if pr.error else []), *pr.notes])
                    )
            leaders = [pr.leader for pr in s.parts if pr.leader]
            if leaders:
                extra.append("the tool's endpoint (the leader) per part: " + ", ".join(leaders))
            extra += s.notes
            if extra:
                lines.append(f"- {s.server}: " + "; ".join(x.replace("|", "/") for x in extra))
        lines.append("")
    lines += [
        "Each side runs on a fresh data dir, ours first, then etcd, never both at once. Server "
        "CPU is user+system of the server's process tree (all members in a cluster) over the "
        "tool's run, per put; RSS is that tree's resident memory (/proc) right after. Restart: "
        "from the launch to the first answered linearizable Range, tried every "
        f"{POLL_INTERVAL * 1000:.0f} ms. The ratio is ours/etcd whichever way is better.",
        "",
    ]
    return "\n".join(lines)


def to_json(scenarios: list[Scenario], meta: dict[str, Any]) -> dict[str, Any]:
    out = []
    for sc in scenarios:
        entry: dict[str, Any] = {
            "scenario": sc.name,
            "title": sc.title,
            "parts": [{**asdict(p), "tool_args": p.workload().args(p.total)} for p in sc.parts],
            "rows": [
                {
                    "row": r.name,
                    "etcd": r.etcd,
                    "ours": r.ours,
                    "ours_over_etcd": r.ratio,
                    "better": r.better,
                    "target": r.target,
                }
                for r in sc.rows()
            ],
        }
        for s in (sc.ours, sc.etcd):
            d = asdict(s)
            d["puts_per_s"] = s.puts_per_s
            d["slowest_ms"] = s.slowest_ms
            d["growth_ratio"] = s.growth_ratio
            entry[s.server] = d
        out.append(entry)
    return {"meta": meta, "scenarios": out}


# --- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.keyspace_tool",
        description="A large keyspace in queue-server and in etcd (issue 23): load, restart, "
        "read; 3-member clusters; the put rate as the keyspace grows.",
    )
    p.add_argument(
        "--members",
        default=None,
        help="comma-separated, from 1 (one member: load, restart, read) and 3 (a 3-member "
        "cluster: load through the leader, raft terms); default 1, or none with --growth",
    )
    p.add_argument(
        "--growth",
        action="store_true",
        help="the growth scenario (alone, unless --members is given too)",
    )
    p.add_argument("--keys", type=int, default=None, help=f"one member's keys ({DEFAULT_KEYS:,})")
    p.add_argument("--parts", type=int, default=DEFAULT_PARTS, help="in this many runs (4)")
    p.add_argument(
        "--cluster-keys", type=int, default=None, help=f"a cluster's ({DEFAULT_CLUSTER_KEYS:,})"
    )
    p.add_argument(
        "--cluster-parts", type=int, default=DEFAULT_CLUSTER_PARTS, help="in this many runs (3)"
    )
    p.add_argument(
        "--growth-keys", type=int, default=None, help=f"the growth run's ({DEFAULT_GROWTH_KEYS:,})"
    )
    p.add_argument(
        "--growth-probe",
        type=int,
        default=None,
        help=f"its first and last runs' puts ({DEFAULT_GROWTH_PROBE:,})",
    )
    p.add_argument(
        "--same-keys",
        action="store_true",
        help="every part of the one-member and cluster loads rewrites the same keys (16 B): "
        "N puts over N/parts keys",
    )
    add_common_args(
        p,
        QUICK_RUN_TIMEOUT,
        FULL_RUN_TIMEOUT,
        quick_help=f"tiny sizes ({QUICK_KEYS:,} keys, {QUICK_CLUSTER_KEYS:,} in a cluster, growth "
        f"{QUICK_GROWTH_KEYS:,}/{QUICK_GROWTH_PROBE:,}): checks the harness, claims nothing",
    )
    args = p.parse_args(argv)
    if args.members is None:
        args.member_counts = [] if args.growth else [1]
    else:
        try:
            args.member_counts = sorted({int(x) for x in args.members.split(",") if x.strip()})
        except ValueError:
            args.member_counts = []
        if not args.member_counts or any(m not in (1, 3) for m in args.member_counts):
            p.error(f"--members takes 1, 3 or 1,3, not {args.members!r}")
    q = args.quick
    if args.keys is None:
        args.keys = QUICK_KEYS if q else DEFAULT_KEYS
    if args.cluster_keys is None:
        args.cluster_keys = QUICK_CLUSTER_KEYS if q else DEFAULT_CLUSTER_KEYS
    if args.growth_keys is None:
        args.growth_keys = QUICK_GROWTH_KEYS if q else DEFAULT_GROWTH_KEYS
    if args.growth_probe is None:
        args.growth_probe = QUICK_GROWTH_PROBE if q else DEFAULT_GROWTH_PROBE
    for keys, parts, what in (
        (args.keys, args.parts, "--keys/--parts"),
        (args.cluster_keys, args.cluster_parts, "--cluster-keys/--cluster-parts"),
    ):
        if not 1 <= parts <= MAX_PARTS or keys < parts or keys % parts:
            p.error(f"{what}: 1 to {MAX_PARTS} parts that divide the keys evenly")
    if args.growth_probe < 1 or args.growth_keys <= 2 * args.growth_probe:
        p.error("--growth-keys must be more than twice --growth-probe")
    resolve_common_args(p, args, QUICK_RUN_TIMEOUT, FULL_RUN_TIMEOUT)
    return args


def scenario_plan(args: argparse.Namespace) -> list[tuple[str, str, list[Part]]]:
    plan: list[tuple[str, str, list[Part]]] = []
    same = " (every part the same keys)" if args.same_keys else ""
    if 1 in args.member_counts:
        parts = even_parts(args.keys, args.parts, args.same_keys)
        plan.append(
            (
                "single",
                f"One member: {args.keys:,} puts in {args.parts} parts{same}, then a restart",
                parts,
            )
        )
    if 3 in args.member_counts:
        parts = even_parts(args.cluster_keys, args.cluster_parts, args.same_keys)
        plan.append(
            (
                "cluster",
                f"Three members: {args.cluster_keys:,} puts in {args.cluster_parts} parts "
                f"through the leader{same}",
                parts,
            )
        )
    if args.growth:
        g, k = args.growth_keys, args.growth_probe
        plan.append(
            (
                "growth",
                f"One member, growth: {g:,} keys, the put rate of the last {k:,} against the "
                f"first {k:,}",
                growth_parts(g, k),
            )
        )
    return plan


RUNNERS: dict[str, Callable[[str, Sequence[Part], argparse.Namespace, Path], Side]] = {
    "single": run_single,
    "cluster": run_cluster,
    "growth": run_growth,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    mode = "quick" if args.quick else "full"
    started = time.monotonic()
    meta = run_meta(args)
    meta |= {
        "tool": args.tool,
        "tmpdir": tempfile.gettempdir(),
        "command": "python -m benchmarks.keyspace_tool "
        + " ".join(a for a in (argv if argv is not None else sys.argv[1:])),
        "key_size": KEY_SIZE,
        "val_size": VAL_SIZE,
        "same_keys": args.same_keys,
    }
    scenarios: list[Scenario] = []
    for name, title, parts in scenario_plan(args):
        log(f"{title} ({mode})")
        sides: dict[str, Side] = {}
        for kind in ("ours", "etcd"):
            work = Path(tempfile.mkdtemp(prefix=f"keyspace-tool-{name}-{kind}-"))
            side = sides[kind] = RUNNERS[name](kind, parts, args, work)
            if side.ok:
                shutil.rmtree(work, ignore_errors=True)
            else:
                log(f"  {kind}: FAILED: {side.error}; kept {work} (logs, tool output)")
        scenarios.append(Scenario(name, title, parts, sides["ours"], sides["etcd"]))
    meta["duration_s"] = round(time.monotonic() - started, 1)
    meta["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    failed = [
        f"{sc.name} on {s.server}" for sc in scenarios for s in (sc.ours, sc.etcd) if not s.ok
    ]
    md, doc = markdown(scenarios, meta), to_json(scenarios, meta)
    return finish_report(args, md, doc, failed, started, log)


if __name__ == "__main__":
    sys.exit(main())
