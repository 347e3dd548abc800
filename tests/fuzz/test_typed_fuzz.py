"""Typed fuzzing of every RPC against a real server process, then a consistency check.

For each method of KV, Watch, Lease, Maintenance, Cluster (MemberList), Lock,
Election and CQS (see `harness.SKIPPED` for what is left out and why), hypothesis
draws well-typed requests from the method's input descriptor
(`strategies.message_strategy`) and calls the server with a deadline. Every
answer must carry a status etcd would use (`harness.status_problem`), the
process must stay up, and the current revision must never go down.

The last test checks the state the fuzzing left: a full Range equals the replay
of the watch history, and after a restart from the data dir the revision, the
keys and HashKV are the same.

CI runs `CI_EXAMPLES` examples per method (fewer for long polls, which wait out
their deadline); `FUZZ_EXAMPLES=500` runs a longer, randomised campaign.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.fuzz import harness
from tests.fuzz.strategies import MAX_REPEATED, message_strategy
from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

CI_EXAMPLES = 30
CI_LONG_POLL_EXAMPLES = 8
"""Long polls usually wait out their 0.3 s deadline: fewer of them keep CI short."""
STABLE_TIMEOUT = 15.0

RPCS = harness.all_rpcs()
CASES: collections.Counter[str] = collections.Counter()
OUTCOMES: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
DETAILS: dict[str, set[str]] = collections.defaultdict(set)


class Run:
    """What the fuzz run has seen so far: the highest revision."""

    max_revision = 0


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("fuzz") / "fuzz.etcd").start()
    yield srv
    if srv.proc is not None and srv.proc.poll() is None:
        srv.stop()


@pytest.fixture(scope="module")
def fuzz_channel(fuzz_server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(fuzz_server.endpoint) as ch:
        yield ch


def _settings(rpc: harness.Rpc) -> settings:
    default = CI_LONG_POLL_EXAMPLES if rpc.name in harness.LONG_POLLS - {"Watch"} else CI_EXAMPLES
    randomised = "FUZZ_EXAMPLES" in os.environ
    return settings(
        max_examples=harness.examples(default),
        deadline=None,
        derandomize=not randomised,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _requests(rpc: harness.Rpc) -> st.SearchStrategy[list[object]]:
    one = message_strategy(rpc.request_class.DESCRIPTOR)
    if rpc.method.client_streaming:
        return st.lists(one, max_size=MAX_REPEATED + 2)
    return st.lists(one, min_size=1, max_size=1)


@pytest.mark.parametrize("rpc", RPCS, ids=[r.path.lstrip("/") for r in RPCS])
def test_rpc_answers_with_etcd_status(
    rpc: harness.Rpc, fuzz_server: ServerProcess, fuzz_channel: grpc.Channel
) -> None:
    @_settings(rpc)
    @given(requests=_requests(rpc))
    def run(requests: list[object]) -> None:
        outcome = harness.call(fuzz_channel, rpc, requests)
        CASES[rpc.path] += 1
        OUTCOMES[rpc.path][outcome.code.name] += 1
        if outcome.code != grpc.StatusCode.OK:
            DETAILS[rpc.path].add(f"{outcome.code.name}: {outcome.details[:80]}")
        if rpc.name == "Alarm":
            _disarm_alarms(fuzz_channel)  # a NOSPACE alarm would cap every later write
        problem = harness.status_problem(rpc, outcome)
        assert problem is None, f"{problem}\nrequests: {requests}"
        assert fuzz_server.proc is not None and fuzz_server.proc.poll() is None, "server died"
        for resp in outcome.responses:
            header = getattr(resp, "header", None)
            if rpc.kind == "unary_unary" and header is not None and header.revision:
                assert header.revision >= Run.max_revision, f"header revision went down: {resp}"
        revision = harness.status_revision(fuzz_channel)
        assert revision >= Run.max_revision, f"revision went from {Run.max_revision} to {revision}"
        Run.max_revision = revision

    run()


def _revoke_all_leases(channel: grpc.Channel) -> None:
    lease = rpc_pb2_grpc.LeaseStub(channel)
    for item in lease.LeaseLeases(rpc_pb2.LeaseLeasesRequest(), timeout=5).leases:
        try:
            lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=item.ID), timeout=5)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, e  # expired meanwhile


def _stable_revision(channel: grpc.Channel) -> int:
    """The revision once it has not moved for half a second (background work
    such as lease expiry or queue redelivery settled), bounded in time."""
    deadline = time.monotonic() + STABLE_TIMEOUT
    last = harness.status_revision(channel)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = harness.status_revision(channel)
        if now == last:
            return now
        last = now
    raise AssertionError(f"revision still moving after {STABLE_TIMEOUT}s")


def _disarm_alarms(channel: grpc.Channel) -> None:
    maintenance = rpc_pb2_grpc.MaintenanceStub(channel)
    alarms = maintenance.Alarm(rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.GET), timeout=5)
    for alarm in alarms.alarms:
        maintenance.Alarm(
            rpc_pb2.AlarmRequest(
                action=rpc_pb2.AlarmRequest.DEACTIVATE, memberID=alarm.memberID, alarm=alarm.alarm
            ),
            timeout=5,
        )


def test_state_is_consistent_after_fuzzing(
    fuzz_server: ServerProcess, fuzz_channel: grpc.Channel, tmp_path: Path
) -> None:
    """Range == replayed watch history; restart keeps revision, keys and HashKV."""
    _disarm_alarms(fuzz_channel)
    _revoke_all_leases(fuzz_channel)
    revision = _stable_revision(fuzz_channel)
    assert revision >= Run.max_revision
    keys = harness.full_range(fuzz_channel)
    replayed, start = harness.replay_history(fuzz_channel, revision)
    assert replayed == keys, f"watch history from revision {start} disagrees with Range"
    hash_before = (
        rpc_pb2_grpc.MaintenanceStub(fuzz_channel).HashKV(rpc_pb2.HashKVRequest(), timeout=5).hash
    )

    assert fuzz_server.stop() == 0
    fuzz_server.start()
    with grpc.insecure_channel(fuzz_server.endpoint) as ch:
        after = _stable_revision(ch)
        assert after == revision, f"revision {revision} before restart, {after} after"
        assert harness.full_range(ch) == keys
        hash_after = (
            rpc_pb2_grpc.MaintenanceStub(ch).HashKV(rpc_pb2.HashKVRequest(), timeout=5).hash
        )
        assert hash_after == hash_before
    total = sum(CASES.values())
    print(f"\nfuzz cases run: {total}")
    for path, count in sorted(CASES.items()):
        print(f"  {path}: {count} {dict(OUTCOMES[path])}")
        if os.environ.get("FUZZ_VERBOSE"):
            for detail in sorted(DETAILS[path]):
                print(f"      {detail}")
