"""Unit tests of the health listener's I/O-free core (a request's bytes through
h11 and its bounds, routing, etcd's health verdicts on a fake server) and of
--listen-metrics-urls / ETCD_LISTEN_METRICS_URLS."""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

import pytest

from etcdserverpb import rpc_pb2
from queue_server.alarms import AlarmTable
from queue_server.config import ConfigError, parse_config
from queue_server.errors import RequestTimeout, ServerStopped
from queue_server.metrics_listener import (
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    BadRequest,
    BodyTooLarge,
    ClientGone,
    Exchange,
    HeadTooLarge,
    HealthChecker,
    HttpError,
    LengthRequired,
    Request,
    Response,
    respond,
    takes_body,
)

pytestmark = pytest.mark.unit


class FakeServer:
    """What the checker looks at, set by each test."""

    def __init__(self) -> None:
        self.alarms = AlarmTable()
        self.leader = 1
        self.read_error: Exception | None = None
        self.read_blocks = False

    def raise_alarm(self, alarm: int, member: int = 1) -> None:
        self.alarms.active.add((member, alarm))

    async def linearize(self) -> None:
        if self.read_blocks:
            await asyncio.Event().wait()
        if self.read_error is not None:
            raise self.read_error

    def checker(self) -> HealthChecker:
        return HealthChecker(self.alarms, lambda: self.leader, self.linearize, range_timeout=0.05)


def read(*chunks: bytes) -> Request:
    """The request an exchange reads from these chunks, as they arrive."""
    exchange = Exchange(takes_body)
    for chunk in chunks:
        request = exchange.feed(chunk)
        if request is not None:
            return request
    raise AssertionError("the request is not whole")


async def ask(fake: FakeServer, target: str, method: str = "GET") -> Response:
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    return await respond(fake.checker(), read(head))


def verdict(response: Response) -> dict[str, str]:
    parsed = json.loads(response.body)
    assert isinstance(parsed, dict)
    return parsed


# -- parsing and encoding ----------------------------------------------------------


def test_a_request_is_read_as_it_arrives() -> None:
    r = read(
        b"GET /health?exclude=NOSPACE&exclude=&serializable=true HTTP/1.1\r\nHo", b"st: x\r\n\r\n"
    )
    assert r == Request("GET", "/health", {"exclude": ["NOSPACE", ""], "serializable": ["true"]})
    assert read(b"GET http://h:2381/livez HTTP/1.0\r\n\r\n").path == "/livez"


@pytest.mark.parametrize(
    "head",
    [
        b"GET /health\r\n\r\n",
        b"GET /health HTTP/2\r\nHost: x\r\n\r\n",
        b"GET health HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\xff /health HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host, as Go's server refuses it
        b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
    ],
)
def test_malformed_requests_are_bad_requests(head: bytes) -> None:
    exchange = Exchange(takes_body)
    with pytest.raises(BadRequest):
        exchange.feed(head)
    assert exchange.answer(Response(BadRequest.status, b"Bad Request\n")).startswith(
        b"HTTP/1.1 400 Bad Request\r\n"
    )


