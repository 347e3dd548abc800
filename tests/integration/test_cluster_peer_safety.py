"""What a member does with a snapshot a peer sends it that is not a valid one.

A process that reaches a member's peer port speaks the peer wire
(`etcdserverpb/peer.proto`) as the leader would, and sends a raft snapshot
message whose data is a pickle built to create a directory when unpickled (and
the same pickle in the old `QSNAP1` framing, and plain garbage). The member must
refuse each with a clear log line, run nothing, move to no new term, and go on
serving with the same data as the others.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time
import zlib
from collections.abc import Iterator
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


def send_as_leader(member: Member, leader_id: int, to_id: int, message: Message) -> None:
    """Dial the member's peer port, say Hello as the leader, send one raft batch."""
    hello = peer_pb2.Hello(wire_version=WIRE_VERSION, from_member=leader_id, to_member=to_id)
    batch = peer_pb2.RaftBatch(messages=[message.to_bytes()])
    with socket.create_connection(("127.0.0.1", member.peer_port), timeout=5) as s:
        s.sendall(frame(peer_pb2.PeerFrame(hello=hello)) + frame(peer_pb2.PeerFrame(raft=batch)))
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
    for n, data in enumerate(bodies, start=1):
        message = Message(
            MessageType.SNAP,
            leader_id,
            follower_id,
            term=term,
            snapshot=Snapshot(SnapshotMeta(index, term, voters), data),
        )
        send_as_leader(follower, leader_id, follower_id, message)
        wait_for_log(follower, refusal, before + n)

    assert not marker.exists(), "the pickle ran"
    logged = follower.log_text()
    assert "is not a valid snapshot" in logged
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
    hashes = set()
    deadline = time.monotonic() + WAIT
    while len(hashes) != 1:
        assert time.monotonic() < deadline, f"members differ: {hashes}"
        hashes = set()
        for m in cluster.members:
            with grpc.insecure_channel(m.endpoint) as ch:
                maint = rpc_pb2_grpc.MaintenanceStub(ch)
                hashes.add(maint.HashKV(rpc_pb2.HashKVRequest(), timeout=5).hash)
