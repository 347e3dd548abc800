"""The gateway requests Patroni's etcd3 DCS makes, side by side with etcd 3.4.23.

tests/integration/test_patroni.py runs Patroni itself; this is the same traffic
at the HTTP level, in the exact shapes `patroni/dcs/etcd3.py` (3.0 and 4.x)
sends, so a difference shows as a JSON diff rather than a failover that takes
too long. Compared after tests/compat/test_gateway_differential.normalise.

What Patroni sends, and reads back:
- `GET /version` (it picks `/v3` from `etcdcluster` >= 3.4);
- serializable prefix ranges (`serializable: true`);
- `/v3/lease/grant` with `TTL`, and `/v3/lease/keepalive` as a unary call (it
  reads `result.TTL`; a lease that is gone answers without a TTL);
- puts guarded by a txn comparing `CREATE` with `create_revision: "0"` (a
  string) or `MOD`, `VALUE` comparisons with no `result` (EQUAL by default);
- 4.x's leader update: a txn whose `failure` branch is a nested `request_txn`
  (it reads `responses[0].response_txn.succeeded`);
- a prefix watch with `start_revision` and `filters: []`, whose messages must
  carry `header.cluster_id` and `header.raft_term` (4.x refuses a node whose
  raft_term goes down).
"""

from __future__ import annotations

import base64
import os
from typing import Any

import pytest

from tests.compat.test_gateway_differential import Client, Pair, Stream, b64, normalise
from tests.support.processes import EtcdProcess, ServerProcess

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(
        os.environ.get("ETCD_GRPC_TRANSPORT") == "grpcio",
        reason="the gateway is served by the native transport only",
    ),
]

PREFIX = "/service/qs-ha/"


def prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@pytest.fixture(scope="module")
def pair(etcd: EtcdProcess, server: ServerProcess) -> Pair:
    return Pair(etcd, server)


def test_version_and_serializable_range(pair: Pair) -> None:
    ref, ours = pair.ref.get("/version"), pair.ours.get("/version")
    assert ref[0] == ours[0] == 200
    assert ours[1].startswith(b'{"etcdserver":"3.')
    pair.step("/v3/kv/put", {"key": b64(PREFIX + "config"), "value": b64('{"ttl":10}')})
    body = {"key": b64(PREFIX), "range_end": b64(prefix_end(PREFIX)), "serializable": True}
    answer = pair.step("/v3/kv/range", body)
    assert base64.b64decode(answer["kvs"][0]["key"]) == (PREFIX + "config").encode()


def test_leader_race_and_nested_update(pair: Pair) -> None:
    for client in (pair.ref, pair.ours):
        status, _ = client.post("/v3/lease/grant", {"TTL": 10, "ID": 7000})
        assert status == 200
        status, _ = client.post("/v3/lease/grant", {"TTL": 10, "ID": 7001})
        assert status == 200
    leader = b64(PREFIX + "leader")
    name = b64("pg0")
    put = {"request_put": {"key": leader, "value": name, "lease": 7000}}
    create = {"key": leader, "target": "CREATE", "create_revision": "0"}
    # attempt_to_acquire_leader: put the key if it does not exist.
    pair.step("/v3/kv/txn", {"compare": [create], "success": [put]})
    pair.step("/v3/kv/txn", {"compare": [create], "success": [put]})
    # 4.x's _update_leader with a new lease: the VALUE compare holds...
    moved = {"request_put": {"key": leader, "value": name, "lease": 7001}}
    same = {"key": leader, "target": "VALUE", "value": name}
    nested = {"request_txn": {"compare": [create], "success": [moved]}}
    pair.step("/v3/kv/txn", {"compare": [same], "success": [moved], "failure": [nested]})
    # ...and when it does not, the nested txn runs (and fails: the key exists).
    other = {"key": leader, "target": "VALUE", "value": b64("pg1")}
    answer = pair.step("/v3/kv/txn", {"compare": [other], "success": [moved], "failure": [nested]})
    assert answer["responses"][0]["response_txn"].get("succeeded", False) is False
    # Once the key is gone, the nested txn creates it.
    pair.step("/v3/kv/deleterange", {"key": leader})
    answer = pair.step("/v3/kv/txn", {"compare": [other], "success": [moved], "failure": [nested]})
    assert answer["responses"][0]["response_txn"]["succeeded"] is True
    # _delete_leader and a MOD-guarded delete.
    pair.step(
        "/v3/kv/txn", {"compare": [same], "success": [{"request_delete_range": {"key": leader}}]}
    )
    mod = {"key": leader, "target": "MOD", "mod_revision": "1"}
    pair.step(
        "/v3/kv/txn", {"compare": [mod], "success": [{"request_delete_range": {"key": leader}}]}
    )


def test_unary_keepalive(pair: Pair) -> None:
    for client in (pair.ref, pair.ours):
        assert client.post("/v3/lease/grant", {"TTL": 30, "ID": 7100})[0] == 200
    answer = pair.step("/v3/lease/keepalive", {"ID": 7100})
    assert answer["result"]["TTL"] == "30"
    pair.step("/v3/lease/revoke", {"ID": 7100})
    answer = pair.step("/v3/lease/keepalive", {"ID": 7100})
    assert "TTL" not in answer["result"]


def watch_messages(endpoint: str, client: Client, revision: str) -> list[Any]:
    stream = Stream(endpoint, "/v3/watch")
    try:
        request = {
            "key": b64(PREFIX),
            "range_end": b64(prefix_end(PREFIX)),
            "start_revision": revision,
            "filters": [],
        }
        stream.send_body({"create_request": request})
        got = [stream.status(), stream.recv()]
        client.post("/v3/kv/put", {"key": b64(PREFIX + "members/pg0"), "value": b64("{}")})
        got.append(stream.recv())
        return got
    finally:
        stream.close()


def test_prefix_watch_from_revision(pair: Pair, etcd: EtcdProcess, server: ServerProcess) -> None:
    _, ref_range = pair.ref.post("/v3/kv/range", {"key": b64(PREFIX), "serializable": True})
    _, our_range = pair.ours.post("/v3/kv/range", {"key": b64(PREFIX), "serializable": True})
    assert ref_range["header"]["revision"] == our_range["header"]["revision"]
    revision = str(int(ref_range["header"]["revision"]) + 1)
    ref = watch_messages(etcd.endpoint, pair.ref, revision)
    ours = watch_messages(server.endpoint, pair.ours, revision)
    assert normalise(ours) == normalise(ref)
    for message in ours[1:]:
        header = message["result"]["header"]
        assert header["cluster_id"] and int(header["raft_term"]) >= 1, header
