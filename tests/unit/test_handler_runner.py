"""`transport.methods.run_handler`: what every transport (native, gateway,
grpcio fallback) means by calling a handler, and the status it ends with."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

import pytest

from queue_server.transport.methods import Handler, Method, run_handler
from queue_server.transport.status import RpcError, Status

pytestmark = pytest.mark.unit


class FakeCall:
    """A served call that records what the handler writes."""

    def __init__(self, stream_error: RpcError | None = None) -> None:
        self.stream_error = stream_error
        self.written: list[Any] = []

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return []

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def client_common_name(self) -> str | None:
        return None

    def time_remaining(self) -> float | None:
        return None

    async def abort(self, code: Status, message: str) -> NoReturn:
        raise RpcError(code, message)

    async def write(self, message: Any) -> None:
        self.written.append(message)

    async def write_many(self, messages: Sequence[Any]) -> None:
        self.written.extend(messages)


def method(handler: Handler, streaming: bool) -> Method:
    return Method("test.S", "M", False, streaming, bytes, handler, bytes)


def run(m: Method, call: FakeCall) -> list[Any]:
    answered: list[Any] = []
    asyncio.run(run_handler(m, b"req", call, answered.append))
    return answered


def test_a_unary_response_goes_to_respond_and_nothing_is_written() -> None:
    async def handler(request: bytes, call: FakeCall) -> bytes:
        return request + b"!"

    call = FakeCall()
    assert run(method(handler, False), call) == [b"req!"]
    assert call.written == []


def test_a_streamed_response_is_each_item_of_the_generator_or_what_a_coroutine_writes() -> None:
    async def generator(request: bytes, call: FakeCall) -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"

    async def writer(request: bytes, call: FakeCall) -> None:
        await call.write_many([b"c", b"d"])

    for handler, items in ((generator, [b"a", b"b"]), (writer, [b"c", b"d"])):
        call = FakeCall()
        assert run(method(handler, True), call) == []
        assert call.written == items


def test_an_abort_is_the_status_unless_the_request_stream_failed_first() -> None:
    async def handler(request: bytes, call: FakeCall) -> None:
        await call.abort(Status.NOT_FOUND, "etcdserver: not here")

    with pytest.raises(RpcError) as e:
        run(method(handler, False), FakeCall())
    assert (e.value.code, e.value.message) == (Status.NOT_FOUND, "etcdserver: not here")

    broken = RpcError(Status.INTERNAL, "grpc: failed to unmarshal the received message x")
    with pytest.raises(RpcError) as e:
        run(method(handler, True), FakeCall(stream_error=broken))
    assert e.value is broken


def test_a_handler_bug_is_logged_and_ends_unknown_with_grpcios_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(request: bytes, call: FakeCall) -> AsyncIterator[bytes]:
        yield b"first"
        raise ValueError("boom")

    call = FakeCall(stream_error=RpcError(Status.INTERNAL, "ignored: not an RpcError"))
    with pytest.raises(RpcError) as e:
        run(method(handler, True), call)
    assert (e.value.code, e.value.message) == (
        Status.UNKNOWN,
        "Unexpected <class 'ValueError'>: boom",
    )
    assert call.written == [b"first"]
    assert "handler failed method=/test.S/M" in caplog.text


def test_a_cancellation_is_left_to_the_transport() -> None:
    async def handler(request: bytes, call: FakeCall) -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        run(method(handler, False), FakeCall())
