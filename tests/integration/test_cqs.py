"""The Change Queue Service (issue 5, seeds 000 and 001) through the real stubs
and `etcdctl` against a real server process.

Publishing is an etcd put on `/q/dto:{type}/p/{key}`; consuming is
BatchDequeue / BatchAcknowledge / ReEnqueue. Every test uses its own queue names
and dto types on the module's server (a queue receives every publication of the
types it subscribes to, so types are unique per test too). Tests that need a short
visibility timeout share a second module server; restarts get their own.

Whether a token is still held is probed without side effects by a Header-only
ReEnqueue that half-closes: CANCELLED (held; nothing changes) or
FAILED_PRECONDITION (unknown, acknowledged or expired).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from etcdserverpb import cqs_pb2, rpc_pb2
from tests.integration.cqs_support import (
    WAIT,
    Cqs,
    Notification,
    ReEnqueueRequest,
    SplitItem,
    footer,
    header,
    identity,
    ids,
    item,
    publication,
    sla,
    status_of,
    unique,
    urn,
)
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.integration

NOT_FOUND = grpc.StatusCode.NOT_FOUND
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
CANCELLED = grpc.StatusCode.CANCELLED

SHORT_VISIBILITY = 1.5
"""--cqs-visibility-timeout of the `short` server, seconds: short, but with room for
the few calls a test makes inside one lease on a loaded 2-core machine."""

# the seed's example (seed 000, "Priority and ordering")
OSLO_1 = "t/farmersmarket/s/oslo-main/esls/7318690123456"
BERGEN = "t/farmersmarket/s/bergen-west/esls/9876543210987"
OSLO_3 = "t/farmersmarket/s/oslo-main/esls/7318690999001"


@pytest.fixture(scope="module")
def cqs(channel: grpc.Channel) -> Cqs:
    return Cqs(channel)


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cqs]:
    """A client of a second server with a short visibility timeout."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("cqs-short") / "short.etcd",
        extra_args=["--cqs-visibility-timeout", f"{SHORT_VISIBILITY:g}s"],
    ).start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            yield Cqs(ch)
    finally:
        srv.stop()


def new_queue(cqs: Cqs, *subscriptions: str | tuple[str, str], depth: int = 0) -> str:
    name = unique("q")
    cqs.configure(name, list(subscriptions), depth=depth)
    return name


# -- priority and grouping --------------------------------------------------------


def test_seed_example_groups_by_store(cqs: Cqs) -> None:
    t = unique("storeesl.v1")
    q = new_queue(cqs, t, depth=4)
    cqs.publish(t, OSLO_1, "2026-01-01T10:00:01Z")
    cqs.publish(t, BERGEN, "2026-01-01T10:00:02Z")
    cqs.publish(t, OSLO_3, "2026-01-01T10:00:05Z")

    first = cqs.dequeue(q, max_notifications=2, prefix_depth=4)
    # items 1 and 3: bergen-west is skipped though its SLA is earlier than item 3's
    assert ids(first) == [OSLO_1, OSLO_3]
    assert [sla(n) for n in first] == ["2026-01-01T10:00:01Z", "2026-01-01T10:00:05Z"]
    assert all(n.dto_type == t and n.ack_token for n in first)
    assert len({n.ack_token for n in first}) == 2
    second = cqs.dequeue(q, max_notifications=2, prefix_depth=4)
    assert ids(second) == [BERGEN]
    assert cqs.dequeue(q) == []


def test_order_is_sla_then_longer_id_then_fifo(cqs: Cqs) -> None:
    t = unique("storeesl.v1")
    batch_q, single_q = new_queue(cqs, t), new_queue(cqs, t)  # both get every publish
    store = "t/x/s/1"
    published = [  # publish order
        (f"{store}/esls/a", "2026-01-01T10:00:03Z"),
        (f"{store}/e", "2026-01-01T10:00:02Z"),  # 5 segments
        (f"{store}/esls/d", "2026-01-01T10:00:02Z"),  # 6 segments, before e
        (store, "2026-01-01T10:00:01Z"),  # the earliest SLA, shortest id
        (f"{store}/esls/e", "2026-01-01T10:00:02Z"),  # 6 segments, after d
        (f"{store}/esls/c/page", "2026-01-01T10:00:02Z"),  # 7 segments
    ]
    for dto_id, when in published:
        cqs.publish(t, dto_id, when)
    expected = [
        store,
        f"{store}/esls/c/page",
        f"{store}/esls/d",
        f"{store}/esls/e",
        f"{store}/e",
        f"{store}/esls/a",
    ]
    # one batch: the whole group in queue order
    assert ids(cqs.dequeue(batch_q, max_notifications=10)) == expected
    # one by one: the same order
    assert [urn(cqs.dequeue_one(single_q))[1] for _ in expected] == expected
    assert cqs.dequeue(single_q) == []


def test_prefix_depth_tenant_whole_id_and_queue_default(cqs: Cqs) -> None:
    t = unique("storeesl.v1")
    by_store, by_tenant, whole_id = new_queue(cqs, t), new_queue(cqs, t), new_queue(cqs, t)
    esl = "t/a/s/1/esls/x"
    cqs.publish(t, esl, "2026-01-01T10:00:01Z")
    cqs.publish(t, "t/a/s/1/esls/y", "2026-01-01T10:00:02Z")
    cqs.publish(t, f"{esl}/pages/1", "2026-01-01T10:00:03Z")
    cqs.publish(t, "t/a/s/2/esls/z", "2026-01-01T10:00:04Z")
    cqs.publish(t, "t/b/s/1/esls/w", "2026-01-01T10:00:05Z")

    # 0: the queue's depth (4 = the store)
    assert ids(cqs.dequeue(by_store, max_notifications=10, prefix_depth=0)) == [
        esl,
        "t/a/s/1/esls/y",
        f"{esl}/pages/1",
    ]
    # 2: the tenant
    assert ids(cqs.dequeue(by_tenant, max_notifications=10, prefix_depth=2)) == [
        esl,
        "t/a/s/1/esls/y",
        f"{esl}/pages/1",
        "t/a/s/2/esls/z",
    ]
    # deeper than the first id: grouped by that whole id (its subtree)
    assert ids(cqs.dequeue(whole_id, max_notifications=10, prefix_depth=20)) == [
        esl,
        f"{esl}/pages/1",
    ]


