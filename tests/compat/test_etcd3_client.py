"""The PyPI `etcd3` client (python-etcd3 0.12.0) against the server.

etcd3 cannot be imported here (its generated protos clash with ours in the
protobuf descriptor pool, and it needs the pure-Python protobuf runtime), so
`etcd3_scenarios.py` runs the scenarios in a child process and prints JSON. It runs
once per server per module, all scenarios in one process (each start of the pure
Python protobuf runtime costs about a second), the two servers' runs side by side.

Each test checks one scenario three ways: it did not raise in the client, our
server's output is exactly the expected data, and real etcd's output is the same
data (so the expectation is etcd's behaviour, not ours). Revisions in the output
are relative to the scenario's start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import EtcdProcess, FrontProcess, ServerProcess

pytestmark = pytest.mark.compat

SCRIPT = Path(__file__).with_name("etcd3_scenarios.py")
SCRIPT_TIMEOUT = 120.0


def start_scenarios(endpoint: str, *names: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    # the child must not import our etcdserverpb by accident: run it from its
    # own directory, with no PYTHONPATH pointing at the repository
    env.pop("PYTHONPATH", None)
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), endpoint, *(names or ("all",))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=SCRIPT.parent,
    )


def finish_scenarios(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=SCRIPT_TIMEOUT)
        raise
    assert proc.returncode == 0, f"etcd3_scenarios.py failed:\n{stderr}"
    result: dict[str, Any] = json.loads(stdout)
    return result


@pytest.fixture(scope="module")
def outputs(server: ServerProcess, etcd: EtcdProcess) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every scenario against both servers, the two runs side by side (each
    costs seconds: the pure-Python protobuf runtime, and lease expiries)."""
    procs = [start_scenarios(server.endpoint), start_scenarios(etcd.endpoint)]
    deadline = time.monotonic() + SCRIPT_TIMEOUT
    try:
        ours, reference = (
            finish_scenarios(p, max(1.0, deadline - time.monotonic())) for p in procs
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=SCRIPT_TIMEOUT)
    return ours, reference