@pytest.mark.parametrize("chunk", [1, 1000, MAX_HEAD_BYTES + 100])
def test_a_head_over_the_bound_is_refused_however_it_arrives(chunk: int) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n"
    exchange = Exchange(takes_body)
    with pytest.raises(HeadTooLarge):
        for i in range(0, len(head), chunk):
            assert exchange.feed(head[i : i + chunk]) is None
    # the bound is the head's length: one just within it is read
    pad = MAX_HEAD_BYTES - len(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: \r\n\r\n")
    fits = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * pad + b"\r\n\r\n"
    assert len(fits) == MAX_HEAD_BYTES and read(fits).path == "/health"
    with pytest.raises(HeadTooLarge):
        read(fits[:-4] + b"a\r\n\r\n")


def test_a_client_that_leaves_before_its_request_is_whole_gets_no_answer() -> None:
    for sent in (b"", b"GET /heal"):
        exchange = Exchange(takes_body)
        assert sent == b"" or exchange.feed(sent) is None
        with pytest.raises(ClientGone):
            exchange.feed(b"")


def test_an_answer_is_framed_by_its_length_and_closes_the_connection() -> None:
    exchange = Exchange(takes_body)
    exchange.feed(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = exchange.answer(Response(HTTPStatus.OK, b"ok", headers=(("Allow", "GET"),)))
    assert raw == (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: 2\r\nConnection: close\r\nAllow: GET\r\n\r\nok"
    )
    head = Exchange(takes_body)
    head.feed(b"HEAD /livez HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = head.answer(Response(HTTPStatus.OK, b"ok"))
    assert raw.endswith(b"Content-Length: 2\r\nConnection: close\r\n\r\n")  # no body


# -- /health -----------------------------------------------------------------------


async def test_healthy_member_answers_etcds_json() -> None:
    r = await ask(FakeServer(), "/health")
    assert (r.status, r.body) == (200, b'{"health":"true","reason":""}')


@pytest.mark.parametrize(
    ("alarm", "reason"),
    [(rpc_pb2.NOSPACE, "ALARM NOSPACE"), (rpc_pb2.CORRUPT, "ALARM CORRUPT")],
)
async def test_alarm_makes_health_false(alarm: int, reason: str) -> None:
    fake = FakeServer()
    fake.raise_alarm(alarm)
    r = await ask(fake, "/health")
    assert r.status == 503 and r.body.endswith(b"\n")
    assert verdict(r) == {"health": "false", "reason": reason}


async def test_excluded_alarms_are_ignored_and_others_still_count() -> None:
    fake = FakeServer()
    fake.raise_alarm(rpc_pb2.NOSPACE)
    assert (await ask(fake, "/health?exclude=NOSPACE")).status == 200
    fake.raise_alarm(rpc_pb2.CORRUPT, member=2)
    r = await ask(fake, "/health?exclude=NOSPACE")
    assert verdict(r)["reason"] == "ALARM CORRUPT"
    assert (await ask(fake, "/health?exclude=NOSPACE&exclude=CORRUPT")).status == 200


async def test_alarm_of_a_type_unknown_to_us_is_alarm_unknown() -> None:
    """An open-enum alarm type (fuzzing activated type 88) must not break /health."""
    fake = FakeServer()
    fake.raise_alarm(88)
    r = await ask(fake, "/health")
    assert r.status == 503
    assert verdict(r) == {"health": "false", "reason": "ALARM UNKNOWN"}
    assert (await ask(fake, "/health?exclude=88")).status == 200


async def test_no_leader_unless_serializable() -> None:
    fake = FakeServer()
    fake.leader = 0
    r = await ask(fake, "/health")
    assert r.status == 503 and verdict(r)["reason"] == "RAFT NO LEADER"
    assert (await ask(fake, "/health?serializable=true")).status == 200
    assert (await ask(fake, "/health?serializable=false")).status == 503


async def test_read_that_times_out_or_fails_is_a_range_error() -> None:
    fake = FakeServer()
    fake.read_blocks = True
    r = await ask(fake, "/health")
    assert verdict(r) == {"health": "false", "reason": f"RANGE ERROR:{RequestTimeout().text}"}
    assert (await ask(fake, "/health?serializable=true")).status == 200
    fake.read_blocks, fake.read_error = False, ServerStopped()
    r = await ask(fake, "/health")
    assert verdict(r)["reason"] == "RANGE ERROR:etcdserver: server stopped"


# -- the other routes ----------------------------------------------------------------


async def test_readyz_needs_a_leader_and_livez_does_not() -> None:
    fake = FakeServer()
    assert (await ask(fake, "/readyz")).body == b"ok"
    fake.leader = 0
    r = await ask(fake, "/readyz")
    assert (r.status, r.body) == (503, b"RAFT NO LEADER\n")
    assert (await ask(fake, "/livez")) == Response(HTTPStatus.OK, b"ok")


async def test_unknown_path_404_and_other_methods_405() -> None:
    fake = FakeServer()
    assert (await ask(fake, "/metrics")).status == 404
    r = await ask(fake, "/health", method="HEAD")
    assert r.status == 405 and ("Allow", "GET") in r.headers


# -- POST /api/redrive ----------------------------------------------------------------


def test_a_post_routes_body_is_read_whole_and_bounded() -> None:
    head = b"POST /api/redrive HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    r = read(head + b"content-length: 17\r\n\r\n", b'{"queue": ', b'"jobs"}')
    assert r.headers["content-type"] == "application/json"
    assert r.body == b'{"queue": "jobs"}'
    chunked = read(head + b"Transfer-Encoding: chunked\r\n\r\n4\r\n{}  \r\n0\r\n\r\n")
    assert chunked.body == b"{}  "
    # a GET, or a POST elsewhere, is answered at its head: its body is not read
    assert read(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\n\r\n").body == b""

    refused: list[tuple[bytes, type[HttpError]]] = [
        (head + b"\r\n", LengthRequired),
        (head + b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1), BodyTooLarge),
        (head + b"Content-Length: -1\r\n\r\n", BadRequest),
        (
            head
            + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % (MAX_BODY_BYTES + 1)
            + b"a" * (MAX_BODY_BYTES + 1),
            BodyTooLarge,
        ),
    ]
    for sent, error in refused:
        with pytest.raises(error):
            read(sent)


async def test_redrive_takes_only_a_json_object_posted_as_json() -> None:
    bodies: list[object] = []

    async def redrive(body: object) -> tuple[HTTPStatus, dict[str, object]]:
        bodies.append(body)
        return HTTPStatus.OK, {"moved": 0}

    checker = FakeServer().checker()
    checker.redrive = redrive

    def post(body: bytes, content_type: str = "application/json") -> Request:
        headers = {"content-type": content_type}
        return Request("POST", "/api/redrive", {}, headers, body)

    assert (await respond(checker, post(b'{"queue": "jobs"}'))).status == 200
    assert (await respond(checker, post(b'{"queue": "jobs"}', "text/plain"))).status == 415
    assert (await respond(checker, post(b'["jobs"]'))).status == 400
    assert (await respond(checker, post(b"\xff"))).status == 400
    r = await respond(checker, Request("GET", "/api/redrive"))
    assert r.status == 405 and ("Allow", "POST") in r.headers
    assert bodies == [{"queue": "jobs"}]  # only the good one reached the redrive


# -- configuration -------------------------------------------------------------------


def test_metrics_urls_from_flag_or_environment() -> None:
    assert parse_config([], environ={}).metrics_addresses() == []
    urls = "http://127.0.0.1:2381,http://[::1]:2382"
    c = parse_config(["--listen-metrics-urls", urls], environ={})
    assert c.listen_metrics_urls == ("http://127.0.0.1:2381", "http://[::1]:2382")
    assert c.metrics_addresses() == [("127.0.0.1", 2381), ("::1", 2382)]
    env = {"ETCD_LISTEN_METRICS_URLS": "http://0.0.0.0:2381"}
    assert parse_config([], environ=env).metrics_addresses() == [("0.0.0.0", 2381)]


@pytest.mark.parametrize(
    "url", ["https://127.0.0.1:2381", "http://127.0.0.1", "127.0.0.1:2381", "unix:///tmp/s"]
)
def test_bad_metrics_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_config(["--listen-metrics-urls", url], environ={})
