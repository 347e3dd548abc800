"""The v3lockpb.Lock service: Lock and Unlock, as etcd's server runs them.

Lock holds `name/<lease hex>` with the caller's lease until it is the oldest key
of the prefix (`queue_server.recipes.mutex`); Unlock deletes the key it returned.
A Lock without a lease gets a lease of its own that nobody keeps alive, as etcd's
(its session's), so such a lock goes away after SESSION_TTL seconds.

etcd runs these as client recipes inside the server: every error reaches the
caller as UNKNOWN with the message of the underlying error (etcd's client errors
carry no gRPC status), e.g. UNKNOWN "etcdserver: requested lease not found".
"""

from __future__ import annotations

from typing import ClassVar

from etcdserverpb import v3lock_pb2, v3lock_pb2_grpc
from queue_server.api.errors import abort_unknown
from queue_server.api.header import HeaderFiller
from queue_server.errors import EmptyKey, EtcdError
from queue_server.lease.ids import LeaseIdGenerator
from queue_server.recipes.local_client import LocalClient
from queue_server.recipes.mutex import SessionExpired, claim_and_wait, session_lease
from queue_server.transport.methods import Call


class LockService(v3lock_pb2_grpc.LockServicer):
    """Server-side mutexes over the node's own KV, leases and watches."""

    waiting_methods: ClassVar[frozenset[str]] = frozenset({"Lock"})
    """Methods that wait for other holders (a stop ends them at once:
    `Method.waits`)."""

    def __init__(self, client: LocalClient, header: HeaderFiller, ids: LeaseIdGenerator) -> None:
        self.client = client
        self.header = header
        self.ids = ids

    async def Lock(self, request: v3lock_pb2.LockRequest, context: Call) -> v3lock_pb2.LockResponse:
        try:
            lease = await session_lease(self.client, request.lease, self.ids.next)
            key = request.name + b"/" + b"%x" % lease
            _, header = await claim_and_wait(self.client, request.name + b"/", key, lease, b"")
        except (EtcdError, SessionExpired) as e:
            await abort_unknown(context, str(e))
        resp = v3lock_pb2.LockResponse(key=key)
        resp.header.CopyFrom(header)
        self.header.fill(resp.header)
        return resp

    async def Unlock(
        self, request: v3lock_pb2.UnlockRequest, context: Call
    ) -> v3lock_pb2.UnlockResponse:
        try:
            if not request.key:
                raise EmptyKey()  # what etcd's KV Delete says of it
            deleted = await self.client.delete(request.key)
        except EtcdError as e:
            await abort_unknown(context, e.text)
        resp = v3lock_pb2.UnlockResponse()
        resp.header.CopyFrom(deleted.header)
        self.header.fill(resp.header)
        return resp
