"""CQS through fronts over a real 3-member etcd (queue_server/front/cqs.py).

A queue made through one front, published to through another, dequeued,
acknowledged and split through either: seed 000's and seed 001's contracts as
the embedded server keeps them (tests/integration/test_cqs.py), with every
notification a key in etcd. When the dispatching front is SIGKILLed, another
front rebuilds the queue from etcd: what was pending is still pending, in its
order, and what was in flight stays in flight until its visibility timeout.
Every wait is bounded.
"""

from __future__ import annotations

import json
import queue as queues
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from etcdserverpb import cqs_pb2, rpc_pb2, rpc_pb2_grpc
from tests.integration.cqs_support import (
    Cqs,
    footer,
    header,
    ids,
    item,
    publication,
    status_of,
    unique,
)
from tests.integration.test_queue import consumer_key, new_id
from tests.support.processes import EtcdCluster, FrontProcess, free_port
from tests.support.tls import make_pki

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="needs Debian's etcd-server"),
]

WAIT = 15.0
VISIBILITY = 2.0
"""The fronts' --cqs-visibility-timeout: short, so expiry is seen within the test."""
SLA = "2026-06-01T10:00:0{}Z"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    etcd = EtcdCluster(tmp_path_factory.mktemp("etcd3cqs")).start()
    yield etcd
    etcd.stop()


@pytest.fixture
def fronts(cluster: EtcdCluster, tmp_path: Path) -> Iterator[list[FrontProcess]]:
    procs = [
        FrontProcess(
            tmp_path / f"front{i}.etcd",
            cluster.endpoints,
            ["--cqs-visibility-timeout", f"{VISIBILITY}s"],
        ).start()
        for i in (1, 2)
    ]
    yield procs
    for proc in procs:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop()


def cqs(front: FrontProcess) -> Cqs:
    return Cqs(grpc.insecure_channel(front.endpoint))


def etcd_keys(cluster: EtcdCluster, prefix: bytes) -> list[bytes]:
    """The keys under `prefix`, read from etcd itself."""
    with grpc.insecure_channel(cluster.endpoints[0]) as ch:
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        reply = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=prefix, range_end=end, keys_only=True), timeout=WAIT
        )
    return [kv.key for kv in reply.kvs]


def dispatcher_of(cluster: EtcdCluster, queue: str) -> bytes:
    with grpc.insecure_channel(cluster.endpoints[0]) as ch:
        reply = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=f"/q/{queue}".encode()), timeout=WAIT
        )
    return bytes(reply.kvs[0].value) if reply.kvs else b""


def wait_for(what: str, check: object, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


def taken_in(cluster: EtcdCluster, dto: str, queue: str) -> None:
    """Until every publication of `dto` has reached `queue`'s rows: a publication
    is fanned out a moment after its put (docs/compatibility.md), so a test of
    the queue's order waits for it."""
    wait_for(
        "publications taken into the queue",
        lambda: (
            not etcd_keys(cluster, f"/q/dto:{dto}/p/".encode())
            and not etcd_keys(cluster, f"/q/{queue}/in/".encode())
        ),
    )


def dequeue_until(c: Cqs, queue: str, n: int, **kwargs: int) -> list[cqs_pb2.DtoChangeNotification]:
    """Long-poll until `n` notifications came (bounded)."""
    got: list[cqs_pb2.DtoChangeNotification] = []
    deadline = time.monotonic() + WAIT
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} within {WAIT}s"
        got.extend(c.dequeue(queue, wait_ms=1000, **kwargs))
    return got


def test_publish_on_one_front_dequeue_and_ack_through_the_other(
    fronts: list[FrontProcess], cluster: EtcdCluster
) -> None:
    a, b = cqs(fronts[0]), cqs(fronts[1])
    queue, dto = unique("renderer"), unique("storeesl.v1")
    a.configure(queue, [dto])
    config, _ = a.config(queue)
    assert config == {"cqs": {"subscriptions": [{"dto_type": dto}], "depth": 4}}
    # most urgent first; equal SLA: more segments first; the rest of its store follow
    b.publish(dto, "t/a/s/one/esls/2", SLA.format(3))
    b.publish(dto, "t/a/s/two/esls/1", SLA.format(1))
    b.publish(dto, "t/a/s/one/esls/1", SLA.format(2))
    b.publish(dto, "t/a/s/two", SLA.format(1))
    taken_in(cluster, dto, queue)
    first = dequeue_until(a, queue, 2, max_notifications=10)
    assert ids(first) == ["t/a/s/two/esls/1", "t/a/s/two"], ids(first)
    rest = dequeue_until(b, queue, 2, max_notifications=10)
    assert ids(rest) == ["t/a/s/one/esls/1", "t/a/s/one/esls/2"]
    # each notification is a key in etcd while it is held
    assert len(etcd_keys(cluster, f"/q/{queue}/n/".encode())) == 4
    b.ack(queue, [n.ack_token for n in first])  # acks through the other front
    a.ack(queue, [n.ack_token for n in rest])
    wait_for("rows gone", lambda: not etcd_keys(cluster, f"/q/{queue}/n/".encode()))
    assert a.dequeue(queue) == []
    assert etcd_keys(cluster, f"/q/dto:{dto}/p/".encode()) == []  # fanned out and gone


