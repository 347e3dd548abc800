"""An in-process etcd client over the node's state machine, log and watch hub.

Lock and Election are implemented, as in etcd's server, as client recipes; this is
their client. Reads come from the state machine, writes go through the log, and
`wait_delete` watches a key through the watch hub like any watcher.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from etcdserverpb import internal_pb2, kv_pb2, rpc_pb2
from queue_server.apply import Proposer, StateMachine
from queue_server.errors import EtcdError, LeaseExists
from queue_server.watch.hub import WatchHub

NOPUT = rpc_pb2.WatchCreateRequest.NOPUT


class LocalClient:
    """KV and watch operations for server-side recipes."""

    def __init__(self, state: StateMachine, log: Proposer, hub: WatchHub) -> None:
        self.state = state
        self.log = log
        self.hub = hub

    def range(self, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        return self.state.read_range(request)

    async def _propose(self, command: internal_pb2.Command) -> object:
        result = await self.log.propose(command)
        if isinstance(result, EtcdError):
            raise result
        return result

    async def txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        result = await self._propose(internal_pb2.Command(txn=request))
        assert isinstance(result, rpc_pb2.TxnResponse)
        return result

    async def grant(self, ttl: int, new_id: Callable[[dict[int, Any]], int]) -> int:
        """Grant a lease with an id from `new_id` (given the leases that exist);
        returns the id. An id taken meanwhile by another grant is retried."""
        while True:
            request = rpc_pb2.LeaseGrantRequest(ID=new_id(self.state.lessor.leases), TTL=ttl)
            try:
                await self._propose(internal_pb2.Command(lease_grant=request))
            except LeaseExists:
                continue
            return request.ID

    async def delete(self, key: bytes) -> rpc_pb2.DeleteRangeResponse:
        command = internal_pb2.Command(delete_range=rpc_pb2.DeleteRangeRequest(key=key))
        result = await self._propose(command)
        assert isinstance(result, rpc_pb2.DeleteRangeResponse)
        return result

    async def wait_delete(self, key: bytes, after_revision: int) -> int:
        """Wait until `key` is deleted at a revision after `after_revision`;
        returns that revision."""
        wake = asyncio.Event()
        stream = self.hub.open_stream(wake.set)
        try:
            create = rpc_pb2.WatchCreateRequest(
                key=key,
                start_revision=after_revision + 1,
                filters=[NOPUT],
            )
            self.hub.create(stream, create)
            while True:
                while stream.outbox:
                    response = stream.pop()
                    if response.compact_revision:
                        # history is gone: fall back to reading the key now
                        if not self.range(rpc_pb2.RangeRequest(key=key)).kvs:
                            return self.state.store.revision
                        self.hub.create(
                            stream, rpc_pb2.WatchCreateRequest(key=key, filters=[NOPUT])
                        )
                    for event in response.events:
                        if event.type == kv_pb2.Event.DELETE:
                            return event.kv.mod_revision
                if stream.has_room and stream.unsynced():
                    self.hub.catch_up(stream)
                    continue
                wake.clear()
                await wake.wait()
        finally:
            self.hub.close_stream(stream)
