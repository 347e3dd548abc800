"""KV suites: `put`, `range` and `txn` (compare-and-swap).

Each workload is a closed loop: N requests in flight, each task issuing its next
request as soon as the previous one answers, over one or a few channels per client
process. Latency is per request, measured in the client.
"""

from __future__ import annotations

import os
import random

from benchmarks.loadgen import BadResponse, ClientRun
from benchmarks.results import Measurement, Outcome
from benchmarks.workloads.base import RunContext, Workload, prefix_end
from etcdserverpb import rpc_pb2, rpc_pb2_grpc

VALUE_SIZE = 256
PUT_CONCURRENCY = (1, 16, 64, 256)
RANGE_PREFIX_KEYS = 100
CAS_KEYS = 64
CAS_CONCURRENCY = 16


def channels_for(concurrency: int, procs: int) -> int:
    """One channel per client process up to 32 requests in flight in it, then two."""
    return 1 if concurrency // max(procs, 1) <= 32 else 2


# -- client programs (run in the client processes) --------------------------------


async def put_program(run: ClientRun) -> None:
    """Put distinct keys with a random value of `value_size` bytes."""
    await run.connect()
    stubs = [rpc_pb2_grpc.KVStub(run.channel(i)) for i in range(run.channel_count)]
    value = os.urandom(int(run.params["value_size"]))
    prefix = f"{run.params['prefix']}/{run.index}/".encode()
    timeout = run.spec.rpc_timeout

    async def op(seq: int) -> object:
        stub = stubs[seq % len(stubs)]
        return await stub.Put(
            rpc_pb2.PutRequest(key=prefix + str(seq).encode(), value=value), timeout=timeout
        )

    await run.warmup(op)
    await run.start()
    await run.drive(op)


async def range_program(run: ClientRun) -> None:
    """Range one key (`key`) or a prefix (`key` + `range_end`); checks the count."""
    await run.connect()
    stubs = [rpc_pb2_grpc.KVStub(run.channel(i)) for i in range(run.channel_count)]
    request = rpc_pb2.RangeRequest(
        key=run.params["key"], range_end=run.params.get("range_end", b"")
    )
    expect = int(run.params["expect"])
    timeout = run.spec.rpc_timeout

    async def op(seq: int) -> object:
        resp = await stubs[seq % len(stubs)].Range(request, timeout=timeout)
        if len(resp.kvs) != expect:
            raise BadResponse(f"range returned {len(resp.kvs)} keys, expected {expect}")
        return resp

    await run.warmup(op)
    await run.start()
    await run.drive(op)


async def cas_program(run: ClientRun) -> None:
    """Compare-and-swap on random keys of `keys`: the txn compares the key's
    mod_revision with the last one this client saw; success puts a new value,
    failure ranges the key (and so learns its current mod_revision)."""
    await run.connect()
    stub = rpc_pb2_grpc.KVStub(run.channel(0))
    keys: list[bytes] = list(run.params["keys"])
    last: dict[bytes, int] = dict(zip(keys, run.params["revisions"], strict=True))
    value = os.urandom(VALUE_SIZE)
    rng = random.Random(run.index)
    timeout = run.spec.rpc_timeout
    measuring = False

    async def op(seq: int) -> object:
        key = rng.choice(keys)
        seen = last[key]
        txn = rpc_pb2.TxnRequest(
            compare=[
                rpc_pb2.Compare(
                    key=key,
                    target=rpc_pb2.Compare.MOD,
                    result=rpc_pb2.Compare.EQUAL,
                    mod_revision=seen,
                )
            ],
            success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value))],
            failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key))],
        )
        resp = await stub.Txn(txn, timeout=timeout)
        if resp.succeeded:
            last[key] = max(last[key], resp.header.revision)
            if measuring:
                run.add("cas_succeeded")
        else:
            kvs = resp.responses[0].response_range.kvs
            if not kvs:
                raise BadResponse(f"key {key!r} vanished")
            last[key] = max(last[key], kvs[0].mod_revision)
            if measuring:
                run.add("cas_conflicts")
        return resp

    await run.warmup(op)
    await run.start()
    measuring = True
    await run.drive(op)


