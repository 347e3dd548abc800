"""What the fuzz tests share: the RPC table, generic calls, the status rules and
the consistency check.

The RPC table comes from the service descriptors (every method of KV, Watch,
Lease, Maintenance, Cluster, Lock, Election and CQS), minus the ones left out on
purpose (`SKIPPED`, each with its reason). A call goes through
`grpc.Channel.unary_unary` (or the streaming kinds) with the message classes'
own (de)serializers, so no generated stub code is needed and every method is
called the same way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor

from etcdserverpb import cqs_pb2, rpc_pb2, rpc_pb2_grpc, v3election_pb2, v3lock_pb2

SERVICES = (
    rpc_pb2.DESCRIPTOR.services_by_name["KV"],
    rpc_pb2.DESCRIPTOR.services_by_name["Watch"],
    rpc_pb2.DESCRIPTOR.services_by_name["Lease"],
    rpc_pb2.DESCRIPTOR.services_by_name["Maintenance"],
    rpc_pb2.DESCRIPTOR.services_by_name["Cluster"],
    v3lock_pb2.DESCRIPTOR.services_by_name["Lock"],
    v3election_pb2.DESCRIPTOR.services_by_name["Election"],
    cqs_pb2.DESCRIPTOR.services_by_name["DtoChangeQueueService"],
)

SKIPPED: dict[str, str] = {
    "MemberAdd": "changes membership: a fuzzed peer URL would make a 1-member cluster wait "
    "for a member that never comes (loss of quorum), by design",
    "MemberRemove": "removing the only member stops the server, by design",
    "MemberUpdate": "rewrites this member's peer URLs: destructive, not read-only",
    "MemberPromote": "membership change (learners): not read-only",
}
"""Methods not fuzzed, and why. Defragment, Snapshot, MoveLeader and Downgrade
are fuzzed: with the small fuzz data set they are fast, and the last two answer
UNIMPLEMENTED on one member."""

LONG_POLLS = frozenset({"Lock", "Campaign", "Observe", "BatchDequeue", "Watch"})
"""Methods that may legitimately wait past a short deadline (a held lock, a
leader that never changes, an empty queue)."""

ALLOWED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAVAILABLE,
    }
)
"""The codes etcd answers requests with; UNKNOWN and INTERNAL mean an unhandled
exception (grpcio's "Unexpected <class ...>") and are bugs."""

RECIPE_SERVICES = frozenset({"v3lockpb.Lock", "v3electionpb.Election"})
"""etcd's Lock and Election run client recipes in the server and report their
errors as UNKNOWN with the recipe's message (see queue_server/api/lock.py): for
them UNKNOWN is allowed unless it carries grpcio's unhandled-exception text."""

UNIMPLEMENTED_OK = frozenset({"MoveLeader", "Downgrade"})
"""Answered UNIMPLEMENTED on a single member (queue_server/api/maintenance.py)."""
CANCELLED_OK = frozenset({"ReEnqueue"})
"""CQS's documented answer to a ReEnqueue stream that ends before its Footer
(docs/cqs.md, "the stream ends (half-close) before the Footer")."""

CALL_TIMEOUT = 5.0
"""Deadline of an ordinary call: far above any answer on loopback."""
LONG_POLL_TIMEOUT = 0.3
"""Deadline of a call that may wait (a Lock, a Campaign, an Observe)."""


def examples(default: int) -> int:
    """Examples per RPC: `default` in CI, or FUZZ_EXAMPLES for a longer run."""
    raw = os.environ.get("FUZZ_EXAMPLES")
    return int(raw) if raw else default


@dataclass(frozen=True)
class Rpc:
    """One method of one service, with its message classes."""

    service: str
    method: MethodDescriptor
    request_class: Any
    response_class: Any

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method.name}"

    @property
    def kind(self) -> str:
        m = self.method
        return ("stream" if m.client_streaming else "unary") + (
            "_stream" if m.server_streaming else "_unary"
        )

    @property
    def timeout(self) -> float:
        return LONG_POLL_TIMEOUT if self.name in LONG_POLLS else CALL_TIMEOUT


def all_rpcs() -> list[Rpc]:
    """Every fuzzed method of SERVICES, in a fixed order."""
    rpcs = []
    for service in SERVICES:
        for method in service.methods:
            if method.name in SKIPPED:
                continue
            rpcs.append(
                Rpc(
                    service.full_name,
                    method,
                    message_factory.GetMessageClass(method.input_type),
                    message_factory.GetMessageClass(method.output_type),
                )
            )
    return rpcs


@dataclass
class Outcome:
    """What one call ended with: its code and details, and the responses read."""

    code: grpc.StatusCode
    details: str
    responses: list[Any]


