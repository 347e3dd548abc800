"""A distributed mutex on a key prefix (etcd's concurrency.Mutex, server side).

Lock(name, lease): put `name/<lease hex>` with the lease unless it exists; the
holder is the key of the prefix with the lowest create_revision. A waiter watches
the newest key created before its own until it is deleted, then checks again
(no thundering herd). If waiting is abandoned, the waiter's key is deleted.
"""

from __future__ import annotations

import asyncio

from etcdserverpb import rpc_pb2
from queue_server.recipes.local_client import LocalClient


class SessionExpired(Exception):
    """The waiter's key vanished (its lease expired) while it waited."""

    def __init__(self) -> None:
        super().__init__("session expired")


def _first_created(prefix: bytes) -> rpc_pb2.RangeRequest:
    return rpc_pb2.RangeRequest(
        key=prefix,
        range_end=prefix_end(prefix),
        sort_target=rpc_pb2.RangeRequest.CREATE,
        sort_order=rpc_pb2.RangeRequest.ASCEND,
        limit=1,
    )


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that selects every key starting with `prefix`."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\x00"


async def claim_and_wait(
    client: LocalClient, prefix: bytes, my_key: bytes, lease: int, value: bytes
) -> tuple[int, rpc_pb2.ResponseHeader]:
    """Create `my_key` (if absent) under `prefix` and wait until it is the oldest
    key there. Returns (my create_revision, header of the last read)."""
    cmp = rpc_pb2.Compare(
        key=my_key,
        target=rpc_pb2.Compare.CREATE,
        result=rpc_pb2.Compare.EQUAL,
        create_revision=0,
    )
    put = rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=my_key, value=value, lease=lease))
    get = rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=my_key))
    owner = rpc_pb2.RequestOp(request_range=_first_created(prefix))
    resp = await client.txn(
        rpc_pb2.TxnRequest(compare=[cmp], success=[put, owner], failure=[get, owner])
    )
    if resp.succeeded:
        my_rev = resp.header.revision
    else:
        my_rev = resp.responses[0].response_range.kvs[0].create_revision
    header = resp.header
    owners = resp.responses[1].response_range.kvs
    if owners and owners[0].create_revision == my_rev:
        return my_rev, header
    try:
        while True:
            older = client.range(
                rpc_pb2.RangeRequest(
                    key=prefix,
                    range_end=prefix_end(prefix),
                    max_create_revision=my_rev - 1,
                    sort_target=rpc_pb2.RangeRequest.CREATE,
                    sort_order=rpc_pb2.RangeRequest.DESCEND,
                    limit=1,
                )
            )
            if not older.kvs:
                header = older.header
                break
            await client.wait_delete(older.kvs[0].key, older.header.revision)
        mine = client.range(rpc_pb2.RangeRequest(key=my_key))
        if not mine.kvs:
            raise SessionExpired()
        return my_rev, mine.header
    except (asyncio.CancelledError, Exception):
        # do not leave a waiter's key behind: it would block the others
        await asyncio.shield(client.delete(my_key))
        raise
