"""Differential tests: the same KV request sequences against our server and real etcd.

Every case is a function that builds a list of requests from a `Ctx` (a key prefix
of its own and the revision the server was at when the case began). The runner
sends the sequence to real etcd and to our server and compares, step by step:

- responses, after dropping the header's cluster_id, member_id and raft_term and
  rewriting every revision (header.revision, create_revision, mod_revision) as an
  offset from the case's starting revision, since the two servers need not be at
  the same absolute revision;
- errors: the gRPC code and the exact details string (the code alone where the
  details carry transport numbers);
- the store's revision after every step, relative to the start; and on each
  server, a step that failed must not have moved the revision.

Some steps also say what etcd must answer (`expect`), so a case that no longer
exercises what it is named for (say, an "error" case that etcd accepts) fails
loudly instead of comparing two successes.

Cases run in file order on two module-scoped servers that only this module uses,
so `range_all_keys`, which reads the whole key space, runs first and sees only its
own keys. Each case uses keys under its own prefix `/diff/NNN-name/`, so a case's
from-key reads see nothing of earlier cases (their prefixes sort lower) and later
cases have not run yet.

Lease cases use the same runner with lease ids of their own (`Ctx.lease`); a
lease's remaining TTL is compared to within TTL_SLACK seconds, and lists that
etcd builds from Go maps (a lease's keys, LeaseLeases) are sorted. Lock and
Election cases call the v3lock / v3election services.

Watch cases (`WATCH_CASES`, `test_watch_same_as_etcd`) run on one Watch stream
each: a step is a request on the stream or a KV call, and says how many watch
responses etcd sends for it; the runner reads that many, then ends with a
barrier (see `run_watch_case`). Responses are compared like the others, with
compact_revision relative too.

etcd 3.4 vs 3.5: every case below behaves the same in etcd 3.4.23 (the reference
run here) and in etcd 3.5 (our target), checked against the 3.5 sources
(server/etcdserver/apply.go, api/v3rpc/key.go, api/v3rpc/watch.go,
mvcc/kvstore*.go, mvcc/watchable_store.go, lease/lessor.go, api/v3lock,
api/v3election, client/v3/concurrency): none needed a 3.5-specific expectation.
The cases avoid what differs: a WatchProgressRequest is only sent when every
watcher of the stream is synced (3.4 answers at once, 3.5.9 defers the answer,
3.5.17 drops the request while a watcher catches up, and answers nothing on a
stream with no watchers); in 3.5 a watcher that a compaction cancelled counts
as not synced until the client cancels it too (tests/unit/
test_watch_compacted.py has ours).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pprint import pformat
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from etcdserverpb import (
    rpc_pb2,
    rpc_pb2_grpc,
    v3election_pb2,
    v3election_pb2_grpc,
    v3lock_pb2,
    v3lock_pb2_grpc,
)
from tests.support.processes import EtcdProcess, ServerProcess

pytestmark = pytest.mark.compat

RPC_TIMEOUT = 10.0
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops, also ours
MIB = 1024 * 1024
MAX_REQUEST_BYTES = 1536 * 1024  # etcd's default --max-request-bytes, also ours

RR = rpc_pb2.RangeRequest
C = rpc_pb2.Compare

# -- request builders ---------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One request of a case. `expect` is the gRPC code name etcd must answer
    ("OK" for success), when the case depends on it; `code_only` compares the
    error code but not the details (for messages that carry sizes)."""

    method: str
    request: Message
    expect: str | None = None
    code_only: bool = False


LEASES_PER_CASE = 1000


@dataclass(frozen=True)
class Ctx:
    """What a case builds its requests from: its key prefix, the revision the
    server was at before the case's first request, and the first of the lease
    ids it may use (`lease(n)`, n < LEASES_PER_CASE)."""

    prefix: bytes
    base: int
    lease_base: int = 0

    def lease(self, n: int) -> int:
        return self.lease_base + n

    def k(self, name: str | bytes = b"") -> bytes:
        return self.prefix + (name.encode() if isinstance(name, str) else name)

    def rev(self, offset: int) -> int:
        """The absolute revision `offset` writes after the case began."""
        return self.base + offset


def prefix_end(key: bytes) -> bytes:
    """etcd's GetPrefixRangeEnd."""
    b = bytearray(key)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\x00"


def put(key: bytes, value: bytes = b"", *, expect: str | None = None, **kw: Any) -> Step:
    return Step("Put", rpc_pb2.PutRequest(key=key, value=value, **kw), expect)


def get(key: bytes, range_end: bytes = b"", *, expect: str | None = None, **kw: Any) -> Step:
    return Step("Range", rpc_pb2.RangeRequest(key=key, range_end=range_end, **kw), expect)


def delete(key: bytes, range_end: bytes = b"", *, expect: str | None = None, **kw: Any) -> Step:
    return Step(
        "DeleteRange", rpc_pb2.DeleteRangeRequest(key=key, range_end=range_end, **kw), expect
    )


def txn_req(
    compare: list[rpc_pb2.Compare] | None = None,
    success: list[rpc_pb2.RequestOp] | None = None,
    failure: list[rpc_pb2.RequestOp] | None = None,
) -> rpc_pb2.TxnRequest:
    return rpc_pb2.TxnRequest(compare=compare or [], success=success or [], failure=failure or [])


def txn(
    compare: list[rpc_pb2.Compare] | None = None,
    success: list[rpc_pb2.RequestOp] | None = None,
    failure: list[rpc_pb2.RequestOp] | None = None,
    expect: str | None = None,
) -> Step:
    return Step("Txn", txn_req(compare, success, failure), expect)


def compact(revision: int, expect: str | None = None, physical: bool = False) -> Step:
    return Step("Compact", rpc_pb2.CompactionRequest(revision=revision, physical=physical), expect)


def op_get(key: bytes, range_end: bytes = b"", **kw: Any) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key, range_end=range_end, **kw))


def op_put(key: bytes, value: bytes = b"", **kw: Any) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, **kw))


def op_del(key: bytes, range_end: bytes = b"", **kw: Any) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(
        request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=range_end, **kw)
    )


def op_txn(
    compare: list[rpc_pb2.Compare] | None = None,
    success: list[rpc_pb2.RequestOp] | None = None,
    failure: list[rpc_pb2.RequestOp] | None = None,
) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_txn=txn_req(compare, success, failure))


def cmp(key: bytes, target: int, result: int, range_end: bytes = b"", **operand: Any) -> C:
    """A Compare; `operand` is one of version/create_revision/mod_revision/value/lease
    (or none, to leave the oneof unset). Raw ints are allowed for target/result."""
    return C(key=key, target=target, result=result, range_end=range_end, **operand)  # type: ignore[arg-type]


# -- the cases ----------------------------------------------------------------

Builder = Callable[[Ctx], list[Step]]
CASES: list[tuple[str, Builder]] = []


def case(fn: Builder) -> Builder:
    """Register a case; cases run in the order they are defined."""
    CASES.append((fn.__name__.removeprefix("case_"), fn))
    return fn


@case
def case_range_all_keys(c: Ctx) -> list[Step]:
    # Runs first: the whole key space is just this case's keys on both servers.
    return [
        put(c.k("a"), b"1"),
        put(c.k("b"), b"2"),
        put(c.k("c"), b"3"),
        get(b"\x00", b"\x00", expect="OK"),
        get(b"\x00", b"\x00", limit=2),
        get(b"\x00", b"\x00", count_only=True),
        get(b"\x00", b"\x00", keys_only=True, sort_order=RR.DESCEND),
        delete(b"\x00", b"\x00", prev_kv=True, expect="OK"),
        get(b"\x00", b"\x00"),
    ]


@case
def case_range_single(c: Ctx) -> list[Step]:
    return [
        put(c.k("a"), b"1"),
        put(c.k("ab"), b"2"),
        get(c.k("a")),
        get(c.k("missing")),
        get(c.k("a"), revision=-1),  # negative: the current revision
        get(c.k("a"), limit=-3),  # negative limit: no limit
        get(c.k("a"), serializable=True),
    ]


@case
def case_range_prefix_and_from_key(c: Ctx) -> list[Step]:
    return [
        put(c.k("a"), b"1"),
        put(c.k("ab"), b"2"),
        put(c.k("abc"), b"3"),
        put(c.k("b"), b"4"),
        put(c.k(b"a\xff"), b"5"),
        get(c.k("a"), prefix_end(c.k("a"))),
        get(c.k("ab"), prefix_end(c.k("ab"))),
        get(c.k(), prefix_end(c.k())),
        get(c.k("ab"), b"\x00"),  # from-key
        get(c.k("zzz"), b"\x00"),  # from-key past every key
        get(c.k("b"), c.k("a")),  # range_end < key: empty, not an error
        get(c.k("a"), c.k("a")),  # range_end == key: empty
        delete(c.k("b"), c.k("a"), expect="OK"),  # deletes nothing
        delete(c.k("ab"), b"\x00", prev_kv=True),  # from-key delete
        get(c.k(), prefix_end(c.k())),
    ]


