"""Client scenarios run with the PyPI `etcd3` package (python-etcd3 0.12.0).

    PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python \\
        python tests/compat/etcd3_scenarios.py HOST:PORT SCENARIO [SCENARIO ...]

Runs each named scenario (or `all`) against the server at HOST:PORT with
`etcd3.client(host, port)` and prints one JSON object to stdout: scenario name ->
{"result": ...} or {"error": traceback}. A scenario that fails does not stop the
others.

This runs in its own process because etcd3's generated protobuf modules cannot
share a process with ours (both define etcdserverpb.* in the default descriptor
pool) and need the pure-Python protobuf runtime. It imports nothing from this
repository.

Every scenario writes under its own key prefix, and reports revisions relative to
the revision the server was at when the scenario began ("base"), so the output of
a run against our server and one against etcd can be compared as they are.

etcd3 0.12.0 accepts `limit`, `revision`, `count_only` and the min/max revision
filters as keyword arguments of its range calls but never copies them into the
RangeRequest (`Etcd3Client._build_get_range_request`), so they are silently
ignored whatever the server; the scenarios do not use them. Likewise its watch
`filters` argument cannot work (it assigns a list to the repeated field, which
protobuf refuses), and its Lock cannot wait for a held lock with the tenacity
installed here (see `attempt`).

Calls that block (watch iterators) are read with a deadline (`take`), and every
wait is bounded: nothing here sleeps to let something happen.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import etcd3  # type: ignore[import-untyped]
import grpc

RPC_TIMEOUT = 10


class Run:
    """One scenario's client, key prefix and starting revision."""

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.prefix = f"/etcd3/{name}/"
        self.base = self.revision()

    def k(self, name: str) -> str:
        return self.prefix + name

    def revision(self) -> int:
        return int(self.client.get_response("/etcd3-probe").header.revision)

    def rel(self, revision: int) -> int:
        """A revision as an offset from the scenario's start (0 stays 0: unset)."""
        return revision - self.base if revision else 0

    def meta(self, meta: Any) -> dict[str, Any] | None:
        """etcd3's KVMetadata as plain data."""
        if meta is None:
            return None
        return {
            "key": meta.key.decode(),
            "create_revision": self.rel(meta.create_revision),
            "mod_revision": self.rel(meta.mod_revision),
            "version": meta.version,
            "lease_id": meta.lease_id,
            "header_revision": self.rel(meta.response_header.revision),
        }

    def kv(self, kv: Any) -> dict[str, Any]:
        """An mvccpb.KeyValue message as plain data."""
        return {
            "key": kv.key.decode(),
            "value": kv.value.decode(),
            "create_revision": self.rel(kv.create_revision),
            "mod_revision": self.rel(kv.mod_revision),
            "version": kv.version,
        }

    def pairs(self, items: Any) -> list[list[Any]]:
        """etcd3's (value, KVMetadata) sequences as [value, key, version, mod_revision]."""
        return [
            [value.decode(), meta.key.decode(), meta.version, self.rel(meta.mod_revision)]
            for value, meta in items
        ]

    def error(self, call: Callable[[], Any]) -> dict[str, Any]:
        """Run `call`, which must fail; describe the exception."""
        try:
            call()
        except grpc.RpcError as e:
            return {"type": "RpcError", "code": e.code().name, "details": e.details()}
        except etcd3.exceptions.Etcd3Exception as e:
            return {"type": type(e).__name__, "message": str(e)}
        raise AssertionError("the call succeeded")


# -- scenarios ------------------------------------------------------------------


def scenario_get(r: Run) -> dict[str, Any]:
    c = r.client
    c.put(r.k("a"), "hello")
    c.put(r.k("a"), "hello again")
    value, meta = c.get(r.k("a"))
    missing = c.get(r.k("missing"))
    s_value, _ = c.get(r.k("a"), serializable=True)
    return {
        "value": value.decode(),
        "meta": r.meta(meta),
        "missing": [missing[0], missing[1]],
        "serializable": s_value.decode(),
        "bytes_key": c.get(r.k("a").encode())[0].decode(),
    }


def scenario_get_prefix(r: Run) -> dict[str, Any]:
    c = r.client
    for key, value in [("a", "1"), ("ab", "2"), ("abc", "3"), ("b", "4")]:
        c.put(r.k(key), value)
    return {
        "a": r.pairs(c.get_prefix(r.k("a"))),
        "all": r.pairs(c.get_prefix(r.prefix)),
        "keys_only": r.pairs(c.get_prefix(r.k("a"), keys_only=True)),
        "descend": r.pairs(c.get_prefix(r.prefix, sort_order="descend")),
        "by_value": r.pairs(c.get_prefix(r.prefix, sort_order="descend", sort_target="value")),
        "none": r.pairs(c.get_prefix(r.k("z"))),
    }


