"""The client library's errors, and which gRPC failures are worth retrying.

Calls that fail for good raise the `grpc.RpcError` the server sent (a
`grpc.aio.AioRpcError`, with its code and etcd's message); the client's own
conditions raise a `ClientError`. Two different rules decide what is transient:

- `RETRY_CODES`: what the client itself retries, on another endpoint: the
  member is gone, stopping, or has no leader (etcd answers all of those with
  UNAVAILABLE).
- `is_transient`: seed 000's rule for a CQS consumer's own processing errors:
  UNAVAILABLE, DEADLINE_EXCEEDED and INTERNAL are transient (redeliver), every
  other status is permanent; the first gRPC error along the cause chain decides.

Imports nothing of the server.
"""

from __future__ import annotations

import grpc

RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Codes a call is retried on (another endpoint, after a backoff). A write that
failed so may have committed: the member can die after the commit and before
its answer, so a retried produce can enqueue twice (at-least-once)."""

TRANSIENT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}
)
"""Seed 000: the gRPC equivalents of HTTP 5xx. Everything else is permanent."""

FATAL_WATCH_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""Codes that end a consumer instead of making it reconnect: asking again
would get the same answer."""


class ClientError(Exception):
    """Base of the client library's own errors."""


class ConsumerClosed(ClientError):
    """The consumer was closed; it yields no more deliveries."""


class NoDeliveryLease(ClientError):
    """`nack()` or `extend()` on a delivery that carries no delivery lease: its
    queue has no ack deadline, so there is nothing to extend and no way to give
    this one message back (closing the consumer gives back all it holds)."""


class DeliveryLost(ClientError):
    """The delivery's lease is gone: its ack deadline passed (the message was
    taken back and may be with another consumer), it was acknowledged, or the
    consumer reconnected since (every message it held was given back)."""


def grpc_code(error: BaseException) -> grpc.StatusCode | None:
    """The status code of the first gRPC error along `error`'s cause chain
    (`__cause__`, else `__context__`), or None if there is none."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, grpc.RpcError):
            code = getattr(current, "code", None)
            if callable(code):
                found = code()
                if isinstance(found, grpc.StatusCode):
                    return found
        current = current.__cause__ or current.__context__
    return None


def is_transient(error: BaseException) -> bool:
    """Seed 000's classification of a failure to process one notification:
    True (transient: leave it unacknowledged, it comes back) when the first
    gRPC error in the cause chain is UNAVAILABLE, DEADLINE_EXCEEDED or INTERNAL,
    or when the chain holds a refused connection or a timeout outside gRPC;
    False (permanent) otherwise."""
    code = grpc_code(error)
    if code is not None:
        return code in TRANSIENT_CODES
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError)):
            return True
        current = current.__cause__ or current.__context__
    return False
