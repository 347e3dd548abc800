"""CQS suite: the Change Queue Service (dtoflow.changequeue.v1) against an etcd recipe.

Three rows, run in this order on one pair of servers; each row uses what the one
before it left on its server:

1. **ReEnqueue over one stream.** Our server: a queue subscribed to `esl`, one
   seed notification published (KV Put on `/q/dto:esl/p/seed`) and dequeued, then
   one ReEnqueue stream that replaces it with `ITEMS` items (1 000 000; quick
   10 000), realistic ids `t/{tenant}/s/{store}/esls/{13-digit barcode}` over 50
   stores. Items/s over the stream; peak server RSS sampled during it, RSS before
   in `extra`. etcd's column: the same items as one key each
   (`/bench/cqs/q/{sla}/{segments}/{seq}` -> the notification's JSON), Txns of
   128 puts (etcd's default --max-txn-ops), 4 in flight on one connection (the
   keys carry their order, so pipelining loses none, like the stream).
2. **Bytes per pending notification.** RSS now (idle, after the stream) minus RSS
   before the stream, over the notifications queued (etcd: over the keys). The
   table and chart show a row's figure in the ops/s column, so this row puts its
   bytes per notification there (lower is better; ratio = ours/etcd bytes); the
   exact figure and both RSS values are in `extra`.
3. **Dequeue+ack, batches of 20.** One consumer: BatchDequeue(max 20, prefix depth
   4) then BatchAcknowledge of the tokens, back to back, from the queue row 1
   filled. ops/s = notifications acknowledged per second, latency = one batch
   (dequeue + ack). etcd's column: the recipe over the keys row 1 put: Range with
   limit 20 over the prefix (key order = priority order) then one Txn that
   compares each key's mod_revision and deletes the 20 keys. The recipe does not
   group by id prefix and keeps no in-flight state (so it is the cheaper problem),
   but etcd's Range counts every key of the range even with a limit, so its cost
   grows with the backlog: both servers start from the same backlog.

Long phases print a progress line to stderr every `PROGRESS_SECONDS`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc
import psutil  # type: ignore[import-untyped,unused-ignore]
from grpc import aio

from benchmarks.loadgen import (
    BadResponse,
    ClientRun,
    LatencyHistogram,
    check_unimplemented,
    unimplemented_as,
)
from benchmarks.results import NOT_IMPLEMENTED, Measurement, Outcome, Unavailable
from benchmarks.servers import ResourceMonitor
from benchmarks.workloads.base import RunContext, Workload, prefix_end
from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc

QUEUE = "bench-cqs"
DTO_TYPE = "esl"
TENANT = "retail"
STORES = 50
SEED_ID = f"t/{TENANT}"
"""The seed notification ReEnqueue splits: the whole tenant, re-sent as its ESLs."""
SLA = "2026-01-01T10:00:01Z"
SLA_US = int(dt.datetime.fromisoformat(SLA.replace("Z", "+00:00")).timestamp()) * 1_000_000
BARCODE_BASE = 2_000_000_000_000
BARCODE_SPAN = 1_000_000_000_000
BARCODE_STEP = 7_919
"""Prime, so coprime with BARCODE_SPAN: item i gets a distinct barcode."""

ITEMS = (1_000_000, 10_000)
"""Items of the ReEnqueue stream (full, quick); also the backlog of row 3."""
STREAM_SECONDS = (300.0, 15.0)
"""Time bound of the stream (full, quick): it ends (with its Footer) when reached."""
SETTLE_SECONDS = (1.0, 0.3)
"""How long row 2 samples the idle server's RSS (full, quick)."""
BATCH = 20
DEPTH = 4
WAIT_MS = 1000
WARMUP_BATCHES = 50
ETCD_TXN_OPS = 128
ETCD_TXNS_IN_FLIGHT = 4
RECIPE_PREFIX = b"/bench/cqs/q/"
ID_SEGMENTS = 6
"""Segments of every item id (t/{tenant}/s/{store}/esls/{barcode})."""
_RECIPE_KEY = RECIPE_PREFIX + b"%d/%02d/" % (SLA_US, 63 - ID_SEGMENTS)
_RECIPE_VALUE = b'{"dto_type": "%s", "dto_id": "%%s", "sla_timestamp": "%s"}' % (
    DTO_TYPE.encode(),
    SLA.encode(),
)
PROGRESS_SECONDS = 15.0
RPC_TIMEOUT = 30.0


