"""Cluster suite: a 3-member cluster of each kind on loopback.

The runner starts three members of ours and three of etcd (`CLUSTER_SIZE` in
`benchmarks/workloads/__init__.py`), each bootstrapped with one --initial-cluster
on 127.0.0.1 peer ports, and waits until all members of a cluster name the same
leader (Maintenance.Status: `leader` against `header.member_id`). Server CPU and
RSS are those of the three members summed. Five rows, in this order, on one pair
of clusters (the last one kills a member, so it runs last):

1. **Put spread over the members.** The put loop of the put suite (distinct keys,
   256-byte values, 64 in flight) from client processes that each open one
   channel to every member and send request `seq` to member `seq % 3`: a third of
   the puts reach the leader, two thirds reach a follower, which hands them on
   (ours forwards the command to the leader; etcd's follower forwards the
   proposal through Raft).
2. **Put to the leader.** The same, every channel to the leader.
3. **Linearizable range on a follower.** Range (the default, linearizable) of one
   key, 64 in flight, every channel to one follower: each read costs the follower
   a ReadIndex round trip to the leader.
4. **A queue across members.** One producer and four consumers in one client
   process, its channels alternating between the two followers; the leader
   orders every assignment. Ours runs the native queue (consumers receive
   handed-over delivery keys), etcd the queue suite's recipe.
5. **Leader failover.** A writer in the orchestrator puts a key every
   `ATTEMPT_INTERVAL` round robin over the two followers, without waiting for the
   answer (each attempt has its own `ATTEMPT_TIMEOUT`; a client retrying as fast
   as that). After `STEADY` seconds of successful writes the leader is killed with
   SIGKILL (by pid); the row's figure is the time from the kill to the first
   success of a put issued after it. The table and chart show figures in the
   ops/s column, so this row's measurement is one recovery over that many
   seconds: ops/s = 1 / seconds (higher is better, so the ratio reads like the
   other rows); the seconds are in `extra.failover_s` and in the note, beside the
   time until both survivors named one new leader (`extra.leader_after_s`).
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
import time
from dataclasses import dataclass, replace

import grpc

from benchmarks.results import Failed, Measurement, Outcome
from benchmarks.servers import BenchCluster, BenchServer, ResourceMonitor
from benchmarks.workloads.base import RunContext, Workload
from benchmarks.workloads.kv import VALUE_SIZE, put_program, range_program
from benchmarks.workloads.queue import (
    BACKLOG,
    NATIVE_ACKS_IN_FLIGHT,
    NATIVE_BACKLOG,
    NATIVE_PRODUCER_IN_FLIGHT,
    DeliveryCheck,
    native_queue_program,
    queue_recipe_program,
)
from etcdserverpb import rpc_pb2, rpc_pb2_grpc

MEMBERS = 3
CONCURRENCY = 64
QUICK_SECONDS = 0.5
"""The timed window of rows 1-3 in quick mode, which also skips their warm-up, so
that the quick suite (six members to start, two elections to wait for) stays short."""
PUT_OPS = (200_000, 2_000)
RANGE_OPS = (400_000, 4_000)
RANGE_KEY = b"/bench/cluster/range"

ATTEMPT_INTERVAL = 0.02
"""The failover writer issues a put this often (seconds): the resolution of the row."""
ATTEMPT_TIMEOUT = 2.0
STEADY = (1.0, 0.2)
"""Seconds of writes before the kill (full, quick); at least one must succeed."""
RECOVERY_TIMEOUT = 30.0
"""Bound on the wait for a put to succeed after the kill."""
STATUS_TIMEOUT = 0.5


def _cluster(ctx: RunContext) -> BenchCluster:
    if not isinstance(ctx.server, BenchCluster):
        raise RuntimeError("the cluster suite runs against a cluster (CLUSTER_SIZE)")
    return ctx.server


def _window(ctx: RunContext) -> RunContext:
    """The context with this suite's timed window (shorter, no warm-up, in quick mode)."""
    if not ctx.budget.quick:
        return ctx
    seconds = min(ctx.budget.seconds, QUICK_SECONDS)
    return replace(ctx, budget=replace(ctx.budget, seconds=seconds, warmup_seconds=0.0))


def _progress(ctx: RunContext, message: str) -> None:
    print(f"{'':11}cluster | {ctx.kind}: {message}", file=sys.stderr, flush=True)


def _leader_note(cluster: BenchCluster, before: BenchServer, outcome: Outcome) -> Outcome:
    """Say who led; say so if the leader changed during the row."""
    if not isinstance(outcome, Measurement):
        return outcome
    after = cluster.wait_leader()
    name = cluster.name_of
    if after is before:
        outcome.note = f"leader {name(before)}"
    else:
        outcome.note = f"the leader changed during the row ({name(before)} -> {name(after)})"
    return outcome


