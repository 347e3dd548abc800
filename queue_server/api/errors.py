"""One table from core errors to gRPC status: code and exact etcd message."""

from __future__ import annotations

from typing import NoReturn

from etcdserverpb import internal_pb2
from queue_server.api.header import HeaderFiller
from queue_server.apply import Proposer
from queue_server.errors import EtcdError
from queue_server.transport.methods import Call
from queue_server.transport.status import Status


async def abort(context: Call, error: EtcdError) -> NoReturn:
    """End the call with the status etcd sends for `error`."""
    await context.abort(Status[error.code], error.text)
    raise AssertionError("unreachable: abort raises")


async def abort_unknown(context: Call, message: str) -> NoReturn:
    """End the call as etcd does for a plain (non-status) error: UNKNOWN + its text.
    etcd's lock and election recipes report their own errors this way."""
    await context.abort(Status.UNKNOWN, message)
    raise AssertionError("unreachable: abort raises")


async def propose_checked(log: Proposer, command: internal_pb2.Command, context: Call) -> object:
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
) -> object:
    """`propose_checked`, and the response's header filled."""
    result = await propose_checked(log, command, context)
    header.fill(result.header)  # type: ignore[attr-defined]
    return result
