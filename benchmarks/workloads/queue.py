"""Queue suite: a work queue end to end, as etcd users build one today.

The etcd-key recipe (what etcd's contrib/recipes queue does, without its
Range-backlog step since consumers start before the producer): a producer puts
messages under a prefix; every consumer prefix-watches it and claims the oldest
message it has seen with a Txn that compares the key's mod_revision with the one
in the event and deletes the key on success. Every consumer sees every message, so
with several consumers most claims lose the race (counted as `claim_conflicts`).
The producer keeps at most `BACKLOG` messages unclaimed (it counts claims through a
delete-only prefix watch), stamps the send time in the value; latency is produce to
claim. After the time window the producer puts an end marker; consumers stop once
they have seen it and every message before it is claimed (or when the drain time is
up).

The native queue protocol of our server is a separate workload, a hook below.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

from grpc import aio

from benchmarks.loadgen import STREAM_END, ClientRun, Unimplemented, split, unimplemented_as
from benchmarks.results import Outcome, Unavailable
from benchmarks.workloads.base import RunContext, Workload, prefix_end
from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc

VALUE_SIZE = 256
CONSUMERS = (1, 8)
PRODUCER_IN_FLIGHT = 4
BACKLOG = 32
"""At most this many messages produced and not yet claimed (a closed loop, so that
latency measures the queue at load, not an ever-growing backlog)."""
END_SUFFIX = b"~end"  # sorts after the zero-padded message numbers


class RecipeConsumer:
    """One consumer of the etcd recipe: a prefix watch and a claim loop."""

    def __init__(self, run: ClientRun, channel: aio.Channel, prefix: bytes) -> None:
        self.run = run
        self.prefix = prefix
        self.end_key = prefix + END_SUFFIX
        self.kv = rpc_pb2_grpc.KVStub(channel)
        self.call: Any = rpc_pb2_grpc.WatchStub(channel).Watch()
        self.pending: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.end_seen = False
        self.wake = asyncio.Event()

    async def open(self) -> None:
        create = rpc_pb2.WatchCreateRequest(key=self.prefix, range_end=prefix_end(self.prefix))
        async with unimplemented_as("Watch", self.call):
            await self.call.write(rpc_pb2.WatchRequest(create_request=create))
            while True:
                resp = await self.call.read()
                if resp is STREAM_END or resp.canceled:
                    raise RuntimeError("watch stream ended during setup")
                if resp.created:
                    return

    async def _watch(self) -> None:
        while True:
            resp = await self.call.read()
            if resp is STREAM_END or resp.canceled:
                self.end_seen = True  # nothing more will come
                self.wake.set()
                return
            for ev in resp.events:
                key = ev.kv.key
                if ev.type == kv_pb2.Event.DELETE:
                    self.pending.pop(key, None)
                elif key == self.end_key:
                    self.end_seen = True
                else:
                    stamp = int.from_bytes(ev.kv.value[:8], "big")
                    self.pending[key] = (ev.kv.mod_revision, stamp)
            self.wake.set()

    async def consume(self) -> None:
        watcher = asyncio.create_task(self._watch())
        try:
            while True:
                if self.pending:
                    key, (revision, stamp) = self.pending.popitem(last=False)
                    await self._claim(key, revision, stamp)
                elif self.end_seen or watcher.done():
                    return
                else:
                    self.wake.clear()
                    await self.wake.wait()
        finally:
            watcher.cancel()
            self.call.cancel()

    async def _claim(self, key: bytes, revision: int, stamp: int) -> None:
        txn = rpc_pb2.TxnRequest(
            compare=[
                rpc_pb2.Compare(
                    key=key,
                    target=rpc_pb2.Compare.MOD,
                    result=rpc_pb2.Compare.EQUAL,
                    mod_revision=revision,
                )
            ],
            success=[rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))],
        )
        try:
            resp = await self.kv.Txn(txn, timeout=self.run.spec.rpc_timeout)
        except aio.AioRpcError as e:
            self.run.error(e)
            return
        if resp.succeeded:
            self.run.record(time.monotonic_ns() - stamp)
        else:
            self.run.add("claim_conflicts")


class DeleteCounter:
    """The producer's view of the backlog: a prefix watch that sees only deletes
    (claims), so the producer can keep at most `backlog` messages unclaimed."""

    def __init__(self, channel: aio.Channel, prefix: bytes) -> None:
        self.prefix = prefix
        self.call: Any = rpc_pb2_grpc.WatchStub(channel).Watch()
        self.deleted = 0
        self.changed = asyncio.Event()

    async def open(self) -> None:
        create = rpc_pb2.WatchCreateRequest(
            key=self.prefix,
            range_end=prefix_end(self.prefix),
            filters=[rpc_pb2.WatchCreateRequest.NOPUT],
        )
        async with unimplemented_as("Watch", self.call):
            await self.call.write(rpc_pb2.WatchRequest(create_request=create))
            while True:
                resp = await self.call.read()
                if resp is STREAM_END or resp.canceled:
                    raise RuntimeError("watch stream ended during setup")
                if resp.created:
                    return

    async def count(self) -> None:
        while True:
            resp = await self.call.read()
            if resp is STREAM_END or resp.canceled:
                return
            self.deleted += sum(1 for ev in resp.events if ev.type == kv_pb2.Event.DELETE)
            self.changed.set()

    async def room(self, seq: int, backlog: int, deadline: float) -> bool:
        """Wait until message `seq` fits in the backlog; False when the window ended."""
        while seq - self.deleted >= backlog:
            if time.monotonic() >= deadline:
                return False
            self.changed.clear()
            await self.changed.wait()
        return time.monotonic() < deadline


async def queue_recipe_program(run: ClientRun) -> None:
    await run.connect()
    prefix: bytes = run.params["prefix"]
    consumers = [
        RecipeConsumer(run, run.channel(i), prefix) for i in range(int(run.params["consumers"]))
    ]
    for consumer in consumers:
        await consumer.open()
    counter: DeleteCounter | None = None
    if run.params.get("producer"):
        counter = DeleteCounter(run.channel(0), prefix)
        await counter.open()
    await run.start()

    async def produce(counter: DeleteCounter) -> None:
        kv = rpc_pb2_grpc.KVStub(run.channel(0))
        pad = b"m" * (VALUE_SIZE - 8)
        timeout = run.spec.rpc_timeout
        backlog = int(run.params["backlog"])
        counting = asyncio.create_task(counter.count())
        # Wake producers blocked on a full backlog when the window ends.
        wake = asyncio.get_running_loop().call_later(
            max(0.0, run.deadline - time.monotonic()), counter.changed.set
        )
        produced = 0

        async def put(seq: int) -> object:
            nonlocal produced
            if not await counter.room(seq, backlog, run.deadline):
                return None
            value = time.monotonic_ns().to_bytes(8, "big") + pad
            resp = await kv.Put(
                rpc_pb2.PutRequest(key=prefix + b"%012d" % seq, value=value), timeout=timeout
            )
            produced += 1
            return resp

        try:
            await run.issue(put, PRODUCER_IN_FLIGHT, int(run.params["messages"]))
            run.add("produced", produced)
            await kv.Put(rpc_pb2.PutRequest(key=prefix + END_SUFFIX, value=b"end"), timeout=timeout)
        finally:
            wake.cancel()
            counting.cancel()
            counter.call.cancel()

    tasks = [asyncio.create_task(c.consume()) for c in consumers]
    if counter is not None:
        tasks.append(asyncio.create_task(produce(counter)))
    done, pending = await asyncio.wait(
        tasks, timeout=max(0.0, run.drain_deadline - time.monotonic())
    )
    for task in pending:
        task.cancel()
    for task in done:
        error = task.exception()
        if error is not None:
            raise error
    if pending:
        run.add("timed_out_tasks", len(pending))
    run.finish(at=run.last_event)


def _recipe(consumers: int) -> Workload:
    def run(ctx: RunContext) -> Outcome:
        procs = 1 if consumers == 1 else ctx.max_client_procs
        messages = ctx.budget.pick(100_000, 300)
        per_proc = [
            {"consumers": n, "producer": i == 0} for i, n in enumerate(split(consumers, procs))
        ]
        outcome, _ = ctx.run_clients(
            queue_recipe_program,
            procs=procs,
            concurrency=consumers,
            max_ops=messages,
            params={
                "prefix": f"/bench/queue/recipe{consumers}/".encode(),
                "messages": messages,
                "backlog": BACKLOG,
            },
            per_proc=per_proc,
            channels=min(consumers, 4),
            warmup=False,
        )
        return outcome

    return Workload(
        suite="queue",
        name=f"etcd recipe, 1 producer, {consumers} consumer{'s' if consumers > 1 else ''}",
        about=(
            "Producer puts under a prefix; consumers prefix-watch and claim with a "
            f"compare-mod_revision-and-delete Txn; {consumers} consumer(s), at most "
            f"{BACKLOG} messages unclaimed: messages/s."
        ),
        run=run,
    )


# ---------------------------------------------------------------------------------
# HOOK: native queue workload (our server only; not written yet).
#
# When the server speaks its native queue protocol -- produce with a Put of
# /q/{name}/p/{key}; a consumer watches /q/{name}/c/{consumer uuid}, where the server
# delivers each message to one consumer; the consumer acks by deleting that delivery
# key -- write `native_queue_program` with the shape of `queue_recipe_program`:
# open the consumers' watches before `run.start()`, produce after it, call
# `run.record(now - stamp)` for every acked message, stop on an end marker or at
# `run.drain_deadline`. The rows below then measure it with no other change; the
# etcd column stays null (etcd has no native queue: compare with the recipe rows).
# ---------------------------------------------------------------------------------


async def native_queue_program(run: ClientRun) -> None:
    raise Unimplemented("native queue workload not written yet (benchmarks/workloads/queue.py)")


def _native(consumers: int) -> Workload:
    def run(ctx: RunContext) -> Outcome:
        if ctx.kind == "etcd":
            return Unavailable("etcd has no native queue (compare with the etcd recipe rows)")
        procs = 1 if consumers == 1 else ctx.max_client_procs
        messages = ctx.budget.pick(100_000, 300)
        outcome, _ = ctx.run_clients(
            native_queue_program,
            procs=procs,
            concurrency=consumers,
            max_ops=messages,
            params={"queue": f"bench-native-{consumers}", "messages": messages},
            per_proc=[
                {"consumers": n, "producer": i == 0} for i, n in enumerate(split(consumers, procs))
            ],
            channels=min(consumers, 4),
            warmup=False,
        )
        return outcome

    return Workload(
        suite="queue",
        name=f"native queue, 1 producer, {consumers} consumer{'s' if consumers > 1 else ''}",
        about=(
            "Our native queue protocol (put /q/{name}/p/{key}, watch /q/{name}/c/{uuid}, "
            "delete the delivery key): messages/s. Hook; not written yet."
        ),
        run=run,
    )


QUEUE = [*(_recipe(c) for c in CONSUMERS), *(_native(c) for c in CONSUMERS)]
