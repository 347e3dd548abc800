"""Regression tests for the bugs the fuzzers found, one test each, against a real
server process (the module's `server` and `channel` fixtures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]


def test_alarm_of_an_unknown_type_does_not_break_status(channel: grpc.Channel) -> None:
    """AlarmType is an open enum: etcd stores an alarm of any type a client
    activates and Status lists it by number (Go's String()). Status used to fail
    with UNKNOWN "Enum AlarmType has no name defined for value 88" for good."""
    maintenance = rpc_pb2_grpc.MaintenanceStub(channel)
    unknown: Any = 88  # not a declared AlarmType: proto3 enums are open
    activate = rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.ACTIVATE, memberID=7, alarm=unknown)
    resp = maintenance.Alarm(activate, timeout=5)
    assert [(a.memberID, a.alarm) for a in resp.alarms] == [(7, 88)]
    try:
        status = maintenance.Status(rpc_pb2.StatusRequest(), timeout=5)
        assert "memberID:7 alarm:88 " in status.errors
    finally:
        deactivate = rpc_pb2.AlarmRequest(
            action=rpc_pb2.AlarmRequest.DEACTIVATE, memberID=7, alarm=unknown
        )
        maintenance.Alarm(deactivate, timeout=5)
    assert not maintenance.Status(rpc_pb2.StatusRequest(), timeout=5).errors


def test_undecodable_request_gets_internal_as_from_etcd(channel: grpc.Channel) -> None:
    """Bytes that do not parse used to get grpcio's UNKNOWN "Unexpected <class
    'DecodeError'>" and an ERROR traceback in the log per request; etcd (grpc-go)
    answers INTERNAL "grpc: error unmarshalling request: ...", and so do we."""
    call = channel.unary_unary(
        "/etcdserverpb.KV/Range", request_serializer=bytes, response_deserializer=bytes
    )
    with pytest.raises(grpc.RpcError) as err:
        call(b"\x0a\x02\xff\xfe\xff", timeout=5)  # a key field that runs past the end
    assert err.value.code() == grpc.StatusCode.INTERNAL
    details = err.value.details() or ""
    assert details.startswith("grpc: error unmarshalling request: ")
    stream = channel.stream_stream(
        "/etcdserverpb.Lease/LeaseKeepAlive", request_serializer=bytes, response_deserializer=bytes
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stream(iter([b"\x08\x01", b"\xff"]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    details = err.value.details() or ""
    assert details.startswith("grpc: failed to unmarshal the received message ")


@pytest.mark.parametrize(
    ("seconds", "nanos"), [(2**62, 0), (300_000_000_000, 0), (1, -5), (1, 10**9)]
)
def test_publication_with_an_sla_outside_timestamps_range_is_refused(
    channel: grpc.Channel, seconds: int, nanos: int
) -> None:
    """A protobuf-encoded publication whose sla_timestamp is outside
    google.protobuf.Timestamp's range used to be queued; then every Range over the
    queue failed with UNKNOWN (SerializeToJsonError: the view prints SLAs as RFC
    3339) and the queue's watch consumers stopped getting deliveries."""
    cqs = cqs_pb2_grpc.DtoChangeQueueServiceStub(channel)
    kv = rpc_pb2_grpc.KVStub(channel)
    cqs.CreateOrConfigureQueue(
        cqs_pb2.CreateOrConfigureQueueRequest(
            queue_name="slaq", subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type="slat")]
        ),
        timeout=5,
    )
    note = cqs_pb2.DtoChangeNotification(dto_type="slat", dto_id="t/a/s/b/1")
    note.sla_timestamp.seconds, note.sla_timestamp.nanos = seconds, nanos
    with pytest.raises(grpc.RpcError) as err:
        kv.Put(rpc_pb2.PutRequest(key=b"/q/dto:slat/p/k", value=note.SerializeToString()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid Timestamp" in (err.value.details() or "")
    shown = kv.Range(rpc_pb2.RangeRequest(key=b"/q/slaq/", range_end=b"/q/slaq0"), timeout=5)
    assert [kv.key for kv in shown.kvs] == [b"/q/slaq/config"]


@pytest.mark.parametrize(
    "config",
    [
        b'{"max_depth": Infinity}',
        b'{"prefetch": 1e400}',
        b'{"max_deliveries": -Infinity}',
        b'{"ack_deadline": NaN}',
        b'{"ack_deadline": 1e308}',
    ],
)
def test_queue_config_with_non_finite_or_huge_numbers_is_refused(
    channel: grpc.Channel, config: bytes
) -> None:
    """Python's json reads Infinity and NaN. `{"max_depth": Infinity}` used to
    raise OverflowError inside apply (UNKNOWN to the client), and replaying that
    log entry made every later restart fail; an ack_deadline of 1e308 made
    LeaseKeepAlive on the delivery lease answer a TTL no int64 holds."""
    kv = rpc_pb2_grpc.KVStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        kv.Put(rpc_pb2.PutRequest(key=b"/q/cfgq/config", value=config), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("etcdserver: queue config /q/cfgq/config: ")


def test_restart_after_a_refused_queue_config(tmp_path: Path) -> None:
    """The log entry of a refused config replays to the same refusal."""
    srv = ServerProcess(tmp_path / "cfg.etcd").start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            kv.Put(rpc_pb2.PutRequest(key=b"a", value=b"1"), timeout=5)
            with pytest.raises(grpc.RpcError):
                kv.Put(rpc_pb2.PutRequest(key=b"/q/x/config", value=b'{"max_depth": Infinity}'))
            revision = kv.Put(rpc_pb2.PutRequest(key=b"b", value=b"2"), timeout=5).header.revision
        assert srv.stop() == 0
        srv.start()
        with grpc.insecure_channel(srv.endpoint) as ch:
            got = rpc_pb2_grpc.KVStub(ch).Range(rpc_pb2.RangeRequest(key=b"b"), timeout=5)
            assert got.header.revision == revision and got.kvs[0].value == b"2"
    finally:
        srv.stop()


def test_unimplemented_methods_answer_without_a_logged_traceback(
    server: ServerProcess, channel: grpc.Channel
) -> None:
    """MoveLeader and Downgrade used to reach the generated servicer's
    NotImplementedError, which grpcio logs with a traceback on every call."""
    maintenance = rpc_pb2_grpc.MaintenanceStub(channel)
    for call, request in (
        (maintenance.MoveLeader, rpc_pb2.MoveLeaderRequest(targetID=1)),
        (maintenance.Downgrade, rpc_pb2.DowngradeRequest()),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "NotImplementedError" not in server.log_text()