# -- publishing -------------------------------------------------------------------


def test_fan_out_alias_rules_and_drop(cqs: Cqs) -> None:
    t = unique("storeesl.v1")
    plain_a, plain_b = new_queue(cqs, t), new_queue(cqs, t)
    alias_q = new_queue(cqs, (t, "by_storeesl"))
    other_alias = new_queue(cqs, (t, "by_item"))
    both = new_queue(cqs, t, (t, "by_storeesl"))
    queues = [plain_a, plain_b, alias_q, other_alias, both]

    esl = "t/fm/s/oslo-main/esls/7318690123456"
    cqs.publish(t, esl, "2026-01-01T10:00:01Z", tracking_id="trk-plain")
    link = "t/fm/s/oslo-main/esls/7318690123456/link/ecc"
    cqs.publish(t, link, "2026-01-01T10:00:02Z", alias="by_storeesl", tracking_id="trk-alias")

    got = {q: cqs.drain(q) for q in queues}
    plain = (t, "dto_id", esl, "")
    aliased = (t, "dto_id", link, "by_storeesl")
    assert [identity(n) for n in got[plain_a]] == [plain]
    assert [identity(n) for n in got[plain_b]] == [plain]
    assert [identity(n) for n in got[alias_q]] == [aliased]
    assert got[other_alias] == []
    assert [identity(n) for n in got[both]] == [plain, aliased]
    assert got[plain_a][0].tracking_id == "trk-plain"
    assert got[alias_q][0].tracking_id == "trk-alias"
    assert sla(got[alias_q][0]) == "2026-01-01T10:00:02Z"

    # no subscriber: accepted, dropped
    nobody = unique("nobody.v1")
    cqs.publish(nobody, esl, "2026-01-01T10:00:01Z")
    # an alias nobody subscribes to: dropped too
    cqs.publish(t, esl, "2026-01-01T10:00:01Z", alias="by_nothing")
    assert all(cqs.dequeue(q) == [] for q in queues)
    # a publication point holds nothing afterwards
    assert cqs.published_keys(t) == []
    assert cqs.published_keys(nobody) == []


def _serialized(
    *,
    dto_id: str = "",
    parent_id: str = "",
    alias_name: str = "",
    tracking_id: str = "",
    sla_text: str = "",
) -> bytes:
    """A DtoChangeNotification as a publisher may put it."""
    n = Notification(alias_name=alias_name, tracking_id=tracking_id)
    if dto_id:
        n.dto_id = dto_id
    if parent_id:
        n.parent_id = parent_id
    if sla_text:
        n.sla_timestamp.FromJsonString(sla_text)
    return n.SerializeToString()


BAD_PUBLICATIONS: dict[str, bytes] = {
    "not-json": b'{"dto_id": "t/a/s/1/e/1", ',
    "json-array": b'["t/a/s/1/e/1"]',
    "no-sla": b'{"dto_id": "t/a/s/1/e/1"}',
    "bad-sla": b'{"dto_id": "t/a/s/1/e/1", "sla_timestamp": "yesterday"}',
    "no-dto-id": b'{"sla_timestamp": "2026-01-01T10:00:01Z"}',
    "parent-id": b'{"parent_id": "t/a/s/1/esls", "sla_timestamp": "2026-01-01T10:00:01Z"}',
    "unknown-field": b'{"dto_id": "t/a/s/1/e/1", "sla_timestamp": "2026-01-01T10:00:01Z", "colour": "red"}',
    "proto-no-sla": _serialized(dto_id="t/a/s/1/e/1"),
    "proto-parent-id": _serialized(parent_id="t/a/s/1/esls", sla_text="2026-01-01T10:00:01Z"),
}


@pytest.mark.parametrize("value", BAD_PUBLICATIONS.values(), ids=BAD_PUBLICATIONS.keys())
def test_malformed_publication_is_refused_and_changes_nothing(cqs: Cqs, value: bytes) -> None:
    t = unique("storeesl.v1")
    q = new_queue(cqs, t)
    before = cqs.revision()
    assert status_of(lambda: cqs.publish_raw(t, value)) == INVALID_ARGUMENT
    assert cqs.revision() == before  # nothing written
    assert cqs.published_keys(t) == []
    assert cqs.dequeue(q) == []  # nothing queued
    # and the publication point still works
    cqs.publish(t, "t/a/s/1/e/ok", "2026-01-01T10:00:01Z")
    assert ids(cqs.drain(q)) == ["t/a/s/1/e/ok"]


def etcdctl(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["etcdctl", "--endpoints", server.endpoint, "--dial-timeout", "5s", *args],
        capture_output=True,
        text=True,
        timeout=WAIT * 3,
        env={**os.environ, "ETCDCTL_API": "3"},
    )


