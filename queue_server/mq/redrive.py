"""Redrive: a queue's dead letters put back on the queue, as etcd Txns.

What belongs here: which dead letters a redrive moves and the Txn that moves
each one. Nothing here proposes or does I/O; the caller (the dashboard's
endpoint, or any etcd client following docs/queue.md) sends the Txns through the
ordinary KV path, so a redrive is replicated and checked like any write.

One Txn per dead letter, the shape docs/queue.md documents for clients:

    compare: CREATE(/q/{dead}/{idx}/{key}) == the dead letter's create_revision
    success: DeleteRange(/q/{dead}/{idx}/{key})
             Put(/q/{name}/p/{key}, value, lease)

The compare makes a Txn a no-op if the dead letter was consumed, cancelled or
already redriven (a retried redrive moves nothing twice). The delete removes it
from the dead-letter queue; the put is a produce, rewritten in apply into the
queue's next message key, so the message goes to the back of the line with a
fresh delivery count. The dead letter's lease, if it had one (the lease it was
produced with), goes with it.

Only pending dead letters are moved: one a consumer of the dead-letter queue
holds is being worked on, and deleting it would acknowledge it under that
consumer.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcdserverpb import rpc_pb2
from queue_server.keyspace import grammar as keys
from queue_server.mq.state import QueueState
from queue_server.mvcc.store import MVCCStore

MAX_REDRIVE = 10_000
"""Dead letters one redrive call may move: each is a Txn through the log, and an
HTTP request that proposes more than this would hold its connection for long."""


class RedriveRefused(ValueError):
    """A redrive that cannot be done as asked; the message says why."""


@dataclass(frozen=True, slots=True)
class RedrivePlan:
    """The Txns of one redrive, oldest dead letter first."""

    queue: str
    dead_letter: str
    txns: list[rpc_pb2.TxnRequest]


def redrive_txn(
    spelling: bytes,
    name: bytes,
    dead_key: bytes,
    create_revision: int,
    value: bytes,
    lease: int = 0,
) -> rpc_pb2.TxnRequest:
    """The Txn that moves the dead letter at `dead_key` back onto queue `name`."""
    suffix = dead_key.rsplit(b"/", 1)[1]
    return rpc_pb2.TxnRequest(
        compare=[
            rpc_pb2.Compare(
                key=dead_key,
                target=rpc_pb2.Compare.CREATE,
                result=rpc_pb2.Compare.EQUAL,
                create_revision=create_revision,
            )
        ],
        success=[
            rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=dead_key)),
            rpc_pb2.RequestOp(
                request_put=rpc_pb2.PutRequest(
                    key=keys.producer_key(spelling, name, suffix), value=value, lease=lease
                )
            ),
        ],
    )


def plan_redrive(queues: QueueState, store: MVCCStore, name: str, count: int | None) -> RedrivePlan:
    """The Txns that move up to `count` (all when None) of queue `name`'s pending
    dead letters back onto it. Refused: a name that is not an etcd-key queue's,
    a count that is not a positive whole number up to MAX_REDRIVE."""
    if not name or "/" in name:
        raise RedriveRefused(f"queue name {name!r} is not one segment")
    if count is not None and not 1 <= count <= MAX_REDRIVE:
        raise RedriveRefused(f"count {count} is not between 1 and {MAX_REDRIVE}")
    q = queues.queues.get(name.encode())
    if q is None:
        raise RedriveRefused(f"no queue named {name!r}")
    dead_name = q.dead_letter_name()
    if dead_name == q.name:
        raise RedriveRefused(f"queue {name!r} is its own dead-letter queue")
    dead = queues.queues.get(dead_name)
    txns: list[rpc_pb2.TxnRequest] = []
    limit = MAX_REDRIVE if count is None else count
    for dead_key in dead.pending.values() if dead is not None else ():
        if len(txns) >= limit:
            break
        kv = store.get(dead_key)
        if kv is None:  # pragma: no cover - pending keys exist
            continue
        txns.append(
            redrive_txn(q.spelling, q.name, dead_key, kv.create_revision, kv.value, kv.lease)
        )
    return RedrivePlan(name, dead_name.decode(errors="replace"), txns)