# -- rows 1-3: closed loops through the client processes --------------------------


def _put(ctx: RunContext, *, to_leader: bool) -> Outcome:
    cluster = _cluster(ctx)
    leader = cluster.wait_leader()
    targets = [leader] if to_leader else cluster.live()
    run = _window(ctx)
    procs = run.procs(CONCURRENCY)
    outcome, _ = run.run_clients(
        put_program,
        procs=procs,
        concurrency=CONCURRENCY,
        max_ops=ctx.budget.pick(*PUT_OPS),
        params={
            "value_size": VALUE_SIZE,
            "prefix": f"/bench/cluster/{'leader' if to_leader else 'spread'}",
        },
        endpoints=[m.endpoint for m in targets],
    )
    ctx.detail = run.detail
    return _leader_note(cluster, leader, outcome)


def _put_spread(ctx: RunContext) -> Outcome:
    return _put(ctx, to_leader=False)


def _put_leader(ctx: RunContext) -> Outcome:
    return _put(ctx, to_leader=True)


def _range_follower(ctx: RunContext) -> Outcome:
    cluster = _cluster(ctx)
    leader = cluster.wait_leader()
    follower = cluster.followers(leader)[0]
    with ctx.channel(leader.endpoint) as ch:
        rpc_pb2_grpc.KVStub(ch).Put(
            rpc_pb2.PutRequest(key=RANGE_KEY, value=b"v" * VALUE_SIZE), timeout=10
        )
    run = _window(ctx)
    outcome, _ = run.run_clients(
        range_program,
        procs=run.procs(CONCURRENCY),
        concurrency=CONCURRENCY,
        max_ops=ctx.budget.pick(*RANGE_OPS),
        params={"key": RANGE_KEY, "expect": 1},
        endpoints=[follower.endpoint],
    )
    ctx.detail = run.detail
    outcome = _leader_note(cluster, leader, outcome)
    if isinstance(outcome, Measurement):
        outcome.note += f"; reads on follower {cluster.name_of(follower)}"
    return outcome


# -- row 4: a queue across members ------------------------------------------------

QUEUE_CONSUMERS = 4
QUEUE_MESSAGES = (50_000, 300)


def _queue_across(ctx: RunContext) -> Outcome:
    """One producer and QUEUE_CONSUMERS consumers in one client process whose
    channels alternate between the two followers: the producer and consumers 0
    and 2 on one, consumers 1 and 3 on the other; the leader orders everything.
    Ours: the native queue (consumers off the leader receive handed-over delivery
    keys). etcd: the recipe of the queue suite (prefix watch, claim by Txn)."""
    cluster = _cluster(ctx)
    leader = cluster.wait_leader()
    followers = cluster.followers(leader)
    messages = ctx.budget.pick(*QUEUE_MESSAGES)
    if ctx.kind == "etcd":
        program = queue_recipe_program
        params: dict[str, object] = {
            "prefix": b"/bench/cluster/queue/",
            "messages": messages,
            "backlog": BACKLOG,
        }
    else:
        program = native_queue_program
        params = {
            "queue": "bench-cluster",
            "end_key": b"/bench/cluster/queue-end",
            "messages": messages,
            "put_batch": 1,
            "ack_batch": 1,
            "producer_tasks": NATIVE_PRODUCER_IN_FLIGHT,
            "acks_in_flight": NATIVE_ACKS_IN_FLIGHT,
            "backlog": NATIVE_BACKLOG,
        }
    outcome, payload = ctx.run_clients(
        program,
        procs=1,
        concurrency=QUEUE_CONSUMERS,
        max_ops=messages,
        params=params,
        per_proc=[{"consumers": QUEUE_CONSUMERS, "producer": True}],
        channels=QUEUE_CONSUMERS // 2,
        warmup=False,
        endpoints=[m.endpoint for m in followers],
    )
    outcome = _leader_note(cluster, leader, outcome)
    if isinstance(outcome, Measurement) and ctx.kind != "etcd":
        check = DeliveryCheck.of(payload)
        outcome.extra.update(lost=check.lost, duplicates=check.duplicates)
        outcome.note += "; " + check.note(behind=bool(outcome.extra.get("timed_out_tasks")))
    return outcome


# -- row 5: leader failover, from the orchestrator --------------------------------


@dataclass
class Attempt:
    issued: float
    future: grpc.Future[rpc_pb2.PutResponse]
    done_at: float | None = None
    ok: bool = False
    cancelled: bool = False


