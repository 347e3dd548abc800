"""The identity every response header carries: cluster, member, term, revision."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from etcdserverpb import rpc_pb2


@dataclass(slots=True)
class HeaderFiller:
    """etcd's header.fill: ids and term always, the current revision when unset."""

    cluster_id: int
    member_id: int
    raft_term: int
    current_revision: Callable[[], int]

    def fill(self, header: rpc_pb2.ResponseHeader) -> None:
        header.cluster_id = self.cluster_id
        header.member_id = self.member_id
        header.raft_term = self.raft_term
        if not header.revision:
            header.revision = self.current_revision()
