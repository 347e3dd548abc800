"""A small gRPC client over HTTP/2 for a front's unary calls to the backend.

What belongs here: unary gRPC calls whose request and response are bytes
already (`UnaryPool.call`), over a few HTTP/2 connections to the backend's
endpoints, with failover between them. Streams (Watch, LeaseKeepAlive,
Snapshot, Observe) stay on grpcio (`front/upstream.py`).

Why it exists: measured through a front with etcd's benchmark tool (put64),
grpcio's asyncio client cost about 100 µs of the front's CPU per call, more
than the rest of the front together; this client costs a fraction of that.
It is written for one peer, grpc-go as etcd runs it, and no more:

- Requests are encoded with literals without indexing (`header_blocks.block`),
  so no encoder state is kept; the block of a path is built once. Responses
  are decoded with `hpack`, per connection; a block made only of indexed
  fields (what grpc-go sends once its table holds them) changes no decoder
  state, so its decoding is remembered by its bytes.
- Flow control, receiving: our stream windows are as large as HTTP/2 allows,
  and the connection window is topped up once half of it is used.
  Sending: the request goes out as the backend's windows allow, the rest waits
  for its WINDOW_UPDATEs.
- Failures: a call that the backend refused unprocessed (GOAWAY past its
  stream, REFUSED_STREAM) or that could not be sent because no connection
  could be made is retried on another connection, as grpc's transparent retry
  does. A call in flight when its connection is lost fails with UNAVAILABLE:
  it may have been applied, so only the client may decide to retry it.
- Which member: the pool dials its preferred address first and the others
  after it; `move_to` changes the preferred one (`front/leader.py` keeps it on
  the leader), opening the new connection before it retires the old ones.
- Deadlines: sent as `grpc-timeout`, and enforced here too (RST_STREAM CANCEL).
- Keepalive: a connection that received nothing for KEEPALIVE_SECONDS is
  pinged, and closed when another period passes in silence, so a member that
  stops answering without closing (a cut network) is left for the next one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import unquote_to_bytes

from hpack import Decoder
from hpack.exceptions import HPACKError

from queue_server.transport.h2 import (
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    FLAG_ACK,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    FLAG_PADDED,
    FLAG_PRIORITY,
    FRAME_HEADER,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    WINDOW_UPDATE,
    ErrorCode,
)
from queue_server.transport.header_blocks import block, literal
from queue_server.transport.status import Status

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 3.0
"""How long a connection attempt to one endpoint may take."""
KEEPALIVE_SECONDS = 10.0
"""A connection that has received nothing for this long is sent a PING, and is
closed if this long again passes with nothing received: a member that stopped
answering without closing (a cut network, a stopped process) is left in 10-20 s,
as grpcio's keepalive leaves it for the front's streams (upstream.py). etcd
allows a ping every 5 s (its --grpc-keepalive-min-time)."""
KEEPALIVE_PING = b"frontkap"
"""The 8 bytes of our keepalive PING."""
CONNECTIONS = 2
"""Connections per front to the backend: calls are spread over them, so one
connection's writes and reads do not serialize every call."""
UNLIMITED_STREAMS = 1 << 32
"""No limit on concurrent streams until the backend's SETTINGS names one (RFC 9113 6.5.2)."""
RECV_TOP_UP = MAX_WINDOW // 2
"""Connection window used before we give it back in one WINDOW_UPDATE."""
DECODED_BLOCKS = 64
MAX_STREAM_ID = 2**31 - 1
DIAL_ERRORS = (OSError, TimeoutError, ConnectionError, ssl.SSLError)
"""What a failed connection attempt raises."""
_SETTINGS_ENTRY = struct.Struct(">HI")
_MESSAGE_PREFIX = struct.Struct(">BI")

_RST_STATUS = {
    ErrorCode.REFUSED_STREAM: Status.UNAVAILABLE,
    ErrorCode.CANCEL: Status.CANCELLED,
    ErrorCode.ENHANCE_YOUR_CALM: Status.RESOURCE_EXHAUSTED,
    ErrorCode.INADEQUATE_SECURITY: Status.PERMISSION_DENIED,
}
"""grpc-go's mapping of a stream reset to a status (others: INTERNAL)."""


