"""The HTTP/1.1 + JSON gateway on the client port (grpc-gateway's wire).

What belongs here: `HttpConnection`, the asyncio protocol a client connection is
handed to when its first bytes are not the HTTP/2 preface (`GrpcConnection`
decides); HTTP/1.1 parsing with h11 (keep-alive, Content-Length and chunked
bodies, bounded heads and bodies); grpc-gateway v1's JSON mapping of requests and
responses (proto3 JSON, original field names out, both spellings in, unknown
fields ignored); its error bodies and the HTTP status of each gRPC code; and
`GatewayCall`, the `Call` a handler sees. It serves methods of the SAME
`MethodTable` the gRPC side serves (same middleware, limits, auth): the routes
(URL path -> `Method`) and the plain GET pages are handed in by the composition,
so this module knows nothing of etcd. Imports nothing of ours but `methods` and
`status`.

Theory of operation: one request at a time per connection (HTTP/1.1 has no
multiplexing; a pipelined request waits in h11's buffer until the answer before
it is sent). A unary route collects the body (at most `max_body` bytes), parses
it, runs the handler and answers with Content-Length. A streamed route (watch,
lease keep-alive) starts its handler when the head arrives: the body is a
sequence of JSON values (newline-delimited, as clients send them), each one
request message; the answer is chunked, one `{"result": ...}` line per response
message. A stream that ends with an error sends grpc-gateway's error line. A
closed connection cancels the handler.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, NoReturn

import h11
from google.protobuf import json_format
from google.protobuf.message import Message

from queue_server.transport.methods import Method, run_handler
from queue_server.transport.status import RpcError, Status

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
"""Request line plus headers. An etcd gateway client sends a few hundred bytes (an
auth token is under 100). Go's net/http allows 1 MiB; 64 KiB is far more than
any real client needs and bounds what one connection makes us buffer."""
BODY_OVERHEAD_BYTES = 512 * 1024
"""Added to --max-request-bytes for a JSON body: base64 makes bytes a third larger,
and field names and quoting add more (as gRPC adds its framing overhead)."""
IDLE_TIMEOUT = 300.0
"""Seconds a keep-alive connection may sit between requests (or before its first
head arrives) before it is closed: idle clients must not hold connections forever."""
STREAM_BACKLOG = 256 * 1024
"""Unread bytes of a streamed request body after which we stop reading the socket
until the handler catches up."""

_JSON_HEADERS = [
    (b"Access-Control-Allow-Headers", b"accept, content-type, authorization"),
    (b"Access-Control-Allow-Methods", b"POST, GET, OPTIONS, PUT, DELETE"),
    (b"Access-Control-Allow-Origin", b"*"),
    (b"Content-Type", b"application/json"),
]
"""What etcd's gateway sends on every JSON answer (CORS included)."""
_OK_HEADERS = [*_JSON_HEADERS, (b"Grpc-Metadata-Content-Type", b"application/grpc")]
_TEXT_HEADERS = [
    (b"Content-Type", b"text/plain; charset=utf-8"),
    (b"X-Content-Type-Options", b"nosniff"),
]

HTTP_STATUS: Mapping[Status, int] = {
    Status.OK: 200,
    Status.CANCELLED: 408,
    Status.UNKNOWN: 500,
    Status.INVALID_ARGUMENT: 400,
    Status.DEADLINE_EXCEEDED: 504,
    Status.NOT_FOUND: 404,
    Status.ALREADY_EXISTS: 409,
    Status.PERMISSION_DENIED: 403,
    Status.RESOURCE_EXHAUSTED: 429,
    Status.FAILED_PRECONDITION: 412,
    Status.ABORTED: 409,
    Status.OUT_OF_RANGE: 400,
    Status.UNIMPLEMENTED: 501,
    Status.INTERNAL: 500,
    Status.UNAVAILABLE: 503,
    Status.DATA_LOSS: 500,
    Status.UNAUTHENTICATED: 401,
}
"""grpc-gateway v1's HTTPStatusFromCode (the version etcd 3.4 and 3.5 are built
with: FailedPrecondition is 412 there, 400 in v2)."""


@dataclass(frozen=True, slots=True)
class Route:
    """One gateway URL: the method it calls. `hold_open`: for a bidirectional
    stream, the end of the request body does not end the requests the handler
    reads (it waits for the connection to close instead): etcd's watch goes on
    sending after the client half-closes, and curl's one-shot bodies rely on it."""

    method: Method
    hold_open: bool = False


