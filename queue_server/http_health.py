"""The HTTP listener of --listen-metrics-urls: etcd's `/health`, `/readyz`, `/livez`,
Prometheus' `/metrics`, and the queue dashboard (`/`, the JSON it polls,
`/api/state`, and its redrive button's `POST /api/redrive`).

What belongs here: reading one HTTP/1.1 request head, routing it, the health checks
themselves, encoding the answer, and the asyncio stream servers that carry them.
It must not import grpc, `queue_server.server` or the `replication` package: the
server hands in what the checks look at (the alarm table, a leader lookup and the
linearizable-read barrier of its log, the metrics renderer and the dashboard's
state snapshot, the redrive), so that the checks run against fakes too.

Theory of operation: a connection carries one request and is closed after the
answer (`Connection: close`), which every probe client (Docker's healthcheck,
kubelet, curl, Prometheus) accepts. `parse_head`, `respond` and `encode_response`
do no I/O; `HealthListener` only moves bytes between them and the sockets.

`/health` follows etcd 3.5 (server/etcdserver/api/etcdhttp/metrics.go): 200 and
`{"health":"true","reason":""}`, or 503 and `{"health":"false","reason":...}`
when an alarm is active ("ALARM NOSPACE"; `?exclude=NOSPACE` ignores it), when
the member knows no leader ("RAFT NO LEADER") or when a linearizable read fails
within etcd's request timeout ("RANGE ERROR:etcdserver: request timed out").
`?serializable=true` checks this member alone: no leader check, a local read.

`POST /api/redrive` is the only route that takes a body: a JSON object of at most
MAX_BODY_BYTES, sent with `Content-Type: application/json`. A browser sends that
type across origins only after a CORS preflight, which this listener never
grants, so another site's page cannot make a visitor's browser redrive.

`/livez` and `/readyz` are the probes of later etcd versions, kept minimal: live
while this listener answers (the event loop runs; it exists only between the
server's start and stop), ready while the member also knows a leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from http import HTTPStatus
from importlib import resources
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

from etcdserverpb import rpc_pb2
from queue_server.alarms import AlarmTable, alarm_name
from queue_server.errors import EtcdError, RequestTimeout

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8 * 1024
"""Longest request line plus headers. A probe sends a few hundred bytes; 8 KiB is
what common servers allow, and keeps a client from making us buffer more."""
HEAD_TIMEOUT = 5.0
"""Seconds a client has to send its request head (and body), so an idle or
trickling connection (slowloris) does not hold a connection slot."""
MAX_BODY_BYTES = 4 * 1024
"""Largest request body: a redrive request is a queue name and a count."""
MAX_CONNECTIONS = 32
"""Connections served at once; more are closed unanswered. Probes come a few a
minute; the bound keeps a flood from piling up linearizable reads."""
RANGE_TIMEOUT = 7.0
"""How long /health waits for its linearizable read: etcd's request timeout with
its default election timeout (5 s + 2 x 1 s), as its health check uses."""

ALARM_REASONS: Mapping[int, str] = {
    rpc_pb2.NOSPACE: "ALARM NOSPACE",
    rpc_pb2.CORRUPT: "ALARM CORRUPT",
}
"""etcd's /health reason per alarm type; any other is "ALARM UNKNOWN"."""
TEXT = "text/plain; charset=utf-8"
"""etcd's Content-Type for every answer here (Go's sniffing calls its JSON text)."""


# -- requests and responses ------------------------------------------------------


class HttpError(Exception):
    """A request this listener cannot serve; `status` is the answer to send."""

    status: ClassVar[HTTPStatus] = HTTPStatus.BAD_REQUEST


class BadRequest(HttpError):
    status = HTTPStatus.BAD_REQUEST


class HeadTooLarge(HttpError):
    status = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE


class BodyTooLarge(HttpError):
    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE


class LengthRequired(HttpError):
    status = HTTPStatus.LENGTH_REQUIRED


@dataclass(frozen=True, slots=True)
class Request:
    """The parts of a request head that routing looks at."""

    method: str
    path: str
    query: Mapping[str, list[str]] = field(default_factory=dict)
    # what a POST route reads; not what routing compares (names in lower case)
    headers: Mapping[str, str] = field(default_factory=dict, compare=False)
    body: bytes = field(default=b"", compare=False)


@dataclass(frozen=True, slots=True)
class Response:
    status: HTTPStatus
    body: bytes
    content_type: str = TEXT
    headers: tuple[tuple[str, str], ...] = ()


def parse_head(head: bytes) -> Request:
    """The request line and headers of a head."""
    line, _, rest = head.partition(b"\r\n")
    try:
        method, target, version = line.decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        raise BadRequest(f"malformed request line {line[:80]!r}") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest(f"unsupported version {version!r}")
    parts = urlsplit(target)
    if not parts.path.startswith("/"):
        raise BadRequest(f"malformed target {target[:80]!r}")
    headers: dict[str, str] = {}
    for field_line in rest.split(b"\r\n"):
        name, colon, value = field_line.partition(b":")
        if colon:
            headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
    return Request(method, parts.path, parse_qs(parts.query, keep_blank_values=True), headers)