@case
def case_limit_more_count(c: Ctx) -> list[Step]:
    end = prefix_end(c.k())
    steps = [put(c.k(f"k{i}"), str(i).encode()) for i in range(5)]
    steps += [
        get(c.k(), end, limit=2),
        get(c.k(), end, limit=4),
        get(c.k(), end, limit=5),
        get(c.k(), end, limit=6),
        get(c.k(), end, limit=2, count_only=True),
        get(c.k(), end, limit=2, keys_only=True),
        get(c.k(), end, limit=2, sort_order=RR.DESCEND),
        get(c.k(), end, limit=2, sort_target=RR.VALUE, sort_order=RR.DESCEND),
        # filters apply after the fetch: count is still every key in the range
        get(c.k(), end, limit=1, min_mod_revision=c.rev(3)),
        get(c.k(), end, limit=10, max_create_revision=c.rev(2)),
    ]
    return steps


@case
def case_revisions(c: Ctx) -> list[Step]:
    a = c.k("a")
    return [
        put(a, b"1"),  # +1
        put(a, b"2"),  # +2
        delete(a),  # +3
        put(a, b"3"),  # +4 (a new generation)
        put(c.k("b"), b"b"),  # +5
        get(a, revision=c.rev(1)),
        get(a, revision=c.rev(2)),
        get(a, revision=c.rev(3)),  # deleted then: empty
        get(a, revision=c.rev(4)),
        get(c.k(), prefix_end(c.k()), revision=c.rev(4)),
        get(c.k(), prefix_end(c.k()), revision=c.rev(5), count_only=True),
        get(a, revision=c.rev(5)),  # the current revision
        get(a, revision=c.rev(6), expect="OUT_OF_RANGE"),  # future
        get(a, revision=c.rev(1000), expect="OUT_OF_RANGE"),
    ]


@case
def case_before_any_compaction(c: Ctx) -> list[Step]:
    # Must run before every case that compacts: etcd's first kept revision is -1
    # until the first compaction, and it decides what a Txn may read and whether
    # Compact(0) is accepted.
    a = c.k("a")
    return [
        put(a, b"1"),
        txn(success=[op_get(a, revision=-1)], expect="OK"),
        txn(success=[op_get(a, revision=-2)], expect="OUT_OF_RANGE"),
        txn(success=[op_put(c.k("b")), op_get(a, revision=-2)], expect="OUT_OF_RANGE"),
        get(a, revision=-2, expect="OK"),
        compact(-1, expect="OUT_OF_RANGE"),
        # Accepted once (the compaction revision goes from -1 to 0); then a
        # second Compact(0) and a Txn read at revision -1 are refused.
        compact(0, expect="OK"),
        compact(0, expect="OUT_OF_RANGE"),
        txn(success=[op_get(a, revision=-1)], expect="OUT_OF_RANGE"),
    ]


@case
def case_revision_compacted(c: Ctx) -> list[Step]:
    a = c.k("a")
    return [
        put(a, b"1"),  # +1
        put(a, b"2"),  # +2
        put(a, b"3"),  # +3
        compact(c.rev(2), expect="OK"),
        get(a, revision=c.rev(1), expect="OUT_OF_RANGE"),  # compacted
        get(a, revision=c.rev(2), expect="OK"),  # the compacted revision itself is readable
        get(a, revision=c.rev(3)),
        txn(success=[op_get(a, revision=c.rev(1))], expect="OUT_OF_RANGE"),
        txn(success=[op_put(a, b"x"), op_get(a, revision=c.rev(1))], expect="OUT_OF_RANGE"),
        txn(success=[op_get(a, revision=c.rev(2))], expect="OK"),
        txn(success=[op_get(a, revision=c.rev(9))], expect="OUT_OF_RANGE"),  # future, in a txn
        txn(success=[op_put(a, b"y"), op_get(a, revision=c.rev(4))], expect="OUT_OF_RANGE"),
        # In a Txn, etcd refuses any revision below the compacted one, negative
        # ones included (checkRequestRange: revision < FirstRev); a plain Range
        # reads a negative revision as "now".
        txn(success=[op_get(a, revision=-1)], expect="OUT_OF_RANGE"),
        txn(success=[op_put(c.k("b")), op_get(a, revision=-5)], expect="OUT_OF_RANGE"),
        get(a, revision=-1, expect="OK"),
    ]


@case
def case_sort(c: Ctx) -> list[Step]:
    # Creation order d, b, a, c; values and versions chosen so every target gives
    # a different order, with ties (version) to show ties keep key order.
    steps = [
        put(c.k("d"), b"2"),
        put(c.k("b"), b"4"),
        put(c.k("a"), b"1"),
        put(c.k("c"), b"3"),
        put(c.k("b"), b"5"),  # b: version 2
        put(c.k("d"), b"0"),  # d: version 2
        put(c.k("a"), b"6"),  # a: version 2, mod after d
    ]
    end = prefix_end(c.k())
    for target in (RR.KEY, RR.VERSION, RR.CREATE, RR.MOD, RR.VALUE):
        for order in (RR.NONE, RR.ASCEND, RR.DESCEND):
            steps.append(get(c.k(), end, sort_target=target, sort_order=order))
    steps += [
        get(c.k(), end, sort_target=RR.VALUE, sort_order=RR.DESCEND, limit=2),
        get(c.k(), end, sort_target=RR.CREATE, limit=3),  # target alone: ascending
        get(c.k(), end, sort_target=RR.MOD, sort_order=RR.ASCEND, keys_only=True),
        get(c.k(), end, sort_order=7),  # unknown order: unsorted (key order)
    ]
    return steps


@case
def case_keys_and_count_only(c: Ctx) -> list[Step]:
    end = prefix_end(c.k())
    return [
        put(c.k("a"), b"1"),
        put(c.k("b"), b"2"),
        get(c.k(), end, keys_only=True),
        get(c.k(), end, count_only=True),
        get(c.k(), end, count_only=True, keys_only=True),
        get(c.k("missing"), count_only=True),
    ]


@case
def case_revision_filters(c: Ctx) -> list[Step]:
    end = prefix_end(c.k())
    steps = [
        put(c.k("a"), b"1"),  # +1
        put(c.k("b"), b"2"),  # +2
        put(c.k("c"), b"3"),  # +3
        put(c.k("a"), b"4"),  # +4: a is created +1, modified +4
        put(c.k("d"), b"5"),  # +5
    ]
    for field in ("min_mod_revision", "max_mod_revision", "min_create_revision"):
        for offset in (0, 2, 4, 6):
            bound: dict[str, Any] = {field: c.rev(offset)}
            steps.append(get(c.k(), end, **bound))
    steps += [
        get(c.k(), end, max_create_revision=c.rev(2)),
        get(c.k(), end, min_mod_revision=c.rev(2), max_mod_revision=c.rev(4)),
        get(c.k(), end, min_create_revision=c.rev(2), max_create_revision=c.rev(3)),
        get(c.k(), end, min_mod_revision=c.rev(3), sort_target=RR.MOD, sort_order=RR.DESCEND),
        get(c.k(), end, max_mod_revision=c.rev(3), count_only=True),
        get(c.k(), end, min_mod_revision=c.rev(2), revision=c.rev(3)),
    ]
    return steps


@case
def case_put_prev_kv(c: Ctx) -> list[Step]:
    a = c.k("a")
    return [
        put(a, b"1", prev_kv=True),  # nothing before: no prev_kv
        put(a, b"2", prev_kv=True),
        put(a, b"", prev_kv=True),  # empty value is a value
        get(a),
        delete(a),
        put(a, b"3", prev_kv=True),  # deleted before: no prev_kv, version 1 again
    ]


@case
def case_put_ignore_value(c: Ctx) -> list[Step]:
    a = c.k("a")
    return [
        put(a, ignore_value=True, expect="INVALID_ARGUMENT"),  # key not found
        put(a, b"1"),
        put(a, ignore_value=True, prev_kv=True, expect="OK"),
        get(a),
        put(a, b"x", ignore_value=True, expect="INVALID_ARGUMENT"),  # value is provided
        delete(a),
        put(a, ignore_value=True, expect="INVALID_ARGUMENT"),  # deleted: key not found
        txn(success=[op_put(a, ignore_value=True)], expect="INVALID_ARGUMENT"),
        txn(success=[op_put(a, b"v", ignore_value=True)], expect="INVALID_ARGUMENT"),
    ]


@case
def case_put_ignore_lease(c: Ctx) -> list[Step]:
    a = c.k("a")
    return [
        put(a, b"1", ignore_lease=True, expect="INVALID_ARGUMENT"),  # key not found
        put(a, b"1"),
        put(a, b"2", ignore_lease=True, prev_kv=True, expect="OK"),
        put(a, ignore_lease=True, ignore_value=True, expect="OK"),
        put(a, b"3", ignore_lease=True, lease=77, expect="INVALID_ARGUMENT"),  # lease provided
        get(a),
        txn(success=[op_put(c.k("nope"), b"v", ignore_lease=True)], expect="INVALID_ARGUMENT"),
        txn(success=[op_put(a, b"t", ignore_lease=True)], expect="OK"),
    ]


