"""The v3electionpb.Election service: Campaign, Proclaim, Leader, Observe, Resign.

As in etcd, an election is a prefix: each candidate holds `name/<lease hex>` with
its lease, and the leader is the candidate whose key was created first. Campaign
waits like a mutex (`queue_server.recipes.mutex`); Proclaim and Resign act only if
the caller's key still has the create revision it won with. A Campaign or Proclaim
without a lease gets a lease of its own that nobody keeps alive, as etcd's session
does. As in etcd, whose server runs these as client recipes, every error reaches
the caller as UNKNOWN with the underlying message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import ClassVar

from etcdserverpb import rpc_pb2, v3election_pb2, v3election_pb2_grpc
from queue_server.api.errors import abort_unknown
from queue_server.api.header import HeaderFiller
from queue_server.errors import EtcdError
from queue_server.lease.ids import LeaseIdGenerator
from queue_server.recipes.local_client import LocalClient
from queue_server.recipes.mutex import (
    SessionExpired,
    claim,
    prefix_end,
    session_lease,
    wait_turn,
)
from queue_server.transport.methods import Call

NOT_LEADER = "election: not leader"
NO_LEADER = "election: no leader"
MISSING_LEADER_KEY = '"leader" field must be provided'


class NotLeader(Exception):
    def __init__(self) -> None:
        super().__init__(NOT_LEADER)


class ElectionService(v3election_pb2_grpc.ElectionServicer):
    """Server-side elections over the node's own KV, leases and watches."""

    waiting_methods: ClassVar[frozenset[str]] = frozenset({"Campaign", "Observe"})
    """Methods that wait for other candidates or follow the leader for as long
    as the client wants (a stop ends them at once: `Method.waits`)."""

    def __init__(self, client: LocalClient, header: HeaderFiller, ids: LeaseIdGenerator) -> None:
        self.client = client
        self.header = header
        self.ids = ids

    def _first(self, name: bytes) -> rpc_pb2.RangeResponse:
        prefix = name + b"/"
        return self.client.range(
            rpc_pb2.RangeRequest(
                key=prefix,
                range_end=prefix_end(prefix),
                sort_target=rpc_pb2.RangeRequest.CREATE,
                sort_order=rpc_pb2.RangeRequest.ASCEND,
                limit=1,
            )
        )

    async def Campaign(
        self, request: v3election_pb2.CampaignRequest, context: Call
    ) -> v3election_pb2.CampaignResponse:
        """etcd's Election.Campaign: claim `name/<lease hex>`; if it existed with
        another value, proclaim ours at once; then wait to be the oldest. The
        response carries the claim's header, as etcd's does."""
        prefix = request.name + b"/"
        try:
            lease = await session_lease(self.client, request.lease, self.ids.next)
            key = prefix + b"%x" % lease
            claimed = await claim(self.client, prefix, key, lease, request.value)
            if claimed.existing is not None and claimed.existing != request.value:
                proclaimed = await self._proclaim(key, claimed.rev, lease, request.value)
                if not proclaimed.succeeded:
                    raise NotLeader()
            if not claimed.owner:
                await wait_turn(self.client, prefix, key, claimed.rev)
                if not self.client.range(rpc_pb2.RangeRequest(key=key)).kvs:
                    # etcd's Campaign does not look again, and reports a win for
                    # a key that is gone; we report that its lease expired
                    raise SessionExpired()
        except (EtcdError, SessionExpired, NotLeader) as e:
            await abort_unknown(context, str(e))
        resp = v3election_pb2.CampaignResponse()
        resp.header.CopyFrom(claimed.header)
        self.header.fill(resp.header)
        resp.leader.name = request.name
        resp.leader.key = key
        resp.leader.rev = claimed.rev
        resp.leader.lease = lease
        return resp

    async def _proclaim(
        self, key: bytes, rev: int, lease: int, value: bytes
    ) -> rpc_pb2.TxnResponse:
        cmp = rpc_pb2.Compare(
            key=key,
            target=rpc_pb2.Compare.CREATE,
            result=rpc_pb2.Compare.EQUAL,
            create_revision=rev,
        )
        put = rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))
        return await self.client.txn(rpc_pb2.TxnRequest(compare=[cmp], success=[put]))

    async def Proclaim(
        self, request: v3election_pb2.ProclaimRequest, context: Call
    ) -> v3election_pb2.ProclaimResponse:
        if not request.HasField("leader"):
            await abort_unknown(context, MISSING_LEADER_KEY)
        leader = request.leader
        try:
            # a leader key without a lease: etcd's session grants one for the put
            lease = await session_lease(self.client, leader.lease, self.ids.next)
            resp = await self._proclaim(leader.key, leader.rev, lease, request.value)
        except EtcdError as e:
            await abort_unknown(context, e.text)
        if not resp.succeeded:
            await abort_unknown(context, NOT_LEADER)
        out = v3election_pb2.ProclaimResponse()
        out.header.CopyFrom(resp.header)
        self.header.fill(out.header)
        return out

    async def Resign(
        self, request: v3election_pb2.ResignRequest, context: Call
    ) -> v3election_pb2.ResignResponse:
        if not request.HasField("leader"):
            await abort_unknown(context, MISSING_LEADER_KEY)
        leader = request.leader
        cmp = rpc_pb2.Compare(
            key=leader.key,
            target=rpc_pb2.Compare.CREATE,
            result=rpc_pb2.Compare.EQUAL,
            create_revision=leader.rev,
        )
        delete = rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=leader.key))
        try:
            resp = await self.client.txn(rpc_pb2.TxnRequest(compare=[cmp], success=[delete]))
        except EtcdError as e:
            await abort_unknown(context, e.text)
        out = v3election_pb2.ResignResponse()
        out.header.CopyFrom(resp.header)
        self.header.fill(out.header)
        return out

    async def Leader(
        self, request: v3election_pb2.LeaderRequest, context: Call
    ) -> v3election_pb2.LeaderResponse:
        first = self._first(request.name)
        if not first.kvs:
            await abort_unknown(context, NO_LEADER)
        resp = v3election_pb2.LeaderResponse()
        resp.header.CopyFrom(first.header)
        self.header.fill(resp.header)
        resp.kv.CopyFrom(first.kvs[0])
        return resp

    async def Observe(
        self, request: v3election_pb2.LeaderRequest, context: Call
    ) -> AsyncIterator[v3election_pb2.LeaderResponse]:
        """Stream the leader's key-value each time the leader or its value changes."""
        hub = self.client.hub
        wake = asyncio.Event()
        stream = hub.open_stream(wake.set)
        prefix = request.name + b"/"
        try:
            hub.create(stream, rpc_pb2.WatchCreateRequest(key=prefix, range_end=prefix_end(prefix)))
            last: tuple[bytes, int] | None = None
            while True:
                first = self._first(request.name)
                if first.kvs:
                    kv = first.kvs[0]
                    if (kv.key, kv.mod_revision) != last:
                        last = (kv.key, kv.mod_revision)
                        resp = v3election_pb2.LeaderResponse()
                        resp.header.CopyFrom(first.header)
                        self.header.fill(resp.header)
                        resp.kv.CopyFrom(kv)
                        yield resp
                stream.clear()
                wake.clear()
                await wake.wait()
        finally:
            hub.close_stream(stream)
