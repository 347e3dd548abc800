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
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc
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


CQS_QUEUE = "fzq"
CQS_TYPE = "fzt"
CQS_FLOW_EXAMPLES = 40


def _publication(note: cqs_pb2.DtoChangeNotification, fix: bool) -> cqs_pb2.DtoChangeNotification:
    """A fuzzed notification, or (`fix`) one nudged towards delivery: our type, no
    alias (an alias-scoped one only reaches alias subscriptions), an id and an SLA,
    the SLA's fields still fuzzed (seconds and nanos at any value)."""
    if fix:
        note.dto_type = CQS_TYPE
        note.alias_name = ""
        if not note.dto_id:
            note.dto_id = "t/a/s/b/x"  # also replaces a parent_id (one oneof)
        note.sla_timestamp.seconds = note.sla_timestamp.seconds or 1_700_000_000
    return note


def test_cqs_flow_with_fuzzed_payloads(fuzz_channel: grpc.Channel) -> None:
    """Publish fuzzed notifications (protobuf values) to a real CQS queue, dequeue
    with fuzzed parameters, split one delivery with fuzzed items, acknowledge the
    rest with fuzzed tokens mixed in: every answer carries an etcd status."""
    cqs = cqs_pb2_grpc.DtoChangeQueueServiceStub(fuzz_channel)
    kv = rpc_pb2_grpc.KVStub(fuzz_channel)
    cqs.CreateOrConfigureQueue(
        cqs_pb2.CreateOrConfigureQueueRequest(
            queue_name=CQS_QUEUE, subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type=CQS_TYPE)]
        ),
        timeout=5,
    )
    notes = st.lists(
        st.tuples(message_strategy(cqs_pb2.DtoChangeNotification.DESCRIPTOR), st.booleans()),
        min_size=1,
        max_size=4,
    )
    items = st.lists(message_strategy(cqs_pb2.SplitItem.DESCRIPTOR), max_size=4)
    dequeues = message_strategy(cqs_pb2.BatchDequeueRequest.DESCRIPTOR)
    tokens = st.lists(st.text(max_size=12), max_size=3)

    def checked(name: str, fn: Callable[[], object]) -> object | None:
        try:
            result = fn()
            OUTCOMES[f"cqs-flow/{name}"]["OK"] += 1
            return result
        except grpc.RpcError as e:
            outcome = harness.Outcome(e.code(), e.details() or "", [])
            OUTCOMES[f"cqs-flow/{name}"][outcome.code.name] += 1
            DETAILS[f"cqs-flow/{name}"].add(f"{outcome.code.name}: {outcome.details[:80]}")
            rpc = next(r for r in RPCS if r.name == name)
            problem = harness.status_problem(rpc, outcome)
            assert problem is None, problem
            return None

    @settings(
        max_examples=harness.examples(CQS_FLOW_EXAMPLES),
        deadline=None,
        derandomize="FUZZ_EXAMPLES" not in os.environ,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(notes=notes, dequeue=dequeues, split=items, extra_tokens=tokens)
    def run(
        notes: list[tuple[cqs_pb2.DtoChangeNotification, bool]],
        dequeue: cqs_pb2.BatchDequeueRequest,
        split: list[cqs_pb2.SplitItem],
        extra_tokens: list[str],
    ) -> None:
        for i, (note, fix) in enumerate(notes):
            value = _publication(note, fix).SerializeToString()
            key = b"/q/dto:%s/p/k%d" % (CQS_TYPE.encode(), i)

            def put(k: bytes = key, v: bytes = value) -> object:
                return kv.Put(rpc_pb2.PutRequest(key=k, value=v))

            checked("Put", put)
            CASES["cqs-flow/Put"] += 1
        view = rpc_pb2.RangeRequest(
            key=b"/q/%s/" % CQS_QUEUE.encode(), range_end=b"/q/%s0" % CQS_QUEUE.encode()
        )
        checked("Range", lambda: kv.Range(view, timeout=5))  # the queue shown as keys
        CASES["cqs-flow/Range"] += 1
        dequeue.queue_name = CQS_QUEUE
        dequeue.max_notifications = abs(dequeue.max_notifications) % 2000 or 1
        dequeue.prefix_depth = abs(dequeue.prefix_depth) % 40
        dequeue.wait_time_milliseconds = dequeue.wait_time_milliseconds % 50
        got = checked("BatchDequeue", lambda: cqs.BatchDequeue(dequeue, timeout=5))
        CASES["cqs-flow/BatchDequeue"] += 1
        delivered = list(got.notifications) if isinstance(got, cqs_pb2.BatchDequeueResponse) else []
        if delivered:
            first = delivered.pop(0)
            frames = [
                cqs_pb2.ReEnqueueRequest(
                    header=cqs_pb2.ReEnqueueRequest.Header(
                        queue_name=CQS_QUEUE, ack_token=first.ack_token
                    )
                ),
                *[cqs_pb2.ReEnqueueRequest(item=item) for item in split],
                cqs_pb2.ReEnqueueRequest(footer=cqs_pb2.ReEnqueueRequest.Footer()),
            ]
            checked("ReEnqueue", lambda: cqs.ReEnqueue(iter(frames), timeout=5))
            CASES["cqs-flow/ReEnqueue"] += 1
        ack = cqs_pb2.BatchAcknowledgeRequest(
            queue_name=CQS_QUEUE, ack_tokens=[n.ack_token for n in delivered] + extra_tokens
        )
        checked("BatchAcknowledge", lambda: cqs.BatchAcknowledge(ack, timeout=5))
        CASES["cqs-flow/BatchAcknowledge"] += 1

    run()


QUEUE_CONFIG_EXAMPLES = 40
_JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and the infinities too: Python's json writes and reads them
    st.text(max_size=8),
)
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
_SETTING = st.sampled_from(
    ["ack_deadline", "max_deliveries", "dead_letter", "prefetch", "max_depth", "cqs", "other"]
)
_CQS_SETTING = st.sampled_from(["subscriptions", "depth", "prefetch", "other"])
QUEUE_CONFIGS = st.dictionaries(
    _SETTING,
    st.one_of(_JSON, st.dictionaries(_CQS_SETTING, _JSON, max_size=3)),
    max_size=4,
)


