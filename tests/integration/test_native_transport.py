"""The native gRPC transport over real loopback sockets, in process.

Each test starts a `NativeServer` on 127.0.0.1 with a `MethodTable` built by
hand, whose handlers live in the test and take and give real etcd protobuf
messages (RangeRequest in, RangeResponse out). Clients are grpcio's asyncio
channels in the same event loop, or `RawClient`, HTTP/2 frames written by hand,
where a grpcio client cannot misbehave the way a test needs (never reading,
never answering PINGs, sending nothing at all).

Every wait is bounded. Where a test waits for time itself to pass (a timeout
that must fire, a count that must stop growing), it says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import pytest
from hpack import Encoder

from etcdserverpb import kv_pb2, rpc_pb2
from queue_server.transport.grpc_protocol import ConnectionSettings
from queue_server.transport.h2 import (
    DATA,
    DEFAULT_WINDOW,
    FLAG_ACK,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PING,
    PREFACE,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    ErrorCode,
    Limits,
)
from queue_server.transport.methods import (
    STREAM_DECODE_ERROR,
    UNARY_DECODE_ERROR,
    Call,
    Handler,
    Method,
    MethodTable,
)
from queue_server.transport.server import NativeServer
from queue_server.transport.status import RpcError, Status, encode_message
from tests.support import h2_client
from tests.support.h2_client import (
    RawClient,
    grpc_message,
    grpc_request_headers,
    settings_frame,
    window_update,
)
from tests.support.h2_frames import frame

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]
"""One event loop for the module: grpc.aio's completion-queue poller keeps to the
loop it first ran on, and logs "Event loop is closed" when each test has its own."""

SERVICE = "test.Probe"
WAIT = 5.0
"""Seconds any one thing that should happen may take."""
MIB = 1024 * 1024

RangeRequest = rpc_pb2.RangeRequest
RangeResponse = rpc_pb2.RangeResponse
KeyValue = kv_pb2.KeyValue


# -- the server and its methods ------------------------------------------------


def path(name: str) -> str:
    return f"/{SERVICE}/{name}"


def method(
    name: str,
    handler: Handler,
    *,
    client_streaming: bool = False,
    server_streaming: bool = False,
) -> Method:
    return Method(
        SERVICE,
        name,
        client_streaming,
        server_streaming,
        RangeRequest.FromString,
        handler,
        RangeResponse.SerializeToString,
    )


async def echo(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
    return RangeResponse(count=len(request.key), kvs=[KeyValue(key=request.key)])


def numbered(i: int, size: int = 20 * 1024) -> rpc_pb2.RangeResponse:
    """A response that says where it belongs in a stream, `size` bytes of value."""
    return RangeResponse(count=i, kvs=[KeyValue(key=b"%d" % i, value=bytes([i % 251]) * size)])


@dataclass
class Served:
    server: NativeServer
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def serving(
    *methods: Method,
    limits: Limits | None = None,
    max_receive_message: int = 4 * MIB,
    keepalive_interval: float = 7200.0,
    keepalive_timeout: float = 20.0,
    preface_timeout: float = 10.0,
    stopped_message: str = "server stopped",
) -> AsyncIterator[Served]:
    """A NativeServer on 127.0.0.1 (any port) serving `methods`; stopped after."""
    table = MethodTable(methods)
    settings = ConnectionSettings(
        table.by_raw_path(),
        limits or Limits(),
        max_receive_message=max_receive_message,
        keepalive_interval=keepalive_interval,
        keepalive_timeout=keepalive_timeout,
        preface_timeout=preface_timeout,
        stopped_message=stopped_message,
        clock=time.monotonic,
    )
    server = NativeServer(settings)
    port = await server.listen("127.0.0.1", 0)
    try:
        yield Served(server, port)
    finally:
        await asyncio.wait_for(server.stop(0), WAIT)


@contextlib.asynccontextmanager
async def channel(
    served: Served, options: Sequence[tuple[str, Any]] = ()
) -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(served.target, options=list(options))
    try:
        yield ch
    finally:
        await ch.close(None)  # no grace: grpc's default, which grpc-stubs does not declare


def unary(
    ch: grpc.aio.Channel, name: str
) -> grpc.aio.UnaryUnaryMultiCallable[rpc_pb2.RangeRequest, rpc_pb2.RangeResponse]:
    return ch.unary_unary(
        path(name),
        request_serializer=RangeRequest.SerializeToString,
        response_deserializer=RangeResponse.FromString,
    )


def unary_stream(
    ch: grpc.aio.Channel, name: str
) -> grpc.aio.UnaryStreamMultiCallable[rpc_pb2.RangeRequest, rpc_pb2.RangeResponse]:
    return ch.unary_stream(
        path(name),
        request_serializer=RangeRequest.SerializeToString,
        response_deserializer=RangeResponse.FromString,
    )


def stream_unary(
    ch: grpc.aio.Channel, name: str
) -> grpc.aio.StreamUnaryMultiCallable[rpc_pb2.RangeRequest, rpc_pb2.RangeResponse]:
    return ch.stream_unary(
        path(name),
        request_serializer=RangeRequest.SerializeToString,
        response_deserializer=RangeResponse.FromString,
    )


def stream_stream(
    ch: grpc.aio.Channel, name: str
) -> grpc.aio.StreamStreamMultiCallable[rpc_pb2.RangeRequest, rpc_pb2.RangeResponse]:
    return ch.stream_stream(
        path(name),
        request_serializer=RangeRequest.SerializeToString,
        response_deserializer=RangeResponse.FromString,
    )


def raw_bytes(data: bytes) -> bytes:
    return data


class Parked:
    """A handler's body that waits forever and records that it was cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.time_remaining: float | None = None

    async def park(self, call: Call) -> None:
        self.time_remaining = call.time_remaining()
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def unary(self, request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
        await self.park(call)
        raise AssertionError("unreachable")


# -- a raw HTTP/2 client (tests/support/h2_client.py) ---------------------------


def request_headers(name: str) -> list[tuple[str, str]]:
    return grpc_request_headers(path(name))


@contextlib.asynccontextmanager
async def raw_client(port: int) -> AsyncIterator[RawClient]:
    async with h2_client.raw_client(port, SERVICE) as client:
        yield client


# -- unary calls -------------------------------------------------------------------


async def test_unary_round_trip_sees_metadata_and_peer() -> None:
    seen: list[tuple[Sequence[tuple[str, str]], str]] = []

    async def handler(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
        seen.append((call.invocation_metadata(), call.peer()))
        return RangeResponse(count=len(request.key), kvs=[KeyValue(key=request.key[::-1])])

    async with serving(method("Unary", handler)) as served, channel(served) as ch:
        response = await unary(ch, "Unary")(
            RangeRequest(key=b"hello"), metadata=(("token", "abc"),), timeout=WAIT
        )
    assert response.count == 5 and response.kvs[0].key == b"olleh"
    ((metadata, peer),) = seen
    assert ("token", "abc") in metadata
    names = {name for name, _ in metadata}
    assert not names & {"content-type", "te", "grpc-timeout", "grpc-accept-encoding"}
    assert not any(name.startswith(":") for name in names)
    assert peer.startswith("ipv4:127.0.0.1:")
    assert int(peer.rpartition(":")[2]) != served.port  # the client's port, not ours


@pytest.mark.parametrize(
    ("target", "details"),
    [
        (path("Nope"), f"unknown method Nope for service {SERVICE}"),
        ("/test.Missing/Unary", "unknown service test.Missing"),
    ],
    ids=["method", "service"],
)
async def test_unknown_method_or_service_is_unimplemented(target: str, details: str) -> None:
    async with serving(method("Unary", echo)) as served, channel(served) as ch:
        stub = ch.unary_unary(
            target,
            request_serializer=RangeRequest.SerializeToString,
            response_deserializer=RangeResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub(RangeRequest(key=b"k"), timeout=WAIT)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert info.value.details() == details
        # the connection is fine afterwards
        assert (await unary(ch, "Unary")(RangeRequest(key=b"ok"), timeout=WAIT)).count == 2


ABORT_MESSAGE = "ünïcode 100% msg"


async def abort_not_found(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
    await call.abort(Status.NOT_FOUND, ABORT_MESSAGE)


async def raise_not_found(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
    raise RpcError(Status.NOT_FOUND, ABORT_MESSAGE)


@pytest.mark.parametrize("handler", [abort_not_found, raise_not_found], ids=["abort", "raise"])
async def test_abort_status_and_message_round_trip(handler: Handler) -> None:
    async with serving(method("Abort", handler)) as served, channel(served) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(ch, "Abort")(RangeRequest(), timeout=WAIT)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == ABORT_MESSAGE


async def test_abort_is_trailers_only_and_percent_encoded() -> None:
    async with (
        serving(method("Abort", abort_not_found)) as served,
        raw_client(served.port) as client,
    ):
        await client.handshake()
        ex = await client.call(1, "Abort", RangeRequest())
    assert ex.frames == [(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM)]  # one block, no DATA
    assert ex.headers is not None
    assert (b":status", b"200") in ex.headers
    assert (b"content-type", b"application/grpc") in ex.headers
    assert ex.grpc_status == Status.NOT_FOUND
    assert ex.trailer(b"grpc-message") == b"%C3%BCn%C3%AFcode 100%25 msg"


async def test_handler_exception_is_unknown() -> None:
    async def broken(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
        raise ValueError("boom")

    async with (
        serving(method("Broken", broken), method("Unary", echo)) as served,
        channel(served) as ch,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(ch, "Broken")(RangeRequest(), timeout=WAIT)
        assert info.value.code() == grpc.StatusCode.UNKNOWN
        assert "boom" in (info.value.details() or "")
        assert (await unary(ch, "Unary")(RangeRequest(key=b"x"), timeout=WAIT)).count == 1


async def test_client_deadline_cancels_the_handler() -> None:
    parked = Parked()
    async with serving(method("Park", parked.unary)) as served, channel(served) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(ch, "Park")(RangeRequest(), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(parked.cancelled.wait(), WAIT)
    # grpcio rounds grpc-timeout up when it encodes it (0.3 s can arrive as 301 ms)
    assert parked.time_remaining is not None and 0 < parked.time_remaining <= 0.35


async def test_server_enforces_grpc_timeout_itself() -> None:
    """A raw client sends grpc-timeout and never resets: the server ends the
    call with DEADLINE_EXCEEDED on its own and cancels the handler."""
    parked = Parked()
    async with serving(method("Park", parked.unary)) as served, raw_client(served.port) as client:
        await client.handshake()
        client.open(1, "Park", extra=[("grpc-timeout", "200m")])
        client.message(1, RangeRequest())
        ex = client.exchange(1)
        await client.until(lambda: ex.ended, "the deadline's trailers")
        await asyncio.wait_for(parked.cancelled.wait(), WAIT)
    assert ex.grpc_status == Status.DEADLINE_EXCEEDED
    assert ex.trailer(b"grpc-message") == b"context deadline exceeded"
    assert parked.time_remaining is not None and 0 < parked.time_remaining <= 0.2


async def test_calls_of_one_connection_expire_each_at_its_own_deadline() -> None:
    """One timer serves every deadline of a connection: a later call with an
    earlier deadline ends first, the other at its own, and a call that
    answered in time is not touched."""
    parked = Parked()

    async def answer(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
        return rpc_pb2.RangeResponse(count=7)

    async with (
        serving(method("Park", parked.unary), method("Unary", answer)) as served,
        raw_client(served.port) as client,
    ):
        await client.handshake()
        loop = asyncio.get_running_loop()
        started = loop.time()
        client.open(1, "Park", extra=[("grpc-timeout", "900m")])
        client.message(1, RangeRequest())
        client.open(3, "Unary", extra=[("grpc-timeout", "100m")])
        client.message(3, RangeRequest())
        client.open(5, "Park", extra=[("grpc-timeout", "200m")])
        client.message(5, RangeRequest())
        late, quick, early = client.exchange(1), client.exchange(3), client.exchange(5)
        await client.until(lambda: early.ended, "the 200 ms call's trailers")
        early_at = loop.time() - started
        assert not late.ended
        await client.until(lambda: late.ended, "the 900 ms call's trailers")
        late_at = loop.time() - started
    assert quick.grpc_status == Status.OK
    assert early.grpc_status == late.grpc_status == Status.DEADLINE_EXCEEDED
    assert early_at < 0.9 <= late_at


@pytest.mark.parametrize("shape", ["unary", "server-stream"])
async def test_client_cancel_reaches_the_handler(shape: str) -> None:
    parked = Parked()

    async def stream(request: rpc_pb2.RangeRequest, call: Call) -> AsyncIterator[Any]:
        yield RangeResponse(count=1)
        await parked.park(call)

    async with (
        serving(method("Park", parked.unary), method("Stream", stream, server_streaming=True)) as s,
        channel(s) as ch,
    ):
        if shape == "unary":
            call: Any = unary(ch, "Park")(RangeRequest(), timeout=WAIT)
            await asyncio.wait_for(parked.started.wait(), WAIT)
        else:
            call = unary_stream(ch, "Stream")(RangeRequest(), timeout=WAIT)
            first = await asyncio.wait_for(call.read(), WAIT)
            assert first.count == 1
            await asyncio.wait_for(parked.started.wait(), WAIT)
        assert call.cancel()
        await asyncio.wait_for(parked.cancelled.wait(), WAIT)
        assert await asyncio.wait_for(call.code(), WAIT) == grpc.StatusCode.CANCELLED


async def test_request_over_max_receive_message_is_resource_exhausted() -> None:
    called: list[int] = []

    async def handler(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
        called.append(len(request.key))
        return RangeResponse()

    request = RangeRequest(key=b"k" * 100_000)
    size = request.ByteSize()
    options = [("grpc.max_send_message_length", 16 * MIB)]
    async with (
        serving(method("Unary", handler), max_receive_message=64 * 1024) as served,
        channel(served, options) as ch,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(ch, "Unary")(request, timeout=WAIT)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == (
            f"grpc: received message larger than max ({size} vs. {64 * 1024})"
        )
        await unary(ch, "Unary")(RangeRequest(key=b"small"), timeout=WAIT)
    assert called == [5]


async def test_compressed_request_is_unimplemented() -> None:
    async with serving(method("Unary", echo)) as served, channel(served) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(ch, "Unary")(
                RangeRequest(key=b"k" * 1000), timeout=WAIT, compression=grpc.Compression.Gzip
            )
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert info.value.details() == 'grpc: Decompressor is not installed for grpc-encoding "gzip"'


async def test_request_that_does_not_parse_is_internal() -> None:
    async def count_all(
        requests: AsyncIterator[rpc_pb2.RangeRequest], call: Call
    ) -> rpc_pb2.RangeResponse:
        return RangeResponse(count=len([r async for r in requests]))

    methods = (method("Unary", echo), method("Count", count_all, client_streaming=True))
    async with serving(*methods) as served, channel(served) as ch:
        stub = ch.unary_unary(
            path("Unary"),
            request_serializer=raw_bytes,
            response_deserializer=RangeResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub(b"\xff\xff", timeout=WAIT)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert (info.value.details() or "").startswith(UNARY_DECODE_ERROR)
        assert len(info.value.details() or "") > len(UNARY_DECODE_ERROR)

        streamed = ch.stream_unary(
            path("Count"),
            request_serializer=raw_bytes,
            response_deserializer=RangeResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await streamed(iter([b"", b"\xff\xff"]), timeout=WAIT)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert (info.value.details() or "").startswith(STREAM_DECODE_ERROR)


# -- streams -----------------------------------------------------------------------

STREAMED = 400


async def yielding_handler(request: rpc_pb2.RangeRequest, call: Call) -> AsyncIterator[Any]:
    for i in range(STREAMED):
        yield numbered(i)


async def writing_handler(request: rpc_pb2.RangeRequest, call: Call) -> None:
    for i in range(STREAMED):
        await call.write(numbered(i))


@pytest.mark.parametrize("handler", [yielding_handler, writing_handler], ids=["yield", "write"])
async def test_server_stream_far_beyond_the_windows_arrives_whole_and_in_order(
    handler: Handler,
) -> None:
    """400 messages of 20 KiB: 8 MB through 64 KiB default windows."""
    async with (
        serving(method("Stream", handler, server_streaming=True)) as served,
        channel(served) as ch,
    ):
        call = unary_stream(ch, "Stream")(RangeRequest(), timeout=4 * WAIT)
        received = [r async for r in call]
        assert await call.code() == grpc.StatusCode.OK
    assert [r.count for r in received] == list(range(STREAMED))
    assert all(r.kvs[0].value == numbered(r.count).kvs[0].value for r in received)


async def test_client_stream_and_bidi_stream_echo() -> None:
    async def collect(
        requests: AsyncIterator[rpc_pb2.RangeRequest], call: Call
    ) -> rpc_pb2.RangeResponse:
        keys = [request.key async for request in requests]
        return RangeResponse(count=len(keys), kvs=[KeyValue(key=b",".join(keys))])

    async def echo_each(
        requests: AsyncIterator[rpc_pb2.RangeRequest], call: Call
    ) -> AsyncIterator[Any]:
        async for request in requests:
            yield RangeResponse(kvs=[KeyValue(key=request.key)])

    async def some_requests() -> AsyncIterator[rpc_pb2.RangeRequest]:
        for i in range(50):
            yield RangeRequest(key=b"%d" % i)

    methods = (
        method("Collect", collect, client_streaming=True),
        method("Echo", echo_each, client_streaming=True, server_streaming=True),
    )
    async with serving(*methods) as served, channel(served) as ch:
        response = await stream_unary(ch, "Collect")(some_requests(), timeout=WAIT)
        assert response.count == 50
        assert response.kvs[0].key == b",".join(b"%d" % i for i in range(50))

        # ping-pong: each answer comes before the next request is sent
        bidi = stream_stream(ch, "Echo")(None, timeout=WAIT)
        for i in range(20):
            await asyncio.wait_for(bidi.write(RangeRequest(key=b"m%d" % i)), WAIT)
            answer = await asyncio.wait_for(bidi.read(), WAIT)
            assert isinstance(answer, RangeResponse), answer  # not EOF
            assert answer.kvs[0].key == b"m%d" % i
        await bidi.done_writing()
        # grpc-stubs has no grpc.aio.EOF (grpc has: the end of a stream's reads)
        assert await asyncio.wait_for(bidi.read(), WAIT) is grpc.aio.EOF  # type: ignore[attr-defined]
        assert await bidi.code() == grpc.StatusCode.OK


# -- HTTP/2 misbehaviour, by hand ---------------------------------------------------


async def test_non_grpc_request_gets_415() -> None:
    get = [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "127.0.0.1")]
    async with serving(method("Unary", echo)) as served, raw_client(served.port) as client:
        await client.handshake()
        client.open(1, "", headers=get, end_stream=True)
        ex = client.exchange(1)
        await client.until(lambda: ex.ended, "the 415 response")
    assert [t for t, _ in ex.frames] == [HEADERS, DATA]
    assert not ex.frames[0][1] & FLAG_END_STREAM
    assert ex.frames[1][1] & FLAG_END_STREAM
    assert ex.headers is not None and (b":status", b"415") in ex.headers
    assert b"gRPC" in ex.data
    assert ex.reset is None


async def test_grpc_request_not_post_gets_grpc_gos_405() -> None:
    """grpc-go's answer, checked against etcd in tests/compat/
    test_hostile_differential.py: HTTP 405 with INTERNAL, the method quoted as
    Go's %q quotes it, RST_STREAM(NO_ERROR) after it when the request had not
    ended; the connection serves calls as before."""
    async with serving(method("Unary", echo)) as served, raw_client(served.port) as client:
        await client.handshake()
        client.open(1, "", headers=grpc_request_headers(path("Unary"), "GET"), end_stream=True)
        odd = 'GE"T\x01\u00e9'
        client.open(3, "", headers=grpc_request_headers(path("Unary"), odd))
        # grpc-go checks the method before the path: not UNIMPLEMENTED
        client.open(5, "", headers=grpc_request_headers("/no.Such/Method", "HEAD"), end_stream=True)
        after = await client.call(7, "Unary", RangeRequest(key=b"k"))
        get, other, head = (client.exchange(sid) for sid in (1, 3, 5))
    assert after.grpc_status == Status.OK
    for ex, reset in ((get, None), (other, ErrorCode.NO_ERROR), (head, None)):
        assert ex.frames[0] == (HEADERS, FLAG_END_STREAM | FLAG_END_HEADERS)
        assert ex.reset == reset and len(ex.frames) == (1 if reset is None else 2)
        assert ex.headers is not None and ex.headers[:3] == [
            (b":status", b"405"),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", b"13"),
        ]

    def message(quoted: str) -> bytes:
        text = f"Received a HEADERS frame with :method {quoted} which should be POST"
        return encode_message(text)

    assert get.trailer(b"grpc-message") == message('"GET"')
    assert other.trailer(b"grpc-message") == message('"GE\\"T\\x01\u00e9"')
    assert head.trailer(b"grpc-message") == message('"HEAD"')


async def test_silent_connection_is_closed_after_preface_timeout() -> None:
    async with (
        serving(method("Unary", echo), preface_timeout=0.3) as served,
        raw_client(served.port) as client,
    ):
        start = client.loop.time()
        # the server speaks (SETTINGS) and then, after the timeout, hangs up
        assert await client.closed_within(WAIT)
        elapsed = client.loop.time() - start
    assert 0.25 <= elapsed < WAIT
    assert [f.type for f in client.control][:1] == [SETTINGS]


async def test_connection_that_sent_the_preface_is_not_closed_by_preface_timeout() -> None:
    async with (
        serving(method("Unary", echo), preface_timeout=0.3) as served,
        raw_client(served.port) as client,
    ):
        await client.handshake()
        # time passing is the subject: more than three preface timeouts, idle
        assert not await client.closed_within(1.0)
        ex = await client.call(1, "Unary", RangeRequest(key=b"late"))
        assert ex.grpc_status == Status.OK


async def test_keepalive_closes_a_client_that_does_not_answer_pings() -> None:
    async with (
        serving(method("Unary", echo), keepalive_interval=0.2, keepalive_timeout=0.3) as served,
        raw_client(served.port) as client,
    ):
        await client.handshake()
        ping = await client.control_frame(PING)
        pinged = client.loop.time()
        assert not ping.flags & FLAG_ACK and len(ping.payload) == 8
        assert await client.closed_within(WAIT)
        waited = client.loop.time() - pinged
    assert 0.2 <= waited < WAIT


async def test_keepalive_keeps_a_grpc_client_that_answers() -> None:
    peers: list[str] = []

    async def handler(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
        peers.append(call.peer())
        return RangeResponse()

    async with (
        serving(method("Unary", handler), keepalive_interval=0.2, keepalive_timeout=0.3) as served,
        channel(served) as ch,
    ):
        await unary(ch, "Unary")(RangeRequest(), timeout=WAIT)
        # time passing is the subject: five keepalive intervals
        await asyncio.sleep(1.0)
        await unary(ch, "Unary")(RangeRequest(), timeout=WAIT)
        assert len(served.server.connections) == 1
    assert len(peers) == 2 and peers[0] == peers[1]  # the same connection throughout


async def test_keepalive_tolerates_acks_slower_than_the_interval() -> None:
    async with (
        serving(method("Unary", echo), keepalive_interval=0.1, keepalive_timeout=0.35) as served,
        raw_client(served.port) as client,
    ):
        await client.handshake()
        loop = client.loop
        answers: list[asyncio.TimerHandle] = []
        pings = 0
        end = loop.time() + 1.0
        try:
            # time passing is the subject: every PING answered 0.15 s late
            while (left := end - loop.time()) > 0:
                try:
                    f = await client.read_frame(left)
                except TimeoutError:
                    break
                assert f is not None, f"closed after {pings} PINGs, each answered in 0.15 s"
                if f.type == PING and not f.flags & FLAG_ACK:
                    pings += 1
                    ack = frame(PING, FLAG_ACK, 0, f.payload)
                    answers.append(loop.call_later(0.15, client.send, ack))
        finally:
            for handle in answers:
                handle.cancel()
        assert pings >= 3
        ex = await client.call(1, "Unary", RangeRequest(key=b"alive"))
        assert ex.grpc_status == Status.OK


MAX_WRITES = 48
"""A safety stop for the flooding handler: with backpressure from the socket its
writes stop after the kernel's buffers and the transport's 1 MiB high-water mark
(a handful of 1 MiB messages); without it they would go on, in memory, forever."""


@pytest.mark.parametrize(
    "yield_between_writes",
    [
        pytest.param(
            False,
            id="tight-loop",
        ),
        pytest.param(True, id="yielding"),
    ],
)
async def test_client_that_never_reads_blocks_the_writer(yield_between_writes: bool) -> None:
    """The client opens all the windows (so flow control is not what stops the
    handler) and then never reads: the handler must end up waiting in
    `call.write`, and be cancelled once the client goes."""
    writes = 0
    wrote = asyncio.Event()
    cancelled = asyncio.Event()
    big = RangeResponse(kvs=[KeyValue(key=b"flood", value=b"x" * MIB)])

    async def flood(request: rpc_pb2.RangeRequest, call: Call) -> None:
        nonlocal writes
        try:
            while writes < MAX_WRITES:
                await call.write(big)
                writes += 1
                wrote.set()
                if yield_between_writes:
                    await asyncio.sleep(0)
            await asyncio.Event().wait()  # the safety stop: park until cancelled
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with serving(method("Flood", flood, server_streaming=True)) as served:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", served.port)), WAIT)
            block = Encoder().encode(request_headers("Flood"))
            request = (
                PREFACE
                + settings_frame({SETTINGS_INITIAL_WINDOW_SIZE: MAX_WINDOW})
                + window_update(0, MAX_WINDOW - DEFAULT_WINDOW)
                + frame(HEADERS, FLAG_END_HEADERS, 1, block)
                + frame(DATA, FLAG_END_STREAM, 1, grpc_message(RangeRequest()))
            )
            await asyncio.wait_for(loop.sock_sendall(sock, request), WAIT)
            await asyncio.wait_for(wrote.wait(), WAIT)
            # time passing is the subject: wait until two looks 0.5 s apart agree
            deadline = loop.time() + 10.0
            last = -1
            while writes != last:
                assert loop.time() < deadline, f"still writing after 10 s ({writes} MiB)"
                last = writes
                await asyncio.sleep(0.5)
            assert 1 <= writes < MAX_WRITES, f"{writes} MiB written to a client not reading"
        finally:
            sock.close()
        await asyncio.wait_for(cancelled.wait(), WAIT)


# -- stopping and limits --------------------------------------------------------------


async def test_graceful_stop_finishes_calls_in_flight_then_refuses_new_ones() -> None:
    release = asyncio.Event()
    both = asyncio.Event()
    started = 0

    async def slow(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
        nonlocal started
        started += 1
        if started == 2:
            both.set()
        await release.wait()
        return RangeResponse(count=7)

    methods = (method("Slow", slow), method("Unary", echo))
    async with (
        serving(*methods) as served,
        channel(served) as ch,
        raw_client(served.port) as client,
    ):
        await client.handshake()
        in_flight = asyncio.ensure_future(unary(ch, "Slow")(RangeRequest(), timeout=WAIT))
        client.open(1, "Slow")
        client.message(1, RangeRequest())
        await asyncio.wait_for(both.wait(), WAIT)

        loop = client.loop
        began = loop.time()
        stop = asyncio.ensure_future(served.server.stop(grace=5))
        goaway = await client.control_frame(GOAWAY)
        assert goaway.error_code == ErrorCode.NO_ERROR
        assert goaway.last_stream_id == 1
        assert not stop.done()

        release.set()
        assert (await asyncio.wait_for(in_flight, WAIT)).count == 7
        ex = client.exchange(1)
        await client.until(lambda: ex.ended, "the in-flight call's response")
        assert ex.grpc_status == Status.OK
        assert [RangeResponse.FromString(m).count for m in ex.messages] == [7]
        assert await client.closed_within(WAIT)
        await asyncio.wait_for(stop, WAIT)
        assert loop.time() - began < 5  # done when the calls were, not after the grace

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unary(ch, "Unary")(RangeRequest(), timeout=WAIT)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(OSError):
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", served.port), WAIT)


async def test_a_stop_ends_waiting_calls_at_once_and_gives_the_others_the_grace() -> None:
    watch, poll = Parked(), Parked()
    release = asyncio.Event()
    slow_started = asyncio.Event()

    async def watching(requests: Any, call: Call) -> AsyncIterator[Any]:
        yield RangeResponse(count=1)
        await watch.park(call)

    async def slow(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
        slow_started.set()
        await release.wait()
        return RangeResponse(count=7)

    methods = (
        replace(
            method("Watch", watching, client_streaming=True, server_streaming=True), waits=True
        ),
        replace(method("Poll", poll.unary), waits=True),
        method("Slow", slow),
    )
    async with serving(*methods, stopped_message="test: stopped") as served, channel(served) as ch:
        stream = stream_stream(ch, "Watch")(None, timeout=WAIT)
        await stream.write(RangeRequest())
        first = await asyncio.wait_for(stream.read(), WAIT)
        assert isinstance(first, RangeResponse), first  # not EOF
        assert first.count == 1
        polled = asyncio.ensure_future(unary(ch, "Poll")(RangeRequest(), timeout=WAIT))
        in_flight = asyncio.ensure_future(unary(ch, "Slow")(RangeRequest(), timeout=WAIT))
        await asyncio.wait_for(poll.started.wait(), WAIT)
        await asyncio.wait_for(slow_started.wait(), WAIT)

        stop = asyncio.ensure_future(served.server.stop(grace=5))
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(stream.read(), WAIT)
        assert (ended.value.code(), ended.value.details()) == (
            grpc.StatusCode.UNAVAILABLE,
            "test: stopped",
        )
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(polled, WAIT)
        assert (ended.value.code(), ended.value.details()) == (
            grpc.StatusCode.UNAVAILABLE,
            "test: stopped",
        )
        await asyncio.wait_for(watch.cancelled.wait(), WAIT)
        await asyncio.wait_for(poll.cancelled.wait(), WAIT)
        assert not in_flight.done() and not stop.done()  # the plain call has its grace
        release.set()
        assert (await asyncio.wait_for(in_flight, WAIT)).count == 7
        await asyncio.wait_for(stop, WAIT)


async def test_a_stop_ends_a_plain_call_still_running_after_the_grace() -> None:
    parked = Parked()
    async with serving(method("Slow", parked.unary)) as served, channel(served) as ch:
        in_flight = asyncio.ensure_future(unary(ch, "Slow")(RangeRequest(), timeout=WAIT))
        await asyncio.wait_for(parked.started.wait(), WAIT)
        began = asyncio.get_running_loop().time()
        await asyncio.wait_for(served.server.stop(grace=0.2), WAIT)
        assert asyncio.get_running_loop().time() - began < 2.0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(in_flight, WAIT)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ended.value.details() == "server stopped"  # ConnectionSettings' default
        await asyncio.wait_for(parked.cancelled.wait(), WAIT)


async def test_graceful_stop_delivers_a_stream_still_waiting_for_window() -> None:
    go = asyncio.Event()
    started = asyncio.Event()
    count = 10  # 10 x 20 KiB: more than the client's 64 KiB windows

    async def stream(request: rpc_pb2.RangeRequest, call: Call) -> AsyncIterator[Any]:
        started.set()
        await go.wait()
        for i in range(count):
            yield numbered(i)

    async with (
        serving(method("Stream", stream, server_streaming=True)) as served,
        raw_client(served.port) as client,
    ):
        await client.handshake()  # default windows: 65 535 bytes
        client.open(1, "Stream")
        client.message(1, RangeRequest())
        await asyncio.wait_for(started.wait(), WAIT)
        stop = asyncio.ensure_future(served.server.stop(grace=5))
        try:
            await client.control_frame(GOAWAY)
            go.set()
            ex = client.exchange(1)
            await client.until(
                lambda: len(ex.data) >= DEFAULT_WINDOW or ex.ended, "a window of DATA"
            )
            # then read on, as a client does: open the windows
            client.send(window_update(0, 4 * MIB) + window_update(1, 4 * MIB))
            await client.until(lambda: ex.ended, "the rest of the stream")
            assert ex.grpc_status == Status.OK
            counts = [RangeResponse.FromString(m).count for m in ex.messages]
            assert counts == list(range(count))
        finally:
            await asyncio.wait_for(stop, 2 * WAIT)


async def test_max_concurrent_streams_bounds_running_handlers() -> None:
    release = asyncio.Event()
    two_running = asyncio.Event()
    third_started = asyncio.Event()
    running = peak = entered = 0

    async def block(request: rpc_pb2.RangeRequest, call: Call) -> rpc_pb2.RangeResponse:
        nonlocal running, peak, entered
        entered += 1
        running += 1
        peak = max(peak, running)
        if running == 2:
            two_running.set()
        if entered == 3:
            third_started.set()
        try:
            await release.wait()
        finally:
            running -= 1
        return RangeResponse(count=len(request.key))

    methods = (method("Block", block), method("Unary", echo))
    limits = Limits(max_concurrent_streams=2)
    async with serving(*methods, limits=limits) as served, channel(served) as ch:
        # one call first, so that the client has our SETTINGS before the three
        await unary(ch, "Unary")(RangeRequest(), timeout=WAIT)
        stub = unary(ch, "Block")
        calls = [
            asyncio.ensure_future(stub(RangeRequest(key=b"k" * (i + 1)), timeout=WAIT))
            for i in range(3)
        ]
        await asyncio.wait_for(two_running.wait(), WAIT)
        # the third must not start while two run (waiting for what must not happen)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(third_started.wait(), 0.3)
        assert peak == 2
        release.set()
        responses = await asyncio.wait_for(asyncio.gather(*calls), WAIT)
    assert sorted(r.count for r in responses) == [1, 2, 3]
    assert entered == 3 and peak == 2


async def test_unread_request_messages_are_credited_back_to_the_connection() -> None:
    async def first_only(
        requests: AsyncIterator[rpc_pb2.RangeRequest], call: Call
    ) -> rpc_pb2.RangeResponse:
        async for request in requests:
            return RangeResponse(count=len(request.key))
        return RangeResponse()

    window = 1 * MIB
    limits = Limits(connection_window=window)
    body = grpc_message(RangeRequest(key=b"k" * 12_000))
    per_stream = 16  # 192 KB a stream, under the 256 KiB stream window
    need = per_stream * len(body)
    async with (
        serving(method("FirstOnly", first_only, client_streaming=True), limits=limits) as s,
        raw_client(s.port) as client,
    ):
        await client.handshake()
        assert client.send_window == window
        for i in range(12):  # 2.3 MB in all: more than two connection windows
            sid = 2 * i + 1
            await client.until(
                lambda: client.send_window >= need,
                f"window for stream {sid}",
                timeout=2.0,
            )
            client.open(sid, "FirstOnly")
            client.send(b"".join(frame(DATA, 0, sid, body) for _ in range(per_stream)))
            client.send(frame(DATA, FLAG_END_STREAM, sid))
            client.send_window -= need
            assert (await client.ended(sid)).grpc_status == Status.OK