def test_a_change_published_again_while_pending_merges(
    fronts: list[FrontProcess], cluster: EtcdCluster
) -> None:
    a, b = cqs(fronts[0]), cqs(fronts[1])
    queue, dto = unique("merge"), unique("storeesl.v1")
    a.configure(queue, [dto])
    b.publish(dto, "t/a/s/x/esls/1", SLA.format(5), tracking_id="late")
    b.publish(dto, "t/a/s/x/esls/1", SLA.format(2), tracking_id="soon")
    taken_in(cluster, dto, queue)
    got = a.dequeue(queue)
    assert a.dequeue(queue) == []
    assert len(got) == 1, got
    assert got[0].tracking_id == "soon" and got[0].sla_timestamp.seconds % 60 == 2


def test_visibility_expiry_gives_a_new_token_through_either_front(
    fronts: list[FrontProcess],
) -> None:
    a, b = cqs(fronts[0]), cqs(fronts[1])
    queue, dto = unique("expiry"), unique("storeesl.v1")
    a.configure(queue, [dto])
    a.publish(dto, "t/a/s/x/esls/1", SLA.format(1))
    held = dequeue_until(b, queue, 1)[0]
    assert a.dequeue(queue) == []  # in flight: invisible
    started = time.monotonic()
    again = a.dequeue(queue, wait_ms=int((VISIBILITY + 5) * 1000))
    assert len(again) == 1 and again[0].dto_id == held.dto_id
    assert again[0].ack_token != held.ack_token
    assert time.monotonic() - started >= VISIBILITY - 0.5
    b.ack(queue, [held.ack_token])  # the dead token is ignored
    assert a.token_status(queue, again[0].ack_token) == grpc.StatusCode.CANCELLED
    assert a.token_status(queue, held.ack_token) == grpc.StatusCode.FAILED_PRECONDITION
    b.ack(queue, [again[0].ack_token])


