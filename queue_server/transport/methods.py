"""The methods a gRPC server serves, by `:path`, the call interface their
handlers see, and what it means to run one.

What belongs here: `Method` (one RPC: its path, its streaming shape, how to
parse its request, its handler), `MethodTable`, `Call`, the small interface
every handler is given in place of a transport's own context, and
`run_handler`, the one way every transport calls a handler. The three
transports (the native gRPC connection, `grpc_protocol.py`; the HTTP/JSON
gateway, `gateway.py`; grpcio's server, `grpcio_fallback.py`) serve the same
table through it and keep only their own I/O: how a request is read, and how a
response, a stream's end or a status is written. Imports nothing of ours but
`status`.

Running a handler (`run_handler`): a unary response is what the handler
returns, handed to the transport's `respond`; a streamed response is every
item of the handler's async generator, written with `call.write`, or what a
handler that is a plain coroutine writes itself. The call then ends with one
status, and the only exceptions `run_handler` lets out say which:

- `RpcError`: the call ends with its code and message. A handler reports an
  etcd error this way (`api/errors.py` turns the core's `EtcdError` into
  `call.abort`, which raises one), and so does a request stream that failed
  (`ServedCall.stream_error`), which wins over whatever the handler raised
  next;
- any other exception is a bug in the handler: logged with its traceback, and
  the call ends UNKNOWN "Unexpected <class ...>: ..." (grpcio's text for it);
- `asyncio.CancelledError`: the transport cancelled the call (the client went
  away, or the server is stopping); what to answer, if anything, is the
  transport's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn, Protocol

from queue_server.transport.status import RpcError, Status

log = logging.getLogger(__name__)

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


class ServedCall(Call, Protocol):
    """A `Call` as its transport serves it."""

    @property
    def stream_error(self) -> RpcError | None:
        """Why the request stream failed (a message that does not parse, or
        too large), if it did: the status the call ends with."""


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


async def run_handler(
    method: Method, request: Any, call: ServedCall, respond: Callable[[Any], None]
) -> None:
    """Run `method`'s handler for one call (see the module docstring): `request`
    is the request message, or for a streamed request the iterator of them;
    a unary response goes to `respond`, which sends it. Returns when the
    handler is done and the call ends OK; raises `RpcError` with the status it
    ends with otherwise, or `asyncio.CancelledError`."""
    try:
        if not method.response_streaming:
            respond(await method.handler(request, call))
            return
        result = method.handler(request, call)
        if hasattr(result, "__anext__"):
            async for item in result:
                await call.write(item)
        else:
            await result
    except RpcError as e:
        raise call.stream_error or e from None
    except Exception as e:
        log.exception("handler failed method=%s", method.path)
        raise RpcError(Status.UNKNOWN, f"Unexpected {type(e)}: {e}") from None
