"""Unit tests of the replicated CQS state (queue_server/cqs/state.py) as the state
machine applies it: config keys, publications, direct enqueues, the CqsDequeue /
CqsSettle / CqsEnqueue log commands, determinism, snapshots and the etcd range
view. Everything goes through `StateMachine.apply` with `internal_pb2.Command`
messages, the way the log feeds it; no network.

Every dequeue gets a token base of its own, as the real proposers mint one per
proposal: tokens are the base followed by the record's seq in hex.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from google.protobuf.message import Message

from etcdserverpb import cqs_pb2, internal_pb2, rpc_pb2
from queue_server.apply import StateMachine
from queue_server.errors import EtcdError
from queue_server.keyspace import grammar as keys
from queue_server.proposals import ApplyResult
from queue_server.storage.snapshot import SnapshotStore

pytestmark = pytest.mark.unit

Command = internal_pb2.Command
M = TypeVar("M", bound=Message)

DTO = "storeesl.v1"
PUBLISH = f"/q/dto:{DTO}/p/k1"
STORE_A = "t/farmersmarket/s/oslo-main"
STORE_B = "t/farmersmarket/s/bergen-west"
NOW = 1_000_000  # ms
VIS = 60_000  # ms


def sla(second: int) -> str:
    return f"2026-01-01T10:00:{second:02d}Z"


def sla_us(second: int) -> int:
    return int(datetime(2026, 1, 1, 10, 0, second, tzinfo=UTC).timestamp()) * 1_000_000


def micros(n: Any) -> int:
    """A notification's sla_timestamp in Unix microseconds."""
    return int(n.sla_timestamp.seconds) * 1_000_000 + int(n.sla_timestamp.nanos) // 1000


def config(*subs: tuple[str, str] | str, depth: int = 4, **extra: Any) -> bytes:
    subscriptions = [
        {"dto_type": s} if isinstance(s, str) else {"dto_type": s[0], "alias_name": s[1]}
        for s in subs
    ]
    return json.dumps({"cqs": {"subscriptions": subscriptions, "depth": depth, **extra}}).encode()


def note(dto_id: str, second: int, **fields: str) -> bytes:
    return json.dumps({"dto_id": dto_id, "sla_timestamp": sla(second), **fields}).encode()


# -- commands -------------------------------------------------------------------


def put(key: str, value: bytes) -> internal_pb2.Command:
    return Command(put=rpc_pb2.PutRequest(key=key.encode(), value=value))


def delete(key: str) -> internal_pb2.Command:
    return Command(delete_range=rpc_pb2.DeleteRangeRequest(key=key.encode()))


def dequeue(
    queue: str,
    base: str,
    *,
    max: int = 10,
    depth: int = 0,
    now: int = NOW,
    until: int = NOW + VIS,
) -> internal_pb2.Command:
    c = Command()
    d = c.cqs_dequeue
    d.queue, d.max, d.depth, d.now_ms, d.visible_until_ms, d.token_base = (
        queue,
        max,
        depth,
        now,
        until,
        base,
    )
    return c


def settle(
    queue: str, tokens: list[str], *, now: int = NOW, release: bool = False
) -> internal_pb2.Command:
    c = Command()
    c.cqs_settle.queue = queue
    c.cqs_settle.tokens.extend(tokens)
    c.cqs_settle.now_ms = now
    c.cqs_settle.release = release
    return c


def item(dto_type: str = DTO, dto_id: str = "", parent_id: str = "", alias: str = "") -> Any:
    i = cqs_pb2.SplitItem(dto_type=dto_type, alias_name=alias)
    if dto_id:
        i.dto_id = dto_id
    if parent_id:
        i.parent_id = parent_id
    return i


def enqueue(
    queue: str,
    original: str,
    items: list[Any],
    *,
    now: int = NOW,
    until: int = 0,
    commit: bool = False,
) -> internal_pb2.Command:
    c = Command()
    e = c.cqs_enqueue
    e.queue, e.original, e.now_ms, e.visible_until_ms, e.commit = (
        queue,
        original,
        now,
        until,
        commit,
    )
    e.items.extend(items)
    return c


class Machine:
    """A StateMachine fed commands at consecutive log indexes."""

    def __init__(self, sm: StateMachine | None = None) -> None:
        self.sm = sm if sm is not None else StateMachine()
        self.index = self.sm.applied_index

    def apply(self, command: internal_pb2.Command) -> ApplyResult:
        self.index += 1
        return self.sm.apply(self.index, command)[0]

    def ok(self, command: internal_pb2.Command, kind: type[M]) -> M:
        result = self.apply(command)
        assert not isinstance(result, EtcdError), f"{command} failed: {result}"
        assert isinstance(result, kind), result
        return result

    def fails(self, command: internal_pb2.Command, code: str) -> EtcdError:
        result = self.apply(command)
        assert isinstance(result, EtcdError), f"{command} succeeded: {result}"
        assert result.code == code, (result.code, result.text)
        return result

    # shorthands
    def put(self, key: str, value: bytes) -> rpc_pb2.PutResponse:
        return self.ok(put(key, value), rpc_pb2.PutResponse)

    def dequeue(self, queue: str, base: str, **kw: int) -> internal_pb2.CqsDequeueResponse:
        return self.ok(dequeue(queue, base, **kw), internal_pb2.CqsDequeueResponse)

    def settle(
        self, queue: str, tokens: list[str], *, now: int = NOW, release: bool = False
    ) -> int:
        resp = self.ok(
            settle(queue, tokens, now=now, release=release), internal_pb2.CqsSettleResponse
        )
        return resp.settled

    def enqueue(self, *args: Any, **kw: Any) -> internal_pb2.CqsEnqueueResponse:
        return self.ok(enqueue(*args, **kw), internal_pb2.CqsEnqueueResponse)

    def view(self, queue: str, **kw: Any) -> rpc_pb2.RangeResponse:
        return self.sm.read_range(
            rpc_pb2.RangeRequest(
                key=f"/q/{queue}/".encode(), range_end=f"/q/{queue}0".encode(), **kw
            )
        )

    def keys(self, queue: str) -> list[str]:
        return [kv.key.decode() for kv in self.view(queue).kvs]

    def state(self) -> dict[str, Any]:
        """export_state without the log position (which every command moves)."""
        s = self.sm.export_state()
        s.pop("applied_index")
        return s