@case
def case_put_lease_not_found(c: Ctx) -> list[Step]:
    a = c.k("a")
    return [
        put(a, b"1", lease=1234, expect="NOT_FOUND"),
        # a Put checks the lease before the key...
        put(a, ignore_value=True, lease=1234, expect="NOT_FOUND"),
        put(a, b"1"),
        put(a, b"2", lease=1234, prev_kv=True, expect="NOT_FOUND"),
        # ...a put inside a Txn checks the key first, then the lease
        txn(success=[op_put(c.k("b"), ignore_value=True, lease=1234)], expect="INVALID_ARGUMENT"),
        txn(success=[op_put(a, ignore_value=True, lease=1234)], expect="NOT_FOUND"),
        txn(success=[op_put(a, b"3", lease=1234)], expect="NOT_FOUND"),
        # every put of the branch is checked before any range: the first failing
        # put decides, whatever comes before it
        txn(success=[op_put(a, b"3", lease=1234), op_put(c.k("b"), ignore_value=True)]),
        txn(success=[op_put(c.k("b"), ignore_value=True), op_put(a, b"3", lease=1234)]),
        txn(success=[op_get(a, revision=c.rev(100)), op_put(c.k("b"), ignore_lease=True)]),
        txn(success=[op_put(c.k("b"), b"x"), op_get(a, revision=c.rev(100))]),
        # the branch not taken is not checked
        txn(
            compare=[cmp(a, C.VALUE, C.EQUAL, value=b"1")],
            success=[op_put(a, b"4")],
            failure=[op_put(a, b"5", lease=1234)],
            expect="OK",
        ),
        get(a),
    ]


@case
def case_empty_key(c: Ctx) -> list[Step]:
    return [
        put(b"", b"v", expect="INVALID_ARGUMENT"),
        get(b"", expect="INVALID_ARGUMENT"),
        get(b"", b"\x00", expect="INVALID_ARGUMENT"),
        delete(b"", expect="INVALID_ARGUMENT"),
        delete(b"", b"\x00", expect="INVALID_ARGUMENT"),
        txn(compare=[cmp(b"", C.VERSION, C.EQUAL, version=0)], expect="INVALID_ARGUMENT"),
        txn(success=[op_put(b"", b"v")], expect="INVALID_ARGUMENT"),
        txn(failure=[op_get(b"")], expect="INVALID_ARGUMENT"),
        txn(success=[op_txn(success=[op_del(b"")])], expect="INVALID_ARGUMENT"),
        # the order of etcd's checks: the empty key before value/lease provided
        put(b"", b"v", ignore_value=True, expect="INVALID_ARGUMENT"),
        put(c.k("a"), b"v", ignore_value=True, lease=5, ignore_lease=True),
    ]


@case
def case_delete_range(c: Ctx) -> list[Step]:
    end = prefix_end(c.k())
    return [
        put(c.k("a"), b"1"),
        put(c.k("b"), b"2"),
        put(c.k("b"), b"2b"),
        put(c.k("c"), b"3"),
        put(c.k("d"), b"4"),
        delete(c.k("missing"), prev_kv=True),  # deletes nothing: revision unchanged
        delete(c.k("a"), prev_kv=True),
        delete(c.k("a"), prev_kv=True),  # already gone
        delete(c.k("b"), c.k("d"), prev_kv=True),
        delete(c.k("c"), end),  # nothing left in [c, end) but d
        get(c.k(), end),
        put(c.k("e"), b"5"),
        delete(c.k(), b"\x00"),  # from the prefix on: every key of this case
        get(c.k(), end),
    ]


@case
def case_compare_targets(c: Ctx) -> list[Step]:
    a = c.k("a")
    steps = [put(a, b"m"), put(a, b"m")]  # a: create +1, mod +2, version 2, value "m"
    operands: dict[int, tuple[str, list[Any]]] = {
        C.VERSION: ("version", [1, 2, 3]),
        C.CREATE: ("create_revision", [c.rev(0), c.rev(1), c.rev(2)]),
        C.MOD: ("mod_revision", [c.rev(1), c.rev(2), c.rev(3)]),
        C.VALUE: ("value", [b"l", b"m", b"n"]),
        C.LEASE: ("lease", [-1, 0, 1]),
    }
    hit, miss = [op_get(a)], [op_get(c.k("other"))]
    for target, (field, values) in operands.items():
        for result in (C.EQUAL, C.NOT_EQUAL, C.GREATER, C.LESS):
            for v in values:
                steps.append(txn([cmp(a, target, result, **{field: v})], hit, miss))
    return steps


@case
def case_compare_ranges_and_missing_keys(c: Ctx) -> list[Step]:
    a, b, m = c.k("a"), c.k("b"), c.k("missing")
    end = prefix_end(c.k())
    yes, no = [op_put(c.k("yes"), b"1")], [op_put(c.k("no"), b"1")]
    return [
        put(a, b"1"),
        put(b, b"1"),
        put(b, b"2"),  # b: version 2
        txn([cmp(c.k(), C.VERSION, C.GREATER, end, version=0)], yes, no),
        txn([cmp(c.k(), C.VERSION, C.EQUAL, end, version=1)], yes, no),  # b is 2: false
        txn([cmp(c.k(), C.VALUE, C.LESS, end, value=b"3")], yes, no),
        txn([cmp(a, C.VERSION, C.EQUAL, b"\x00", version=1)], yes, no),  # from-key
        txn([cmp(c.k("x"), C.VERSION, C.EQUAL, b"\x00", version=0)], yes, no),  # no keys
        txn([cmp(b, C.MOD, C.LESS, a, mod_revision=1)], yes, no),  # range_end < key
        # a missing key compares as an all-zero KeyValue...
        txn([cmp(m, C.VERSION, C.EQUAL, version=0)], yes, no),
        txn([cmp(m, C.CREATE, C.EQUAL, create_revision=0)], yes, no),
        txn([cmp(m, C.MOD, C.LESS, mod_revision=1)], yes, no),
        txn([cmp(m, C.LEASE, C.EQUAL, lease=0)], yes, no),
        # ...but a value compare on a missing key is always false
        txn([cmp(m, C.VALUE, C.EQUAL, value=b"")], yes, no),
        txn([cmp(m, C.VALUE, C.NOT_EQUAL, value=b"x")], yes, no),
        txn([cmp(c.k("zz"), C.VALUE, C.LESS, prefix_end(c.k("zz")), value=b"x")], yes, no),
        # several compares: all must hold
        txn(
            [cmp(a, C.VERSION, C.EQUAL, version=1), cmp(b, C.VERSION, C.EQUAL, version=2)], yes, no
        ),
        txn(
            [cmp(a, C.VERSION, C.EQUAL, version=1), cmp(b, C.VERSION, C.EQUAL, version=1)], yes, no
        ),
        get(c.k(), end),
    ]


@case
def case_compare_unknown_and_mismatched(c: Ctx) -> list[Step]:
    a = c.k("a")
    hit, miss = [op_get(a)], [op_get(c.k("other"))]
    return [
        put(a, b"v"),
        # an unknown target compares as equal
        txn([cmp(a, 9, C.EQUAL, version=5)], hit, miss, expect="OK"),
        txn([cmp(a, 9, C.GREATER)], hit, miss),
        txn([cmp(a, 9, C.NOT_EQUAL)], hit, miss),
        txn([cmp(c.k("missing"), 9, C.EQUAL)], hit, miss),
        # an unknown result holds whatever the values
        txn([cmp(a, C.VERSION, 9, version=100)], hit, miss, expect="OK"),
        txn([cmp(a, C.VALUE, 7, value=b"zzz")], hit, miss),
        # an operand that does not match the target: the target's operand is 0/""
        txn([cmp(a, C.VERSION, C.EQUAL, value=b"v")], hit, miss),
        txn([cmp(a, C.VERSION, C.GREATER, mod_revision=1000)], hit, miss),
        txn([cmp(a, C.VALUE, C.EQUAL, version=1)], hit, miss),
        txn([cmp(a, C.VALUE, C.GREATER)], hit, miss),  # no operand at all
        txn([cmp(a, C.CREATE, C.GREATER, lease=1 << 40)], hit, miss),
    ]


@case
def case_txn_basics(c: Ctx) -> list[Step]:
    a, b = c.k("a"), c.k("b")
    return [
        txn(expect="OK"),  # empty: succeeds, changes nothing
        txn(failure=[op_put(a, b"never")]),  # no compares: success branch (empty)
        put(a, b"1"),
        txn(
            [cmp(a, C.VALUE, C.EQUAL, value=b"1")],
            [op_put(a, b"2", prev_kv=True), op_put(b, b"x"), op_get(a), op_get(c.k(), b"\x00")],
            [op_get(a)],
        ),
        txn(
            [cmp(a, C.VALUE, C.EQUAL, value=b"1")],
            [op_put(a, b"never")],
            [op_del(b, prev_kv=True), op_get(b), op_put(c.k("c"), b"y"), op_get(c.k(), b"\x00")],
        ),
        # a range before and after the writes, and one at the revision before the txn
        txn(
            success=[
                op_get(a),
                op_del(a),
                op_get(a),
                op_put(a, b"3"),
                op_get(a),
                op_get(a, revision=c.rev(1)),
                op_get(c.k(), b"\x00", count_only=True),
            ]
        ),
        # a delete that deletes nothing leaves the revision alone
        txn(success=[op_del(c.k("none")), op_get(a)]),
        txn(success=[op_del(c.k("none"), prefix_end(c.k("none")), prev_kv=True)]),
        get(c.k(), prefix_end(c.k())),
    ]


