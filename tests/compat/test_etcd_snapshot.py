"""Snapshots between us and a real etcd (3.4.23), both ways: our
`etcdctl snapshot save` file is one etcd's `snapshot status` reads and
`snapshot restore` makes a data dir of, on which etcd serves our keys; a real
etcd's snapshot is one `queue-server restore` makes a data dir of, on which we
serve etcd's keys. The same history runs on both sides: puts, a multi-key txn
(sub revisions), a delete (a tombstone), a lease, a compaction, a value large
enough for overflow pages and enough keys for branch pages."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from queue_server.storage.bbolt import BoltReader
from tests.compat.test_etcdctl import Ctl
from tests.compat.test_etcdctl import pytestmark as etcdctl_marks
from tests.support.processes import EtcdProcess, ServerProcess

pytestmark = etcdctl_marks

REPO_ROOT = Path(__file__).resolve().parents[2]
TXN_KEYS = 100
"""Keys put by each of the history's two txns (etcd's --max-txn-ops is 128)."""


def history(ctl: Ctl) -> dict[str, Any]:
    """Run the history; returns what the test checks afterwards."""
    ctl.ok("put", "a", "1")
    ctl.ok("put", "b", "2")
    ctl.ok("put", "a", "3")
    compact_at = ctl.revision()
    lease_id = ctl.ok("lease", "grant", "600").split()[1]
    ctl.ok("put", f"--lease={lease_id}", "leased", "v")
    ctl.ok("del", "b")
    ctl.ok("put", "a", "4")
    ctl.ok("compact", str(compact_at))
    ctl.ok("put", "big", "x" * 10_000)
    for t in range(2):
        ops = "".join(f"put k{t}-{i:03d} value-{i}\n" for i in range(TXN_KEYS))
        ctl.ok("txn", stdin=f"\n{ops}\n\n")
    return {"compact_at": compact_at, "lease": int(lease_id, 16)}


def everything(ctl: Ctl, *flags: str) -> dict[str, Any]:
    doc = ctl.json("get", "", "--prefix", *flags)
    assert isinstance(doc, dict)
    return doc


def same_data(a: Ctl, b: Ctl, facts: dict[str, Any]) -> None:
    """Both serve the same keys, revisions, versions, leases and history."""
    got_a, got_b = everything(a), everything(b)
    assert got_a["kvs"] == got_b["kvs"]
    assert got_a["header"]["revision"] == got_b["header"]["revision"]
    assert len(got_a["kvs"]) == 2 * TXN_KEYS + 3  # a, big, leased (b is deleted)
    # the history after the compaction point is kept: a as of the compaction
    rev = str(facts["compact_at"])
    assert everything(a, "--rev", rev)["kvs"] == everything(b, "--rev", rev)["kvs"]
    for ctl in (a, b):
        assert "compacted" in ctl.error("get", "a", "--rev", str(facts["compact_at"] - 1))
        ttl = ctl.json("lease", "timetolive", f"{facts['lease']:x}", "--keys")
        assert ttl["granted-ttl"] == 600 and 0 < ttl["ttl"] <= 600
        assert ttl["keys"] == ["bGVhc2Vk"]  # "leased"


def status(ctl: Ctl, path: Path) -> dict[str, Any]:
    st = ctl.json("snapshot", "status", str(path))
    assert isinstance(st, dict)
    assert st["totalSize"] == path.stat().st_size - 32  # the db, then its sha256
    return st


@pytest.fixture
def ours(tmp_path: Path) -> Iterator[Ctl]:
    srv = ServerProcess(tmp_path / "ours.etcd").start()
    try:
        yield Ctl(srv.endpoint, "queue-server")
    finally:
        srv.stop()


@pytest.fixture
def real_etcd(tmp_path: Path) -> Iterator[Ctl]:
    proc = EtcdProcess(tmp_path / "real.etcd").start()
    try:
        yield Ctl(proc.endpoint, "etcd")
    finally:
        proc.stop()


def test_our_snapshot_restores_into_a_real_etcd(ours: Ctl, tmp_path: Path) -> None:
    facts = history(ours)
    path = tmp_path / "ours.db"
    ours.ok("snapshot", "save", str(path))
    st = status(ours, path)
    assert st["revision"] == ours.revision()
    keys = BoltReader(path.read_bytes()[:-32])
    assert st["totalKey"] == sum(len(list(keys.items(b))) for b in keys.buckets())

    etcd = EtcdProcess.restored_from(path, tmp_path / "restored.etcd")
    etcd.start()
    try:
        same_data(ours, Ctl(etcd.endpoint, "etcd"), facts)
    finally:
        etcd.stop()


def test_a_real_etcd_snapshot_restores_into_our_server(real_etcd: Ctl, tmp_path: Path) -> None:
    facts = history(real_etcd)
    path = tmp_path / "etcd.db"
    real_etcd.ok("snapshot", "save", str(path))
    st = status(real_etcd, path)
    assert st["revision"] == real_etcd.revision()

    data_dir = tmp_path / "restored.etcd"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "queue_server.cli",
            "restore",
            str(path),
            "--data-dir",
            str(data_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert r.returncode == 0, r.stderr
    srv = ServerProcess(data_dir).start()
    try:
        mine = Ctl(srv.endpoint, "queue-server")
        same_data(real_etcd, mine, facts)
        # and it goes on from etcd's revision
        assert mine.revision() == real_etcd.revision()
        mine.ok("put", "after", "1")
        assert mine.revision() == real_etcd.revision() + 1
    finally:
        srv.stop()