def ids(resp: internal_pb2.CqsDequeueResponse) -> list[str]:
    return [n.dto_id or n.parent_id for n in resp.notifications]


def tokens(resp: internal_pb2.CqsDequeueResponse) -> list[str]:
    return [n.ack_token for n in resp.notifications]


@pytest.fixture
def m() -> Machine:
    """A machine with one CQS queue `r` subscribed to storeesl.v1."""
    machine = Machine()
    machine.put("/q/r/config", config(DTO))
    return machine


# -- configuration ----------------------------------------------------------------


def test_config_put_creates_a_queue_and_only_a_cqs_config_does() -> None:
    m = Machine()
    m.fails(dequeue("r", "a-"), "NOT_FOUND")
    m.put("/q/r/config", config(DTO, depth=3))
    m.put("/q/plain/config", json.dumps({"max_depth": 5}).encode())
    assert m.dequeue("r", "b-").notifications == []  # known, empty
    m.fails(dequeue("plain", "c-"), "NOT_FOUND")  # an etcd-key queue, not CQS
    (q,) = m.state()["cqs"]
    assert (q["name"], q["subscriptions"], q["tree"]["depth"]) == ("r", [(DTO, "")], 3)


@pytest.mark.parametrize(
    "bad",
    [
        {"cqs": {"depth": 99}},
        {"cqs": {"subscriptions": [{"alias_name": "x"}]}},
        {"cqs": {"subscriptions": [{"dto_type": DTO}], "colour": "red"}},
        {"cqs": []},
    ],
)
def test_invalid_cqs_config_is_refused_and_creates_nothing(bad: dict[str, Any]) -> None:
    m = Machine()
    before = m.sm.store.revision
    m.fails(put("/q/r/config", json.dumps(bad).encode()), "INVALID_ARGUMENT")
    assert m.sm.store.revision == before
    assert m.sm.store.get(b"/q/r/config") is None
    m.fails(dequeue("r", "a-"), "NOT_FOUND")


def test_deleting_the_config_key_deletes_the_queue(m: Machine) -> None:
    m.put(PUBLISH, note(f"{STORE_A}/esls/1", 1))
    m.dequeue("r", "a-", max=1)
    m.put(PUBLISH, note(f"{STORE_A}/esls/2", 2))
    assert len(m.keys("r")) == 3  # in flight, pending, config
    m.ok(delete("/q/r/config"), rpc_pb2.DeleteRangeResponse)
    m.fails(dequeue("r", "b-"), "NOT_FOUND")
    m.fails(settle("r", ["a-1"]), "NOT_FOUND")
    assert m.keys("r") == []  # neither the config nor the notifications
    assert m.state()["cqs"] == []
    # a publication now reaches nobody, and a new queue of that name starts empty
    m.put(PUBLISH, note(f"{STORE_A}/esls/3", 3))
    m.put("/q/r/config", config(DTO))
    assert m.dequeue("r", "c-").notifications == []


def test_removing_the_cqs_object_from_the_config_deletes_the_queue(m: Machine) -> None:
    m.put(PUBLISH, note(f"{STORE_A}/esls/1", 1))
    m.put("/q/r/config", json.dumps({"max_depth": 10}).encode())
    m.fails(dequeue("r", "a-"), "NOT_FOUND")
    assert m.state()["cqs"] == []


def test_depth_is_fixed_at_creation(m: Machine) -> None:
    m2 = Machine()
    m2.put("/q/r/config", config(DTO, depth=2))
    m2.put("/q/r/config", config(DTO, "other.v1", depth=4))  # new subscriptions, same depth
    (q,) = m2.state()["cqs"]
    assert q["tree"]["depth"] == 2
    assert q["subscriptions"] == [(DTO, ""), ("other.v1", "")]
    # depth 2 groups by "t/farmersmarket": both stores come together
    m2.put(PUBLISH, note(f"{STORE_A}/esls/1", 1))
    m2.put(PUBLISH, note(f"{STORE_B}/esls/2", 2))
    m2.put("/q/dto:other.v1/p/x", note(f"{STORE_B}/esls/3", 3))
    assert ids(m2.dequeue("r", "a-")) == [
        f"{STORE_A}/esls/1",
        f"{STORE_B}/esls/2",
        f"{STORE_B}/esls/3",
    ]
    # while a queue of depth 4 groups by store
    m.put(PUBLISH, note(f"{STORE_A}/esls/1", 1))
    m.put(PUBLISH, note(f"{STORE_B}/esls/2", 2))
    m.put(PUBLISH, note(f"{STORE_A}/esls/3", 3))
    assert ids(m.dequeue("r", "a-")) == [f"{STORE_A}/esls/1", f"{STORE_A}/esls/3"]


