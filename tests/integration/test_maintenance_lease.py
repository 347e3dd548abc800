"""Maintenance (alarms and the quota, defragment, hashes, snapshot and restore)
and lease durability, through our stubs against real server processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.integration


def rpc_error(fn: object, *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, timeout=10)  # type: ignore[operator]
    return err.value


def test_quota_raises_nospace_alarm_and_disarm_restores_writes(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "q.etcd", extra_args=["--quota-backend-bytes", "20000"]).start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            kv, mt = rpc_pb2_grpc.KVStub(ch), rpc_pb2_grpc.MaintenanceStub(ch)
            lease = rpc_pb2_grpc.LeaseStub(ch)
            written = 0
            while True:
                try:
                    kv.Put(rpc_pb2.PutRequest(key=b"k%d" % written, value=b"x" * 500), timeout=10)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert e.details() == "etcdserver: mvcc: database space exceeded"
                    break
                written += 1
                assert written < 100, "the quota never triggered"
            alarms = mt.Alarm(
                rpc_pb2.AlarmRequest(action=rpc_pb2.AlarmRequest.GET), timeout=10
            ).alarms
            assert [a.alarm for a in alarms] == [rpc_pb2.NOSPACE]
            status = mt.Status(rpc_pb2.StatusRequest(), timeout=10)
            assert status.errors and "alarm:NOSPACE" in status.errors[0]
            # capped: small writes and lease grants fail too; reads and deletes work
            err = rpc_error(kv.Put, rpc_pb2.PutRequest(key=b"tiny", value=b"1"))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            err = rpc_error(lease.LeaseGrant, rpc_pb2.LeaseGrantRequest(TTL=60))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert kv.Range(rpc_pb2.RangeRequest(key=b"k0"), timeout=10).count == 1
            rev = kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"k", range_end=b"l"), timeout=10)
            kv.Compact(rpc_pb2.CompactionRequest(revision=rev.header.revision), timeout=10)
            mt.Defragment(rpc_pb2.DefragmentRequest(), timeout=30)
            for a in alarms:
                mt.Alarm(
                    rpc_pb2.AlarmRequest(
                        action=rpc_pb2.AlarmRequest.DEACTIVATE, memberID=a.memberID, alarm=a.alarm
                    ),
                    timeout=10,
                )
            assert not mt.Alarm(rpc_pb2.AlarmRequest(), timeout=10).alarms
            kv.Put(rpc_pb2.PutRequest(key=b"after", value=b"ok"), timeout=10)
    finally:
        srv.stop()


def test_alarm_survives_restart(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "a.etcd").start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            mt = rpc_pb2_grpc.MaintenanceStub(ch)
            member = mt.Status(rpc_pb2.StatusRequest(), timeout=10).header.member_id
            activate = rpc_pb2.AlarmRequest(
                action=rpc_pb2.AlarmRequest.ACTIVATE, memberID=member, alarm=rpc_pb2.NOSPACE
            )
            assert len(mt.Alarm(activate, timeout=10).alarms) == 1
        srv.stop()
        srv.start()
        with grpc.insecure_channel(srv.endpoint) as ch:
            err = rpc_error(rpc_pb2_grpc.KVStub(ch).Put, rpc_pb2.PutRequest(key=b"k", value=b"v"))
            assert err.details() == "etcdserver: mvcc: database space exceeded"
    finally:
        srv.stop()


def test_hashkv_is_stable_and_tracks_changes(channel: grpc.Channel) -> None:
    kv, mt = rpc_pb2_grpc.KVStub(channel), rpc_pb2_grpc.MaintenanceStub(channel)
    rev = kv.Put(rpc_pb2.PutRequest(key=b"h", value=b"1"), timeout=10).header.revision
    h1 = mt.HashKV(rpc_pb2.HashKVRequest(revision=rev), timeout=10).hash
    kv.Put(rpc_pb2.PutRequest(key=b"h", value=b"2"), timeout=10)
    assert mt.HashKV(rpc_pb2.HashKVRequest(revision=rev), timeout=10).hash == h1
    assert mt.HashKV(rpc_pb2.HashKVRequest(revision=0), timeout=10).hash != h1
    err = rpc_error(mt.HashKV, rpc_pb2.HashKVRequest(revision=rev + 1000))
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE


def test_snapshot_restores_into_a_new_data_dir(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "src.etcd").start()
    snap = tmp_path / "backup.db"
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            kv, mt = rpc_pb2_grpc.KVStub(ch), rpc_pb2_grpc.MaintenanceStub(ch)
            lease = rpc_pb2_grpc.LeaseStub(ch).LeaseGrant(
                rpc_pb2.LeaseGrantRequest(TTL=300), timeout=10
            )
            for i in range(200):
                kv.Put(rpc_pb2.PutRequest(key=b"s%03d" % i, value=b"v%d" % i), timeout=10)
            kv.Put(rpc_pb2.PutRequest(key=b"leased", value=b"x", lease=lease.ID), timeout=10)
            expected = kv.Range(rpc_pb2.RangeRequest(key=b"\x00", range_end=b"\x00"), timeout=10)
            with open(snap, "wb") as f:
                for chunk in mt.Snapshot(rpc_pb2.SnapshotRequest(), timeout=30):
                    f.write(chunk.blob)
    finally:
        srv.stop()
    size = snap.stat().st_size
    assert size % 512 == 32  # etcd's clients look for the sha256 there
    restored = tmp_path / "restored.etcd"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "queue_server.cli",
            "restore",
            str(snap),
            "--data-dir",
            str(restored),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert r.returncode == 0, r.stderr
    # a damaged copy is refused
    bad = tmp_path / "bad.db"
    data = bytearray(snap.read_bytes())
    data[100] ^= 0xFF
    bad.write_bytes(bytes(data))
    r2 = subprocess.run(
        [
            sys.executable,
            "-m",
            "queue_server.cli",
            "restore",
            str(bad),
            "--data-dir",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert r2.returncode == 1 and "sha256" in r2.stderr
    new = ServerProcess(restored).start()
    try:
        with grpc.insecure_channel(new.endpoint) as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            got = kv.Range(rpc_pb2.RangeRequest(key=b"\x00", range_end=b"\x00"), timeout=10)
            assert list(got.kvs) == list(expected.kvs)
            assert got.header.revision == expected.header.revision
            ttl = rpc_pb2_grpc.LeaseStub(ch).LeaseTimeToLive(
                rpc_pb2.LeaseTimeToLiveRequest(ID=lease.ID, keys=True), timeout=10
            )
            assert ttl.grantedTTL == 300 and list(ttl.keys) == [b"leased"]
    finally:
        new.stop()


def test_lease_survives_restart_with_refreshed_ttl_and_then_expires(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "l.etcd").start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            lease = rpc_pb2_grpc.LeaseStub(ch).LeaseGrant(
                rpc_pb2.LeaseGrantRequest(TTL=3), timeout=10
            )
            rpc_pb2_grpc.KVStub(ch).Put(
                rpc_pb2.PutRequest(key=b"eph", value=b"1", lease=lease.ID), timeout=10
            )
        srv.kill()
        srv.start()
        started = time.monotonic()
        with grpc.insecure_channel(srv.endpoint) as ch:
            leases = rpc_pb2_grpc.LeaseStub(ch)
            kv = rpc_pb2_grpc.KVStub(ch)
            ttl = leases.LeaseTimeToLive(
                rpc_pb2.LeaseTimeToLiveRequest(ID=lease.ID, keys=True), timeout=10
            )
            assert ttl.grantedTTL == 3 and ttl.TTL >= 1 and list(ttl.keys) == [b"eph"]
            # expiry is applied through the log: poll (bounded) until the key is gone
            deadline = started + 15
            while kv.Range(rpc_pb2.RangeRequest(key=b"eph"), timeout=10).count:
                assert time.monotonic() < deadline, "lease did not expire"
                time.sleep(0.1)
            assert time.monotonic() - started >= 2.0  # not before a full TTL after restart
            gone = leases.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=lease.ID), timeout=10)
            assert gone.TTL == -1
    finally:
        srv.stop()


def test_keepalive_stream_keeps_a_lease_past_its_ttl(channel: grpc.Channel) -> None:
    leases = rpc_pb2_grpc.LeaseStub(channel)
    kv = rpc_pb2_grpc.KVStub(channel)
    lease = leases.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=2), timeout=10)
    kv.Put(rpc_pb2.PutRequest(key=b"kept", value=b"1", lease=lease.ID), timeout=10)
    end = time.monotonic() + 4.5

    def pings() -> object:
        while time.monotonic() < end:
            yield rpc_pb2.LeaseKeepAliveRequest(ID=lease.ID)
            time.sleep(0.5)  # the keepalive cadence itself, not synchronisation

    answers = list(leases.LeaseKeepAlive(pings(), timeout=20))
    assert answers and all(a.ID == lease.ID and a.TTL == 2 for a in answers)
    assert kv.Range(rpc_pb2.RangeRequest(key=b"kept"), timeout=10).count == 1
    unknown = list(leases.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=99)]), timeout=10))
    assert [(a.ID, a.TTL) for a in unknown] == [(99, 0)]