def dto_id(i: int) -> str:
    """Item `i`'s id: round robin over the stores, a distinct 13-digit barcode."""
    barcode = BARCODE_BASE + (i * BARCODE_STEP) % BARCODE_SPAN
    return f"t/{TENANT}/s/store{i % STORES:02d}/esls/{barcode:013d}"


def publication(dto: str) -> bytes:
    """The JSON value of a publication (KV Put on /q/dto:{type}/p/{key})."""
    return json.dumps({"dto_id": dto, "sla_timestamp": SLA}).encode()


def recipe_put(i: int) -> rpc_pb2.PutRequest:
    """The etcd recipe's key and value of item `i`. The key spells the queue's
    order (SLA, more segments first, then enqueue order); the value is the
    notification's JSON."""
    return rpc_pb2.PutRequest(
        key=_RECIPE_KEY + b"%010d" % i, value=_RECIPE_VALUE % dto_id(i).encode()
    )


class Ticker:
    """A progress line on stderr at most every PROGRESS_SECONDS (client side)."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.t0 = time.monotonic()
        self.last = self.t0

    def tick(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            print(
                f"{'':11}{self.label}: {done:,} of {self.total:,} items after {now - self.t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )


# -- client programs (run in the client processes) --------------------------------


async def reenqueue_program(run: ClientRun) -> None:
    """One ReEnqueue stream: Header, `items` items (fewer if the window ends), Footer."""
    await run.connect()
    stub = cqs_pb2_grpc.DtoChangeQueueServiceStub(run.channel(0))
    items = int(run.params["items"])
    header = cqs_pb2.ReEnqueueRequest(
        header=cqs_pb2.ReEnqueueRequest.Header(
            queue_name=str(run.params["queue"]), ack_token=str(run.params["token"])
        )
    )
    sent = 0
    ticker = Ticker(str(run.params["label"]), items)

    async def frames() -> AsyncIterator[cqs_pb2.ReEnqueueRequest]:
        nonlocal sent
        yield header
        deadline = run.deadline
        for i in range(items):
            if i % 256 == 0:
                if time.monotonic() >= deadline:
                    break
                ticker.tick(i)
            yield cqs_pb2.ReEnqueueRequest(
                item=cqs_pb2.SplitItem(dto_type=DTO_TYPE, dto_id=dto_id(i))
            )
            sent += 1
        yield cqs_pb2.ReEnqueueRequest(footer=cqs_pb2.ReEnqueueRequest.Footer())

    await run.start()
    async with unimplemented_as("ReEnqueue"):
        resp = await stub.ReEnqueue(frames(), timeout=run.spec.seconds + RPC_TIMEOUT)
    run.finish()
    run.ops = int(resp.items_enqueued)
    if resp.items_enqueued != sent or not resp.acknowledged:
        run.error(
            BadResponse(
                f"sent {sent} items, the server enqueued {resp.items_enqueued} "
                f"(acknowledged={resp.acknowledged})"
            )
        )
    run.payload.append({"sent": sent})


async def recipe_load_program(run: ClientRun) -> None:
    """The etcd recipe's enqueue: Txns of ETCD_TXN_OPS puts, `concurrency` in flight."""
    await run.connect()
    kv = rpc_pb2_grpc.KVStub(run.channel(0))
    items = int(run.params["items"])
    txn_ops = int(run.params["txn_ops"])
    put = 0
    ticker = Ticker(str(run.params["label"]), items)

    async def op(seq: int) -> object:
        nonlocal put
        first = seq * txn_ops
        last = min(first + txn_ops, items)
        txn = rpc_pb2.TxnRequest(
            success=[rpc_pb2.RequestOp(request_put=recipe_put(i)) for i in range(first, last)]
        )
        resp = await kv.Txn(txn, timeout=RPC_TIMEOUT)
        put += last - first
        ticker.tick(put)
        return resp

    await run.start()
    await run.issue(op, run.spec.concurrency, -(-items // txn_ops))
    run.finish()
    run.ops = put
    run.payload.append({"sent": put})


class Consumer:
    """One consumer's batch (dequeue, then ack), timed in parts; `take` returns the
    notifications acknowledged, or None when the queue had nothing."""

    def __init__(self, run: ClientRun) -> None:
        self.run = run
        self.dequeue = LatencyHistogram()
        self.ack = LatencyHistogram()

    async def take(self) -> int | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def timed(self, t0: int, t1: int, t2: int) -> None:
        self.dequeue.record(t1 - t0)
        self.ack.record(t2 - t1)

    async def consume(self) -> None:
        """Warm up (untimed), open the window, then batches back to back until
        `max_ops` batches, the deadline, or an empty queue."""
        run = self.run
        warm_until = time.monotonic() + run.spec.warmup_seconds
        async with unimplemented_as("dequeue"):
            for _ in range(WARMUP_BATCHES):
                if time.monotonic() >= warm_until or await self.take() is None:
                    break
        self.dequeue, self.ack = LatencyHistogram(), LatencyHistogram()
        await run.start()
        batches = 0
        last_done: float | None = None
        while batches < run.spec.max_ops and time.monotonic() < run.deadline:
            batches += 1
            t0 = time.perf_counter_ns()
            try:
                n = await self.take()
            except aio.AioRpcError as e:
                check_unimplemented(e, "dequeue")
                run.error(e)
                continue
            except BadResponse as e:
                run.error(e)
                continue
            if n is None:
                run.add("empty_batches")
                break
            run.hist.record(time.perf_counter_ns() - t0)
            run.ops += n
            run.add("batches")
            last_done = time.monotonic()
        run.finish(at=last_done)
        run.payload.append({"dequeue": self.dequeue, "ack": self.ack})


class CqsConsumer(Consumer):
    def __init__(self, run: ClientRun) -> None:
        super().__init__(run)
        self.stub = cqs_pb2_grpc.DtoChangeQueueServiceStub(run.channel(0))
        self.queue = str(run.params["queue"])
        self.request = cqs_pb2.BatchDequeueRequest(
            queue_name=self.queue,
            max_notifications=BATCH,
            prefix_depth=DEPTH,
            wait_time_milliseconds=WAIT_MS,
        )

    async def take(self) -> int | None:
        t0 = time.perf_counter_ns()
        resp = await self.stub.BatchDequeue(self.request, timeout=RPC_TIMEOUT)
        t1 = time.perf_counter_ns()
        tokens = [n.ack_token for n in resp.notifications]
        if not tokens:
            return None
        await self.stub.BatchAcknowledge(
            cqs_pb2.BatchAcknowledgeRequest(queue_name=self.queue, ack_tokens=tokens),
            timeout=RPC_TIMEOUT,
        )
        self.timed(t0, t1, time.perf_counter_ns())
        return len(tokens)


class RecipeConsumer(Consumer):
    def __init__(self, run: ClientRun) -> None:
        super().__init__(run)
        self.kv = rpc_pb2_grpc.KVStub(run.channel(0))
        self.request = rpc_pb2.RangeRequest(
            key=RECIPE_PREFIX, range_end=prefix_end(RECIPE_PREFIX), limit=BATCH
        )

    async def take(self) -> int | None:
        t0 = time.perf_counter_ns()
        resp = await self.kv.Range(self.request, timeout=RPC_TIMEOUT)
        t1 = time.perf_counter_ns()
        if not resp.kvs:
            return None
        txn = rpc_pb2.TxnRequest(
            compare=[
                rpc_pb2.Compare(
                    key=kv.key,
                    target=rpc_pb2.Compare.MOD,
                    result=rpc_pb2.Compare.EQUAL,
                    mod_revision=kv.mod_revision,
                )
                for kv in resp.kvs
            ],
            success=[
                rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=kv.key))
                for kv in resp.kvs
            ],
        )
        tresp = await self.kv.Txn(txn, timeout=RPC_TIMEOUT)
        self.timed(t0, t1, time.perf_counter_ns())
        if not tresp.succeeded:
            raise BadResponse("a claimed key changed under the only consumer")
        return sum(int(r.response_delete_range.deleted) for r in tresp.responses)


