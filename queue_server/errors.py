"""The errors the core reports to clients, one class per etcd error.

The core raises (or returns, from apply) these plain exceptions and never imports
grpc. Each class carries the gRPC status code name and the exact message etcd 3.5
sends, because clients rebuild typed errors from the message text; the API layer
turns them into a gRPC status with one table lookup (`queue_server.api.errors`).
"""

from __future__ import annotations

from typing import ClassVar


class EtcdError(Exception):
    """An expected failure of a request; `code` is a grpc.StatusCode name."""

    code: ClassVar[str] = "UNKNOWN"
    message: ClassVar[str] = "etcdserver: unknown error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.message)

    @property
    def text(self) -> str:
        return str(self.args[0])


def _error(name: str, code: str, message: str) -> type[EtcdError]:
    return type(name, (EtcdError,), {"code": code, "message": message, "__doc__": message})


EmptyKey = _error("EmptyKey", "INVALID_ARGUMENT", "etcdserver: key is not provided")
KeyNotFound = _error("KeyNotFound", "INVALID_ARGUMENT", "etcdserver: key not found")
ValueProvided = _error("ValueProvided", "INVALID_ARGUMENT", "etcdserver: value is provided")
LeaseProvided = _error("LeaseProvided", "INVALID_ARGUMENT", "etcdserver: lease is provided")
TooManyOps = _error(
    "TooManyOps", "INVALID_ARGUMENT", "etcdserver: too many operations in txn request"
)
DuplicateKey = _error(
    "DuplicateKey", "INVALID_ARGUMENT", "etcdserver: duplicate key given in txn request"
)
Compacted = _error(
    "Compacted", "OUT_OF_RANGE", "etcdserver: mvcc: required revision has been compacted"
)
FutureRevision = _error(
    "FutureRevision", "OUT_OF_RANGE", "etcdserver: mvcc: required revision is a future revision"
)
NoSpace = _error("NoSpace", "RESOURCE_EXHAUSTED", "etcdserver: mvcc: database space exceeded")
LeaseNotFound = _error("LeaseNotFound", "NOT_FOUND", "etcdserver: requested lease not found")
LeaseExists = _error("LeaseExists", "FAILED_PRECONDITION", "etcdserver: lease already exists")
LeaseTTLTooLarge = _error("LeaseTTLTooLarge", "OUT_OF_RANGE", "etcdserver: too large lease TTL")
RequestTooLarge = _error("RequestTooLarge", "INVALID_ARGUMENT", "etcdserver: request is too large")
TooManyRequests = _error("TooManyRequests", "RESOURCE_EXHAUSTED", "etcdserver: too many requests")
ServerStopped = _error("ServerStopped", "UNAVAILABLE", "etcdserver: server stopped")
RequestTimeout = _error("RequestTimeout", "UNAVAILABLE", "etcdserver: request timed out")
MemberNotFound = _error("MemberNotFound", "NOT_FOUND", "etcdserver: member not found")
NotCapable = _error("NotCapable", "UNAVAILABLE", "etcdserver: not capable")
NoLeader = _error("NoLeader", "UNAVAILABLE", "etcdserver: no leader")
LeaderChanged = _error("LeaderChanged", "UNAVAILABLE", "etcdserver: leader changed")
PeerURLExists = _error(
    "PeerURLExists", "FAILED_PRECONDITION", "etcdserver: Peer URLs already exists"
)
LearnerNotSupported = _error(
    "LearnerNotSupported",
    "INVALID_ARGUMENT",
    "etcdserver: learner members are not supported by this server",
)
NotClustered = _error(
    "NotClustered",
    "FAILED_PRECONDITION",
    "etcdserver: membership changes need a member started with --initial-cluster",
)