def test_publish_with_etcdctl_and_as_serialized_notification(
    cqs: Cqs, server: ServerProcess
) -> None:
    t = unique("storeesl.v1")
    q = new_queue(cqs, t, (t, "by_storeesl"))
    by_etcdctl = "t/fm/s/oslo-main/esls/1"
    value = publication(by_etcdctl, "2026-01-01T10:00:03Z", tracking_id="trk-etcdctl")
    done = etcdctl(server, "put", f"/q/dto:{t}/p/job-1", value.decode())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "OK"

    as_proto = "t/fm/s/oslo-main/esls/2"
    cqs.publish_raw(
        t,
        _serialized(
            dto_id=as_proto,
            alias_name="by_storeesl",
            tracking_id="trk-proto",
            sla_text="2026-01-01T10:00:02Z",
        ),
    )

    refused = etcdctl(server, "put", f"/q/dto:{t}/p/job-2", '{"dto_id": "t/fm/s/oslo-main/esls/3"}')
    assert refused.returncode != 0
    assert "invalid" in refused.stderr.lower(), refused.stderr

    listed = etcdctl(server, "get", "--prefix", f"/q/dto:{t}/")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == ""  # published at once, nothing stored

    got = cqs.drain(q)
    assert [identity(n) for n in got] == [
        (t, "dto_id", as_proto, "by_storeesl"),
        (t, "dto_id", by_etcdctl, ""),
    ]
    assert [(sla(n), n.tracking_id) for n in got] == [
        ("2026-01-01T10:00:02Z", "trk-proto"),
        ("2026-01-01T10:00:03Z", "trk-etcdctl"),
    ]


# -- long-poll ----------------------------------------------------------------------


def test_long_poll_returns_as_soon_as_something_is_published(cqs: Cqs) -> None:
    t = unique("storeesl.v1")
    q = new_queue(cqs, t)
    request = cqs_pb2.BatchDequeueRequest(
        queue_name=q, max_notifications=10, wait_time_milliseconds=10_000
    )
    started = time.monotonic()
    future = cqs.stub.BatchDequeue.future(request, timeout=30)
    try:
        # the queue is empty: the call is still waiting half a second later
        with pytest.raises(grpc.FutureTimeoutError):
            future.result(timeout=0.5)
        published_at = time.monotonic()
        cqs.publish(t, "t/a/s/1/e/1", "2026-01-01T10:00:01Z")
        resp = future.result(timeout=WAIT)
        returned_at = time.monotonic()
    finally:
        future.cancel()
    assert ids(resp.notifications) == ["t/a/s/1/e/1"]
    assert returned_at - published_at < 2.0, "the long-poll was not woken by the publish"
    assert returned_at - started < 5.0  # well under the 10 s wait


def test_long_poll_on_an_empty_queue_times_out_empty(cqs: Cqs) -> None:
    q = new_queue(cqs, unique("storeesl.v1"))
    started = time.monotonic()
    assert cqs.dequeue(q, max_notifications=10, wait_ms=1000) == []
    elapsed = time.monotonic() - started
    assert 0.99 <= elapsed < 4.0, elapsed


# -- argument checks and limits -------------------------------------------------------


@pytest.mark.parametrize("queue", ["", "no-such-queue-6f1c"], ids=["blank", "unknown"])
def test_unknown_or_blank_queue_is_not_found(cqs: Cqs, queue: str) -> None:
    assert status_of(lambda: cqs.dequeue(queue)) == NOT_FOUND
    assert status_of(lambda: cqs.dequeue(queue, wait_ms=5000)) == NOT_FOUND
    assert status_of(lambda: cqs.ack(queue, ["some-token"])) == NOT_FOUND
    assert status_of(lambda: cqs.ack(queue, [])) == NOT_FOUND
    assert status_of(lambda: cqs.reenqueue(queue, "some-token", [])) == NOT_FOUND


def test_reenqueue_on_another_queue_is_not_found_even_with_a_live_token(cqs: Cqs) -> None:
    t = unique("storeesl.v1")
    q = new_queue(cqs, t)
    cqs.publish(t, "t/a/s/1/e/1", "2026-01-01T10:00:01Z")
    n = cqs.dequeue_one(q)
    missing = unique("missing")
    assert status_of(lambda: cqs.reenqueue(missing, n.ack_token, [])) == NOT_FOUND
    assert cqs.token_status(q, n.ack_token) == CANCELLED  # still held


@pytest.mark.parametrize("max_notifications", [0, -1])
def test_max_notifications_below_one_is_invalid(cqs: Cqs, max_notifications: int) -> None:
    t = unique("storeesl.v1")
    q = new_queue(cqs, t)
    cqs.publish(t, "t/a/s/1/e/1", "2026-01-01T10:00:01Z")
    assert (
        status_of(lambda: cqs.dequeue(q, max_notifications=max_notifications)) == INVALID_ARGUMENT
    )
    assert ids(cqs.dequeue(q)) == ["t/a/s/1/e/1"]  # nothing was taken


def test_max_notifications_is_capped_at_1000(cqs: Cqs) -> None:
    t = unique("design.v1")
    q = new_queue(cqs, t)
    store = "t/fm/s/oslo-main/esls"
    cqs.enqueue_split(
        q, t, "2026-01-01T10:00:01Z", (item("x.v1", f"{store}/{n:05d}") for n in range(5000))
    )
    batch = cqs.dequeue(q, max_notifications=5000)
    assert len(batch) == 1000
    assert ids(batch) == [f"{store}/{n:05d}" for n in range(1000)]  # FIFO at equal SLA
    assert len(cqs.dequeue(q, max_notifications=1000)) == 1000  # the rest are still there


# -- acknowledgement --------------------------------------------------------------


