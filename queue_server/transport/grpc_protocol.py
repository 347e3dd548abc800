"""gRPC over one HTTP/2 connection, on an asyncio transport.

What belongs here: `GrpcConnection`, the asyncio protocol of one client
connection. It feeds the bytes read to its `H2Connection`, turns streams into
calls (`NativeCall`), runs each call's handler as a task, and writes what the
connection produced once per read (or once per event-loop turn for answers that
come later). Also the gRPC rules of the wire: length-prefixed messages, the
request size limit, compression refused, `grpc-timeout` deadlines, status and
`grpc-message` in trailers, trailers-only errors, routing by `:path`, and
keepalive pings. Knows nothing of etcd: handlers come from a `MethodTable`.

Theory of operation, per call:

- HEADERS open a stream. A non-gRPC request gets HTTP 415 with a short body; a
  gRPC one whose method is not POST gets grpc-go's HTTP 405; an unknown path
  gets UNIMPLEMENTED. Otherwise a `NativeCall` is made.
- A unary request is collected whole, then its handler's task starts; a
  streamed request's task starts at once and reads messages through the call
  (`async for request in call`), which credits flow-control window as it reads.
- The task's answer goes out as headers + message + trailers in one go; a
  streamed answer writes messages as they come, waiting while the stream's
  window or the socket is full.
- RST_STREAM from the client, a lost connection or the deadline cancel the
  task. Nothing is sent on a stream after it is closed.
- A stop (`transport/server.py`) sends GOAWAY, then ends calls with UNAVAILABLE
  and `ConnectionSettings.stopped_message` (trailers, so the client learns why)
  and cancels their tasks: waiting calls (`Method.waits`) at once, other
  calls after the grace. A draining connection closes itself once nothing is left to send.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

from google.protobuf.message import DecodeError

from queue_server.transport import header_blocks
from queue_server.transport.gateway import GatewaySettings, HttpConnection
from queue_server.transport.h2 import ErrorCode, H2Connection, Limits
from queue_server.transport.methods import (
    STREAM_DECODE_ERROR,
    UNARY_DECODE_ERROR,
    Method,
    run_handler,
)
from queue_server.transport.status import RpcError, Status, encode_message

log = logging.getLogger(__name__)

MESSAGE_PREFIX = struct.Struct(">BI")
"""A gRPC message's 5-byte prefix: compressed flag, length."""

STREAM_BACKLOG = 256 * 1024
"""Bytes a response stream may have waiting for window before its writer waits."""
WRITE_BUFFER_HIGH = 1024 * 1024
"""The socket buffer above which the connection stops reading requests (and
response streams wait): a client that does not read stops getting served."""
MAX_OUTBOUND_BYTES = 64 * 1024 * 1024
"""A connection whose unsent bytes grow past this anyway (answers to requests
already in flight) is dropped: its client is not reading."""
FLUSH_NOW_BYTES = 256 * 1024
"""Output a streaming writer may pile up before it is written at once."""
PREFACE_TIMEOUT = 10.0
"""Seconds a new connection has to send the HTTP/2 preface and SETTINGS (or the
TLS handshake is done by then): half-open and silent connections are closed."""

