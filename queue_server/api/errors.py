"""One table from core errors to gRPC status: code and exact etcd message."""

from __future__ import annotations

from typing import NoReturn

import grpc
from grpc import aio

from etcdserverpb import internal_pb2
from queue_server.api.header import HeaderFiller
from queue_server.apply import Proposer
from queue_server.errors import EtcdError


async def abort(context: aio.ServicerContext[object, object], error: EtcdError) -> NoReturn:
    """End the call with the status etcd sends for `error`."""
    await context.abort(getattr(grpc.StatusCode, error.code), error.text)
    raise AssertionError("unreachable: abort raises")


async def abort_unknown(context: aio.ServicerContext[object, object], message: str) -> NoReturn:
    """End the call as etcd does for a plain (non-status) error: UNKNOWN + its text.
    etcd's lock and election recipes report their own errors this way."""
    await context.abort(grpc.StatusCode.UNKNOWN, message)
    raise AssertionError("unreachable: abort raises")


async def propose_or_abort(
    log: Proposer,
    command: internal_pb2.Command,
    context: aio.ServicerContext[object, object],
    header: HeaderFiller,
) -> object:
    """Propose `command`; end the call with etcd's status if it fails (before or
    at apply), else return the response with its header filled."""
    try:
        result = await log.propose(command)
    except EtcdError as e:
        await abort(context, e)
    if isinstance(result, EtcdError):
        await abort(context, result)
    header.fill(result.header)  # type: ignore[attr-defined]
    return result
