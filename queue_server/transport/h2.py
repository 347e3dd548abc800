"""The server side of one HTTP/2 connection (RFC 9113), with no I/O.

What belongs here: the frame layer of a connection. Bytes go in with
`receive()`, bytes to send accumulate in `out`, and what happens to streams is
told to an `H2Events` listener given at construction (request headers, request
data, a stream reset, a blocked stream writable again). It knows nothing of gRPC,
sockets or the event loop; the clock is injected. Must not import anything of
ours but `header_blocks`.

Theory of operation:

- The client speaks first: the 24-byte preface, then a SETTINGS frame. We send
  our SETTINGS and a connection WINDOW_UPDATE at once, and ACK theirs.
- A stream is opened by the client's HEADERS (+ CONTINUATION). It is in
  `streams` until it is closed on both sides or reset. Ids at or below
  `last_stream_id` that are not in `streams` are closed.
- Flow control, sending: every DATA byte we send takes from the connection's and
  the stream's window. What does not fit waits in the stream's `pending`, and
  goes out as WINDOW_UPDATEs (or a larger INITIAL_WINDOW_SIZE) arrive; trailers
  wait behind it. `backlog(stream_id)` tells a writer how much waits.
- Flow control, receiving: the listener calls `consumed(stream_id, n)` when it
  has taken n bytes of a stream's data off our hands (a unary request at once,
  a streamed message when the handler reads it); WINDOW_UPDATEs are sent once
  half of a window is used, so a slow reader holds the client back.
- Errors: a connection error sends GOAWAY and sets `closed`; the owner flushes
  `out` and closes the socket. A stream error sends RST_STREAM and tells the
  listener the stream is gone.
- Limits against hostile clients are in `Limits`, each with its reason.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from hpack import Decoder
from hpack.exceptions import HPACKError, OversizedHeaderListError

from queue_server.transport.header_blocks import TABLE_SIZE_ZERO

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20

SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
DEFAULT_MAX_FRAME = 16_384
"""The largest frame we accept: the default, which we never raise (grpc-go and
most clients send at most 16 KiB frames anyway)."""
MAX_FRAME_LIMIT = 2**24 - 1

DECODED_BLOCKS = 64
"""Header blocks remembered per connection (see `H2Connection._decode`)."""

FRAME_HEADER = struct.Struct(">IBI")
"""length(24) and type(8) packed in the first word, flags, stream id."""


class ErrorCode(IntEnum):
    """HTTP/2 error codes (RFC 9113 section 7)."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


STREAM_CAP = 65_536
"""Streams one connection may have open when --max-concurrent-streams says
"no limit" (etcd's default, 2^32-1): a client gets the configured limit, but
never so many that their state alone could exhaust the server's memory. A
benchmark with 256 clients on 16 connections uses 16 per connection."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one connection may make the server hold, and why each bound is
    what it is."""

    max_concurrent_streams: int = STREAM_CAP
    """SETTINGS_MAX_CONCURRENT_STREAMS, from --max-concurrent-streams (capped at
    STREAM_CAP). Streams beyond it are refused with RST_STREAM(REFUSED_STREAM)."""
    initial_window: int = 256 * 1024
    """SETTINGS_INITIAL_WINDOW_SIZE: a stream's unread data we hold at most. A
    watch stream whose handler stops reading holds back its client at 256 KiB."""
    connection_window: int = 8 * 1024 * 1024
    """The connection receive window: all unread data of one connection. Bounds
    inbound memory per connection, large enough for several max-size requests."""
    max_header_list_size: int = 64 * 1024
    """SETTINGS_MAX_HEADER_LIST_SIZE and the decoder's cap on a decoded header
    list: stops HPACK bombs (small blocks that decode to huge lists). etcd
    clients send a few hundred bytes (path, token, user agent)."""
    max_header_block: int = 128 * 1024
    """Compressed bytes of one header block across its CONTINUATIONs."""
    max_continuations: int = 64
    """CONTINUATION frames of one header block: empty CONTINUATIONs cost nothing
    to send and would never reach the byte cap (CVE-2024-27316)."""
    reset_burst: float = 1000.0
    reset_rate: float = 200.0
    """Client RST_STREAMs of streams not answered yet (and streams we refuse),
    as a token bucket: a burst, then this many per second. Past it, GOAWAY
    ENHANCE_YOUR_CALM (rapid reset, CVE-2023-44487). Clients cancel watches and
    calls, but not thousands a second for long."""
    junk_burst: float = 10_000.0
    junk_rate: float = 1_000.0
    """Frames that make us work and carry nothing: PRIORITY, empty DATA without
    END_STREAM, unknown types, SETTINGS (CVE-2019-9518 style floods)."""
    ping_min_interval: float = 5.0
    """--grpc-keepalive-min-time: a client ping sooner than this after the last
    one, while we sent nothing in between, is a strike."""
    max_ping_strikes: int = 2
    """grpc-go's maxPingStrikes: more strikes than this is GOAWAY
    ENHANCE_YOUR_CALM "too_many_pings", as etcd answers."""