_TIMEOUT_UNITS = {
    ord("H"): 3600.0,
    ord("M"): 60.0,
    ord("S"): 1.0,
    ord("m"): 1e-3,
    ord("u"): 1e-6,
    ord("n"): 1e-9,
}
_RESERVED_METADATA = frozenset(
    (b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding")
)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""The HTTP/2 client connection preface: a connection that starts otherwise is
HTTP/1.1, handed to the gateway."""
_HTTP1_METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD ", b"OPTIONS ", b"PATCH ")
"""How an HTTP/1.1 request line starts: such a connection goes to the gateway."""
_LONGEST_METHOD = max(len(m) for m in _HTTP1_METHODS)
_NOT_GRPC_BODY = b"this port serves gRPC (content-type application/grpc)\n"
_NOT_GRPC_HEADERS = header_blocks.block(
    [(b":status", b"415"), (b"content-type", b"text/plain; charset=utf-8")]
)
_GO_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    "\\": "\\\\",
    '"': '\\"',
}


def go_quote(raw: bytes) -> str:
    """Go's strconv.Quote (fmt's %q) of a header value: as grpc-go quotes what
    it names in a status message."""
    out = ['"']
    for ch in raw.decode("utf-8", "surrogateescape"):
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch in _GO_ESCAPES:
            out.append(_GO_ESCAPES[ch])
        elif ch == " " or ch.isprintable():
            out.append(ch)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def parse_timeout(value: bytes) -> float | None:
    """A `grpc-timeout` value (up to 8 digits and a unit) in seconds; None if malformed."""
    if len(value) < 2 or len(value) > 9 or not value[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(value[-1])
    return None if unit is None else int(value[:-1]) * unit


class _ReadHeaders:
    """What a call's headers say, read once per header list: the pseudo-headers
    and gRPC headers the connection routes by, and, when a handler first asks,
    the metadata it sees."""

    __slots__ = (
        "_metadata",
        "content_type",
        "encoding",
        "headers",
        "http_method",
        "path",
        "seconds",
        "timeout",
    )

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.headers = headers
        path = content_type = timeout = encoding = http_method = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                http_method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
        self.path, self.http_method, self.content_type = path, http_method, content_type
        self.timeout, self.encoding = timeout, encoding
        self.seconds = parse_timeout(timeout) if timeout else None
        """The grpc-timeout in seconds (None: none, or malformed)."""
        self._metadata: tuple[tuple[str, str], ...] | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        if self._metadata is None:
            self._metadata = tuple(
                (name.decode("latin-1"), value.decode("utf-8", "replace"))
                for name, value in self.headers
                if name[:1] != b":" and name not in _RESERVED_METADATA
            )
        return self._metadata


READ_HEADERS_MEMO = 64
"""Header lists read, remembered per connection (see `GrpcConnection.request_headers`)."""


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """What every connection of one server is configured with."""

    methods: dict[bytes, Method]
    limits: Limits = field(default_factory=Limits)
    max_receive_message: int = 4 * 1024 * 1024
    keepalive_interval: float = 7200.0
    keepalive_timeout: float = 20.0
    preface_timeout: float = PREFACE_TIMEOUT
    gateway: GatewaySettings | None = None
    """The HTTP/1.1 JSON gateway served on the same port (None: gRPC only)."""
    stopped_message: str = "server stopped"
    """The UNAVAILABLE status text of calls a stop ends (etcd's is
    "etcdserver: server stopped")."""
    clock: Callable[[], float] = field(kw_only=True)
    """Monotonic seconds for the HTTP/2 layer's rate limits and pings: the owner's
    clock (a node's `Timers.clock`), handed in, never read from `time` here."""


class NativeCall:
    """One call on a `GrpcConnection`: the handler's `Call`, and for a streamed
    request its iterator of messages."""

    __slots__ = (
        "_conn",
        "_inbuf",
        "_messages",
        "_read",
        "_read_waiter",
        "_remote_done",
        "_write_waiter",
        "closed",
        "deadline",
        "headers_sent",
        "method",
        "stream_error",
        "stream_id",
        "task",
    )

    def __init__(
        self,
        conn: GrpcConnection,
        stream_id: int,
        method: Method,
        read: _ReadHeaders,
        deadline: float | None,
    ) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.method = method
        self._read = read
        self.deadline = deadline
        """When the call's grpc-timeout runs out (the loop's clock), or None."""
        self._inbuf = bytearray()
        self._messages: deque[bytes] = deque()
        self._read_waiter: asyncio.Future[None] | None = None
        self._write_waiter: asyncio.Future[None] | None = None
        self._remote_done = False
        self.closed = False
        self.headers_sent = False
        self.stream_error: RpcError | None = None
        self.task: asyncio.Task[None] | None = None

    # -- the Call interface --------------------------------------------------

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return self._read.metadata()

    def peer(self) -> str:
        return self._conn.peer_name

    def client_common_name(self) -> str | None:
        return self._conn.common_name

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self._conn.loop.time())

    async def abort(self, code: Status, message: str) -> NoReturn:
        raise RpcError(code, message)

    async def write(self, message: Any) -> None:
        payload = self.method.serialize(message)
        await self._send(MESSAGE_PREFIX.pack(0, len(payload)) + payload)

    async def write_many(self, messages: Sequence[Any]) -> None:
        serialize = self.method.serialize
        pack = MESSAGE_PREFIX.pack
        framed = []
        for message in messages:
            payload = message if type(message) is bytes else serialize(message)
            framed.append(pack(0, len(payload)))
            framed.append(payload)
        await self._send(b"".join(framed))

    async def _send(self, data: bytes) -> None:
        if self.closed:
            return
        conn = self._conn
        h2 = conn.h2
        sid = self.stream_id
        if not self.headers_sent:
            self.headers_sent = True
            h2.send_headers(sid, header_blocks.RESPONSE_HEADERS)
        h2.send_data(sid, data)
        if len(h2.out) >= FLUSH_NOW_BYTES:
            # Hand it to the socket now, so that its back pressure (pause_writing)
            # applies to this writer, and let the loop serve others meanwhile.
            conn.flush_now()
            await asyncio.sleep(0)
        else:
            conn.schedule_flush()
        while not self.closed and (h2.backlog(sid) > STREAM_BACKLOG or conn.write_paused):
            waiter = conn.loop.create_future()
            self._write_waiter = waiter
            await waiter

    # -- the request stream ---------------------------------------------------

    def __aiter__(self) -> NativeCall:
        return self

    async def __anext__(self) -> Any:
        while not self._messages:
            if self._remote_done or self.closed:
                raise StopAsyncIteration
            waiter = self._conn.loop.create_future()
            self._read_waiter = waiter
            await waiter
        raw = self._messages.popleft()
        conn = self._conn
        conn.h2.consumed(self.stream_id, len(raw) + 5)
        conn.schedule_flush()
        try:
            return self.method.parse(raw)
        except DecodeError as e:
            self.stream_error = RpcError(Status.INTERNAL, STREAM_DECODE_ERROR + str(e))
            raise self.stream_error from None

    # -- the connection's side -------------------------------------------------

    def feed(self, data: bytes, limit: int) -> RpcError | None:
        """Request bytes: split them into messages. Returns the error that ends
        the call (too large, compressed), if any."""
        buf = self._inbuf
        size = len(data) - 5
        whole = not buf and 0 <= size <= limit and data[0] == 0
        if whole and int.from_bytes(data[1:5], "big") == size:
            self._messages.append(data[5:])
            return None
        buf += data
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if length > limit:
                return RpcError(
                    Status.RESOURCE_EXHAUSTED,
                    f"grpc: received message larger than max ({length} vs. {limit})",
                )
            if buf[0]:
                return RpcError(
                    Status.INTERNAL, "grpc: compressed flag set with identity or empty encoding"
                )
            if len(buf) < 5 + length:
                break
            self._messages.append(bytes(buf[5 : 5 + length]))
            del buf[: 5 + length]
        return None

    def remote_done(self) -> None:
        self._remote_done = True
        self.wake_reader()

    def wake_reader(self) -> None:
        waiter = self._read_waiter
        if waiter is not None:
            self._read_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def wake_writer(self) -> None:
        waiter = self._write_waiter
        if waiter is not None:
            self._write_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def discard_unread(self) -> int:
        """Drop a streamed request's unread messages; returns their bytes (a
        unary request's were credited on arrival)."""
        if not self.method.request_streaming:
            return 0
        size = sum(len(m) + 5 for m in self._messages) + len(self._inbuf)
        self._messages.clear()
        self._inbuf.clear()
        return size

    def take_request(self) -> bytes | None:
        """The one message of a unary request (None: none, or more than one)."""
        if len(self._messages) != 1 or self._inbuf:
            return None
        return self._messages.popleft()


