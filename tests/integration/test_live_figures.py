"""Live figures from real servers (issue 17, items 1 and 2), read from /metrics.

- A CQS notification dequeued and never acknowledged shows as pending again
  within about a second of its visibility timeout, with no further call: the
  server's own clock proposes the expiry.
- The age of the oldest pending etcd-key queue message is a replicated produce
  time: it goes on counting across a kill -9 and restart (WAL replay and a
  snapshot), and every member of a cluster reports the same age, one that was
  restarted after the produce included.

Every wait is a bounded poll of a scrape, never a sleep standing in for an event.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from tests.support.cluster import Cluster
from tests.support.processes import ServerProcess, free_port

pytestmark = pytest.mark.integration

WAIT = 15.0
"""Seconds any one wait may take."""
VISIBILITY = 1.0
"""--cqs-visibility-timeout of the CQS test, seconds."""
AGE = "queue_server_queue_oldest_pending_age_seconds"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200
        text = resp.read().decode()
    finally:
        conn.close()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(port: int, name: str, **labels: str) -> float | None:
    return scrape(port).get((name, tuple(sorted(labels.items()))))


def poll(what: str, check: Callable[[], bool], timeout: float = WAIT) -> float:
    """Poll `check` until it holds (bounded); returns when it first held."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)  # the poll's period, not a synchronisation
    return time.monotonic()


@pytest.fixture
def metrics_port() -> int:
    return free_port()


def server(data_dir: Path, port: int, metrics_port: int, *args: str) -> ServerProcess:
    return ServerProcess(
        data_dir,
        port=port,
        extra_args=["--listen-metrics-urls", f"http://127.0.0.1:{metrics_port}", *args],
    )


@pytest.fixture
def cqs_server(tmp_path: Path, metrics_port: int) -> Iterator[ServerProcess]:
    srv = server(
        tmp_path / "cqs.etcd",
        free_port(),
        metrics_port,
        "--cqs-visibility-timeout",
        f"{VISIBILITY:g}s",
    ).start()
    yield srv
    srv.stop()


def publish_and_dequeue(endpoint: str) -> tuple[float, float]:
    """A CQS queue `live` with one notification (SLA a minute ago), dequeued
    and never acknowledged; (before, after) the dequeue, monotonic."""
    with grpc.insecure_channel(endpoint) as ch:
        cqs = cqs_pb2_grpc.DtoChangeQueueServiceStub(ch)
        cqs.CreateOrConfigureQueue(
            cqs_pb2.CreateOrConfigureQueueRequest(
                queue_name="live", subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type="o.v1")]
            ),
            timeout=5,
        )
        sla = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 60))
        rpc_pb2_grpc.KVStub(ch).Put(
            rpc_pb2.PutRequest(
                key=b"/q/dto:o.v1/p/x",
                value=json.dumps({"dto_id": "t/1", "sla_timestamp": sla}).encode(),
            ),
            timeout=5,
        )
        before = time.monotonic()
        got = cqs.BatchDequeue(
            cqs_pb2.BatchDequeueRequest(queue_name="live", max_notifications=1), timeout=5
        )
        after = time.monotonic()
        assert len(got.notifications) == 1
    return before, after


def test_an_unacknowledged_notification_is_pending_again_with_no_call(
    cqs_server: ServerProcess, metrics_port: int
) -> None:
    before, after = publish_and_dequeue(cqs_server.endpoint)
    # no call from here on: only the server's clock can bring it back
    m = scrape(metrics_port)
    assert m[("queue_server_cqs_in_flight", (("queue", "live"),))] == 1
    assert m[("queue_server_cqs_pending", (("queue", "live"),))] == 0
    assert m[("queue_server_cqs_sla_lag_seconds", (("queue", "live"),))] == 0  # none pending

    back = poll(
        "the notification pending again",
        lambda: sample(metrics_port, "queue_server_cqs_pending", queue="live") == 1,
    )
    assert before + VISIBILITY - 0.05 <= back <= after + VISIBILITY + 1.0
    m = scrape(metrics_port)
    assert m[("queue_server_cqs_in_flight", (("queue", "live"),))] == 0
    assert 55 < m[("queue_server_cqs_sla_lag_seconds", (("queue", "live"),))] < 120


