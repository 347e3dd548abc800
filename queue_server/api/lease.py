"""The etcdserverpb.Lease service: Grant, Revoke, KeepAlive, TimeToLive, Leases.

Grant and Revoke change replicated state, so they go through the log. KeepAlive
and TimeToLive touch only the node's expiry clock, as in etcd, where keepalives
reach the leader's lessor and never the raft log. The queue delivery table's
leases (the ack deadline of a delivered message) answer KeepAlive, TimeToLive and
Revoke here too, so any etcd client can extend or give back a delivery.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import ClassVar, Protocol

from etcdserverpb import internal_pb2, rpc_pb2, rpc_pb2_grpc
from queue_server.api.errors import R, propose_or_abort
from queue_server.api.header import HeaderFiller
from queue_server.apply import Proposer, StateMachine
from queue_server.lease.expiry import ExpiryClock
from queue_server.lease.ids import LeaseIdGenerator
from queue_server.transport.methods import Call


class DeliveryLeases(Protocol):
    """Leases that are not in the lease table: the queue delivery table's
    leases (a delivery's ack deadline, extendable like any lease)."""

    def keep_alive(self, lease_id: int, now: float) -> int | None: ...

    def time_to_live(self, lease_id: int, now: float) -> tuple[int, int, bytes] | None: ...

    def revoke(self, lease_id: int) -> bool: ...


class LeaseService(rpc_pb2_grpc.LeaseServicer):
    """Serves leases from the state machine's lessor and the node's expiry clock."""

    waiting_methods: ClassVar[frozenset[str]] = frozenset({"LeaseKeepAlive"})
    """Keepalive streams last as long as the client wants (a stop ends them
    at once: `Method.waits`)."""

    def __init__(
        self,
        state: StateMachine,
        log: Proposer,
        expiry: ExpiryClock,
        header: HeaderFiller,
        ids: LeaseIdGenerator,
        clock: Callable[[], float],
        deliveries: DeliveryLeases | None = None,
    ) -> None:
        self.state = state
        self.log = log
        self.expiry = expiry
        self.header = header
        self.deliveries = deliveries
        self.ids = ids
        self.clock = clock
        """The node's clock (`Timers.clock`), the one `expiry` runs on: a
        delivery's ack deadline is extended or read at its time."""

    async def _propose(self, command: internal_pb2.Command, context: Call, response: type[R]) -> R:
        return await propose_or_abort(self.log, command, context, self.header, response)

    async def LeaseGrant(
        self, request: rpc_pb2.LeaseGrantRequest, context: Call
    ) -> rpc_pb2.LeaseGrantResponse:
        command = internal_pb2.Command(lease_grant=request)
        if request.ID == 0:
            command.lease_grant.ID = self.ids.next(self.state.lessor.leases)
        return await self._propose(command, context, rpc_pb2.LeaseGrantResponse)

    async def LeaseRevoke(
        self, request: rpc_pb2.LeaseRevokeRequest, context: Call
    ) -> rpc_pb2.LeaseRevokeResponse:
        if (
            request.ID not in self.state.lessor.leases
            and self.deliveries is not None
            and self.deliveries.revoke(request.ID)
        ):
            resp = rpc_pb2.LeaseRevokeResponse()  # a delivery given back: no log entry
            self.header.fill(resp.header)
            return resp
        command = internal_pb2.Command(lease_revoke=request)
        return await self._propose(command, context, rpc_pb2.LeaseRevokeResponse)

    async def LeaseKeepAlive(
        self, request_iterator: AsyncIterator[rpc_pb2.LeaseKeepAliveRequest], context: Call
    ) -> AsyncIterator[rpc_pb2.LeaseKeepAliveResponse]:
        leases = self.state.lessor.leases
        deliveries = self.deliveries
        async for request in request_iterator:
            if request.ID in leases:
                ttl = self.expiry.keep_alive(request.ID)
            elif deliveries is not None:
                ttl = deliveries.keep_alive(request.ID, self.clock()) or 0
            else:
                ttl = 0
            resp = rpc_pb2.LeaseKeepAliveResponse(ID=request.ID, TTL=ttl)
            self.header.fill(resp.header)
            yield resp

    async def LeaseTimeToLive(
        self, request: rpc_pb2.LeaseTimeToLiveRequest, context: Call
    ) -> rpc_pb2.LeaseTimeToLiveResponse:
        lease = self.state.lessor.leases.get(request.ID)
        resp = rpc_pb2.LeaseTimeToLiveResponse(ID=request.ID)
        delivery = None
        if lease is None and self.deliveries is not None:
            delivery = self.deliveries.time_to_live(request.ID, self.clock())
        if delivery is not None:
            resp.TTL, resp.grantedTTL, key = delivery
            if request.keys and key:
                resp.keys.append(key)
        elif lease is None:
            resp.TTL = -1  # etcd answers an unknown lease with TTL -1, not an error
        else:
            resp.TTL = self.expiry.remaining(request.ID)
            resp.grantedTTL = lease.ttl
            if request.keys:
                resp.keys.extend(sorted(lease.keys))
        self.header.fill(resp.header)
        return resp

    async def LeaseLeases(
        self, request: rpc_pb2.LeaseLeasesRequest, context: Call
    ) -> rpc_pb2.LeaseLeasesResponse:
        resp = rpc_pb2.LeaseLeasesResponse()
        for lease_id in self.state.lessor.leases:
            resp.leases.add(ID=lease_id)
        self.header.fill(resp.header)
        return resp
