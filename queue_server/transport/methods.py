"""The methods a gRPC server serves, by `:path`, and the call interface their
handlers see.

What belongs here: `Method` (one RPC: its path, its streaming shape, how to
parse its request, its handler), `MethodTable`, and `Call`, the small interface
every handler is given in place of a transport's own context. Both transports
(the native one of this package, and grpcio's server in
`queue_server/api/grpcio_server.py`) serve the same table. Imports nothing of
ours but `status`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, Protocol

from queue_server.transport.status import Status

UNARY_DECODE_ERROR = "grpc: error unmarshalling request: "
STREAM_DECODE_ERROR = "grpc: failed to unmarshal the received message "
"""grpc-go's texts for a request that does not parse, as etcd 3.4 and 3.5 send
them (no colon in the second: the grpc-go they are built with)."""

Handler = Callable[..., Any]
"""(request, call) -> awaitable response, for unary requests; (request
iterator, call) -> ... for streamed ones. A streamed response is an async
generator, or a coroutine that writes with `call.write`."""


class Call(Protocol):
    """What a handler may know of and do with its call, on any transport."""

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        """The request's custom metadata (the headers that are not pseudo or
        reserved ones), as (lower-case key, value)."""

    def peer(self) -> str:
        """The client's address, as grpc spells it (ipv4:127.0.0.1:5555)."""

    def client_common_name(self) -> str | None:
        """The CN of the client's verified TLS certificate, if it sent one."""

    def time_remaining(self) -> float | None:
        """Seconds to the call's deadline, None without one."""

    async def abort(self, code: Status, message: str) -> NoReturn:
        """End the call with `code` and `message` (raises)."""

    async def write(self, message: Any) -> None:
        """Send one response message on a response stream (waits while the
        client's flow-control window or the connection is full)."""

    async def write_many(self, messages: Sequence[Any]) -> None:
        """Send several response messages at once (one DATA write on the native
        transport); waits as `write` does. An item that is `bytes` is a message
        serialized already."""


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC of the table."""

    service: str
    name: str
    request_streaming: bool
    response_streaming: bool
    parse: Callable[[bytes], Any]
    handler: Handler
    serialize: Callable[[Any], bytes]
    request_class: Any = None
    """The request's message class (the HTTP/JSON gateway builds requests from JSON)."""
    response_class: Any = None
    """The response's message class (the gateway reads back responses handed over
    serialized already, as `write_many` allows)."""
    waits: bool = False
    """The call lasts for as long as its client or others want: a watch, a
    keepalive stream, a long poll, a lock. A stop ends such calls at once with
    UNAVAILABLE, where other calls in flight get a grace period to finish."""

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    def with_handler(self, handler: Handler) -> Method:
        return replace(self, handler=handler)

    @property
    def kind(self) -> str:
        """grpc-prometheus' grpc_type: unary, client_stream, server_stream, bidi_stream."""
        if self.request_streaming and self.response_streaming:
            return "bidi_stream"
        if self.request_streaming:
            return "client_stream"
        if self.response_streaming:
            return "server_stream"
        return "unary"


Middleware = Callable[[Method], Handler]
"""Given a method, the handler to serve it with (wrapping `method.handler`)."""


class MethodTable:
    """Every method served, by path."""

    def __init__(self, methods: Iterable[Method] = ()) -> None:
        self.methods: dict[str, Method] = {}
        for method in methods:
            self.add(method)

    def add(self, method: Method) -> None:
        self.methods[method.path] = method

    def wrapped(self, *middleware: Middleware) -> MethodTable:
        """The same methods, each handler wrapped by `middleware` (the first
        given is the outermost)."""
        table = MethodTable()
        for method in self.methods.values():
            for wrap in reversed(middleware):
                method = method.with_handler(wrap(method))
            table.add(method)
        return table

    def by_raw_path(self) -> dict[bytes, Method]:
        return {path.encode(): m for path, m in self.methods.items()}
