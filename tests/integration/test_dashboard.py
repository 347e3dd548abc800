"""The queue dashboard at `/`, driven in headless Chromium (Debian's `chromium`,
through Playwright) against a real server with real traffic, at 1280 and 1920 px:
the page fits, its charts have the server's history on first load, the numbers it
shows match what etcd reads of the same server say and follow live changes, a
backlog with no consumer is highlighted, idle queues fold away, settings, alarms
and quota are shown, and the redrive button puts dead letters back (etcdctl sees
them in the queue). The redrive Txn is also tested with etcdctl alone, and the
redrive endpoint's refusals with plain HTTP.

A redrive sent to a follower is replicated to every member.

`DASHBOARD_SCREENSHOTS=docs` also saves `docs/dashboard.png` (1280 px) and
`docs/dashboard-1920.png` there."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from tests.support.cluster import Cluster
from tests.support.processes import ServerProcess, free_port
from tests.support.queue_consumer import WatchConsumer

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
if CHROMIUM is None:  # pragma: no cover - CI installs Debian's chromium
    pytest.skip("Debian's chromium is not installed", allow_module_level=True)

WAIT_MS = 15_000
WAIT_S = 15.0
WIDTHS = (1280, 1920)
QUOTA = 64 * 1024 * 1024


def count(kv: rpc_pb2_grpc.KVStub, key: bytes, end: bytes) -> int:
    request = rpc_pb2.RangeRequest(key=key, range_end=end, count_only=True)
    return int(kv.Range(request, timeout=5).count)


def messages(kv: rpc_pb2_grpc.KVStub, name: str) -> int:
    """The depth of queue `name` as an etcd count of its message keys."""
    return count(kv, f"/q/{name}/0".encode(), f"/q/{name}/:".encode())


def wait_until(what: str, check: Any, timeout: float = WAIT_S) -> Any:
    """Poll `check()` until it returns something true (bounded); returns it."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def http(
    port: int, path: str, body: Any = None, method: str = "GET", content_type: str | None = None
) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one request to the metrics listener."""
    data = (
        None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    if content_type is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def redrive(port: int, body: Any) -> tuple[int, Any]:
    return http(port, "/api/redrive", body, "POST", "application/json")


def state(port: int) -> dict[str, Any]:
    status, body = http(port, "/api/state")
    assert status == 200
    return body  # type: ignore[no-any-return]


def row(s: dict[str, Any], name: str) -> dict[str, Any]:
    return next(q for q in s["queues"] if q["name"] == name)


def dead_letter(channel: grpc.Channel, name: str, n: int) -> None:
    """`n` messages of queue `name` (max_deliveries 1) taken by a consumer that then
    goes away: each failed delivery moves it to `{name}.dead`."""
    kv = rpc_pb2_grpc.KVStub(channel)
    kv.Put(rpc_pb2.PutRequest(key=f"/q/{name}/config".encode(), value=b'{"max_deliveries": 1}'))
    for i in range(n):
        kv.Put(rpc_pb2.PutRequest(key=f"/q/{name}/p/m{i}".encode(), value=b"v%d" % i), timeout=5)
    consumer = WatchConsumer(channel, name)
    for _ in range(n):
        consumer.deliveries.get(timeout=WAIT_S)
    consumer.close()
    wait_until(f"{n} dead letters of {name}", lambda: messages(kv, f"{name}.dead") == n)


def etcdctl(endpoint: str, *args: str, stdin: str | None = None) -> str:
    out = subprocess.run(
        ["etcdctl", f"--endpoints={endpoint}", "--dial-timeout=3s", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "ETCDCTL_API": "3"},
        check=True,
    )
    return out.stdout


def inked(page: Any, selector: str, color: tuple[int, int, int]) -> int:
    """Pixels of the canvas at `selector` drawn in (about) `color`: a line that is
    really on screen, not just points counted."""
    return int(
        page.evaluate(
            """([sel, rgb]) => {
              const c = document.querySelector(sel);
              if (!c || !c.width || !c.height) return 0;
              const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
              let n = 0;
              for (let i = 0; i < d.length; i += 4)
                if (d[i + 3] > 128 && Math.abs(d[i] - rgb[0]) + Math.abs(d[i + 1] - rgb[1])
                    + Math.abs(d[i + 2] - rgb[2]) < 60) n++;
              return n;
            }""",
            [selector, list(color)],
        )
    )


BLUE, GREEN = (0x1F, 0x6F, 0xEB), (0x0A, 0x7A, 0x3D)
"""The page's produced/s and acked/s line colours."""