async def dequeue_program(run: ClientRun) -> None:
    await run.connect()
    consumer = CqsConsumer(run) if run.params["native"] else RecipeConsumer(run)
    await consumer.consume()


# -- workloads (run in the orchestrator) ------------------------------------------


@dataclass(frozen=True)
class Queued:
    """What row 1 left on a server, for rows 2 and 3."""

    items: int
    seconds: float
    rss_before_mb: float


def _rss_mb(pid: int) -> float:
    """The server's resident set size (with any children), as ResourceMonitor counts it."""
    total = 0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += int(p.memory_info().rss)
    return total / (1024 * 1024)


def _seed(ctx: RunContext) -> str:
    """Create the queue, publish the seed, dequeue it: the token ReEnqueue splits."""
    with ctx.channel() as ch:
        cqs = cqs_pb2_grpc.DtoChangeQueueServiceStub(ch)
        cqs.CreateOrConfigureQueue(
            cqs_pb2.CreateOrConfigureQueueRequest(
                queue_name=QUEUE,
                subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type=DTO_TYPE)],
                depth=DEPTH,
            ),
            timeout=RPC_TIMEOUT,
        )
        rpc_pb2_grpc.KVStub(ch).Put(
            rpc_pb2.PutRequest(
                key=f"/q/dto:{DTO_TYPE}/p/seed".encode(), value=publication(SEED_ID)
            ),
            timeout=RPC_TIMEOUT,
        )
        resp = cqs.BatchDequeue(
            cqs_pb2.BatchDequeueRequest(
                queue_name=QUEUE, max_notifications=1, wait_time_milliseconds=5000
            ),
            timeout=RPC_TIMEOUT,
        )
    if len(resp.notifications) != 1 or resp.notifications[0].dto_id != SEED_ID:
        raise RuntimeError(f"the seed publication was not delivered: {resp}")
    return str(resp.notifications[0].ack_token)