class CallError(Exception):
    """A call ended with a status other than OK; `retry` when the backend never
    processed it (it may be sent again as it is)."""

    def __init__(self, code: Status, message: str, retry: bool = False) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.retry = retry


@dataclass(slots=True)
class _Call:
    done: asyncio.Future[bytes]
    pending: memoryview
    """Request bytes not yet sent (DATA frames, the last one ends the stream)."""
    send_window: int
    headers_seen: bool = False
    data: bytearray = field(default_factory=bytearray)
    block: bytearray | None = None
    block_ends_stream: bool = False


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection to one backend endpoint."""

    def __init__(self, pool: UnaryPool, address: str) -> None:
        self.pool = pool
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.calls: dict[int, _Call] = {}
        self.next_id = 1
        self.draining = False
        self.lost = False
        self.peer_window = DEFAULT_WINDOW
        self.peer_initial = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_MAX_FRAME
        self.peer_max_streams = UNLIMITED_STREAMS
        """The backend's SETTINGS_MAX_CONCURRENT_STREAMS (etcd's
        --max-concurrent-streams): calls past it wait in `waiting`, as grpc-go's
        do, instead of being refused."""
        self.waiting: collections.deque[tuple[bytes, bytes, asyncio.Future[bytes]]] = (
            collections.deque()
        )
        self.recv_used = 0
        self.buf = bytearray()
        self.decoder = Decoder()
        self.decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self.blocked: list[int] = []
        self._out: list[bytes] = []
        self._orphan = bytearray()
        """A header block of a stream we no longer wait for, still decoded so the
        decoder's table stays in step with the backend's encoder."""
        self.heard = True
        """Whether a frame came in since the last keepalive tick."""
        self.pinged = False
        self._tick: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        settings = _SETTINGS_ENTRY.pack(SETTINGS_ENABLE_PUSH, 0) + _SETTINGS_ENTRY.pack(
            SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW
        )
        transport.write(
            PREFACE
            + _frame(SETTINGS, 0, 0, settings)
            + _frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))
        )
        self._tick = asyncio.get_running_loop().call_later(KEEPALIVE_SECONDS, self._keepalive)

    def _keepalive(self) -> None:
        """One keepalive tick (KEEPALIVE_SECONDS)."""
        if self.lost or self.transport is None:
            return
        if not self.heard:
            if self.pinged:  # a ping and a whole period with nothing back
                log.warning("backend %s stopped answering: closing its connection", self.address)
                self.transport.abort()
                return
            self._write(_frame(PING, 0, 0, KEEPALIVE_PING))
            self.pinged = True
        else:
            self.pinged = False
        self.heard = False
        self._tick = asyncio.get_running_loop().call_later(KEEPALIVE_SECONDS, self._keepalive)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._tick is not None:
            self._tick.cancel()
        self.pool.forget(self)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"{self.address}: connection closed"))
        for call in self.calls.values():
            if not call.done.done():  # it may have been applied: not ours to retry
                call.done.set_exception(
                    CallError(
                        Status.UNAVAILABLE,
                        f"connection to {self.address} lost: {exc or 'closed by the peer'}",
                    )
                )
        self.calls.clear()
        self._fail_waiting(f"connection to {self.address} lost before the call was sent")

    def data_received(self, data: bytes) -> None:
        self.heard = True
        buf = self.buf
        buf += data
        pos, end = 0, len(buf)
        unpack = FRAME_HEADER.unpack_from
        try:
            while end - pos >= 9:
                first, flags, sid = unpack(buf, pos)
                length = first >> 8
                if end - pos - 9 < length:
                    break
                payload = bytes(buf[pos + 9 : pos + 9 + length])
                pos += 9 + length
                self._frame(first & 0xFF, flags, sid & 0x7FFFFFFF, payload)
        except (HPACKError, ValueError, struct.error) as e:
            self._fail(ErrorCode.PROTOCOL_ERROR, f"bad frame from {self.address}: {e}")
            return
        del buf[:pos]

    # -- frames in -----------------------------------------------------------------------

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            if flags & FLAG_PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & FLAG_PRIORITY:
                payload = payload[5:]
            self._on_block_part(sid, payload, flags & FLAG_END_HEADERS, flags & FLAG_END_STREAM)
        elif ftype == CONTINUATION:
            self._on_block_part(sid, payload, flags & FLAG_END_HEADERS, None)
        elif ftype == SETTINGS:
            if not flags & FLAG_ACK:
                self._on_settings(payload)
        elif ftype == WINDOW_UPDATE:
            self._on_window_update(sid, int.from_bytes(payload[:4], "big") & 0x7FFFFFFF)
        elif ftype == PING:
            if not flags & FLAG_ACK and self.transport is not None:
                self._write(_frame(PING, FLAG_ACK, 0, payload))
        elif ftype == RST_STREAM:
            self._on_rst(sid, ErrorCode(int.from_bytes(payload[:4], "big")))
        elif ftype == GOAWAY:
            self._on_goaway(int.from_bytes(payload[:4], "big") & 0x7FFFFFFF, payload[8:])

    def _on_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) // 6 * 6, 6):
            key, value = _SETTINGS_ENTRY.unpack_from(payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - self.peer_initial
                self.peer_initial = value
                for call in self.calls.values():
                    call.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self.peer_max_frame = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
        self._write(_frame(SETTINGS, FLAG_ACK, 0))
        self._start_waiting()
        if not self.ready.done():
            self.ready.set_result(None)
        self._send_blocked()

    def _on_window_update(self, sid: int, increment: int) -> None:
        if sid == 0:
            self.peer_window += increment
        else:
            call = self.calls.get(sid)
            if call is None:
                return
            call.send_window += increment
        self._send_blocked()

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        self.recv_used += len(payload)
        if self.recv_used >= RECV_TOP_UP and self.transport is not None:
            self._write(_frame(WINDOW_UPDATE, 0, 0, self.recv_used.to_bytes(4, "big")))
            self.recv_used = 0
        call = self.calls.get(sid)
        if call is None:
            return
        if flags & FLAG_PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        call.data += payload
        if flags & FLAG_END_STREAM:
            self._end(sid, call, None)

    def _on_block_part(
        self, sid: int, part: bytes, end_headers: int, end_stream: int | None
    ) -> None:
        call = self.calls.get(sid)
        if end_stream is not None:  # HEADERS: a new block
            if call is not None:
                call.block = bytearray(part)
                call.block_ends_stream = bool(end_stream)
            elif end_headers:
                self._decode(part)  # keep the decoder in step with the peer's table
                return
            else:
                self._orphan = bytearray(part)
                return
        elif call is not None and call.block is not None:
            call.block += part
        else:
            self._orphan += part
            if end_headers:
                self._decode(bytes(self._orphan))
            return
        if not end_headers or call is None or call.block is None:
            return
        headers = self._decode(bytes(call.block))
        call.block = None
        if call.headers_seen or call.block_ends_stream:
            self._end(sid, call, headers)
            return
        call.headers_seen = True
        status = dict(headers).get(b":status", b"")
        if status != b"200":
            code = Status.UNAVAILABLE if status in (b"502", b"503", b"504") else Status.UNKNOWN
            self._finish(sid, call, CallError(code, f"unexpected HTTP status {status.decode()}"))

    def _decode(self, raw: bytes) -> list[tuple[bytes, bytes]]:
        known = self.decoded.get(raw)
        if known is not None:
            return known
        headers = [(bytes(n), bytes(v)) for n, v in self.decoder.decode(raw, raw=True)]
        if all(b & 0x80 for b in raw) and len(self.decoded) < DECODED_BLOCKS:
            self.decoded[raw] = headers  # indexed fields only: no decoder state changed
        return headers

    def _on_rst(self, sid: int, code: ErrorCode) -> None:
        call = self.calls.get(sid)
        if call is None:
            return
        status = _RST_STATUS.get(code, Status.INTERNAL)
        self._finish(
            sid,
            call,
            CallError(
                status,
                f"stream reset by the backend: {code.name}",
                code == ErrorCode.REFUSED_STREAM,
            ),
        )

    def _on_goaway(self, last_stream_id: int, debug: bytes) -> None:
        self.draining = True
        self.pool.forget(self)
        message = f"the backend is going away: {debug.decode('utf-8', 'replace')}"
        for sid in [s for s in self.calls if s > last_stream_id]:
            self._finish(sid, self.calls[sid], CallError(Status.UNAVAILABLE, message, retry=True))
        self._fail_waiting(message)
        if not self.calls and self.transport is not None:
            self._flush()
            self.transport.close()

    def _fail(self, code: ErrorCode, message: str) -> None:
        if self.transport is not None:
            self._write(_frame(GOAWAY, 0, 0, bytes(4) + int(code).to_bytes(4, "big")))
            self._flush()
            self.transport.close()

    # -- calls -----------------------------------------------------------------------------

    def _end(self, sid: int, call: _Call, trailers: list[tuple[bytes, bytes]] | None) -> None:
        if trailers is None:
            self._finish(
                sid, call, CallError(Status.INTERNAL, "server closed the stream without trailers")
            )
            return
        fields = dict(trailers)
        code = int(fields.get(b"grpc-status", b"2"))
        if code != 0:
            message = unquote_to_bytes(fields.get(b"grpc-message", b"")).decode("utf-8", "replace")
            self._finish(sid, call, CallError(Status(code), message))
            return
        data = call.data
        if len(data) < 5:
            self._finish(sid, call, CallError(Status.INTERNAL, "response without a message"))
            return
        compressed, length = _MESSAGE_PREFIX.unpack_from(data)
        if compressed or length != len(data) - 5:
            self._finish(sid, call, CallError(Status.INTERNAL, "malformed response message"))
            return
        del self.calls[sid]
        if not call.done.done():
            call.done.set_result(bytes(data[5:]))
        self._after_call()

    def _finish(self, sid: int, call: _Call, error: CallError) -> None:
        self.calls.pop(sid, None)
        if not call.done.done():
            call.done.set_exception(error)
        self._after_call()

    def _after_call(self) -> None:
        if self.waiting:
            self._start_waiting()
        if self.draining and not self.calls and self.transport is not None:
            self._flush()
            self.transport.close()

    def retire(self) -> None:
        """Take no new calls, and close once the calls in flight have ended
        (the pool moved to another member). Calls still waiting for a stream
        were never sent: they are retried on the pool's other connections."""
        self.draining = True
        self.pool.forget(self)
        self._fail_waiting(f"connection to {self.address} retired before the call was sent")
        if not self.calls and self.transport is not None:
            self._flush()
            self.transport.close()

    def start(self, header_block: bytes, message: bytes) -> asyncio.Future[bytes]:
        """One unary call: its stream opened now, or once the backend's stream
        limit allows; the future resolves to the response bytes."""
        assert self.transport is not None
        done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if len(self.calls) >= self.peer_max_streams or self.waiting:
            self.waiting.append((header_block, message, done))
            self._start_waiting()  # in order: behind those waiting already
        else:
            self._open(header_block, message, done)
        return done

    def _open(self, header_block: bytes, message: bytes, done: asyncio.Future[bytes]) -> None:
        sid = self.next_id
        self.next_id += 2
        if self.next_id > MAX_STREAM_ID:  # ids run out: new calls go to a new connection
            self.draining = True
            self.pool.forget(self)
        body = _MESSAGE_PREFIX.pack(0, len(message)) + message
        call = _Call(done, memoryview(body), self.peer_initial)
        self.calls[sid] = call
        self._write(_frame(HEADERS, FLAG_END_HEADERS, sid, header_block))
        if not self._send(sid, call):
            self.blocked.append(sid)

    def _start_waiting(self) -> None:
        """Open the streams of waiting calls the backend's limit now allows."""
        waiting = self.waiting
        while waiting and len(self.calls) < self.peer_max_streams:
            if self.draining or self.lost or self.transport is None:
                self._fail_waiting(f"connection to {self.address} closing")
                return
            header_block, message, done = waiting.popleft()
            if not done.done():  # its caller gave up meanwhile
                self._open(header_block, message, done)

    def _fail_waiting(self, why: str) -> None:
        """Waiting calls were never sent: their callers may send them again."""
        while self.waiting:
            _, _, done = self.waiting.popleft()
            if not done.done():
                done.set_exception(CallError(Status.UNAVAILABLE, why, retry=True))

    def _write(self, data: bytes) -> None:
        """Queue bytes for the socket: what one turn of the loop queues goes out
        in one write (many calls start in the same turn under load)."""
        self._out.append(data)
        if len(self._out) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._out and self.transport is not None and not self.lost:
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def _send(self, sid: int, call: _Call) -> bool:
        """Send what the windows allow of the request; True when all of it is out."""
        assert self.transport is not None
        out = []
        while call.pending:
            size = min(len(call.pending), self.peer_window, call.send_window, self.peer_max_frame)
            if size <= 0:
                break
            chunk, call.pending = call.pending[:size], call.pending[size:]
            self.peer_window -= size
            call.send_window -= size
            out.append(_frame(DATA, 0 if call.pending else FLAG_END_STREAM, sid, bytes(chunk)))
        if out:
            self._write(b"".join(out))
        return not call.pending

    def _send_blocked(self) -> None:
        still = []
        for sid in self.blocked:
            call = self.calls.get(sid)
            if call is not None and not self._send(sid, call):
                still.append(sid)
        self.blocked = still

    def cancel(self, future: asyncio.Future[bytes]) -> None:
        for i, (_, _, done) in enumerate(self.waiting):
            if done is future:
                del self.waiting[i]
                return
        for sid, call in list(self.calls.items()):
            if call.done is future:
                del self.calls[sid]
                if self.transport is not None and not self.lost:
                    self._write(
                        _frame(RST_STREAM, 0, sid, int(ErrorCode.CANCEL).to_bytes(4, "big"))
                    )
                self._after_call()
                return