def test_ack_subset_ignores_unknown_and_repeated_tokens(short: Cqs) -> None:
    """On the short-visibility server: what is not acknowledged comes back, what is
    acknowledged never does."""
    t = unique("storeesl.v1")
    q = new_queue(short, t)
    for n in range(5):
        short.publish(t, f"t/a/s/1/e/{n}", f"2026-01-01T10:00:0{n}Z")
    batch = short.dequeue(q, max_notifications=10)
    assert ids(batch) == [f"t/a/s/1/e/{n}" for n in range(5)]
    tokens = [n.ack_token for n in batch]

    short.ack(q, [tokens[0], "no-such-token", tokens[2], tokens[0], ""])
    short.ack(q, [tokens[0], tokens[2]])  # again: ignored
    short.ack(q, [])
    assert [short.token_status(q, tok) for tok in tokens] == [
        FAILED_PRECONDITION,
        CANCELLED,
        FAILED_PRECONDITION,
        CANCELLED,
        CANCELLED,
    ]
    # nothing is redelivered before its timeout
    assert short.dequeue(q) == []

    # after the timeout, exactly the unacknowledged ones come back
    again: list[Notification] = []
    deadline = time.monotonic() + WAIT
    while len(again) < 3 and time.monotonic() < deadline:
        again += short.dequeue(q, max_notifications=10, wait_ms=3000)
    assert ids(again) == ["t/a/s/1/e/1", "t/a/s/1/e/3", "t/a/s/1/e/4"]
    short.ack(q, [n.ack_token for n in again])
    # longer than a visibility timeout: nothing else is left, in flight or pending
    assert short.dequeue(q, max_notifications=10, wait_ms=int(SHORT_VISIBILITY * 1500)) == []


def test_visibility_timeout_redelivers_with_a_new_token(short: Cqs) -> None:
    t = unique("storeesl.v1")
    q = new_queue(short, t)
    short.publish(t, OSLO_1, "2026-01-01T10:00:01Z", tracking_id="trk-1")
    before = time.monotonic()
    first = short.dequeue_one(q)
    assert short.dequeue(q) == []  # in flight: not visible

    second = short.dequeue_one(q, wait_ms=int(SHORT_VISIBILITY * 5000))
    waited = time.monotonic() - before
    # visible again at the timeout: the long-poll wakes then, not at its own end
    assert SHORT_VISIBILITY - 0.05 <= waited < SHORT_VISIBILITY + 2.0, waited
    assert identity(second) == identity(first)
    assert (sla(second), second.tracking_id) == ("2026-01-01T10:00:01Z", "trk-1")
    assert second.ack_token != first.ack_token

    # the old token is dead: acknowledging it is ignored and does not remove the
    # redelivered notification, which stays in flight under its new token
    short.ack(q, [first.ack_token])
    assert short.token_status(q, first.ack_token) == FAILED_PRECONDITION  # lease expired
    assert short.token_status(q, second.ack_token) == CANCELLED
    assert short.dequeue(q) == []
    short.ack(q, [second.ack_token])
    assert short.token_status(q, second.ack_token) == FAILED_PRECONDITION
    assert short.dequeue(q, wait_ms=int(SHORT_VISIBILITY * 1500)) == []


def test_ack_after_the_lease_expired_is_ignored(short: Cqs) -> None:
    """An expired token is dead even before anyone dequeues the notification again."""
    t = unique("storeesl.v1")
    q = new_queue(short, t)
    short.publish(t, OSLO_1, "2026-01-01T10:00:01Z")
    leased_at = time.monotonic()
    first = short.dequeue_one(q)
    # let the lease run out with nobody dequeuing: nothing observable happens at
    # that moment, so this is a bounded wait for wall-clock time, not for an event
    time.sleep(max(0.0, leased_at + SHORT_VISIBILITY + 0.3 - time.monotonic()))
    short.ack(q, [first.ack_token])
    again = short.dequeue_one(q)
    assert identity(again) == identity(first)
    assert again.ack_token != first.ack_token
    short.ack(q, [again.ack_token])


# -- dedup ----------------------------------------------------------------------------


def test_pending_duplicates_merge_keeping_the_earlier_sla_and_its_tracking_id(cqs: Cqs) -> None:
    t = unique("storeesl.v1")
    q = new_queue(cqs, t)
    esl, other = "t/a/s/1/esls/x", "t/a/s/1/esls/y"
    cqs.publish(t, other, "2026-01-01T10:00:03Z", tracking_id="trk-other")
    cqs.publish(t, esl, "2026-01-01T10:00:05Z", tracking_id="trk-late")
    cqs.publish(t, esl, "2026-01-01T10:00:01Z", tracking_id="trk-early")
    cqs.publish(t, esl, "2026-01-01T10:00:09Z", tracking_id="trk-later")
    got = cqs.dequeue(q, max_notifications=10)
    # one x, moved ahead of y by the earlier SLA it merged in
    assert [(urn(n)[1], sla(n), n.tracking_id) for n in got] == [
        (esl, "2026-01-01T10:00:01Z", "trk-early"),
        (other, "2026-01-01T10:00:03Z", "trk-other"),
    ]


def test_in_flight_duplicate_is_queued_as_a_new_copy(cqs: Cqs) -> None:
    t = unique("storeesl.v1")
    q = new_queue(cqs, t)
    esl = "t/a/s/1/esls/x"
    cqs.publish(t, esl, "2026-01-01T10:00:01Z", tracking_id="trk-1")
    held = cqs.dequeue_one(q)
    cqs.publish(t, esl, "2026-01-01T10:00:07Z", tracking_id="trk-2")
    copy = cqs.dequeue_one(q)
    assert identity(copy) == identity(held)
    assert (sla(copy), copy.tracking_id) == ("2026-01-01T10:00:07Z", "trk-2")
    assert copy.ack_token != held.ack_token
    assert cqs.token_status(q, held.ack_token) == CANCELLED  # the first is still in flight
    cqs.ack(q, [held.ack_token, copy.ack_token])
    assert cqs.dequeue(q) == []


def test_dto_id_parent_id_and_alias_are_distinct_identities(cqs: Cqs) -> None:
    t = unique("design.v1")
    q = new_queue(cqs, t)
    path = "t/a/s/1/esls"
    cqs.enqueue_split(
        q,
        t,
        "2026-01-01T10:00:01Z",
        [
            item("img.v1", dto_id=path),
            item("img.v1", parent_id=path),
            item("img.v1", dto_id=path, alias="by_storeesl"),
            item("img.v1", parent_id=path, alias="by_storeesl"),
            item("other.v1", dto_id=path),
            item("img.v1", dto_id=path),  # duplicates: merged
            item("img.v1", parent_id=path),
        ],
    )
    got = cqs.drain(q)
    assert sorted(identity(n) for n in got) == sorted(
        [
            ("img.v1", "dto_id", path, ""),
            ("img.v1", "parent_id", path, ""),
            ("img.v1", "dto_id", path, "by_storeesl"),
            ("img.v1", "parent_id", path, "by_storeesl"),
            ("other.v1", "dto_id", path, ""),
        ]
    )