class H2Events(Protocol):
    """What a connection tells its owner about streams."""

    def request_headers(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool
    ) -> None:
        """A new stream with its (validated) request headers."""

    def request_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        """Request body bytes (padding removed); `end_stream` ends the request."""

    def stream_reset(self, stream_id: int) -> None:
        """The stream is gone (the client reset it, or a stream error): stop
        using it; nothing more will be sent on it."""

    def stream_writable(self, stream_id: int) -> None:
        """A stream whose output waited for window got it all out."""

    def ping_acked(self, payload: bytes) -> None:
        """The client answered one of our PINGs."""


class _ConnectionError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _StreamError(Exception):
    def __init__(self, stream_id: int, code: ErrorCode) -> None:
        super().__init__(stream_id, code)
        self.stream_id = stream_id
        self.code = code


class _Stream:
    """One open stream's flow-control and close state."""

    __slots__ = (
        "content_length",
        "local_closed",
        "pending",
        "pending_end",
        "pending_trailers",
        "received",
        "recv_window",
        "remote_closed",
        "responded",
        "send_window",
        "stream_id",
        "unacked",
    )

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.stream_id = stream_id
        self.send_window = send_window
        self.recv_window = recv_window
        self.unacked = 0
        self.remote_closed = False
        self.local_closed = False
        self.responded = False
        self.pending = bytearray()
        self.pending_end = False
        self.pending_trailers: bytes | None = None
        self.content_length = -1
        self.received = 0


class _Bucket:
    """A token bucket on the injected clock."""

    __slots__ = ("burst", "clock", "rate", "stamp", "tokens")

    def __init__(self, burst: float, rate: float, clock: Callable[[], float]) -> None:
        self.burst = burst
        self.rate = rate
        self.clock = clock
        self.tokens = burst
        self.stamp = clock()

    def take(self) -> bool:
        """Take one token; False when the bucket is empty."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= 1
        return self.tokens >= 0


_PSEUDO_BITS = {b":method": 1, b":scheme": 2, b":path": 4, b":authority": 8}
_REQUIRED_PSEUDO = 1 | 2 | 4
_CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)


def _check_request_headers(headers: list[tuple[bytes, bytes]]) -> int:
    """RFC 9113 8.2 and 8.3: a well-formed request's headers. Returns the
    content-length (-1 when absent); raises ValueError when malformed."""
    seen = 0
    regular = False
    content_length = -1
    for name, value in headers:
        if name[:1] == b":":
            bit = _PSEUDO_BITS.get(name, 0)
            if regular or not bit or seen & bit:
                raise ValueError(name)
            seen |= bit
            if bit == 4 and not value:
                raise ValueError(name)
            continue
        regular = True
        if name.lower() != name or name in _CONNECTION_SPECIFIC:
            raise ValueError(name)
        if name == b"te" and value != b"trailers":
            raise ValueError(name)
        if name == b"content-length":
            if not value.isdigit():
                raise ValueError(name)
            content_length = int(value)
    if seen & _REQUIRED_PSEUDO != _REQUIRED_PSEUDO:
        raise ValueError("missing pseudo-header")
    return content_length


def _check_trailers(headers: list[tuple[bytes, bytes]]) -> None:
    for name, _ in headers:
        if name[:1] == b":" or name.lower() != name or name in _CONNECTION_SPECIFIC:
            raise ValueError(name)


_UNCHECKED = -2
"""`_DecodedBlock.content_length` before the request's headers were checked."""


