"""Regression tests for the bugs the fuzzers found, one test each, against a real
server process (the module's `server` and `channel` fixtures)."""

from __future__ import annotations

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]


def test_alarm_of_an_unknown_type_does_not_break_status(channel: grpc.Channel) -> None:
    """AlarmType is an open enum: etcd stores an alarm of any type a client
    activates and Status lists it by number (Go's String()). Status used to fail
    with UNKNOWN "Enum AlarmType has no name defined for value 88" for good."""
    maintenance = rpc_pb2_grpc.MaintenanceStub(channel)
    activate = rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.ACTIVATE, memberID=7, alarm=88)
    resp = maintenance.Alarm(activate, timeout=5)
    assert [(a.memberID, a.alarm) for a in resp.alarms] == [(7, 88)]
    try:
        status = maintenance.Status(rpc_pb2.StatusRequest(), timeout=5)
        assert "memberID:7 alarm:88 " in status.errors
    finally:
        deactivate = rpc_pb2.AlarmRequest(
            action=rpc_pb2.AlarmRequest.DEACTIVATE, memberID=7, alarm=88
        )
        maintenance.Alarm(deactivate, timeout=5)
    assert not maintenance.Status(rpc_pb2.StatusRequest(), timeout=5).errors