# -- publications -----------------------------------------------------------------


def test_json_publication_is_queued_and_writes_no_key(m: Machine) -> None:
    revision = m.sm.store.revision
    resp = m.put(PUBLISH, note(f"{STORE_A}/esls/1", 1, tracking_id="trk-1"))
    assert resp.header.revision == revision  # nothing written
    assert m.sm.store.get(PUBLISH.encode()) is None
    assert m.sm.store.range(b"/q/dto:", b"/q/dto;").count == 0
    got = m.dequeue("r", "a-")
    (n,) = got.notifications
    assert got.seq == [1]
    assert n.ack_token == "a-1"
    assert (n.dto_type, n.dto_id, n.alias_name, n.tracking_id) == (
        DTO,
        f"{STORE_A}/esls/1",
        "",
        "trk-1",
    )
    assert n.WhichOneof("urn") == "dto_id"
    assert micros(n) == sla_us(1)


def test_json_publication_may_name_the_keys_dto_type_and_keeps_sub_second_sla(
    m: Machine,
) -> None:
    value = json.dumps(
        {"dto_type": DTO, "dto_id": "x/1", "sla_timestamp": "2026-01-01T10:00:01.250Z"}
    ).encode()
    m.put(PUBLISH, value)
    (n,) = m.dequeue("r", "a-").notifications
    assert micros(n) == sla_us(1) + 250_000


def test_serialized_notification_is_a_publication(m: Machine) -> None:
    n = cqs_pb2.DtoChangeNotification(dto_id=f"{STORE_A}/esls/9", tracking_id="trk")
    n.sla_timestamp.FromJsonString(sla(5))
    m.put(PUBLISH, n.SerializeToString())
    n.dto_type = DTO  # naming the key's type is allowed too
    n.dto_id = f"{STORE_A}/esls/8"
    n.sla_timestamp.FromJsonString(sla(4))
    m.put(PUBLISH, n.SerializeToString())
    got = m.dequeue("r", "a-")
    assert ids(got) == [f"{STORE_A}/esls/8", f"{STORE_A}/esls/9"]  # SLA order
    assert [x.tracking_id for x in got.notifications] == ["trk", "trk"]
    assert {x.dto_type for x in got.notifications} == {DTO}


def _serialized(**fields: Any) -> bytes:
    n = cqs_pb2.DtoChangeNotification(**fields)
    n.sla_timestamp.FromJsonString(sla(1))
    return n.SerializeToString()


def _no_sla() -> bytes:
    return cqs_pb2.DtoChangeNotification(dto_id="x/1").SerializeToString()


INVALID_PUBLICATIONS: dict[str, bytes] = {
    "malformed JSON": b'{"dto_id": "x/1", ',
    "JSON not an object": b'["x/1"]',
    "missing sla": json.dumps({"dto_id": "x/1"}).encode(),
    "missing dto_id": json.dumps({"sla_timestamp": sla(1)}).encode(),
    "empty dto_id": json.dumps({"dto_id": "", "sla_timestamp": sla(1)}).encode(),
    "parent_id": json.dumps({"parent_id": "x", "sla_timestamp": sla(1)}).encode(),
    "unknown field": note("x/1", 1, colour="red"),
    "ack_token is not publishable": note("x/1", 1, ack_token="mine"),
    "wrong dto_type": note("x/1", 1, dto_type="other.v1"),
    "bad timestamp": json.dumps({"dto_id": "x/1", "sla_timestamp": "yesterday"}).encode(),
    "not a notification": b"\xff\xff\xff",
    "serialized, missing sla": _no_sla(),
    "serialized parent_id": _serialized(parent_id="x"),
    "serialized wrong dto_type": _serialized(dto_id="x/1", dto_type="other.v1"),
    "empty value": b"",
}


@pytest.mark.parametrize("value", INVALID_PUBLICATIONS.values(), ids=INVALID_PUBLICATIONS.keys())
def test_invalid_publication_is_refused_and_changes_nothing(m: Machine, value: bytes) -> None:
    m.put(PUBLISH, note(f"{STORE_A}/esls/1", 1))
    revision, state = m.sm.store.revision, m.state()
    err = m.fails(put(PUBLISH, value), "INVALID_ARGUMENT")
    assert err.text.startswith("cqs: invalid change notification")
    assert m.sm.store.revision == revision
    assert m.state() == state
    assert ids(m.dequeue("r", "a-")) == [f"{STORE_A}/esls/1"]