def _stream(ctx: RunContext) -> Outcome:
    try:
        return _run_stream(ctx)
    except grpc.RpcError as e:
        if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
            # The runner reports this row "not implemented"; so do the rows after it.
            ctx.state["cqs stream"] = Unavailable(NOT_IMPLEMENTED)
        raise


def _run_stream(ctx: RunContext) -> Outcome:
    items = ctx.budget.pick(*ITEMS)
    long = replace(ctx, budget=replace(ctx.budget, seconds=ctx.budget.pick(*STREAM_SECONDS)))
    label = f"cqs | ReEnqueue | {ctx.kind}"
    if ctx.kind == "ours":
        token = _seed(ctx)
        rss_before = _rss_mb(ctx.server.pid)
        outcome, payload = long.run_clients(
            reenqueue_program,
            procs=1,
            concurrency=1,
            max_ops=items,
            params={"queue": QUEUE, "token": token, "items": items, "label": label},
            warmup=False,
        )
    else:
        rss_before = _rss_mb(ctx.server.pid)
        outcome, payload = long.run_clients(
            recipe_load_program,
            procs=1,
            concurrency=ETCD_TXNS_IN_FLIGHT,
            max_ops=items,
            params={"items": items, "txn_ops": ETCD_TXN_OPS, "label": label},
            warmup=False,
        )
    ctx.detail = long.detail
    ctx.state["cqs stream"] = outcome
    if not isinstance(outcome, Measurement):
        return outcome
    sent = sum(int(p["sent"]) for p in payload)
    ctx.state["cqs queued"] = Queued(outcome.ops, outcome.seconds, rss_before)
    outcome.extra.update(items=outcome.ops, rss_before_mb=rss_before)
    what = "items" if ctx.kind == "ours" else f"keys in Txns of {ETCD_TXN_OPS} puts"
    outcome.note = (
        f"{outcome.ops:,} {what} in {outcome.seconds:.1f}s; server RSS {rss_before:.0f} MB "
        f"before, peak {outcome.rss_mb:.0f} MB"
        + (f" (the time bound stopped it at {sent:,} of {items:,})" if sent < items else "")
    )
    return outcome


def _from_stream(ctx: RunContext) -> Queued | Outcome:
    """What row 1 queued on this server, or the outcome to report instead."""
    queued = ctx.state.get("cqs queued")
    if isinstance(queued, Queued) and queued.items > 0:
        return queued
    stream = ctx.state.get("cqs stream")
    if isinstance(stream, Unavailable):
        return Unavailable(stream.note)
    return Unavailable("nothing queued: the ReEnqueue row did not measure")


