"""A raw HTTP/2 client for tests: a connection whose frames the test writes by
hand (so it can misbehave as no gRPC library would), filed by stream as they
are read. Every read is bounded by WAIT."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hpack import Decoder, Encoder

from queue_server.transport.h2 import (
    DATA,
    DEFAULT_WINDOW,
    FLAG_ACK,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    HEADERS,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
)
from tests.support.h2_frames import Frame, frame

WAIT = 5.0
"""Seconds any one thing that should happen may take."""


def grpc_request_headers(path: str, method: str = "POST") -> list[tuple[str, str]]:
    """A gRPC request's headers for `path` ("/service/Method")."""
    return [
        (":method", method),
        (":scheme", "http"),
        (":path", path),
        (":authority", "127.0.0.1"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


def settings_frame(values: dict[int, int] | None = None) -> bytes:
    items = (values or {}).items()
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in items))


def window_update(sid: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, increment.to_bytes(4, "big"))


def grpc_message(message: Any) -> bytes:
    payload: bytes = message.SerializeToString()
    return struct.pack(">BI", 0, len(payload)) + payload


@dataclass
class Exchange:
    """What the server sent on one stream."""

    headers: list[tuple[bytes, bytes]] | None = None
    data: bytearray = field(default_factory=bytearray)
    trailers: list[tuple[bytes, bytes]] | None = None
    frames: list[tuple[int, int]] = field(default_factory=list)
    """(type, flags) of each frame, in order."""
    ended: bool = False
    reset: int | None = None

    def trailer(self, name: bytes) -> bytes | None:
        for key, value in self.trailers or ():
            if key == name:
                return value
        return None

    @property
    def grpc_status(self) -> int | None:
        value = self.trailer(b"grpc-status")
        return None if value is None else int(value)

    @property
    def messages(self) -> list[bytes]:
        out = []
        data = bytes(self.data)
        pos = 0
        while pos < len(data):
            flag, length = struct.unpack_from(">BI", data, pos)
            assert flag == 0
            out.append(data[pos + 5 : pos + 5 + length])
            pos += 5 + length
        assert pos == len(data), "a message cut short"
        return out


class RawClient:
    """One HTTP/2 connection written by hand. Frames read are filed by stream;
    the connection's send window is kept from the server's WINDOW_UPDATEs.
    `open` and `call` name methods of `service`."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, service: str = ""
    ) -> None:
        self.service = service
        self.reader = reader
        self.writer = writer
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.send_window = DEFAULT_WINDOW
        self.server_settings: dict[int, int] = {}
        self.control: list[Frame] = []
        """Frames on stream 0, in order."""
        self.exchanges: dict[int, Exchange] = {}
        self.loop = asyncio.get_running_loop()

    @classmethod
    async def connect(cls, port: int, service: str = "") -> RawClient:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT)
        return cls(reader, writer, service)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await asyncio.wait_for(self.writer.wait_closed(), WAIT)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def exchange(self, sid: int) -> Exchange:
        return self.exchanges.setdefault(sid, Exchange())

    async def handshake(self, settings: dict[int, int] | None = None) -> None:
        """Preface and SETTINGS; returns once the server's SETTINGS are ACKed by
        us and ours by it (its connection WINDOW_UPDATE comes before that ACK)."""
        self.send(PREFACE + settings_frame(settings))
        acked = False
        while not (acked and self.server_settings):
            f = await self.read_frame()
            assert f is not None, "connection closed during the handshake"
            if f.type == SETTINGS and f.flags & FLAG_ACK:
                acked = True
            elif f.type == SETTINGS:
                self.server_settings = dict(struct.iter_unpack(">HI", f.payload))
                self.send(frame(SETTINGS, FLAG_ACK, 0))

    async def read_frame(self, timeout: float = WAIT) -> Frame | None:
        """The next frame (filed as it is read); None once the server closed the
        connection. TimeoutError when nothing came within `timeout`."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), timeout)
            first, flags, sid = struct.unpack(">IBI", head)
            payload = await asyncio.wait_for(self.reader.readexactly(first >> 8), WAIT)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None
        f = Frame(first & 0xFF, flags, sid & 0x7FFFFFFF, payload)
        if f.stream_id == 0:
            self.control.append(f)
            if f.type == WINDOW_UPDATE:
                self.send_window += int.from_bytes(payload, "big") & 0x7FFFFFFF
            return f
        ex = self.exchange(f.stream_id)
        ex.frames.append((f.type, f.flags))
        end = bool(flags & FLAG_END_STREAM)
        if f.type == HEADERS:
            assert flags & FLAG_END_HEADERS, "the server's header blocks fit one frame"
            fields: list[tuple[bytes, bytes]] = self.decoder.decode(payload, raw=True)  # type: ignore[assignment]
            if ex.headers is None:
                ex.headers = fields
                if end:  # trailers-only
                    ex.trailers = fields
            else:
                ex.trailers = fields
            ex.ended = ex.ended or end
        elif f.type == DATA:
            ex.data += payload
            ex.ended = ex.ended or end
        elif f.type == RST_STREAM:
            ex.reset = f.error_code
            ex.ended = True
        return f

    async def until(self, condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
        """Read frames until `condition()` holds; fails if the connection closes first."""
        deadline = self.loop.time() + timeout
        while not condition():
            try:
                f = await self.read_frame(deadline - self.loop.time())
            except TimeoutError:
                raise AssertionError(f"nothing more came in {timeout} s: {what}") from None
            if f is None:
                raise AssertionError(f"connection closed while waiting for {what}")

    async def control_frame(self, ftype: int) -> Frame:
        """Read frames until one of type `ftype` on stream 0 comes."""
        seen = len(self.control)
        await self.until(
            lambda: any(f.type == ftype for f in self.control[seen:]), f"frame type {ftype}"
        )
        return next(f for f in self.control[seen:] if f.type == ftype)

    async def closed_within(self, seconds: float) -> bool:
        """True when the server closes the connection within `seconds` (frames
        read meanwhile are filed)."""
        deadline = self.loop.time() + seconds
        try:
            while await self.read_frame(deadline - self.loop.time()) is not None:
                pass
        except TimeoutError:
            return False
        return True

    def open(
        self,
        sid: int,
        name: str,
        *,
        extra: Iterable[tuple[str, str]] = (),
        headers: list[tuple[str, str]] | None = None,
        end_stream: bool = False,
    ) -> None:
        fields = headers if headers is not None else grpc_request_headers(f"/{self.service}/{name}")
        block = self.encoder.encode([*fields, *extra])
        flags = FLAG_END_HEADERS | (FLAG_END_STREAM if end_stream else 0)
        self.send(frame(HEADERS, flags, sid, block))

    def message(self, sid: int, message: Any, *, end_stream: bool = True) -> None:
        body = grpc_message(message)
        assert len(body) <= 16_384
        self.send(frame(DATA, FLAG_END_STREAM if end_stream else 0, sid, body))

    async def ended(self, sid: int, timeout: float = WAIT) -> Exchange:
        """Read frames until stream `sid` ended (END_STREAM or RST_STREAM)."""
        ex = self.exchange(sid)
        await self.until(lambda: ex.ended, f"the end of stream {sid}", timeout)
        return ex

    async def call(self, sid: int, name: str, request: Any) -> Exchange:
        self.open(sid, name)
        self.message(sid, request)
        return await self.ended(sid)


@contextlib.asynccontextmanager
async def raw_client(port: int, service: str = "") -> AsyncIterator[RawClient]:
    client = await RawClient.connect(port, service)
    try:
        yield client
    finally:
        await client.close()