Page = Callable[[str, str], Awaitable[tuple[int, str, bytes]]]
"""A plain GET page: (path, query) -> (status, content type, body)."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    routes: Mapping[str, Route]
    """POST routes by URL path."""
    pages: Mapping[str, Page]
    """GET pages by URL path (/version, /health, /metrics)."""
    max_body: int
    """Bytes a unary request body (or one message of a stream) may have."""


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


# -- the JSON mapping ----------------------------------------------------------------

_GO_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def to_json(message: Message) -> bytes:
    """A message as etcd's gateway writes it: original field names, int64 as
    strings, enums by name, default values left out, compact, UTF-8 with Go's
    HTML escapes."""
    return encode(json_format.MessageToDict(message, preserving_proto_field_name=True))


def encode(value: Any) -> bytes:
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.translate(_GO_ESCAPES).encode()


def from_json(value: Any, cls: Any) -> Any:
    """A request message from a decoded JSON value (unknown fields ignored, as
    grpc-gateway's unmarshaler); RpcError INVALID_ARGUMENT when it does not fit."""
    if not isinstance(value, dict):
        raise RpcError(Status.INVALID_ARGUMENT, f"json: cannot unmarshal {value!r} into a message")
    try:
        return json_format.ParseDict(value, cls(), ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise RpcError(Status.INVALID_ARGUMENT, str(e)) from None


def parse_body(body: bytes, cls: Any) -> Any:
    """A unary request's body (empty: the empty message)."""
    if not body.strip():
        return cls()
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RpcError(Status.INVALID_ARGUMENT, str(e)) from None
    return from_json(value, cls)


def error_body(code: Status, message: str) -> bytes:
    """grpc-gateway v1's errorBody, fields in etcd's order."""
    return encode({"error": message, "message": message, "code": int(code)})


def stream_error_line(code: Status, message: str) -> bytes:
    """grpc-gateway v1's error on a streamed answer (after 200 was sent)."""
    http = HTTP_STATUS.get(code, 500)
    body = {
        "grpc_code": int(code),
        "http_code": http,
        "message": message,
        "http_status": HTTPStatus(http).phrase,
    }
    return encode({"error": body}) + b"\n"


class JsonStream:
    """Splits a streamed body into JSON values: newline-delimited or simply
    concatenated, as Go's json.Decoder reads them."""

    def __init__(self) -> None:
        self._buf = ""
        self._raw = bytearray()
        self._decoder = json.JSONDecoder()

    def feed(self, data: bytes) -> list[Any]:
        """The values completed by `data`; raises ValueError on malformed input."""
        self._raw += data
        try:
            text = self._raw.decode()
            self._raw.clear()
        except UnicodeDecodeError as e:
            if e.reason != "unexpected end of data":
                raise ValueError(str(e)) from None
            text = self._raw[: e.start].decode()
            del self._raw[: e.start]
        self._buf += text
        values: list[Any] = []
        while True:
            buf = self._buf.lstrip()
            if not buf:
                self._buf = ""
                return values
            try:
                value, end = self._decoder.raw_decode(buf)
            except json.JSONDecodeError as e:
                if e.pos >= len(buf) or e.msg.startswith("Unterminated string"):
                    self._buf = buf  # incomplete: wait for more
                    return values
                raise ValueError(str(e)) from None
            values.append(value)
            self._buf = buf[end:]

    def pending(self) -> int:
        return len(self._buf) + len(self._raw)

    def finish(self) -> None:
        """The body ended: what is left must be whitespace."""
        if self._raw or self._buf.strip():
            raise ValueError("unexpected EOF")


# -- the call --------------------------------------------------------------------


class GatewayCall:
    """One request on an `HttpConnection`: the handler's `Call`, and for a
    streamed request its iterator of messages."""

    def __init__(
        self, conn: HttpConnection, route: Route, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self._conn = conn
        self.route = route
        self.method = route.method
        self._headers = headers
        self._messages: deque[Any] = deque()
        self._read_waiter: asyncio.Future[None] | None = None
        self._body_done = False
        self.stream_error: RpcError | None = None
        self.stream = JsonStream()
        self.response_started = False
        self.closed = False
        self.task: asyncio.Task[None] | None = None

    # -- the Call interface ----------------------------------------------------

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        """The Authorization header (etcd's gateway token) and grpc-gateway's
        Grpc-Metadata-* headers, as gRPC metadata."""
        metadata = []
        for name, value in self._headers:
            if name == b"authorization":
                metadata.append(("authorization", value.decode("utf-8", "replace")))
            elif name.startswith(b"grpc-metadata-"):
                key = name[len(b"grpc-metadata-") :].decode("latin-1")
                metadata.append((key, value.decode("utf-8", "replace")))
        return metadata

    def peer(self) -> str:
        return self._conn.peer_name

    def client_common_name(self) -> str | None:
        return self._conn.common_name

    def time_remaining(self) -> float | None:
        return None

    async def abort(self, code: Status, message: str) -> NoReturn:
        raise RpcError(code, message)

    async def write(self, message: Any) -> None:
        await self.write_many((message,))

    async def write_many(self, messages: Sequence[Any]) -> None:
        if self.closed:
            return
        decode = self.method.response_class.FromString
        lines = []
        for message in messages:
            if type(message) is bytes:
                message = decode(message)
            lines.append(b'{"result":' + to_json(message) + b"}\n")
        await self._conn.send_chunk(self, b"".join(lines))

    # -- the request stream ----------------------------------------------------

    def __aiter__(self) -> GatewayCall:
        return self

    async def __anext__(self) -> Any:
        while not self._messages:
            if self.stream_error is not None:
                raise self.stream_error
            if self.closed or (self._body_done and not self.route.hold_open):
                raise StopAsyncIteration
            waiter = self._conn.loop.create_future()
            self._read_waiter = waiter
            await waiter
        value = self._messages.popleft()
        if not self._messages:
            self._conn.resume_body()
        return from_json(value, self.method.request_class)

    # -- the connection's side ---------------------------------------------------

    def feed(self, data: bytes) -> None:
        try:
            self._messages.extend(self.stream.feed(data))
        except ValueError as e:
            self.stream_error = RpcError(Status.INVALID_ARGUMENT, str(e))
        if self.stream.pending() > self._conn.settings.max_body:
            self.stream_error = RpcError(
                Status.RESOURCE_EXHAUSTED, "grpc: received message larger than max"
            )
        self.wake()

    def body_done(self) -> None:
        try:
            self.stream.finish()
        except ValueError as e:
            self.stream_error = self.stream_error or RpcError(Status.INVALID_ARGUMENT, str(e))
        self._body_done = True
        self.wake()

    @property
    def backlog_bytes(self) -> int:
        """Roughly what the parsed, unread messages hold (a bound, not a measure)."""
        return len(self._messages) * 256

    def wake(self) -> None:
        waiter = self._read_waiter
        if waiter is not None:
            self._read_waiter = None
            if not waiter.done():
                waiter.set_result(None)


# -- the connection ----------------------------------------------------------------


class HttpConnection(asyncio.Protocol):
    """The asyncio protocol of one HTTP/1.1 client connection."""

    def __init__(
        self,
        settings: GatewaySettings,
        peer_name: str,
        common_name: str | None,
        idle: asyncio.Event,
        on_close: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.peer_name = peer_name
        self.common_name = common_name
        self.loop = asyncio.get_running_loop()
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.transport: asyncio.Transport | None = None
        self.idle = idle
        self._on_close = on_close
        self._call: GatewayCall | None = None
        self._body = bytearray()
        self._unary: Route | None = None
        self._request: h11.Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._write_paused = False
        self._write_waiter: asyncio.Future[None] | None = None
        self._read_paused = False
        self._discarding = 0
        """Bytes of a body answered before it was read (404, 405): read and
        dropped, up to `max_body`, so the connection can carry the next request."""
        self._idle_timer: asyncio.TimerHandle | None = None
        self.draining = False

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        self.h11.receive_data(data)
        self._process()

    def eof_received(self) -> bool | None:
        self.h11.receive_data(b"")
        self._process()
        return None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._write_waiter
        if waiter is not None:
            self._write_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        call = self._call
        if call is not None:
            call.closed = True
            call.wake()
        if self._task is not None:
            self._task.cancel()
        self.resume_writing()
        self.idle.set()
        self._on_close()

    # -- requests ----------------------------------------------------------------

    def _arm_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self.loop.call_later(IDLE_TIMEOUT, self._idle_expired)

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if self._task is None and self.transport is not None:
            self.transport.close()

    def _process(self) -> None:
        """Handle every event h11 has ready (until it needs data or the answer)."""
        while self.transport is not None and not self.transport.is_closing():
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as e:
                self._protocol_error(e)
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._start(event)
            elif isinstance(event, h11.Data):
                self._data(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._end_of_body()
            elif isinstance(event, h11.ConnectionClosed):
                if self._task is None:
                    self.transport.close()
                return

    def _protocol_error(self, error: h11.RemoteProtocolError) -> None:
        assert self.transport is not None
        if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE) and self._task is None:
            status = error.error_status_hint
            self._send_plain(status, f"{status} {error}\n".encode(), close=True)
        self.transport.close()

    def _start(self, request: h11.Request) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self.idle.clear()
        self._request = request
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        route = self.settings.routes.get(path)
        method = request.method
        if self.h11.they_are_waiting_for_100_continue and route is not None:
            self._send(h11.InformationalResponse(status_code=100, reason=b"Continue", headers=[]))
        self._discarding = 0
        if route is None or method != b"POST":
            self._discarding = 1
            page = self.settings.pages.get(path)
            if page is not None and method == b"GET":
                self._task = self.loop.create_task(self._serve_page(page, path, query))
            elif page is not None or route is not None:
                self._send_plain(405, b"Method Not Allowed\n")
            else:
                self._send_plain(404, b"Not Found\n")
            return
        headers = [(name.lower(), value) for name, value in request.headers]
        if route.method.request_streaming:
            call = GatewayCall(self, route, headers)
            self._call = call
            self._task = self.loop.create_task(self._serve(call, call))
        else:
            self._call = GatewayCall(self, route, headers)
            self._unary = route
            self._body.clear()

    def _data(self, data: bytes) -> None:
        call = self._call
        if self._unary is not None:
            self._body += data
            if len(self._body) > self.settings.max_body:
                size = len(self._body)
                self._unary = None
                self._body.clear()
                self._answer_error(
                    Status.RESOURCE_EXHAUSTED,
                    f"grpc: received message larger than max ({size} vs. {self.settings.max_body})",
                )
        elif call is not None and call.method.request_streaming:
            call.feed(data)
            backlog = call.stream.pending() + call.backlog_bytes
            if backlog > STREAM_BACKLOG and not self._read_paused and self.transport is not None:
                self._read_paused = True
                self.transport.pause_reading()
        elif self._discarding:
            self._discarding += len(data)
            if self._discarding > self.settings.max_body and self.transport is not None:
                self.transport.close()

    def resume_body(self) -> None:
        if self._read_paused and self.transport is not None and not self.transport.is_closing():
            self._read_paused = False
            self.transport.resume_reading()

    def _end_of_body(self) -> None:
        route = self._unary
        call = self._call
        if route is not None and call is not None:
            self._unary = None
            body = bytes(self._body)
            self._body.clear()
            try:
                request = parse_body(body, route.method.request_class)
            except RpcError as e:
                self._answer_error(e.code, e.message)
                return
            self._task = self.loop.create_task(self._serve(call, request))
        elif call is not None:
            call.body_done()
        else:
            self._cycle()

    # -- answers -----------------------------------------------------------------

    async def _serve_page(self, page: Page, path: str, query: str) -> None:
        try:
            status, content_type, body = await page(path, query)
        except Exception:
            log.exception("gateway page failed path=%s", path)
            status, content_type, body = 500, "text/plain; charset=utf-8", b"internal error\n"
        self._task = None
        headers = [(b"Content-Type", content_type.encode()), (b"Content-Length", b"%d" % len(body))]
        self._send(h11.Response(status_code=status, reason=_reason(status), headers=headers))
        self._send(h11.Data(data=body))
        self._send(h11.EndOfMessage())
        self._cycle()

    async def _serve(self, call: GatewayCall, request: Any) -> None:
        """Run the call's handler (`methods.run_handler`) and answer with what
        it ends with: a JSON body, or the end of a chunked stream, or
        grpc-gateway's error (a body, or a stream's last line)."""
        method = call.method

        def respond(response: Any) -> None:
            self._task = None
            if type(response) is bytes:  # serialized already (a front's forward)
                response = method.response_class.FromString(response)
            body = to_json(response)
            headers = [*_OK_HEADERS, (b"Content-Length", b"%d" % len(body))]
            self._send(h11.Response(status_code=200, reason=_reason(200), headers=headers))
            self._send(h11.Data(data=body))
            self._send(h11.EndOfMessage())
            self._finish(call)

        try:
            await run_handler(method, request, call, respond)
            if method.response_streaming and call.stream_error is not None:
                raise call.stream_error  # the body broke after the handler's last read
        except RpcError as e:
            self._task = None
            if call.response_started:
                self._end_stream(call, e)
            else:
                self._answer_error(e.code, e.message)
        except asyncio.CancelledError:
            self._task = None
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()  # the server is stopping
        else:
            if method.response_streaming:  # `respond` answered a unary one
                self._task = None
                self._end_stream(call, None)

    async def send_chunk(self, call: GatewayCall, data: bytes) -> None:
        if call.closed or self.transport is None or self.transport.is_closing():
            return
        if not call.response_started:
            call.response_started = True
            self._send(h11.Response(status_code=200, reason=_reason(200), headers=_OK_HEADERS))
        self._send(h11.Data(data=data))
        while self._write_paused and not call.closed:
            waiter = self.loop.create_future()
            self._write_waiter = waiter
            await waiter

    def _end_stream(self, call: GatewayCall, error: RpcError | None) -> None:
        if not call.response_started:
            call.response_started = True
            self._send(h11.Response(status_code=200, reason=_reason(200), headers=_OK_HEADERS))
        if error is not None:
            self._send(h11.Data(data=stream_error_line(error.code, error.message)))
        self._send(h11.EndOfMessage())
        self._finish(call)

    def _answer_error(self, code: Status, message: str) -> None:
        body = error_body(code, message)
        headers = [*_JSON_HEADERS, (b"Content-Length", b"%d" % len(body))]
        status = HTTP_STATUS.get(code, 500)
        # the reason phrase too: clients show it (etcd3gw raises it as the error's text)
        self._send(h11.Response(status_code=status, reason=_reason(status), headers=headers))
        self._send(h11.Data(data=body))
        self._send(h11.EndOfMessage())
        if self._call is not None:
            self._finish(self._call)
        else:
            self._cycle()

    def _send_plain(self, status: int, body: bytes, close: bool = False) -> None:
        headers = [*_TEXT_HEADERS, (b"Content-Length", b"%d" % len(body))]
        if close:
            headers.append((b"Connection", b"close"))
        self._send(h11.Response(status_code=status, reason=_reason(status), headers=headers))
        self._send(h11.Data(data=body))
        self._send(h11.EndOfMessage())
        self._cycle()

    def _send(self, event: Any) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            data = self.h11.send(event)
        except h11.LocalProtocolError:
            log.debug("gateway answer out of turn peer=%s", self.peer_name)
            transport.close()
            return
        if data:
            transport.write(data)

    def _finish(self, call: GatewayCall) -> None:
        call.closed = True
        call.wake()
        self._call = None
        self._cycle()

    def _cycle(self) -> None:
        """The answer is out: keep the connection for the next request, or close
        it (the client asked to, the body was not read to its end, or we drain)."""
        transport = self.transport
        if transport is None or transport.is_closing() or self._task is not None:
            return
        h = self.h11
        if h.our_state is h11.DONE and h.their_state is h11.DONE and not self.draining:
            h.start_next_cycle()
            self._request = None
            self.idle.set()
            self._arm_idle()
            self.resume_body()
            self._process()
        elif h.our_state is h11.DONE or h.our_state is h11.MUST_CLOSE:
            if h.their_state is h11.SEND_BODY and self._discarding and not self.draining:
                return  # the body of a request answered already is read to its end
            if h.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.IDLE):
                self.idle.set()
                transport.close()
            elif self._call is None and self._unary is None:
                # The answer went before the body was read (an error): drop the rest.
                self.idle.set()
                transport.close()

    # -- lifetime ---------------------------------------------------------------------

    def drain(self) -> None:
        """A graceful stop: finish the request in flight, then close."""
        self.draining = True
        if self._task is None and self._call is None and self.transport is not None:
            self.transport.close()

    def end_call(self, waiting_only: bool, code: Status, message: str) -> None:
        """A stop: end the call in flight with `code` and `message` (grpc-gateway's
        error line on a stream already answering), and cancel its handler. With
        `waiting_only`, only a call that waits on its client or on others
        (`Method.waits`: watches, keepalive streams, long polls)."""
        call, task = self._call, self._task
        if call is None or task is None or call.closed:
            return
        if waiting_only and not call.method.waits:
            return
        self._task = None
        if call.response_started:
            self._end_stream(call, RpcError(code, message))
        else:
            self._answer_error(code, message)
        task.cancel()

    def close_now(self) -> None:
        if self.transport is None:
            return
        if self._task is not None:
            self.transport.abort()
        else:
            self.transport.close()