def test_queue_config_and_flow_with_fuzzed_settings(fuzz_channel: grpc.Channel) -> None:
    """Fuzzed JSON settings in `/q/{name}/config` (wrong types, huge and
    non-finite numbers), then a produce and a consumer watch on the queue: every
    answer carries an etcd status. The module's last test restarts the server,
    so a config that breaks replay is caught too."""
    kv = rpc_pb2_grpc.KVStub(fuzz_channel)
    put = next(r for r in RPCS if r.name == "Put")
    counter = iter(range(10**9))

    @settings(
        max_examples=harness.examples(QUEUE_CONFIG_EXAMPLES),
        deadline=None,
        derandomize="FUZZ_EXAMPLES" not in os.environ,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(config=QUEUE_CONFIGS)
    def run(config: dict[str, object]) -> None:
        name = b"cfg%d" % next(counter)
        value = json.dumps(config).encode()
        for key, data in ((b"/q/%s/config" % name, value), (b"/q/%s/p/m" % name, b"x")):
            try:
                kv.Put(rpc_pb2.PutRequest(key=key, value=data), timeout=5)
                outcome = harness.Outcome(grpc.StatusCode.OK, "", [])
            except grpc.RpcError as e:
                outcome = harness.Outcome(e.code(), e.details() or "", [])
            CASES["queue-config/Put"] += 1
            OUTCOMES["queue-config/Put"][outcome.code.name] += 1
            if outcome.code != grpc.StatusCode.OK:
                DETAILS["queue-config/Put"].add(f"{outcome.code.name}: {outcome.details[:80]}")
            problem = harness.status_problem(put, outcome)
            assert problem is None, f"{problem}\nconfig: {value!r}"
        consume = rpc_pb2.WatchRequest(
            create_request=rpc_pb2.WatchCreateRequest(key=b"/q/%s/c/u1" % name)
        )
        watch = next(r for r in RPCS if r.name == "Watch")
        outcome = harness.call(fuzz_channel, watch, [consume])
        CASES["queue-config/Watch"] += 1
        assert harness.status_problem(watch, outcome) is None, outcome

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
    """No exception was logged; Range == replayed watch history; restart keeps
    revision, keys and HashKV."""
    log_text = fuzz_server.log_text()
    assert "Traceback" not in log_text, f"an exception was logged: {log_text[-3000:]}"
    _disarm_alarms(fuzz_channel)
    _revoke_all_leases(fuzz_channel)
    revision = _stable_revision(fuzz_channel)
    assert revision >= Run.max_revision
    keys = harness.full_range(fuzz_channel)
    replayed, start = harness.replay_history(fuzz_channel, revision)
    assert harness.without_cqs_view(replayed) == harness.without_cqs_view(keys), (
        f"watch history from revision {start} disagrees with Range"
    )
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
