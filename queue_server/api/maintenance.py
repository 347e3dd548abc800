"""The etcdserverpb.Maintenance service (Status) and etcdserverpb.Cluster (MemberList).

The rest of Maintenance (Alarm, Defragment, Hash, Snapshot, ...) arrives with the
Watch/Lease issue; until then grpc answers UNIMPLEMENTED for those methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from grpc import aio

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from queue_server.api.header import HeaderFiller
from queue_server.apply import StateMachine

Context = aio.ServicerContext[object, object]

SERVER_VERSION = "3.5.17"
"""The etcd release whose API we match; clients gate features on it."""


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """How this member describes itself to clients."""

    member_id: int
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]


class MaintenanceService(rpc_pb2_grpc.MaintenanceServicer):
    """Status of this member: version, sizes, leader, raft index and term."""

    def __init__(
        self,
        state: StateMachine,
        header: HeaderFiller,
        last_index: Callable[[], int],
        db_size: Callable[[], int],
    ) -> None:
        self.state = state
        self.header = header
        self.last_index = last_index
        self.db_size = db_size

    async def Status(
        self, request: rpc_pb2.StatusRequest, context: Context
    ) -> rpc_pb2.StatusResponse:
        size = self.db_size()
        resp = rpc_pb2.StatusResponse(
            version=SERVER_VERSION,
            dbSize=size,
            dbSizeInUse=size,
            leader=self.header.member_id,
            raftIndex=self.last_index(),
            raftTerm=self.header.raft_term,
            raftAppliedIndex=self.state.applied_index,
        )
        self.header.fill(resp.header)
        return resp


class ClusterService(rpc_pb2_grpc.ClusterServicer):
    """Membership of a one-member cluster (the cluster issue adds the rest)."""

    def __init__(self, member: MemberInfo, header: HeaderFiller) -> None:
        self.member = member
        self.header = header

    async def MemberList(
        self, request: rpc_pb2.MemberListRequest, context: Context
    ) -> rpc_pb2.MemberListResponse:
        m = self.member
        resp = rpc_pb2.MemberListResponse()
        resp.members.add(
            ID=m.member_id, name=m.name, peerURLs=m.peer_urls, clientURLs=m.client_urls
        )
        self.header.fill(resp.header)
        return resp