class Writer:
    """Puts every ATTEMPT_INTERVAL, round robin over `stubs`, none waiting for the
    one before (each attempt bounded by ATTEMPT_TIMEOUT). Completion times come
    from gRPC's done callbacks, so they do not depend on how often `run` polls."""

    def __init__(self, stubs: list[rpc_pb2_grpc.KVStub]) -> None:
        self.stubs = stubs
        self.attempts: list[Attempt] = []
        self.value = b"f" * VALUE_SIZE
        self._lock = threading.Lock()
        self._since: float | None = None
        self._first: Attempt | None = None
        """The earliest completed success among the attempts issued at or after
        `_since`."""

    def attempt(self) -> None:
        n = len(self.attempts)
        request = rpc_pb2.PutRequest(key=b"/bench/cluster/failover/%06d" % n, value=self.value)
        issued = time.monotonic()
        future = self.stubs[n % len(self.stubs)].Put.future(request, timeout=ATTEMPT_TIMEOUT)
        attempt = Attempt(issued, future)
        self.attempts.append(attempt)
        future.add_done_callback(functools.partial(self._done, attempt))

    def _done(self, attempt: Attempt, future: grpc.Future[rpc_pb2.PutResponse]) -> None:
        """Done callback (a gRPC thread, or this one if already done)."""
        done_at = time.monotonic()
        cancelled = future.cancelled()
        ok = not cancelled and future.exception() is None
        with self._lock:
            attempt.done_at, attempt.cancelled, attempt.ok = done_at, cancelled, ok
            since = self._since
            if ok and since is not None and attempt.issued >= since:
                first = self._first
                if first is None or (first.done_at is not None and done_at < first.done_at):
                    self._first = attempt

    def ok_count(self) -> int:
        with self._lock:
            return sum(1 for a in self.attempts if a.ok)

    def run(self, until: float, stop_after: float | None = None) -> Attempt | None:
        """Write until `until` (monotonic), or, with `stop_after`, until a put issued
        at or after `stop_after` succeeded (returned). Bounded in time and count."""
        if stop_after is not None:
            with self._lock:
                self._since, self._first = stop_after, None
        next_at = time.monotonic()
        limit = len(self.attempts) + int((until - next_at) / ATTEMPT_INTERVAL) + 2
        while time.monotonic() < until and len(self.attempts) < limit:
            if stop_after is not None and self._first is not None:
                break
            now = time.monotonic()
            if now >= next_at:
                self.attempt()
                next_at = max(next_at + ATTEMPT_INTERVAL, now)
            time.sleep(0.002)  # the loop's tick; completion times come from callbacks
        with self._lock:
            return self._first if stop_after is not None else None

    def cancel(self) -> None:
        for a in self.attempts:
            a.future.cancel()


class LeaderWatch(threading.Thread):
    """Polls Status on the survivors until they name one leader other than `dead`;
    `found_at` is when (monotonic), None if not before the deadline."""

    def __init__(self, cluster: BenchCluster, dead: BenchServer, deadline: float) -> None:
        super().__init__(name="leader-watch", daemon=True)
        self.cluster = cluster
        self.dead = dead
        self.deadline = deadline
        self.found_at: float | None = None
        self.leader: BenchServer | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        survivors = self.cluster.followers(self.dead)
        channels = [grpc.insecure_channel(m.endpoint) for m in survivors]
        stubs = [rpc_pb2_grpc.MaintenanceStub(ch) for ch in channels]
        dead_ids = {i for i, m in self.cluster.member_ids.items() if m is self.dead}
        try:
            while time.monotonic() < self.deadline and not self.halt.is_set():
                try:
                    named = {
                        s.Status(rpc_pb2.StatusRequest(), timeout=STATUS_TIMEOUT).leader
                        for s in stubs
                    }
                except grpc.RpcError:
                    named = set()
                if len(named) == 1 and not named & ({0} | dead_ids):
                    self.found_at = time.monotonic()
                    self.leader = self.cluster.member_ids.get(named.pop())
                    return
                self.halt.wait(ATTEMPT_INTERVAL)
        finally:
            for ch in channels:
                ch.close()


