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


class EmptyKey(EtcdError):
    """A request names no key."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: key is not provided"


class KeyNotFound(EtcdError):
    """A put with ignore_value or ignore_lease on a key that does not exist, or an
    empty RequestOp in a txn."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: key not found"


class ValueProvided(EtcdError):
    """A put with ignore_value that also carries a value."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: value is provided"


class LeaseProvided(EtcdError):
    """A put with ignore_lease that also names a lease."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: lease is provided"


class TooManyOps(EtcdError):
    """A txn with more operations than --max-txn-ops."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: too many operations in txn request"


class DuplicateKey(EtcdError):
    """A txn that writes one key twice (etcd"s duplicate-key rule)."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: duplicate key given in txn request"


class Compacted(EtcdError):
    """A read or watch at a revision compaction has dropped."""

    code = "OUT_OF_RANGE"
    message = "etcdserver: mvcc: required revision has been compacted"


class FutureRevision(EtcdError):
    """A read at a revision not yet written."""

    code = "OUT_OF_RANGE"
    message = "etcdserver: mvcc: required revision is a future revision"


class NoSpace(EtcdError):
    """A write refused while the NOSPACE alarm is raised."""

    code = "RESOURCE_EXHAUSTED"
    message = "etcdserver: mvcc: database space exceeded"


class LeaseNotFound(EtcdError):
    """A request names a lease that does not exist."""

    code = "NOT_FOUND"
    message = "etcdserver: requested lease not found"


class LeaseExists(EtcdError):
    """A grant of a lease id already granted."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: lease already exists"


class LeaseTTLTooLarge(EtcdError):
    """A grant with a TTL over etcd"s maximum."""

    code = "OUT_OF_RANGE"
    message = "etcdserver: too large lease TTL"


class RequestTooLarge(EtcdError):
    """A request over --max-request-bytes."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: request is too large"


class TooManyRequests(EtcdError):
    """A proposal while too many entries wait to be applied (`admission.MAX_UNAPPLIED`)."""

    code = "RESOURCE_EXHAUSTED"
    message = "etcdserver: too many requests"


class ServerStopped(EtcdError):
    """The server is stopping: the log takes no more proposals."""

    code = "UNAVAILABLE"
    message = "etcdserver: server stopped"


class RequestTimeout(EtcdError):
    """A proposal whose result did not come in time."""

    code = "UNAVAILABLE"
    message = "etcdserver: request timed out"


class MemberNotFound(EtcdError):
    """A membership change names a member that does not exist."""

    code = "NOT_FOUND"
    message = "etcdserver: member not found"


class NotCapable(EtcdError):
    """A request this server cannot serve."""

    code = "UNAVAILABLE"
    message = "etcdserver: not capable"


class NoLeader(EtcdError):
    """The cluster has no leader to take the request."""

    code = "UNAVAILABLE"
    message = "etcdserver: no leader"


class LeaderChanged(EtcdError):
    """The leader changed while the request was in flight."""

    code = "UNAVAILABLE"
    message = "etcdserver: leader changed"


class PeerURLExists(EtcdError):
    """A member add or update with a peer URL another member has."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: Peer URLs already exists"


class LearnerNotSupported(EtcdError):
    """A member add as a learner."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: learner members are not supported by this server"


class NotClustered(EtcdError):
    """A membership change on a server started without --initial-cluster."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: membership changes need a member started with --initial-cluster"