class GrpcConnection(asyncio.Protocol):
    """The asyncio protocol of one client connection: HTTP/2 in, calls out."""

    def __init__(self, settings: ConnectionSettings, on_close: Callable[[GrpcConnection], None]):
        self.settings = settings
        self.methods = settings.methods
        self.loop = asyncio.get_running_loop()
        self.h2 = H2Connection(self, settings.clock, settings.limits)
        self.calls: dict[int, NativeCall] = {}
        self._read_headers: dict[int, _ReadHeaders] = {}
        """What header lists said, by the list's id (the list is held, so its id
        is not reused meanwhile): h2 hands the same list again for a header block
        it remembers (`H2Connection._decode`), as a client's repeated calls send."""
        self._plain_http: set[int] = set()
        self.transport: asyncio.Transport | None = None
        self.peer_name = "unknown"
        self.common_name: str | None = None
        self.write_paused = False
        self.draining = False
        self._on_close = on_close
        self._flush_pending = False
        self._preface_timer: asyncio.TimerHandle | None = None
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._ping_timer: asyncio.TimerHandle | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        """One timer for every call's deadline: armed at the earliest (see `_expire_due`)."""
        self._deadline_at = 0.0
        self.idle = asyncio.Event()
        self.idle.set()
        self._sniffing = settings.gateway is not None
        """Until the first bytes tell HTTP/2 from HTTP/1.1 (only with a gateway)."""
        self._sniffed = b""
        self.http: HttpConnection | None = None
        """The HTTP/1.1 protocol this connection was handed to, if it was."""

    # -- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            host, port = peer[0], peer[1]
            self.peer_name = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self.common_name = _common_name(ssl_object.getpeercert())
            if ssl_object.selected_alpn_protocol() == "h2":
                self._sniffing = False
        self._preface_timer = self.loop.call_later(
            self.settings.preface_timeout, self._preface_deadline
        )
        if self.settings.keepalive_interval > 0:
            self._keepalive_timer = self.loop.call_later(
                self.settings.keepalive_interval, self._keepalive
            )
        if not self._sniffing:  # our SETTINGS wait until the client is known to speak h2
            self._flush()

    def data_received(self, data: bytes) -> None:
        if self._sniffing:
            data = self._sniff(data)
            if not data:
                return
        h2 = self.h2
        h2.receive(data)
        if h2.closed and h2.error:
            log.debug("client connection error peer=%s error=%s", self.peer_name, h2.error)
        self._flush()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        for call in list(self.calls.values()):
            call.wake_writer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (
            self._preface_timer,
            self._keepalive_timer,
            self._ping_timer,
            self._deadline_timer,
        ):
            if timer is not None:
                timer.cancel()
        calls = list(self.calls.values())
        self.calls.clear()
        for call in calls:
            self._closed(call)
            if call.task is not None:
                call.task.cancel()
        self.idle.set()
        self._on_close(self)

    def _sniff(self, data: bytes) -> bytes:
        """The first bytes: an HTTP/1.1 request line (the connection is handed to
        the gateway; returns nothing), or anything else, returned to be fed to h2
        with our SETTINGS sent first: the preface, or bytes that are neither, which
        h2 refuses as an invalid preface (GOAWAY, PROTOCOL_ERROR), as RFC 9113
        asks. Bytes that could still become either are kept."""
        data = self._sniffed + data
        head = data[: len(PREFACE)]
        undecided = head == PREFACE[: len(head)] and len(head) < len(PREFACE)
        method = data[:_LONGEST_METHOD]
        if undecided or any(m.startswith(method) and m != method for m in _HTTP1_METHODS):
            self._sniffed = data
            return b""
        self._sniffing = False
        self._sniffed = b""
        if any(data.startswith(m) for m in _HTTP1_METHODS):
            self._to_http1(data)
            return b""
        return data

    def _to_http1(self, data: bytes) -> None:
        """Hand the connection to an `HttpConnection` (the gateway) from here on."""
        settings = self.settings.gateway
        transport = self.transport
        assert settings is not None and transport is not None
        for timer in (self._preface_timer, self._keepalive_timer):
            if timer is not None:
                timer.cancel()
        self._preface_timer = self._keepalive_timer = None
        http = HttpConnection(
            settings, self.peer_name, self.common_name, self.idle, lambda: self._on_close(self)
        )
        self.http = http
        transport.set_protocol(http)
        http.connection_made(transport)
        http.data_received(data)

    # -- output --------------------------------------------------------------

    def _quiet(self) -> bool:
        """No call runs and no finished one still waits for window to send."""
        return not self.calls and not self.h2.pending_output

    def schedule_flush(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def flush_now(self) -> None:
        self._flush()

    def _flush(self) -> None:
        self._flush_pending = False
        transport = self.transport
        h2 = self.h2
        if transport is None or transport.is_closing():
            h2.out.clear()
            return
        out = h2.out
        if out:
            h2.out = bytearray()
            transport.write(out)
            if transport.get_write_buffer_size() > MAX_OUTBOUND_BYTES:
                log.warning("client not reading; connection dropped peer=%s", self.peer_name)
                transport.abort()
                return
        if h2.closed or (self.draining and self._quiet()):
            transport.close()

    # -- H2Events ------------------------------------------------------------

    def request_headers(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool
    ) -> None:
        if self._preface_timer is not None:
            self._preface_timer.cancel()
            self._preface_timer = None
        read = self._read_headers.get(id(headers))
        if read is None or read.headers is not headers:
            read = _ReadHeaders(headers)
            if len(self._read_headers) >= READ_HEADERS_MEMO:
                self._read_headers.clear()
            self._read_headers[id(headers)] = read
        path, http_method, content_type = read.path, read.http_method, read.content_type
        timeout, encoding, seconds = read.timeout, read.encoding, read.seconds
        if not content_type.startswith(b"application/grpc"):
            # Answered once the request has ended, as an HTTP server reads a
            # body first; until then the stream is open to the client.
            if end_stream:
                self._not_grpc(stream_id)
            else:
                self._plain_http.add(stream_id)
            return
        # grpc-go's order: the headers' own errors (a malformed grpc-timeout),
        # then the method, then what the server's routing finds
        deadline = None
        if timeout:
            if seconds is None:
                self._refuse(
                    stream_id,
                    Status.INTERNAL,
                    f"malformed grpc-timeout: {timeout.decode('latin-1')}",
                )
                return
            deadline = self.loop.time() + seconds
        if http_method != b"POST":
            self._not_post(stream_id, http_method, content_type)
            return
        method = self.methods.get(path)
        if method is None:
            self._refuse(stream_id, Status.UNIMPLEMENTED, self._unknown(path))
            return
        if encoding and encoding != b"identity":
            self._refuse(
                stream_id,
                Status.UNIMPLEMENTED,
                f'grpc: Decompressor is not installed for grpc-encoding "{encoding.decode("latin-1")}"',
            )
            return
        call = NativeCall(self, stream_id, method, read, deadline)
        self.calls[stream_id] = call
        self.idle.clear()
        if deadline is not None and (self._deadline_timer is None or deadline < self._deadline_at):
            self._arm_deadline(deadline)
        if method.request_streaming:
            call.task = self.loop.create_task(self._serve(call, call))
            if end_stream:
                call.remote_done()
        elif end_stream:
            self._start_unary(call)

    def request_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        call = self.calls.get(stream_id)
        if call is None:
            self.h2.consumed(stream_id, len(data))
            if end_stream and stream_id in self._plain_http:
                self._plain_http.discard(stream_id)
                self._not_grpc(stream_id)
            return
        if data:
            error = call.feed(data, self.settings.max_receive_message)
            if error is not None:
                self.h2.consumed(stream_id, len(data))
                self._end(call, error.code, error.message)
                if call.task is not None:
                    call.task.cancel()
                return
        method = call.method
        if not method.request_streaming:
            self.h2.consumed(stream_id, len(data))
            if end_stream:
                self._start_unary(call)
            return
        if end_stream:
            call.remote_done()
        elif data:
            call.wake_reader()

    def stream_reset(self, stream_id: int) -> None:
        self._plain_http.discard(stream_id)
        call = self.calls.pop(stream_id, None)
        if call is not None:
            self._closed(call)
            if call.task is not None:
                call.task.cancel()
            if self._quiet():
                self.idle.set()

    def stream_writable(self, stream_id: int) -> None:
        call = self.calls.get(stream_id)
        if call is not None:
            call.wake_writer()
        elif self._quiet():
            self.idle.set()
            if self.draining:
                self.schedule_flush()

    def ping_acked(self, payload: bytes) -> None:
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None

    # -- calls ---------------------------------------------------------------

    def _start_unary(self, call: NativeCall) -> None:
        raw = call.take_request()
        if raw is None:
            self._end(call, Status.INTERNAL, UNARY_DECODE_ERROR + "expected exactly one message")
            return
        try:
            request = call.method.parse(raw)
        except DecodeError as e:
            self._end(call, Status.INTERNAL, UNARY_DECODE_ERROR + str(e))
            return
        call.task = self.loop.create_task(self._serve(call, request))

    async def _serve(self, call: NativeCall, request: Any) -> None:
        """Run the call's handler (`methods.run_handler`) and end the stream
        with what it ends with."""

        def respond(response: Any) -> None:
            if not call.closed:
                payload = call.method.serialize(response)
                self.h2.respond(
                    call.stream_id,
                    header_blocks.RESPONSE_HEADERS,
                    MESSAGE_PREFIX.pack(0, len(payload)) + payload,
                    header_blocks.TRAILERS_OK,
                )
                self._finished(call)

        try:
            await run_handler(call.method, request, call, respond)
        except RpcError as e:
            self._end(call, e.code, e.message)
        except asyncio.CancelledError:
            if not call.closed:  # the server is stopping
                self._end(call, Status.UNAVAILABLE, self.settings.stopped_message)
        else:
            if call.method.response_streaming:  # `respond` ended a unary one
                self._end(call, Status.OK, "")

    def _not_grpc(self, stream_id: int) -> None:
        """HTTP 415 and a line of text for a request that is not gRPC."""
        self.h2.send_headers(stream_id, _NOT_GRPC_HEADERS)
        self.h2.send_data(stream_id, _NOT_GRPC_BODY, end_stream=True)

    def _not_post(self, stream_id: int, http_method: bytes, content_type: bytes) -> None:
        """grpc-go's answer (1.47 on, so etcd 3.5.10 on) to a gRPC request whose
        method is not POST: HTTP 405, its content type echoed as grpc-go does
        (the subtype after "+" or ";"), and INTERNAL in the same header block,
        which ends the stream (RST_STREAM(NO_ERROR) follows if the request had
        not ended)."""
        base = header_blocks.GRPC_CONTENT_TYPE
        separator = content_type[len(base) : len(base) + 1]
        subtype = content_type[len(base) + 1 :] if separator in (b"+", b";") else b""
        message = (
            f"Received a HEADERS frame with :method {go_quote(http_method)} which should be POST"
        )
        block = header_blocks.block(
            [
                (b":status", b"405"),
                (b"content-type", base + b"+" + subtype if subtype else base),
                (b"grpc-status", str(int(Status.INTERNAL)).encode()),
                (b"grpc-message", encode_message(message)),
            ]
        )
        self.h2.send_headers(stream_id, block, end_stream=True)

    def _refuse(self, stream_id: int, code: Status, message: str) -> None:
        self.h2.send_headers(
            stream_id, header_blocks.trailers_only(code, encode_message(message)), end_stream=True
        )

    def _end(self, call: NativeCall, code: Status, message: str) -> None:
        """End `call` with a status (trailers, or trailers-only before any message)."""
        if call.closed:
            return
        h2 = self.h2
        encoded = encode_message(message)
        if call.headers_sent:
            h2.send_trailers(call.stream_id, header_blocks.trailers(code, encoded))
        else:
            h2.send_headers(
                call.stream_id, header_blocks.trailers_only(code, encoded), end_stream=True
            )
        self._finished(call)

    def _finished(self, call: NativeCall) -> None:
        self.calls.pop(call.stream_id, None)
        self._closed(call)
        if self._quiet():
            self.idle.set()
        self.schedule_flush()

    def _closed(self, call: NativeCall) -> None:
        call.closed = True
        # (tested here, not in the calls: a unary call has nothing to discard or wake)
        if call.method.request_streaming:
            unread = call.discard_unread()
            if unread:  # never read, but the client's window must not shrink for good
                self.h2.consumed(call.stream_id, unread)
        if call._read_waiter is not None:
            call.wake_reader()
        if call._write_waiter is not None:
            call.wake_writer()

    def _arm_deadline(self, when: float) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_at = when
        self._deadline_timer = self.loop.call_at(when, self._expire_due)

    def _expire_due(self) -> None:
        """End the calls whose deadline has passed, and arm the timer at the
        next one. Most calls end long before their deadline (grpc-go clients
        send one with every call), so they cost no timer of their own: the
        timer fires about once per deadline's length, not once per call."""
        self._deadline_timer = None
        now = self.loop.time()
        following: float | None = None
        for call in list(self.calls.values()):
            deadline = call.deadline
            if deadline is None:
                continue
            if deadline <= now:
                self._expire(call)
            elif following is None or deadline < following:
                following = deadline
        if following is not None:
            self._arm_deadline(following)

    def _expire(self, call: NativeCall) -> None:
        if call.closed:
            return
        self._end(call, Status.DEADLINE_EXCEEDED, "context deadline exceeded")
        if call.task is not None:
            call.task.cancel()

    # -- connection lifetime --------------------------------------------------

    def _preface_deadline(self) -> None:
        self._preface_timer = None
        if not self.h2.handshaken and self.transport is not None:
            log.debug("connection sent no request in time; closed peer=%s", self.peer_name)
            self.transport.close()

    def _keepalive(self) -> None:
        self._keepalive_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        if self._ping_timer is None:  # one ping outstanding at a time, as grpc-go
            self.h2.ping(b"keepaliv")
            self.schedule_flush()
            self._ping_timer = self.loop.call_later(
                self.settings.keepalive_timeout, self._keepalive_expired
            )
        self._keepalive_timer = self.loop.call_later(
            self.settings.keepalive_interval, self._keepalive
        )

    def _keepalive_expired(self) -> None:
        self._ping_timer = None
        if self.transport is not None:
            log.info("keepalive ping not answered; connection closed peer=%s", self.peer_name)
            self.transport.abort()

    def drain(self) -> None:
        """A graceful stop: GOAWAY, finish the calls in flight, then close."""
        if self.http is not None:
            self.http.drain()
            return
        if self.draining:
            return
        self.draining = True
        self.h2.goaway(ErrorCode.NO_ERROR)
        self._flush()

    @property
    def serving(self) -> bool:
        """Whether a call is still running (output waiting for window aside)."""
        if self.http is not None:
            return not self.idle.is_set()
        return bool(self.calls)

    def end_calls(self, waiting_only: bool) -> None:
        """A stop: end calls in flight with UNAVAILABLE (`stopped_message`) and
        cancel their handlers. With `waiting_only`, only the calls that wait on
        their client or on others (`Method.waits`: watches, keepalive streams, long polls)."""
        if self.http is not None:
            self.http.end_call(waiting_only, Status.UNAVAILABLE, self.settings.stopped_message)
            return
        for call in list(self.calls.values()):
            if waiting_only and not call.method.waits:
                continue
            self._end(call, Status.UNAVAILABLE, self.settings.stopped_message)
            if call.task is not None:
                call.task.cancel()
        self._flush()

    def _unknown(self, path: bytes) -> str:
        """grpc-go's text for a path no method serves."""
        text = path.decode("latin-1")
        service, _, name = text[1:].rpartition("/") if text[:1] == "/" else text.rpartition("/")
        if not service:
            return f"malformed method name: {text!r}"
        if any(m.service == service for m in self.methods.values()):
            return f"unknown method {name} for service {service}"
        return f"unknown service {service}"

    def close_now(self) -> None:
        """The stop's time is up: close (a quiet connection after writing what it
        has), cutting the calls and the output still left."""
        if self.http is not None:
            self.http.close_now()
            return
        if self.transport is None:
            return
        if self.calls:
            self.transport.abort()
        else:
            self.transport.close()


def _common_name(cert: Any) -> str | None:
    """The subject CN of a verified peer certificate (ssl's getpeercert shape)."""
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value:
                return str(value)
    return None
