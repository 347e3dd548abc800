"""A front's unary calls go to the backend's leader, and follow it
(`queue_server/front/leader.py`), over a real 3-member etcd.

Where a call went is read from etcd itself: each member's `/metrics` counts
the Puts it handled (`grpc_server_handled_total`). A front is given a follower
first, so that without the leader preference its calls would stay there.
Every wait is bounded.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import EtcdCluster, FrontProcess, until_answered

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="needs Debian's etcd-server"),
]

WAIT = 10.0
FOLLOW_BOUND = 5.0
"""The front moves to a new leader within a poll or two (1 s each, and 1 s of
Status timeout for a member that stopped answering) of its election (0.5 s
here): 5 s bounds it with room, and is under half the 10-20 s the keepalive
needs to leave a stopped member, which was the only way out before."""
PUT_COUNT = re.compile(
    rb'^grpc_server_handled_total\{grpc_code="OK",grpc_method="Put",'
    rb'grpc_service="etcdserverpb.KV",grpc_type="unary"\} (\d+)',
    re.M,
)


@pytest.fixture()
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    etcd = EtcdCluster(tmp_path_factory.mktemp("etcd3")).start()
    yield etcd
    etcd.stop()


def puts_handled(cluster: EtcdCluster, i: int) -> int:
    """The Puts member `i` has answered OK, from its own metrics."""
    url = f"http://{cluster.members[i].endpoint}/metrics"
    with urllib.request.urlopen(url, timeout=WAIT) as r:
        found = PUT_COUNT.search(r.read())
    return int(found.group(1)) if found else 0


def front_with_a_follower_first(
    cluster: EtcdCluster, tmp_path_factory: pytest.TempPathFactory
) -> tuple[FrontProcess, int]:
    """A front over every member, the leader named last; and the leader's index."""
    leader = cluster.leader()
    order = sorted(range(3), key=lambda i: i == leader)  # the leader last
    endpoints = [cluster.members[i].endpoint for i in order]
    front = FrontProcess(tmp_path_factory.mktemp("front") / "front.etcd", endpoints).start()
    return front, leader


def put_through(stub: rpc_pb2_grpc.KVStub, key: bytes, timeout: float = WAIT) -> None:
    stub.Put(rpc_pb2.PutRequest(key=key, value=b"v"), timeout=timeout)


def wait_until_puts_land_on(
    cluster: EtcdCluster, stub: rpc_pb2_grpc.KVStub, member: int, bound: float
) -> float:
    """Put through the front until a batch of 10 is answered by `member` alone;
    the seconds it took (bounded by `bound`)."""
    start = time.monotonic()
    while True:
        before = puts_handled(cluster, member)
        for n in range(10):
            try:
                put_through(stub, b"/leader/%d" % n, timeout=2.0)
            except grpc.RpcError as e:
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        if puts_handled(cluster, member) - before == 10:
            return time.monotonic() - start
        took = time.monotonic() - start
        assert took < bound, f"puts not on member {member} after {took:.1f}s"


def test_a_fronts_puts_go_to_the_leader_though_a_follower_is_named_first(
    cluster: EtcdCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    front, leader = front_with_a_follower_first(cluster, tmp_path_factory)
    try:
        with grpc.insecure_channel(front.endpoint) as channel:
            stub = rpc_pb2_grpc.KVStub(channel)
            wait_until_puts_land_on(cluster, stub, leader, WAIT)
            followers = [i for i in range(3) if i != leader]
            before = [puts_handled(cluster, i) for i in followers]
            for n in range(50):
                put_through(stub, b"/leader/steady/%d" % n)
            assert [puts_handled(cluster, i) for i in followers] == before
    finally:
        front.stop()


def test_a_front_follows_the_leadership_to_another_member_without_failing_a_call(
    cluster: EtcdCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """etcdctl move-leader hands the leadership over; the front's connections
    to the old leader are retired once their calls end, so no call fails for
    the move itself (a proposal etcd was handling as leadership moved may be
    refused by etcd, as it would be straight: 'leader changed')."""
    front, leader = front_with_a_follower_first(cluster, tmp_path_factory)
    try:
        with grpc.insecure_channel(front.endpoint) as channel:
            stub = rpc_pb2_grpc.KVStub(channel)
            wait_until_puts_land_on(cluster, stub, leader, WAIT)
            target = (leader + 1) % 3
            member_id = cluster_member_id(cluster, target)
            subprocess.run(
                [
                    *("etcdctl", "--endpoints", cluster.members[leader].endpoint),
                    *("move-leader", f"{member_id:x}"),
                ],
                check=True,
                capture_output=True,
                timeout=WAIT,
                env={**os.environ, "ETCDCTL_API": "3"},
            )
            assert cluster.leader() == target
            wait_until_puts_land_on(cluster, stub, target, FOLLOW_BOUND)
    finally:
        front.stop()


def test_a_front_leaves_a_leader_that_stops_answering_within_seconds(
    cluster: EtcdCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGSTOP on the leader (as a cut network looks): the other two elect a
    new one, the front's poll hears it from them on connections of their own,
    and its calls move there, well before the keepalive would give up."""
    front, leader = front_with_a_follower_first(cluster, tmp_path_factory)
    proc = cluster.members[leader].proc
    assert proc is not None
    try:
        with grpc.insecure_channel(front.endpoint) as channel:
            stub = rpc_pb2_grpc.KVStub(channel)
            wait_until_puts_land_on(cluster, stub, leader, WAIT)
            os.kill(proc.pid, signal.SIGSTOP)
            until_answered(
                lambda: put_through(stub, b"/leader/after-stop", timeout=1.0),
                FOLLOW_BOUND,
                "a put after the leader stopped",
            )
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        front.stop()


def cluster_member_id(cluster: EtcdCluster, i: int) -> int:
    with grpc.insecure_channel(cluster.members[i].endpoint) as ch:
        status = rpc_pb2_grpc.MaintenanceStub(ch).Status(rpc_pb2.StatusRequest(), timeout=WAIT)
    return int(status.header.member_id)