class _DecodedBlock:
    """A decoded header block, and once checked as a request's headers, the
    content-length they declare (-1: none), so a remembered block is not
    checked again."""

    __slots__ = ("content_length", "headers")

    def __init__(self, headers: list[tuple[bytes, bytes]]) -> None:
        self.headers = headers
        self.content_length = _UNCHECKED


class H2Connection:
    """The server side of one HTTP/2 connection: frames in, frames out."""

    def __init__(
        self,
        events: H2Events,
        clock: Callable[[], float],
        limits: Limits | None = None,
    ) -> None:
        """`clock` (monotonic seconds, the owner's: the node's timer clock) times the
        rate limits and the keepalive pings."""
        self.events = events
        self.limits = limits = limits or Limits()
        self.clock = clock
        self.out = bytearray()
        """Bytes to send; the owner writes and clears it."""
        self.closed = False
        """A connection error was sent (or GOAWAY after drain): close after flushing."""
        self.goaway_sent = False
        self.peer_goaway = False
        self.streams: dict[int, _Stream] = {}
        self.last_stream_id = 0
        self.error: str | None = None
        """Why the connection was closed by a connection error."""
        self._buf = bytearray()
        self._preface = False
        self.handshaken = False
        """The client's preface and first SETTINGS have arrived."""
        self._decoder = Decoder(max_header_list_size=limits.max_header_list_size)
        self._decoded: dict[bytes, _DecodedBlock] = {}
        self._first_block = True
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._send_window = DEFAULT_WINDOW
        self._recv_window = limits.connection_window
        self._recv_unacked = 0
        self._blocked: dict[int, None] = {}
        self._block_stream = 0
        self._block_parts: list[bytes] = []
        self._block_size = 0
        self._block_frames = 0
        self._block_end_stream = False
        self._block_bad_priority = False
        self._reset_by_us: dict[int, None] = {}
        self._resets = _Bucket(limits.reset_burst, limits.reset_rate, self.clock)
        self._junk = _Bucket(limits.junk_burst, limits.junk_rate, self.clock)
        self._ping_strikes = 0
        self._last_ping = float("-inf")
        self._sent_since_ping = False
        self._send_settings()

    # -- output ------------------------------------------------------------

    def _frame(self, ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> None:
        out = self.out
        out += FRAME_HEADER.pack(len(payload) << 8 | ftype, flags, stream_id)
        out += payload

    def _send_settings(self) -> None:
        limits = self.limits
        settings = [
            (SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
            (SETTINGS_INITIAL_WINDOW_SIZE, limits.initial_window),
            (SETTINGS_MAX_HEADER_LIST_SIZE, limits.max_header_list_size),
        ]
        payload = b"".join(struct.pack(">HI", k, v) for k, v in settings)
        self._frame(SETTINGS, 0, 0, payload)
        increment = limits.connection_window - DEFAULT_WINDOW
        if increment > 0:
            self._frame(WINDOW_UPDATE, 0, 0, increment.to_bytes(4, "big"))

    def send_headers(self, stream_id: int, block: bytes, end_stream: bool = False) -> None:
        """A header block (response headers, or trailers with `end_stream`)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed:
            return
        if self._first_block:
            block = TABLE_SIZE_ZERO + block
            self._first_block = False
        stream.responded = True
        flags = FLAG_END_STREAM if end_stream else 0
        limit = self._peer_max_frame
        if len(block) <= limit:
            self._frame(HEADERS, flags | FLAG_END_HEADERS, stream_id, block)
        else:
            self._frame(HEADERS, flags, stream_id, block[:limit])
            rest = block[limit:]
            while rest:
                chunk, rest = rest[:limit], rest[limit:]
                self._frame(CONTINUATION, 0 if rest else FLAG_END_HEADERS, stream_id, chunk)
        self._sent_since_ping = True
        if end_stream:
            self._close_local(stream)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """DATA on a stream, within the windows; the rest waits in `pending`."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed:
            return
        if stream.pending:
            stream.pending += data
            stream.pending_end = stream.pending_end or end_stream
            return
        size = len(data)
        if (
            size <= self._send_window
            and size <= stream.send_window
            and size <= self._peer_max_frame
        ):
            self._send_window -= size
            stream.send_window -= size
            self._frame(DATA, FLAG_END_STREAM if end_stream else 0, stream_id, data)
            self._sent_since_ping = True
            if end_stream:
                self._close_local(stream)
            return
        stream.pending += data
        stream.pending_end = end_stream
        self._blocked[stream_id] = None
        self._drain(stream)

    def send_trailers(self, stream_id: int, block: bytes) -> None:
        """Trailers that end the stream, after any data still waiting for window."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed:
            return
        if stream.pending:
            stream.pending_trailers = block
            return
        self.send_headers(stream_id, block, end_stream=True)

    def respond(self, stream_id: int, headers: bytes, data: bytes, trailers: bytes) -> None:
        """A whole response: headers, one body, trailers (the unary call's path).
        When each fits one frame and the body fits the windows (nearly always),
        the three frames are written at once; otherwise one part after the other."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_closed:
            return
        size = len(data)
        limit = self._peer_max_frame
        if (
            self._first_block
            or stream.pending
            or len(headers) > limit
            or len(trailers) > limit
            or size > limit
            or size > self._send_window
            or size > stream.send_window
        ):
            self.send_headers(stream_id, headers)
            self.send_data(stream_id, data)
            self.send_trailers(stream_id, trailers)
            return
        self._send_window -= size
        stream.send_window -= size
        stream.responded = True
        self._sent_since_ping = True
        pack = FRAME_HEADER.pack
        out = self.out
        out += pack(len(headers) << 8 | HEADERS, FLAG_END_HEADERS, stream_id)
        out += headers
        out += pack(size << 8 | DATA, 0, stream_id)
        out += data
        out += pack(len(trailers) << 8 | HEADERS, FLAG_END_STREAM | FLAG_END_HEADERS, stream_id)
        out += trailers
        self._close_local(stream)

    @property
    def pending_output(self) -> bool:
        """Some stream still has data or trailers waiting for window."""
        return bool(self._blocked)

    def backlog(self, stream_id: int) -> int:
        """Bytes of the stream waiting for flow-control window."""
        stream = self.streams.get(stream_id)
        return len(stream.pending) if stream is not None else 0

    def reset(self, stream_id: int, code: ErrorCode = ErrorCode.CANCEL) -> None:
        """RST_STREAM a stream (ours to end: a deadline, a refused call)."""
        self._frame(RST_STREAM, 0, stream_id, int(code).to_bytes(4, "big"))
        self._forget(stream_id)

    def ping(self, payload: bytes) -> None:
        """A PING of ours (keepalive); the answer comes to `ping_acked`."""
        self._frame(PING, 0, 0, payload)

    def goaway(self, code: ErrorCode = ErrorCode.NO_ERROR, debug: bytes = b"") -> None:
        """GOAWAY with the last stream we took: no new streams after it."""
        self._frame(
            GOAWAY,
            0,
            0,
            self.last_stream_id.to_bytes(4, "big") + int(code).to_bytes(4, "big") + debug,
        )
        self.goaway_sent = True

    def consumed(self, stream_id: int, size: int) -> None:
        """The owner took `size` bytes of the stream's data: credit them back."""
        self._recv_unacked += size
        if self._recv_unacked >= self.limits.connection_window // 2:
            self._frame(WINDOW_UPDATE, 0, 0, self._recv_unacked.to_bytes(4, "big"))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            return
        stream.unacked += size
        if stream.unacked >= self.limits.initial_window // 2:
            self._frame(WINDOW_UPDATE, 0, stream_id, stream.unacked.to_bytes(4, "big"))
            stream.recv_window += stream.unacked
            stream.unacked = 0

    def _close_local(self, stream: _Stream) -> None:
        stream.local_closed = True
        if stream.remote_closed:
            del self.streams[stream.stream_id]
        else:
            # The response is complete before the request: ask the client to stop
            # sending without error (RFC 9113 8.1), as grpc-go does.
            self._frame(RST_STREAM, 0, stream.stream_id, b"\x00\x00\x00\x00")
            self._forget(stream.stream_id)

    def _forget(self, stream_id: int) -> None:
        """A stream we reset: frames still in flight for it are ignored."""
        self.streams.pop(stream_id, None)
        self._blocked.pop(stream_id, None)
        reset = self._reset_by_us
        reset[stream_id] = None
        if len(reset) > 1024:
            del reset[next(iter(reset))]

    def _drain(self, stream: _Stream) -> bool:
        """Send what the windows allow of `stream`'s pending output; True when
        all of it (and its trailers) went out."""
        pending = stream.pending
        limit = self._peer_max_frame
        sid = stream.stream_id
        while pending:
            room = min(self._send_window, stream.send_window, limit)
            if room <= 0:
                return False
            chunk = bytes(pending[:room])
            del pending[:room]
            self._send_window -= len(chunk)
            stream.send_window -= len(chunk)
            end = not pending and stream.pending_end and stream.pending_trailers is None
            self._frame(DATA, FLAG_END_STREAM if end else 0, sid, chunk)
            self._sent_since_ping = True
            if end:
                self._blocked.pop(sid, None)
                self._close_local(stream)
                return True
        self._blocked.pop(sid, None)
        trailers = stream.pending_trailers
        if trailers is not None:
            stream.pending_trailers = None
            self.send_headers(sid, trailers, end_stream=True)
        elif stream.pending_end:
            self._frame(DATA, FLAG_END_STREAM, sid)
            self._close_local(stream)
        self.events.stream_writable(sid)
        return True

    def _drain_blocked(self) -> None:
        for sid in list(self._blocked):
            if self._send_window <= 0:
                return
            stream = self.streams.get(sid)
            if stream is None:
                self._blocked.pop(sid, None)
            else:
                self._drain(stream)

    # -- input -------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Bytes from the client. Afterwards `out` holds the answers, and
        `closed` says the connection must be closed once they are written."""
        if self.closed:
            return
        buf = self._buf
        buf += data
        try:
            if not self._preface:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "invalid preface")
                    return
                if buf[: len(PREFACE)] != PREFACE:
                    raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "invalid preface")
                del buf[: len(PREFACE)]
                self._preface = True
            self._frames(buf)
        except _ConnectionError as e:
            self._connection_error(e.code, e.message)

    def _connection_error(self, code: ErrorCode, message: str) -> None:
        self.goaway(code, message.encode())
        self.closed = True
        self.error = message
        self._buf.clear()

    def _frames(self, buf: bytearray) -> None:
        pos = 0
        end = len(buf)
        unpack = FRAME_HEADER.unpack_from
        try:
            while end - pos >= 9:
                first, flags, sid = unpack(buf, pos)
                length = first >> 8
                if length > DEFAULT_MAX_FRAME:
                    raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "frame too large")
                if end - pos - 9 < length:
                    break
                ftype = first & 0xFF
                sid &= 0x7FFFFFFF
                payload = bytes(buf[pos + 9 : pos + 9 + length])
                pos += 9 + length
                if not self.handshaken:
                    if ftype != SETTINGS or flags & FLAG_ACK:
                        raise _ConnectionError(
                            ErrorCode.PROTOCOL_ERROR, "first frame must be SETTINGS"
                        )
                    self.handshaken = True
                if self._block_stream and ftype != CONTINUATION:
                    raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "expected CONTINUATION")
                try:
                    if ftype == DATA:
                        self._on_data(flags, sid, payload)
                    elif ftype == HEADERS:
                        self._on_headers(flags, sid, payload)
                    elif ftype == CONTINUATION:
                        self._on_continuation(flags, sid, payload)
                    elif ftype == WINDOW_UPDATE:
                        self._on_window_update(sid, payload)
                    elif ftype == RST_STREAM:
                        self._on_rst_stream(sid, payload)
                    elif ftype == SETTINGS:
                        self._on_settings(flags, sid, payload)
                    elif ftype == PING:
                        self._on_ping(flags, sid, payload)
                    elif ftype == PRIORITY:
                        self._on_priority(sid, payload)
                    elif ftype == GOAWAY:
                        self._on_goaway(sid, payload)
                    elif ftype == PUSH_PROMISE:
                        raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE from client")
                    else:
                        self._junk_frame()  # unknown frame types are ignored
                except _StreamError as e:
                    self._stream_error(e.stream_id, e.code)
                if self.closed:
                    return
        finally:
            if not self.closed:
                del buf[:pos]

    def _stream_error(self, stream_id: int, code: ErrorCode) -> None:
        known = stream_id in self.streams
        self._frame(RST_STREAM, 0, stream_id, int(code).to_bytes(4, "big"))
        self._forget(stream_id)
        if known:
            self.events.stream_reset(stream_id)

    def _junk_frame(self) -> None:
        if not self._junk.take():
            raise _ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "too many frames with no work")

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_window -= size
        if self._recv_window < 0:
            raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "connection window exceeded")
        data = payload
        if flags & FLAG_PADDED:
            if not size or payload[0] >= size:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "padding exceeds frame")
            data = payload[1 : size - payload[0]]
        stream = self.streams.get(sid)
        if stream is None or stream.remote_closed:
            if stream is None and sid > self.last_stream_id:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on an idle stream")
            self.consumed(0, size)
            if sid in self._reset_by_us:
                return
            raise _StreamError(sid, ErrorCode.STREAM_CLOSED)
        stream.recv_window -= size
        if stream.recv_window < 0:
            self.consumed(0, size)
            raise _StreamError(sid, ErrorCode.FLOW_CONTROL_ERROR)
        end_stream = bool(flags & FLAG_END_STREAM)
        if not data and not end_stream:
            self._junk_frame()
        if stream.content_length >= 0:
            stream.received += len(data)
            if stream.received > stream.content_length or (
                end_stream and stream.received != stream.content_length
            ):
                self.consumed(0, size)
                raise _StreamError(sid, ErrorCode.PROTOCOL_ERROR)
        padding = size - len(data)
        if padding:
            self.consumed(sid, padding)
        if end_stream:
            stream.remote_closed = True
            if stream.local_closed:
                del self.streams[sid]
        self.events.request_data(sid, data, end_stream)

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or not sid & 1:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS on an invalid stream id")
        start = 0
        end = len(payload)
        if flags & FLAG_PADDED:
            if not end:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "padding exceeds frame")
            start = 1
            end -= payload[0]
        bad_priority = False
        if flags & FLAG_PRIORITY:
            if start + 5 > end:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "padding exceeds frame")
            depends = int.from_bytes(payload[start : start + 4], "big") & 0x7FFFFFFF
            bad_priority = depends == sid
            start += 5
        if start > end:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "padding exceeds frame")
        fragment = payload[start:end]
        end_stream = bool(flags & FLAG_END_STREAM)
        if flags & FLAG_END_HEADERS:
            self._header_block(sid, fragment, end_stream, bad_priority)
            return
        self._block_stream = sid
        self._block_parts = [fragment]
        self._block_size = len(fragment)
        self._block_frames = 0
        self._block_end_stream = end_stream
        self._block_bad_priority = bad_priority
        if self._block_size > self.limits.max_header_block:
            raise _ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if not self._block_stream or sid != self._block_stream:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "unexpected CONTINUATION")
        self._block_parts.append(payload)
        self._block_size += len(payload)
        self._block_frames += 1
        limits = self.limits
        if self._block_size > limits.max_header_block:
            raise _ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        if self._block_frames > limits.max_continuations:
            raise _ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "too many CONTINUATION frames")
        if flags & FLAG_END_HEADERS:
            self._block_stream = 0
            block = b"".join(self._block_parts)
            self._block_parts = []
            self._header_block(sid, block, self._block_end_stream, self._block_bad_priority)

    def _header_block(self, sid: int, block: bytes, end_stream: bool, bad_priority: bool) -> None:
        decoded = self._decoded.get(block)
        try:
            if decoded is None:
                decoded = self._decode(block)
        except OversizedHeaderListError:
            raise _ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "header list too large") from None
        except (HPACKError, IndexError, ValueError):
            raise _ConnectionError(ErrorCode.COMPRESSION_ERROR, "bad header block") from None
        fields = decoded.headers
        stream = self.streams.get(sid)
        if stream is not None:  # trailers
            if stream.remote_closed:
                raise _StreamError(sid, ErrorCode.STREAM_CLOSED)
            if not end_stream:
                raise _StreamError(sid, ErrorCode.PROTOCOL_ERROR)
            try:
                _check_trailers(fields)
            except ValueError:
                raise _StreamError(sid, ErrorCode.PROTOCOL_ERROR) from None
            if stream.content_length >= 0 and stream.received != stream.content_length:
                raise _StreamError(sid, ErrorCode.PROTOCOL_ERROR)
            stream.remote_closed = True
            if stream.local_closed:
                del self.streams[sid]
            self.events.request_data(sid, b"", True)
            return
        if sid <= self.last_stream_id:
            if sid in self._reset_by_us:
                return
            raise _ConnectionError(ErrorCode.STREAM_CLOSED, "HEADERS on a closed stream")
        self.last_stream_id = sid
        if self.goaway_sent:
            return  # after GOAWAY new streams are ignored (RFC 9113 6.8)
        if bad_priority:
            raise _StreamError(sid, ErrorCode.PROTOCOL_ERROR)
        content_length = decoded.content_length
        if content_length == _UNCHECKED:
            try:
                content_length = _check_request_headers(fields)
            except ValueError:
                raise _StreamError(sid, ErrorCode.PROTOCOL_ERROR) from None
            decoded.content_length = content_length  # remembered with the block
        if len(self.streams) >= self.limits.max_concurrent_streams:
            if not self._resets.take():
                raise _ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "too many refused streams")
            raise _StreamError(sid, ErrorCode.REFUSED_STREAM)
        if end_stream and content_length > 0:
            raise _StreamError(sid, ErrorCode.PROTOCOL_ERROR)
        stream = _Stream(sid, self._peer_initial_window, self.limits.initial_window)
        stream.content_length = content_length
        stream.remote_closed = end_stream
        self.streams[sid] = stream
        self.events.request_headers(sid, fields, end_stream)

    def _decode(self, block: bytes) -> _DecodedBlock:
        """HPACK-decode `block`. A client sends the same bytes for the same call
        again and again (indexed fields into its unchanged dynamic table), so
        a block that left the table as it was is remembered until the table
        next changes: decoding is then a dict lookup. A block of indexed fields
        only (the common one after the table changed: every index moved by
        one) is read here without hpack's general decoder."""
        decoder = self._decoder
        entries = decoder.header_table.dynamic_entries
        size, newest = len(entries), entries[0] if entries else None
        fields = self._indexed_only(block)
        headers: list[tuple[bytes, bytes]] = (
            decoder.decode(block, raw=True)  # type: ignore[assignment]
            if fields is None
            else fields
        )
        decoded = _DecodedBlock(headers)
        # An insertion puts a new tuple first (compared by identity: an equal
        # entry added again still shifts the others' indexes); evictions change
        # the length.
        if len(entries) != size or (entries[0] if entries else None) is not newest:
            self._decoded.clear()
        elif len(self._decoded) < DECODED_BLOCKS:
            self._decoded[block] = decoded
        return decoded

    def _indexed_only(self, block: bytes) -> list[tuple[bytes, bytes]] | None:
        """The fields of a block made only of indexed fields (RFC 7541 6.1),
        which leave the table as it is; None for any other block, and for
        anything hpack's decoder should judge (a bad index, a table over its
        allowed size, a header list over its limit)."""
        decoder = self._decoder
        if decoder.header_table_size > decoder.max_allowed_table_size:
            return None
        get = decoder.header_table.get_by_index
        limit = decoder.max_header_list_size
        fields: list[tuple[bytes, bytes]] = []
        total = 0
        i, end = 0, len(block)
        try:
            while i < end:
                first = block[i]
                i += 1
                if first < 0x80:
                    return None
                index = first & 0x7F
                if index == 0x7F:  # the 7-bit prefix is full: continuation bytes follow
                    shift = 0
                    while True:
                        octet = block[i]
                        i += 1
                        index += (octet & 0x7F) << shift
                        if octet < 0x80:
                            break
                        shift += 7
                        if shift > 21:
                            return None
                name, value = get(index)
                total += len(name) + len(value) + 32
                if total > limit:
                    return None
                fields.append((name, value))
        except (HPACKError, IndexError):
            return None
        return fields

    def _on_priority(self, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) != 5:
            raise _StreamError(sid, ErrorCode.FRAME_SIZE_ERROR)
        self._junk_frame()
        if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid:
            raise _StreamError(sid, ErrorCode.PROTOCOL_ERROR)

    def _on_rst_stream(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM of wrong size")
        if sid == 0 or sid > self.last_stream_id:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        stream = self.streams.pop(sid, None)
        if stream is None:
            return
        self._blocked.pop(sid, None)
        self.events.stream_reset(sid)
        # Only a reset before any answer is work thrown away (the rapid reset
        # attack); cancelling a stream that was answered is how clients end a
        # KeepAliveOnce or a watch.
        if not stream.responded and not self._resets.take():
            raise _ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "too many stream resets")

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & FLAG_ACK:
            if payload:
                raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS of wrong size")
        self._junk_frame()
        grew = False
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_ENABLE_PUSH:
                if value > 1:
                    raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "bad ENABLE_PUSH")
            elif key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "window too large")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "window overflow")
                grew = grew or delta > 0
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= MAX_FRAME_LIMIT:
                    raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                self._peer_max_frame = value
            # HEADER_TABLE_SIZE: our blocks use no dynamic table; the others are
            # limits on what we would push or send in headers, which stay small.
        self._frame(SETTINGS, FLAG_ACK, 0)
        if grew:
            self._drain_blocked()

    def _on_ping(self, flags: int, sid: int, payload: bytes) -> None:
        if len(payload) != 8:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "PING of wrong size")
        if sid != 0:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
        if flags & FLAG_ACK:
            self.events.ping_acked(payload)
            return
        now = self.clock()
        if self._sent_since_ping:
            self._ping_strikes = 0
        elif now - self._last_ping < self.limits.ping_min_interval:
            self._ping_strikes += 1
        self._sent_since_ping = False
        self._last_ping = now
        if self._ping_strikes > self.limits.max_ping_strikes:
            raise _ConnectionError(ErrorCode.ENHANCE_YOUR_CALM, "too_many_pings")
        self._frame(PING, FLAG_ACK, 0, payload)

    def _on_goaway(self, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY too short")
        self.peer_goaway = True

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE of wrong size")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if not increment:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "zero window increment")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise _ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "window overflow")
            if self._blocked:
                self._drain_blocked()
            return
        stream = self.streams.get(sid)
        if stream is None:
            if sid > self.last_stream_id:
                raise _ConnectionError(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return
        if not increment:
            raise _StreamError(sid, ErrorCode.PROTOCOL_ERROR)
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            raise _StreamError(sid, ErrorCode.FLOW_CONTROL_ERROR)
        if sid in self._blocked:
            self._drain(stream)