def fits(page: Any) -> None:
    """Nothing sticks out: not the document, and no table out of its section."""
    width = page.evaluate("window.innerWidth")
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    overflowing = page.evaluate(
        """() => [...document.querySelectorAll('section')]
             .filter((s) => s.scrollWidth > s.clientWidth + 1)
             .map((s) => s.querySelector('h2, summary')?.textContent.trim().slice(0, 40))"""
    )
    assert overflowing == []


def test_the_dashboard_shows_the_servers_queues_live(tmp_path: Path) -> None:
    http_port = free_port()
    srv = ServerProcess(
        tmp_path / "d.etcd",
        extra_args=[
            "--listen-metrics-urls",
            f"http://127.0.0.1:{http_port}",
            "--quota-backend-bytes",
            str(QUOTA),
        ],
    ).start()
    channel = grpc.insecure_channel(srv.endpoint)
    consumer: WatchConsumer | None = None
    try:
        kv = rpc_pb2_grpc.KVStub(channel)
        # a queue that is set up and never used: it folds away
        kv.Put(rpc_pb2.PutRequest(key=b"/q/old/config", value=b'{"prefetch": 8}'), timeout=5)
        for i in range(10):
            kv.Put(rpc_pb2.PutRequest(key=b"/q/jobs/p/m%d" % i, value=b"work"), timeout=5)
        consumer = WatchConsumer(channel, "jobs")
        delivered = [consumer.deliveries.get(timeout=10) for _ in range(10)]
        for key in delivered[:4]:
            kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=5)
        # a backlog nobody consumes
        for i in range(2):
            kv.Put(rpc_pb2.PutRequest(key=b"/q/orphans/p/o%d" % i, value=b"x"), timeout=5)
        dead_letter(channel, "failing", 3)
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
        depth = messages(kv, "jobs")
        consumers = count(kv, b"/q/jobs/c/", b"/q/jobs/c0")
        assert (depth, consumers) == (6, 1)
        # the server has sampled a few seconds of history before the page opens
        wait_until("history", lambda: len(row(state(http_port), "jobs")["history"]["t"]) >= 3)

        shots = os.environ.get("DASHBOARD_SCREENSHOTS")
        with playwright_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            pages = {}
            for width in WIDTHS:
                # ?idle=1: fold queues quiet for a second, not five minutes
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(f"http://127.0.0.1:{http_port}/?idle=1", timeout=WAIT_MS)
                page.wait_for_selector("body[data-updated]", timeout=WAIT_MS)
                pages[width] = page

            for page in pages.values():

                def shown(queue_name: str, field: str, page: Any = page) -> str:
                    table = "#cqs" if queue_name == "esl" else "#queues"
                    sel = f'{table} [data-queue="{queue_name}"][data-field="{field}"]'
                    return str(page.locator(sel).inner_text(timeout=WAIT_MS))

                # history on first load: the first render already has a line
                assert int(page.evaluate("document.body.dataset.firstChartPoints")) >= 2
                spark = page.locator('canvas.spark[data-queue="jobs"]')
                assert int(spark.get_attribute("data-points") or 0) >= 2
                # the produce and ack bursts before the page opened are drawn
                assert inked(page, "#chart", BLUE) > 20 and inked(page, "#chart", GREEN) > 20
                jobs_spark = 'canvas.spark[data-queue="jobs"]'
                assert inked(page, jobs_spark, BLUE) > 5 and inked(page, jobs_spark, GREEN) > 5
                assert shown("jobs", "depth") == str(depth)
                assert shown("jobs", "in_flight") == "6"
                assert shown("jobs", "pending") == "0"
                assert shown("jobs", "consumers") == str(consumers)
                assert shown("jobs", "produced") == "10"
                assert shown("jobs", "acked") == "4"
                assert shown("jobs", "delivered") == "10"
                assert shown("jobs", "consumer_members") == "d.etcd x1"
                assert "prefetch 64" in shown("jobs", "settings")
                assert "dead letter jobs.dead" in shown("jobs", "settings")
                assert shown("esl", "pending") == "3"
                assert shown("esl", "in_flight") == "0"
                assert shown("esl", "sla_lag").endswith(" d")  # the SLA was years ago
                assert page.locator("#leader").inner_text() == "d.etcd"
                # a backlog with no consumer is flagged; one being consumed is not
                orphans = page.locator('#queues tr.main[data-queue="orphans"]')
                assert "no-consumer" in (orphans.get_attribute("class") or "")
                assert orphans.locator('[data-flag="no-consumer"]').is_visible()
                assert shown("orphans", "oldest_pending").endswith(" s")
                assert page.locator("#total-orphaned").inner_text() == "1"
                assert page.locator("#total-dead").inner_text() == "3"
                jobs_class = page.locator('#queues tr.main[data-queue="jobs"]').get_attribute(
                    "class"
                )
                assert "no-consumer" not in (jobs_class or "")
                # dead letters, counted on their queue
                assert shown("failing", "dead_letters") == "3"
                assert shown("failing", "dead_lettered") == "3"
                assert "max deliveries 1" in shown("failing", "settings")
                # the dead-letter queue itself is labelled, not flagged
                dead_row = page.locator('#queues tr.main[data-queue="failing.dead"]')
                assert "dead letters of failing" in dead_row.inner_text()
                assert "no-consumer" not in (dead_row.get_attribute("class") or "")
                # alarms, quota
                assert page.locator("#alarms").inner_text() == "none"
                assert "of 64.0 MiB" in page.locator("#quota").inner_text()
                # an idle queue folds away, with its settings
                assert page.locator('#queues [data-queue="old"]').count() == 0
                assert page.locator("#idle-count").inner_text() == "1"
                assert not page.locator('#idle-queues [data-queue="old"]').first.is_visible()
                page.locator("#idle summary").click()
                idle_settings = page.locator(
                    '#idle-queues [data-queue="old"][data-field="settings"]'
                )
                assert "prefetch 8" in idle_settings.inner_text()
                fits(page)

            # live: rates and counters follow traffic without a reload
            page = pages[1280]
            for i in range(5):
                kv.Put(rpc_pb2.PutRequest(key=b"/q/jobs/p/late%d" % i, value=b"w"), timeout=5)
            for key in delivered[4:6]:
                kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=key), timeout=5)
            page.wait_for_function(
                """() => {
                  const q = (f) => document.querySelector(
                    `#queues [data-queue="jobs"][data-field="${f}"]`)?.textContent;
                  return q("acked") === "6" && q("produced") === "15" && q("depth") === "9";
                }""",
                timeout=WAIT_MS,
            )
            assert messages(kv, "jobs") == 9
            # the rates of that traffic showed up at some poll; the chart has them
            page.wait_for_function(
                """() => Math.max(...[...document.querySelectorAll('canvas.chart, canvas.spark')]
                   .map((c) => Number(c.dataset.points || 0))) >= 3""",
                timeout=WAIT_MS,
            )
            s = state(http_port)
            assert row(s, "jobs")["produced"] == 15
            for width, page in pages.items():
                fits(page)
                if shots:
                    name = "dashboard.png" if width == 1280 else f"dashboard-{width}.png"
                    page.screenshot(path=str(Path(shots) / name), full_page=True)
            page = pages[1280]

            # redrive two of the three dead letters with the button
            page.locator('#queues input.count[data-queue="failing"]').fill("2")
            page.locator('#queues button[data-action="redrive"][data-queue="failing"]').click()
            page.wait_for_function("() => document.body.dataset.redrives === '1'", timeout=WAIT_MS)
            result = page.locator("#redrive-result").inner_text()
            assert "2 dead letters moved back from failing.dead" in result, result
            keys = etcdctl(srv.endpoint, "get", "--prefix", "--keys-only", "/q/failing/")
            moved = sorted(k.rsplit("/", 1)[1] for k in keys.split() if "/q/failing/0" in k)
            assert moved == ["m0", "m1"]  # the oldest two, back in the queue
            assert messages(kv, "failing.dead") == 1
            page.wait_for_function(
                """() => document.querySelector(
                  '#queues [data-queue="failing"][data-field="dead_letters"]')?.textContent === '1'""",
                timeout=WAIT_MS,
            )
            # nobody consumes them now: the backlog is flagged
            page.wait_for_selector(
                '#queues tr.main.no-consumer[data-queue="failing"]', timeout=WAIT_MS
            )

            # an alarm shows; a redrive refused by it moves nothing and says why
            maintenance = rpc_pb2_grpc.MaintenanceStub(channel)
            member_id = maintenance.Status(rpc_pb2.StatusRequest(), timeout=5).header.member_id
            alarm = rpc_pb2.AlarmRequest(
                action=rpc_pb2.AlarmRequest.ACTIVATE, memberID=member_id, alarm=rpc_pb2.NOSPACE
            )
            maintenance.Alarm(alarm, timeout=5)
            page.wait_for_function(
                "() => document.getElementById('alarms').textContent.startsWith('NOSPACE on ')",
                timeout=WAIT_MS,
            )
            assert "warn" in (page.locator("#alarms").get_attribute("class") or "")
            status, body = redrive(http_port, {"queue": "failing"})
            assert status == 409 and body["moved"] == 0, body
            assert "space exceeded" in body["error"]
            assert messages(kv, "failing.dead") == 1
            alarm.action = rpc_pb2.AlarmRequest.DEACTIVATE
            maintenance.Alarm(alarm, timeout=5)

            # the rest with an empty count: all of them
            page.wait_for_function(
                "() => document.getElementById('alarms').textContent === 'none'",
                timeout=WAIT_MS,
            )
            page.locator('#queues button[data-action="redrive"][data-queue="failing"]').click()
            page.wait_for_function("() => document.body.dataset.redrives === '2'", timeout=WAIT_MS)
            assert "1 dead letter moved back" in page.locator("#redrive-result").inner_text()
            assert messages(kv, "failing.dead") == 0
            assert messages(kv, "failing") == 3
            page.wait_for_selector(
                '#queues button[data-action="redrive"][data-queue="failing"]:disabled',
                timeout=WAIT_MS,
            )

            for page in pages.values():
                fits(page)
            browser.close()
    finally:
        if consumer is not None:
            consumer.close()
        channel.close()
        srv.stop()


