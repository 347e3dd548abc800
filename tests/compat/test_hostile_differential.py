"""Bad input side by side with real etcd: undecodable request bytes and an alarm
of a type neither server declares (found by tests/fuzz/) answer alike.

The text after grpc-go's prefix is Go's protobuf error ("unexpected EOF"), which
ours cannot reproduce from Python's parser; codes and prefixes must match."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import EtcdProcess, ServerProcess

pytestmark = pytest.mark.compat

BAD_RANGE = b"\x0a\x02\xff\xfe\xff"  # a key whose length runs past the end


def _unary(endpoint: str) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(endpoint) as ch:
        call = ch.unary_unary("/etcdserverpb.KV/Range", bytes, bytes)  # identity
        with pytest.raises(grpc.RpcError) as err:
            call(BAD_RANGE, timeout=5)
    return err.value.code(), err.value.details() or ""


def _stream(endpoint: str) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(endpoint) as ch:
        call = ch.stream_stream("/etcdserverpb.Lease/LeaseKeepAlive", bytes, bytes)
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([b"\x08\x01", b"\xff"]), timeout=5))
    return err.value.code(), err.value.details() or ""


@pytest.mark.parametrize(
    ("ask", "prefix"),
    [
        (_unary, "grpc: error unmarshalling request: "),
        (_stream, "grpc: failed to unmarshal the received message "),
    ],
)
def test_undecodable_requests_answer_as_etcd(
    etcd: EtcdProcess, server: ServerProcess, ask: Any, prefix: str
) -> None:
    theirs, ours = ask(etcd.endpoint), ask(server.endpoint)
    assert theirs[0] == ours[0] == grpc.StatusCode.INTERNAL
    assert theirs[1].startswith(prefix), theirs
    assert ours[1].startswith(prefix), ours


def test_alarm_of_an_undeclared_type_is_listed_as_etcd_lists_it(
    etcd: EtcdProcess, server: ServerProcess
) -> None:
    unknown: Any = 88
    listed = []
    for endpoint in (etcd.endpoint, server.endpoint):
        with grpc.insecure_channel(endpoint) as ch:
            m = rpc_pb2_grpc.MaintenanceStub(ch)
            alarm = rpc_pb2.AlarmRequest(
                action=rpc_pb2.AlarmRequest.ACTIVATE, memberID=7, alarm=unknown
            )
            m.Alarm(alarm, timeout=5)
            listed.append(list(m.Status(rpc_pb2.StatusRequest(), timeout=5).errors))
            alarm.action = rpc_pb2.AlarmRequest.DEACTIVATE
            m.Alarm(alarm, timeout=5)
            assert not m.Status(rpc_pb2.StatusRequest(), timeout=5).errors
    assert listed[0] == listed[1] == ["memberID:7 alarm:88 "]
