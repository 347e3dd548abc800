"""The etcdserverpb.Lease service: Grant, Revoke, KeepAlive, TimeToLive, Leases.

Grant and Revoke change replicated state, so they go through the log. KeepAlive
and TimeToLive touch only the node's expiry clock, as in etcd, where keepalives
reach the leader's lessor and never the raft log.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from grpc import aio

from etcdserverpb import internal_pb2, rpc_pb2, rpc_pb2_grpc
from queue_server.api.errors import abort
from queue_server.api.header import HeaderFiller
from queue_server.apply import Proposer, StateMachine
from queue_server.errors import EtcdError
from queue_server.lease.expiry import ExpiryClock

Context = aio.ServicerContext[object, object]


class LeaseIdGenerator:
    """Server-chosen lease ids in etcd's shape: the member id's low 16 bits, then
    a millisecond timestamp and a counter, kept positive and unique."""

    def __init__(self, member_id: int) -> None:
        self._prefix = (member_id & 0xFFFF) << 48
        self._suffix = (int(time.time() * 1000) << 8) & ((1 << 48) - 1)

    def next(self, taken: dict[int, object]) -> int:
        while True:
            self._suffix = (self._suffix + 1) & ((1 << 48) - 1)
            lease_id = (self._prefix | self._suffix) & ((1 << 63) - 1)
            if lease_id and lease_id not in taken:
                return lease_id


_SHARED_IDS: dict[int, LeaseIdGenerator] = {}


def lease_ids(member_id: int) -> LeaseIdGenerator:
    """The member's one lease id generator, shared by every service that grants
    leases (Lease, and Lock/Election for requests without a lease), so that two
    of them never pick the same id."""
    ids = _SHARED_IDS.get(member_id)
    if ids is None:
        ids = _SHARED_IDS[member_id] = LeaseIdGenerator(member_id)
    return ids


class LeaseService(rpc_pb2_grpc.LeaseServicer):
    """Serves leases from the state machine's lessor and the node's expiry clock."""

    def __init__(
        self,
        state: StateMachine,
        log: Proposer,
        expiry: ExpiryClock,
        header: HeaderFiller,
    ) -> None:
        self.state = state
        self.log = log
        self.expiry = expiry
        self.header = header
        self.ids = lease_ids(header.member_id)

    async def _propose(self, command: internal_pb2.Command, context: Context) -> object:
        try:
            result = await self.log.propose(command)
        except EtcdError as e:
            await abort(context, e)
        if isinstance(result, EtcdError):
            await abort(context, result)
        self.header.fill(result.header)  # type: ignore[attr-defined]
        return result

    async def LeaseGrant(
        self, request: rpc_pb2.LeaseGrantRequest, context: Context
    ) -> rpc_pb2.LeaseGrantResponse:
        command = internal_pb2.Command(lease_grant=request)
        if request.ID == 0:
            command.lease_grant.ID = self.ids.next(self.state.lessor.leases)  # type: ignore[arg-type]
        return await self._propose(command, context)  # type: ignore[return-value]

    async def LeaseRevoke(
        self, request: rpc_pb2.LeaseRevokeRequest, context: Context
    ) -> rpc_pb2.LeaseRevokeResponse:
        return await self._propose(internal_pb2.Command(lease_revoke=request), context)  # type: ignore[return-value]

    async def LeaseKeepAlive(
        self, request_iterator: AsyncIterator[rpc_pb2.LeaseKeepAliveRequest], context: Context
    ) -> AsyncIterator[rpc_pb2.LeaseKeepAliveResponse]:
        leases = self.state.lessor.leases
        async for request in request_iterator:
            ttl = self.expiry.keep_alive(request.ID) if request.ID in leases else 0
            resp = rpc_pb2.LeaseKeepAliveResponse(ID=request.ID, TTL=ttl)
            self.header.fill(resp.header)
            yield resp

    async def LeaseTimeToLive(
        self, request: rpc_pb2.LeaseTimeToLiveRequest, context: Context
    ) -> rpc_pb2.LeaseTimeToLiveResponse:
        lease = self.state.lessor.leases.get(request.ID)
        resp = rpc_pb2.LeaseTimeToLiveResponse(ID=request.ID)
        if lease is None:
            resp.TTL = -1  # etcd answers an unknown lease with TTL -1, not an error
        else:
            resp.TTL = self.expiry.remaining(request.ID)
            resp.grantedTTL = lease.ttl
            if request.keys:
                resp.keys.extend(sorted(lease.keys))
        self.header.fill(resp.header)
        return resp

    async def LeaseLeases(
        self, request: rpc_pb2.LeaseLeasesRequest, context: Context
    ) -> rpc_pb2.LeaseLeasesResponse:
        resp = rpc_pb2.LeaseLeasesResponse()
        for lease_id in self.state.lessor.leases:
            resp.leases.add(ID=lease_id)
        self.header.fill(resp.header)
        return resp