def scenario_put(r: Run) -> dict[str, Any]:
    c = r.client
    first = c.put(r.k("a"), "1", prev_kv=True)
    second = c.put(r.k("a"), "2", prev_kv=True)
    third = c.put(r.k("a"), b"\x00binary\xff")
    plain = c.put(r.k("b"), "x")
    value, meta = c.get(r.k("a"))
    return {
        "first": {
            "revision": r.rel(first.header.revision),
            "has_prev_kv": first.HasField("prev_kv"),
        },
        "second": {"revision": r.rel(second.header.revision), "prev_kv": r.kv(second.prev_kv)},
        "third_revision": r.rel(third.header.revision),
        "plain": {
            "revision": r.rel(plain.header.revision),
            "has_prev_kv": plain.HasField("prev_kv"),
        },
        "value": list(value),
        "version": meta.version,
        "lease_not_found": r.error(lambda: c.put(r.k("c"), "v", lease=1234)),
    }


def scenario_delete(r: Run) -> dict[str, Any]:
    c = r.client
    c.put(r.k("a"), "1")
    c.put(r.k("b"), "2")
    c.put(r.k("b"), "22")
    deleted = c.delete(r.k("a"))
    again = c.delete(r.k("a"))
    resp = c.delete(r.k("b"), prev_kv=True, return_response=True)
    missing = c.delete(r.k("missing"), prev_kv=True, return_response=True)
    return {
        "deleted": deleted,
        "again": again,
        "response": {
            "deleted": resp.deleted,
            "revision": r.rel(resp.header.revision),
            "prev_kvs": [r.kv(kv) for kv in resp.prev_kvs],
        },
        "missing": {
            "deleted": missing.deleted,
            "revision": r.rel(missing.header.revision),
            "prev_kvs": len(missing.prev_kvs),
        },
        "left": [c.get(r.k("a"))[0], c.get(r.k("b"))[0]],
    }


def scenario_delete_prefix(r: Run) -> dict[str, Any]:
    c = r.client
    for key in ("a", "ab", "b"):
        c.put(r.k(key), key)
    c.put(r.prefix[:-1] + "-sibling", "stays")  # shares the prefix but for the "/"
    resp = c.delete_prefix(r.k("a"))
    none = c.delete_prefix(r.k("zz"))
    all_resp = c.delete_prefix(r.prefix)
    sibling = c.get(r.prefix[:-1] + "-sibling")[0]
    c.delete(r.prefix[:-1] + "-sibling")
    return {
        "a": {"deleted": resp.deleted, "revision": r.rel(resp.header.revision)},
        "none": {"deleted": none.deleted, "revision": r.rel(none.header.revision)},
        "rest": {"deleted": all_resp.deleted, "revision": r.rel(all_resp.header.revision)},
        "sibling": sibling.decode(),
        "left": r.pairs(c.get_prefix(r.prefix)),
    }