def test_invalid_publication_in_a_txn_fails_the_whole_txn(m: Machine) -> None:
    revision, state = m.sm.store.revision, m.state()
    txn = rpc_pb2.TxnRequest(
        success=[
            rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"plain", value=b"1")),
            rpc_pb2.RequestOp(
                request_put=rpc_pb2.PutRequest(key=PUBLISH.encode(), value=note("x/1", 1))
            ),
            rpc_pb2.RequestOp(
                request_put=rpc_pb2.PutRequest(key=PUBLISH.encode(), value=b'{"dto_id": 1')
            ),
        ]
    )
    m.fails(Command(txn=txn), "INVALID_ARGUMENT")
    assert m.sm.store.revision == revision and m.sm.store.get(b"plain") is None
    assert m.state() == state


def test_publications_of_the_same_dto_merge_while_pending(m: Machine) -> None:
    m.put(PUBLISH, note("x/1", 7, tracking_id="late"))
    m.put(PUBLISH, note("x/1", 3, tracking_id="early"))
    m.put(PUBLISH, note("x/1", 9, tracking_id="later"))
    got = m.dequeue("r", "a-")
    assert ids(got) == ["x/1"] and got.notifications[0].tracking_id == "early"
    assert micros(got.notifications[0]) == sla_us(3)


# -- fan-out and aliases ------------------------------------------------------------


def test_publication_fans_out_to_every_subscribed_queue() -> None:
    m = Machine()
    m.put("/q/a/config", config(DTO))
    m.put("/q/b/config", config("other.v1", DTO))
    m.put("/q/c/config", config("other.v1"))
    m.put(PUBLISH, note("x/1", 1))
    m.put("/q/dto:other.v1/p/k", note("y/1", 2))
    m.put("/q/dto:nobody.v1/p/k", note("z/1", 3))  # no subscriber: accepted, dropped
    assert ids(m.dequeue("a", "a-")) == ["x/1"]
    got = m.dequeue("b", "b-", depth=-1)
    assert ids(got) == ["x/1", "y/1"]
    assert [n.dto_type for n in got.notifications] == [DTO, "other.v1"]
    assert ids(m.dequeue("c", "c-")) == ["y/1"]
    # each queue holds its own copy
    assert m.settle("a", ["a-1"]) == 1
    assert m.settle("b", ["b-1", "b-2"]) == 2


def test_subscriptions_follow_a_reconfiguration(m: Machine) -> None:
    m.put(PUBLISH, note("x/1", 1))
    m.put("/q/r/config", config("other.v1"))
    m.put(PUBLISH, note("x/2", 2))  # no longer subscribed
    m.put("/q/dto:other.v1/p/k", note("y/1", 3))
    assert ids(m.dequeue("r", "a-", depth=-1)) == ["x/1", "y/1"]


def test_alias_scoped_subscriptions() -> None:
    m = Machine()
    m.put("/q/plain/config", config(DTO))
    m.put("/q/scoped/config", config((DTO, "by_store")))
    m.put("/q/both/config", config(DTO, (DTO, "by_store")))
    m.put(PUBLISH, note("x/1", 1))
    m.put(PUBLISH, note("x/2", 2, alias_name="by_store"))
    m.put(PUBLISH, note("x/3", 3, alias_name="by_region"))  # nobody: dropped
    assert ids(m.dequeue("plain", "a-", depth=-1)) == ["x/1"]
    scoped = m.dequeue("scoped", "b-", depth=-1)
    assert ids(scoped) == ["x/2"] and scoped.notifications[0].alias_name == "by_store"
    both = m.dequeue("both", "c-", depth=-1)
    assert ids(both) == ["x/1", "x/2"]
    assert [n.alias_name for n in both.notifications] == ["", "by_store"]


def test_same_dto_with_and_without_alias_are_two_notifications() -> None:
    m = Machine()
    m.put("/q/both/config", config(DTO, (DTO, "by_store")))
    m.put(PUBLISH, note("x/1", 1))
    m.put(PUBLISH, note("x/1", 1, alias_name="by_store"))
    assert len(m.dequeue("both", "a-", depth=-1).notifications) == 2


# -- direct enqueue -------------------------------------------------------------------


def test_direct_enqueue_reaches_that_queue_alone() -> None:
    m = Machine()
    m.put("/q/r/config", config(DTO))
    m.put("/q/s/config", config(DTO))
    revision = m.sm.store.revision
    m.put("/q/r/p/k", note("x/1", 1, dto_type=DTO))
    m.put("/q/r/p/k", note("y/1", 2, dto_type="unsubscribed.v1"))  # any type
    assert m.sm.store.revision == revision  # no message key written
    got = m.dequeue("r", "a-", depth=-1)
    assert ids(got) == ["x/1", "y/1"]
    assert [n.dto_type for n in got.notifications] == [DTO, "unsubscribed.v1"]
    assert m.dequeue("s", "b-").notifications == []


@pytest.mark.parametrize(
    "value",
    [note("x/1", 1), b'{"dto_type": "d"', _serialized(dto_id="x/1")],
    ids=["JSON without dto_type", "malformed", "serialized without dto_type"],
)
def test_direct_enqueue_must_name_its_dto_type(m: Machine, value: bytes) -> None:
    revision, state = m.sm.store.revision, m.state()
    m.fails(put("/q/r/p/k", value), "INVALID_ARGUMENT")
    assert (m.sm.store.revision, m.state()) == (revision, state)


def test_produce_on_a_queue_without_cqs_stays_an_etcd_key_queue(m: Machine) -> None:
    m.put("/q/plain/p/k", b"anything at all")
    assert m.sm.store.get(b"/q/plain/0000000000000001/k") is not None
    assert m.dequeue("r", "a-").notifications == []