def _factory(conn: _Connection) -> Callable[[], _Connection]:
    return lambda: conn


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return FRAME_HEADER.pack(len(payload) << 8 | ftype, flags, sid) + payload


def grpc_timeout(seconds: float) -> bytes:
    """A `grpc-timeout` value: whole milliseconds, at most 8 digits."""
    ms = max(1, int(seconds * 1000))
    return f"{ms}m".encode() if ms < 100_000_000 else f"{int(seconds)}S".encode()


class UnaryPool:
    """Unary calls to the backend over up to `CONNECTIONS` HTTP/2 connections.
    `addresses` are host:port, tried in order (the one that last worked first)."""

    def __init__(
        self,
        addresses: Sequence[str],
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        connections: int = CONNECTIONS,
    ) -> None:
        self.addresses = list(addresses)
        self.tls = tls
        self.server_hostname = server_hostname
        self.size = connections
        self.connections: list[_Connection] = []
        self._turn = 0
        self._preferred = 0
        self._connecting: asyncio.Task[_Connection] | None = None
        self._blocks: dict[tuple[str, str], bytes] = {}
        self.scheme = b"https" if tls is not None else b"http"

    def forget(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self.connections.remove(conn)

    def header_block(self, path: str, authority: str) -> bytes:
        key = (path, authority)
        found = self._blocks.get(key)
        if found is None:
            found = block(
                [
                    (b":method", b"POST"),
                    (b":scheme", self.scheme),
                    (b":path", path.encode()),
                    (b":authority", authority.encode()),
                    (b"content-type", b"application/grpc"),
                    (b"te", b"trailers"),
                ]
            )
            self._blocks[key] = found
        return found

    async def _dial(self, address: str) -> _Connection:
        """A new connection to `address`, its SETTINGS exchanged (not yet in the pool)."""
        loop = asyncio.get_running_loop()
        host, _, port = address.rpartition(":")
        conn = _Connection(self, address)
        try:
            await asyncio.wait_for(
                loop.create_connection(
                    _factory(conn),
                    host.strip("[]"),
                    int(port),
                    ssl=self.tls,
                    server_hostname=self.server_hostname if self.tls else None,
                ),
                CONNECT_TIMEOUT,
            )
            await asyncio.wait_for(conn.ready, CONNECT_TIMEOUT)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise
        return conn

    async def _open(self) -> _Connection:
        errors = []
        order = self.addresses[self._preferred :] + self.addresses[: self._preferred]
        for address in order:
            try:
                conn = await self._dial(address)
            except DIAL_ERRORS as e:
                errors.append(f"{address}: {e}")
                continue
            self._preferred = self.addresses.index(address)
            self.connections.append(conn)
            return conn
        raise CallError(
            Status.UNAVAILABLE,
            "failed to connect to all addresses; " + "; ".join(errors),
            retry=True,
        )

    async def move_to(self, address: str) -> bool:
        """Make `address` (one of `addresses`) the member new calls go to. A
        connection to it is opened first, and only then are the open
        connections to other members retired: they take no new calls and close
        once their calls have ended. False, and nothing changed, when it cannot
        be reached."""
        index = self.addresses.index(address)
        if all(c.address == address for c in self.connections):
            self._preferred = index  # nothing open elsewhere: the next dial goes there
            return True
        try:
            conn = await self._dial(address)
        except DIAL_ERRORS as e:
            log.info(
                "backend member unreachable, calls stay where they are address=%s error=%s",
                address,
                e,
            )
            return False
        self._preferred = index
        for old in [c for c in self.connections if c.address != address]:
            old.retire()
        self.connections.append(conn)
        return True

    def _pick(self) -> _Connection | None:
        """The next of a full pool's connections in turn, if it is open (the
        common case, with no coroutine); None: ask `_connection`."""
        connections = self.connections
        if len(connections) < self.size:
            return None
        self._turn = (self._turn + 1) % len(connections)
        conn = connections[self._turn]
        return None if conn.draining or conn.lost else conn

    async def _connection(self) -> _Connection:
        live = [c for c in self.connections if not c.draining and not c.lost]
        if len(live) >= self.size:
            self._turn = (self._turn + 1) % len(live)
            return live[self._turn]
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._open())
        if live:
            self._turn = (self._turn + 1) % len(live)
            return live[self._turn]  # a new one is on its way meanwhile
        return await asyncio.shield(self._connecting)

    async def call(
        self,
        path: str,
        message: bytes,
        metadata: Sequence[tuple[str, str]] = (),
        timeout: float | None = None,
    ) -> bytes:
        """One unary call; raises CallError with the backend's status otherwise."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        attempts = 0
        while True:
            attempts += 1
            conn = self._pick() or await self._connection()
            authority = conn.address
            head = self.header_block(path, authority)
            extra = []
            if deadline is not None:
                left = deadline - loop.time()
                if left <= 0:
                    raise CallError(Status.DEADLINE_EXCEEDED, "context deadline exceeded")
                extra.append(literal(b"grpc-timeout", grpc_timeout(left)))
            for key, value in metadata:
                extra.append(literal(key.encode("latin-1"), value.encode()))
            future = conn.start(head + b"".join(extra) if extra else head, message)
            try:
                if deadline is None:
                    return await future
                return await asyncio.wait_for(asyncio.shield(future), deadline - loop.time())
            except TimeoutError:
                conn.cancel(future)
                raise CallError(Status.DEADLINE_EXCEEDED, "context deadline exceeded") from None
            except asyncio.CancelledError:
                conn.cancel(future)
                raise
            except CallError as e:
                if not e.retry or attempts > len(self.addresses) + 1:
                    raise

    async def close(self) -> None:
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        self.connections.clear()
