"""The fallback transport: the same method table served by grpcio's aio server
(`--grpc-transport grpcio`).

What belongs here: `GrpcioCall`, our `Call` over grpcio's `ServicerContext`
(with the client certificate's common name as grpcio's auth context has it,
`client_common_name`), and `generic_handlers`, which registers the table as
generic handlers, each running its method with `methods.run_handler`, as the
native transport and the gateway do: a streamed response is written with
grpcio's `context.write`, and the status a call ends with becomes grpcio's
`context.abort`. Imports grpcio and nothing of ours but `methods` and
`status`. Generic
ones only: for "registered methods" grpcio 1.6x keeps a pending task per method
and waits on all of them for every incoming call, a cost linear in the ~33
methods of etcd's services (more CPU than a whole Range).

A stop (`stop_grpcio`) ends the calls in flight with a status of ours, as the
native transport does (grpcio's own stop would wait out its grace, then cancel
them with UNAVAILABLE "Cancelling all calls"): `ServedCalls` knows each call's
task, and a call cancelled by the stop answers UNAVAILABLE with its message.

Requests that do not parse are answered as etcd (grpc-go) answers them:
INTERNAL "grpc: error unmarshalling request: ..." for a unary request, INTERNAL
"grpc: failed to unmarshal the received message ..." on a stream, instead of
grpcio's UNKNOWN and a traceback per request. Each method's deserializer
returns an `Undecodable` marker instead of raising.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from queue_server.transport.methods import (
    STREAM_DECODE_ERROR,
    UNARY_DECODE_ERROR,
    Method,
    MethodTable,
    run_handler,
)
from queue_server.transport.status import RpcError, Status

Context = aio.ServicerContext[Any, Any]

COMMON_NAME_KEY = "x509_common_name"
"""The gRPC auth-context property holding the verified peer certificate's CN."""


class HasAuthContext(Protocol):
    """A gRPC servicer context (sync or asyncio): all `client_common_name` needs."""

    def auth_context(self) -> Mapping[str, Iterable[bytes]]: ...


def client_common_name(context: HasAuthContext) -> str | None:
    """The CN of the client's verified certificate, or None (plain http, or a
    listener that asked for no certificate because --client-cert-auth is off).

    gRPC puts the CN in the auth context only after the handshake verified the
    certificate against --trusted-ca-file, so a name returned here is trusted.
    etcd uses it as the user name of a request without a token when auth is on,
    and so does `queue_server/api/auth_gate.py` (through `Call`)."""
    names = list(context.auth_context().get(COMMON_NAME_KEY, ()))
    if not names:
        return None
    name = names[0].decode("utf-8", "replace")
    return name or None


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a request deserializer returns for bytes that do not parse."""

    reason: str


class GrpcioCall:
    """A `Call` over one grpcio servicer context."""

    __slots__ = ("context", "stream_error")

    def __init__(self, context: Context) -> None:
        self.context = context
        self.stream_error: RpcError | None = None

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return [
            (key, value.decode() if isinstance(value, bytes) else value)
            for key, value in self.context.invocation_metadata() or ()
        ]

    def peer(self) -> str:
        return str(self.context.peer())

    def client_common_name(self) -> str | None:
        return client_common_name(self.context)

    def time_remaining(self) -> float | None:
        remaining = self.context.time_remaining()
        return None if remaining is None else float(remaining)

    async def abort(self, code: Status, message: str) -> NoReturn:
        raise RpcError(code, message)

    async def write(self, message: Any) -> None:
        await self.context.write(message)

    async def write_many(self, messages: Sequence[Any]) -> None:
        for message in messages:
            await self.context.write(message)

    async def requests(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """The request stream, ended with etcd's status at the first
        undecodable message (which then wins over what the handler says next)."""
        async for request in requests:
            if isinstance(request, Undecodable):
                self.stream_error = RpcError(Status.INTERNAL, STREAM_DECODE_ERROR + request.reason)
                raise self.stream_error
            yield request


class ServedCalls:
    """The calls being served on grpcio, so that a stop can end them."""

    def __init__(self, stopped_message: str) -> None:
        self.stopped_message = stopped_message
        """The UNAVAILABLE status text of calls a stop ends."""
        self.stopping = False
        self._tasks: dict[asyncio.Task[Any], bool] = {}
        """Each call's task, and whether the call waits (`Method.waits`)."""

    @contextlib.contextmanager
    def serving(self, waits: bool) -> Iterator[None]:
        task = asyncio.current_task()
        assert task is not None
        self._tasks[task] = waits
        try:
            yield
        finally:
            self._tasks.pop(task, None)

    def end(self, waiting_only: bool) -> None:
        """Cancel the calls (with `waiting_only`, those that wait): each answers
        UNAVAILABLE `stopped_message`."""
        self.stopping = True
        for task, waits in list(self._tasks.items()):
            if waits or not waiting_only:
                task.cancel()

    def stopped(self) -> RpcError:
        return RpcError(Status.UNAVAILABLE, self.stopped_message)