# -- dequeue, settle, expiry ---------------------------------------------------------


def test_dequeue_takes_the_most_urgent_and_its_prefix_group(m: Machine) -> None:
    m.put(PUBLISH, note(f"{STORE_B}/esls/1", 2))
    m.put(PUBLISH, note(f"{STORE_A}/esls/2", 1))
    m.put(PUBLISH, note(f"{STORE_A}/esls/3", 5))
    got = m.dequeue("r", "a-")
    assert ids(got) == [f"{STORE_A}/esls/2", f"{STORE_A}/esls/3"]
    assert list(got.seq) == [2, 3] and tokens(got) == ["a-2", "a-3"]
    assert ids(m.dequeue("r", "b-", max=1)) == [f"{STORE_B}/esls/1"]
    assert m.dequeue("r", "c-").notifications == []


def test_unknown_queue_commands_are_not_found(m: Machine) -> None:
    m.fails(dequeue("nope", "a-"), "NOT_FOUND")
    m.fails(settle("nope", ["x"]), "NOT_FOUND")
    m.fails(enqueue("nope", "x", []), "NOT_FOUND")


def test_expiry_at_dequeue_makes_the_notification_visible_again(m: Machine) -> None:
    m.put(PUBLISH, note("x/1", 4, tracking_id="trk"))
    m.put(PUBLISH, note("x/2", 6))
    first = m.dequeue("r", "a-", max=1, now=NOW, until=NOW + 500)
    assert tokens(first) == ["a-1"]
    # still in flight just before its visibility ends
    assert ids(m.dequeue("r", "b-", now=NOW + 499, until=NOW + 10_000)) == ["x/2"]
    again = m.dequeue("r", "c-", now=NOW + 500, until=NOW + 10_000)
    (n,) = again.notifications
    assert (n.dto_id, n.ack_token, n.tracking_id) == ("x/1", "c-1", "trk")
    assert micros(n) == sla_us(4)  # the same SLA
    assert list(again.seq) == [1]  # and the same place
    # the old token is dead, the new one alive
    assert m.settle("r", ["a-1"], now=NOW + 600) == 0
    assert m.settle("r", ["c-1"], now=NOW + 600) == 1
    assert m.settle("r", ["c-1"], now=NOW + 600) == 0


def test_expiry_at_settle(m: Machine) -> None:
    m.put(PUBLISH, note("x/1", 4))
    m.dequeue("r", "a-", now=NOW, until=NOW + 500)
    assert m.settle("r", ["a-1"], now=NOW + 500) == 0  # too late: it expired first
    assert m.keys("r") == ["/q/r/0000000000000001/pending", "/q/r/config"]
    got = m.dequeue("r", "b-", now=NOW + 501)
    assert tokens(got) == ["b-1"]


def test_release_makes_in_flight_visible_again_now(m: Machine) -> None:
    m.put(PUBLISH, note("x/1", 1))
    m.put(PUBLISH, note("x/2", 2))
    m.put(PUBLISH, note("x/3", 3))
    assert tokens(m.dequeue("r", "a-", max=2, depth=-1)) == ["a-1", "a-2"]
    assert m.settle("r", ["a-2", "unknown"], release=True) == 1
    assert m.settle("r", ["a-2"], release=True) == 0  # released already
    assert m.settle("r", ["a-2"]) == 0  # its token is dead
    # x/2 is back, before x/3, with its SLA
    got = m.dequeue("r", "b-", depth=-1)
    assert ids(got) == ["x/2", "x/3"]
    assert micros(got.notifications[0]) == sla_us(2)
    assert m.settle("r", ["a-1", "b-2", "b-3"]) == 3


def test_in_flight_duplicate_gets_a_new_pending_copy(m: Machine) -> None:
    m.put(PUBLISH, note("x/1", 5))
    m.dequeue("r", "a-")
    m.put(PUBLISH, note("x/1", 8))  # changed again after the consumer read it
    got = m.dequeue("r", "b-")
    assert ids(got) == ["x/1"] and list(got.seq) == [2]
    assert m.settle("r", ["a-1", "b-2"]) == 2


# -- ReEnqueue -----------------------------------------------------------------------


def test_enqueue_inherits_sla_and_tracking_and_keeps_the_original(m: Machine) -> None:
    m.put(PUBLISH, note(STORE_A, 3, tracking_id="trk-7"))
    m.put(PUBLISH, note(f"{STORE_B}/esls/1", 9))
    (original,) = tokens(m.dequeue("r", "a-", max=1))
    resp = m.enqueue(
        "r",
        original,
        [
            item(dto_id=f"{STORE_A}/esls/1"),
            item(dto_type="esl.v1", parent_id=f"{STORE_A}/esls"),
            item(dto_id=f"{STORE_A}/esls/2", alias="by_store"),
        ],
    )
    assert resp.enqueued == 3
    got = m.dequeue("r", "b-")
    assert ids(got) == [f"{STORE_A}/esls/1", f"{STORE_A}/esls/2", f"{STORE_A}/esls"]
    assert {n.tracking_id for n in got.notifications} == {"trk-7"}
    assert {micros(n) for n in got.notifications} == {sla_us(3)}
    parent = got.notifications[2]
    assert (parent.WhichOneof("urn"), parent.dto_type) == ("parent_id", "esl.v1")
    assert got.notifications[1].alias_name == "by_store"
    assert m.settle("r", [original]) == 1  # without commit, still held