def call(channel: grpc.Channel, rpc: Rpc, requests: list[Any], max_responses: int = 64) -> Outcome:
    """Call `rpc` with `requests` (one for a unary request, any number for a
    stream, which is half-closed after them) and read at most `max_responses`."""
    ser: Callable[[Any], bytes] = rpc.request_class.SerializeToString
    de: Callable[[bytes], Any] = rpc.response_class.FromString
    responses: list[Any] = []
    try:
        if rpc.kind == "unary_unary":
            fn = channel.unary_unary(rpc.path, request_serializer=ser, response_deserializer=de)
            responses.append(fn(requests[0], timeout=rpc.timeout))
        elif rpc.kind == "stream_unary":
            fn2 = channel.stream_unary(rpc.path, request_serializer=ser, response_deserializer=de)
            responses.append(fn2(iter(requests), timeout=rpc.timeout))
        else:
            if rpc.kind == "unary_stream":
                fn3 = channel.unary_stream(
                    rpc.path, request_serializer=ser, response_deserializer=de
                )
                it: Any = fn3(requests[0], timeout=rpc.timeout)
            else:
                fn4 = channel.stream_stream(
                    rpc.path, request_serializer=ser, response_deserializer=de
                )
                it = fn4(iter(requests), timeout=rpc.timeout)
            for response in it:
                responses.append(response)
                if len(responses) >= max_responses:
                    it.cancel()
                    return Outcome(grpc.StatusCode.OK, "", responses)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", responses)
    return Outcome(grpc.StatusCode.OK, "", responses)


def status_problem(rpc: Rpc, outcome: Outcome) -> str | None:
    """Why `outcome` is not an answer etcd would give, or None if it is."""
    code = outcome.code
    if code in ALLOWED:
        return None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and rpc.name in LONG_POLLS:
        return None
    if code == grpc.StatusCode.UNIMPLEMENTED and rpc.name in UNIMPLEMENTED_OK:
        return None
    if code == grpc.StatusCode.CANCELLED and rpc.name in CANCELLED_OK:
        return None
    if (
        code == grpc.StatusCode.UNKNOWN
        and rpc.service in RECIPE_SERVICES
        and not outcome.details.startswith("Unexpected")
    ):
        return None
    return f"{rpc.path} answered {code.name}: {outcome.details!r}"


# -- consistency ---------------------------------------------------------------


def status_revision(channel: grpc.Channel) -> int:
    resp = rpc_pb2_grpc.MaintenanceStub(channel).Status(rpc_pb2.StatusRequest(), timeout=5)
    return int(resp.header.revision)


def full_range(channel: grpc.Channel, revision: int = 0) -> dict[bytes, tuple[bytes, int, int]]:
    """Every key at `revision` (0: current) as key -> (value, mod_revision, lease)."""
    resp = rpc_pb2_grpc.KVStub(channel).Range(
        rpc_pb2.RangeRequest(key=b"\x00", range_end=b"\x00", revision=revision), timeout=10
    )
    return {kv.key: (kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs}


def without_cqs_view(
    keys: dict[bytes, tuple[bytes, int, int]],
) -> dict[bytes, tuple[bytes, int, int]]:
    """`keys` without the message keys of CQS queues (`/q/{queue}/{seq}/...`): a
    current Range shows each CQS queue's notifications as keys, but they live in
    the queue's own structure, not in the key history, so no watch replays them
    (docs/cqs-design.md, "Range")."""
    cqs_queues = set()
    for key, (value, _, _) in keys.items():
        if key.startswith(b"/q/") and key.endswith(b"/config") and b'"cqs"' in value:
            cqs_queues.add(key[len(b"/q/") : -len(b"/config")])

    def in_view(key: bytes) -> bool:
        if not key.startswith(b"/q/"):
            return False
        name, _, rest = key[len(b"/q/") :].partition(b"/")
        seq = rest.split(b"/", 1)[0]
        return name in cqs_queues and len(seq) == 16 and seq.isdigit()

    return {k: v for k, v in keys.items() if not in_view(k)}


def replay_history(
    channel: grpc.Channel, until: int, deadline: float = 20.0
) -> tuple[dict[bytes, tuple[bytes, int, int]], int]:
    """The keyspace at `until` rebuilt from the watch history: from revision 1 if
    nothing is compacted, else from a Range at the compact revision plus the
    history after it. Returns the keyspace and the revision replay started at."""
    start = 1
    base: dict[bytes, tuple[bytes, int, int]] = {}
    events = _watch_all(channel, start, until, deadline)
    if isinstance(events, int):  # compacted: start from the compact revision
        compact = events
        base = full_range(channel, compact)
        start = compact + 1
        replay = _watch_all(channel, start, until, deadline)
        assert not isinstance(replay, int), "compacted again during the check"
        events = replay
    state = dict(base)
    for ev in events:
        kv = ev.kv
        if ev.type == ev.PUT:
            state[kv.key] = (kv.value, kv.mod_revision, kv.lease)
        else:
            state.pop(kv.key, None)
    return state, start


def _watch_all(channel: grpc.Channel, start: int, until: int, deadline: float) -> list[Any] | int:
    """Every event from `start` to `until` on one all-keys watcher, or the
    compact revision if `start` is compacted. A progress request follows the
    create: the server answers it once the watcher has caught up with history."""
    create = rpc_pb2.WatchRequest(
        create_request=rpc_pb2.WatchCreateRequest(
            key=b"\x00", range_end=b"\x00", start_revision=start
        )
    )
    progress = rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest())
    done = False

    def requests() -> Iterator[rpc_pb2.WatchRequest]:
        yield create
        yield progress
        end = time.monotonic() + deadline
        while not done and time.monotonic() < end:
            time.sleep(0.01)

    events: list[Any] = []
    stream = rpc_pb2_grpc.WatchStub(channel).Watch(requests(), timeout=deadline)
    try:
        for resp in stream:
            if resp.canceled:
                return int(resp.compact_revision)
            events.extend(ev for ev in resp.events if ev.kv.mod_revision <= until)
            if not resp.created and not resp.events and resp.header.revision >= until:
                break  # the progress answer: history is all here
    finally:
        done = True
        stream.cancel()
    return events
