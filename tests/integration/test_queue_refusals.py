"""Clear refusals and queue settings with a schema (issue 17), against a real
server process, through our generated stubs and etcdctl.

A key under `/q/` or `/queue/` with a queue's shape but a broken part is
refused with INVALID_ARGUMENT and a message naming the part, and nothing
changes: the whole keyspace and its revision are the same before and after. A
refused watch is answered created and canceled with the reason (the stream
stays open) and registers nothing. Ordinary keys under the prefixes keep
working. A config outside the schema is refused naming the field and the
value; Go's duration text is a duration ("30s" is a 30 s ack deadline).

Every test uses its own queue names on the module's server, and leaves no
consumer behind (a consumer's registry key going away would change the
revision under another test's before/after).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.integration.test_queue import (
    DELETE,
    PUT,
    WAIT,
    WatchStream,
    ack,
    consumer_key,
    get,
    new_id,
    prefix_end,
    put_op,
)
from tests.support.cluster import Cluster
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.integration

U = "6f1c2a4e-0c1d-4a57-9d43-3f0b1f4f2f10"
"""A valid consumer id, for shapes refused for another part."""
CTL_TIMEOUT = 20.0


@pytest.fixture(scope="module")
def kv(channel: grpc.Channel) -> rpc_pb2_grpc.KVStub:
    return rpc_pb2_grpc.KVStub(channel)


def everything(kv: rpc_pb2_grpc.KVStub) -> tuple[int, list[tuple[bytes, bytes, int]]]:
    """The revision and every key (with value and mod_revision)."""
    resp = kv.Range(rpc_pb2.RangeRequest(key=b"\0", range_end=b"\0"), timeout=WAIT)
    return resp.header.revision, [(k.key, k.value, k.mod_revision) for k in resp.kvs]


def refused(call: object, request: object) -> str:
    """The details of a call that must fail with INVALID_ARGUMENT."""
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=WAIT)  # type: ignore[operator]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    return err.value.details() or ""


def etcdctl(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["etcdctl", f"--endpoints={server.endpoint}", *args],
        capture_output=True,
        text=True,
        timeout=CTL_TIMEOUT,
        env={**os.environ, "ETCDCTL_API": "3"},
        check=False,
    )


def always_true(key: bytes) -> rpc_pb2.Compare:
    """A compare that holds: `key` does not exist (its version is 0)."""
    return rpc_pb2.Compare(
        key=key,
        target=rpc_pb2.Compare.VERSION,
        result=rpc_pb2.Compare.EQUAL,
        version=0,
    )


def consume_registered(
    stream: WatchStream, ckey: bytes, name: bytes, channel: grpc.Channel
) -> None:
    """Watch `ckey` on `stream` (a new consumer of a new queue) and return once
    the server has written the queue's registry key `/q/{name}`, its last
    write for a new consumer, so no write of its own lands in a later test."""
    registry = WatchStream(channel)
    try:
        registry.watch(b"/q/" + name)
        stream.watch(ckey)
        (claimed,) = registry.events(1)
        assert claimed.type == PUT
    finally:
        registry.close()


# -- producer typos ---------------------------------------------------------------

PUTS = [
    ("/q/typo/p/", "empty message key"),
    ("/q/typo/p", "producer key with no message key"),
    ("/q//p/k", "empty queue name"),
    ("/q/typo/p//k", "empty message key"),
    ("/queue/typo/producer/", "empty message key"),
    ("/queue/typo/producer", "producer key with no message key"),
    ("/queue//producer/k", "empty queue name"),
    (
        "/q/typo/producer/k",
        '"producer" is the /queue/ spelling: a /q/ producer key is /q/{name}/p/...',
    ),
    (
        "/queue/typo/p/k",
        '"p" is the /q/ spelling: a /queue/ producer key is /queue/{name}/producer/...',
    ),
    ("/q//config", "empty queue name"),
]


@pytest.mark.parametrize(("key", "why"), PUTS)
def test_producer_typos_are_refused_and_change_nothing(
    kv: rpc_pb2_grpc.KVStub, key: str, why: str
) -> None:
    message = f"etcdserver: queue key {key}: {why}"
    bad = put_op(key.encode(), b"job")
    ordinary = put_op(b"/refusals/ordinary", b"1")
    before = everything(kv)

    assert refused(kv.Put, rpc_pb2.PutRequest(key=key.encode(), value=b"job")) == message
    # inside a Txn the whole Txn is refused: in the branch taken, in the branch
    # not taken, and in a nested Txn
    for txn in (
        rpc_pb2.TxnRequest(success=[ordinary, bad]),
        rpc_pb2.TxnRequest(
            compare=[always_true(b"/refusals/none")], success=[ordinary], failure=[bad]
        ),
        rpc_pb2.TxnRequest(
            success=[ordinary, rpc_pb2.RequestOp(request_txn=rpc_pb2.TxnRequest(success=[bad]))]
        ),
    ):
        assert refused(kv.Txn, txn) == message

    assert everything(kv) == before


def test_etcdctl_shows_the_refusal(server: ServerProcess, kv: rpc_pb2_grpc.KVStub) -> None:
    before = everything(kv)
    p = etcdctl(server, "put", "/q/typo/p/", "job")
    assert p.returncode != 0
    assert (
        "code = InvalidArgument desc = etcdserver: queue key /q/typo/p/: empty message key"
        in p.stderr
    )
    assert everything(kv) == before


def test_plain_keys_under_the_prefixes_still_work(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """Keys that are not shaped like a queue key stay ordinary keys: put, get,
    watched like any key."""
    plain = [
        b"/q",
        b"/q/",
        b"/queue-stats/x",
        b"/q/plain/other/y",
        b"/queue/plain/other",
        b"/qp/p/",
    ]
    stream = WatchStream(channel)
    try:
        watched = stream.watch(b"/q/plain/other/y")
        for i, key in enumerate(plain):
            revision = kv.Put(
                rpc_pb2.PutRequest(key=key, value=b"v%d" % i), timeout=WAIT
            ).header.revision
            assert get(kv, key) == b"v%d" % i
            got = kv.Range(rpc_pb2.RangeRequest(key=key), timeout=WAIT).kvs[0]
            assert got.mod_revision == revision
        (event,) = stream.events(1)
        assert (event.type, event.kv.key, event.kv.value) == (PUT, b"/q/plain/other/y", b"v3")
        stream.cancel(watched)
    finally:
        stream.close()
    # and a well-formed producer key still produces, its extra segments dropped
    kv.Put(rpc_pb2.PutRequest(key=b"/q/plainq/p/k/extra", value=b"m"), timeout=WAIT)
    base = b"/q/plainq/"
    (msg,) = kv.Range(
        rpc_pb2.RangeRequest(key=base + b"0", range_end=base + b":"), timeout=WAIT
    ).kvs
    assert msg.key == b"/q/plainq/0000000000000001/k" and msg.value == b"m"
    assert ack(kv, msg.key) == 1


# -- consumer watches -------------------------------------------------------------

RANGE = (
    "a consumer watch has no range_end (a prefix or range watch here consumes nothing; "
    "watch {} with a prefix to see the consumers)"
)
WATCHES = [
    (f"/q/wq/c/{U}", prefix_end(f"/q/wq/c/{U}".encode()).decode(), RANGE.format("/q/wq/c/")),
    (f"/q/wq/c/{U}", "\0", RANGE.format("/q/wq/c/")),  # --from-key
    (f"/queue/wq/consumer/{U}", "/queue/wq/consumer0", RANGE.format("/queue/wq/consumer/")),
    ("/q/wq/c/", "", "empty consumer uuid"),
    ("/q/wq/c", "", "consumer key with no uuid"),
    (f"/q//c/{U}", "", "empty queue name"),
    ("/q/wq/c/worker-1", "", 'consumer id "worker-1" is not a UUID'),
    ("/queue/wq/consumer/", "", "empty consumer uuid"),
    (
        f"/queue/wq/c/{U}",
        "",
        '"c" is the /q/ spelling: a /queue/ consumer key is /queue/{name}/consumer/...',
    ),
    (
        f"/q/wq/consumer/{U}",
        "",
        '"consumer" is the /queue/ spelling: a /q/ consumer key is /q/{name}/c/...',
    ),
]


def test_refused_consumer_watches(
    server: ServerProcess, channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """Each refused watch is answered created and canceled, watch id -1 (as
    etcd answers a watch its mvcc layer refuses) and the reason; the stream
    goes on; nothing is registered; the server logs each at WARNING."""
    observer = WatchStream(channel)
    observer.watch(b"/q/", prefix_end(b"/q/"))
    observer.watch(b"/queue/", prefix_end(b"/queue/"))
    stream = WatchStream(channel)
    try:
        before = everything(kv)
        for key, range_end, why in WATCHES:
            resp = stream.create(key.encode(), range_end.encode(), watch_id=0)
            assert (resp.created, resp.canceled, resp.watch_id) == (True, True, -1), resp
            assert resp.cancel_reason == f"etcdserver: queue key {key}: {why}"
            assert resp.header.revision == before[0]
        # the same stream still watches; the observers' first event is the
        # marker, so no refused watch wrote a registry key
        marker = b"/q/wq-marker"
        stream.watch(marker)
        kv.Put(rpc_pb2.PutRequest(key=marker, value=b"x"), timeout=WAIT)
        (event,) = stream.events(1)
        assert event.kv.key == marker
        (seen,) = observer.events(1)
        assert (seen.type, seen.kv.key) == (PUT, marker)
        revision, keys = everything(kv)
        assert revision == before[0] + 1
        assert [k for k in keys if k[0] != marker] == before[1]
    finally:
        stream.close()
        observer.close()
    deadline = time.monotonic() + WAIT
    while server.log_text().count("queue watch refused") < len(WATCHES):
        assert time.monotonic() < deadline, server.log_text()[-2000:]
        time.sleep(0.05)  # a log file gives no event to wait on
    assert "queue watch refused key='/q/wq/c/worker-1' range_end='' reason=" in server.log_text()


def test_etcdctl_watch_shows_the_reason(server: ServerProcess) -> None:
    p = etcdctl(server, "watch", "--prefix", f"/q/wq/c/{U}")
    assert p.returncode != 0
    assert (
        f"watch was canceled (etcdserver: queue key /q/wq/c/{U}: a consumer watch has no range_end"
        in (p.stdout + p.stderr)
    )
    p = etcdctl(server, "watch", "/q/wq/c/")
    assert p.returncode != 0
    assert "watch was canceled (etcdserver: queue key /q/wq/c/: empty consumer uuid)" in (
        p.stdout + p.stderr
    )


def test_operator_views_still_watch_the_queue(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub
) -> None:
    """A prefix watch of the whole queue and of its consumers' keys are ordinary
    watches: they see a consumer come and go, the message and its ack."""
    name = b"views"
    whole, consumers = WatchStream(channel), WatchStream(channel)
    whole.watch(b"/q/views/", prefix_end(b"/q/views/"))
    consumers.watch(b"/q/views/c/", prefix_end(b"/q/views/c/"))
    stream = WatchStream(channel)
    ckey = consumer_key(name, new_id())
    try:
        consume_registered(stream, ckey, name, channel)
        (reg,) = consumers.events(1)
        assert (reg.type, reg.kv.key) == (PUT, ckey)
        kv.Put(rpc_pb2.PutRequest(key=b"/q/views/p/m", value=b"x"), timeout=WAIT)
        (delivery,) = stream.events(1)
        assert ack(kv, delivery.kv.key) == 1
        got = [(e.type, e.kv.key) for e in whole.events(3)]
        assert got == [(PUT, ckey), (PUT, delivery.kv.key), (DELETE, delivery.kv.key)]
        stream.close()  # the consumer goes: its registry key with it
        (gone,) = consumers.events(1)
        assert (gone.type, gone.kv.key) == (DELETE, ckey)
    finally:
        stream.close()
        whole.close()
        consumers.close()


# -- settings ---------------------------------------------------------------------

CONFIGS = [
    ({"prefetch": "16"}, '"prefetch": "16" is not an integer'),
    ({"prefetch": 1.5}, '"prefetch": 1.5 is not an integer'),
    ({"prefetch": True}, '"prefetch": true is not an integer'),
    ({"prefetch": 0}, '"prefetch": 0 is less than 1'),
    ({"ack_deadline": -1}, '"ack_deadline": -1 is negative'),
    (
        {"ack_deadline": "soon"},
        '"ack_deadline": "soon" is not a duration ("30s", "1m30s", "500ms") or a number of seconds',
    ),
    ({"max_depth": "100"}, '"max_depth": "100" is not an integer'),
    ({"max_deliveries": -2}, '"max_deliveries": -2 is negative'),
    ({"dead_letter": 7}, '"dead_letter": 7 is not a string'),
    ({"prefetc": 16}, 'unknown field "prefetc" (value 16)'),
    ({"cqs": {"prefetch": True}}, '"cqs.prefetch": true is not an integer'),
    ({"cqs": {"depth": 33}}, '"cqs.depth": 33 is more than 32'),
]


@pytest.mark.parametrize(("config", "why"), CONFIGS)
def test_config_outside_the_schema_is_refused(
    kv: rpc_pb2_grpc.KVStub, config: dict[str, object], why: str
) -> None:
    key = b"/q/schema/config"
    if get(kv, key) is None:
        kv.Put(rpc_pb2.PutRequest(key=key, value=b'{"prefetch": 3}'), timeout=WAIT)
    value = json.dumps(config).encode()
    message = f"etcdserver: queue config /q/schema/config: {why}"
    before = everything(kv)
    assert refused(kv.Put, rpc_pb2.PutRequest(key=key, value=value)) == message
    txn = rpc_pb2.TxnRequest(
        compare=[always_true(b"/refusals/none")],
        success=[put_op(b"/refusals/ordinary", b"1")],
        failure=[put_op(key, value)],
    )
    assert refused(kv.Txn, txn) == message
    assert everything(kv) == before
    assert get(kv, key) == b'{"prefetch": 3}'


def test_etcdctl_config_refusal_names_field_and_value(
    server: ServerProcess, kv: rpc_pb2_grpc.KVStub
) -> None:
    before = everything(kv)
    p = etcdctl(server, "put", "/q/ctlschema/config", '{"prefetch": "16"}')
    assert p.returncode != 0
    assert (
        'etcdserver: queue config /q/ctlschema/config: "prefetch": "16" is not an integer'
        in p.stderr
    )
    assert everything(kv) == before
    p = etcdctl(server, "put", "/q/ctlschema/config", '{"ack_deadline": "1m30s", "prefetch": 4}')
    assert p.returncode == 0, p.stderr
    assert get(kv, b"/q/ctlschema/config") == b'{"ack_deadline": "1m30s", "prefetch": 4}'
    assert etcdctl(server, "del", "/q/ctlschema/config").stdout == "1\n"


@pytest.mark.parametrize(("deadline", "seconds"), [("30s", 30), ("1m30s", 90), (45, 45)])
def test_ack_deadline_in_go_duration_text(
    channel: grpc.Channel, kv: rpc_pb2_grpc.KVStub, deadline: object, seconds: int
) -> None:
    """ "30s" is a 30 s ack deadline: the delivery's own lease is granted 30 s
    (LeaseTimeToLive), as with the number 30."""
    name = b"godur%d" % seconds
    config = json.dumps({"ack_deadline": deadline}).encode()
    kv.Put(rpc_pb2.PutRequest(key=b"/q/%s/config" % name, value=config), timeout=WAIT)
    stream = WatchStream(channel)
    ckey = consumer_key(name, new_id())
    try:
        consume_registered(stream, ckey, name, channel)
        kv.Put(rpc_pb2.PutRequest(key=b"/q/%s/p/m" % name, value=b"x"), timeout=WAIT)
        (delivery,) = stream.events(1)
        assert delivery.kv.lease != 0
        ttl = rpc_pb2_grpc.LeaseStub(channel).LeaseTimeToLive(
            rpc_pb2.LeaseTimeToLiveRequest(ID=delivery.kv.lease), timeout=WAIT
        )
        assert ttl.grantedTTL == seconds
        assert 0 < ttl.TTL <= seconds
        assert ack(kv, delivery.kv.key) == 1
    finally:
        stream.close()
    # the consumer's registry key goes with it (other tests compare revisions)
    consumers = WatchStream(channel)
    try:
        resp = kv.Range(rpc_pb2.RangeRequest(key=ckey), timeout=WAIT)
        if resp.kvs:
            prefix = b"/q/%s/c/" % name
            consumers.watch(prefix, prefix_end(prefix), start_revision=resp.header.revision + 1)
            (gone,) = consumers.events(1)
            assert (gone.type, gone.kv.key) == (DELETE, ckey)
    finally:
        consumers.close()


# -- in a cluster -----------------------------------------------------------------


def test_refused_on_a_follower_before_anything_is_proposed(cluster: Cluster) -> None:
    """A follower refuses like a single server, without asking the leader: the
    log (every member's revision and keys) does not move."""
    leader = cluster.wait_leader()
    follower = next(m for m in cluster.members if m is not leader)
    with (
        grpc.insecure_channel(follower.endpoint) as ch,
        grpc.insecure_channel(leader.endpoint) as leader_ch,
    ):
        kv, leader_kv = rpc_pb2_grpc.KVStub(ch), rpc_pb2_grpc.KVStub(leader_ch)
        kv.Put(rpc_pb2.PutRequest(key=b"/refusals/ordinary", value=b"1"), timeout=WAIT)
        before = everything(leader_kv)  # linearizable: the put above is in it
        assert (
            refused(kv.Put, rpc_pb2.PutRequest(key=b"/q//p/k", value=b"job"))
            == "etcdserver: queue key /q//p/k: empty queue name"
        )
        config = rpc_pb2.PutRequest(key=b"/q/jobs/config", value=b'{"prefetch": true}')
        assert refused(kv.Put, config) == (
            'etcdserver: queue config /q/jobs/config: "prefetch": true is not an integer'
        )
        stream = WatchStream(ch)
        try:
            resp = stream.create(b"/q/jobs/c/worker-1")
            assert (resp.created, resp.canceled) == (True, True)
            assert resp.cancel_reason.endswith('consumer id "worker-1" is not a UUID')
        finally:
            stream.close()
        assert everything(kv) == before
        assert everything(leader_kv) == before