# -- workloads (run in the orchestrator) ------------------------------------------


def _put(concurrency: int) -> Workload:
    def run(ctx: RunContext) -> Outcome:
        procs = ctx.procs(concurrency)
        outcome, _ = ctx.run_clients(
            put_program,
            procs=procs,
            concurrency=concurrency,
            max_ops=ctx.budget.pick(200_000, 4_000),
            params={"value_size": VALUE_SIZE, "prefix": f"/bench/put/c{concurrency}"},
            channels=channels_for(concurrency, procs),
        )
        return outcome

    return Workload(
        suite="put",
        name=f"put {VALUE_SIZE} B, {concurrency} in flight",
        about=f"Put of distinct keys with {VALUE_SIZE}-byte values, {concurrency} requests in flight.",
        run=run,
    )


def _seed_range(ctx: RunContext) -> tuple[bytes, bytes]:
    """Once per server: one single key and a prefix of 100 keys."""
    single, prefix = b"/bench/range/single", b"/bench/range/prefix/"
    if not ctx.state.get("range_seeded"):
        value = os.urandom(VALUE_SIZE)
        with ctx.channel() as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            kv.Put(rpc_pb2.PutRequest(key=single, value=value), timeout=10)
            for i in range(RANGE_PREFIX_KEYS):
                kv.Put(rpc_pb2.PutRequest(key=prefix + b"%03d" % i, value=value), timeout=10)
        ctx.state["range_seeded"] = True
    return single, prefix


def _range_single(ctx: RunContext) -> Outcome:
    single, _ = _seed_range(ctx)
    outcome, _ = ctx.run_clients(
        range_program,
        procs=ctx.procs(64),
        concurrency=64,
        max_ops=ctx.budget.pick(400_000, 6_000),
        params={"key": single, "expect": 1},
        channels=channels_for(64, ctx.procs(64)),
    )
    return outcome


def _range_prefix(ctx: RunContext) -> Outcome:
    _, prefix = _seed_range(ctx)
    outcome, _ = ctx.run_clients(
        range_program,
        procs=ctx.procs(16),
        concurrency=16,
        max_ops=ctx.budget.pick(200_000, 3_000),
        params={"key": prefix, "range_end": prefix_end(prefix), "expect": RANGE_PREFIX_KEYS},
    )
    return outcome


def _txn_cas(ctx: RunContext) -> Outcome:
    keys = [b"/bench/cas/%02d" % i for i in range(CAS_KEYS)]
    revisions: list[int] = []
    with ctx.channel() as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        for key in keys:
            resp = kv.Put(rpc_pb2.PutRequest(key=key, value=b"0"), timeout=10)
            revisions.append(resp.header.revision)
    outcome, _ = ctx.run_clients(
        cas_program,
        procs=ctx.procs(CAS_CONCURRENCY),
        concurrency=CAS_CONCURRENCY,
        max_ops=ctx.budget.pick(200_000, 3_000),
        params={"keys": keys, "revisions": revisions},
    )
    if isinstance(outcome, Measurement):
        ok = outcome.extra.get("cas_succeeded", 0.0)
        total = ok + outcome.extra.get("cas_conflicts", 0.0)
        if total:
            outcome.extra["cas_success_ratio"] = ok / total
    return outcome


PUT = [_put(c) for c in PUT_CONCURRENCY]

RANGE = [
    Workload(
        suite="range",
        name="range 1 key, 64 in flight",
        about="Range of one existing key (256 B value), 64 requests in flight.",
        run=_range_single,
    ),
    Workload(
        suite="range",
        name=f"range prefix of {RANGE_PREFIX_KEYS} keys, 16 in flight",
        about=f"Range of a prefix holding {RANGE_PREFIX_KEYS} keys of 256 B, 16 requests in flight.",
        run=_range_prefix,
    ),
]

TXN = [
    Workload(
        suite="txn",
        name=f"CAS txn over {CAS_KEYS} keys, {CAS_CONCURRENCY} in flight",
        about=(
            "Txn: compare mod_revision == last seen, success put, failure range; "
            f"{CAS_CONCURRENCY} in flight over {CAS_KEYS} keys (conflicts are counted)."
        ),
        run=_txn_cas,
    ),
]
