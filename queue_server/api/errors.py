"""One table from core errors to gRPC status: code and exact etcd message."""

from __future__ import annotations

from typing import NoReturn, Protocol, TypeVar

from google.protobuf.message import Message

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.api.header import HeaderFiller
from queue_server.apply import Proposer
from queue_server.errors import EtcdError
from queue_server.transport.methods import Call
from queue_server.transport.status import Status


class _Response(Protocol):
    """An etcd response: a message with a header to fill."""

    @property
    def header(self) -> rpc_pb2.ResponseHeader: ...


R = TypeVar("R", bound=_Response)
"""The response type a caller of `propose_or_abort` expects its command to answer."""


async def abort(context: Call, error: EtcdError) -> NoReturn:
    """End the call with the status etcd sends for `error`."""
    await context.abort(Status[error.code], error.text)
    raise AssertionError("unreachable: abort raises")


async def abort_unknown(context: Call, message: str) -> NoReturn:
    """End the call as etcd does for a plain (non-status) error: UNKNOWN + its text.
    etcd's lock and election recipes report their own errors this way."""
    await context.abort(Status.UNKNOWN, message)
    raise AssertionError("unreachable: abort raises")


async def propose_checked(log: Proposer, command: internal_pb2.Command, context: Call) -> Message:
    """Propose `command`; end the call with its status if it fails (before or at
    apply), else return the apply result."""
    try:
        result = await log.propose(command)
    except EtcdError as e:
        await abort(context, e)
    if isinstance(result, EtcdError):
        await abort(context, result)
    return result


async def propose_or_abort(
    log: Proposer,
    command: internal_pb2.Command,
    context: Call,
    header: HeaderFiller,
    response: type[R],
) -> R:
    """`propose_checked`, and the response's header filled. `response` is the
    type apply answers `command` with; any other answer is a bug, raised.

    `propose_checked`'s steps are repeated here rather than awaited: every write
    of the KV service comes this way, and a coroutine less per call counts."""
    try:
        result = await log.propose(command)
    except EtcdError as e:
        await abort(context, e)
    if isinstance(result, EtcdError):
        await abort(context, result)
    if not isinstance(result, response):
        raise TypeError(f"apply answered {type(result).__name__}, not {response.__name__}")
    header.fill(result.header)
    return result