def _failover(ctx: RunContext) -> Outcome:
    cluster = _cluster(ctx)
    leader = cluster.wait_leader()
    survivors = cluster.followers(leader)
    name = cluster.name_of
    channels = [grpc.insecure_channel(m.endpoint) for m in survivors]
    writer = Writer([rpc_pb2_grpc.KVStub(ch) for ch in channels])
    monitor = ResourceMonitor(cluster.pids)
    cpu0 = time.process_time()
    monitor.start()
    watch: LeaderWatch | None = None
    try:
        for ch in channels:
            grpc.channel_ready_future(ch).result(timeout=ctx.budget.setup_timeout)
        steady = ctx.budget.pick(*STEADY)
        writer.run(until=time.monotonic() + steady)
        if writer.ok_count() == 0:
            return Failed(f"no put succeeded in {steady:.1f}s before the kill")
        before = len(writer.attempts)
        _progress(ctx, f"SIGKILL leader {name(leader)} (pid {leader.pid})")
        killed_at = time.monotonic()
        cluster.kill(leader)
        watch = LeaderWatch(cluster, leader, killed_at + RECOVERY_TIMEOUT)
        watch.start()
        first = writer.run(until=killed_at + RECOVERY_TIMEOUT, stop_after=killed_at)
        watch.join(timeout=RECOVERY_TIMEOUT)
    finally:
        if watch is not None:
            watch.halt.set()
        writer.cancel()
        cpu, rss = monitor.stop()
        for ch in channels:
            ch.close()
    if first is None or first.done_at is None:
        return Failed(f"no put succeeded within {RECOVERY_TIMEOUT:.0f}s of killing the leader")
    seconds = first.done_at - killed_at
    upto = [a for a in writer.attempts[before:] if a.issued <= first.issued]
    failed = sum(1 for a in upto if a.done_at is not None and not (a.ok or a.cancelled))
    issued = [killed_at] + [a.issued for a in upto]
    extra = {
        "failover_s": seconds,
        "attempts_after_kill": float(len(upto)),
        "failed_attempts_after_kill": float(failed),
        "first_ok_latency_ms": (first.done_at - first.issued) * 1000,
        "max_attempt_gap_ms": max(b - a for a, b in itertools.pairwise(issued)) * 1000,
    }
    note = (
        f"SIGKILL of leader {name(leader)}: the first put issued after it succeeded "
        f"{seconds:.2f}s later ({len(upto)} attempts, {failed} failed)"
    )
    if watch.found_at is not None:
        extra["leader_after_s"] = watch.found_at - killed_at
        new = name(watch.leader) if watch.leader else "?"
        note += f"; survivors named {new} leader after {extra['leader_after_s']:.2f}s"
    _progress(ctx, note)
    return Measurement(
        ops=1,
        seconds=seconds,
        errors=0,
        p50_ms=None,
        p99_ms=None,
        p999_ms=None,
        cpu_s=cpu,
        rss_mb=rss,
        client_cpu_s=time.process_time() - cpu0,
        client_procs=1,
        concurrency=1,
        extra=extra,
        note=note + "; the ops/s column holds 1/seconds",
    )


CLUSTER = [
    Workload(
        suite="cluster",
        name=f"3-member cluster put, {CONCURRENCY} in flight",
        about=(
            f"Put of distinct keys with {VALUE_SIZE}-byte values, {CONCURRENCY} in flight, "
            "round robin over the 3 members' endpoints (2/3 reach a follower, which hands "
            "them to the leader); server cpu/RSS of the 3 members."
        ),
        run=_put_spread,
    ),
    Workload(
        suite="cluster",
        name=f"3-member cluster put to the leader, {CONCURRENCY} in flight",
        about=(
            f"Put of distinct keys with {VALUE_SIZE}-byte values, {CONCURRENCY} in flight, "
            "every request to the leader; server cpu/RSS of the 3 members."
        ),
        run=_put_leader,
    ),
    Workload(
        suite="cluster",
        name=f"3-member cluster linearizable range on a follower, {CONCURRENCY} in flight",
        about=(
            f"Range (linearizable, the default) of one key on one follower, {CONCURRENCY} "
            "in flight: each read waits for the leader's ReadIndex."
        ),
        run=_range_follower,
    ),
    Workload(
        suite="cluster",
        name=f"queue across members, 1 producer, {QUEUE_CONSUMERS} consumers",
        about=(
            "One producer on a follower, consumers alternating between the two "
            "followers, the leader dispatching: messages/s acked, produce-to-receipt "
            "latency. Ours: the native queue; etcd: the queue suite's recipe."
        ),
        run=_queue_across,
    ),
    Workload(
        suite="cluster",
        name="leader failover",
        about=(
            f"SIGKILL the leader while a writer puts every {ATTEMPT_INTERVAL * 1000:.0f} ms "
            "to the two followers: seconds until a put issued after the kill succeeds. "
            "The ops/s column holds 1/seconds (higher is better); the seconds are in "
            "extra.failover_s."
        ),
        run=_failover,
    ),
]
