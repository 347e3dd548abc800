"""A cluster member's session lease, which its consumer registry keys hang on.

A consumer's watch lives on one member. Its registry key `/q/{name}/c/{uuid}` is
put with this member's session lease, so when the member dies (or is cut off
from the majority) the leader's lease expiry deletes the key, and the state
machine hands the consumer's messages to the consumers left. The member keeps
the lease alive like any client would; if it lost it anyway (it was cut off for
longer than the TTL), the next registration grants a new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.errors import EtcdError
from queue_server.lease.expiry import ExpiryClock
from queue_server.lease.lessor import Lessor
from queue_server.proposals import Propose

SESSION_TTL = 4
"""Seconds a member's consumers outlive it: how soon their messages go to others."""


class NodeSession:
    """Grants, keeps alive and re-grants this member's session lease."""

    def __init__(
        self,
        propose: Propose,
        lessor: Lessor,
        expiry: ExpiryClock,
        new_lease_id: Callable[[], int],
        ttl: int = SESSION_TTL,
    ) -> None:
        self._propose = propose
        self._lessor = lessor
        self._expiry = expiry
        self._new_lease_id = new_lease_id
        self.ttl = ttl
        self.lease_id = 0
        self._lock = asyncio.Lock()

    async def lease(self) -> int:
        """The session lease, granted first if there is none (or it expired)."""
        if self.lease_id in self._lessor.leases:
            return self.lease_id
        async with self._lock:
            if self.lease_id in self._lessor.leases:
                return self.lease_id
            lease_id = self._new_lease_id()
            command = internal_pb2.Command(
                lease_grant=rpc_pb2.LeaseGrantRequest(ID=lease_id, TTL=self.ttl)
            )
            result = await self._propose(command)
            if isinstance(result, EtcdError):
                raise result
            self.lease_id = lease_id
            return lease_id

    @property
    def interval(self) -> float:
        """A timer policy of the node driver: keepalives four times per TTL."""
        return self.ttl / 4

    def due(self, now: float) -> None:
        """Keep the lease alive (on a follower the keepalive reaches the leader)."""
        if self.lease_id in self._lessor.leases:
            self._expiry.keep_alive(self.lease_id)