def test_a_redrive_is_one_etcd_txn_per_dead_letter(tmp_path: Path) -> None:
    """The documented Txn, sent with etcdctl alone: the dead letter leaves the
    dead-letter queue and is produced again on its queue, where a consumer gets
    it; the same Txn again changes nothing."""
    srv = ServerProcess(tmp_path / "t.etcd").start()
    channel = grpc.insecure_channel(srv.endpoint)
    consumer: WatchConsumer | None = None
    try:
        kv = rpc_pb2_grpc.KVStub(channel)
        dead_letter(channel, "mail", 2)
        dead = json.loads(etcdctl(srv.endpoint, "get", "--prefix", "/q/mail.dead/", "-w", "json"))
        first = dead["kvs"][0]
        dead_key = base64.b64decode(first["key"]).decode()
        assert dead_key == "/q/mail.dead/0000000000000001/m0"
        txn = (
            f'create("{dead_key}") = "{first["create_revision"]}"\n'
            "\n"
            f"del {dead_key}\n"
            'put /q/mail/p/m0 "v0"\n'
            "\n"
            "\n"
        )
        out = etcdctl(srv.endpoint, "txn", stdin=txn)
        assert out.splitlines()[0] == "SUCCESS", out
        # back in the queue as its next message (idx 3: m0 and m1 were 1 and 2)
        assert etcdctl(srv.endpoint, "get", "--prefix", "/q/mail/0").split() == [
            "/q/mail/0000000000000003/m0",
            "v0",
        ]
        assert messages(kv, "mail.dead") == 1
        # a retried redrive moves nothing twice
        out = etcdctl(srv.endpoint, "txn", stdin=txn)
        assert out.splitlines()[0] == "FAILURE", out
        assert messages(kv, "mail") == 1 and messages(kv, "mail.dead") == 1
        # it is an ordinary message again: delivered with a fresh count
        consumer = WatchConsumer(channel, "mail")
        assert consumer.deliveries.get(timeout=WAIT_S) == b"/q/mail/0000000000000003/m0"
    finally:
        if consumer is not None:
            consumer.close()
        channel.close()
        srv.stop()