# -- configuration -------------------------------------------------------------------


def test_create_or_configure_is_idempotent_replaces_subscriptions_and_keeps_depth(
    cqs: Cqs,
) -> None:
    a, b = unique("design.v1"), unique("storeesl.v1")
    q = unique("q")
    cqs.configure(q, [a], depth=2)
    config, rev = cqs.config(q)
    assert config == {"cqs": {"subscriptions": [{"dto_type": a}], "depth": 2}}

    cqs.publish(a, "t/x/s/1/e/1", "2026-01-01T10:00:01Z")
    cqs.configure(q, [a], depth=2)  # the same again: a no-op
    assert cqs.config(q) == (config, rev)

    # another list replaces the old one; another depth is ignored once created
    cqs.configure(q, [b], depth=4)
    config, _ = cqs.config(q)
    assert config == {"cqs": {"subscriptions": [{"dto_type": b}], "depth": 2}}
    cqs.publish(a, "t/x/s/1/e/dropped", "2026-01-01T10:00:01Z")  # no longer subscribed
    cqs.publish(b, "t/x/s/2/e/2", "2026-01-01T10:00:02Z")
    cqs.publish(b, "t/y/s/1/e/3", "2026-01-01T10:00:03Z")

    # the notification queued before the reconfiguration is still there, and
    # prefix_depth 0 groups by the creation depth, 2 (the tenant), not 4
    got = cqs.dequeue(q, max_notifications=10, prefix_depth=0)
    assert ids(got) == ["t/x/s/1/e/1", "t/x/s/2/e/2"]
    assert ids(cqs.dequeue(q, max_notifications=10)) == ["t/y/s/1/e/3"]
    assert cqs.dequeue(q) == []


def test_create_or_configure_refuses_bad_requests(cqs: Cqs) -> None:
    def configure(req: cqs_pb2.CreateOrConfigureQueueRequest) -> object:
        return cqs.stub.CreateOrConfigureQueue(req, timeout=WAIT)

    sub = cqs_pb2.DtoTypeSubscription
    req = cqs_pb2.CreateOrConfigureQueueRequest
    assert status_of(lambda: configure(req(queue_name=""))) == INVALID_ARGUMENT
    assert status_of(lambda: configure(req(queue_name="a/b"))) == INVALID_ARGUMENT
    bad_sub = req(queue_name=unique("q"), subscriptions=[sub(alias_name="x")])
    assert status_of(lambda: configure(bad_sub)) == INVALID_ARGUMENT


# -- ReEnqueue ----------------------------------------------------------------------


def held_notification(cqs: Cqs, sla_text: str = "2026-01-01T10:00:01Z") -> tuple[str, Notification]:
    """A new queue with one notification in flight: (queue, the notification)."""
    t = unique("design.v1")
    q = new_queue(cqs, t)
    cqs.publish(t, f"t/fm/designs/{unique('d')}", sla_text, tracking_id="trk-original")
    return q, cqs.dequeue_one(q)


def test_reenqueue_items_inherit_sla_and_tracking_id(cqs: Cqs) -> None:
    q, original = held_notification(cqs, "2026-01-01T11:30:00Z")
    items = [
        item("img.v1", dto_id="t/fm/s/1/esls/1"),
        item("img.v1", dto_id="t/fm/s/1/esls/2", alias="by_storeesl"),
        item("img.v1", parent_id="t/fm/s/2/esls"),
        item("img.v1", parent_id="t/fm/s/3/esls", alias="by_storeesl"),
    ]
    resp = cqs.reenqueue(q, original.ack_token, items)
    assert (resp.acknowledged, resp.items_enqueued) == (True, 4)
    assert cqs.token_status(q, original.ack_token) == FAILED_PRECONDITION  # acknowledged

    got = cqs.drain(q)
    assert sorted(identity(n) for n in got) == sorted(
        [
            ("img.v1", "dto_id", "t/fm/s/1/esls/1", ""),
            ("img.v1", "dto_id", "t/fm/s/1/esls/2", "by_storeesl"),
            ("img.v1", "parent_id", "t/fm/s/2/esls", ""),
            ("img.v1", "parent_id", "t/fm/s/3/esls", "by_storeesl"),
        ]
    )
    assert {(sla(n), n.tracking_id) for n in got} == {("2026-01-01T11:30:00Z", "trk-original")}
    tokens = {n.ack_token for n in got}
    assert len(tokens) == 4 and original.ack_token not in tokens and "" not in tokens


def test_reenqueue_header_and_footer_alone_acknowledges(cqs: Cqs) -> None:
    q, original = held_notification(cqs)
    resp = cqs.reenqueue_frames([header(q, original.ack_token), footer()])
    assert (resp.acknowledged, resp.items_enqueued) == (True, 0)
    # the token is now dead: a second use fails, an ack of it is ignored
    again = [header(q, original.ack_token), footer()]
    assert status_of(lambda: cqs.reenqueue_frames(again)) == FAILED_PRECONDITION
    cqs.ack(q, [original.ack_token])
    assert cqs.dequeue(q) == []