def test_enqueue_commit_acknowledges_the_original(m: Machine) -> None:
    m.put(PUBLISH, note(STORE_A, 3))
    (original,) = tokens(m.dequeue("r", "a-", until=NOW + 1000))
    assert m.enqueue("r", original, [item(dto_id=f"{STORE_A}/esls/1")], commit=True).enqueued == 1
    assert m.settle("r", [original]) == 0
    # it does not come back when its visibility would have ended
    assert ids(m.dequeue("r", "b-", now=NOW + 5000)) == [f"{STORE_A}/esls/1"]
    assert m.dequeue("r", "c-", now=NOW + 5000).notifications == []
    # a commit with no items acknowledges too
    m.put(PUBLISH, note("y/1", 1))
    (y,) = tokens(m.dequeue("r", "d-", now=NOW + 5000))
    assert m.enqueue("r", y, [], now=NOW + 5000, commit=True).enqueued == 0
    assert m.settle("r", [y], now=NOW + 5000) == 0


def test_enqueue_visible_until_extends_the_original(m: Machine) -> None:
    m.put(PUBLISH, note("x/1", 3))
    (original,) = tokens(m.dequeue("r", "a-", until=NOW + 1000))
    m.enqueue("r", original, [], now=NOW + 10, until=NOW + 5000)
    assert m.dequeue("r", "b-", now=NOW + 2000).notifications == []  # still held
    assert m.settle("r", [original], now=NOW + 4999) == 1


@pytest.mark.parametrize("how", ["unknown", "expired", "acknowledged", "released"])
def test_enqueue_for_a_dead_original_fails_precondition(m: Machine, how: str) -> None:
    m.put(PUBLISH, note("x/1", 3))
    (original,) = tokens(m.dequeue("r", "a-", until=NOW + 1000))
    now = NOW
    if how == "unknown":
        original = "a-99"
    elif how == "expired":
        now = NOW + 1000
    elif how == "acknowledged":
        assert m.settle("r", [original]) == 1
    else:
        assert m.settle("r", [original], release=True) == 1
    state = m.state()
    m.fails(
        enqueue("r", original, [item(dto_id="x/2")], now=now, commit=True), "FAILED_PRECONDITION"
    )
    if how != "expired":  # an expiry at `now` is the one change it may make
        assert m.state() == state
    visible = how in ("expired", "released")
    assert ids(m.dequeue("r", "b-", now=now)) == (["x/1"] if visible else [])


@pytest.mark.parametrize(
    "bad",
    [item(dto_type="", dto_id="x/9"), item(), item(dto_id="")],
    ids=["no dto_type", "no urn", "empty id"],
)
def test_an_invalid_item_fails_the_whole_enqueue(m: Machine, bad: Any) -> None:
    m.put(PUBLISH, note("x/1", 3))
    (original,) = tokens(m.dequeue("r", "a-", until=NOW + 1000))
    state = m.state()
    m.fails(
        enqueue(
            "r",
            original,
            [item(dto_id="x/2"), bad, item(dto_id="x/3")],
            until=NOW + 9000,
            commit=True,
        ),
        "INVALID_ARGUMENT",
    )
    assert m.state() == state
    assert m.dequeue("r", "b-").notifications == []  # no item was queued
    # the original is neither acknowledged nor extended
    assert ids(m.dequeue("r", "c-", now=NOW + 1000)) == ["x/1"]


# -- determinism and snapshots ---------------------------------------------------------


def scenario() -> list[internal_pb2.Command]:
    """A log exercising every CQS command, expiry and release included."""
    log = [
        put("/q/r/config", config(DTO, (DTO, "by_store"))),
        put("/q/s/config", config(DTO, depth=2)),
    ]
    for i, (store, second) in enumerate(
        [(STORE_A, 30), (STORE_B, 10), (STORE_A, 20), (STORE_B, 40), (STORE_A, 5)]
    ):
        log.append(put(f"/q/dto:{DTO}/p/k{i}", note(f"{store}/esls/{i}", second)))
    log += [
        put(PUBLISH, note(f"{STORE_B}/esls/9", 15, alias_name="by_store", tracking_id="t9")),
        put(PUBLISH, b"{broken"),
        dequeue("r", "d1-", max=2, until=NOW + 1000),
        dequeue("s", "d2-", max=3, until=NOW + 500),
        settle("r", ["d1-5"]),
        dequeue("r", "d3-", max=1, depth=-1, until=NOW + 2000),
        enqueue("r", "d3-2", [item(dto_id=f"{STORE_B}/esls/2/a"), item(parent_id=STORE_B)]),
        dequeue("s", "d4-", now=NOW + 600, until=NOW + 5000),
        settle("s", ["d4-5", "d2-5"], now=NOW + 600, release=True),
        dequeue("r", "d5-", now=NOW + 1500, until=NOW + 9000),
        enqueue("r", "d3-2", [], now=NOW + 1500, until=NOW + 20_000, commit=True),
        enqueue("r", "d1-3", [item(dto_id="late")], now=NOW + 1500),
        put(f"/q/dto:{DTO}/p/k", note(f"{STORE_A}/esls/0", 1)),
        dequeue("r", "d6-", now=NOW + 3000),
        dequeue("s", "d7-", now=NOW + 3000),
    ]
    return log


