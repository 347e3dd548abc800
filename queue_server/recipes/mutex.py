"""A distributed mutex on a key prefix (etcd's concurrency.Mutex, server side).

Lock(name, lease): put `name/<lease hex>` with the lease unless it exists; the
holder is the key of the prefix with the lowest create_revision. A waiter watches
the newest key created before its own until it is deleted, then checks again
(no thundering herd). If waiting is abandoned, the waiter's key is deleted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from etcdserverpb import rpc_pb2
from queue_server.recipes.local_client import LocalClient

SESSION_TTL = 60
"""TTL of the lease etcd's server-side recipes grant for a request that names no
lease (concurrency.NewSession's default; the lease is never kept alive)."""


class SessionExpired(Exception):
    """The waiter's key vanished (its lease expired) while it waited."""

    def __init__(self) -> None:
        super().__init__("mutex: session is expired")  # etcd's ErrSessionExpired


async def session_lease(
    client: LocalClient, lease: int, new_id: Callable[[dict[int, Any]], int]
) -> int:
    """etcd's concurrency.NewSession(WithLease(lease)) then Orphan(): the given
    lease, or for 0 a new SESSION_TTL lease that nobody keeps alive (so a lock or
    candidacy taken without a lease goes away by itself, as in etcd)."""
    if lease != 0:
        return lease
    return await client.grant(SESSION_TTL, new_id)


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


@dataclass(frozen=True, slots=True)
class Claim:
    """The outcome of putting one's key under a prefix (unless it exists)."""

    rev: int
    """The key's create revision."""
    header: rpc_pb2.ResponseHeader
    """The header of the claiming txn."""
    existing: bytes | None
    """The key's value if it existed already (not written then), else None."""
    owner: bool
    """Whether the key is the oldest under the prefix."""


async def claim(
    client: LocalClient, prefix: bytes, my_key: bytes, lease: int, value: bytes
) -> Claim:
    """Create `my_key` with `value` and `lease` under `prefix` unless it exists, in
    one txn that also reads the prefix's oldest key (etcd's tryAcquire and the
    first txn of Election.Campaign)."""
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
    existing: bytes | None = None
    if resp.succeeded:
        my_rev = resp.header.revision
    else:
        mine = resp.responses[0].response_range.kvs[0]
        my_rev, existing = mine.create_revision, mine.value
    owners = resp.responses[1].response_range.kvs
    return Claim(
        my_rev, resp.header, existing, bool(owners) and owners[0].create_revision == my_rev
    )


async def wait_older_deleted(client: LocalClient, prefix: bytes, my_rev: int) -> None:
    """Wait until no key under `prefix` was created before `my_rev` (etcd's
    waitDeletes): watch the newest older key until it is deleted, then look
    again (no thundering herd)."""
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
            return
        await client.wait_delete(older.kvs[0].key, older.header.revision)


async def wait_turn(client: LocalClient, prefix: bytes, my_key: bytes, my_rev: int) -> None:
    """After a claim that is not the oldest: wait for the older keys to go. If
    waiting is abandoned (cancelled, or failed), delete `my_key`: a waiter's key
    left behind would block the others."""
    try:
        await wait_older_deleted(client, prefix, my_rev)
    except (asyncio.CancelledError, Exception):
        await asyncio.shield(client.delete(my_key))
        raise


async def claim_and_wait(
    client: LocalClient, prefix: bytes, my_key: bytes, lease: int, value: bytes
) -> tuple[int, rpc_pb2.ResponseHeader]:
    """etcd's Mutex.Lock: create `my_key` (if absent) under `prefix` and wait until
    it is the oldest key there. Returns my create_revision and the header of the
    claim (if it owned the lock at once) or of the read of my key after waiting."""
    c = await claim(client, prefix, my_key, lease, value)
    if c.owner:
        return c.rev, c.header
    await wait_turn(client, prefix, my_key, c.rev)
    mine = client.range(rpc_pb2.RangeRequest(key=my_key))
    if not mine.kvs:
        raise SessionExpired()
    return c.rev, mine.header
