"""Checks of KV requests that need no state, done before anything is proposed.

These are etcd's v3rpc checks (`checkRangeRequest`, `checkPutRequest`,
`checkTxnRequest`, `checkIntervals`), with the same errors in the same order, so a
request etcd refuses up front is refused here up front and never reaches the log.
Checks that need state (does the lease exist, is the revision compacted) belong to
`queue_server.kv.executor`, at apply time.

After etcd's checks, the caller may add its own stateless check of what a
Txn puts (`check_txn`'s `put_check`): the API layer checks queue keys and queue
configs this way, so a malformed one is refused before it is proposed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from etcdserverpb import rpc_pb2
from queue_server.errors import (
    DuplicateKey,
    EmptyKey,
    EtcdError,
    KeyNotFound,
    LeaseProvided,
    TooManyOps,
    ValueProvided,
)


def check_range(r: rpc_pb2.RangeRequest) -> None:
    if not r.key:
        raise EmptyKey()


def check_put(r: rpc_pb2.PutRequest) -> None:
    if not r.key:
        raise EmptyKey()
    if r.ignore_value and r.value:
        raise ValueProvided()
    if r.ignore_lease and r.lease:
        raise LeaseProvided()


def check_delete(r: rpc_pb2.DeleteRangeRequest) -> None:
    if not r.key:
        raise EmptyKey()


PutCheck = Callable[[bytes, bytes], None]
"""A stateless check of a put's key and value; raises an EtcdError to refuse it."""


def check_txn(r: rpc_pb2.TxnRequest, max_txn_ops: int, put_check: PutCheck | None = None) -> None:
    """All of etcd's Txn checks, the overlap rule included; then `put_check` on
    every put, in both branches and in nested txns (so a txn is refused whole
    whichever branch its compares would choose). One walk over the ops; a put
    `put_check` refuses is reported only if etcd's checks pass."""
    refused: list[EtcdError] = []
    _check_txn_ops(r, max_txn_ops, put_check, refused)
    _check_intervals(r.success)
    _check_intervals(r.failure)
    if refused:
        raise refused[0]


def _check_txn_ops(
    r: rpc_pb2.TxnRequest,
    max_txn_ops: int,
    put_check: PutCheck | None,
    refused: list[EtcdError],
) -> None:
    ops = max(len(r.compare), len(r.success), len(r.failure))
    if ops > max_txn_ops:
        raise TooManyOps()
    for c in r.compare:
        if not c.key:
            raise EmptyKey()
    for branch in (r.success, r.failure):
        for op in branch:
            kind = op.WhichOneof("request")
            if kind == "request_range":
                check_range(op.request_range)
            elif kind == "request_put":
                put = op.request_put
                check_put(put)
                if put_check is not None and not refused:
                    try:
                        put_check(put.key, put.value)
                    except EtcdError as e:
                        refused.append(e)
            elif kind == "request_delete_range":
                check_delete(op.request_delete_range)
            elif kind == "request_txn":
                _check_txn_ops(op.request_txn, max_txn_ops - ops, put_check, refused)
            else:
                # An empty RequestOp: etcd answers "key not found".
                raise KeyNotFound()


class _Deletes:
    """The key ranges deleted by a txn branch, as etcd's interval tree sees them.

    etcd builds these intervals from the raw range_end, in which an empty string is
    +infinity and "\\0" is an ordinary (small) byte string: a delete with range_end
    "\\0" therefore overlaps nothing here, exactly as in etcd.
    """

    __slots__ = ("intervals",)

    def __init__(self) -> None:
        self.intervals: list[tuple[bytes, bytes | None]] = []

    def add(self, key: bytes, range_end: bytes) -> None:
        self.intervals.append((key, range_end if range_end else None))

    def union(self, other: _Deletes) -> None:
        self.intervals.extend(other.intervals)

    def contains(self, key: bytes) -> bool:
        for begin, end in self.intervals:
            if end is None:
                if key == begin:
                    return True
            elif begin <= key < end:
                return True
        return False


def _check_intervals(ops: Sequence[rpc_pb2.RequestOp]) -> tuple[set[bytes], _Deletes]:
    """Refuse a branch whose puts overlap each other or its deletes (nested txns
    included); returns the branch's puts and deletes for the level above."""
    dels = _Deletes()
    put_keys: list[bytes] = []
    nested: list[rpc_pb2.TxnRequest] = []
    for op in ops:  # one pass: WhichOneof and the field reads are what cost here
        kind = op.WhichOneof("request")
        if kind == "request_put":
            put_keys.append(op.request_put.key)
        elif kind == "request_delete_range":
            d = op.request_delete_range
            dels.add(d.key, d.range_end)
        elif kind == "request_txn":
            nested.append(op.request_txn)
    if not nested and not dels.intervals:  # the common case: puts alone
        puts = set(put_keys)
        if len(puts) != len(put_keys):
            raise DuplicateKey()
        return puts, dels

    puts = set()
    for txn in nested:
        puts_then, dels_then = _check_intervals(txn.success)
        puts_else, dels_else = _check_intervals(txn.failure)
        for k in puts_then:
            if k in puts or dels.contains(k):
                raise DuplicateKey()
            puts.add(k)
        for k in puts_else:
            # then/else exclude each other, so the same key in both is fine
            if (k in puts and k not in puts_then) or dels.contains(k):
                raise DuplicateKey()
            puts.add(k)
        dels.union(dels_then)
        dels.union(dels_else)

    for k in put_keys:
        if k in puts or dels.contains(k):
            raise DuplicateKey()
        puts.add(k)
    return puts, dels