def scenario_transactions(r: Run) -> dict[str, Any]:
    c = r.client
    t = c.transactions
    a, b = r.k("a"), r.k("b")
    c.put(a, "1")
    c.put(b, "x")
    c.put(b, "y")
    _, meta_a = c.get(a)
    _, meta_b = c.get(b)

    def outcome(result: tuple[bool, list[Any]]) -> dict[str, Any]:
        succeeded, responses = result
        out: list[Any] = []
        for resp in responses:
            if isinstance(resp, list):  # a range: (value, KVMetadata) pairs
                out.append({"range": r.pairs(resp)})
            else:
                kind = resp.WhichOneof("response")
                inner = getattr(resp, kind)
                item: dict[str, Any] = {kind: r.rel(inner.header.revision)}
                if kind == "response_delete_range":
                    item["deleted"] = inner.deleted
                if kind == "response_txn":
                    item["succeeded"] = inner.succeeded
                    item["responses"] = len(inner.responses)
                out.append(item)
        return {"succeeded": succeeded, "responses": out}

    results: dict[str, Any] = {}
    results["all_true"] = outcome(
        c.transaction(
            compare=[
                t.value(a) == "1",
                t.version(b) == 2,
                t.create(a) == meta_a.create_revision,
                t.mod(b) == meta_b.mod_revision,
            ],
            success=[t.put(a, "2"), t.get(a), t.delete(b), t.get(b)],
            failure=[t.put(a, "never")],
        )
    )
    results["value_false"] = outcome(
        c.transaction(
            compare=[t.value(a) == "1"],
            success=[t.put(a, "never")],
            failure=[t.put(b, "restored"), t.get(a), t.get(r.prefix, r.k("z"))],
        )
    )
    results["version_greater"] = outcome(
        c.transaction(compare=[t.version(a) > 1], success=[t.get(a)], failure=[])
    )
    results["version_less_false"] = outcome(
        c.transaction(compare=[t.version(a) < 2], success=[t.get(a)], failure=[])
    )
    results["create_not_equal"] = outcome(
        c.transaction(compare=[t.create(b) != 0], success=[t.get(b)], failure=[t.get(a)])
    )
    results["mod_less"] = outcome(
        c.transaction(compare=[t.mod(a) < meta_a.mod_revision], success=[], failure=[t.get(a)])
    )
    results["missing_key"] = outcome(
        c.transaction(
            compare=[t.version(r.k("nope")) == 0, t.create(r.k("nope")) == 0],
            success=[t.put(r.k("nope"), "created")],
            failure=[],
        )
    )
    results["missing_value"] = outcome(
        c.transaction(compare=[t.value(r.k("nope2")) == ""], success=[], failure=[t.get(a)])
    )
    results["nested"] = outcome(
        c.transaction(
            compare=[],
            success=[
                t.txn(
                    compare=[t.value(a) == "2"],
                    success=[t.put(r.k("n"), "then")],
                    failure=[t.put(r.k("n"), "else")],
                )
            ],
            failure=[],
        )
    )
    results["delete_prev_kv"] = outcome(
        c.transaction(compare=[], success=[t.delete(r.k("n"), prev_kv=True)], failure=[])
    )
    results["duplicate_key"] = r.error(
        lambda: c.transaction(compare=[], success=[t.put(a, "1"), t.put(a, "2")], failure=[])
    )
    results["put_if_not_exists"] = [
        c.put_if_not_exists(r.k("pine"), "1"),
        c.put_if_not_exists(r.k("pine"), "2"),
    ]
    results["final"] = r.pairs(c.get_prefix(r.prefix))
    return results


def scenario_replace(r: Run) -> dict[str, Any]:
    c = r.client
    k = r.k("a")
    c.put(k, "initial")
    return {
        "replaced": c.replace(k, "initial", "new"),
        "after": c.get(k)[0].decode(),
        "stale": c.replace(k, "initial", "newer"),
        "after_stale": c.get(k)[0].decode(),
        "again": c.replace(k, "new", "newest"),
        "missing": c.replace(r.k("missing"), "", "x"),
        "missing_after": c.get(r.k("missing"))[0],
        "final": r.pairs(c.get_prefix(r.prefix)),
    }


def scenario_get_all(r: Run) -> dict[str, Any]:
    c = r.client
    t = c.transactions
    # get_all reads the whole key space: empty it first (a Delete of ["\0", "\0")
    # through a txn, since etcd3 has no call for it)
    wiped, _ = c.transaction(compare=[], success=[t.delete(b"\x00", b"\x00")], failure=[])
    for key, value in [("b", "3"), ("a", "2"), ("c", "1")]:
        c.put(r.k(key), value)
    return {
        "wiped": wiped,
        "all": r.pairs(c.get_all()),
        "keys_only": r.pairs(c.get_all(keys_only=True)),
        "by_value": r.pairs(c.get_all(sort_order="ascend", sort_target="value")),
        "by_create_desc": r.pairs(c.get_all(sort_order="descend", sort_target="create")),
    }


def scenario_get_range(r: Run) -> dict[str, Any]:
    c = r.client
    # created in the order e, c, a, d, b; values reverse the key order
    for key, value in [("e", "1"), ("c", "3"), ("a", "5"), ("d", "2"), ("b", "4")]:
        c.put(r.k(key), value)
    c.put(r.k("c"), "3")  # c: version 2, modified last
    lo, hi = r.k("a"), r.k("e")
    out: dict[str, Any] = {"plain": r.pairs(c.get_range(lo, hi))}
    for target in ("key", "version", "create", "mod", "value"):
        for order in (None, "ascend", "descend"):
            items = c.get_range(lo, hi, sort_order=order, sort_target=target)
            out[f"{target}/{order}"] = [meta.key.decode()[-1] for _, meta in items]
    out["empty"] = r.pairs(c.get_range(hi, lo))  # range_end before the key
    out["keys_only"] = r.pairs(c.get_range(lo, hi, keys_only=True))
    return out


