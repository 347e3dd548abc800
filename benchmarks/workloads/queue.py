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

The native queue protocol of our server is measured by the native rows (see the
block above `native_queue_program`): single-message produces and acks with 1 and 8
consumers, and a batched row. etcd has no native queue, so their etcd column holds
the etcd recipe's figures with the same consumer count: ratio_ops is native/recipe.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Any

from grpc import aio

from benchmarks.loadgen import STREAM_END, ClientRun, require_watch, split, unimplemented_as
from benchmarks.results import Measurement, Outcome, Unavailable
from benchmarks.workloads.base import RunContext, Workload, prefix_end
from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc

VALUE_SIZE = 256
CONSUMERS = (1, 8)
PRODUCER_IN_FLIGHT = 4
BACKLOG = 32
"""At most this many messages produced and not yet claimed (a closed loop, so that
latency measures the queue at load, not an ever-growing backlog)."""
END_SUFFIX = b"~end"  # sorts after the zero-padded message numbers


async def create_watch(call: Any, create: rpc_pb2.WatchCreateRequest) -> int:
    """Create a watch on an open Watch stream and wait for `created`; its id."""
    async with unimplemented_as("Watch", call):
        await call.write(rpc_pb2.WatchRequest(create_request=create))
        while True:
            resp = await call.read()
            if resp is STREAM_END or resp.canceled:
                raise RuntimeError("watch stream ended during setup")
            if resp.created:
                return int(resp.watch_id)
    raise AssertionError("unreachable")


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
        await create_watch(self.call, create)

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
        await create_watch(self.call, create)

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
    await require_watch(run.channel(0))
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
        ctx.state[f"queue recipe {consumers}"] = outcome  # the etcd column of the native rows
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
# Native queue workload (our server only).
#
# Produce with a Put of /q/{name}/p/{key} (or, batched, several such puts in one
# Txn); each consumer watches the exact key /q/{name}/c/{uuid4} and the server
# delivers every message to one consumer, round-robin within a prefetch window,
# as PUT events of the message key /q/{name}/{idx}/{key} (several may share one
# WatchResponse); the consumer acks by deleting that key (one DeleteRange each, or,
# batched, several DeleteRanges in one Txn).
#
# Every client process also runs a `QueueMonitor`: one Watch stream with a
# delete-only watch over the queue's message keys (acks, counted globally, which
# bounds the producer's backlog and tells consumers when everything is acked) and
# a watch on an end key outside the queue, where the producer puts how many
# messages it produced once the window closed. A process stops when that many
# messages were acked, or at the drain deadline.
#
# ops = messages acked (unique: a delete that removes nothing is not counted);
# latency = produce (stamp in the value) to receipt by the consumer. Every process
# hands back the message numbers it produced and received, and the orchestrator
# checks at-least-once delivery with no loss (`lost`, `duplicates` in `extra` and
# in the note).
# ---------------------------------------------------------------------------------

NATIVE_PRODUCER_IN_FLIGHT = 8
"""Single-message rows: producer tasks, each with one Put in flight."""
NATIVE_ACKS_IN_FLIGHT = 4
"""Ack requests in flight per consumer (it holds up to the prefetch window)."""
NATIVE_BACKLOG = 128
"""At most this many messages produced and not yet acked (single-message rows)."""
BATCH_PUTS = 16
"""Batched row: producer puts per Txn."""
BATCH_ACKS = 16
"""Batched row: most DeleteRanges per ack Txn."""
BATCH_PRODUCER_IN_FLIGHT = 4
BATCH_ACKS_IN_FLIGHT = 2
BATCH_BACKLOG = 512
BATCH_CONSUMERS = 8
STAMP = 8  # value: 8-byte send time, 8-byte message number, padding
SEQ_END = 16


def _message_seq(value: bytes) -> int:
    return int.from_bytes(value[STAMP:SEQ_END], "big")


