"""Carries out KV requests (etcdserverpb messages) on the MVCC store.

This is etcd's applier for Range, Put, DeleteRange, Txn and Compaction: it turns a
request message into store operations and a response message. Requests are
assumed to have passed `queue_server.kv.validation`; the checks that need state
(lease exists, key exists for ignore_value, revision not compacted) are made here,
before anything changes, so a failed request leaves the store as it was.

It imports protobuf messages but never grpc; it reads no clock and does no I/O.
Response headers carry only `revision`; the API layer fills in the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from etcdserverpb import rpc_pb2
from queue_server.errors import Compacted, FutureRevision, KeyNotFound, LeaseNotFound
from queue_server.mvcc.store import ALL_KEYS_END, KeyValue, MVCCStore, WriteTxn
from queue_server.watch.hub import fill_kv

RangeRequest = rpc_pb2.RangeRequest
SortOrder = rpc_pb2.RangeRequest.SortOrder
SortTarget = rpc_pb2.RangeRequest.SortTarget

_SORT_KEYS: dict[int, Callable[[KeyValue], object]] = {
    rpc_pb2.RangeRequest.KEY: lambda kv: kv.key,
    rpc_pb2.RangeRequest.VERSION: lambda kv: kv.version,
    rpc_pb2.RangeRequest.CREATE: lambda kv: kv.create_revision,
    rpc_pb2.RangeRequest.MOD: lambda kv: kv.mod_revision,
    rpc_pb2.RangeRequest.VALUE: lambda kv: kv.value,
}


def range_end_of(range_end: bytes) -> bytes | None:
    """etcd's range_end convention: empty = the key alone, "\\0" = no upper bound."""
    if not range_end:
        return None
    if range_end == b"\x00":
        return ALL_KEYS_END
    return range_end


LeaseExists = Callable[[int], bool]


def _no_leases(lease_id: int) -> bool:
    return False


class KeyHooks(Protocol):
    """How the rest of the state machine takes part in KV requests without the
    executor knowing it (the queue keyspace router implements it)."""

    def begin_request(self) -> None:
        """The writes of one request are about to be checked, so a check can
        count across them (a Txn producing several messages near max_depth)."""
        ...

    def check_put(self, key: bytes, value: bytes) -> None:
        """Refuse a put before anything changes (raise an EtcdError)."""
        ...

    def route_put(self, key: bytes, value: bytes) -> bytes | None:
        """The key a put really writes (a producer key becomes a message key),
        or None when the put is consumed and writes no key."""
        ...

    def route_delete(self, key: bytes) -> bytes | int:
        """The key a single-key delete really removes (a delivery key stands for
        its message), or how many deliveries it settled when it removes none."""
        ...

    def range_view(
        self, key: bytes, end: bytes | None, revision: int, limit: int
    ) -> tuple[list[KeyValue], int]:
        """Keys that live outside the store, added to a current Range: the first
        `limit` in key order (0: all; -1: none, only counted), and their count."""
        ...


class PlainKeys:
    """No hooks: every key is just a key."""

    def begin_request(self) -> None:
        return None

    def check_put(self, key: bytes, value: bytes) -> None:
        return None

    def route_put(self, key: bytes, value: bytes) -> bytes | None:
        return key

    def route_delete(self, key: bytes) -> bytes | int:
        return key

    def range_view(
        self, key: bytes, end: bytes | None, revision: int, limit: int
    ) -> tuple[list[KeyValue], int]:
        return [], 0