@pytest.fixture(scope="module")
def ours(outputs: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    return outputs[0]


@pytest.fixture(scope="module")
def reference(outputs: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    return outputs[1]


def result_of(outputs: dict[str, Any], name: str) -> Any:
    out = outputs[name]
    assert "error" not in out, f"scenario {name} raised in the etcd3 client:\n{out['error']}"
    return out["result"]


def check(name: str, ours: dict[str, Any], reference: dict[str, Any], expected: Any) -> None:
    assert result_of(ours, name) == expected
    assert result_of(reference, name) == expected, "etcd disagrees with the expectation"


def P(scenario: str, key: str) -> str:
    return f"/etcd3/{scenario}/{key}"


# -- KV -------------------------------------------------------------------------


def test_get(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    check(
        "get",
        ours,
        reference,
        {
            "value": "hello again",
            "meta": {
                "key": P("get", "a"),
                "create_revision": 1,
                "mod_revision": 2,
                "version": 2,
                "lease_id": 0,
                "header_revision": 2,
            },
            "missing": [None, None],
            "serializable": "hello again",
            "bytes_key": "hello again",
        },
    )


def test_get_prefix(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    a = ["1", P("get_prefix", "a"), 1, 1]
    ab = ["2", P("get_prefix", "ab"), 1, 2]
    abc = ["3", P("get_prefix", "abc"), 1, 3]
    b = ["4", P("get_prefix", "b"), 1, 4]
    check(
        "get_prefix",
        ours,
        reference,
        {
            "a": [a, ab, abc],
            "all": [a, ab, abc, b],
            "keys_only": [["", *a[1:]], ["", *ab[1:]], ["", *abc[1:]]],
            "descend": [b, abc, ab, a],
            "by_value": [b, abc, ab, a],
            "none": [],
        },
    )


def test_put(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    check(
        "put",
        ours,
        reference,
        {
            "first": {"revision": 1, "has_prev_kv": False},
            "second": {
                "revision": 2,
                "prev_kv": {
                    "key": P("put", "a"),
                    "value": "1",
                    "create_revision": 1,
                    "mod_revision": 1,
                    "version": 1,
                },
            },
            "third_revision": 3,
            "plain": {"revision": 4, "has_prev_kv": False},
            "value": list(b"\x00binary\xff"),
            "version": 3,
            "lease_not_found": {
                "type": "RpcError",
                "code": "NOT_FOUND",
                "details": "etcdserver: requested lease not found",
            },
        },
    )


def test_delete(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    check(
        "delete",
        ours,
        reference,
        {
            "deleted": True,
            "again": False,
            "response": {
                "deleted": 1,
                "revision": 5,
                "prev_kvs": [
                    {
                        "key": P("delete", "b"),
                        "value": "22",
                        "create_revision": 2,
                        "mod_revision": 3,
                        "version": 2,
                    }
                ],
            },
            "missing": {"deleted": 0, "revision": 5, "prev_kvs": 0},
            "left": [None, None],
        },
    )


def test_delete_prefix(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    check(
        "delete_prefix",
        ours,
        reference,
        {
            "a": {"deleted": 2, "revision": 5},
            "none": {"deleted": 0, "revision": 5},
            "rest": {"deleted": 1, "revision": 6},
            "sibling": "stays",
            "left": [],
        },
    )


def test_transactions(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    def kv(key: str, value: str, version: int, mod: int) -> list[Any]:
        return [value, P("transactions", key), version, mod]

    a2 = kv("a", "2", 2, 4)
    b_restored = kv("b", "restored", 1, 5)
    check(
        "transactions",
        ours,
        reference,
        {
            # a=1 (+1), b=x (+2), b=y (+3); the txn writes at +4
            "all_true": {
                "succeeded": True,
                "responses": [
                    {"response_put": 4},
                    {"range": [a2]},
                    {"response_delete_range": 4, "deleted": 1},
                    {"range": []},
                ],
            },
            "value_false": {
                "succeeded": False,
                "responses": [{"response_put": 5}, {"range": [a2]}, {"range": [a2, b_restored]}],
            },
            "version_greater": {"succeeded": True, "responses": [{"range": [a2]}]},
            "version_less_false": {"succeeded": False, "responses": []},
            "create_not_equal": {"succeeded": True, "responses": [{"range": [b_restored]}]},
            "mod_less": {"succeeded": False, "responses": [{"range": [a2]}]},
            "missing_key": {"succeeded": True, "responses": [{"response_put": 6}]},
            # a value compare on a missing key is false, even against ""
            "missing_value": {"succeeded": False, "responses": [{"range": [a2]}]},
            # a nested TxnResponse carries an (empty) header: revision 0 -> 0
            "nested": {
                "succeeded": True,
                "responses": [{"response_txn": 0, "succeeded": True, "responses": 1}],
            },
            "delete_prev_kv": {
                "succeeded": True,
                "responses": [{"response_delete_range": 8, "deleted": 1}],
            },
            "duplicate_key": {
                "type": "RpcError",
                "code": "INVALID_ARGUMENT",
                "details": "etcdserver: duplicate key given in txn request",
            },
            "put_if_not_exists": [True, False],
            "final": [a2, b_restored, kv("nope", "created", 1, 6), kv("pine", "1", 1, 9)],
        },
    )


def test_replace(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    check(
        "replace",
        ours,
        reference,
        {
            "replaced": True,
            "after": "new",
            "stale": False,
            "after_stale": "new",
            "again": True,
            "missing": False,
            "missing_after": None,
            "final": [["newest", P("replace", "a"), 3, 3]],
        },
    )


def test_get_all(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    a = ["2", P("get_all", "a"), 1, 3]
    b = ["3", P("get_all", "b"), 1, 2]
    c = ["1", P("get_all", "c"), 1, 4]
    # the scenario empties the key space first (that is the wipe's revision, +1)
    check(
        "get_all",
        ours,
        reference,
        {
            "wiped": True,
            "all": [a, b, c],
            "keys_only": [["", *a[1:]], ["", *b[1:]], ["", *c[1:]]],
            "by_value": [c, a, b],
            "by_create_desc": [c, a, b],
        },
    )


def test_get_range(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    # [a, e) after creating e, c, a, d, b (+1..+5) and writing c again (+6):
    # versions a1 b1 c2 d1; values a5 b4 c3 d2
    a, b = ["5", P("get_range", "a"), 1, 3], ["4", P("get_range", "b"), 1, 5]
    c, d = ["3", P("get_range", "c"), 2, 6], ["2", P("get_range", "d"), 1, 4]
    orders = {
        "key": "abcd",
        "version": "abdc",  # ties keep key order...
        "create": "cadb",
        "mod": "adbc",
        "value": "dcba",
    }
    expected: dict[str, Any] = {"plain": [a, b, c, d], "empty": []}
    expected["keys_only"] = [["", *x[1:]] for x in (a, b, c, d)]
    for target, order in orders.items():
        expected[f"{target}/None"] = list(order)  # a target alone sorts ascending
        expected[f"{target}/ascend"] = list(order)
        expected[f"{target}/descend"] = list(reversed(order))
    expected["version/descend"] = list("cabd")  # ...descending too
    check("get_range", ours, reference, expected)


def test_compact(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    def out_of_range(what: str) -> dict[str, str]:
        return {"type": "RpcError", "code": "OUT_OF_RANGE", "details": f"etcdserver: mvcc: {what}"}

    check(
        "compact",
        ours,
        reference,
        {
            "compact": None,
            "future": out_of_range("required revision is a future revision"),
            "again": out_of_range("required revision has been compacted"),
            "same": out_of_range("required revision has been compacted"),
            "physical": None,
            "read": [["3", P("compact", "a"), 3, 3]],
        },
    )


# -- Maintenance and Cluster ----------------------------------------------------


def test_status(ours: dict[str, Any], server: ServerProcess, reference: dict[str, Any]) -> None:
    st = result_of(ours, "status")
    assert st["version"] == "3.5.17"
    assert st["db_size"] > 0
    assert st["raft_term"] >= 1
    assert st["raft_index"] >= 1
    # etcd3 finds the leader among the members by id
    assert st["leader"] == {
        "id": st["member_id"],
        "name": server.data_dir.name,
        "client_urls": [f"http://{server.endpoint}"],
    }
    ref = result_of(reference, "status")
    assert ref["leader"]["id"] == ref["member_id"]
    assert set(ref) == set(st)


def test_members(ours: dict[str, Any], server: ServerProcess, reference: dict[str, Any]) -> None:
    out = result_of(ours, "members")
    assert out["members"] == [
        {
            "id": out["member_id"],
            "name": server.data_dir.name,
            "peer_urls": ["http://localhost:2380"],
            "client_urls": [f"http://{server.endpoint}"],
        }
    ]
    ref = result_of(reference, "members")
    assert [m["id"] for m in ref["members"]] == [ref["member_id"]]


# -- Watch ----------------------------------------------------------------------


def ev(
    scenario: str,
    key: str,
    value: str,
    version: int,
    create: int,
    mod: int,
    **prev: Any,
) -> dict[str, Any]:
    """An event as the scenarios report it: a delete has version 0, create 0."""
    out = {
        "type": "PutEvent" if version else "DeleteEvent",
        "key": P(scenario, key),
        "value": value,
        "version": version,
        "create_revision": create,
        "mod_revision": mod,
    }
    out.update(prev)
    return out


def test_watch(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    check(
        "watch",
        ours,
        reference,
        {
            "events": [
                ev("watch", "a", "1", 1, 1, 1),
                # +2 is the put of another key
                ev("watch", "a", "2", 2, 1, 3),
                ev("watch", "a", "", 0, 0, 4),
                ev("watch", "a", "3", 1, 5, 5),  # a new generation
            ],
            "error": "None",
            "after_cancel": [],
        },
    )


def test_watch_prefix(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    def e(key: str, value: str, version: int, create: int, mod: int, prev: str, pmod: int) -> Any:
        return ev(
            "watch_prefix",
            key,
            value,
            version,
            create,
            mod,
            prev_value=prev,
            prev_mod_revision=pmod,
        )

    check(
        "watch_prefix",
        ours,
        reference,
        {
            "events": [
                e("p/a", "1", 1, 1, 1, "", 0),  # a create: no previous
                e("p/b", "2", 1, 3, 3, "", 0),  # +2 is outside the prefix
                e("p/a", "3", 2, 1, 4, "1", 1),
                # one delete of the prefix: both events at +5, in key order
                e("p/a", "", 0, 0, 5, "3", 4),
                e("p/b", "", 0, 0, 5, "2", 3),
            ],
            "error": "None",
        },
    )


def test_watch_start_revision(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    s = "watch_start_revision"
    check(
        s,
        ours,
        reference,
        {
            "history": [
                ev(s, "a", "2", 2, 1, 2),
                ev(s, "a", "", 0, 0, 3),
                ev(s, "a", "3", 1, 4, 4),
            ],
            "live": [ev(s, "a", "4", 2, 4, 5)],
            # started at +7: the put at +6 is not delivered
            "ahead": [ev(s, "a", "6", 4, 4, 7)],
            "once": ev(s, "a", "1", 1, 1, 1),
            "once_times_out": {"type": "WatchTimedOut", "message": ""},
        },
    )


def test_watch_callback_and_cancel(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    s = "watch_callback"
    check(
        s,
        ours,
        reference,
        {
            "first_done": True,
            # one response per put, header at the put's revision
            "first": [
                {"revision": 1, "events": [ev(s, "a", "1", 1, 1, 1)]},
                {"revision": 2, "events": [ev(s, "a", "2", 2, 1, 2)]},
            ],
            # the first watch was canceled before the third put
            "second_done": True,
            "second": [{"revision": 3, "events": [ev(s, "a", "3", 3, 1, 3)]}],
        },
    )


def test_watch_compacted(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    s = "watch_compacted"
    check(
        s,
        ours,
        reference,
        {
            "events": [],
            "error": "RevisionCompactedError",
            "compacted_revision": 2,
            "from_compacted": [ev(s, "a", "2", 2, 1, 2), ev(s, "a", "3", 3, 1, 3)],
        },
    )


# -- Lease ----------------------------------------------------------------------


def test_lease(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    not_found = {
        "type": "RpcError",
        "code": "NOT_FOUND",
        "details": "etcdserver: requested lease not found",
    }
    check(
        "lease",
        ours,
        reference,
        {
            "id_positive": True,
            "ttl": 60,
            "granted_ttl": 60,
            "remaining_ttl_ok": True,
            "keys": [P("lease", "a"), P("lease", "b")],
            "meta_lease": True,
            "refresh": [[True, 60]],
            "revoke_revisions": 1,
            "after_revoke": {
                "remaining_ttl": -1,
                "granted_ttl": 0,
                "keys": [],
                "left": [["3", P("lease", "c"), 1, 3]],
                "refresh": [[True, 0]],  # a keepalive of an unknown lease: TTL 0
            },
            "revoke_again": not_found,
            "put_with_revoked": not_found,
            "explicit": [True, 30],
            # FAILED_PRECONDITION, which etcd3 turns into PreconditionFailedError
            "explicit_again": {"type": "PreconditionFailedError", "message": ""},
            "minimum_ttl": 2,  # etcd's minimum with its default timing
            "too_large": {
                "type": "RpcError",
                "code": "OUT_OF_RANGE",
                "details": "etcdserver: too large lease TTL",
            },
        },
    )


def test_lease_expiry(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    check(
        "lease_expiry",
        ours,
        reference,
        {
            "granted": 2,
            "written": 3,
            "after_expiry": 4,  # both keys deleted in one revision
            "left": [["3", P("lease_expiry", "c"), 1, 3]],
            "remaining_ttl": -1,
            "keys": [],
        },
    )


# -- Lock (etcd3's own recipe over KV and Lease) --------------------------------


def test_locks(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    check(
        "locks",
        ours,
        reference,
        {
            "first_acquire": True,
            "held": {
                "is_acquired": [True, False],
                "value_is_first_uuid": True,
                "lease_is_first_lease": True,
                "granted_ttl": 10,
                "refresh": [10],
            },
            "second_acquire_while_held": "had to wait",
            "second_after_attempt": False,
            "first_release": True,
            "first_release_again": False,
            "second_acquire": True,
            "after_handover": [False, True],
            "second_release": True,
            "context_manager": True,
            "after_context": None,
        },
    )


# -- through a front ------------------------------------------------------------


def test_every_scenario_through_a_front_answers_as_etcd(
    front: FrontProcess, etcd: EtcdProcess, reference: dict[str, Any]
) -> None:
    """The whole scenario run again through a front (--backend-endpoints) over
    an etcd of its own: every scenario's output equals etcd's own, raised
    errors included. The two etcds differ only in who they are (member id,
    client URL), which a front passes through as grpc-proxy does, and in the
    size of their files."""
    through = finish_scenarios(start_scenarios(front.endpoint), SCRIPT_TIMEOUT)
    assert set(through) == set(reference)
    text = json.dumps(through, sort_keys=True)
    ids = (result_of(through, "status")["member_id"], result_of(reference, "status")["member_id"])
    assert front.backend_etcd is not None
    text = text.replace(str(ids[0]), str(ids[1])).replace(front.backend[0], etcd.endpoint)
    text = text.replace(f":{front.backend_etcd.peer_port}", f":{etcd.peer_port}")
    through, reference = json.loads(text), json.loads(json.dumps(reference))
    for out in (through, reference):  # bbolt's file size follows its commit timing
        result_of(out, "status")["db_size"] = 0
    differ = [name for name in reference if through[name] != reference[name]]
    assert not differ, (
        "scenarios a front answers otherwise than etcd: "
        + json.dumps({name: (through[name], reference[name]) for name in differ}, indent=1)[:4000]
    )