def scenario_status(r: Run) -> dict[str, Any]:
    st = r.client.status()
    return {
        "version": st.version,
        "db_size": st.db_size,
        "leader": None
        if st.leader is None
        else {
            "id": st.leader.id,
            "name": st.leader.name,
            "client_urls": list(st.leader.client_urls),
        },
        "raft_index": st.raft_index,
        "raft_term": st.raft_term,
        "member_id": r.client.get_response("/etcd3-probe").header.member_id,
    }


def scenario_members(r: Run) -> dict[str, Any]:
    return {
        "members": [
            {
                "id": m.id,
                "name": m.name,
                "peer_urls": list(m.peer_urls),
                "client_urls": list(m.client_urls),
            }
            for m in r.client.members
        ],
        "member_id": r.client.get_response("/etcd3-probe").header.member_id,
    }


def scenario_compact(r: Run) -> dict[str, Any]:
    c = r.client
    k = r.k("a")
    c.put(k, "1")
    c.put(k, "2")
    c.put(k, "3")
    # etcd3 cannot read at a revision (see the module doc), so the compaction
    # shows in Compact's own answers only
    return {
        "compact": c.compact(r.base + 2),
        "future": r.error(lambda: c.compact(r.base + 100)),
        "again": r.error(lambda: c.compact(r.base + 1)),
        "same": r.error(lambda: c.compact(r.base + 2)),
        "physical": c.compact(r.base + 3, physical=True),
        "read": r.pairs(c.get_prefix(r.prefix)),
    }


# -- watch ----------------------------------------------------------------------

WATCH_TIMEOUT = 10.0
"""How long a watch may take to deliver an event it owes."""
POLL_TIMEOUT = 15.0
"""How long a lease may take to expire (etcd checks expiry every 500ms)."""


def take(iterator: Any, count: int, timeout: float = WATCH_TIMEOUT) -> dict[str, Any]:
    """The next `count` items of a blocking iterator (etcd3's watch iterators
    block forever), read in a thread and awaited at most `timeout` seconds; and
    what the iteration raised, if it did."""
    got: list[Any] = []
    raised: list[BaseException] = []

    def run() -> None:
        try:
            for item in iterator:
                got.append(item)
                if len(got) == count:
                    return
        except Exception as e:
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return {"items": list(got), "error": raised[0] if raised else None}


def event(r: Run, ev: Any, prev: bool = False) -> dict[str, Any]:
    """etcd3's PutEvent / DeleteEvent as plain data."""
    out = {
        "type": type(ev).__name__,
        "key": ev.key.decode(),
        "value": ev.value.decode(),
        "version": ev.version,
        "create_revision": r.rel(ev.create_revision),
        "mod_revision": r.rel(ev.mod_revision),
    }
    if prev:
        out["prev_value"] = ev.prev_value.decode()
        out["prev_mod_revision"] = r.rel(ev.prev_mod_revision)
    return out


def scenario_watch(r: Run) -> dict[str, Any]:
    c = r.client
    a = r.k("a")
    # etcd3 returns once the server has created the watch: no sync point needed
    events, cancel = c.watch(a)
    try:
        c.put(a, "1")
        c.put(r.k("b"), "not watched")
        c.put(a, "2")
        c.delete(a)
        c.put(a, "3")
        got = take(events, 4)
    finally:
        cancel()
    return {
        "events": [event(r, e) for e in got["items"]],
        "error": repr(got["error"]),
        "after_cancel": [event(r, e) for e in events],  # cancel ends the iterator
    }


def scenario_watch_prefix(r: Run) -> dict[str, Any]:
    c = r.client
    p = r.k("p/")
    events, cancel = c.watch_prefix(p, prev_kv=True)
    try:
        c.put(p + "a", "1")
        c.put(r.k("p"), "outside the prefix")
        c.put(p + "b", "2")
        c.put(p + "a", "3")
        c.delete_prefix(p)  # one revision, two events
        got = take(events, 5)
    finally:
        cancel()
    return {"events": [event(r, e, prev=True) for e in got["items"]], "error": repr(got["error"])}