def test_reenqueue_unknown_or_acknowledged_token_fails_precondition(cqs: Cqs) -> None:
    q, original = held_notification(cqs)
    other_q, other = held_notification(cqs)
    some_item = [item("img.v1", dto_id="t/fm/s/1/esls/1")]
    assert status_of(lambda: cqs.reenqueue(q, "no-such-token", some_item)) == FAILED_PRECONDITION
    assert status_of(lambda: cqs.reenqueue(q, "", some_item)) == FAILED_PRECONDITION
    # a token of another queue is unknown here
    assert status_of(lambda: cqs.reenqueue(q, other.ack_token, some_item)) == FAILED_PRECONDITION
    cqs.ack(q, [original.ack_token])
    assert status_of(lambda: cqs.reenqueue(q, original.ack_token, some_item)) == FAILED_PRECONDITION
    assert cqs.dequeue(q) == []  # no item went in
    assert cqs.token_status(other_q, other.ack_token) == CANCELLED


def test_reenqueue_with_an_expired_token_fails_precondition(short: Cqs) -> None:
    q, original = held_notification(short)
    again = short.dequeue_one(q, wait_ms=int(SHORT_VISIBILITY * 5000))  # the lease expired
    some_item = [item("img.v1", dto_id="t/fm/s/1/esls/1")]
    assert (
        status_of(lambda: short.reenqueue(q, original.ack_token, some_item)) == FAILED_PRECONDITION
    )
    assert short.token_status(q, again.ack_token) == CANCELLED  # the redelivery is untouched
    assert short.dequeue(q) == []


def test_reenqueue_flushes_items_while_the_stream_is_open(cqs: Cqs) -> None:
    """Items sent on an open stream reach the queue within the flush interval
    (issue: at least every 1 000 items or 100 ms), not at the Footer nor at the
    next lease extension (every 10 s with the default 60 s visibility)."""
    q, original = held_notification(cqs)
    send_items, release = threading.Event(), threading.Event()
    esls = [f"t/fm/s/1/esls/{n}" for n in range(5)]

    def stream() -> Iterator[ReEnqueueRequest]:
        yield header(q, original.ack_token)
        send_items.wait(timeout=6 * WAIT)
        for e in esls:
            yield ReEnqueueRequest(item=item("img.v1", dto_id=e))
        release.wait(timeout=6 * WAIT)
        yield footer()

    call = cqs.stub.ReEnqueue.future(stream(), timeout=6 * WAIT)
    try:
        # the stream is open and idle: nothing shows up
        assert cqs.dequeue(q, max_notifications=10, wait_ms=300) == []
        sent_at = time.monotonic()
        send_items.set()
        seen: list[Notification] = []
        while len(seen) < len(esls) and time.monotonic() - sent_at < 3 * WAIT:
            seen += cqs.dequeue(q, max_notifications=10, wait_ms=1000)
        visible_after = time.monotonic() - sent_at
        assert not call.done(), call
        assert ids(seen) == esls
        assert visible_after < 1.5, (
            f"items became visible {visible_after:.1f}s after they were sent"
        )
    finally:
        send_items.set()
        release.set()
    resp = call.result(timeout=WAIT)
    assert (resp.acknowledged, resp.items_enqueued) == (True, len(esls))


def test_reenqueue_open_stream_extends_the_original_lease(short: Cqs) -> None:
    """While a stream is open the original is not redelivered, however long it
    stays open; then the Footer still acknowledges it."""
    q, original = held_notification(short)
    release = threading.Event()

    def stream() -> Iterator[ReEnqueueRequest]:
        yield header(q, original.ack_token)
        yield ReEnqueueRequest(item=item("img.v1", dto_id="t/fm/s/1/esls/1"))
        release.wait(timeout=6 * WAIT)
        yield ReEnqueueRequest(item=item("img.v1", dto_id="t/fm/s/1/esls/2"))
        yield footer()

    call = short.stub.ReEnqueue.future(stream(), timeout=6 * WAIT)
    try:
        # two visibility timeouts: only the streamed item shows up, never the original
        seen: list[Notification] = []
        deadline = time.monotonic() + 2 * SHORT_VISIBILITY
        while (left := deadline - time.monotonic()) > 0:
            batch = short.dequeue(q, max_notifications=10, wait_ms=max(1, int(left * 1000)))
            short.ack(q, [n.ack_token for n in batch])
            seen += batch
        assert not call.done(), call
        assert ids(seen) == ["t/fm/s/1/esls/1"]
    finally:
        release.set()
    resp = call.result(timeout=WAIT)
    assert (resp.acknowledged, resp.items_enqueued) == (True, 2)
    assert ids(short.drain(q)) == ["t/fm/s/1/esls/2"]
    assert short.dequeue(q, wait_ms=int(SHORT_VISIBILITY * 1500)) == []  # the original is gone


BAD_STREAMS: dict[str, list[str]] = {
    # frames after a header: "I" = a valid item, "H" = a second header, "F" = footer,
    # "no-type" / "no-urn" = invalid items; the first entry "-" means no header first
    "first-is-item": ["-", "I", "F"],
    "first-is-footer": ["-", "F"],
    "second-header-first": ["H", "I", "F"],
    "second-header-after-items": ["I", "I", "H", "I", "F"],
    "item-without-dto-type": ["I", "no-type", "I", "F"],
    "item-without-urn": ["I", "no-urn", "I", "F"],
}


@pytest.mark.parametrize("shape", BAD_STREAMS.values(), ids=BAD_STREAMS.keys())
def test_reenqueue_malformed_stream_is_invalid_and_not_acknowledged(
    cqs: Cqs, shape: list[str]
) -> None:
    q, original = held_notification(cqs)
    sent: list[str] = []
    requests: list[ReEnqueueRequest] = []
    failed = False  # set once the frame the server must refuse is queued
    if shape[0] != "-":
        requests.append(header(q, original.ack_token))
    for n, frame in enumerate(shape[1:] if shape[0] == "-" else shape):
        dto_id = f"t/fm/s/1/esls/{n}"
        if frame == "I":
            requests.append(ReEnqueueRequest(item=item("img.v1", dto_id=dto_id)))
            if not failed:
                sent.append(dto_id)
        elif frame == "H":
            requests.append(header(q, original.ack_token))
            failed = True
        elif frame == "F":
            requests.append(footer())
            failed = True
        elif frame == "no-type":
            requests.append(ReEnqueueRequest(item=SplitItem(dto_id=dto_id)))
            failed = True
        elif frame == "no-urn":
            requests.append(ReEnqueueRequest(item=item("img.v1")))
            failed = True
    if shape[0] == "-":
        sent = []  # without a header nothing may be enqueued
    assert status_of(lambda: cqs.reenqueue_frames(requests)) == INVALID_ARGUMENT
    assert cqs.token_status(q, original.ack_token) == CANCELLED  # not acknowledged
    # items already flushed may stay; nothing after the refused frame went in
    got = cqs.drain(q)
    assert set(ids(got)) <= set(sent), (ids(got), sent)


