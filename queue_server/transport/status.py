"""gRPC status codes and the exception a call ends with.

What belongs here: the numeric codes of the gRPC protocol (the same numbers on
every transport), `RpcError` that a servicer raises through `Call.abort`, and the
`grpc-message` percent-encoding of the gRPC HTTP/2 spec. Imports nothing of ours.
"""

from __future__ import annotations

from enum import IntEnum


class Status(IntEnum):
    """The gRPC status codes (grpc/doc/statuscodes.md), by grpcio's names."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class RpcError(Exception):
    """Ends a call with `code` and `message` (what `Call.abort` raises)."""

    def __init__(self, code: Status, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message


_UNRESERVED = frozenset(range(0x20, 0x7F)) - {ord("%")}


def encode_message(message: str) -> bytes:
    """`grpc-message` as the spec sends it: UTF-8, with every byte outside
    printable ASCII (and `%` itself) percent-encoded."""
    raw = message.encode("utf-8")
    if all(b in _UNRESERVED for b in raw):
        return raw
    return b"".join(bytes((b,)) if b in _UNRESERVED else b"%%%02X" % b for b in raw)
