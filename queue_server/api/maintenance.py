"""The etcdserverpb.Maintenance service and etcdserverpb.Cluster (MemberList).

Maintenance: Status, Alarm (GET is a local read; ACTIVATE/DEACTIVATE go through
the log), Defragment (the backend file rewritten without free pages, or on a
cluster member a snapshot that trims the log), Hash/HashKV (a checksum of the
kept history), Snapshot (an etcd backend database of our state, which `etcdctl
snapshot restore` and `queue-server restore` turn into a data dir). The last
three go through `StateFiles`: on one node the local log does them on a thread
from a backend read transaction, so the loop serves meanwhile.
MoveLeader and Downgrade answer UNIMPLEMENTED until there is a cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import IO, Protocol, TypeVar

from etcdserverpb import internal_pb2, rpc_pb2, rpc_pb2_grpc
from queue_server.alarms import alarm_name
from queue_server.api.errors import abort
from queue_server.api.header import HeaderFiller
from queue_server.apply import Proposer, StateMachine
from queue_server.config import SERVER_VERSION
from queue_server.errors import EtcdError
from queue_server.replication.membership import Membership
from queue_server.storage.snapshot import SHA256_BYTES
from queue_server.transport.methods import Call


class StateFiles(Protocol):
    """Who makes the whole-state operations of this member: its log (the local
    log or the cluster log, each over the state machine's backend)."""

    async def defragment(self) -> None: ...

    async def hash_kv(self, revision: int) -> int:
        """The store's checksum at `revision` (checked already; 0: now)."""
        ...

    async def export_etcd_db(self, fileobj: IO[bytes]) -> int:
        """The state as an etcd backend database into `fileobj`; its size."""
        ...


_MembersResponse = TypeVar(
    "_MembersResponse",
    rpc_pb2.MemberListResponse,
    rpc_pb2.MemberAddResponse,
    rpc_pb2.MemberRemoveResponse,
    rpc_pb2.MemberUpdateResponse,
)


SNAPSHOT_CHUNK_BYTES = 64 * 1024
"""Bytes per Snapshot stream message (etcd sends 32 KiB; larger chunks cost fewer
messages and stay far below any client's receive limit)."""


class MaintenanceService(rpc_pb2_grpc.MaintenanceServicer):
    """Status, alarms, hashes, snapshots and defragmentation of this member."""

    def __init__(
        self,
        state: StateMachine,
        log: Proposer,
        header: HeaderFiller,
        db_size: Callable[[], int],
        files: StateFiles,
        leader_of: Callable[[], int] | None = None,
    ) -> None:
        self.state = state
        self.log = log
        self.header = header
        self.db_size = db_size
        self.files = files
        self.leader_of = leader_of

    async def Status(self, request: rpc_pb2.StatusRequest, context: Call) -> rpc_pb2.StatusResponse:
        resp = rpc_pb2.StatusResponse(
            version=SERVER_VERSION,
            dbSize=self.db_size(),
            dbSizeInUse=self.state.store.size_bytes,
            leader=self.leader_of() if self.leader_of is not None else self.header.member_id,
            raftIndex=self.log.last_index,
            raftTerm=self.header.raft_term,
            raftAppliedIndex=self.state.applied_index,
        )
        for member_id, alarm in self.state.alarms.get():
            # Go's text form of an AlarmMember, as etcd lists alarms in Status.errors
            name = alarm_name(alarm)
            resp.errors.append(f"memberID:{member_id} alarm:{name} ")
        self.header.fill(resp.header)
        return resp

    async def Alarm(self, request: rpc_pb2.AlarmRequest, context: Call) -> rpc_pb2.AlarmResponse:
        if request.action == rpc_pb2.AlarmRequest.GET:
            resp = self.state.alarms.apply(request)
        else:
            result = await self.log.propose(internal_pb2.Command(alarm=request))
            if isinstance(result, EtcdError):
                await abort(context, result)
            assert isinstance(result, rpc_pb2.AlarmResponse)
            resp = result
        self.header.fill(resp.header)
        return resp

    async def Defragment(
        self, request: rpc_pb2.DefragmentRequest, context: Call
    ) -> rpc_pb2.DefragmentResponse:
        await self.files.defragment()
        resp = rpc_pb2.DefragmentResponse()
        self.header.fill(resp.header)
        return resp

    async def Hash(self, request: rpc_pb2.HashRequest, context: Call) -> rpc_pb2.HashResponse:
        resp = rpc_pb2.HashResponse(hash=await self.files.hash_kv(0))
        self.header.fill(resp.header)
        return resp

    async def HashKV(self, request: rpc_pb2.HashKVRequest, context: Call) -> rpc_pb2.HashKVResponse:
        store = self.state.store
        try:
            store.check_revision(request.revision)
            value = await self.files.hash_kv(request.revision)
        except EtcdError as e:
            await abort(context, e)
        resp = rpc_pb2.HashKVResponse(hash=value, compact_revision=store.compact_revision)
        self.header.fill(resp.header)
        return resp

    async def Snapshot(
        self, request: rpc_pb2.SnapshotRequest, context: Call
    ) -> AsyncIterator[rpc_pb2.SnapshotResponse]:
        """The whole state as an etcd backend database (bbolt, with our queue
        state in a bucket of its own; `storage/etcd_backend.py`), streamed in
        chunks and followed by the sha256 of its bytes, as etcd streams its db:
        `etcdctl snapshot status/restore` read it, and so does `queue-server
        restore`. It is built in a temporary file, so memory holds the exported
        state and one chunk, not the database."""
        with tempfile.TemporaryFile() as db:
            total = await self.files.export_etcd_db(db) + SHA256_BYTES
            loop = asyncio.get_running_loop()
            db.seek(0)
            digest = hashlib.sha256()
            sent = 0
            while sent < total:
                chunk = await loop.run_in_executor(None, db.read, SNAPSHOT_CHUNK_BYTES)
                digest.update(chunk)
                if sent + len(chunk) == total - SHA256_BYTES:
                    chunk += digest.digest()
                sent += len(chunk)
                resp = rpc_pb2.SnapshotResponse(remaining_bytes=total - sent, blob=chunk)
                self.header.fill(resp.header)
                yield resp


class ClusterService(rpc_pb2_grpc.ClusterServicer):
    """Membership: list, add, remove, update (`queue_server/replication/membership.py`)."""

    def __init__(self, membership: Membership, header: HeaderFiller) -> None:
        self.membership = membership
        self.header = header

    def _answer(self, resp: _MembersResponse) -> _MembersResponse:
        """Every member in the response, and the header."""
        for m in self.membership.members():
            resp.members.add(
                ID=m.member_id, name=m.name, peerURLs=m.peer_urls, clientURLs=m.client_urls
            )
        self.header.fill(resp.header)
        return resp

    async def MemberList(
        self, request: rpc_pb2.MemberListRequest, context: Call
    ) -> rpc_pb2.MemberListResponse:
        return self._answer(rpc_pb2.MemberListResponse())

    async def MemberAdd(
        self, request: rpc_pb2.MemberAddRequest, context: Call
    ) -> rpc_pb2.MemberAddResponse:
        try:
            added = await self.membership.add(tuple(request.peerURLs), request.isLearner)
        except EtcdError as e:
            await abort(context, e)
        resp = rpc_pb2.MemberAddResponse()
        resp.member.ID = added.member_id
        resp.member.peerURLs.extend(added.peer_urls)
        return self._answer(resp)

    async def MemberRemove(
        self, request: rpc_pb2.MemberRemoveRequest, context: Call
    ) -> rpc_pb2.MemberRemoveResponse:
        try:
            await self.membership.remove(request.ID)
        except EtcdError as e:
            await abort(context, e)
        return self._answer(rpc_pb2.MemberRemoveResponse())

    async def MemberUpdate(
        self, request: rpc_pb2.MemberUpdateRequest, context: Call
    ) -> rpc_pb2.MemberUpdateResponse:
        try:
            await self.membership.update(request.ID, tuple(request.peerURLs))
        except EtcdError as e:
            await abort(context, e)
        return self._answer(rpc_pb2.MemberUpdateResponse())
