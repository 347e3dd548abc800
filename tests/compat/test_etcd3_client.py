"""The PyPI `etcd3` client (python-etcd3 0.12.0) against the server.

etcd3 cannot be imported here (its generated protos clash with ours in the
protobuf descriptor pool, and it needs the pure-Python protobuf runtime), so
`etcd3_scenarios.py` runs the scenarios in a child process and prints JSON. It runs
once per server per module, all scenarios in one process (each start of the pure
Python protobuf runtime costs about a second).

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
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import EtcdProcess, ServerProcess

pytestmark = pytest.mark.compat

SCRIPT = Path(__file__).with_name("etcd3_scenarios.py")
SCRIPT_TIMEOUT = 120.0


def run_scenarios(endpoint: str, *names: str) -> dict[str, Any]:
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    # the child must not import our etcdserverpb by accident: run it from its
    # own directory, with no PYTHONPATH pointing at the repository
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), endpoint, *(names or ("all",))],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
        env=env,
        cwd=SCRIPT.parent,
        check=False,
    )
    assert proc.returncode == 0, f"etcd3_scenarios.py failed:\n{proc.stderr}"
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@pytest.fixture(scope="module")
def ours(server: ServerProcess) -> dict[str, Any]:
    return run_scenarios(server.endpoint)


@pytest.fixture(scope="module")
def reference(etcd: EtcdProcess) -> dict[str, Any]:
    return run_scenarios(etcd.endpoint)


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