def test_reenqueue_stream_ending_without_footer_is_cancelled_and_keeps_items(cqs: Cqs) -> None:
    q, original = held_notification(cqs, "2026-01-01T11:00:00Z")
    items = [item("img.v1", dto_id=f"t/fm/s/1/esls/{n}") for n in range(3)]
    requests = [header(q, original.ack_token), *(ReEnqueueRequest(item=i) for i in items)]
    assert status_of(lambda: cqs.reenqueue_frames(requests)) == CANCELLED

    got = cqs.drain(q)
    assert ids(got) == [f"t/fm/s/1/esls/{n}" for n in range(3)]
    assert {(sla(n), n.tracking_id) for n in got} == {("2026-01-01T11:00:00Z", "trk-original")}
    # the original was not acknowledged: its token still works
    resp = cqs.reenqueue(q, original.ack_token, [])
    assert (resp.acknowledged, resp.items_enqueued) == (True, 0)


def test_reenqueue_client_cancel_mid_stream_keeps_flushed_items(cqs: Cqs) -> None:
    q, original = held_notification(cqs)
    base = "t/fm/s/oslo-main/esls"
    count = 1500  # more than one flush batch of 1 000
    # the last item has more segments: at the inherited (equal) SLA it ranks first,
    # so seeing it at the head of the queue proves every item before it is in too
    marker = f"{base}/last/marker"
    expected = {f"{base}/{n:05d}" for n in range(count - 1)} | {marker}
    release = threading.Event()

    def stream() -> Iterator[ReEnqueueRequest]:
        yield header(q, original.ack_token)
        for n in range(count - 1):
            yield ReEnqueueRequest(item=item("img.v1", dto_id=f"{base}/{n:05d}"))
        yield ReEnqueueRequest(item=item("img.v1", dto_id=marker))
        release.wait(timeout=6 * WAIT)  # the client stalls: no Footer

    call = cqs.stub.ReEnqueue.future(stream(), timeout=6 * WAIT)
    taken: list[Notification] = []
    try:
        deadline = time.monotonic() + 3 * WAIT
        while marker not in ids(taken):
            assert time.monotonic() < deadline, "the streamed items never became visible"
            assert not call.done(), call
            taken += cqs.dequeue(q, max_notifications=1000, wait_ms=2000)
        assert call.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            call.result(timeout=WAIT)
    finally:
        release.set()

    cqs.ack(q, [n.ack_token for n in taken])
    rest = cqs.drain(q)
    delivered = ids(taken) + ids(rest)
    assert len(delivered) == len(set(delivered)) == count
    assert set(delivered) == expected
    # the original was not acknowledged
    assert cqs.token_status(q, original.ack_token) == CANCELLED
    resp = cqs.reenqueue(q, original.ack_token, [])
    assert resp.acknowledged


# -- the seed's worked example, scaled down ------------------------------------------


STORES = 50
ESLS_PER_STORE = 1000
URGENT_AFTER = 10
"""The urgent change is published once this many stores are split."""


def test_tiered_split_worked_example_with_urgent_change_mid_way(cqs: Cqs) -> None:
    """Seed 000's tiered split, 50 stores x 1 000 ESLs (the seed: 500 x 10 000)."""
    design_type, esl_type = unique("design.v1"), unique("storeesl.v1")
    q = new_queue(cqs, design_type, esl_type, depth=4)
    design_sla, urgent_sla = "2026-01-01T12:00:00Z", "2026-01-01T10:00:00Z"
    cqs.publish(design_type, "t/fm/designs/summer-sale", design_sla, tracking_id="trk-design")

    (design,) = cqs.dequeue(q, max_notifications=20)
    assert urn(design) == ("dto_id", "t/fm/designs/summer-sale")
    stores = [f"t/fm/s/store{i:02d}" for i in range(STORES)]
    # tier 1: one parent_id item per store; the design notification is acknowledged
    resp = cqs.reenqueue(
        q, design.ack_token, (item("studioeslimage.v1", parent_id=f"{s}/esls") for s in stores)
    )
    assert (resp.acknowledged, resp.items_enqueued) == (True, STORES)
    assert cqs.token_status(q, design.ack_token) == FAILED_PRECONDITION

    urgent = "t/fm/s/oslo-main/esls/7318690123456"
    rendered: Counter[str] = Counter()
    started = time.monotonic()
    for i, store in enumerate(stores):
        # the next store's parent item: store order is FIFO at the inherited SLA
        (parent,) = cqs.dequeue(q, max_notifications=20)
        assert urn(parent) == ("parent_id", f"{store}/esls")
        assert (parent.dto_type, sla(parent), parent.tracking_id) == (
            "studioeslimage.v1",
            design_sla,
            "trk-design",
        )
        # tier 2: one dto_id item per ESL of the store
        esls = [f"{store}/esls/{n:013d}" for n in range(ESLS_PER_STORE)]
        resp = cqs.reenqueue(q, parent.ack_token, (item("studioeslimage.v1", e) for e in esls))
        assert (resp.acknowledged, resp.items_enqueued) == (True, ESLS_PER_STORE)

        if i == URGENT_AFTER:
            # an urgent single-ESL change slots in ahead of all the bulk work
            cqs.publish(esl_type, urgent, urgent_sla, tracking_id="trk-urgent")
            batch = cqs.dequeue(q, max_notifications=20)
            assert [identity(n) for n in batch] == [(esl_type, "dto_id", urgent, "")]
            assert (sla(batch[0]), batch[0].tracking_id) == (urgent_sla, "trk-urgent")
            cqs.ack(q, [batch[0].ack_token])

        # the store's ESLs (longer ids) come before the sibling stores' parents
        seen: list[str] = []
        while len(seen) < ESLS_PER_STORE:
            batch = cqs.dequeue(q, max_notifications=250)
            assert batch, f"{store}: only {len(seen)} ESLs delivered"
            assert all(urn(n)[0] == "dto_id" for n in batch), ids(batch)
            assert {(sla(n), n.tracking_id) for n in batch} == {(design_sla, "trk-design")}
            seen += ids(batch)
            cqs.ack(q, [n.ack_token for n in batch])
        assert seen == esls  # all of this store, in the order they were split
        rendered.update(seen)

    assert cqs.dequeue(q) == []
    assert len(rendered) == STORES * ESLS_PER_STORE
    assert set(rendered.values()) == {1}
    assert time.monotonic() - started < 90


