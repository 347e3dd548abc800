"""Who is in the cluster: the member list, and adding, removing and updating members.

What belongs here: the members as clients see them (`MemberList`), built from
what members published through the log (`MemberAttributes`: name, peer and
client URLs) and, for members that have not published yet, from their peer URLs;
and the changes, which are Raft membership changes (`ConfChange` entries, one
voter at a time) carrying the new member's peer URLs as context. Every member
applies the same entries, so each updates its member table and its peer channels
at the same point of the log.

A member that applies its own removal stops serving, as etcd's does.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from etcdserverpb import internal_pb2
from queue_server.apply import StateMachine
from queue_server.errors import (
    EtcdError,
    LearnerNotSupported,
    MemberNotFound,
    NotClustered,
    PeerURLExists,
)
from queue_server.replication.driver import ClusterLog
from queue_server.replication.peers import Peers
from raft.messages import ConfChange, ConfChangeOp

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """How a member describes itself to clients."""

    member_id: int
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]


def member_id_for(peer_urls: tuple[str, ...], cluster_token: str) -> int:
    """A member id derived the way etcd derives one: from its peer URLs and the
    cluster token, so it is stable across restarts."""
    digest = hashlib.sha1(("".join(sorted(peer_urls)) + cluster_token).encode()).digest()
    return int.from_bytes(digest[:8], "big")


class Membership:
    """The member table of this member's view of the cluster."""

    def __init__(
        self,
        state: StateMachine,
        me: MemberInfo,
        cluster_token: str,
        founders: dict[int, tuple[str, ...]],
        log: ClusterLog | None = None,
        peers: Peers | None = None,
        on_removed: Callable[[], None] | None = None,
    ) -> None:
        self.state = state
        self.me = me
        self.cluster_token = cluster_token
        self.founders = founders
        self.log = log
        self.peers = peers
        self.on_removed = on_removed
        if log is not None:
            log.on_conf_change = self._applied

    # -- reading ------------------------------------------------------------------

    def members(self) -> list[MemberInfo]:
        """Every voter: as it published itself, else by its peer URLs."""
        out: dict[int, MemberInfo] = {
            mid: MemberInfo(mid, "", urls, ()) for mid, urls in self.founders.items()
        }
        for mid, (name, peer_urls, client_urls) in self.state.members.items():
            out[mid] = MemberInfo(mid, name, peer_urls, client_urls)
        if self.me.member_id not in self.state.members:
            out[self.me.member_id] = self.me
        if self.log is not None and self.log.voters:
            voters = self.log.voters
            out = {k: v for k, v in out.items() if k in voters}
        return sorted(out.values(), key=lambda m: m.member_id)

    def leader_id(self) -> int:
        return self.log.leader_id if self.log is not None else self.me.member_id

    # -- changing -----------------------------------------------------------------

    async def add(self, peer_urls: tuple[str, ...], learner: bool) -> MemberInfo:
        if self.log is None:
            raise NotClustered()
        if learner:
            raise LearnerNotSupported()
        for m in self.members():
            if set(m.peer_urls) & set(peer_urls):
                raise PeerURLExists()
        member_id = member_id_for(peer_urls, self.cluster_token)
        context = json.dumps({"peer_urls": list(peer_urls)}).encode()
        await self.log.change_membership(ConfChangeOp.ADD, member_id, context)
        return MemberInfo(member_id, "", peer_urls, ())

    async def remove(self, member_id: int) -> None:
        if self.log is None:
            raise NotClustered()
        if member_id not in {m.member_id for m in self.members()}:
            raise MemberNotFound()
        await self.log.change_membership(ConfChangeOp.REMOVE, member_id, b"")

    async def update(self, member_id: int, peer_urls: tuple[str, ...]) -> None:
        if self.log is None:
            raise NotClustered()
        current = {m.member_id: m for m in self.members()}.get(member_id)
        if current is None:
            raise MemberNotFound()
        for m in self.members():
            if m.member_id != member_id and set(m.peer_urls) & set(peer_urls):
                raise PeerURLExists()
        command = internal_pb2.Command()
        attrs = command.member_attributes
        attrs.id, attrs.name = member_id, current.name
        attrs.peer_urls.extend(peer_urls)
        attrs.client_urls.extend(current.client_urls)
        result = await self.log.propose(command)
        if isinstance(result, EtcdError):
            raise result
        if self.peers is not None and member_id != self.me.member_id:
            self.peers.set_peer(member_id, peer_urls[0])

    # -- applying -----------------------------------------------------------------

    def _applied(self, change: ConfChange) -> None:
        """A membership change reached this member's state machine (which
        changed its member table in apply): the peer side follows."""
        if change.op is ConfChangeOp.ADD:
            urls = tuple(json.loads(change.context or b"{}").get("peer_urls", ()))
            if self.peers is not None and urls and change.node_id != self.me.member_id:
                self.peers.set_peer(change.node_id, urls[0])
            log.info("member added member=%x peer_urls=%s", change.node_id, ",".join(urls))
        elif change.op is ConfChangeOp.REMOVE:
            self.founders.pop(change.node_id, None)
            if self.peers is not None:
                self.peers.remove_peer(change.node_id)
            log.info("member removed member=%x", change.node_id)
            if change.node_id == self.me.member_id and self.on_removed is not None:
                self.on_removed()