def body_length(request: Request) -> int:
    """The Content-Length a request announces (0 without one), within MAX_BODY_BYTES."""
    text = request.headers.get("content-length")
    if text is None:
        if request.method == "POST":
            raise LengthRequired()
        return 0
    if not text.isdigit():
        raise BadRequest(f"malformed Content-Length {text[:20]!r}")
    if int(text) > MAX_BODY_BYTES:
        raise BodyTooLarge()
    return int(text)


def encode_response(response: Response) -> bytes:
    lines = [
        f"HTTP/1.1 {response.status.value} {response.status.phrase}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in response.headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + response.body


def text_response(status: HTTPStatus, text: str) -> Response:
    """What Go's http.Error sends: the text and a newline."""
    return Response(status, (text + "\n").encode())


# -- the checks ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Health:
    """etcd's health verdict; `reason` is empty when healthy."""

    healthy: bool
    reason: str = ""

    def to_json(self) -> str:
        verdict = "true" if self.healthy else "false"
        return json.dumps({"health": verdict, "reason": self.reason}, separators=(",", ":"))


HEALTHY = Health(True)


class HealthChecker:
    """The checks behind the routes, on what the server hands in."""

    def __init__(
        self,
        alarms: AlarmTable,
        leader_id: Callable[[], int],
        linearize: Callable[[], Awaitable[None]],
        render_metrics: Callable[[], bytes] | None = None,
        dashboard_state: Callable[[bool], dict[str, Any]] | None = None,
        range_timeout: float = RANGE_TIMEOUT,
        redrive: Callable[[Mapping[str, Any]], Awaitable[tuple[HTTPStatus, dict[str, Any]]]]
        | None = None,
    ) -> None:
        self.alarms = alarms
        self.leader_id = leader_id
        self.linearize = linearize
        self.render_metrics = render_metrics
        self.dashboard_state = dashboard_state
        self.range_timeout = range_timeout
        self.redrive = redrive

    def check_alarms(self, excluded: Iterable[str]) -> Health:
        """The first active alarm whose name (NOSPACE, CORRUPT) is not excluded."""
        skip = set(excluded)
        for _, alarm in self.alarms.get():
            if alarm_name(alarm) not in skip:
                return Health(False, ALARM_REASONS.get(alarm, "ALARM UNKNOWN"))
        return HEALTHY

    def check_leader(self) -> Health:
        return HEALTHY if self.leader_id() else Health(False, "RAFT NO LEADER")

    async def check_read(self) -> Health:
        """A linearizable read, bounded as etcd bounds the range of its check."""
        try:
            await asyncio.wait_for(self.linearize(), self.range_timeout)
        except TimeoutError:
            return Health(False, f"RANGE ERROR:{RequestTimeout().text}")
        except EtcdError as e:
            return Health(False, f"RANGE ERROR:{e.text}")
        return HEALTHY

    async def health(self, excluded: Iterable[str], serializable: bool) -> Health:
        """etcd's order: alarms, then (unless serializable) leader, then the read. A
        serializable read is served from local state and cannot fail here."""
        verdict = self.check_alarms(excluded)
        if not verdict.healthy or serializable:
            return verdict
        verdict = self.check_leader()
        if not verdict.healthy:
            return verdict
        return await self.check_read()


# -- routes ----------------------------------------------------------------------


async def get_health(checker: HealthChecker, request: Request) -> Response:
    excluded = [name for name in request.query.get("exclude", []) if name]
    serializable = request.query.get("serializable", [""])[0] == "true"
    verdict = await checker.health(excluded, serializable)
    if verdict.healthy:
        return Response(HTTPStatus.OK, verdict.to_json().encode())
    log.warning("/health false reason=%r", verdict.reason)
    return text_response(HTTPStatus.SERVICE_UNAVAILABLE, verdict.to_json())


async def get_livez(checker: HealthChecker, request: Request) -> Response:
    return Response(HTTPStatus.OK, b"ok")


async def get_readyz(checker: HealthChecker, request: Request) -> Response:
    verdict = checker.check_leader()
    if verdict.healthy:
        return Response(HTTPStatus.OK, b"ok")
    return text_response(HTTPStatus.SERVICE_UNAVAILABLE, verdict.reason)


async def get_metrics(checker: HealthChecker, request: Request) -> Response:
    if checker.render_metrics is None:
        return text_response(HTTPStatus.NOT_FOUND, "404 page not found")
    return Response(
        HTTPStatus.OK,
        checker.render_metrics(),
        content_type="text/plain; version=0.0.4; charset=utf-8",
    )


@cache
def dashboard_page() -> bytes:
    """The dashboard's HTML, as shipped in the package (`queue_server/static/`)."""
    return resources.files("queue_server").joinpath("static/dashboard.html").read_bytes()


async def get_dashboard(checker: HealthChecker, request: Request) -> Response:
    if checker.dashboard_state is None:
        return text_response(HTTPStatus.NOT_FOUND, "404 page not found")
    return Response(HTTPStatus.OK, dashboard_page(), content_type="text/html; charset=utf-8")


async def get_state(checker: HealthChecker, request: Request) -> Response:
    if checker.dashboard_state is None:
        return text_response(HTTPStatus.NOT_FOUND, "404 page not found")
    with_history = request.query.get("history", ["1"])[0] != "0"
    body = json.dumps(checker.dashboard_state(with_history)).encode()
    return Response(
        HTTPStatus.OK,
        body,
        content_type="application/json",
        headers=(("Cache-Control", "no-store"),),
    )


def json_response(status: HTTPStatus, payload: Mapping[str, Any]) -> Response:
    return Response(
        status,
        json.dumps(payload).encode(),
        content_type="application/json",
        headers=(("Cache-Control", "no-store"),),
    )


async def post_redrive(checker: HealthChecker, request: Request) -> Response:
    """Dead letters back onto their queue (`dashboard.Redriver`); every refusal is
    a 4xx with `{"error": ...}` and moves nothing."""
    if checker.redrive is None:
        return text_response(HTTPStatus.NOT_FOUND, "404 page not found")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        return json_response(
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
            {"error": "send a JSON object with Content-Type: application/json"},
        )
    try:
        body = json.loads(request.body)
    except (UnicodeDecodeError, ValueError):
        body = None
    if not isinstance(body, dict):
        return json_response(
            HTTPStatus.BAD_REQUEST,
            {"error": 'the body must be a JSON object such as {"queue": "jobs", "count": 10}'},
        )
    status, payload = await checker.redrive(body)
    return json_response(status, payload)


Route = Callable[[HealthChecker, Request], Awaitable[Response]]
ROUTES: Mapping[str, Route] = {
    "/": get_dashboard,
    "/api/state": get_state,
    "/health": get_health,
    "/metrics": get_metrics,
    "/livez": get_livez,
    "/readyz": get_readyz,
}
POST_ROUTES: Mapping[str, Route] = {
    "/api/redrive": post_redrive,
}


async def respond(checker: HealthChecker, request: Request) -> Response:
    """Go's mux answers: 404 for an unknown path, 405 for a method the path does
    not take (GET, or POST for the POST routes)."""
    if request.path in POST_ROUTES:
        route, allowed = POST_ROUTES[request.path], "POST"
    else:
        found = ROUTES.get(request.path)
        if found is None:
            return text_response(HTTPStatus.NOT_FOUND, "404 page not found")
        route, allowed = found, "GET"
    if request.method != allowed:
        response = text_response(HTTPStatus.METHOD_NOT_ALLOWED, "Method Not Allowed")
        return Response(response.status, response.body, headers=(("Allow", allowed),))
    return await route(checker, request)


# -- the listener ----------------------------------------------------------------


class ListenError(OSError):
    """A metrics URL cannot be bound; the message says which."""


class HealthListener:
    """One asyncio server per metrics address, all answering through `checker`."""

    def __init__(self, checker: HealthChecker) -> None:
        self.checker = checker
        self.bound_ports: list[int] = []
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.Task[object]] = set()

    async def start(self, addresses: Sequence[tuple[str, int]]) -> None:
        for host, port in addresses:
            try:
                server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
            except OSError as e:
                await self.stop()
                raise ListenError(f"cannot listen on metrics {host}:{port}: {e.strerror}") from e
            self._servers.append(server)
            self.bound_ports.append(server.sockets[0].getsockname()[1])
        if addresses:
            log.info("serving /health urls=%s", ",".join(f"{h}:{p}" for h, p in addresses))

    async def stop(self) -> None:
        """Stop accepting, cut the connections in flight (a probe retries)."""
        for server in self._servers:
            server.close()
        for task in list(self._connections):
            task.cancel()
        for server in self._servers:
            await server.wait_closed()
        if self._connections:
            await asyncio.wait(list(self._connections))
        self._servers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._connections.add(task)
        try:
            response = await self._answer(reader)
            if response is not None:
                writer.write(encode_response(response))
                await writer.drain()
        except ConnectionError:
            pass  # the client went away; nothing to tell it
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> Response | None:
        """The response to the connection's request; None when it sent none."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
            request = parse_head(head)
            if request.path in POST_ROUTES and request.method == "POST":
                length = body_length(request)
                body = await asyncio.wait_for(reader.readexactly(length), HEAD_TIMEOUT)
                request = Request(
                    request.method, request.path, request.query, request.headers, body
                )
            return await respond(self.checker, request)
        except (asyncio.IncompleteReadError, TimeoutError):
            return None
        except asyncio.LimitOverrunError:
            return text_response(HeadTooLarge.status, HeadTooLarge.status.phrase)
        except HttpError as e:
            return text_response(e.status, e.status.phrase)
