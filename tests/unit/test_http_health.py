"""Unit tests of the health listener's I/O-free core (parsing, routing, etcd's health
verdicts on a fake server) and of --listen-metrics-urls / ETCD_LISTEN_METRICS_URLS."""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

import pytest

from etcdserverpb import rpc_pb2
from queue_server.alarms import AlarmTable
from queue_server.config import ConfigError, parse_config
from queue_server.errors import RequestTimeout, ServerStopped
from queue_server.http_health import (
    MAX_BODY_BYTES,
    BadRequest,
    BodyTooLarge,
    HealthChecker,
    LengthRequired,
    Request,
    Response,
    body_length,
    encode_response,
    parse_head,
    respond,
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


async def ask(fake: FakeServer, target: str, method: str = "GET") -> Response:
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    return await respond(fake.checker(), parse_head(head))


def verdict(response: Response) -> dict[str, str]:
    parsed = json.loads(response.body)
    assert isinstance(parsed, dict)
    return parsed


# -- parsing and encoding ----------------------------------------------------------


def test_parse_head_reads_path_and_query() -> None:
    r = parse_head(b"GET /health?exclude=NOSPACE&exclude=&serializable=true HTTP/1.1\r\nA: b")
    assert r == Request("GET", "/health", {"exclude": ["NOSPACE", ""], "serializable": ["true"]})
    assert parse_head(b"GET http://h:2381/livez HTTP/1.0").path == "/livez"


@pytest.mark.parametrize(
    "head",
    [b"GET /health", b"GET /health HTTP/2", b"GET health HTTP/1.1", b"\xff /health HTTP/1.1"],
)
def test_parse_head_rejects_malformed_request_lines(head: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_head(head)


def test_encode_response_frames_the_body() -> None:
    raw = encode_response(Response(HTTPStatus.OK, b"ok", headers=(("Allow", "GET"),)))
    assert raw == (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: 2\r\nConnection: close\r\nAllow: GET\r\n\r\nok"
    )


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


def test_parse_head_keeps_headers_and_body_length_is_bounded() -> None:
    r = parse_head(
        b"POST /api/redrive HTTP/1.1\r\nContent-Type: application/json\r\ncontent-length: 12"
    )
    assert r.headers == {"content-type": "application/json", "content-length": "12"}
    assert body_length(r) == 12
    with pytest.raises(LengthRequired):
        body_length(parse_head(b"POST /api/redrive HTTP/1.1"))
    with pytest.raises(BodyTooLarge):
        body_length(parse_head(b"POST /x HTTP/1.1\r\nContent-Length: %d" % (MAX_BODY_BYTES + 1)))
    with pytest.raises(BadRequest):
        body_length(parse_head(b"POST /x HTTP/1.1\r\nContent-Length: -1"))


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