async def stop_grpcio(server: aio.Server, calls: ServedCalls, grace: float, flush: float) -> None:
    """Stop `server` as the native transport stops: no new calls (GOAWAY),
    the waiting calls (`Method.waits`) ended at once, the other calls after `grace`
    seconds, all with UNAVAILABLE `calls.stopped_message`; whatever grpcio still
    holds `flush` seconds later is cancelled by grpcio itself."""
    stopping = asyncio.ensure_future(server.stop(grace + flush))
    # One turn of the loop: grpcio's stop refuses new calls (GOAWAY) before it
    # first waits, so a client that retries at once cannot open a new watch.
    await asyncio.sleep(0)
    calls.end(waiting_only=True)
    await asyncio.wait({stopping}, timeout=grace)
    calls.end(waiting_only=False)
    await stopping


def _safe(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as e:
            return Undecodable(str(e))

    return deserialize


def _passing_bytes(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """`serialize`, letting through a message serialized already (`write_many`)."""

    def serializer(message: Any) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return serializer


async def _abort(context: Context, error: RpcError) -> NoReturn:
    await context.abort(grpc.StatusCode[error.code.name], error.message)
    raise AssertionError("unreachable: abort raises")


def _behavior(method: Method, calls: ServedCalls) -> Callable[..., Any]:
    """The grpcio handler of `method`: one coroutine for every streaming shape
    (grpcio sends what it returns for a unary response, and what it writes
    with `context.write` for a streamed one)."""
    waits = method.waits

    async def behavior(request: Any, context: Context) -> Any:
        call = GrpcioCall(context)
        answer: list[Any] = []
        with calls.serving(waits):
            try:
                if method.request_streaming:
                    request = call.requests(request)
                elif isinstance(request, Undecodable):
                    raise RpcError(Status.INTERNAL, UNARY_DECODE_ERROR + request.reason)
                await run_handler(method, request, call, answer.append)
            except RpcError as e:
                await _abort(context, e)
            except asyncio.CancelledError:
                if not calls.stopping:
                    raise
                await _abort(context, calls.stopped())
        return answer[0] if answer else None

    return behavior


def generic_handlers(
    table: MethodTable, calls: ServedCalls
) -> list[grpc.GenericRpcHandler[Any, Any]]:
    """The table as grpcio generic handlers, one per service, serving `calls`."""
    by_service: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = {}
    for method in table.methods.values():
        kind = {
            "unary": grpc.unary_unary_rpc_method_handler,
            "server_stream": grpc.unary_stream_rpc_method_handler,
            "client_stream": grpc.stream_unary_rpc_method_handler,
            "bidi_stream": grpc.stream_stream_rpc_method_handler,
        }[method.kind]
        by_service.setdefault(method.service, {})[method.name] = kind(
            _behavior(method, calls),
            request_deserializer=_safe(method.parse),
            response_serializer=_passing_bytes(method.serialize),
        )
    return [grpc.method_handlers_generic_handler(s, h) for s, h in by_service.items()]
