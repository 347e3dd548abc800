"""Regression tests for the bugs the fuzzers found, one test each, against a real
server process (the module's `server` and `channel` fixtures)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc

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
    assert details.startswith("grpc: failed to unmarshal the received message: ")