# -- durability ----------------------------------------------------------------------


RESTART_VISIBILITY = 8.0
"""Long enough that a SIGKILL + restart (1.2 s idle, 4 s seen on a loaded 2-core
machine) ends well before the in-flight notification's lease."""


@pytest.mark.parametrize(
    "snapshot_args",
    [[], ["--snapshot-count", "4"]],
    ids=["from-the-log", "from-a-snapshot"],
)
def test_pending_and_in_flight_survive_sigkill_and_restart(
    tmp_path: Path, snapshot_args: list[str]
) -> None:
    """Restart state comes from replaying the log, or (every 4 entries) mostly
    from a snapshot of it."""
    srv = ServerProcess(
        tmp_path / "node.etcd",
        extra_args=["--cqs-visibility-timeout", f"{RESTART_VISIBILITY:g}s", *snapshot_args],
    ).start()
    t = unique("storeesl.v1")
    q = unique("q")
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            c = Cqs(ch)
            c.configure(q, [t])
            c.publish(t, "t/a/s/0/e/acked", "2026-01-01T09:00:00Z")
            c.ack(q, [c.dequeue_one(q).ack_token])
            c.publish(t, "t/a/s/1/e/a", "2026-01-01T10:00:01Z", tracking_id="trk-a")
            c.publish(t, "t/a/s/3/e/c", "2026-01-01T10:00:03Z")
            c.publish(t, "t/a/s/2/e/b", "2026-01-01T10:00:02Z")
            c.publish(t, "t/a/s/4/e/d", "2026-01-01T10:00:04Z")
            leased_at = time.monotonic()
            in_flight = c.dequeue_one(q)
            assert urn(in_flight)[1] == "t/a/s/1/e/a"
            # a pending parent_id item with an alias, made by ReEnqueue
            c.publish(t, "t/a/s/0/e/split", "2026-01-01T09:30:00Z", tracking_id="trk-split")
            split = c.dequeue_one(q)
            assert urn(split)[1] == "t/a/s/0/e/split"
            resp = c.reenqueue(
                q, split.ack_token, [item("img.v1", parent_id="t/a/s/9/esls", alias="by_x")]
            )
            assert resp.acknowledged
            # more log entries than two snapshot intervals: with --snapshot-count 4
            # a completed snapshot holds the in-flight notification
            for n in range(9):
                c.kv.Put(rpc_pb2.PutRequest(key=f"/cqs-test/filler/{n}".encode()), timeout=WAIT)

        srv.kill()
        srv.start()

        with grpc.insecure_channel(srv.endpoint) as ch:
            c = Cqs(ch)
            pending = [c.dequeue_one(q) for _ in range(4)]
            assert [identity(n) for n in pending] == [
                ("img.v1", "parent_id", "t/a/s/9/esls", "by_x"),
                (t, "dto_id", "t/a/s/2/e/b", ""),
                (t, "dto_id", "t/a/s/3/e/c", ""),
                (t, "dto_id", "t/a/s/4/e/d", ""),
            ]
            assert (sla(pending[0]), pending[0].tracking_id) == (
                "2026-01-01T09:30:00Z",
                "trk-split",
            )
            c.ack(q, [n.ack_token for n in pending])
            # the in-flight one is not visible before its lease ends
            empty = c.dequeue(q)
            checked_at = time.monotonic() - leased_at
            assert checked_at < RESTART_VISIBILITY - 0.5, "the restart took too long to check"
            assert empty == []

            back = c.dequeue_one(q, wait_ms=int(RESTART_VISIBILITY * 3000))
            waited = time.monotonic() - leased_at
            assert RESTART_VISIBILITY - 0.05 <= waited < RESTART_VISIBILITY + 3.0, waited
            assert identity(back) == identity(in_flight)
            assert (sla(back), back.tracking_id) == ("2026-01-01T10:00:01Z", "trk-a")
            assert back.ack_token != in_flight.ack_token
            assert c.token_status(q, in_flight.ack_token) == FAILED_PRECONDITION
            c.ack(q, [back.ack_token])

            # the subscription survived too; a clean stop keeps a pending one
            c.publish(t, "t/a/s/5/e/e", "2026-01-01T10:00:05Z")
        srv.stop()
        srv.start()
        with grpc.insecure_channel(srv.endpoint) as ch:
            c = Cqs(ch)
            # (an acknowledgement lost in the crash would have shown up above:
            # "t/a/s/0/e/acked" has the earliest SLA of all)
            assert ids(c.drain(q)) == ["t/a/s/5/e/e"]
    finally:
        srv.kill()
