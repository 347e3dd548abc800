"""Mixed load for the crash-consistency test, in its own process.

    python tests/integration/mixed_load.py ENDPOINT RECORD_FILE TAG MAX_OPS

Runs, with several requests in flight, a mix of: puts; txns that write two keys
with one value (so a half-applied txn is visible); queue produces (a put on
`/q/{QUEUE}/p/{key}`); lease grants, each followed by a put attached to the lease;
and one queue consumer (a watch on `/q/{QUEUE}/c/{uuid}`) that acknowledges every
delivery by deleting the delivered key.

Every operation the server acknowledged is appended to RECORD_FILE and fsynced
before the worker goes on, one line each:

    put KEY REVISION            txn N REVISION              produce KEY REVISION
    deliver MESSAGE_KEY         ack MESSAGE_KEY REVISION    lease LEASE_ID
    leasekey KEY LEASE_ID REVISION

(`produce` names the producer key's last segment; the message key ends with it.)
On stdout it prints `ready` once the consumer's watch exists and `ok` per
acknowledged operation, flushed, so the test follows progress without sleeping.
It stops after MAX_OPS operations, at the first failed request (the server was
killed), or after LIFETIME_SECONDS, whichever comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import uuid
from collections.abc import AsyncIterator
from typing import IO

import grpc
from grpc import aio

from etcdserverpb import rpc_pb2, rpc_pb2_grpc

QUEUE = "crashq"
IN_FLIGHT = 6
"""Workers doing writes at once: enough for group commits of several records, so
kills land inside batches."""
LEASE_TTL = 600
"""Long enough that no lease expires during a nightly run (each restart also
gives every lease a full TTL again)."""
LIFETIME_SECONDS = 60.0
CALL_TIMEOUT = 10.0


class Recorder:
    """Appends one line per acknowledged operation and fsyncs it."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a")  # noqa: SIM115 - closed in main

    def record(self, *words: object) -> None:
        self._file.write(" ".join(str(w) for w in words) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        sys.stdout.write("ok\n")
        sys.stdout.flush()

    def close(self) -> None:
        self._file.close()


async def run(endpoint: str, record_path: str, tag: str, max_ops: int) -> None:
    rec = Recorder(record_path)
    stop = asyncio.Event()
    ops = 0
    rng = random.Random()
    try:
        async with aio.insecure_channel(endpoint) as channel:
            kv = rpc_pb2_grpc.KVStub(channel)
            lease = rpc_pb2_grpc.LeaseStub(channel)

            async def one_op(n: int) -> None:
                kind = rng.choice(("put", "txn", "produce", "produce", "lease"))
                if kind == "put":
                    key = f"/mix/put/{tag}/{n}"
                    r = await kv.Put(
                        rpc_pb2.PutRequest(key=key.encode(), value=f"v{n}".encode()),
                        timeout=CALL_TIMEOUT,
                    )
                    rec.record("put", key, r.header.revision)
                elif kind == "txn":
                    a, b = f"/mix/txa/{tag}/{n}".encode(), f"/mix/txb/{tag}/{n}".encode()
                    value = f"t{n}".encode()
                    t = await kv.Txn(
                        rpc_pb2.TxnRequest(
                            compare=[
                                rpc_pb2.Compare(
                                    key=a,
                                    target=rpc_pb2.Compare.VERSION,
                                    result=rpc_pb2.Compare.EQUAL,
                                    version=0,
                                )
                            ],
                            success=[
                                rpc_pb2.RequestOp(
                                    request_put=rpc_pb2.PutRequest(key=a, value=value)
                                ),
                                rpc_pb2.RequestOp(
                                    request_put=rpc_pb2.PutRequest(key=b, value=value)
                                ),
                            ],
                        ),
                        timeout=CALL_TIMEOUT,
                    )
                    assert t.succeeded
                    rec.record("txn", f"{tag}/{n}", t.header.revision)
                elif kind == "produce":
                    name = f"m-{tag}-{n}"
                    r = await kv.Put(
                        rpc_pb2.PutRequest(
                            key=f"/q/{QUEUE}/p/{name}".encode(), value=name.encode()
                        ),
                        timeout=CALL_TIMEOUT,
                    )
                    rec.record("produce", name, r.header.revision)
                else:
                    g = await lease.LeaseGrant(
                        rpc_pb2.LeaseGrantRequest(TTL=LEASE_TTL), timeout=CALL_TIMEOUT
                    )
                    rec.record("lease", g.ID)
                    key = f"/mix/lease/{tag}/{n}"
                    r = await kv.Put(
                        rpc_pb2.PutRequest(key=key.encode(), value=b"l", lease=g.ID),
                        timeout=CALL_TIMEOUT,
                    )
                    rec.record("leasekey", key, g.ID, r.header.revision)

            async def worker() -> None:
                nonlocal ops
                while not stop.is_set() and ops < max_ops:
                    ops += 1
                    try:
                        await one_op(ops)
                    except grpc.RpcError:
                        stop.set()

            async def consumer(created: asyncio.Event) -> None:
                watch_key = f"/q/{QUEUE}/c/{uuid.uuid4()}".encode()
                requests: asyncio.Queue[rpc_pb2.WatchRequest] = asyncio.Queue()
                await requests.put(
                    rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=watch_key))
                )

                async def request_iter() -> AsyncIterator[rpc_pb2.WatchRequest]:
                    while True:
                        yield await requests.get()

                call = rpc_pb2_grpc.WatchStub(channel).Watch(request_iter())
                try:
                    async for resp in call:
                        if resp.created:
                            created.set()
                        for ev in resp.events:
                            # before the delete: it may be applied with its answer lost
                            rec.record("deliver", ev.kv.key.decode())
                            d = await kv.DeleteRange(
                                rpc_pb2.DeleteRangeRequest(key=ev.kv.key), timeout=CALL_TIMEOUT
                            )
                            if d.deleted == 1:
                                rec.record("ack", ev.kv.key.decode(), d.header.revision)
                        if stop.is_set():
                            break
                except grpc.RpcError:
                    pass
                finally:
                    stop.set()
                    call.cancel()

            created = asyncio.Event()
            consuming = asyncio.create_task(consumer(created))
            await asyncio.wait_for(created.wait(), CALL_TIMEOUT)
            sys.stdout.write("ready\n")
            sys.stdout.flush()
            await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
            stop.set()
            consuming.cancel()
            await asyncio.gather(consuming, return_exceptions=True)
    finally:
        rec.close()


def main() -> None:
    endpoint, record_path, tag, max_ops = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with contextlib.suppress(TimeoutError, grpc.RpcError):
        asyncio.run(asyncio.wait_for(run(endpoint, record_path, tag, max_ops), LIFETIME_SECONDS))


if __name__ == "__main__":
    main()
