"""The client library's pure parts, without a server: delivery keys to messages,
endpoints, the redrive Txn's shape, seed 000's error rule, key validation."""

from __future__ import annotations

import grpc
import pytest

from etcdserverpb import kv_pb2, rpc_pb2
from queue_server.client import is_transient, produce_op, redrive_request
from queue_server.client.connection import Connection, parse_endpoints
from queue_server.client.queue import (
    Consumer,
    consumer_key,
    dead_letter_name,
    message_from_event,
    stored_message,
)
from queue_server.keyspace import grammar

pytestmark = pytest.mark.unit

UUID = "6f1c2a4e-0c1d-4a57-9d43-3f0b1f4f2f10"


def kv(key: bytes, **fields: int) -> kv_pb2.KeyValue:
    return kv_pb2.KeyValue(key=key, value=b"v", **fields)


@pytest.mark.parametrize(
    ("delivered", "stored", "idx", "suffix"),
    [
        (b"/q/jobs/0000000000000007/job-7", b"/q/jobs/0000000000000007/job-7", 7, b"job-7"),
        (  # handed over by a member that does not dispatch the queue
            f"/q/jobs/c/{UUID}/0000000000000007/job-7".encode(),
            b"/q/jobs/0000000000000007/job-7",
            7,
            b"job-7",
        ),
        (
            f"/queue/jobs/consumer/{UUID}/0000000000000002/x".encode(),
            b"/queue/jobs/0000000000000002/x",
            2,
            b"x",
        ),
    ],
)
def test_a_delivery_names_its_stored_message(
    delivered: bytes, stored: bytes, idx: int, suffix: bytes
) -> None:
    conn = Connection("127.0.0.1:1")
    m = message_from_event(
        "jobs", kv(delivered, create_revision=5, mod_revision=9, version=3, lease=11), conn, "e"
    )
    assert (m.key, m.message_key, m.idx, m.producer_key) == (delivered, stored, idx, suffix)
    assert (m.create_revision, m.mod_revision, m.delivery_count, m.lease) == (5, 9, 3, 11)
    # the exactly-once guard compares the stored key, which a handed-over key is not
    assert m.compare().key == stored and m.compare().create_revision == 5
    assert m.compare().target == rpc_pb2.Compare.CREATE
    assert m.ack_op().request_delete_range.key == delivered


@pytest.mark.parametrize(
    "key",
    [
        b"/q/jobs/0000000000000007/job-7",
        b"/q/jobs/7/job-7",  # not padded: the stored key is
        f"/q/jobs/c/{UUID}/0000000000000007/job-7".encode(),
        f"/queue/jobs/consumer/{UUID}/0000000000000002/x".encode(),
        b"/queue/jobs/0000000000000002/x",
        b"/q/jobs/consumer/u/0000000000000002/x",  # the other spelling's word
        b"/queue/jobs/c/u/0000000000000002/x",
        b"/q/jobs/c//0000000000000002/x",
        b"/q/jobs/c/u/02x/x",
        b"/q/jobs/c/u/0000000000000002/",
        b"/q//0000000000000002/x",
        b"/q/jobs/0000000000000002/",
        b"/q/jobs/0000000000000002/x/y",
        b"/q/jobs/p/x",
        b"/q/jobs/c/u",
        b"/q/jobs/config",
        b"/q/jobs",
        b"/q/",
        b"/other/jobs/0000000000000002/x",
    ],
)
def test_the_client_reads_message_keys_as_the_server_does(key: bytes) -> None:
    """The client spells its own key shapes (it imports nothing of the server):
    they must answer as the server's grammar does."""
    parsed = grammar.parse(key)
    if parsed is None or parsed.kind not in ("message", "delivery"):
        assert stored_message(key) is None
    else:
        stored = grammar.message_key(parsed.spelling, parsed.name, parsed.idx, parsed.key)
        assert stored_message(key) == (stored, parsed.idx, parsed.key)


def test_endpoints() -> None:
    assert parse_endpoints("http://127.0.0.1:2379, 127.0.0.1:22379/") == [
        "127.0.0.1:2379",
        "127.0.0.1:22379",
    ]
    assert parse_endpoints(["a:1", "b:2"]) == ["a:1", "b:2"]
    with pytest.raises(ValueError):
        parse_endpoints(" , ")


def test_the_redrive_txn_has_the_documented_shape() -> None:
    dead = kv(b"/q/jobs.dead/0000000000000004/job-7", create_revision=42, lease=9)
    txn = redrive_request("jobs", dead)
    (guard,) = txn.compare
    assert (guard.key, guard.target, guard.result, guard.create_revision) == (
        dead.key,
        rpc_pb2.Compare.CREATE,
        rpc_pb2.Compare.EQUAL,
        42,
    )
    delete, put = txn.success
    assert delete.request_delete_range.key == dead.key
    assert (put.request_put.key, put.request_put.value, put.request_put.lease) == (
        b"/q/jobs/p/job-7",
        b"v",
        9,
    )
    assert not txn.failure
    assert dead_letter_name("jobs", {}) == "jobs.dead"
    assert dead_letter_name("jobs", {"dead_letter": "parked"}) == "parked"


class Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


@pytest.mark.parametrize(
    ("code", "transient"),
    [
        (grpc.StatusCode.UNAVAILABLE, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, True),
        (grpc.StatusCode.INTERNAL, True),
        (grpc.StatusCode.INVALID_ARGUMENT, False),
        (grpc.StatusCode.NOT_FOUND, False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False),
    ],
)
def test_seed_000_rule_along_the_cause_chain(code: grpc.StatusCode, transient: bool) -> None:
    assert is_transient(Status(code)) is transient
    try:
        try:
            raise Status(code)
        except Status as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert is_transient(outer) is transient
    # the first gRPC status decides, even with a timeout further down
    first = Status(grpc.StatusCode.INVALID_ARGUMENT)
    first.__cause__ = TimeoutError()
    assert not is_transient(first)


@pytest.mark.parametrize("bad", ["", "a/b"])
def test_keys_are_one_segment(bad: str) -> None:
    with pytest.raises(ValueError):
        produce_op("jobs", bad, b"v")
    with pytest.raises(ValueError):
        produce_op(bad, "k", b"v")
    with pytest.raises(ValueError):
        consumer_key(bad, UUID)


def test_a_consumer_id_is_a_uuid() -> None:
    with pytest.raises(ValueError, match="UUID"):
        Consumer(Connection("127.0.0.1:1"), "jobs", consumer_id="worker-1")
    assert Consumer(Connection("127.0.0.1:1"), "jobs", consumer_id=UUID).key == (
        f"/q/jobs/c/{UUID}".encode()
    )