@case
def case_nested_txns(c: Ctx) -> list[Step]:
    a, b, d = c.k("a"), c.k("b"), c.k("d")
    return [
        put(a, b"1"),
        # nested compares see the state before the txn, not the outer put
        txn(
            [cmp(a, C.VALUE, C.EQUAL, value=b"1")],
            [
                op_put(a, b"2"),
                op_txn(
                    [cmp(a, C.VALUE, C.EQUAL, value=b"1")],
                    [op_put(b, b"then"), op_get(a)],
                    [op_put(b, b"else")],
                ),
                op_get(b),
            ],
            expect="OK",
        ),
        # three levels, the failure branch taken at the middle one
        txn(
            [cmp(a, C.VERSION, C.EQUAL, version=2)],
            [
                op_txn(
                    [cmp(b, C.VALUE, C.EQUAL, value=b"else")],
                    [op_put(d, b"wrong")],
                    [
                        op_put(d, b"right"),
                        op_txn(
                            [cmp(d, C.VERSION, C.EQUAL, version=0)],
                            [op_put(c.k("e"), b"deep"), op_get(d)],
                            [op_put(c.k("e"), b"nope")],
                        ),
                    ],
                ),
                op_txn(success=[op_get(c.k(), b"\x00", keys_only=True)]),
            ],
            [op_put(d, b"outer-else")],
        ),
        # a nested txn with nothing to run, and one in the branch not taken
        txn(
            [cmp(a, C.VERSION, C.EQUAL, version=99)],
            [op_txn(success=[op_put(d, b"x")])],
            [op_txn(), op_txn([cmp(a, C.VERSION, C.GREATER, version=0)], [op_get(a)])],
        ),
        # an error in a nested branch that is taken
        txn(
            success=[op_txn(success=[op_put(c.k("q"), ignore_value=True)])],
            expect="INVALID_ARGUMENT",
        ),
        # ...and in one that is not taken
        txn(
            success=[
                op_txn(
                    [cmp(a, C.VERSION, C.EQUAL, version=99)],
                    [op_put(c.k("q"), ignore_value=True)],
                    [op_put(c.k("q"), b"ok")],
                )
            ],
            expect="OK",
        ),
        get(c.k(), prefix_end(c.k())),
    ]


@case
def case_duplicate_keys(c: Ctx) -> list[Step]:
    a, b = c.k("a"), c.k("b")
    end = prefix_end(c.k())
    dup = "INVALID_ARGUMENT"
    return [
        put(a, b"0"),
        txn(success=[op_put(a, b"1"), op_put(a, b"2")], expect=dup),
        # the per-op checks come before the duplicate check
        txn([cmp(b"", C.VERSION, C.EQUAL)], [op_put(a, b"1"), op_put(a, b"2")]),
        txn(success=[op_put(a, b"1"), op_put(a, b"2"), rpc_pb2.RequestOp()]),
        txn(success=[op_put(a, b"1"), op_put(a, b"2"), op_put(b, b"x", ignore_value=True)]),
        txn(failure=[op_put(a, b"1"), op_put(a, b"2")], expect=dup),  # any branch
        txn(success=[op_put(a, b"1"), op_del(a)], expect=dup),
        txn(success=[op_del(a), op_put(a, b"1")], expect=dup),
        txn(success=[op_del(c.k(), end), op_put(b, b"1")], expect=dup),
        txn(success=[op_put(a, b"1")], failure=[op_put(a, b"2")], expect="OK"),  # other branch
        txn(success=[op_del(a), op_del(a)], expect="OK"),  # deletes may overlap
        put(a, b"0"),
        txn(success=[op_get(a), op_put(a, b"1"), op_get(a)], expect="OK"),  # reads do not count
        # nested: then/else of one txn may put the same key...
        txn(success=[op_txn(success=[op_put(a, b"t")], failure=[op_put(a, b"e")])], expect="OK"),
        # ...but not the same key as the level above, or two siblings
        txn(success=[op_put(a, b"1"), op_txn(success=[op_put(a, b"2")])], expect=dup),
        txn(
            success=[op_txn(success=[op_put(a, b"1")]), op_txn(failure=[op_put(a, b"2")])],
            expect=dup,
        ),
        txn(success=[op_del(a), op_txn(failure=[op_put(a, b"2")])], expect=dup),
        txn(success=[op_del(c.k(), end), op_txn(success=[op_put(b, b"2")])], expect=dup),
        # a nested delete over an outer put: the nested deletes join the outer
        # level's before its puts are checked
        txn(success=[op_put(a, b"1"), op_txn(success=[op_del(a)])], expect=dup),
        txn(success=[op_put(b, b"1"), op_txn(failure=[op_del(c.k(), end)])], expect=dup),
        # a nested put under an outer delete of another key is fine
        txn(success=[op_del(b), op_txn(success=[op_put(a, b"n")])], expect="OK"),
        get(c.k(), end),
        # a nested txn's then-put and a sibling's else-put of one key
        txn(
            success=[
                op_txn(success=[op_put(b, b"1")], failure=[op_put(a, b"1")]),
                op_txn(success=[op_put(a, b"2")]),
            ],
            expect=dup,
        ),
        # a delete with range_end "\0" overlaps nothing in etcd's interval check,
        # so a put of a key inside it is allowed; ops run in order
        txn(success=[op_del(c.k(), b"\x00", prev_kv=True), op_put(b, b"after")], expect="OK"),
        get(c.k(), end),
        txn(success=[op_put(a, b"before"), op_del(c.k(), b"\x00")], expect="OK"),
        get(c.k(), end),
        txn(success=[op_put(a, b"1"), op_put(b, b"2"), op_del(c.k("c"), end)], expect="OK"),
        get(c.k(), end),
    ]


@case
def case_too_many_ops(c: Ctx) -> list[Step]:
    many = "INVALID_ARGUMENT"
    reads = [op_get(c.k(f"r{i}")) for i in range(MAX_TXN_OPS + 1)]
    puts = [op_put(c.k(f"p{i:03d}"), b"v") for i in range(MAX_TXN_OPS + 1)]
    compares = [cmp(c.k(f"c{i}"), C.VERSION, C.EQUAL, version=0) for i in range(MAX_TXN_OPS + 1)]
    return [
        txn(success=reads, expect=many),
        txn(failure=reads, expect=many),
        txn(compare=compares, expect=many),
        txn(success=puts, expect=many),
        txn(success=reads[:MAX_TXN_OPS], expect="OK"),
        txn(compare=compares[:MAX_TXN_OPS], success=puts[:MAX_TXN_OPS], expect="OK"),
        # a nested txn may use only what its parent left: 128 - 101 = 27 ops
        txn(success=[*reads[:100], op_txn(success=reads[:28])], expect=many),
        txn(success=[*reads[:100], op_txn(success=reads[:27])], expect="OK"),
        # the limit counts the longest of compare/success/failure: here 100
        txn(success=reads[:100], failure=[op_txn(compare=compares[:29])], expect=many),
        txn(success=reads[:100], failure=[op_txn(compare=compares[:28])], expect="OK"),
        get(c.k(), prefix_end(c.k()), count_only=True),
    ]


@case
def case_empty_request_op(c: Ctx) -> list[Step]:
    empty = rpc_pb2.RequestOp()
    return [
        txn(success=[empty], expect="INVALID_ARGUMENT"),
        txn(failure=[empty], expect="INVALID_ARGUMENT"),  # checked though not taken
        txn(success=[op_put(c.k("a"), b"1"), empty], expect="INVALID_ARGUMENT"),
        txn(success=[op_txn(failure=[empty])], expect="INVALID_ARGUMENT"),
        # an empty RequestOp after an empty key: the first bad op decides
        txn(success=[op_get(b""), empty], expect="INVALID_ARGUMENT"),
        txn(success=[empty, op_get(b"")], expect="INVALID_ARGUMENT"),
        get(c.k("a")),
    ]


@case
def case_compaction(c: Ctx) -> list[Step]:
    a = c.k("a")
    return [
        put(a, b"1"),  # +1
        put(a, b"2"),  # +2
        put(a, b"3"),  # +3
        compact(c.rev(4), expect="OUT_OF_RANGE"),  # future
        compact(c.rev(1000), expect="OUT_OF_RANGE"),
        compact(c.rev(1), expect="OK"),
        compact(c.rev(1), expect="OUT_OF_RANGE"),  # already compacted
        compact(c.rev(0), expect="OUT_OF_RANGE"),
        compact(0, expect="OUT_OF_RANGE"),
        compact(-1, expect="OUT_OF_RANGE"),
        compact(c.rev(2), physical=True, expect="OK"),
        get(a, revision=c.rev(1), expect="OUT_OF_RANGE"),
        get(a, revision=c.rev(2)),
        compact(c.rev(3), expect="OK"),  # up to the current revision
        get(a, revision=c.rev(3)),
        get(a, revision=c.rev(2), expect="OUT_OF_RANGE"),
        put(a, b"4"),
        compact(c.rev(3), physical=True, expect="OUT_OF_RANGE"),
        compact(c.rev(4), physical=True, expect="OK"),
    ]


