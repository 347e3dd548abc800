"""Differential fuzzing: the same fuzzed KV requests to real etcd and to ours.

Hypothesis draws requests for Range, Put, DeleteRange, Txn and Compact from their
descriptors (`tests/fuzz/strategies.py`); each goes to both servers, which start
empty and see the same sequence, so their revisions stay equal. The status code,
the exact details and the whole response (the header's ids and term aside) must
be the same.

Three things are taken out of the drawn requests, each for a reason:
- lease ids (set to 0): the servers mint different ids, so attached leases differ;
- keys under `/q/` (moved to `q/q/...`): the queue key spaces are ours alone;
- an undeclared `sort_target` (set to KEY): etcd 3.4.23, the reference here,
  panics on it with sort_order DESCEND (a nil sorter in mvcc's Range) and dies.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings

from etcdserverpb import rpc_pb2
from tests.fuzz import harness
from tests.fuzz.strategies import message_strategy
from tests.support.processes import EtcdProcess, ServerProcess

pytestmark = [pytest.mark.compat, pytest.mark.fuzz]

CI_EXAMPLES = 20
KV_RPCS = [r for r in harness.all_rpcs() if r.service == "etcdserverpb.KV"]
DECLARED_SORT_TARGETS = frozenset(rpc_pb2.RangeRequest.SortTarget.values())


def _comparable(request: Any) -> Any:
    """`request` without what the two servers may rightly answer differently."""
    for field, value in request.ListFields():
        if field.name == "lease":
            request.lease = 0
        elif field.name == "sort_target" and value not in DECLARED_SORT_TARGETS:
            request.sort_target = rpc_pb2.RangeRequest.KEY
        elif field.type == FieldDescriptor.TYPE_BYTES and value.startswith(b"/q/"):
            setattr(request, field.name, b"q" + value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            for inner in value if field.is_repeated else [value]:
                _comparable(inner)
    return request


def _answer(outcome: harness.Outcome) -> tuple[str, str, list[str]]:
    responses = []
    for response in outcome.responses:
        copy = type(response).FromString(response.SerializeToString())
        copy.header.cluster_id = copy.header.member_id = copy.header.raft_term = 0
        responses.append(str(copy))
    return outcome.code.name, outcome.details, responses


@pytest.fixture(scope="module")
def channels(etcd: EtcdProcess, server: ServerProcess) -> Any:
    with (
        grpc.insecure_channel(etcd.endpoint) as theirs,
        grpc.insecure_channel(server.endpoint) as ours,
    ):
        yield theirs, ours


@pytest.mark.parametrize("rpc", KV_RPCS, ids=[r.name for r in KV_RPCS])
def test_fuzzed_kv_requests_answer_as_etcd(
    rpc: harness.Rpc, channels: tuple[grpc.Channel, grpc.Channel], etcd: EtcdProcess
) -> None:
    theirs, ours = channels

    @settings(
        max_examples=harness.examples(CI_EXAMPLES),
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=message_strategy(rpc.request_class.DESCRIPTOR))
    def run(request: Any) -> None:
        request = _comparable(request)
        expected = _answer(harness.call(theirs, rpc, [request]))
        assert etcd.proc is not None and etcd.proc.poll() is None, "etcd died"
        got = _answer(harness.call(ours, rpc, [request]))
        assert got == expected, f"request: {request}"

    run()