class QueueMonitor:
    """One Watch stream per client process: a delete-only watch over the queue's
    message keys (acks) and a watch on the end key (the produced count)."""

    def __init__(self, channel: aio.Channel, queue: str, end_key: bytes) -> None:
        self.start = f"/q/{queue}/0".encode()  # message keys: /q/{name}/{idx digits}/...
        self.end = f"/q/{queue}/:".encode()  # ":" follows "9"
        self.end_key = end_key
        self.call: Any = rpc_pb2_grpc.WatchStub(channel).Watch()
        self.acked = 0
        self.expected: int | None = None
        self.changed = asyncio.Event()
        self.finished = asyncio.Event()
        self._acks_id = -1
        self._end_id = -1

    async def open(self) -> None:
        creates = [
            rpc_pb2.WatchCreateRequest(
                key=self.start, range_end=self.end, filters=[rpc_pb2.WatchCreateRequest.NOPUT]
            ),
            rpc_pb2.WatchCreateRequest(key=self.end_key),
        ]
        self._acks_id, self._end_id = [await create_watch(self.call, c) for c in creates]

    async def follow(self) -> None:
        while True:
            resp = await self.call.read()
            if resp is STREAM_END or resp.canceled:
                return
            if resp.watch_id == self._acks_id:
                self.acked += sum(1 for ev in resp.events if ev.type == kv_pb2.Event.DELETE)
            elif resp.watch_id == self._end_id:
                for ev in resp.events:
                    if ev.type == kv_pb2.Event.PUT:
                        self.expected = int(ev.kv.value)
            if self.expected is not None and self.acked >= self.expected:
                self.finished.set()
            self.changed.set()

    async def room(self, seq: int, backlog: int, deadline: float) -> bool:
        """Wait until message `seq` fits in the backlog; False when the window ended."""
        while seq - self.acked >= backlog:
            if time.monotonic() >= deadline:
                return False
            self.changed.clear()
            await self.changed.wait()
        return time.monotonic() < deadline

    def close(self) -> None:
        self.call.cancel()


class NativeConsumer:
    """One consumer of the native queue: a watch on /q/{name}/c/{uuid4} and ack
    tasks that delete the delivered keys."""

    def __init__(
        self, run: ClientRun, channel: aio.Channel, queue: str, ack_batch: int, acks_in_flight: int
    ) -> None:
        self.run = run
        self.key = f"/q/{queue}/c/{uuid.uuid4()}".encode()
        self.ack_batch = ack_batch
        self.acks_in_flight = acks_in_flight
        self.kv = rpc_pb2_grpc.KVStub(channel)
        self.call: Any = rpc_pb2_grpc.WatchStub(channel).Watch()
        self.to_ack: deque[bytes] = deque()
        self.received: list[int] = []
        self.closed = False
        self.wake = asyncio.Event()

    async def open(self) -> None:
        await create_watch(self.call, rpc_pb2.WatchCreateRequest(key=self.key))

    async def _watch(self) -> None:
        run = self.run
        hist = run.hist
        while True:
            resp = await self.call.read()
            if resp is STREAM_END or resp.canceled:
                if resp is not STREAM_END:
                    run.add("consumers_canceled")  # e.g. dropped as stuck by the server
                self.closed = True
                self.wake.set()
                return
            if not resp.events:
                continue
            now = time.monotonic_ns()
            for ev in resp.events:
                if ev.type != kv_pb2.Event.PUT or len(ev.kv.value) < SEQ_END:
                    run.add("unexpected_events")
                    continue
                value = ev.kv.value
                hist.record(now - int.from_bytes(value[:STAMP], "big"))
                self.received.append(_message_seq(value))
                self.to_ack.append(ev.kv.key)
            run.add("deliveries", len(resp.events))
            run.add("delivery_responses")
            self.wake.set()

    async def _acker(self) -> None:
        run = self.run
        timeout = run.spec.rpc_timeout
        while True:
            if not self.to_ack:
                if self.closed:
                    return
                self.wake.clear()
                await self.wake.wait()
                continue
            n = min(self.ack_batch, len(self.to_ack))
            batch = [self.to_ack.popleft() for _ in range(n)]
            try:
                if self.ack_batch == 1:
                    resp = await self.kv.DeleteRange(
                        rpc_pb2.DeleteRangeRequest(key=batch[0]), timeout=timeout
                    )
                    deleted = int(resp.deleted)
                else:
                    txn = rpc_pb2.TxnRequest(
                        success=[
                            rpc_pb2.RequestOp(
                                request_delete_range=rpc_pb2.DeleteRangeRequest(key=key)
                            )
                            for key in batch
                        ]
                    )
                    tresp = await self.kv.Txn(txn, timeout=timeout)
                    deleted = sum(int(r.response_delete_range.deleted) for r in tresp.responses)
            except aio.AioRpcError as e:
                run.error(e)
                run.add("acks_failed", n)
                continue
            run.add("ack_requests")
            if deleted < n:
                run.add("acks_deleting_nothing", n - deleted)
            if deleted:
                run.ops += deleted
                run.last_event = time.monotonic()

    def start(self) -> list[asyncio.Task[None]]:
        """The watch task, then the ack tasks (which end once `closed` and every
        received message is acked)."""
        return [
            asyncio.create_task(self._watch()),
            *(asyncio.create_task(self._acker()) for _ in range(self.acks_in_flight)),
        ]

    def stop_after_acks(self) -> None:
        self.closed = True
        self.wake.set()

    def close(self) -> None:
        self.call.cancel()