def test_the_oldest_pending_age_goes_on_across_a_kill_and_restart(
    tmp_path: Path, metrics_port: int
) -> None:
    data_dir, port = tmp_path / "age.etcd", free_port()
    # a checkpoint every 5 entries: the restart reads the backend and the WAL after it
    srv = server(data_dir, port, metrics_port, "--snapshot-count", "5").start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            kv.Put(rpc_pb2.PutRequest(key=b"/q/aging/p/first", value=b"x"), timeout=5)
            for i in range(7):  # past a snapshot
                kv.Put(rpc_pb2.PutRequest(key=b"/other/%d" % i, value=b"v"), timeout=5)
            kv.Put(rpc_pb2.PutRequest(key=b"/q/aging/p/second", value=b"y"), timeout=5)
        poll("a checkpoint written", lambda: "backend checkpoint index=" in srv.log_text())
        poll("the age past a second", lambda: (sample(metrics_port, AGE, queue="aging") or 0) > 1)
        earlier = sample(metrics_port, AGE, queue="aging")
        scraped = time.monotonic()
        assert earlier is not None
    finally:
        srv.kill()
    srv = server(data_dir, port, metrics_port, "--snapshot-count", "5").start()
    try:
        age = sample(metrics_port, AGE, queue="aging")
        since = time.monotonic() - scraped  # more than the restart took
        # the age went on from where it was: not from 0, nor from the restart
        assert age is not None and earlier + since - 0.5 <= age <= earlier + since + 0.5, (
            age,
            earlier,
            since,
        )
        assert sample(metrics_port, "queue_server_queue_pending", queue="aging") == 2
    finally:
        srv.stop()


def test_every_member_reports_the_same_oldest_age(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path).start()
    try:
        leader = cluster.wait_leader()
        follower = next(m for m in cluster.members if m is not leader)
        with grpc.insecure_channel(follower.endpoint) as ch:  # stamped by a follower
            rpc_pb2_grpc.KVStub(ch).Put(
                rpc_pb2.PutRequest(key=b"/q/shared/p/m", value=b"x"), timeout=5
            )
        # /metrics is answered on each member's client port too
        poll(
            "the age past a second on the leader",
            lambda: (sample(leader.port, AGE, queue="shared") or 0) > 1.5,
        )
        # a member restarted after the produce knows its time too
        restarted = next(m for m in cluster.members if m is not leader and m is not follower)
        restarted.kill()
        restarted.start()
        poll(
            "the restarted member caught up",
            lambda: sample(restarted.port, "queue_server_queue_pending", queue="shared") == 1,
        )
        ages = [sample(m.port, AGE, queue="shared") for m in cluster.members]
        assert all(a is not None and a > 1.5 for a in ages), ages
        assert max(ages) - min(ages) < 1.0, ages  # type: ignore[type-var,operator]
    finally:
        cluster.stop()


def test_in_a_cluster_the_leaders_expiry_reaches_every_member(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, extra_args=["--cqs-visibility-timeout", f"{VISIBILITY:g}s"])
    cluster.start()
    try:
        leader = cluster.wait_leader()
        follower = next(m for m in cluster.members if m is not leader)
        _before, after = publish_and_dequeue(follower.endpoint)
        for m in cluster.members:

            def pending_again(port: int = m.port) -> bool:
                return sample(port, "queue_server_cqs_pending", queue="live") == 1

            back = poll(f"pending again on {m.data_dir.name}", pending_again)
            assert back <= after + VISIBILITY + 2.0
            assert sample(m.port, "queue_server_cqs_in_flight", queue="live") == 0
    finally:
        cluster.stop()
