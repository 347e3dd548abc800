"""The HTTP listener of --listen-metrics-urls: etcd's `/health`, `/readyz`, `/livez`,
Prometheus' `/metrics`, and the queue dashboard (`/`, the JSON it polls,
`/api/state`, and its redrive button's `POST /api/redrive`).

What belongs here: the bounds on one HTTP/1.1 request (h11 parses it, as the
gateway's does on the client port), routing it, the health checks themselves, and
the asyncio stream servers that carry them.
It must not import grpc, `queue_server.server` or the `replication` package: the
server hands in what the checks look at (the alarm table, a leader lookup and the
linearizable-read barrier of its log, the metrics renderer and the dashboard's
state snapshot, the redrive), so that the checks run against fakes too.

Theory of operation: a connection carries one request and is closed after the
answer (`Connection: close`), which every probe client (Docker's healthcheck,
kubelet, curl, Prometheus) accepts. `Exchange` (the request's bytes in, the
answer's bytes out, over an h11 connection) and `respond` do no I/O;
`HealthListener` only moves bytes between them and the sockets.

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

import h11

from etcdserverpb import rpc_pb2
from queue_server.alarms import AlarmTable, alarm_name
from queue_server.errors import EtcdError, RequestTimeout

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8 * 1024
"""Longest request line plus headers. A probe sends a few hundred bytes; 8 KiB is
what common servers allow, and keeps a client from making us buffer more."""
READ_BYTES = 64 * 1024
"""What one read from a connection asks for."""
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


class ClientGone(Exception):
    """The client closed its side before its request was whole: nothing to answer."""


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
    """What a route answers: its status, its body and the body's type, and any
    further headers."""

    status: HTTPStatus
    body: bytes
    content_type: str = TEXT
    headers: tuple[tuple[str, str], ...] = ()


class Exchange:
    """One request and its answer on a connection, over h11, with no I/O: `feed`
    it what the client sends until it returns the request, then `answer`.

    h11 frames the request and checks its syntax (the request line, header
    fields, Host, Content-Length and chunked bodies); the bounds are ours. h11
    bounds only a head that has not ended yet, so it is given at most
    MAX_HEAD_BYTES before the head ends: a longer head is HeadTooLarge however
    it arrives. A body is read only for a request `takes_body` names (the POST
    routes): it must be announced (LengthRequired) and at most MAX_BODY_BYTES.
    """

    def __init__(self, takes_body: Callable[[Request], bool]) -> None:
        self.takes_body = takes_body
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._unfed = b""
        self._head_fed = 0
        """Bytes given to h11 before the head ended."""
        self._closed = False
        self._method = ""
        self._head: Request | None = None
        """A request whose body is being read."""
        self._body = bytearray()

    def feed(self, data: bytes) -> Request | None:
        """The request once it is whole, None while more must come. `data` is
        what was read from the client, b"" once it closed its side. Raises
        HttpError for a request answered with that error's status, ClientGone
        when the client closed before its request was whole."""
        if data:
            self._unfed += data
        else:
            self._closed = True
        try:
            return self._next()
        except h11.RemoteProtocolError as e:
            if self._closed:
                raise ClientGone() from e
            raise _H11_ERRORS.get(e.error_status_hint, BadRequest)(str(e)) from e

    def _next(self) -> Request | None:
        while True:
            if self._head is None:
                room = MAX_HEAD_BYTES - self._head_fed
                chunk, self._unfed = self._unfed[:room], self._unfed[room:]
                self._head_fed += len(chunk)
            else:
                chunk, self._unfed = self._unfed, b""
            if chunk:
                self._h11.receive_data(chunk)
            if self._closed and not self._unfed:
                self._h11.receive_data(b"")
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                if self._head is None and self._unfed:
                    raise HeadTooLarge(f"a request head over {MAX_HEAD_BYTES} bytes")
                return None
            if isinstance(event, h11.Request):
                request = self._request(event)
                if not self.takes_body(request):
                    return request
                self._check_length(request)
                self._head = request
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > MAX_BODY_BYTES:
                    raise BodyTooLarge()
            elif isinstance(event, h11.EndOfMessage):
                h = self._head
                assert h is not None  # a body is read only after its head
                return Request(h.method, h.path, h.query, h.headers, bytes(self._body))
            elif isinstance(event, h11.ConnectionClosed):
                raise ClientGone()
            else:
                raise AssertionError(f"h11 event out of turn: {event!r}")

    def _request(self, event: h11.Request) -> Request:
        self._method = event.method.decode("ascii")
        target = event.target.decode("latin-1")
        parts = urlsplit(target)
        if not parts.path.startswith("/"):
            raise BadRequest(f"malformed target {target[:80]!r}")
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
        query = parse_qs(parts.query, keep_blank_values=True)
        return Request(self._method, parts.path, query, headers)

    @staticmethod
    def _check_length(request: Request) -> None:
        """A body must be announced, by its length (at most MAX_BODY_BYTES) or
        as chunked (counted as it comes)."""
        length = request.headers.get("content-length")
        if length is None:
            if "transfer-encoding" not in request.headers:
                raise LengthRequired()
        elif int(length) > MAX_BODY_BYTES:  # h11 has checked it is a number
            raise BodyTooLarge()

    def answer(self, response: Response) -> bytes:
        """The bytes of `response`, framed by its Content-Length; the connection
        closes after it. A HEAD request is answered with the headers alone, as
        Go's server answers it."""
        status = response.status
        headers = [
            ("Content-Type", response.content_type),
            ("Content-Length", str(len(response.body))),
            ("Connection", "close"),
            *response.headers,
        ]
        events: list[h11.Event] = [
            h11.Response(status_code=status.value, reason=status.phrase, headers=headers)
        ]
        if self._method != "HEAD":
            events.append(h11.Data(data=response.body))
        events.append(h11.EndOfMessage())
        return b"".join(self._h11.send(event) or b"" for event in events)


_H11_ERRORS: Mapping[int, type[HttpError]] = {
    HTTPStatus.BAD_REQUEST: BadRequest,
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE: HeadTooLarge,
}
"""Our error for the status h11 suggests for a request it refuses."""


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


def takes_body(request: Request) -> bool:
    """Whether the route reads the request's body (only a POST route does)."""
    return request.method == "POST" and request.path in POST_ROUTES


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
                server = await asyncio.start_server(self._serve, host, port, limit=READ_BYTES)
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
            exchange = Exchange(takes_body)
            response = await self._answer(exchange, reader)
            if response is not None:
                writer.write(exchange.answer(response))
                await writer.drain()
        except ConnectionError:
            pass  # the client went away; nothing to tell it
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, exchange: Exchange, reader: asyncio.StreamReader) -> Response | None:
        """The response to the connection's request; None when it sent none."""
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                request = None
                while request is None:
                    request = exchange.feed(await reader.read(READ_BYTES))
        except (ClientGone, TimeoutError):
            return None
        except HttpError as e:
            return text_response(e.status, e.status.phrase)
        return await respond(self.checker, request)