def test_re_enqueue_through_the_front_that_does_not_dispatch(
    fronts: list[FrontProcess], cluster: EtcdCluster
) -> None:
    a, b = cqs(fronts[0]), cqs(fronts[1])
    queue, dto = unique("split"), unique("design.v1")
    a.configure(queue, [dto])
    a.publish(dto, "t/a/designs/7", SLA.format(4), tracking_id="job-7")
    original = dequeue_until(a, queue, 1)[0]
    holder = dispatcher_of(cluster, queue)
    other = next(
        c for c, f in zip((a, b), fronts, strict=True) if str(f.port) not in holder.decode()
    )
    items = [item("esl.v1", parent_id=f"t/a/s/{s}/esls") for s in ("one", "two")]
    items += [item("esl.v1", dto_id=f"t/a/s/one/esls/{n}") for n in range(3)]
    reply = other.reenqueue(queue, original.ack_token, items)
    assert reply.acknowledged and reply.items_enqueued == 5
    got = dequeue_until(other, queue, 5, max_notifications=10, prefix_depth=1)
    # inherited SLA and tracking id; longer ids first at equal SLA
    assert all(n.tracking_id == "job-7" and n.sla_timestamp == original.sla_timestamp for n in got)
    assert [n.WhichOneof("urn") for n in got] == ["dto_id"] * 3 + ["parent_id"] * 2
    assert other.token_status(queue, original.ack_token) == grpc.StatusCode.FAILED_PRECONDITION
    # a bad item mid-stream: INVALID_ARGUMENT, the items before it stay queued
    token = got[0].ack_token
    bad = [header(queue, token)]
    bad += [cqs_pb2.ReEnqueueRequest(item=item("esl.v1", dto_id="t/a/s/z/1"))]
    bad += [cqs_pb2.ReEnqueueRequest(item=cqs_pb2.SplitItem(dto_type="esl.v1")), footer()]
    assert status_of(lambda: other.reenqueue_frames(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    assert ids(dequeue_until(a, queue, 1)) == ["t/a/s/z/1"]


LONG_VISIBILITY = 15.0
"""The visibility timeout of fronts whose original hold must outlast a takeover (the dead
front's session TTL, then the rebuild) with no one extending it."""


def test_a_re_enqueue_goes_on_whole_when_the_dispatching_front_dies_mid_stream(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    fronts = [
        FrontProcess(
            tmp_path / f"long{i}.etcd",
            cluster.endpoints,
            ["--cqs-visibility-timeout", f"{LONG_VISIBILITY}s"],
        )
        for i in (1, 2)
    ]
    try:
        for proc in fronts:
            proc.start()
        a = cqs(fronts[0])
        queue, dto = unique("resend"), unique("design.v1")
        a.configure(queue, [dto])
        a.publish(dto, "t/a/designs/9", SLA.format(5), tracking_id="job-9")
        original = dequeue_until(a, queue, 1)[0]
        holder = dispatcher_of(cluster, queue)
        victim = next(f for f in fronts if holder.endswith(b":%d" % f.port))
        survivor = cqs(next(f for f in fronts if f is not victim))
        rows = f"/q/{queue}/n/".encode()
        before = len(etcd_keys(cluster, rows))
        first = [f"t/a/s/one/esls/{n}" for n in range(3)]
        second = [f"t/a/s/two/esls/{n}" for n in range(2)]
        sending: queues.Queue[cqs_pb2.ReEnqueueRequest | None] = queues.Queue()

        def requests() -> Iterator[cqs_pb2.ReEnqueueRequest]:
            while (frame := sending.get(timeout=WAIT)) is not None:
                yield frame

        sending.put(header(queue, original.ack_token))
        for dto_id in first:
            sending.put(cqs_pb2.ReEnqueueRequest(item=item("esl.v1", dto_id=dto_id)))
        # through the front that does not dispatch, which passes it on
        call = survivor.stub.ReEnqueue.future(requests(), timeout=3 * WAIT)
        wait_for(
            "the first items written by the dispatching front",
            lambda: len(etcd_keys(cluster, rows)) >= before + len(first),
        )
        victim.kill()
        for dto_id in second:
            sending.put(cqs_pb2.ReEnqueueRequest(item=item("esl.v1", dto_id=dto_id)))
        sending.put(footer())
        sending.put(None)
        reply = call.result(timeout=3 * WAIT)
        assert reply.acknowledged and reply.items_enqueued == len(first) + len(second)
        assert dispatcher_of(cluster, queue) != holder
        # each item once (the first ones, sent again, merged with themselves), the
        # original acknowledged
        got = dequeue_until(survivor, queue, 5, max_notifications=10, prefix_depth=1)
        assert sorted(ids(got)) == sorted(first + second)
        assert survivor.dequeue(queue, wait_ms=500, max_notifications=10) == []
        assert survivor.token_status(queue, original.ack_token) == (
            grpc.StatusCode.FAILED_PRECONDITION
        )
    finally:
        for proc in fronts:
            if proc.proc is not None and proc.proc.poll() is None:
                proc.stop()


def test_fronts_serving_https_forward_to_each_other_over_tls(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    """front/peers.py: a front whose client port is https names itself so, and the
    others call it over TLS, presenting their own certificate to its
    --client-cert-auth: a dequeue and an ack through the front that does not
    dispatch reach the one that does."""
    pki = make_pki(tmp_path / "pki")
    tls = [
        *("--cert-file", str(pki.server.cert), "--key-file", str(pki.server.key)),
        *("--trusted-ca-file", str(pki.ca), "--client-cert-auth"),
    ]
    fronts = [FrontProcess(tmp_path / f"tls{i}.etcd", cluster.endpoints, tls) for i in (1, 2)]
    try:
        for proc in fronts:
            proc.credentials = pki.credentials(pki.client)  # https, and our client certificate
            proc.start()
        a = Cqs(fronts[0].channel())
        queue, dto = unique("tls"), unique("design.v1")
        a.configure(queue, [dto])
        a.publish(dto, "t/a/designs/1", SLA.format(1))
        taken_in(cluster, dto, queue)
        holder = dispatcher_of(cluster, queue)
        victim = next(f for f in fronts if holder.endswith(b":%d" % f.port))
        assert b"@https://127.0.0.1:" in holder, holder
        other = Cqs(next(f for f in fronts if f is not victim).channel())
        [got] = dequeue_until(other, queue, 1)
        assert got.dto_id == "t/a/designs/1"
        other.ack(queue, [got.ack_token])
        assert other.token_status(queue, got.ack_token) == grpc.StatusCode.FAILED_PRECONDITION
        wait_for("rows gone", lambda: not etcd_keys(cluster, f"/q/{queue}/n/".encode()))

        # the etcd-key queue: a produce through the other front is handed to the
        # dispatching one over TLS and becomes its message key in its own revision
        name = unique("tlsq").encode()
        with fronts[0].channel() as ch, fronts[1].channel() as other_ch:
            watch = rpc_pb2.WatchRequest(
                create_request=rpc_pb2.WatchCreateRequest(key=consumer_key(name, new_id()))
            )
            stream = rpc_pb2_grpc.WatchStub(ch).Watch(iter([watch]), timeout=WAIT)
            wait_for(
                "fronts[0] dispatches the queue", lambda: dispatcher_of(cluster, name.decode())
            )
            put = rpc_pb2.PutRequest(key=b"/q/%s/p/k0" % name, value=b"v0")
            produced = rpc_pb2_grpc.KVStub(other_ch).Put(put, timeout=WAIT)
            delivered = next(r for r in stream if r.events).events[0].kv  # within WAIT
            stream.cancel()
        assert delivered.value == b"v0"
        with grpc.insecure_channel(cluster.endpoints[0]) as ch:
            reply = rpc_pb2_grpc.KVStub(ch).Range(
                rpc_pb2.RangeRequest(key=b"/q/%s/0" % name, range_end=b"/q/%s/:" % name),
                timeout=WAIT,
            )
        # taken directly: no producer key was ever written to be moved later
        assert [m.create_revision for m in reply.kvs] == [produced.header.revision]
    finally:
        for proc in fronts:
            if proc.proc is not None and proc.proc.poll() is None:
                proc.stop()


def test_unknown_queue_and_bad_requests_are_refused_as_embedded(
    fronts: list[FrontProcess],
) -> None:
    a = cqs(fronts[0])
    assert status_of(lambda: a.dequeue(unique("nope"))) == grpc.StatusCode.NOT_FOUND
    for bad in ("", "a/b", "dto:x"):

        def configure(name: str = bad) -> None:
            a.configure(name, ["x"])

        assert status_of(configure) == grpc.StatusCode.INVALID_ARGUMENT
    queue, dto = unique("bad"), unique("t.v1")
    a.configure(queue, [dto])
    assert status_of(lambda: a.dequeue(queue, max_notifications=0)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    # a publication that does not parse is refused by the front, nothing written
    assert status_of(lambda: a.publish_raw(dto, b"{not json")) == grpc.StatusCode.INVALID_ARGUMENT
    assert [k for k in a.published_keys(dto) if b"/p/" in k] == []
    # a config with a cqs object put straight is refused: fronts make CQS queues
    put = rpc_pb2.PutRequest(key=f"/q/{unique('raw')}/config".encode(), value=b'{"cqs": {}}')
    assert status_of(lambda: a.kv.Put(put, timeout=WAIT)) == grpc.StatusCode.INVALID_ARGUMENT


def test_the_dispatching_front_killed_another_rebuilds_the_queue_from_etcd(
    fronts: list[FrontProcess], cluster: EtcdCluster
) -> None:
    a, b = cqs(fronts[0]), cqs(fronts[1])
    queue, dto = unique("takeover"), unique("storeesl.v1")
    a.configure(queue, [dto])
    for n in range(6):
        b.publish(dto, f"t/a/s/{n % 2}/esls/{n}", SLA.format(n))
    taken_in(cluster, dto, queue)
    held = dequeue_until(a, queue, 1, max_notifications=1)[0]
    assert held.dto_id == "t/a/s/0/esls/0"
    holder = dispatcher_of(cluster, queue)
    victim = next(f for f in fronts if holder.endswith(b":%d" % f.port))
    survivor = cqs(next(f for f in fronts if f is not victim))
    victim.kill()
    # pending, in order, through the survivor; the held one stays held
    got = dequeue_until(survivor, queue, 5, max_notifications=1)
    assert ids(got) == [f"t/a/s/{n % 2}/esls/{n}" for n in range(1, 6)]
    assert dispatcher_of(cluster, queue) != holder
    assert survivor.token_status(queue, held.ack_token) == grpc.StatusCode.CANCELLED
    survivor.ack(queue, [held.ack_token, *(n.ack_token for n in got)])
    wait_for("rows gone", lambda: not etcd_keys(cluster, f"/q/{queue}/n/".encode()))


def scrape(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=WAIT) as answer:
        return str(answer.read().decode())


def test_every_front_shows_the_cqs_figures_and_which_front_dispatches(
    cluster: EtcdCluster, fronts: list[FrontProcess], tmp_path: Path
) -> None:
    a, b = cqs(fronts[0]), cqs(fronts[1])
    queue, dto = unique("figures"), unique("storeesl.v1")
    a.configure(queue, [dto])
    for n in range(3):
        b.publish(dto, f"t/a/s/x/esls/{n}", SLA.format(n))
    held = dequeue_until(a, queue, 1, max_notifications=1)
    metrics_port = free_port()
    watcher = FrontProcess(
        tmp_path / "front3.etcd",
        cluster.endpoints,
        ["--listen-metrics-urls", f"http://127.0.0.1:{metrics_port}"],
    ).start()
    try:
        wanted = [
            f'queue_server_cqs_pending{{queue="{queue}"}} 2.0',
            f'queue_server_cqs_in_flight{{queue="{queue}"}} 1.0',
        ]
        deadline = time.monotonic() + WAIT
        while True:
            text = scrape(metrics_port, "/metrics")
            if all(line in text for line in wanted):
                break
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.2)  # the figures are written once a second: nothing to await
        holder = dispatcher_of(cluster, queue).decode()
        assert f'queue_server_queue_dispatcher{{front="{holder}",queue="{queue}"}} 1.0' in text
        assert f'queue_server_cqs_sla_lag_seconds{{queue="{queue}"}}' in text
        published = [line for line in text.splitlines() if line.startswith("queue_server_cqs_pub")]
        assert published and float(published[-1].split()[-1]) >= 3, published
        state = json.loads(scrape(metrics_port, "/api/state"))
        (row,) = [q for q in state["cqs"] if q["name"] == queue]
        assert row["pending"] == 2 and row["in_flight"] == 1 and row["dispatcher"] == holder
        assert row["subscriptions"] == [{"dto_type": dto, "alias_name": ""}]
    finally:
        watcher.stop()
        a.ack(queue, [n.ack_token for n in held])


class CqsLedger:
    """What the producer and the consumers of the chaos test saw."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.produced: set[str] = set()
        self.received: set[str] = set()
        self.acked: set[str] = set()
        self.unsure: set[str] = set()
        """Received, and their acknowledgement never answered (the consumer's
        front died): acknowledged, or back after the timeout, never stuck."""
        self.holding: dict[str, tuple[str, float]] = {}
        self.violations: list[str] = []


def consume(front: FrontProcess, queue: str, label: str, ledger: CqsLedger) -> threading.Event:
    """A consumer loop through `front` in a thread of its own: dequeue, note, ack.
    Errors (a member or a front gone) are retried, bounded by the test's waits."""
    stop = threading.Event()
    c = cqs(front)

    def run() -> None:
        while not stop.is_set():
            try:
                batch = c.dequeue(queue, max_notifications=20, wait_ms=300)
            except grpc.RpcError:
                time.sleep(0.2)
                continue
            now = time.monotonic()
            with ledger.lock:
                for n in batch:
                    held = ledger.holding.get(n.dto_id)
                    # a holder past the visibility timeout may lose it: that is redelivery
                    if held is not None and held[0] != label and now - held[1] < VISIBILITY - 0.5:
                        ledger.violations.append(f"{n.dto_id} held by {held[0]} and {label}")
                    ledger.holding[n.dto_id] = (label, now)
                    ledger.received.add(n.dto_id)
            for _ in range(20):
                try:
                    c.ack(queue, [n.ack_token for n in batch])
                    break
                except grpc.RpcError:
                    time.sleep(0.3)
            else:  # no answer: applied, or they come back after the timeout
                with ledger.lock:
                    ledger.unsure.update(n.dto_id for n in batch)
                continue
            with ledger.lock:
                for n in batch:
                    if ledger.holding.get(n.dto_id, ("",))[0] == label:
                        del ledger.holding[n.dto_id]
                    ledger.acked.add(n.dto_id)

    threading.Thread(target=run, daemon=True).start()
    return stop


def test_nothing_published_is_lost_when_etcds_leader_and_the_dispatching_front_die(
    cluster: EtcdCluster, fronts: list[FrontProcess], tmp_path: Path
) -> None:
    a, b = fronts
    queue, dto, count = unique("chaos"), unique("storeesl.v1"), 240
    cqs(a).configure(queue, [dto])
    assert cqs(b).dequeue(queue) == []  # the queue has its dispatcher, on a or b
    publisher = FrontProcess(tmp_path / "front3.etcd", cluster.endpoints).start()
    ledger = CqsLedger()
    stops = {f.port: consume(f, queue, f"on-{f.port}", ledger) for f in fronts}

    def publish_all() -> None:
        p = cqs(publisher)
        for i in range(count):
            dto_id = f"t/a/s/{i % 7}/esls/{i}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:  # a retry puts the same key again: one publication either way
                    p.publish_raw(dto, publication(dto_id, SLA.format(i % 10)), key=f"m{i}")
                except grpc.RpcError:
                    time.sleep(0.2)
                    continue
                with ledger.lock:
                    ledger.produced.add(dto_id)
                break

    def published_at_least(n: int) -> None:
        deadline = time.monotonic() + 60
        while len(ledger.produced) < n:
            assert time.monotonic() < deadline, f"{len(ledger.produced)} of {n} published"
            time.sleep(0.02)  # the publisher thread's progress: nothing to await

    producer = threading.Thread(target=publish_all, daemon=True)
    producer.start()
    leader = cluster.leader()
    try:
        published_at_least(60)
        cluster.kill(leader)  # SIGKILL etcd's leader mid-stream
        published_at_least(120)
        cluster.restart(leader)
        published_at_least(170)
        holder = dispatcher_of(cluster, queue)
        victim = next(f for f in fronts if holder.endswith(b":%d" % f.port))
        stops[victim.port].set()
        victim.kill()  # the dispatching front, a consumer's front too, mid-stream
        producer.join(90)
        assert not producer.is_alive()
        assert len(ledger.produced) == count
        deadline = time.monotonic() + 60
        while not ledger.produced <= ledger.acked | ledger.unsure:
            missing = sorted(ledger.produced - ledger.acked - ledger.unsure)
            assert time.monotonic() < deadline, (
                f"{len(missing)} published never acknowledged: {missing[:5]}; in etcd: "
                f"{etcd_keys(cluster, f'/q/{queue}/'.encode())[:20]} "
                f"{etcd_keys(cluster, f'/q/dto:{dto}/'.encode())[:20]}"
            )
            time.sleep(0.05)  # the consumers' progress: nothing to await
        assert ledger.produced <= ledger.received  # delivered, every one
        # and nothing left: the unsure ones were acknowledged, or came back and were
        wait_for("rows gone", lambda: not etcd_keys(cluster, f"/q/{queue}/n/".encode()))
    finally:
        for stop in stops.values():
            stop.set()
        publisher.stop()
        member = cluster.members[leader]
        if member.proc is None or member.proc.poll() is not None:
            cluster.restart(leader)
    assert ledger.violations == []


def test_deleting_the_config_deletes_the_queue_as_embedded(
    fronts: list[FrontProcess], cluster: EtcdCluster
) -> None:
    a, b = cqs(fronts[0]), cqs(fronts[1])
    queue, dto = unique("gone"), unique("storeesl.v1")
    a.configure(queue, [dto])
    a.publish(dto, "t/a/s/x/esls/1", SLA.format(1))
    taken_in(cluster, dto, queue)
    b.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=f"/q/{queue}/config".encode()), timeout=WAIT)
    wait_for(
        "the queue's keys, index entry and subscription gone",
        lambda: (
            not etcd_keys(cluster, f"/q/{queue}/".encode())
            and not etcd_keys(cluster, f"/queue-server/cqs/{queue}".encode())
            and not etcd_keys(cluster, f"/q/dto:{dto}/sub/".encode())
        ),
    )
    assert status_of(lambda: b.dequeue(queue)) == grpc.StatusCode.NOT_FOUND
    # published to afterwards: dropped, as with no subscriber embedded
    b.publish(dto, "t/a/s/x/esls/2", SLA.format(2))
    wait_for("dropped", lambda: not etcd_keys(cluster, f"/q/dto:{dto}/p/".encode()))
    assert not etcd_keys(cluster, f"/q/{queue}/".encode())
