"""The v3lockpb.Lock service: Lock and Unlock, as etcd's server runs them.

Lock holds `name/<lease hex>` with the caller's lease until it is the oldest key
of the prefix (`queue_server.recipes.mutex`); Unlock deletes the key it returned.
"""

from __future__ import annotations

from grpc import aio

from etcdserverpb import v3lock_pb2, v3lock_pb2_grpc
from queue_server.api.errors import abort, abort_unknown
from queue_server.api.header import HeaderFiller
from queue_server.errors import EtcdError
from queue_server.recipes.local_client import LocalClient
from queue_server.recipes.mutex import SessionExpired, claim_and_wait

Context = aio.ServicerContext[object, object]


class LockService(v3lock_pb2_grpc.LockServicer):
    """Server-side mutexes over the node's own KV, leases and watches."""

    def __init__(self, client: LocalClient, header: HeaderFiller) -> None:
        self.client = client
        self.header = header

    async def Lock(
        self, request: v3lock_pb2.LockRequest, context: Context
    ) -> v3lock_pb2.LockResponse:
        key = request.name + b"/" + b"%x" % request.lease
        try:
            _, header = await claim_and_wait(
                self.client, request.name + b"/", key, request.lease, b""
            )
        except EtcdError as e:
            await abort(context, e)
        except SessionExpired as e:
            await abort_unknown(context, str(e))
        resp = v3lock_pb2.LockResponse(key=key)
        resp.header.CopyFrom(header)
        self.header.fill(resp.header)
        return resp

    async def Unlock(
        self, request: v3lock_pb2.UnlockRequest, context: Context
    ) -> v3lock_pb2.UnlockResponse:
        try:
            deleted = await self.client.delete(request.key)
        except EtcdError as e:
            await abort(context, e)
        resp = v3lock_pb2.UnlockResponse()
        resp.header.CopyFrom(deleted.header)
        self.header.fill(resp.header)
        return resp