def scenario_watch_start_revision(r: Run) -> dict[str, Any]:
    c = r.client
    a = r.k("a")
    c.put(a, "1")  # +1
    c.put(a, "2")  # +2
    c.delete(a)  # +3
    c.put(a, "3")  # +4
    events, cancel = c.watch(a, start_revision=r.base + 2)
    try:
        history = take(events, 3)
        c.put(a, "4")  # +5
        live = take(events, 1)
    finally:
        cancel()
    # a start revision ahead of the store: nothing until it gets there
    ahead, cancel_ahead = c.watch(a, start_revision=r.base + 7)
    try:
        c.put(a, "5")  # +6
        c.put(a, "6")  # +7
        later = take(ahead, 1)
    finally:
        cancel_ahead()
    # watch_once with a start revision in the past returns at once
    once = c.watch_once(a, timeout=WATCH_TIMEOUT, start_revision=r.base + 1)
    return {
        "history": [event(r, e) for e in history["items"]],
        "live": [event(r, e) for e in live["items"]],
        "ahead": [event(r, e) for e in later["items"]],
        "once": event(r, once),
        "once_times_out": r.error(lambda: c.watch_once(r.k("never"), timeout=0.3)),
    }


def scenario_watch_callback(r: Run) -> dict[str, Any]:
    c = r.client
    a = r.k("a")
    first: list[Any] = []
    second: list[Any] = []
    got_two = threading.Event()
    got_one = threading.Event()

    def on_first(response: Any) -> None:
        first.append(response)
        if sum(len(x.events) for x in first if hasattr(x, "events")) >= 2:
            got_two.set()

    def on_second(response: Any) -> None:
        second.append(response)
        got_one.set()

    watch_id = c.add_watch_callback(a, on_first)
    c.put(a, "1")
    c.put(a, "2")
    first_done = got_two.wait(WATCH_TIMEOUT)
    c.cancel_watch(watch_id)
    # a second watch of the key, on the same stream: once it has seen the next
    # put, the canceled one would have too
    prefix_id = c.add_watch_prefix_callback(r.prefix, on_second)
    c.put(a, "3")
    second_done = got_one.wait(WATCH_TIMEOUT)
    c.cancel_watch(prefix_id)

    def responses(items: list[Any]) -> list[Any]:
        return [
            {
                "revision": r.rel(x.header.revision),
                "events": [event(r, e) for e in x.events],
            }
            if hasattr(x, "events")
            else repr(x)
            for x in items
        ]

    return {
        "first_done": first_done,
        "first": responses(first),
        "second_done": second_done,
        "second": responses(second),
    }


def scenario_watch_compacted(r: Run) -> dict[str, Any]:
    c = r.client
    a = r.k("a")
    c.put(a, "1")  # +1
    c.put(a, "2")  # +2
    c.put(a, "3")  # +3
    c.compact(r.base + 2)
    events, cancel = c.watch(a, start_revision=r.base + 1)
    try:
        got = take(events, 1)
    finally:
        cancel()
    error = got["error"]
    kept, cancel_kept = c.watch(a, start_revision=r.base + 2)  # the compacted one is kept
    try:
        history = take(kept, 2)
    finally:
        cancel_kept()
    return {
        "events": [event(r, e) for e in got["items"]],
        "error": type(error).__name__,
        "compacted_revision": r.rel(getattr(error, "compacted_revision", 0)),
        "from_compacted": [event(r, e) for e in history["items"]],
    }


# -- leases ---------------------------------------------------------------------

LEASE_ID = 0x7E57_0E7C_D300_0001
"""An id for a lease granted with an explicit ID (each server runs this once)."""


def scenario_lease(r: Run) -> dict[str, Any]:
    c = r.client
    lease = c.lease(60)
    c.put(r.k("a"), "1", lease=lease)
    c.put(r.k("b"), "2", lease=lease.id)
    c.put(r.k("c"), "3")
    _, meta = c.get(r.k("a"))
    remaining = lease.remaining_ttl
    refreshed = lease.refresh()
    out: dict[str, Any] = {
        "id_positive": lease.id > 0,
        "ttl": lease.ttl,
        "granted_ttl": lease.granted_ttl,
        "remaining_ttl_ok": 55 <= remaining <= 60,
        "keys": sorted(k.decode() for k in lease.keys),
        "meta_lease": meta.lease_id == lease.id,
        "refresh": [[lease.id == x.ID, x.TTL] for x in refreshed],
    }
    before = r.revision()
    lease.revoke()
    out["revoke_revisions"] = r.revision() - before  # the two keys: one revision
    out["after_revoke"] = {
        "remaining_ttl": lease.remaining_ttl,
        "granted_ttl": lease.granted_ttl,
        "keys": list(lease.keys),
        "left": r.pairs(c.get_prefix(r.prefix)),
        "refresh": [[lease.id == x.ID, x.TTL] for x in lease.refresh()],
    }
    out["revoke_again"] = r.error(lease.revoke)
    out["put_with_revoked"] = r.error(lambda: c.put(r.k("d"), "x", lease=lease))
    explicit = c.lease(30, lease_id=LEASE_ID)
    out["explicit"] = [explicit.id == LEASE_ID, explicit.ttl]
    out["explicit_again"] = r.error(lambda: c.lease(30, lease_id=LEASE_ID))
    explicit.revoke()
    minimum = c.lease(1)
    out["minimum_ttl"] = minimum.ttl
    minimum.revoke()
    out["too_large"] = r.error(lambda: c.lease(9_000_000_001))
    return out