class KVExecutor:
    """Runs KV requests against one store.

    `lease_exists` answers whether a lease id may be attached to a key; `hooks`
    (a `KeyHooks`) lets the queue keyspace check, route and add keys.
    """

    def __init__(
        self,
        store: MVCCStore,
        lease_exists: LeaseExists = _no_leases,
        hooks: KeyHooks | None = None,
    ) -> None:
        self.store = store
        self.lease_exists = lease_exists
        self.hooks: KeyHooks = hooks if hooks is not None else PlainKeys()

    # -- Range ----------------------------------------------------------------

    def range(self, r: rpc_pb2.RangeRequest, txn: WriteTxn | None = None) -> rpc_pb2.RangeResponse:
        """etcd's applier Range: fetch, filter by revisions, sort, then limit."""
        needs_all = bool(
            r.sort_order
            or r.min_mod_revision
            or r.max_mod_revision
            or r.min_create_revision
            or r.max_create_revision
        )
        limit = 0 if needs_all or r.limit <= 0 else r.limit + 1
        reader = txn if txn is not None else self.store
        end = range_end_of(r.range_end)
        rr = reader.range(r.key, end, r.revision, limit, r.count_only)
        kvs = rr.kvs
        count = rr.count
        if not r.revision or r.revision == rr.revision:
            # keys that are not in the store (CQS notifications) join in; the
            # first `limit` of them are enough for the first `limit` of all
            shown, shown_count = self.hooks.range_view(
                r.key, end, rr.revision, -1 if r.count_only else limit
            )
            count += shown_count
            if shown:
                kvs = sorted([*kvs, *shown], key=lambda kv: kv.key)
        if r.max_mod_revision:
            kvs = [kv for kv in kvs if kv.mod_revision <= r.max_mod_revision]
        if r.min_mod_revision:
            kvs = [kv for kv in kvs if kv.mod_revision >= r.min_mod_revision]
        if r.max_create_revision:
            kvs = [kv for kv in kvs if kv.create_revision <= r.max_create_revision]
        if r.min_create_revision:
            kvs = [kv for kv in kvs if kv.create_revision >= r.min_create_revision]

        order = r.sort_order
        if order == RangeRequest.NONE and r.sort_target != RangeRequest.KEY:
            order = RangeRequest.ASCEND
        if order != RangeRequest.NONE:
            sort_key = _SORT_KEYS.get(r.sort_target)
            if sort_key is not None and not (
                order == RangeRequest.ASCEND and r.sort_target == RangeRequest.KEY
            ):
                # Go's sort.Sort is not stable, but keys come in key order and
                # sorted() is stable, so ties stay in key order (what etcd shows).
                if order == RangeRequest.DESCEND:
                    kvs = sorted(kvs, key=sort_key, reverse=True)  # type: ignore[arg-type]
                elif order == RangeRequest.ASCEND:
                    kvs = sorted(kvs, key=sort_key)  # type: ignore[arg-type]

        resp = rpc_pb2.RangeResponse()
        if r.limit > 0 and len(kvs) > r.limit:
            kvs = kvs[: r.limit]
            resp.more = True
        resp.header.revision = rr.revision
        resp.count = count
        add = resp.kvs.add
        keys_only = r.keys_only
        for kv in kvs:
            fill_kv(add(), kv, keys_only)
        return resp

    # -- Put ------------------------------------------------------------------

    def _check_put(self, r: rpc_pb2.PutRequest, lease_first: bool) -> None:
        """etcd checks the lease first for a Put, the key first inside a Txn."""
        if lease_first and r.lease and not self.lease_exists(r.lease):
            raise LeaseNotFound()
        if (r.ignore_value or r.ignore_lease) and self.store.get(r.key) is None:
            raise KeyNotFound()
        if not lease_first and r.lease and not self.lease_exists(r.lease):
            raise LeaseNotFound()
        self.hooks.check_put(r.key, r.value)

    def put(self, r: rpc_pb2.PutRequest, txn: WriteTxn | None = None) -> rpc_pb2.PutResponse:
        if txn is None:
            self.hooks.begin_request()
            self._check_put(r, lease_first=True)
            with self.store.write() as t:
                return self._put(r, t, rpc_pb2.PutResponse())
        return self._put(r, txn, rpc_pb2.PutResponse())

    def _put(
        self, r: rpc_pb2.PutRequest, txn: WriteTxn, resp: rpc_pb2.PutResponse
    ) -> rpc_pb2.PutResponse:
        """Run the put, filling `resp` (a new message, or a Txn's own slot)."""
        value, lease = r.value, r.lease
        key = self.hooks.route_put(r.key, r.value)
        if key is None:  # consumed by the hook (a CQS publication): no key written
            resp.header.revision = txn.read_revision
            return resp
        prev: KeyValue | None = None
        if r.ignore_value or r.ignore_lease or r.prev_kv:
            found = txn.range(key, None).kvs
            prev = found[0] if found else None
        if prev is not None:
            if r.ignore_value:
                value = prev.value
            if r.ignore_lease:
                lease = prev.lease
        txn.put(key, value, lease)
        resp.header.revision = txn.revision
        if r.prev_kv and prev is not None:
            fill_kv(resp.prev_kv, prev)
        return resp

    # -- DeleteRange ----------------------------------------------------------

    def delete_range(
        self, r: rpc_pb2.DeleteRangeRequest, txn: WriteTxn | None = None
    ) -> rpc_pb2.DeleteRangeResponse:
        if txn is None:
            self.hooks.begin_request()
            with self.store.write() as t:
                return self._delete_range(r, t, rpc_pb2.DeleteRangeResponse())
        return self._delete_range(r, txn, rpc_pb2.DeleteRangeResponse())

    def _delete_range(
        self, r: rpc_pb2.DeleteRangeRequest, txn: WriteTxn, resp: rpc_pb2.DeleteRangeResponse
    ) -> rpc_pb2.DeleteRangeResponse:
        """Run the delete, filling `resp` (a new message, or a Txn's own slot)."""
        if r.range_end:
            events = txn.delete_range(r.key, range_end_of(r.range_end))
        else:
            routed = self.hooks.route_delete(r.key)
            if isinstance(routed, int):  # settled deliveries that are not keys (CQS)
                resp.deleted = routed
                resp.header.revision = txn.read_revision
                return resp
            events = txn.delete_range(routed, None)
        resp.deleted = len(events)
        resp.header.revision = txn.read_revision
        if r.prev_kv:
            add = resp.prev_kvs.add
            for e in events:
                if e.prev_kv is not None:
                    fill_kv(add(), e.prev_kv)
        return resp

    # -- Txn ------------------------------------------------------------------

    def txn(self, r: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        """Evaluate the compares, check the chosen branch, then run it at one
        revision. Raises (changing nothing) if the chosen branch would fail."""
        path = self._compare_path(r)
        if not is_read_only(r):  # etcd checks every put first, then every range
            self.hooks.begin_request()
            self._check_branch(r, path, self._check_put_op)
        self._check_branch(r, path, self._check_range_op)
        with self.store.write() as t:
            resp = rpc_pb2.TxnResponse()
            self._run_branch(r, path, 0, t, resp)
            resp.header.revision = t.read_revision
        return resp

    def _compare_path(self, r: rpc_pb2.TxnRequest) -> list[bool]:
        """The outcome of every txn's compares along the branches taken, depth first."""
        ok = all(self._compare(c) for c in r.compare)
        path = [ok]
        for op in r.success if ok else r.failure:
            if op.WhichOneof("request") == "request_txn":
                path.extend(self._compare_path(op.request_txn))
        return path

    def _compare(self, c: rpc_pb2.Compare) -> bool:
        try:
            kvs = self.store.range(c.key, range_end_of(c.range_end)).kvs
        except Exception:  # pragma: no cover - a current read cannot fail
            return False
        target = c.target
        if not kvs:
            if target == rpc_pb2.Compare.VALUE:
                # a missing key has no value to compare, not even an empty one
                return False
            return _compare_kv(c, None)
        return all(_compare_kv(c, kv) for kv in kvs)

    def _check_branch(
        self,
        r: rpc_pb2.TxnRequest,
        path: Sequence[bool],
        check: Callable[[rpc_pb2.RequestOp], None],
    ) -> int:
        """Run `check` on every op of the branches `path` chooses; returns how many
        nested txns it went through (to step along `path`)."""
        nested = 0
        rest = path[1:]
        for op in r.success if path[0] else r.failure:
            if op.WhichOneof("request") == "request_txn":
                n = self._check_branch(op.request_txn, rest, check)
                nested += n + 1
                rest = rest[n + 1 :]
            else:
                check(op)
        return nested

    def _check_put_op(self, op: rpc_pb2.RequestOp) -> None:
        if op.WhichOneof("request") == "request_put":
            self._check_put(op.request_put, lease_first=False)

    def _check_range_op(self, op: rpc_pb2.RequestOp) -> None:
        """etcd's checkRequestRange, which is stricter than a plain Range: any
        revision below the first one kept is refused, negative ones included (a
        plain Range reads a negative revision as "now"). Before any compaction
        the store's compact_revision is -1 (etcd's), so only -1 passes among the
        negatives."""
        if op.WhichOneof("request") != "request_range":
            return
        revision = op.request_range.revision
        if revision == 0:
            return
        if revision > self.store.revision:
            raise FutureRevision()
        if revision < self.store.compact_revision:
            raise Compacted()

    def _run_branch(
        self,
        r: rpc_pb2.TxnRequest,
        path: Sequence[bool],
        pos: int,
        txn: WriteTxn,
        resp: rpc_pb2.TxnResponse,
    ) -> int:
        """Run the branch of `r` that path[pos] chose into `resp`; returns the
        position in `path` after every nested txn of that branch."""
        ok = path[pos]
        resp.succeeded = ok
        pos += 1
        for op in r.success if ok else r.failure:
            out = resp.responses.add()
            kind = op.WhichOneof("request")
            if kind == "request_range":
                out.response_range.CopyFrom(self.range(op.request_range, txn))
            elif kind == "request_put":
                self._put(op.request_put, txn, out.response_put)
            elif kind == "request_delete_range":
                self._delete_range(op.request_delete_range, txn, out.response_delete_range)
            elif kind == "request_txn":
                # etcd gives every nested TxnResponse an empty header (its
                # newTxnResp); Go clients read .Header without a nil check.
                out.response_txn.header.SetInParent()
                pos = self._run_branch(op.request_txn, path, pos, txn, out.response_txn)
        return pos

    # -- Compaction -----------------------------------------------------------

    def compact(self, r: rpc_pb2.CompactionRequest) -> rpc_pb2.CompactionResponse:
        self.store.compact(r.revision)
        resp = rpc_pb2.CompactionResponse()
        resp.header.revision = self.store.revision
        return resp


def _compare_kv(c: rpc_pb2.Compare, kv: KeyValue | None) -> bool:
    """etcd's compareKV; a missing key compares as an all-zero KeyValue."""
    target = c.target
    result = 0
    union = c.WhichOneof("target_union")
    if target == rpc_pb2.Compare.VALUE:
        mine = kv.value if kv is not None else b""
        theirs = c.value if union == "value" else b""
        result = (mine > theirs) - (mine < theirs)
    else:
        if target == rpc_pb2.Compare.CREATE:
            mine_i = kv.create_revision if kv is not None else 0
            theirs_i = c.create_revision if union == "create_revision" else 0
        elif target == rpc_pb2.Compare.MOD:
            mine_i = kv.mod_revision if kv is not None else 0
            theirs_i = c.mod_revision if union == "mod_revision" else 0
        elif target == rpc_pb2.Compare.VERSION:
            mine_i = kv.version if kv is not None else 0
            theirs_i = c.version if union == "version" else 0
        elif target == rpc_pb2.Compare.LEASE:
            mine_i = kv.lease if kv is not None else 0
            theirs_i = c.lease if union == "lease" else 0
        else:
            mine_i = theirs_i = 0  # an unknown target compares as equal, as in etcd
        result = (mine_i > theirs_i) - (mine_i < theirs_i)
    cmp = c.result
    if cmp == rpc_pb2.Compare.EQUAL:
        return result == 0
    if cmp == rpc_pb2.Compare.NOT_EQUAL:
        return result != 0
    if cmp == rpc_pb2.Compare.GREATER:
        return result > 0
    if cmp == rpc_pb2.Compare.LESS:
        return result < 0
    return True


def is_read_only(r: rpc_pb2.TxnRequest) -> bool:
    """True when no branch of the txn (nested ones included) writes."""
    for op in (*r.success, *r.failure):
        kind = op.WhichOneof("request")
        if kind in ("request_put", "request_delete_range"):
            return False
        if kind == "request_txn" and not is_read_only(op.request_txn):
            return False
    return True
