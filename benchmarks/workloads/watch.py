"""Watch suite: fan-out of one writer's puts to 1, 100 and 1000 watchers.

Watchers are spread over a few bidirectional Watch streams (created before the
timed window opens). One writer puts to the watched key back to back, stamping the
send time (monotonic ns, comparable across processes on Linux) into the value; each
watcher event's latency is receive time minus that stamp. The writer ends with a
marker value so watchers know when they have seen everything. Throughput is events
received per second over all watchers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from grpc import aio

from benchmarks.loadgen import STREAM_END, ClientRun, require_watch, split, unimplemented_as
from benchmarks.results import Measurement, Outcome
from benchmarks.workloads.base import RunContext, Workload
from etcdserverpb import rpc_pb2, rpc_pb2_grpc

VALUE_SIZE = 256
END = b"\xffEND"
WATCHERS = (1, 100, 1000)


async def open_watch(
    call: Any,
    requests: list[rpc_pb2.WatchCreateRequest],
) -> list[int]:
    """Create watchers on an open Watch stream; return their ids once all were
    confirmed. Raises `Unimplemented` when the server does not serve Watch."""
    ids: list[int] = []
    async with unimplemented_as("Watch", call):
        for create in requests:
            await call.write(rpc_pb2.WatchRequest(create_request=create))
        while len(ids) < len(requests):
            resp = await call.read()
            if resp is STREAM_END:
                raise RuntimeError("watch stream closed during setup")
            if resp.canceled:
                raise RuntimeError(f"watch canceled during setup: {resp.cancel_reason}")
            if resp.created:
                ids.append(resp.watch_id)
    return ids


async def watch_fanout_program(run: ClientRun) -> None:
    await run.connect()
    await require_watch(run.channel(0))
    key: bytes = run.params["key"]
    watchers = int(run.params["watchers"])
    streams = max(1, min(int(run.params["streams"]), watchers)) if watchers else 0
    calls: list[tuple[Any, int]] = []
    for s, count in enumerate(split(watchers, streams) if streams else []):
        call = rpc_pb2_grpc.WatchStub(run.channel(s)).Watch()
        await open_watch(call, [rpc_pb2.WatchCreateRequest(key=key)] * count)
        calls.append((call, count))
    await run.start()

    async def reader(call: Any, count: int) -> None:
        finished: set[int] = set()
        while len(finished) < count:
            resp = await call.read()
            if resp is STREAM_END:
                return
            if resp.canceled:
                run.error(RuntimeError(f"watch canceled: {resp.cancel_reason}"))
                return
            now = time.monotonic_ns()
            for ev in resp.events:
                value = ev.kv.value
                if value.startswith(END):
                    finished.add(resp.watch_id)
                else:
                    run.record(now - int.from_bytes(value[:8], "big"))

    async def writer() -> None:
        kv = rpc_pb2_grpc.KVStub(run.channel(0))
        pad = b"w" * (VALUE_SIZE - 8)
        puts = 0
        max_puts = int(run.params["puts"])
        while puts < max_puts and time.monotonic() < run.deadline:
            value = time.monotonic_ns().to_bytes(8, "big") + pad
            try:
                await kv.Put(rpc_pb2.PutRequest(key=key, value=value), timeout=run.spec.rpc_timeout)
                puts += 1
            except aio.AioRpcError as e:
                run.error(e)
        run.add("puts", puts)
        await kv.Put(rpc_pb2.PutRequest(key=key, value=END + pad[4:]), timeout=run.spec.rpc_timeout)

    tasks = [asyncio.create_task(reader(call, count)) for call, count in calls]
    if run.params.get("writer"):
        tasks.append(asyncio.create_task(writer()))
    done, pending = await asyncio.wait(
        tasks, timeout=max(0.0, run.drain_deadline - time.monotonic())
    )
    for task in pending:
        task.cancel()
    for call, _ in calls:
        call.cancel()
    for task in done:
        if task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    if pending:
        run.add("timed_out_streams", len(pending))
    run.finish(at=run.last_event)


def _fanout(watchers: int) -> Workload:
    def run(ctx: RunContext) -> Outcome:
        procs = 1 if watchers == 1 else ctx.max_client_procs
        streams = 1 if watchers == 1 else (4 if watchers <= 100 else 8)
        # Full: about 150k events for the fan-outs (the count bound a fast server hits).
        puts = ctx.budget.pick({1: 50_000, 100: 1_500, 1000: 150}, {1: 500, 100: 30, 1000: 5})
        puts_for = puts[watchers]
        key = f"/bench/watch/{watchers}".encode()
        per_proc = [
            {"watchers": w, "streams": s, "writer": i == 0}
            for i, (w, s) in enumerate(
                zip(split(watchers, procs), split(streams, procs), strict=True)
            )
        ]
        outcome, _ = ctx.run_clients(
            watch_fanout_program,
            procs=procs,
            concurrency=watchers,
            max_ops=puts_for * watchers,
            params={"key": key, "puts": puts_for},
            per_proc=per_proc,
            warmup=False,
        )
        if isinstance(outcome, Measurement):
            outcome.extra["expected_events"] = outcome.extra.get("puts", 0.0) * watchers
        return outcome

    return Workload(
        suite="watch",
        name=f"watch fan-out, 1 writer, {watchers} watcher{'s' if watchers > 1 else ''}",
        about=(
            f"One writer puts to one key back to back; {watchers} watchers on few streams "
            "receive the events: events/s and put-to-event latency."
        ),
        run=run,
    )


WATCH = [_fanout(w) for w in WATCHERS]
