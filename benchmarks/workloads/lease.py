"""Lease suite: grant 10 000 leases, then a keepalive storm on them.

`grant` is a closed loop of LeaseGrant calls (64 in flight); the lease ids it got
are kept in the suite's state and used by `keepalive`, which sends
LeaseKeepAliveRequests on a few bidirectional streams, each with a window of
requests in flight, cycling over the leases. Latency is from sending a keepalive to
receiving its answer (answers are matched to requests by lease id).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from typing import Any

from benchmarks.loadgen import STREAM_END, ClientRun, split, unimplemented_as
from benchmarks.results import NOT_IMPLEMENTED, Failed, Outcome, Unavailable
from benchmarks.workloads.base import RunContext, Workload
from etcdserverpb import rpc_pb2, rpc_pb2_grpc

LEASES_FULL = 10_000
LEASES_QUICK = 1_000
LEASE_TTL = 600
GRANT_CONCURRENCY = 64
KEEPALIVE_STREAMS = 8
KEEPALIVE_WINDOW = 32


async def lease_grant_program(run: ClientRun) -> None:
    await run.connect()
    stub = rpc_pb2_grpc.LeaseStub(run.channel(0))
    timeout = run.spec.rpc_timeout

    async def op(seq: int) -> object:
        resp = await stub.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=LEASE_TTL), timeout=timeout)
        run.payload.append(resp.ID)
        return resp

    await run.start()
    await run.drive(op)


async def lease_keepalive_program(run: ClientRun) -> None:
    await run.connect()
    ids: list[int] = list(run.params["lease_ids"])
    streams = max(1, min(int(run.params["streams"]), len(ids)))
    window = int(run.params["window"])
    calls: list[Any] = []
    for s in range(streams):
        call = rpc_pb2_grpc.LeaseStub(run.channel(s)).LeaseKeepAlive()
        # One keepalive per stream before the window: proves the stream works.
        async with unimplemented_as("LeaseKeepAlive", call):
            await call.write(rpc_pb2.LeaseKeepAliveRequest(ID=ids[s]))
            resp = await call.read()
        if resp is STREAM_END:
            raise RuntimeError("keepalive stream closed during setup")
        calls.append(call)
    await run.start()
    issued = 0
    max_ops = run.spec.max_ops

    async def stream(call: Any, lease_ids: list[int]) -> None:
        nonlocal issued
        sent: dict[int, deque[int]] = defaultdict(deque)
        slots = asyncio.Semaphore(window)
        outstanding = 0
        sending = True

        async def receive() -> None:
            nonlocal outstanding
            while sending or outstanding:
                resp = await call.read()
                if resp is STREAM_END:
                    return
                queue = sent.get(resp.ID)
                if not queue:
                    run.error(RuntimeError(f"answer for lease {resp.ID} not asked for"))
                    continue
                t0 = queue.popleft()
                outstanding -= 1
                slots.release()
                if resp.TTL <= 0:
                    run.error(RuntimeError(f"lease {resp.ID} not found"))
                else:
                    run.record(time.perf_counter_ns() - t0)

        receiver = asyncio.create_task(receive())
        i = 0
        try:
            while issued < max_ops and time.monotonic() < run.deadline and not receiver.done():
                await slots.acquire()
                if time.monotonic() >= run.deadline:
                    slots.release()
                    break
                lease = lease_ids[i % len(lease_ids)]
                i += 1
                issued += 1
                sent[lease].append(time.perf_counter_ns())
                outstanding += 1
                await call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease))
        finally:
            sending = False
        if outstanding == 0:
            receiver.cancel()
        await asyncio.wait([receiver], timeout=max(0.0, run.drain_deadline - time.monotonic()))
        receiver.cancel()

    tasks = [asyncio.create_task(stream(c, ids[s::streams])) for s, c in enumerate(calls)]
    await asyncio.wait(tasks, timeout=max(0.0, run.drain_deadline - time.monotonic()) + 1)
    for task in tasks:
        task.cancel()
    for call in calls:
        call.cancel()
    run.finish(at=run.last_event)


def _grant(ctx: RunContext) -> Outcome:
    leases = ctx.budget.pick(LEASES_FULL, LEASES_QUICK)
    outcome, ids = ctx.run_clients(
        lease_grant_program,
        procs=ctx.procs(GRANT_CONCURRENCY),
        concurrency=GRANT_CONCURRENCY,
        max_ops=leases,
        warmup=False,
    )
    ctx.state["lease_ids"] = [int(i) for i in ids]
    ctx.state["lease_grant"] = outcome
    return outcome


def _keepalive(ctx: RunContext) -> Outcome:
    ids: list[int] = ctx.state.get("lease_ids", [])
    if not ids:
        grant = ctx.state.get("lease_grant")
        if isinstance(grant, Unavailable):
            return Unavailable(NOT_IMPLEMENTED)
        return Failed("no lease was granted (run the grant workload first)")
    procs = ctx.max_client_procs
    shares = [ids[i::procs] for i in range(procs)]
    streams = split(KEEPALIVE_STREAMS, procs)
    outcome, _ = ctx.run_clients(
        lease_keepalive_program,
        procs=procs,
        concurrency=KEEPALIVE_STREAMS * KEEPALIVE_WINDOW,
        max_ops=ctx.budget.pick(2_000_000, 10_000),
        per_proc=[
            {"lease_ids": share, "streams": s, "window": KEEPALIVE_WINDOW}
            for share, s in zip(shares, streams, strict=True)
        ],
        channels=2,
        warmup=False,
    )
    return outcome


LEASE = [
    Workload(
        suite="lease",
        name=f"grant {LEASES_FULL} leases, {GRANT_CONCURRENCY} in flight",
        about=f"LeaseGrant (TTL {LEASE_TTL}s), {GRANT_CONCURRENCY} in flight, {LEASES_FULL} leases ({LEASES_QUICK} in --quick).",
        run=_grant,
    ),
    Workload(
        suite="lease",
        name=(f"keepalive storm, {KEEPALIVE_STREAMS} streams x {KEEPALIVE_WINDOW} in flight"),
        about=(
            "LeaseKeepAlive on the granted leases over "
            f"{KEEPALIVE_STREAMS} streams, {KEEPALIVE_WINDOW} keepalives in flight per stream."
        ),
        run=_keepalive,
    ),
]
