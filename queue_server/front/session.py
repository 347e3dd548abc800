"""A front's own presence in the backend etcd: its id, its session lease kept
alive, and the calls the queues make to etcd on the front's behalf.

What belongs here: `FrontSession`. A front's consumer registrations and the
registry keys of the queues it dispatches are on its session lease, so etcd
deletes them when the front dies; the queues' hot calls (Txn, LeaseGrant) go
over the front's own HTTP/2 client (`h2_client.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

from google.protobuf.message import Message
from grpc import aio

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from queue_server.front.h2_client import CallError
from queue_server.front.peers import Peers, front_id
from queue_server.front.upstream import Upstream
from queue_server.transport.status import Status

log = logging.getLogger(__name__)

SESSION_TTL = 2
"""Seconds of the front's session lease: a dead front's consumers and queues are
taken over this long after its last keepalive. 2 s is the shortest etcd grants
with its default timing (its minimum TTL is 1.5 election timeouts, rounded up)."""
KEEPALIVE_SECONDS = 0.5
RETRY_SECONDS = 0.5
CALL_TIMEOUT = 5.0
LEASE_NOT_FOUND = "etcdserver: requested lease not found"


def prefix_end(prefix: bytes) -> bytes:
    """The range_end of a prefix watch or range of `prefix`."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def range_op(key: bytes, range_end: bytes = b"", count_only: bool = False) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(
        request_range=rpc_pb2.RangeRequest(key=key, range_end=range_end, count_only=count_only)
    )


def prefix_op(prefix: bytes) -> rpc_pb2.RequestOp:
    """A Range of every key under `prefix`."""
    return range_op(prefix, prefix_end(prefix))


def put_op(key: bytes, value: bytes = b"", lease: int = 0) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def delete_op(key: bytes) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key))


class FrontSession:
    """This front's id and session lease in the backend."""

    def __init__(self, upstream: Upstream, peers: Peers) -> None:
        self.upstream = upstream
        self.peers = peers
        """How this front reaches the others its registry keys name (`peers.py`)."""
        self._uuid = uuid.uuid4().hex.encode()
        self.front_id = self._uuid
        """The value of this front's registry keys and registrations: its uuid,
        and `@host:port` (`@https://host:port`) once `advertise` has named its
        client port, where other fronts call it and watch it for its death
        (`peers.py`, `liveness.py`)."""
        self.lease = 0
        self.kv = rpc_pb2_grpc.KVStub(upstream.channel)
        self.leases = rpc_pb2_grpc.LeaseStub(upstream.channel)
        self.watches = rpc_pb2_grpc.WatchStub(upstream.channel)
        self._ready = asyncio.Event()
        self._granted = False
        self.renewed: list[Callable[[], None]] = []
        """Called when an expired session lease has been replaced."""
        self._task: asyncio.Task[None] | None = None

    def advertise(self, address: str, tls: bool) -> None:
        """Name the client port other fronts can reach this one at, and whether
        it is served over TLS (before anything is written with `front_id`)."""
        self.front_id = front_id(self._uuid, address, tls)

    async def metadata(self) -> tuple[tuple[str, str], ...]:
        return await self.upstream.own_metadata()

    async def _call(self, path: str, request: Message) -> bytes:
        """One unary call with the front's own credentials, over the front's own
        HTTP/2 client (the queues' hot calls: grpcio's cost several times the CPU)."""
        return await self.upstream.unary.call(
            path, request.SerializeToString(), await self.metadata(), CALL_TIMEOUT
        )

    async def txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        return rpc_pb2.TxnResponse.FromString(await self._call("/etcdserverpb.KV/Txn", request))

    async def read(self, *ranges: rpc_pb2.RequestOp) -> rpc_pb2.TxnResponse:
        """Several Ranges at one revision (a Txn of reads)."""
        return await self.txn(rpc_pb2.TxnRequest(success=ranges))

    async def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds (a delivery lease): its ID."""
        reply = await self._call(
            "/etcdserverpb.Lease/LeaseGrant", rpc_pb2.LeaseGrantRequest(TTL=ttl)
        )
        granted = rpc_pb2.LeaseGrantResponse.FromString(reply)
        if granted.error:
            raise CallError(Status.UNKNOWN, granted.error)
        return int(granted.ID)

    async def revoke(self, lease: int) -> None:
        """Revoke another front's lease (it was seen dead); gone already is fine."""
        try:
            await self._call(
                "/etcdserverpb.Lease/LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease)
            )
        except CallError as e:
            if e.code is not Status.NOT_FOUND:
                raise

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._keep())

    async def ready(self) -> int:
        """The session lease, granted at the first need: a front whose clients
        use no queue writes nothing to etcd of its own."""
        if self._task is None:
            self.start()
        await self._ready.wait()
        return self.lease

    async def _keep(self) -> None:
        """Grant the session lease, and keep it alive for as long as etcd has it.
        A keepalive stream that breaks (the member it went to died) is opened
        again for the same lease, which etcd keeps until its TTL passes. Only a
        lease etcd says is gone is replaced, and then `renewed` is called: what
        was on the old lease went with it."""
        while True:
            try:
                if not self.lease:
                    granted = await self.leases.LeaseGrant(
                        rpc_pb2.LeaseGrantRequest(TTL=SESSION_TTL),
                        metadata=await self.metadata(),
                        timeout=CALL_TIMEOUT,
                    )
                    self.lease = granted.ID
                    self._ready.set()
                    log.info("front session lease=%x front=%s", self.lease, self.front_id.decode())
                    if self._granted:
                        for renewed in self.renewed:
                            renewed()
                    self._granted = True
                if await self._keep_alive():
                    log.warning("front session lease=%x expired, renewing", self.lease)
                    self.lease = 0
                    self._ready.clear()
                    continue
            except aio.AioRpcError as e:
                log.warning("front session keepalive interrupted, again: %s", e.details())
            except asyncio.InvalidStateError:
                # a write on a stream that has ended with its connection: grpc
                # raises this, not an AioRpcError
                log.warning("front session keepalive stream ended, again")
            except Exception:  # the session must outlive anything: log it, go on
                log.exception("front session keepalive failed, again")
            await asyncio.sleep(RETRY_SECONDS)

    def lost(self, lease: int) -> None:
        """etcd answered that `lease` is not found: if it is the session's, it
        is gone (whatever the keepalive stream says), so grant another now."""
        if lease != self.lease or not lease:
            return
        log.warning("front session lease=%x not found in etcd, renewing", lease)
        self.lease = 0
        self._ready.clear()
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.ensure_future(self._keep())

    async def _keep_alive(self) -> bool:
        """Keep the lease alive until the stream ends (False) or etcd says the
        lease has expired (True)."""
        stream = self.leases.LeaseKeepAlive(metadata=await self.metadata())
        try:
            while True:
                await stream.write(rpc_pb2.LeaseKeepAliveRequest(ID=self.lease))
                reply = await stream.read()
                if not isinstance(reply, rpc_pb2.LeaseKeepAliveResponse):
                    return False  # grpc.aio.EOF: the stream ended, the lease may live
                if reply.TTL <= 0:
                    return True
                await asyncio.sleep(KEEPALIVE_SECONDS)
        finally:
            stream.cancel()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.lease:
            with contextlib.suppress(aio.AioRpcError):
                await self.leases.LeaseRevoke(
                    rpc_pb2.LeaseRevokeRequest(ID=self.lease),
                    metadata=await self.metadata(),
                    timeout=1.0,
                )
