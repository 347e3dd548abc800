"""/metrics on --listen-metrics-urls, scraped from a real server after real traffic:
the gRPC counters count what the client did, by method and status code, and the
etcd and queue gauges say what the server holds (checked against etcd reads)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess, free_port
from tests.support.queue_consumer import WatchConsumer

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("Content-Type", "").startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    finally:
        conn.close()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ServerProcess, int]]:
    port = free_port()
    srv = ServerProcess(
        tmp_path / "m.etcd", extra_args=["--listen-metrics-urls", f"http://127.0.0.1:{port}"]
    ).start()
    yield srv, port
    srv.stop()


def test_metrics_count_rpcs_and_show_the_queues(server: tuple[ServerProcess, int]) -> None:
    srv, port = server
    with grpc.insecure_channel(srv.endpoint) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        for i in range(7):
            kv.Put(rpc_pb2.PutRequest(key=b"k%d" % i, value=b"v"), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            kv.Range(rpc_pb2.RangeRequest(key=b"k0", revision=10_000), timeout=5)
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE

        # an etcd-key queue: 5 messages, a consumer that takes them and acks 2
        for i in range(5):
            kv.Put(rpc_pb2.PutRequest(key=b"/q/jobs/p/m%d" % i, value=b"x"), timeout=5)
        consumer = WatchConsumer(ch, "jobs")
        delivered = [consumer.deliveries.get(timeout=10) for _ in range(5)]
        for key in delivered[:2]:
            kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=5)

        # a CQS queue with one pending notification, its SLA an hour ago
        cqs = cqs_pb2_grpc.DtoChangeQueueServiceStub(ch)
        cqs.CreateOrConfigureQueue(
            cqs_pb2.CreateOrConfigureQueueRequest(
                queue_name="svc", subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type="a.v1")]
            ),
            timeout=5,
        )
        # (the publication below writes no key: CQS notifications are not MVCC keys)
        keys_now = kv.Range(rpc_pb2.RangeRequest(key=b"\0", range_end=b"\0"), timeout=5).count
        sla = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
        kv.Put(
            rpc_pb2.PutRequest(
                key=b"/q/dto:a.v1/p/x",
                value=json.dumps({"dto_id": "t/1", "sla_timestamp": sla}).encode(),
            ),
            timeout=5,
        )

        deadline = time.monotonic() + 10
        while True:  # the acks' effects are applied before the next scrape answers
            m = scrape(port)
            if value(m, "queue_server_queue_acked_total", queue="jobs") == 2:
                break
            assert time.monotonic() < deadline, "acks never counted"
            time.sleep(0.05)  # poll the scrape, bounded
        consumer.close()

    put = {"grpc_type": "unary", "grpc_service": "etcdserverpb.KV", "grpc_method": "Put"}
    assert value(m, "grpc_server_handled_total", **put, grpc_code="OK") == 13
    assert value(m, "grpc_server_started_total", **put) == 13
    rng = {"grpc_type": "unary", "grpc_service": "etcdserverpb.KV", "grpc_method": "Range"}
    assert value(m, "grpc_server_handled_total", **rng, grpc_code="OutOfRange") == 1
    assert value(m, "etcd_server_has_leader") == 1
    assert value(m, "etcd_server_is_leader") == 1
    assert value(m, "etcd_debugging_mvcc_keys_total") == keys_now
    assert value(m, "etcd_mvcc_db_total_size_in_bytes") > 0

    assert value(m, "queue_server_queue_depth", queue="jobs") == 3
    assert value(m, "queue_server_queue_in_flight", queue="jobs") == 3
    assert value(m, "queue_server_queue_pending", queue="jobs") == 0
    assert value(m, "queue_server_queue_consumers", queue="jobs") == 1
    assert value(m, "queue_server_queue_produced_total", queue="jobs") == 5
    assert value(m, "queue_server_queue_delivered_total", queue="jobs") == 5
    assert value(m, "queue_server_queue_redelivered_total", queue="jobs") == 0

    assert value(m, "queue_server_cqs_pending", queue="svc") == 1
    assert value(m, "queue_server_cqs_in_flight", queue="svc") == 0
    assert 3500 < value(m, "queue_server_cqs_sla_lag_seconds", queue="svc") < 3700
    assert value(m, "queue_server_cqs_published_total") == 1


def test_a_given_back_message_counts_as_redelivered_and_ages(
    server: tuple[ServerProcess, int],
) -> None:
    srv, port = server
    with grpc.insecure_channel(srv.endpoint) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        kv.Put(rpc_pb2.PutRequest(key=b"/q/slow/p/m", value=b"x"), timeout=5)
        got = threading.Event()

        def requests() -> Iterator[rpc_pb2.WatchRequest]:
            key = b"/q/slow/c/" + str(uuid.uuid4()).encode()
            yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=key))
            got.wait(10)  # then the stream ends: the consumer went away unacknowledged

        for resp in rpc_pb2_grpc.WatchStub(ch).Watch(requests()):
            if resp.events:
                got.set()
                break
    deadline = time.monotonic() + 10
    while value(m := scrape(port), "queue_server_queue_redelivered_total", queue="slow") != 1:
        assert time.monotonic() < deadline, "the give-back was never counted"
        time.sleep(0.05)  # poll the scrape, bounded
    assert value(m, "queue_server_queue_pending", queue="slow") == 1
    assert value(m, "queue_server_queue_consumers", queue="slow") == 0
    assert value(m, "queue_server_queue_oldest_pending_age_seconds", queue="slow") > 0