def _memory(ctx: RunContext) -> Outcome:
    queued = _from_stream(ctx)
    if not isinstance(queued, Queued):
        return queued
    monitor = ResourceMonitor(ctx.server.pid)
    monitor.start()
    settle = ctx.budget.pick(*SETTLE_SECONDS)
    samples: list[float] = []
    for _ in range(5):
        time.sleep(settle / 5)
        samples.append(_rss_mb(ctx.server.pid))
    cpu, _ = monitor.stop()
    rss = statistics.median(samples)
    per = (rss - queued.rss_before_mb) * 1024 * 1024 / queued.items
    unit = "notification" if ctx.kind == "ours" else "key of the etcd recipe"
    # The row's figure goes where the table and the chart show a row's figure: the
    # ops/s column holds bytes per notification (ops = bytes over one second).
    return Measurement(
        ops=max(round(per), 0),
        seconds=1.0,
        errors=0,
        p50_ms=None,
        p99_ms=None,
        p999_ms=None,
        cpu_s=cpu,
        rss_mb=rss,
        client_cpu_s=0.0,
        client_procs=0,
        concurrency=1,
        extra={
            "bytes_per_notification": per,
            "queued": queued.items,
            "rss_before_mb": queued.rss_before_mb,
            "rss_after_mb": rss,
        },
        note=(
            f"{per:,.0f} bytes per pending {unit} (RSS {queued.rss_before_mb:.0f} -> "
            f"{rss:.0f} MB with {queued.items:,} queued); the ops/s column holds bytes per "
            "notification, lower is better"
        ),
    )


def _dequeue_ack(ctx: RunContext) -> Outcome:
    queued = _from_stream(ctx)
    if not isinstance(queued, Queued):
        return queued
    native = ctx.kind == "ours"
    outcome, payload = ctx.run_clients(
        dequeue_program,
        procs=1,
        concurrency=1,
        max_ops=-(-queued.items // BATCH),
        params={"native": native, "queue": QUEUE},
    )
    if not isinstance(outcome, Measurement):
        return outcome
    dequeue, ack = LatencyHistogram(), LatencyHistogram()
    for part in payload:
        dequeue.merge(part["dequeue"])
        ack.merge(part["ack"])
    extra = outcome.extra
    for name, hist in (("dequeue", dequeue), ("ack", ack)):
        for q, tag in ((0.5, "p50"), (0.99, "p99")):
            value = hist.percentile_ms(q)
            if value is not None:
                extra[f"{name}_{tag}_ms"] = value
    if extra.get("batches"):
        extra["notifications_per_batch"] = outcome.ops / extra["batches"]
    extra["backlog_at_start"] = queued.items
    if native:
        outcome.note = f"{queued.items:,} queued at the start"
    else:
        outcome.note = (
            f"etcd recipe (Range limit {BATCH} + Txn deleting them), {queued.items:,} keys "
            "at the start"
        )
    if extra.get("empty_batches"):
        outcome.note += "; the queue ran empty before the window ended"
    return outcome


CQS = [
    Workload(
        suite="cqs",
        name="cqs ReEnqueue, one stream",
        about=(
            f"One ReEnqueue stream of {ITEMS[0]:,} items ({ITEMS[1]:,} quick) splitting one "
            f"dequeued notification, ids t/{{tenant}}/s/{{store}}/esls/{{barcode}} over "
            f"{STORES} stores: items/s, peak server RSS during the stream (RSS before in "
            f"extra). etcd: the same items as keys, Txns of {ETCD_TXN_OPS} puts, "
            f"{ETCD_TXNS_IN_FLIGHT} in flight."
        ),
        run=_stream,
    ),
    Workload(
        suite="cqs",
        name="cqs bytes per pending notification",
        about=(
            "Server RSS growth over the ReEnqueue row, per notification it queued; the "
            "ops/s column (and ratio) holds these bytes, lower is better "
            "(extra.bytes_per_notification). etcd: per key of the recipe."
        ),
        run=_memory,
    ),
    Workload(
        suite="cqs",
        name=f"cqs dequeue+ack, batches of {BATCH}",
        about=(
            f"One consumer, BatchDequeue(max {BATCH}, depth {DEPTH}) + BatchAcknowledge back "
            "to back from the queue the ReEnqueue row filled: notifications/s, latency per "
            f"batch. etcd: the recipe, Range limit {BATCH} over priority-ordered keys + Txn "
            "deleting them (no prefix grouping, no in-flight state; etcd's Range counts "
            "the whole backlog)."
        ),
        run=_dequeue_ack,
    ),
]