async def _produce(
    run: ClientRun, monitor: QueueMonitor, queue: str, produced: list[int], uncertain: list[int]
) -> None:
    """The producer: puts (or Txns of `put_batch` puts) of numbered, time-stamped
    messages while the window is open; then the end key with the produced count.
    `produced` gets the numbers of the messages whose put was answered, `uncertain`
    those whose put failed (it may or may not have been applied)."""
    params = run.params
    messages = int(params["messages"])
    put_batch = int(params["put_batch"])
    backlog = int(params["backlog"])
    kv = rpc_pb2_grpc.KVStub(run.channel(0))
    timeout = run.spec.rpc_timeout
    pad = b"m" * (VALUE_SIZE - SEQ_END)

    def request(seq: int, stamp: bytes) -> rpc_pb2.PutRequest:
        return rpc_pb2.PutRequest(
            key=b"/q/%s/p/m%012d" % (queue.encode(), seq),
            value=stamp + seq.to_bytes(8, "big") + pad,
        )

    async def put(i: int) -> object:
        first = i * put_batch
        seqs = range(first, min(first + put_batch, messages))
        if not seqs or not await monitor.room(seqs[-1], backlog, run.deadline):
            return None
        stamp = time.monotonic_ns().to_bytes(8, "big")
        try:
            if put_batch == 1:
                resp: object = await kv.Put(request(first, stamp), timeout=timeout)
            else:
                txn = rpc_pb2.TxnRequest(
                    success=[rpc_pb2.RequestOp(request_put=request(s, stamp)) for s in seqs]
                )
                resp = await kv.Txn(txn, timeout=timeout)
        except aio.AioRpcError:
            uncertain.extend(seqs)
            raise
        produced.extend(seqs)
        run.add("produce_requests")
        return resp

    # Wake producers blocked on a full backlog when the window ends.
    wake = asyncio.get_running_loop().call_later(
        max(0.0, run.deadline - time.monotonic()), monitor.changed.set
    )
    try:
        ops = -(-messages // put_batch)
        await run.issue(put, int(params["producer_tasks"]), ops)
    finally:
        wake.cancel()
    run.add("produced", len(produced))
    await kv.Put(
        rpc_pb2.PutRequest(key=params["end_key"], value=b"%d" % len(produced)), timeout=timeout
    )


async def native_queue_program(run: ClientRun) -> None:
    await run.connect()
    await require_watch(run.channel(0))
    params = run.params
    queue = str(params["queue"])
    monitor = QueueMonitor(run.channel(0), queue, params["end_key"])
    await monitor.open()
    consumers = [
        NativeConsumer(
            run,
            run.channel(i),
            queue,
            int(params["ack_batch"]),
            int(params["acks_in_flight"]),
        )
        for i in range(int(params["consumers"]))
    ]
    for consumer in consumers:
        await consumer.open()
    await run.start()

    following = asyncio.create_task(monitor.follow())
    finished = asyncio.create_task(monitor.finished.wait())
    consuming = [c.start() for c in consumers]
    acking = [task for tasks in consuming for task in tasks[1:]]
    produced: list[int] = []
    uncertain: list[int] = []
    producing = (
        asyncio.create_task(_produce(run, monitor, queue, produced, uncertain))
        if params.get("producer")
        else None
    )
    workers: list[asyncio.Task[Any]] = [
        *(task for tasks in consuming for task in tasks),
        *([producing] if producing else []),
    ]
    waiting: set[asyncio.Task[Any]] = {finished, following, *workers}
    try:
        while not finished.done():
            left = run.drain_deadline - time.monotonic()
            if left <= 0:
                break
            done, waiting = await asyncio.wait(
                waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                error = None if task is finished else task.exception()
                if error is not None:
                    raise error
            if following in done and not finished.done():
                raise RuntimeError("the queue monitor's watch stream ended")
        if finished.done():
            # Every message is acked (the monitor saw the deletes); this process's
            # own ack answers may still be on their way: let them arrive.
            for c in consumers:
                c.stop_after_acks()
            left = max(1.0, run.drain_deadline - time.monotonic())
            _, late = await asyncio.wait(acking, timeout=left)
            if late:
                run.add("timed_out_tasks", 1)
        else:
            run.add("timed_out_tasks", 1)
    finally:
        for task in (finished, following, *workers):
            task.cancel()
        for c in consumers:
            c.close()
        monitor.close()
    run.payload.append(
        {
            "received": [s for c in consumers for s in c.received],
            "produced": produced,
            "uncertain": uncertain,
        }
    )
    run.finish(at=run.last_event)


@dataclass(frozen=True)
class DeliveryCheck:
    """At-least-once with no loss, from what every client process handed back."""

    produced: int
    received: int
    lost: int
    duplicates: int
    unknown: int
    """Received message numbers that were never confirmed as produced."""

    @staticmethod
    def of(payload: list[Any]) -> DeliveryCheck:
        produced: set[int] = set()
        uncertain: set[int] = set()
        counts: Counter[int] = Counter()
        for part in payload:
            produced.update(part["produced"])
            uncertain.update(part["uncertain"])
            counts.update(part["received"])
        received = set(counts)
        return DeliveryCheck(
            produced=len(produced),
            received=len(received),
            lost=len(produced - received),
            duplicates=sum(counts.values()) - len(received),
            unknown=len(received - produced - uncertain),
        )

    def note(self, behind: bool) -> str:
        parts = [f"native protocol; {self.produced} produced"]
        if self.lost:
            why = "; the drain deadline passed first" if behind else ""
            parts.append(f"LOST {self.lost} (never received{why})")
        else:
            parts.append("every one received")
        parts.append(f"{self.duplicates} duplicate deliveries")
        if self.unknown:
            parts.append(f"{self.unknown} received that were never produced")
        return ", ".join(parts)


def _native(consumers: int, batched: bool = False) -> Workload:
    key = "batched" if batched else "single"

    def run(ctx: RunContext) -> Outcome:
        if ctx.kind == "etcd":
            # etcd has no native queue: the etcd column carries the recipe row with
            # the same consumer count, so that ratio_ops = native / etcd recipe.
            recipe = ctx.state.get(f"queue recipe {consumers}")
            if not isinstance(recipe, Measurement):
                return Unavailable(
                    f"etcd has no native queue, and the etcd recipe row with {consumers} "
                    "consumers did not measure"
                )
            return replace(
                recipe,
                extra=dict(recipe.extra),
                note=(
                    f"the figures of the etcd recipe row with {consumers} consumer"
                    f"{'s' if consumers > 1 else ''} (etcd has no native queue), so "
                    "ratio = native / etcd recipe"
                ),
            )
        procs = 1 if consumers == 1 else ctx.max_client_procs
        messages = ctx.budget.pick(200_000 if batched else 100_000, 640 if batched else 300)
        name = f"bench-native-{key}-{consumers}"
        outcome, payload = ctx.run_clients(
            native_queue_program,
            procs=procs,
            concurrency=consumers,
            max_ops=messages,
            params={
                "queue": name,
                "end_key": f"/bench/queue/{name}/end".encode(),
                "messages": messages,
                "put_batch": BATCH_PUTS if batched else 1,
                "ack_batch": BATCH_ACKS if batched else 1,
                "producer_tasks": BATCH_PRODUCER_IN_FLIGHT
                if batched
                else NATIVE_PRODUCER_IN_FLIGHT,
                "acks_in_flight": BATCH_ACKS_IN_FLIGHT if batched else NATIVE_ACKS_IN_FLIGHT,
                "backlog": BATCH_BACKLOG if batched else NATIVE_BACKLOG,
            },
            per_proc=[
                {"consumers": n, "producer": i == 0} for i, n in enumerate(split(consumers, procs))
            ],
            channels=min(consumers, 4),
            warmup=False,
        )
        if not isinstance(outcome, Measurement):
            return outcome
        check = DeliveryCheck.of(payload)
        extra = outcome.extra
        extra.update(lost=check.lost, duplicates=check.duplicates, unknown=check.unknown)
        for total, per, ratio in (
            ("deliveries", "delivery_responses", "deliveries_per_response"),
            ("ops", "ack_requests", "acks_per_request"),
            ("produced", "produce_requests", "puts_per_request"),
        ):
            count = outcome.ops if total == "ops" else extra.get(total, 0.0)
            if extra.get(per):
                extra[ratio] = count / extra[per]
        outcome.note = check.note(behind=bool(extra.get("timed_out_tasks")))
        return outcome

    s = "s" if consumers > 1 else ""
    if batched:
        name = (
            f"native queue batched, {BATCH_PUTS} puts/txn, {BATCH_ACKS} acks/txn, "
            f"{consumers} consumer{s}"
        )
        about = (
            f"Native queue, {BATCH_PUTS} producer puts per Txn, acks of up to {BATCH_ACKS} "
            f"deliveries per Txn, {consumers} consumer(s): messages/s acked; etcd column: "
            f"the etcd recipe with {consumers} consumer(s)."
        )
    else:
        name = f"native queue, 1 producer, {consumers} consumer{s}"
        about = (
            "Our native queue protocol (put /q/{name}/p/{key}, watch /q/{name}/c/{uuid}, "
            f"delete the delivery key), one Put and one DeleteRange per message, "
            f"{consumers} consumer(s): messages/s acked, produce-to-receipt latency, "
            "no-loss check; etcd column: the etcd recipe with the same consumers."
        )
    return Workload(suite="queue", name=name, about=about, run=run)


QUEUE = [
    *(_recipe(c) for c in CONSUMERS),
    *(_native(c) for c in CONSUMERS),
    _native(BATCH_CONSUMERS, batched=True),
]
