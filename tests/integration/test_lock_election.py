"""v3lock and v3election services through our generated stubs, against a real server."""

from __future__ import annotations

import threading

import grpc
import pytest

from etcdserverpb import (
    rpc_pb2,
    rpc_pb2_grpc,
    v3election_pb2,
    v3election_pb2_grpc,
    v3lock_pb2,
    v3lock_pb2_grpc,
)

pytestmark = pytest.mark.integration


def grant(channel: grpc.Channel, ttl: int = 30) -> int:
    return int(
        rpc_pb2_grpc.LeaseStub(channel)
        .LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=ttl), timeout=10)
        .ID
    )


def test_lock_is_exclusive_and_handed_over_on_unlock(channel: grpc.Channel) -> None:
    lock = v3lock_pb2_grpc.LockStub(channel)
    l1, l2 = grant(channel), grant(channel)
    first = lock.Lock(v3lock_pb2.LockRequest(name=b"mtx", lease=l1), timeout=10)
    assert first.key == b"mtx/%x" % l1
    got: list[v3lock_pb2.LockResponse] = []
    waiter = threading.Thread(
        target=lambda: got.append(
            lock.Lock(v3lock_pb2.LockRequest(name=b"mtx", lease=l2), timeout=20)
        )
    )
    waiter.start()
    # the second Lock cannot finish while the first is held
    waiter.join(timeout=1.0)
    assert waiter.is_alive() and not got
    lock.Unlock(v3lock_pb2.UnlockRequest(key=first.key), timeout=10)
    waiter.join(timeout=15)
    assert got and got[0].key == b"mtx/%x" % l2
    assert got[0].header.revision > first.header.revision


def test_lock_is_released_when_the_holders_lease_is_revoked(channel: grpc.Channel) -> None:
    lock = v3lock_pb2_grpc.LockStub(channel)
    lease = rpc_pb2_grpc.LeaseStub(channel)
    l1, l2 = grant(channel), grant(channel)
    lock.Lock(v3lock_pb2.LockRequest(name=b"mtx2", lease=l1), timeout=10)
    future = lock.Lock.future(v3lock_pb2.LockRequest(name=b"mtx2", lease=l2), timeout=20)
    lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=l1), timeout=10)
    assert future.result(timeout=15).key == b"mtx2/%x" % l2


def test_lock_with_unknown_lease_fails_like_etcd(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as err:
        v3lock_pb2_grpc.LockStub(channel).Lock(
            v3lock_pb2.LockRequest(name=b"x", lease=424242), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == "etcdserver: requested lease not found"


def test_election_campaign_leader_proclaim_observe_resign(channel: grpc.Channel) -> None:
    el = v3election_pb2_grpc.ElectionStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        el.Leader(v3election_pb2.LeaderRequest(name=b"el"), timeout=10)
    assert err.value.details() == "election: no leader"

    l1, l2 = grant(channel), grant(channel)
    won = el.Campaign(v3election_pb2.CampaignRequest(name=b"el", lease=l1, value=b"a"), timeout=10)
    assert won.leader.key == b"el/%x" % l1 and won.leader.lease == l1
    observed = el.Observe(v3election_pb2.LeaderRequest(name=b"el"), timeout=20)
    assert next(observed).kv.value == b"a"

    second = el.Campaign.future(
        v3election_pb2.CampaignRequest(name=b"el", lease=l2, value=b"b"), timeout=20
    )
    el.Proclaim(v3election_pb2.ProclaimRequest(leader=won.leader, value=b"a2"), timeout=10)
    assert next(observed).kv.value == b"a2"
    assert el.Leader(v3election_pb2.LeaderRequest(name=b"el"), timeout=10).kv.value == b"a2"

    el.Resign(v3election_pb2.ResignRequest(leader=won.leader), timeout=10)
    new = second.result(timeout=15)
    assert new.leader.key == b"el/%x" % l2
    assert next(observed).kv.value == b"b"
    observed.cancel()

    with pytest.raises(grpc.RpcError) as err:
        el.Proclaim(v3election_pb2.ProclaimRequest(leader=won.leader, value=b"late"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == "election: not leader"