def describe(result: ApplyResult) -> tuple[object, ...]:
    if isinstance(result, EtcdError):
        return (type(result).__name__, result.code, result.text)
    return (type(result).__name__, result.SerializeToString(deterministic=True))


def test_two_state_machines_fed_the_same_log_agree() -> None:
    a, b = Machine(), Machine()
    results_a = [describe(a.apply(c)) for c in scenario()]
    # the second one reads the log the way a restart replays it: from bytes
    results_b = [describe(b.apply(Command.FromString(c.SerializeToString()))) for c in scenario()]
    assert results_a == results_b
    assert a.sm.export_state() == b.sm.export_state()
    assert a.view("r") == b.view("r") and a.view("s") == b.view("s")
    # and the scenario did something: deliveries with tokens, and refusals
    delivered = [
        r
        for r in (a.apply(dequeue(q, "z-", now=NOW + 100_000)) for q in ("r", "s"))
        if isinstance(r, internal_pb2.CqsDequeueResponse)
    ]
    assert sum(len(r.notifications) for r in delivered) > 0
    assert any(r[0] == "InvalidNotification" for r in results_a)
    assert any(r[0] == "TokenNotHeld" for r in results_a)


def test_snapshot_round_trip_gives_the_same_results_after(tmp_path: Path) -> None:
    log = scenario()
    cut = len(log) - 6
    original = Machine()
    for c in log[:cut]:
        original.apply(c)
    state = original.sm.export_state()
    assert any(q["tree"]["in_flight"] for q in state["cqs"])  # a snapshot with deliveries
    assert any(q["tree"]["pending"] for q in state["cqs"])
    snaps = SnapshotStore(str(tmp_path), fsync=False)
    snaps.save(original.index, copy.deepcopy(state))
    loaded = snaps.load_latest()
    assert loaded is not None and loaded.index == original.index
    sm = StateMachine()
    sm.restore_state(loaded.state)
    restored = Machine(sm)
    assert restored.index == original.index
    assert restored.sm.export_state() == state
    assert restored.view("r") == original.view("r")
    assert restored.view("s") == original.view("s")
    for c in log[cut:]:
        assert describe(restored.apply(c)) == describe(original.apply(c))
    for q in ("r", "s"):  # drain what is left, past every visibility
        later = dequeue(q, "end-", max=100, depth=-1, now=NOW + 100_000)
        assert describe(restored.apply(later)) == describe(original.apply(later))
    assert restored.sm.export_state() == original.sm.export_state()


def test_restored_queue_keeps_publishing_and_token_liveness() -> None:
    m = Machine()
    m.put("/q/r/config", config(DTO))
    m.put(PUBLISH, note("x/1", 1))
    m.put(PUBLISH, note("x/2", 2))
    m.dequeue("r", "a-", max=1, depth=-1, until=NOW + 1000)
    sm = StateMachine()
    sm.restore_state(m.sm.export_state())
    r = Machine(sm)
    r.put(PUBLISH, note("x/0", 0))  # the subscription index was rebuilt
    got = r.dequeue("r", "b-", depth=-1, now=NOW + 10)
    assert ids(got) == ["x/0", "x/2"] and list(got.seq) == [3, 2]  # seq continues
    assert r.settle("r", ["a-1"], now=NOW + 10) == 1  # the restored token is alive
    sm2 = StateMachine()
    sm2.restore_state(m.sm.export_state())
    r2 = Machine(sm2)
    assert r2.settle("r", ["a-1"], now=NOW + 1000) == 0  # and expires on time
    assert ids(r2.dequeue("r", "c-", depth=-1, now=NOW + 1000)) == ["x/1", "x/2"]


# -- the etcd range view --------------------------------------------------------------


def test_range_view_lists_pending_and_in_flight_merged_with_real_keys(m: Machine) -> None:
    m.put("/q/r/config", config(DTO, depth=4))  # the config key is a real key
    m.put(PUBLISH, note(f"{STORE_A}/esls/1", 3, tracking_id="trk"))
    m.put(PUBLISH, note(f"{STORE_B}/esls/2", 1))
    m.put(PUBLISH, note(f"{STORE_A}/esls/3", 2))
    held = m.dequeue("r", "a-", max=1)  # STORE_B/esls/2, seq 2
    assert tokens(held) == ["a-2"]
    m.put("/q/r0-after", b"outside")  # sorts after the range end
    m.put("/q/r/", b"a real key inside")
    resp = m.view("r")
    revision = m.sm.store.revision
    assert [kv.key.decode() for kv in resp.kvs] == [
        "/q/r/",
        "/q/r/0000000000000001/pending",
        "/q/r/0000000000000002/a-2",
        "/q/r/0000000000000003/pending",
        "/q/r/config",
    ]
    assert resp.count == 5 and not resp.more
    pending, in_flight = json.loads(resp.kvs[1].value), json.loads(resp.kvs[2].value)
    assert pending == {
        "dto_type": DTO,
        "dto_id": f"{STORE_A}/esls/1",
        "sla_timestamp": sla(3),
        "tracking_id": "trk",
    }
    assert in_flight == {
        "ack_token": "a-2",
        "dto_type": DTO,
        "dto_id": f"{STORE_B}/esls/2",
        "sla_timestamp": sla(1),
    }
    for kv in resp.kvs[1:4]:  # they exist now: the current revision
        assert (kv.create_revision, kv.mod_revision, kv.version) == (revision, revision, 1)
    # the view follows settle
    assert m.settle("r", ["a-2"]) == 1
    assert m.keys("r") == [
        "/q/r/",
        "/q/r/0000000000000001/pending",
        "/q/r/0000000000000003/pending",
        "/q/r/config",
    ]


