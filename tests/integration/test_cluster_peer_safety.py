"""What a member does with a snapshot a peer sends it that is not a valid one.

A process that reaches a member's peer port speaks the peer wire
(`etcdserverpb/peer.proto`) as the leader would, and sends a raft snapshot
message whose data is a pickle built to create a directory when unpickled (and
the same pickle in the old `QSNAP1` framing, and plain garbage), each both
streamed as the leader's transport sends snapshots and inside a raft batch. The
member must refuse each with a clear log line, run nothing, keep no file, move
to no new term, and go on serving with the same data as the others.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from etcdserverpb import peer_pb2, rpc_pb2, rpc_pb2_grpc
from queue_server.replication.peer_wire import WIRE_VERSION
from raft import Message, MessageType, Snapshot, SnapshotMeta
from tests.support.cluster import Cluster, Member

pytestmark = pytest.mark.integration

WAIT = 15.0


class MakesADirectory:
    """Unpickling this calls os.mkdir(path): what a hostile peer would send."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("peer-safety")).start()
    yield c
    c.stop()


def frame(f: peer_pb2.PeerFrame) -> bytes:
    body = f.SerializeToString()
    return struct.pack(">I", len(body)) + body


def send_as_leader(
    member: Member, leader_id: int, to_id: int, message: Message, streamed: bool
) -> None:
    """Dial the member's peer port, say Hello as the leader, then send the
    snapshot message as the leader's transport does (`streamed`: the message
    with empty data, then the data in chunks) or inside a raft batch."""
    hello = peer_pb2.Hello(wire_version=WIRE_VERSION, from_member=leader_id, to_member=to_id)
    frames = [peer_pb2.PeerFrame(hello=hello)]
    if streamed:
        assert message.snapshot is not None
        data = message.snapshot.data
        bare = replace(message, snapshot=replace(message.snapshot, data=b""))
        start = peer_pb2.SnapshotStart(message=bare.to_bytes(), size=len(data))
        frames.append(peer_pb2.PeerFrame(snapshot_start=start))
        for at in range(0, len(data), 16):
            chunk = peer_pb2.SnapshotChunk(data=data[at : at + 16])
            frames.append(peer_pb2.PeerFrame(snapshot_chunk=chunk))
    else:
        batch = peer_pb2.RaftBatch(messages=[message.to_bytes()])
        frames.append(peer_pb2.PeerFrame(raft=batch))
    with socket.create_connection(("127.0.0.1", member.peer_port), timeout=5) as s:
        s.sendall(b"".join(frame(f) for f in frames))
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        while s.recv(4096):  # the member closes once it has read everything
            pass


def legacy_framing(payload: bytes, index: int) -> bytes:
    """The pickle as the old snapshot files framed it: magic, index, crc32, length."""
    return b"QSNAP1\n" + struct.pack("<QIQ", index, zlib.crc32(payload), len(payload)) + payload


def wait_for_log(member: Member, text: str, count: int) -> None:
    deadline = time.monotonic() + WAIT
    while member.log_text().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged {count} times by {member}"
        time.sleep(0.05)


def test_a_snapshot_that_is_not_a_valid_one_is_refused_and_nothing_runs(
    cluster: Cluster, tmp_path: Path
) -> None:
    leader = cluster.wait_leader()
    follower = next(m for m in cluster.members if m is not leader)
    status = follower.status()
    follower_id, term = status.header.member_id, status.raftTerm
    leader_id = leader.status().header.member_id
    with grpc.insecure_channel(leader.endpoint) as ch:
        rpc_pb2_grpc.KVStub(ch).Put(rpc_pb2.PutRequest(key=b"/safety/k", value=b"v"), timeout=5)

    marker = tmp_path / "created-by-a-pickle"
    payload = pickle.dumps({"state": MakesADirectory(str(marker))})
    index = status.raftIndex + 1_000_000  # far past anything it has: it would install it
    voters = tuple(m.status().header.member_id for m in cluster.members)
    bodies = [payload, legacy_framing(payload, index), b"QSNAP2\n" + os.urandom(64)]
    refusal = "raft snapshot refused"
    before = follower.log_text().count(refusal)
    sent = 0
    for data in bodies:
        message = Message(
            MessageType.SNAP,
            leader_id,
            follower_id,
            term=term,
            snapshot=Snapshot(SnapshotMeta(index, term, voters), data),
        )
        for streamed in (True, False):
            send_as_leader(follower, leader_id, follower_id, message, streamed)
            sent += 1
            wait_for_log(follower, refusal, before + sent)

    assert not marker.exists(), "the pickle ran"
    logged = follower.log_text()
    assert logged.count("is not a valid snapshot") >= len(bodies)  # the streamed ones
    assert "snapshots come streamed" in logged  # the ones inside a raft batch
    snap_dir = follower.data_dir / "raft" / "snap"
    assert not list(snap_dir.glob("*.tmp")), "a refused snapshot's file was left behind"
    assert "raft installed snapshot" not in logged
    # Still the same member in the same term, serving the same data as the others.
    after = follower.status()
    assert after.raftTerm == term
    assert after.raftIndex < index
    with grpc.insecure_channel(follower.endpoint) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        kv.Put(rpc_pb2.PutRequest(key=b"/safety/k", value=b"after"), timeout=5)
        got = kv.Range(rpc_pb2.RangeRequest(key=b"/safety/k"), timeout=5)
    assert got.kvs[0].value == b"after"
    hashes: set[int] = set()
    deadline = time.monotonic() + WAIT
    while len(hashes) != 1:
        assert time.monotonic() < deadline, f"members differ: {hashes}"
        hashes = set()
        for m in cluster.members:
            with grpc.insecure_channel(m.endpoint) as ch:
                maint = rpc_pb2_grpc.MaintenanceStub(ch)
                hashes.add(maint.HashKV(rpc_pb2.HashKVRequest(), timeout=5).hash)
