"""The queue dashboard at `/`, driven in headless Chromium (Debian's `chromium`,
through Playwright) against a real server with real traffic: the numbers the page
shows match what etcd reads of the same server say, and they follow live changes.

`DASHBOARD_SCREENSHOT=docs/dashboard.png` also saves a screenshot there."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import grpc
import pytest

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess, free_port
from tests.support.queue_consumer import WatchConsumer

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
if CHROMIUM is None:  # pragma: no cover - CI installs Debian's chromium
    pytest.skip("Debian's chromium is not installed", allow_module_level=True)

WAIT_MS = 15_000


def count(kv: rpc_pb2_grpc.KVStub, key: bytes, end: bytes) -> int:
    return kv.Range(rpc_pb2.RangeRequest(key=key, range_end=end, count_only=True), timeout=5).count


def test_the_dashboard_shows_the_servers_queues_live(tmp_path: Path) -> None:
    http_port = free_port()
    srv = ServerProcess(
        tmp_path / "d.etcd",
        extra_args=["--listen-metrics-urls", f"http://127.0.0.1:{http_port}"],
    ).start()
    channel = grpc.insecure_channel(srv.endpoint)
    consumer: WatchConsumer | None = None
    try:
        kv = rpc_pb2_grpc.KVStub(channel)
        for i in range(10):
            kv.Put(rpc_pb2.PutRequest(key=b"/q/jobs/p/m%d" % i, value=b"work"), timeout=5)
        consumer = WatchConsumer(channel, "jobs")
        delivered = [consumer.deliveries.get(timeout=10) for _ in range(10)]
        for key in delivered[:4]:
            kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=5)
        cqs = cqs_pb2_grpc.DtoChangeQueueServiceStub(channel)
        cqs.CreateOrConfigureQueue(
            cqs_pb2.CreateOrConfigureQueueRequest(
                queue_name="esl", subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type="esl.v1")]
            ),
            timeout=5,
        )
        for i in range(3):
            value = {"dto_id": f"t/s/{i}", "sla_timestamp": "2020-01-01T00:00:00Z"}
            kv.Put(
                rpc_pb2.PutRequest(key=b"/q/dto:esl.v1/p/x", value=json.dumps(value).encode()),
                timeout=5,
            )
        # what etcd reads say
        depth = count(kv, b"/q/jobs/0", b"/q/jobs/:")
        consumers = count(kv, b"/q/jobs/c/", b"/q/jobs/c0")
        assert (depth, consumers) == (6, 1)

        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"http://127.0.0.1:{http_port}/", timeout=WAIT_MS)

            def shown(queue_name: str, field: str) -> str:
                sel = f'#queues td[data-queue="{queue_name}"][data-field="{field}"]'
                if queue_name == "esl":
                    sel = f'#cqs td[data-queue="{queue_name}"][data-field="{field}"]'
                return page.locator(sel).inner_text(timeout=WAIT_MS)

            page.wait_for_selector('#queues td[data-queue="jobs"]', timeout=WAIT_MS)
            assert shown("jobs", "depth") == str(depth)
            assert shown("jobs", "in_flight") == "6"
            assert shown("jobs", "pending") == "0"
            assert shown("jobs", "consumers") == str(consumers)
            assert shown("jobs", "acked") == "4"
            assert shown("jobs", "delivered") == "10"
            assert shown("jobs", "consumer_members") == "d.etcd x1"
            assert shown("esl", "pending") == "3"
            assert shown("esl", "in_flight") == "0"
            assert shown("esl", "sla_lag").endswith(" d")  # the SLA was years ago
            assert page.locator("#leader").inner_text() == "d.etcd"

            # live: two more acks and a new message show without a reload
            for key in delivered[4:6]:
                kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=5)
            kv.Put(rpc_pb2.PutRequest(key=b"/q/jobs/p/late", value=b"work"), timeout=5)
            page.wait_for_function(
                """() => {
                  const q = (f) => document.querySelector(
                    `#queues td[data-queue="jobs"][data-field="${f}"]`)?.textContent;
                  return q("acked") === "6" && q("depth") === "5" && q("delivered") === "11";
                }""",
                timeout=WAIT_MS,
            )
            assert count(kv, b"/q/jobs/0", b"/q/jobs/:") == 5
            shot = os.environ.get("DASHBOARD_SCREENSHOT")
            if shot:
                time.sleep(3)  # a few polls, so the rate chart has a line to show
                page.screenshot(path=shot, full_page=True)
            browser.close()
    finally:
        if consumer is not None:
            consumer.close()
        channel.close()
        srv.stop()