def test_range_view_count_limit_count_only_and_single_keys(m: Machine) -> None:
    for i in range(5):
        m.put(PUBLISH, note(f"x/{i}", 10 - i))
    m.dequeue("r", "a-", max=2, depth=-1)  # x/4 and x/3: seq 5 and 4
    expected = [
        "/q/r/0000000000000001/pending",
        "/q/r/0000000000000002/pending",
        "/q/r/0000000000000003/pending",
        "/q/r/0000000000000004/a-4",
        "/q/r/0000000000000005/a-5",
        "/q/r/config",
    ]
    assert m.keys("r") == expected
    limited = m.view("r", limit=3)
    assert [kv.key.decode() for kv in limited.kvs] == expected[:3]
    assert limited.count == 6 and limited.more
    assert m.view("r", limit=6).more is False
    counted = m.view("r", count_only=True)
    assert counted.count == 6 and list(counted.kvs) == []
    keys_only = m.view("r", keys_only=True)
    assert [kv.key.decode() for kv in keys_only.kvs] == expected
    assert all(kv.value == b"" for kv in keys_only.kvs)
    descending = m.view("r", sort_order=rpc_pb2.RangeRequest.DESCEND)
    assert [kv.key.decode() for kv in descending.kvs] == expected[::-1]
    # a range inside the queue's keys, and single keys
    part = m.sm.read_range(
        rpc_pb2.RangeRequest(key=expected[1].encode(), range_end=expected[4].encode())
    )
    assert [kv.key.decode() for kv in part.kvs] == expected[1:4] and part.count == 3
    first = m.sm.read_range(
        rpc_pb2.RangeRequest(key=expected[1].encode(), range_end=expected[4].encode(), limit=1)
    )
    assert [kv.key.decode() for kv in first.kvs] == [expected[1]]
    assert first.count == 3 and first.more
    one = m.sm.read_range(rpc_pb2.RangeRequest(key=expected[3].encode()))
    assert [kv.key.decode() for kv in one.kvs] == [expected[3]] and one.count == 1
    assert json.loads(one.kvs[0].value)["ack_token"] == "a-4"
    for missing in ("/q/r/0000000000000004/pending", "/q/r/0000000000000004/a-9"):
        assert m.sm.read_range(rpc_pb2.RangeRequest(key=missing.encode())).count == 0
    # a queue created later has only its config; publications made before it are not its
    m.put("/q/s/config", config(DTO))
    assert m.keys("s") == ["/q/s/config"]


def test_counting_the_message_keys_counts_without_building_them(
    m: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/q/{name}/0` to `/q/{name}/:` holds every message key of the view (the
    range queue-bench and operators count with): counted from the queue's sizes,
    not by building a key per notification (5,000,000 of them took 15 s)."""
    for i in range(4):
        m.put(PUBLISH, note(f"x/{i}", 10 - i))
    m.dequeue("r", "a-", max=1, depth=-1)
    built: list[int] = []
    real = keys.message_key

    def counting(spelling: bytes, name: bytes, idx: int, key: bytes) -> bytes:
        built.append(1)
        return real(spelling, name, idx, key)

    monkeypatch.setattr(keys, "message_key", counting)
    counted = m.sm.read_range(
        rpc_pb2.RangeRequest(key=b"/q/r/0", range_end=b"/q/r/:", count_only=True)
    )
    assert counted.count == 4 and not counted.kvs
    assert built == []
    # a range that starts inside the message keys still walks them, and is right
    part = m.sm.read_range(
        rpc_pb2.RangeRequest(key=b"/q/r/0000000000000002", range_end=b"/q/r/:", count_only=True)
    )
    assert part.count == 3 and built


@pytest.mark.parametrize(
    "key", [b"\x00", b"/a", b"/q/r/"], ids=["all keys", "from /a", "from the queue"]
)
def test_range_with_no_upper_bound_includes_the_view(m: Machine, key: bytes) -> None:
    """range_end "\\0" (etcdctl get --from-key, or --prefix of ""): every key from
    `key` on, CQS notifications included."""
    m.put(PUBLISH, note("x/1", 1))
    m.put(PUBLISH, note("x/2", 2))
    m.dequeue("r", "a-", max=1, depth=-1)
    m.put("/z", b"after the queues")
    resp = m.sm.read_range(rpc_pb2.RangeRequest(key=key, range_end=b"\x00"))
    assert [kv.key.decode() for kv in resp.kvs] == [
        "/q/r/0000000000000001/a-1",
        "/q/r/0000000000000002/pending",
        "/q/r/config",
        "/z",
    ]
    assert resp.count == 4