def _largest_value(key: bytes) -> int:
    """The longest value every etcd member accepts in a Put of `key`: its raft
    entry (up to 14 bytes of request header, then the PutRequest as field 4) is
    at most the limit."""
    for n in range(MAX_REQUEST_BYTES, 0, -1):
        put_req = rpc_pb2.PutRequest(key=key, value=b"x" * n).ByteSize()
        entry = 14 + 1 + len(_varint(put_req)) + put_req
        if entry <= MAX_REQUEST_BYTES:
            return n
    raise AssertionError("unreachable")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@case
def case_request_size(c: Ctx) -> list[Step]:
    big = b"x" * (MIB + MIB // 2 + 64 * 1024)  # 1.56 MiB: over --max-request-bytes
    huge = b"x" * (2 * MIB + 64 * 1024)  # over what gRPC accepts (1.5 MiB + 512 KiB)
    edge = _largest_value(c.k("edge"))
    return [
        put(c.k("big"), big, expect="INVALID_ARGUMENT"),  # request is too large
        txn(success=[op_put(c.k("big"), big)], expect="INVALID_ARGUMENT"),
        # a read-only Txn is not a log entry: its size is not limited but by gRPC
        txn(success=[op_get(c.k(big))], expect="OK"),
        Step("Put", rpc_pb2.PutRequest(key=c.k("huge"), value=huge), "RESOURCE_EXHAUSTED", True),
        put(c.k("small"), b"x" * (MIB + MIB // 4), expect="OK"),  # 1.25 MiB fits
        # at the limit: etcd measures its raft entry, which is the request plus a
        # request header of 13 or 14 bytes (the request id's varint length depends
        # on the member id, which depends on the random peer port): edge + 1 is
        # accepted by some etcd members and not others, edge + 2 by none
        put(c.k("edge"), b"x" * edge, expect="OK"),
        put(c.k("edge"), b"x" * (edge + 2), expect="INVALID_ARGUMENT"),
        get(c.k(), prefix_end(c.k()), keys_only=True),
    ]


# -- lease cases ----------------------------------------------------------------
#
# Leases are chosen by ID (`Ctx.lease`), so both servers hold the same ids. No
# case leaves a lease that has keys attached to expire by itself: that would be
# a write at a time neither server controls, in the middle of a later case.

MAX_LEASE_TTL = 9_000_000_000  # etcd's MaxLeaseTTL (seconds)


def grant(ttl: int, lease_id: int = 0, *, expect: str | None = None) -> Step:
    return Step("LeaseGrant", rpc_pb2.LeaseGrantRequest(TTL=ttl, ID=lease_id), expect)


def revoke(lease_id: int, *, expect: str | None = None) -> Step:
    return Step("LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease_id), expect)


def time_to_live(lease_id: int, keys: bool = False, *, expect: str | None = None) -> Step:
    return Step("LeaseTimeToLive", rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id, keys=keys), expect)


def keep_alive(lease_id: int, *, expect: str | None = None) -> Step:
    """One LeaseKeepAliveRequest on a fresh stream; its one response."""
    return Step("LeaseKeepAlive", rpc_pb2.LeaseKeepAliveRequest(ID=lease_id), expect)


def leases() -> Step:
    return Step("LeaseLeases", rpc_pb2.LeaseLeasesRequest(), "OK")


@case
def case_lease_grant(c: Ctx) -> list[Step]:
    one, two, big = c.lease(1), c.lease(2), c.lease(3)
    return [
        grant(60, one, expect="OK"),
        grant(60, one, expect="FAILED_PRECONDITION"),  # lease already exists
        grant(30, one, expect="FAILED_PRECONDITION"),
        # etcd's minimum TTL with its default timing (1.5 election timeouts): 2s
        grant(1, two, expect="OK"),
        time_to_live(two),
        revoke(two, expect="OK"),
        grant(0, two, expect="OK"),  # 0 and negative TTLs get the minimum too
        revoke(two, expect="OK"),
        grant(-5, two, expect="OK"),
        revoke(two, expect="OK"),
        grant(MAX_LEASE_TTL + 1, big, expect="OUT_OF_RANGE"),  # too large lease TTL
        time_to_live(big),  # ...and the failed grant left nothing behind
        grant(MAX_LEASE_TTL, big, expect="OK"),
        time_to_live(big),
        revoke(big, expect="OK"),
        time_to_live(one),
        keep_alive(one),
        leases(),
        revoke(one, expect="OK"),
        leases(),
    ]


@case
def case_lease_unknown(c: Ctx) -> list[Step]:
    gone = c.lease(1)
    return [
        time_to_live(c.lease(9)),  # TTL -1, not an error
        time_to_live(c.lease(9), keys=True),
        keep_alive(c.lease(9)),  # TTL 0, not an error
        revoke(c.lease(9), expect="NOT_FOUND"),
        put(c.k("a"), b"v", lease=c.lease(9), expect="NOT_FOUND"),
        grant(100, gone, expect="OK"),
        revoke(gone, expect="OK"),
        revoke(gone, expect="NOT_FOUND"),
        time_to_live(gone, keys=True),
        keep_alive(gone),
        put(c.k("a"), b"v", lease=gone, expect="NOT_FOUND"),
        txn(success=[op_put(c.k("a"), b"v", lease=gone)], expect="NOT_FOUND"),
        # the lease is checked in a branch not taken too
        txn(
            [cmp(c.k("a"), C.VERSION, C.EQUAL, version=5)],
            [op_get(c.k("a"))],
            [op_put(c.k("a"), b"v", lease=gone)],
            expect="NOT_FOUND",
        ),
        get(c.k("a")),
    ]


@case
def case_lease_keys(c: Ctx) -> list[Step]:
    l1, l2 = c.lease(1), c.lease(2)
    a, b, d = c.k("a"), c.k("b"), c.k("d")
    return [
        grant(100, l1, expect="OK"),
        grant(100, l2, expect="OK"),
        put(a, b"1", lease=l1),  # +1
        put(b, b"1", lease=l1),  # +2
        txn(success=[op_put(d, b"1", lease=l2)], expect="OK"),  # +3
        time_to_live(l1, keys=True),
        time_to_live(l1),  # keys only when asked
        get(c.k(), prefix_end(c.k())),
        put(a, b"2", ignore_lease=True, expect="OK"),  # keeps l1
        put(b, b"2"),  # detaches b from l1
        put(d, b"2", lease=l1),  # moves d from l2 to l1
        time_to_live(l1, keys=True),
        time_to_live(l2, keys=True),
        delete(a),  # a deleted: gone from l1
        time_to_live(l1, keys=True),
        put(a, b"3", ignore_lease=True, expect="INVALID_ARGUMENT"),  # key not found
        put(a, b"3", lease=l1),
        # revoking deletes the attached keys (a, d) in one revision
        revoke(l1, expect="OK"),
        get(c.k(), prefix_end(c.k())),
        time_to_live(l1, keys=True),
        put(a, b"4", ignore_lease=True, expect="INVALID_ARGUMENT"),  # deleted with the lease
        # a lease with no keys left: revoking it writes nothing
        revoke(l2, expect="OK"),
        put(b, b"3", ignore_lease=True, prev_kv=True, expect="OK"),
        get(c.k(), prefix_end(c.k())),
    ]


@case
def case_lease_negative_id(c: Ctx) -> list[Step]:
    # etcd takes any non-zero id, negative ones included
    lease = -c.lease(1)
    return [
        grant(60, lease, expect="OK"),
        put(c.k("a"), b"1", lease=lease, expect="OK"),
        time_to_live(lease, keys=True),
        get(c.k("a")),
        revoke(lease, expect="OK"),
        get(c.k("a")),
    ]


@case
def case_lease_revoke_txn_keys(c: Ctx) -> list[Step]:
    lease = c.lease(1)
    end = prefix_end(c.k())
    return [
        grant(100, lease, expect="OK"),
        txn(success=[op_put(c.k(f"k{i}"), b"v", lease=lease) for i in range(5)], expect="OK"),
        put(c.k("other"), b"v"),
        time_to_live(lease, keys=True),
        # a delete of a range detaches every key it deletes
        delete(c.k("k3"), end, prev_kv=True),
        time_to_live(lease, keys=True),
        revoke(lease, expect="OK"),
        get(c.k(), end),
    ]


# -- lock and election cases ----------------------------------------------------
#
# etcd serves v3lock and v3election with its client recipes inside the server, so
# their errors arrive as UNKNOWN with the underlying message. Calls that wait (a
# held lock, a campaign behind a leader) are not here: they need a second caller
# (tests/integration/test_lock_election.py); nor are calls without a lease (the
# server grants one with an id of its own: `test_lock_and_campaign_without_lease`).


def lock(name: bytes, lease: int, *, expect: str | None = None) -> Step:
    return Step("Lock", v3lock_pb2.LockRequest(name=name, lease=lease), expect)


def unlock(key: bytes, *, expect: str | None = None) -> Step:
    return Step("Unlock", v3lock_pb2.UnlockRequest(key=key), expect)


def campaign(name: bytes, lease: int, value: bytes, *, expect: str | None = None) -> Step:
    request = v3election_pb2.CampaignRequest(name=name, lease=lease, value=value)
    return Step("Campaign", request, expect)


def leader(name: bytes, *, expect: str | None = None) -> Step:
    return Step("Leader", v3election_pb2.LeaderRequest(name=name), expect)


def leader_key(name: bytes, lease: int, rev: int) -> v3election_pb2.LeaderKey:
    return v3election_pb2.LeaderKey(name=name, key=name + b"/%x" % lease, rev=rev, lease=lease)


def proclaim(
    who: v3election_pb2.LeaderKey | None, value: bytes, *, expect: str | None = None
) -> Step:
    return Step("Proclaim", v3election_pb2.ProclaimRequest(leader=who, value=value), expect)


def resign(who: v3election_pb2.LeaderKey | None, *, expect: str | None = None) -> Step:
    return Step("Resign", v3election_pb2.ResignRequest(leader=who), expect)


@case
def case_lock_service(c: Ctx) -> list[Step]:
    l1 = c.lease(1)
    name = c.k("mutex")
    mine = name + b"/%x" % l1
    held = get(name + b"/", prefix_end(name + b"/"))
    return [
        grant(60, l1, expect="OK"),
        lock(name, l1, expect="OK"),  # +1: name/<lease hex>, with the lease
        held,
        lock(name, l1, expect="OK"),  # the lease's key already: held, nothing written
        lock(c.k("other"), c.lease(9), expect="UNKNOWN"),  # requested lease not found
        unlock(mine, expect="OK"),  # +2
        unlock(mine, expect="OK"),  # nothing left to delete
        unlock(b"", expect="UNKNOWN"),  # key is not provided
        held,
        lock(name, l1, expect="OK"),  # +3
        revoke(l1, expect="OK"),  # +4: the lock goes with its lease
        held,
    ]


@case
def case_election_service(c: Ctx) -> list[Step]:
    l1 = c.lease(1)
    name = c.k("elect")
    won = leader_key(name, l1, c.rev(1))
    return [
        grant(60, l1, expect="OK"),
        leader(name, expect="UNKNOWN"),  # election: no leader
        campaign(name, l1, b"v1", expect="OK"),  # +1
        leader(name, expect="OK"),
        campaign(name, l1, b"v1", expect="OK"),  # again, same value: nothing written
        # again, another value: proclaimed (+2), but the header is the claim's
        campaign(name, l1, b"v2", expect="OK"),
        leader(name),
        proclaim(won, b"v3", expect="OK"),  # +3
        proclaim(leader_key(name, l1, c.rev(2)), b"v4", expect="UNKNOWN"),  # not leader
        proclaim(None, b"v4", expect="UNKNOWN"),  # "leader" field must be provided
        campaign(c.k("other"), c.lease(9), b"x", expect="UNKNOWN"),  # lease not found
        resign(leader_key(name, l1, c.rev(2)), expect="OK"),  # not the leader: no-op
        leader(name),
        resign(won, expect="OK"),  # +4
        resign(won, expect="OK"),  # nothing left
        resign(None, expect="UNKNOWN"),
        leader(name, expect="UNKNOWN"),
        revoke(l1, expect="OK"),
    ]


# -- watch cases ----------------------------------------------------------------
#
# A watch case is a sequence of steps on one Watch stream: requests sent on the
# stream, and KV calls (each step says how many watch responses it makes etcd
# send). The runner reads exactly that many responses after each step, then ends
# with a barrier (a watcher of its own and a put it must see), so a response
# that should not exist shows up either misaligned in a later step or before
# the barrier. Within one step, responses are ordered by watch_id: etcd fans one
# revision out to the watchers of a stream in map order.

WCR = rpc_pb2.WatchCreateRequest
NOPUT, NODELETE = WCR.NOPUT, WCR.NODELETE
BARRIER_WATCH_ID = 9_999


@dataclass(frozen=True)
class WStep:
    """`step` (a KV call, or method "Watch": a WatchRequest sent on the stream)
    and how many watch responses etcd sends because of it."""

    step: Step
    responses: int


def watch(responses: int = 1, **create: Any) -> WStep:
    request = rpc_pb2.WatchRequest(create_request=WCR(**create))
    return WStep(Step("Watch", request), responses)


def unwatch(watch_id: int, responses: int = 1) -> WStep:
    request = rpc_pb2.WatchRequest(cancel_request=rpc_pb2.WatchCancelRequest(watch_id=watch_id))
    return WStep(Step("Watch", request), responses)


def progress(responses: int = 1) -> WStep:
    request = rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest())
    return WStep(Step("Watch", request), responses)


def then(step: Step, responses: int = 1) -> WStep:
    return WStep(step, responses)


WatchBuilder = Callable[[Ctx], list[WStep]]
WATCH_CASES: list[tuple[str, WatchBuilder]] = []


def watch_case(fn: WatchBuilder) -> WatchBuilder:
    WATCH_CASES.append((fn.__name__.removeprefix("wcase_"), fn))
    return fn


@watch_case
def wcase_key_and_prefix(c: Ctx) -> list[WStep]:
    a, ab, b = c.k("a"), c.k("ab"), c.k("b")
    return [
        watch(key=a, watch_id=1),
        watch(key=a, range_end=prefix_end(a), watch_id=2),
        watch(key=c.k(), range_end=b"\x00", watch_id=3),  # from the prefix on
        then(put(a, b"1"), 3),
        then(put(ab, b"2"), 2),
        then(put(b, b"3"), 1),
        then(put(a, b"4"), 3),
        then(delete(a), 3),
        then(delete(a), 0),  # deletes nothing: no event
        then(delete(c.k(), prefix_end(c.k())), 2),  # ab and b, one response each
        then(get(a), 0),
        progress(),
    ]


@watch_case
def wcase_txn_events(c: Ctx) -> list[WStep]:
    a, b, d = c.k("a"), c.k("b"), c.k("d")
    return [
        watch(key=c.k(), range_end=prefix_end(c.k()), watch_id=1, prev_kv=True),
        watch(key=b, watch_id=2, prev_kv=True),
        then(put(a, b"1"), 1),
        then(put(b, b"1"), 2),
        # one txn, one response per watcher with all its events, in op order
        then(txn(success=[op_put(d, b"1"), op_del(a), op_put(b, b"2"), op_get(b)]), 2),
        then(txn([cmp(a, C.VERSION, C.EQUAL, version=0)], [op_get(a)], [op_put(a, b"x")]), 0),
        then(
            txn(success=[op_txn(success=[op_put(a, b"n"), op_del(b)]), op_put(d, b"2")]),
            2,
        ),
    ]


@watch_case
def wcase_prev_kv_and_filters(c: Ctx) -> list[WStep]:
    a = c.k("a")
    return [
        then(put(a, b"0"), 0),
        watch(key=a, watch_id=1, prev_kv=True),
        watch(key=a, watch_id=2, filters=[NOPUT]),
        watch(key=a, watch_id=3, filters=[NODELETE], prev_kv=True),
        watch(key=a, watch_id=4, filters=[NOPUT, NODELETE]),
        then(put(a, b"1"), 2),
        then(put(a, b"", prev_kv=True), 2),  # an empty value
        then(delete(a), 2),
        then(put(a, b"2"), 2),  # created again: no prev_kv
        then(delete(a, prev_kv=True), 2),
    ]


@watch_case
def wcase_start_revision(c: Ctx) -> list[WStep]:
    a, b = c.k("a"), c.k("b")
    end = prefix_end(c.k())
    return [
        then(put(a, b"1"), 0),  # +1
        then(put(b, b"1"), 0),  # +2
        then(put(a, b"2"), 0),  # +3
        then(delete(b), 0),  # +4
        then(txn(success=[op_put(a, b"3"), op_put(b, b"2")]), 0),  # +5
        # history from +2: one response with every event since
        watch(2, key=c.k(), range_end=end, start_revision=c.rev(2), watch_id=1, prev_kv=True),
        watch(2, key=a, start_revision=c.rev(1), watch_id=2),
        watch(2, key=b, start_revision=c.rev(3), watch_id=3, filters=[NOPUT]),
        watch(1, key=b, start_revision=c.rev(5), watch_id=4, filters=[NOPUT]),  # none left
        watch(1, key=a, start_revision=c.rev(6), watch_id=5),  # the next revision
        # a future start revision: nothing until the store gets there
        watch(1, key=a, start_revision=c.rev(8), watch_id=6),
        then(put(a, b"4"), 3),  # +6: watchers 1, 2, 5
        then(put(b, b"3"), 1),  # +7: watcher 1
        then(put(a, b"5"), 4),  # +8: watchers 1, 2, 5, 6
        progress(),
    ]


@watch_case
def wcase_ids_and_cancel(c: Ctx) -> list[WStep]:
    a = c.k("a")
    return [
        watch(key=a, watch_id=1),
        watch(key=a),  # auto ids start at 0...
        watch(key=a),  # ...and skip ids taken: 2
        watch(key=a, watch_id=1),  # duplicate: created and canceled, watch_id -1
        watch(key=a, watch_id=7),
        watch(key=a),  # 3
        then(put(a, b"1"), 5),
        unwatch(2),
        unwatch(2, 0),  # already canceled: etcd answers nothing
        unwatch(42, 0),  # unknown: nothing either
        then(put(a, b"2"), 4),
        unwatch(0),
        unwatch(7),
        watch(key=a),  # 4: an auto id is not reused
        watch(key=a, watch_id=7),  # an explicit one may be
        then(put(a, b"3"), 4),
    ]


@watch_case
def wcase_bad_ranges(c: Ctx) -> list[WStep]:
    a, b = c.k("a"), c.k("b")
    return [
        watch(key=b, range_end=a),  # end < key: canceled, "mvcc: watcher range is empty"
        watch(key=a, range_end=a, watch_id=5),  # end == key: the same
        watch(key=a, range_end=prefix_end(a), watch_id=5),  # id 5 was not taken
        watch(key=b""),  # an empty key is "\0": that one key alone
        watch(key=b"", range_end=b"\x00", watch_id=6, filters=[NODELETE]),  # every key
        then(put(a, b"1"), 2),
        then(delete(a), 1),
        unwatch(6),  # it would see the barrier too
    ]


@watch_case
def wcase_compacted(c: Ctx) -> list[WStep]:
    a = c.k("a")
    return [
        then(put(a, b"1"), 0),  # +1
        then(put(a, b"2"), 0),  # +2
        then(put(a, b"3"), 0),  # +3
        watch(key=a, watch_id=1),  # synced: compaction does not touch it
        then(compact(c.rev(2)), 0),
        # below the compaction: created, then canceled with compact_revision set
        watch(2, key=a, start_revision=c.rev(1), watch_id=2),
        # at the compaction revision: the history since
        watch(2, key=a, start_revision=c.rev(2), watch_id=3),
        then(put(a, b"4"), 2),
        # etcd 3.5 holds back a progress response while the compacted watcher
        # is on the stream (3.4 does not): cancelled first, as clientv3 does
        unwatch(2),
        progress(),
    ]


@watch_case
def wcase_compacted_until_canceled(c: Ctx) -> list[WStep]:
    a = c.k("a")
    return [
        then(put(a, b"1"), 0),  # +1
        then(put(a, b"2"), 0),  # +2
        then(compact(c.rev(2)), 0),
        watch(2, key=a, start_revision=c.rev(1), watch_id=5),  # created, compacted
        # the stream still holds the compacted watch: its id is taken...
        watch(key=a, watch_id=5),
        then(put(a, b"3"), 0),  # ...and it gets nothing more
        # ...until the client cancels it, which etcd answers (canceled, the
        # current revision, no compact_revision)
        unwatch(5),
        unwatch(5, 0),  # gone now: no answer
        watch(key=a, watch_id=5),  # the id is free again
        then(put(a, b"4"), 1),
        progress(),
    ]


# -- running and comparing ----------------------------------------------------

REVISION_FIELDS = {
    "ResponseHeader": {"revision"},
    "KeyValue": {"create_revision", "mod_revision"},
    "WatchResponse": {"compact_revision"},
    "LeaderKey": {"rev"},
}
DROPPED_HEADER_FIELDS = {"cluster_id", "member_id", "raft_term"}
TTL_SLACK = 2
"""Seconds a lease's remaining TTL may have run down while a case ran."""


def normalise(msg: Message, base: int) -> dict[str, Any]:
    """The message as nested dicts of its set fields, revisions relative to `base`
    (as "base+N" strings, so 0/unset stays distinguishable) and the member's
    identity dropped from headers. A lease's remaining TTL, which depends on
    when it is asked, becomes "granted" when it is within TTL_SLACK of it, and
    its keys are sorted."""
    name = msg.DESCRIPTOR.name
    rev_fields = REVISION_FIELDS.get(name, set())
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if name == "ResponseHeader" and fd.name in DROPPED_HEADER_FIELDS:
            continue
        if fd.message_type is not None:
            if fd.is_repeated:
                out[fd.name] = [normalise(v, base) for v in value]
            else:
                out[fd.name] = normalise(value, base)
        elif fd.name in rev_fields:
            out[fd.name] = f"base{value - base:+d}"
        elif fd.is_repeated:
            out[fd.name] = list(value)
        else:
            out[fd.name] = value
    if name == "LeaseTimeToLiveResponse":
        if "keys" in out:
            out["keys"].sort()  # etcd lists them in Go map order
        granted = out.get("grantedTTL", 0)
        if granted > 0 and granted - TTL_SLACK <= out.get("TTL", 0) <= granted:
            out["TTL"] = "granted"
    return out


@dataclass(frozen=True)
class Stubs:
    """The services of one server that cases call."""

    kv: rpc_pb2_grpc.KVStub
    lease: rpc_pb2_grpc.LeaseStub
    watch: rpc_pb2_grpc.WatchStub
    lock: v3lock_pb2_grpc.LockStub
    election: v3election_pb2_grpc.ElectionStub

    @staticmethod
    def of(channel: grpc.Channel) -> Stubs:
        return Stubs(
            rpc_pb2_grpc.KVStub(channel),
            rpc_pb2_grpc.LeaseStub(channel),
            rpc_pb2_grpc.WatchStub(channel),
            v3lock_pb2_grpc.LockStub(channel),
            v3election_pb2_grpc.ElectionStub(channel),
        )

    def call(self, method: str, request: Message) -> Message:
        if method == "LeaseKeepAlive":
            responses = self.lease.LeaseKeepAlive(iter([request]), timeout=RPC_TIMEOUT)
            first: Message = next(responses)
            responses.cancel()
            return first
        stub: Any = self.kv
        if method.startswith("Lease"):
            stub = self.lease
        elif method in ("Lock", "Unlock"):
            stub = self.lock
        elif method in ("Campaign", "Leader", "Proclaim", "Resign"):
            stub = self.election
        result: Message = getattr(stub, method)(request, timeout=RPC_TIMEOUT)
        return result


def current_revision(stub: rpc_pb2_grpc.KVStub) -> int:
    resp = stub.Range(rpc_pb2.RangeRequest(key=b"\x00probe"), timeout=RPC_TIMEOUT)
    return int(resp.header.revision)


def outcome_of(stubs: Stubs, step: Step, ctx: Ctx) -> tuple[str, dict[str, Any]]:
    """Call the step's method; its code and normalised response or error."""
    try:
        resp = stubs.call(step.method, step.request)
    except grpc.RpcError as e:
        code = e.code().name
        return code, {"code": code, "details": None if step.code_only else e.details()}
    out = normalise(resp, ctx.base)
    if step.method == "LeaseLeases":
        # every lease of the server, in no particular order: this case's, sorted
        mine = range(ctx.lease(0), ctx.lease(LEASES_PER_CASE))
        out["leases"] = sorted(
            (x for x in out.get("leases", []) if x["ID"] in mine), key=lambda x: x["ID"]
        )
    return "OK", {"ok": out}


def run_case(stubs: Stubs, name: str, build: Builder) -> list[dict[str, Any]]:
    """Run the case on one server; one record per step."""
    index = next(i for i, (n, _) in enumerate(CASES) if n == name)
    base = current_revision(stubs.kv)
    ctx = Ctx(f"/diff/{index:03d}-{name}/".encode(), base, (index + 1) * LEASES_PER_CASE)
    records: list[dict[str, Any]] = []
    before = base
    for i, step in enumerate(build(ctx)):
        code, outcome = outcome_of(stubs, step, ctx)
        after = current_revision(stubs.kv)
        if code != "OK":
            assert after == before, (
                f"step {i} ({step.method}) failed with {outcome} but moved the "
                f"revision from {before} to {after}"
            )
        records.append(
            {"step": i, "method": step.method, "expect": step.expect, "code": code, **outcome}
        )
        records[-1]["revision_after"] = f"base{after - base:+d}"
        before = after
    return records


class WatchStreamClient:
    """One Watch stream: requests go through a queue, a thread reads responses."""

    def __init__(self, stub: rpc_pb2_grpc.WatchStub) -> None:
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        self._responses: queue.Queue[rpc_pb2.WatchResponse | Exception] = queue.Queue()
        self._call = stub.Watch(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put(response)
        except grpc.RpcError as e:
            self._responses.put(e)

    def send(self, request: rpc_pb2.WatchRequest) -> None:
        self._requests.put(request)

    def next(self, deadline: float) -> rpc_pb2.WatchResponse | None:
        """The next response, or None if none came by `deadline` (monotonic)."""
        try:
            item = self._responses.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
        self._reader.join(timeout=RPC_TIMEOUT)


WATCH_STEP_TIMEOUT = 5.0
BARRIER_KEY = b"/diffw/!barrier"  # below every case's prefix


def run_watch_case(stubs: Stubs, name: str, build: WatchBuilder) -> list[dict[str, Any]]:
    """Run the watch case on one server; one record per step, and one for what
    arrived up to the barrier."""
    index = next(i for i, (n, _) in enumerate(WATCH_CASES) if n == name)
    base = current_revision(stubs.kv)
    ctx = Ctx(f"/diffw/{index:03d}-{name}/".encode(), base)
    stream = WatchStreamClient(stubs.watch)

    def read(
        count: int | None, until: Callable[[rpc_pb2.WatchResponse], bool] = lambda _: False
    ) -> list[rpc_pb2.WatchResponse]:
        """`count` responses, or (count None) up to the first for which `until`
        is true; a timeout is recorded as a made-up response."""
        deadline = time.monotonic() + WATCH_STEP_TIMEOUT
        got: list[rpc_pb2.WatchResponse] = []
        while count is None or len(got) < count:
            response = stream.next(deadline)
            if response is None:
                got.append(rpc_pb2.WatchResponse(cancel_reason="<test: timed out>"))
                break
            got.append(response)
            if count is None and until(response):
                break
        return got

    def normalised(got: list[rpc_pb2.WatchResponse]) -> list[dict[str, Any]]:
        """Sorted by watch id (stable: one watcher's responses keep their order)."""
        return [normalise(r, base) for r in sorted(got, key=lambda r: r.watch_id)]

    def barrier(r: rpc_pb2.WatchResponse) -> bool:
        return r.watch_id == BARRIER_WATCH_ID

    records: list[dict[str, Any]] = []
    try:
        for i, wstep in enumerate(build(ctx)):
            step = wstep.step
            if step.method == "Watch":
                stream.send(step.request)  # type: ignore[arg-type]
                record: dict[str, Any] = {"step": i, "method": "Watch"}
            else:
                code, outcome = outcome_of(stubs, step, ctx)
                record = {"step": i, "method": step.method, "code": code, **outcome}
            record["expect_responses"] = wstep.responses
            record["responses"] = normalised(read(wstep.responses))
            record["revision_after"] = f"base{current_revision(stubs.kv) - base:+d}"
            records.append(record)
        # the barrier: its watcher (created before the put: etcd registers a
        # watcher before it answers `created`), then a put it must see
        stream.send(
            rpc_pb2.WatchRequest(create_request=WCR(key=BARRIER_KEY, watch_id=BARRIER_WATCH_ID))
        )
        got = read(None, barrier)
        stubs.kv.Put(rpc_pb2.PutRequest(key=BARRIER_KEY), timeout=RPC_TIMEOUT)
        got += read(None, lambda r: barrier(r) and bool(r.events))
        records.append({"step": "barrier", "responses": normalised(got)})
    finally:
        stream.close()
    return records


@pytest.fixture(scope="module")
def etcd_stubs(etcd: EtcdProcess) -> Iterator[Stubs]:
    with grpc.insecure_channel(etcd.endpoint) as ch:
        yield Stubs.of(ch)


@pytest.fixture(scope="module")
def our_stubs(server: ServerProcess, channel: grpc.Channel) -> Stubs:
    return Stubs.of(channel)


def compare(reference: list[dict[str, Any]], ours: list[dict[str, Any]]) -> None:
    assert len(ours) == len(reference)
    for ref, mine in zip(reference, ours, strict=True):
        assert mine == ref, (
            f"step {ref['step']} ({ref.get('method')}) differs from etcd\n"
            f"etcd: {pformat(ref, width=100)}\nours: {pformat(mine, width=100)}"
        )


@pytest.mark.parametrize(("name", "build"), CASES, ids=[n for n, _ in CASES])
def test_same_as_etcd(name: str, build: Builder, etcd_stubs: Stubs, our_stubs: Stubs) -> None:
    reference = run_case(etcd_stubs, name, build)
    ours = run_case(our_stubs, name, build)
    for ref in reference:
        if ref["expect"] is not None:
            assert ref["code"] == ref["expect"], (
                f"the case is stale: etcd answered step {ref['step']} ({ref['method']}) "
                f"with {ref['code']}, the case expects {ref['expect']}"
            )
    compare(reference, ours)


@pytest.mark.parametrize(("name", "build"), WATCH_CASES, ids=[n for n, _ in WATCH_CASES])
def test_watch_same_as_etcd(
    name: str, build: WatchBuilder, etcd_stubs: Stubs, our_stubs: Stubs
) -> None:
    reference = run_watch_case(etcd_stubs, name, build)
    ours = run_watch_case(our_stubs, name, build)
    for ref in reference:
        timed_out = [r for r in ref["responses"] if r.get("cancel_reason") == "<test: timed out>"]
        assert not timed_out, (
            f"the case is stale: etcd sent fewer watch responses than step {ref['step']} "
            f"expects: {pformat(ref, width=100)}"
        )
    barrier = reference[-1]["responses"]
    assert [r.get("watch_id") for r in barrier] == [BARRIER_WATCH_ID] * 2, (
        f"the case is stale: etcd sent more than the barrier's responses: {pformat(barrier)}"
    )
    compare(reference, ours)


def sessions_without_lease(stubs: Stubs, prefix: bytes) -> dict[str, Any]:
    """Lock and Campaign with no lease, on one server: what they hold, and that
    two such callers are two sessions (the second Lock waits for the first)."""
    base = current_revision(stubs.kv)
    leases: list[int] = []

    def session(key: bytes, name: bytes, revision: int) -> dict[str, Any]:
        lease = int(key.removeprefix(name + b"/"), 16)
        leases.append(lease)
        ttl = stubs.lease.LeaseTimeToLive(
            rpc_pb2.LeaseTimeToLiveRequest(ID=lease, keys=True), timeout=RPC_TIMEOUT
        )
        [kv] = stubs.kv.Range(rpc_pb2.RangeRequest(key=key), timeout=RPC_TIMEOUT).kvs
        return {
            "revision": revision - base,
            "granted_ttl": ttl.grantedTTL,
            "ttl_ok": ttl.grantedTTL - TTL_SLACK <= ttl.TTL <= ttl.grantedTTL,
            "lease_holds_just_the_key": list(ttl.keys) == [key],
            "key_has_the_lease": kv.lease == lease,
        }

    out: dict[str, Any] = {}
    name = prefix + b"mutex"
    first = stubs.lock.Lock(v3lock_pb2.LockRequest(name=name), timeout=RPC_TIMEOUT)
    out["first"] = session(first.key, name, first.header.revision)
    second = stubs.lock.Lock.future(v3lock_pb2.LockRequest(name=name), timeout=RPC_TIMEOUT)
    try:
        held = rpc_pb2.RangeRequest(key=name + b"/", range_end=prefix_end(name + b"/"))
        deadline = time.monotonic() + WATCH_STEP_TIMEOUT
        while stubs.kv.Range(held, timeout=RPC_TIMEOUT).count < 2 and not second.done():
            assert time.monotonic() < deadline, "the second Lock wrote no key"
        out["second_waits"] = not second.done()
        stubs.lock.Unlock(v3lock_pb2.UnlockRequest(key=first.key), timeout=RPC_TIMEOUT)
        got = second.result(timeout=RPC_TIMEOUT)
    finally:
        second.cancel()
    out["second"] = session(got.key, name, got.header.revision)
    stubs.lock.Unlock(v3lock_pb2.UnlockRequest(key=got.key), timeout=RPC_TIMEOUT)

    elect = prefix + b"elect"
    won = stubs.election.Campaign(
        v3election_pb2.CampaignRequest(name=elect, value=b"v"), timeout=RPC_TIMEOUT
    )
    out["campaign"] = session(won.leader.key, elect, won.header.revision)
    out["campaign"]["leader_lease"] = won.leader.lease == leases[-1]
    stubs.election.Resign(v3election_pb2.ResignRequest(leader=won.leader), timeout=RPC_TIMEOUT)
    out["three_sessions"] = len(set(leases)) == 3
    for lease in leases:
        stubs.lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=RPC_TIMEOUT)
    return out


def test_lock_and_campaign_without_lease(etcd_stubs: Stubs, our_stubs: Stubs) -> None:
    """etcd's Lock and Campaign take a request without a lease as a session of
    their own: they grant a lease (60s, never kept alive) and hold the key with
    it, so two such callers do not share a key, and such a lock expires."""
    session = {
        "granted_ttl": 60,
        "ttl_ok": True,
        "lease_holds_just_the_key": True,
        "key_has_the_lease": True,
    }
    expected = {
        "first": {"revision": 1, **session},  # the lock's put
        "second_waits": True,
        # its put (+2), the first's unlock (+3): then the read of its key
        "second": {"revision": 3, **session},
        # the second's unlock (+4), the claim (+5)
        "campaign": {"revision": 5, "leader_lease": True, **session},
        "three_sessions": True,
    }
    prefix = b"/diffs/no-lease/"
    assert sessions_without_lease(etcd_stubs, prefix) == expected, "etcd disagrees"
    assert sessions_without_lease(our_stubs, prefix) == expected
