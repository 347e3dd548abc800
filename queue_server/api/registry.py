"""Registering servicers with the gRPC server: generic handlers only, and
undecodable requests answered as etcd answers them.

grpcio (1.6x and later) also offers "registered methods": for each of them the aio
server keeps a pending request-call task, and for every incoming RPC it waits on
all those tasks at once (`asyncio.wait(..., FIRST_COMPLETED)`), a cost linear in
the number of methods. With the ~33 methods of etcd's services that wait cost
more CPU per call than our whole Range; generic handlers keep one pending task.
Measured on the put path: see docs/benchmarks.md.

A request whose bytes do not parse (corrupt wire format, bad UTF-8 in a string
field) makes grpcio's aio server answer UNKNOWN "Unexpected <class
'DecodeError'>" and log a traceback at ERROR for every such request, so a
hostile client could flood the log. etcd (grpc-go) answers INTERNAL "grpc: error
unmarshalling request: ..." for a unary request, and INTERNAL "grpc: failed to
unmarshal the received message: ..." for a message on a stream. Here each
method's deserializer returns an `Undecodable` marker instead of raising, and
the method's behaviour answers it with etcd's status before the servicer sees it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

NOT_IMPLEMENTED = "Method not implemented!"
"""What grpcio's generated servicer says of a method it does not implement."""
UNARY_DECODE_ERROR = "grpc: error unmarshalling request: "
STREAM_DECODE_ERROR = "grpc: failed to unmarshal the received message "
"""No colon: the text of the grpc-go that etcd 3.4 and 3.5 are built with."""


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a request deserializer returns for bytes that do not parse."""

    reason: str


def _safe_deserializer(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if parse is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as e:
            return Undecodable(str(e))

    return deserialize


async def _refuse(context: aio.ServicerContext[Any, Any], prefix: str, bad: Undecodable) -> None:
    await context.abort(grpc.StatusCode.INTERNAL, prefix + bad.reason)


class _StreamGuard:
    """One call's request stream, ended with etcd's status at the first
    undecodable message. A servicer that catches the abort and answers again
    (ReEnqueue's "stream ended without a Footer") gets grpcio's "Abort already
    called!"; `finish` turns that back into the first abort."""

    def __init__(self, context: aio.ServicerContext[Any, Any]) -> None:
        self.context = context
        self.aborted: BaseException | None = None

    async def requests(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, Undecodable):
                try:
                    await _refuse(self.context, STREAM_DECODE_ERROR, request)
                except BaseException as e:
                    self.aborted = e
                    raise
            yield request

    def finish(self, error: BaseException) -> BaseException:
        """The exception to end the call with after the servicer raised `error`."""
        if self.aborted is not None and isinstance(error, aio.UsageError):
            return self.aborted
        return error


def _guard_unary_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream_out(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, Undecodable):
                await _refuse(context, UNARY_DECODE_ERROR, request)
            async for response in behavior(request, context):
                yield response

        return stream_out

    async def unary_out(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(context, UNARY_DECODE_ERROR, request)
        try:
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except NotImplementedError:
            # A generated servicer's default (MoveLeader, Downgrade), maybe under a
            # wrapper that awaits it: answer it without grpcio's logged traceback,
            # which a client could repeat at will.
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_IMPLEMENTED)

    return unary_out


def _guard_stream_request(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream_out(requests: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            guard = _StreamGuard(context)
            try:
                async for response in behavior(guard.requests(requests), context):
                    yield response
            except Exception as e:
                raise guard.finish(e) from None

        return stream_out

    async def unary_out(requests: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        guard = _StreamGuard(context)
        try:
            result = behavior(guard.requests(requests), context)
            return await result if inspect.isawaitable(result) else result
        except Exception as e:
            raise guard.finish(e) from None

    return unary_out


def guard_decoding(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` with undecodable requests answered as etcd answers them."""
    kind = ("stream" if handler.request_streaming else "unary") + (
        "_stream" if handler.response_streaming else "_unary"
    )
    behavior = getattr(handler, kind)
    guard = _guard_stream_request if handler.request_streaming else _guard_unary_request
    return handler._replace(  # type: ignore[attr-defined, no-any-return]
        request_deserializer=_safe_deserializer(handler.request_deserializer),
        **{kind: guard(behavior)},
    )


class GenericHandlersOnly:
    """Stands in for the server in a generated `add_*Servicer_to_server` call:
    registers the service's methods, each guarded by `guard_decoding`, as one
    generic handler, and no registered-method handlers."""

    def __init__(self, server: aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        """Not used: the same methods arrive in `add_registered_method_handlers`,
        where they are guarded first."""

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        guarded = {name: guard_decoding(h) for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, guarded),)
        )