def test_the_redrive_endpoint_refuses_bad_requests(tmp_path: Path) -> None:
    """Every refusal is a 4xx with a message, and moves nothing; with auth
    enabled the endpoint refuses everything."""
    http_port = free_port()
    srv = ServerProcess(
        tmp_path / "r.etcd", extra_args=["--listen-metrics-urls", f"http://127.0.0.1:{http_port}"]
    ).start()
    channel = grpc.insecure_channel(srv.endpoint)
    try:
        kv = rpc_pb2_grpc.KVStub(channel)
        dead_letter(channel, "jobs", 2)
        cases: list[tuple[Any, int, str]] = [
            ({"queue": "a/b"}, 400, "is not one segment"),
            ({"queue": ""}, 400, "is not one segment"),
            ({"queue": 7}, 400, "queue must be a queue name"),
            ({}, 400, "queue must be a queue name"),
            ({"queue": "nope"}, 404, "no queue named 'nope'"),
            ({"queue": "jobs", "count": 0}, 400, "count must be a whole number"),
            ({"queue": "jobs", "count": -1}, 400, "count must be a whole number"),
            ({"queue": "jobs", "count": 1.5}, 400, "count must be a whole number"),
            ({"queue": "jobs", "count": "2"}, 400, "count must be a whole number"),
            ({"queue": "jobs", "count": True}, 400, "count must be a whole number"),
            ({"queue": "jobs", "count": 10**9}, 400, "count must be a whole number"),
            ({"queue": "jobs", "limit": 1}, 400, "unknown field 'limit'"),
            (["jobs"], 400, "must be a JSON object"),
            (b"{not json", 400, "must be a JSON object"),
        ]
        for body, status, message in cases:
            got, answer = redrive(http_port, body)
            assert (got, message in answer["error"]) == (status, True), (body, got, answer)
        got, answer = http(http_port, "/api/redrive", {"queue": "jobs"}, "POST", "text/plain")
        assert got == 415 and "Content-Type: application/json" in answer["error"]
        got, answer = http(http_port, "/api/redrive", b"x" * 5000, "POST", "application/json")
        assert got == 413
        assert http(http_port, "/api/redrive")[0] == 405
        assert messages(kv, "jobs.dead") == 2 and messages(kv, "jobs") == 0

        # auth on: the listener has no credentials to check, so no redrive at all
        etcdctl(srv.endpoint, "user", "add", "root", "--new-user-password=rootpw")
        etcdctl(srv.endpoint, "auth", "enable")
        got, answer = redrive(http_port, {"queue": "jobs"})
        assert got == 403 and "refused while auth is enabled" in answer["error"]
        assert state(http_port)["auth_enabled"] is True
        assert messages_as_root(srv.endpoint, "jobs.dead") == 2
    finally:
        channel.close()
        srv.stop()


