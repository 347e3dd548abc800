"""Disk full: the server's data dir on a small tmpfs the test mounts (we run as
root; the test skips, saying why, where mounting is not permitted). The disk is
filled with a file; then:

- the write that finds no room fails with etcd's NOSPACE error
  (`etcdserver: mvcc: database space exceeded`, RESOURCE_EXHAUSTED) and raises the
  NOSPACE alarm; later writes fail the same way, reads go on;
- after the filler is removed and `etcdctl alarm disarm`, writes work again;
- nothing is corrupted: after a SIGKILL and a restart, every acknowledged write is
  there, and none of the refused ones.

The unit tests (`test_storage.py`) cover the same path with an injected ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.crash]

DISK_BYTES = 4 * 1024 * 1024
"""The tmpfs size: room for the server's files and a few hundred puts."""
VALUE = b"x" * 5000
"""Larger than a page, so a record that does not fit is written in part first."""
NOSPACE_TEXT = "etcdserver: mvcc: database space exceeded"


@contextlib.contextmanager
def small_disk(path: Path) -> Iterator[Path]:
    path.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("cannot mount a tmpfs here (no mount command)")
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode})")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, timeout=30, check=False)


def fill(path: Path) -> int:
    """Write a file until the disk is full; returns its size."""
    written = 0
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while written < 2 * DISK_BYTES:  # bounded even if ENOSPC never came
            try:
                written += f.write(chunk) or 0
            except OSError as e:
                assert e.errno == errno.ENOSPC
                return written
    raise AssertionError("the tmpfs never filled up")


def disarm(endpoint: str) -> None:
    if shutil.which("etcdctl"):
        p = subprocess.run(
            ["etcdctl", f"--endpoints={endpoint}", "alarm", "disarm"],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
        assert p.returncode == 0, p.stderr
        assert "alarm:NOSPACE" in p.stdout
        return
    with grpc.insecure_channel(endpoint) as ch:
        maint = rpc_pb2_grpc.MaintenanceStub(ch)
        for a in maint.Alarm(rpc_pb2.AlarmRequest(), timeout=10).alarms:
            maint.Alarm(
                rpc_pb2.AlarmRequest(
                    action=rpc_pb2.AlarmRequest.DEACTIVATE, memberID=a.memberID, alarm=a.alarm
                ),
                timeout=10,
            )


def test_disk_full_raises_nospace_and_recovers(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        server = ServerProcess(disk / "full.etcd")
        server.log_path = tmp_path / "full.etcd.log"  # the server's log is not on the disk
        server.start()
        acknowledged: dict[bytes, int] = {}
        refused: list[bytes] = []
        try:
            with grpc.insecure_channel(server.endpoint) as ch:
                kv = rpc_pb2_grpc.KVStub(ch)
                maint = rpc_pb2_grpc.MaintenanceStub(ch)
                for i in range(20):
                    key = b"before/%03d" % i
                    acknowledged[key] = kv.Put(
                        rpc_pb2.PutRequest(key=key, value=VALUE), timeout=10
                    ).header.revision
                filler = disk / "filler"
                fill(filler)

                errors = []
                for i in range(50):  # the first write that finds no room, and later ones
                    key = b"full/%03d" % i
                    try:
                        r = kv.Put(rpc_pb2.PutRequest(key=key, value=VALUE), timeout=10)
                        acknowledged[key] = r.header.revision  # a page had room
                    except grpc.RpcError as e:
                        errors.append((e.code(), e.details()))
                        refused.append(key)
                        if len(errors) >= 3:
                            break
                assert errors, "no write was refused on a full disk"
                assert set(errors) == {(grpc.StatusCode.RESOURCE_EXHAUSTED, NOSPACE_TEXT)}
                alarms = maint.Alarm(rpc_pb2.AlarmRequest(), timeout=10).alarms
                assert [a.alarm for a in alarms] == [rpc_pb2.NOSPACE]
                # reads go on
                got = kv.Range(rpc_pb2.RangeRequest(key=b"before/000"), timeout=10)
                assert got.kvs[0].value == VALUE
                assert maint.Status(rpc_pb2.StatusRequest(), timeout=10).errors

                # space back, alarm disarmed: writes work
                filler.unlink()
                disarm(server.endpoint)
                assert not maint.Alarm(rpc_pb2.AlarmRequest(), timeout=10).alarms
                r = kv.Put(rpc_pb2.PutRequest(key=b"after", value=b"ok"), timeout=10)
                acknowledged[b"after"] = r.header.revision

            server.kill()
            server.start()
            with grpc.insecure_channel(server.endpoint) as ch:
                kv = rpc_pb2_grpc.KVStub(ch)
                everything = kv.Range(rpc_pb2.RangeRequest(key=b"\0", range_end=b"\0"), timeout=10)
            found = {k.key: k.mod_revision for k in everything.kvs}
            assert found == acknowledged, f"server log:\n{server.log_text()[-3000:]}"
            assert "wal write refused, disk full" in server.log_text()
            assert "wal torn tail" not in server.log_text()  # the partial write was cut
        finally:
            if server.proc is not None and server.proc.poll() is None:
                server.stop()