def scenario_lease_expiry(r: Run) -> dict[str, Any]:
    c = r.client
    lease = c.lease(2)
    c.put(r.k("a"), "1", lease=lease)
    c.put(r.k("b"), "2", lease=lease)
    c.put(r.k("c"), "3")
    written = r.revision()
    deadline = time.monotonic() + POLL_TIMEOUT
    while c.get(r.k("a"))[0] is not None and time.monotonic() < deadline:
        pass
    return {
        "granted": lease.ttl,
        "written": r.rel(written),
        "after_expiry": r.rel(r.revision()),  # both keys deleted in one revision
        "left": r.pairs(c.get_prefix(r.prefix)),
        "remaining_ttl": lease.remaining_ttl,
        "keys": list(lease.keys),
    }


# -- locks ----------------------------------------------------------------------


def attempt(lock: Any) -> bool | str:
    """One try at `lock`: True if taken at once, else "had to wait".

    etcd3 0.12 waits between attempts with a tenacity `wait` callback of an older
    signature, so with the tenacity installed here an acquire that does not get
    the lock at its first try raises TypeError, whatever the server (and leaves
    the lease it granted for the try to expire)."""
    try:
        return bool(lock.acquire(timeout=0))
    except TypeError as e:
        assert "delay_since_first_attempt" in str(e), e
        return "had to wait"


def scenario_locks(r: Run) -> dict[str, Any]:
    """etcd3's Lock: a key /locks/NAME put with a lease if it does not exist."""
    c = r.client
    name = f"etcd3-{r.base}"  # fresh on every run
    key = "/locks/" + name
    first = c.lock(name, ttl=10)
    second = c.lock(name, ttl=10)
    out: dict[str, Any] = {"first_acquire": first.acquire(timeout=5)}
    value, meta = c.get(key)
    out["held"] = {
        "is_acquired": [first.is_acquired(), second.is_acquired()],
        "value_is_first_uuid": value == first.uuid,
        "lease_is_first_lease": meta.lease_id == first.lease.id,
        "granted_ttl": first.lease.granted_ttl,
        "refresh": [x.TTL for x in first.refresh()],
    }
    # contended: the second cannot take it while the first holds it
    out["second_acquire_while_held"] = attempt(second)
    out["second_after_attempt"] = second.is_acquired()
    out["first_release"] = first.release()
    out["first_release_again"] = first.release()  # not held any more
    out["second_acquire"] = attempt(second)
    out["after_handover"] = [first.is_acquired(), second.is_acquired()]
    out["second_release"] = second.release()
    with c.lock(name, ttl=10) as third:
        out["context_manager"] = third.is_acquired()
    out["after_context"] = c.get(key)[0]
    return out


SCENARIOS: dict[str, Callable[[Run], dict[str, Any]]] = {
    name.removeprefix("scenario_"): fn
    for name, fn in globals().items()
    if name.startswith("scenario_") and callable(fn)
}


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(f"usage: {argv[0]} HOST:PORT SCENARIO|all [SCENARIO ...]", file=sys.stderr)
        return 2
    host, _, port = argv[1].rpartition(":")
    names = list(SCENARIOS) if argv[2:] == ["all"] else argv[2:]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenarios: {unknown}; known: {sorted(SCENARIOS)}", file=sys.stderr)
        return 2
    client = etcd3.client(host=host, port=int(port), timeout=RPC_TIMEOUT)
    out: dict[str, Any] = {}
    try:
        for name in names:
            try:
                out[name] = {"result": SCENARIOS[name](Run(client, name))}
            except Exception:
                out[name] = {"error": traceback.format_exc()}
    finally:
        client.close()
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