def messages_as_root(endpoint: str, name: str) -> int:
    out = etcdctl(
        endpoint, "--user=root:rootpw", "get", f"/q/{name}/0", f"/q/{name}/:", "--keys-only"
    )
    return len(out.split())


def test_a_redrive_sent_to_a_follower_is_replicated(tmp_path: Path) -> None:
    """POST /api/redrive on a follower's metrics listener: the Txns go through
    Raft like a client's, so every member has the dead letters back in the queue."""
    ports = {f"n{i}": free_port() for i in (1, 2, 3)}
    cluster = Cluster(
        tmp_path,
        member_args={
            name: ["--listen-metrics-urls", f"http://127.0.0.1:{port}"]
            for name, port in ports.items()
        },
    ).start()
    try:
        leader = cluster.wait_leader()
        follower = next(m for m in cluster.members if m is not leader)
        with leader.channel() as channel:
            dead_letter(channel, "jobs", 2)
        got, answer = redrive(ports[follower.data_dir.name], {"queue": "jobs"})
        assert (got, answer["moved"]) == (200, 2), answer
        for member in cluster.members:
            with member.channel() as channel:
                kv = rpc_pb2_grpc.KVStub(channel)
                assert (messages(kv, "jobs"), messages(kv, "jobs.dead")) == (2, 0)
            port = ports[member.data_dir.name]
            wait_until(
                f"{member.data_dir.name} shows no dead letters",
                lambda port=port: row(state(port), "jobs")["dead_letters"] == 0,
            )
    finally:
        cluster.stop()
