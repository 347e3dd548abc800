"""One table from core errors to gRPC status: code and exact etcd message."""

from __future__ import annotations

from typing import NoReturn

import grpc
from grpc import aio

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
