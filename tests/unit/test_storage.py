"""Unit tests of the durable log: WAL records, torn tails, snapshots, recovery,
group commit. Files only, no network."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import StateMachine
from queue_server.errors import LeaseNotFound, RequestTooLarge
from queue_server.mvcc.store import ALL_KEYS_END
from queue_server.storage.local_log import LocalLog
from queue_server.storage.snapshot import CorruptSnapshotError, SnapshotStore
from queue_server.storage.wal import WALGapError, WriteAheadLog

pytestmark = pytest.mark.unit


def put_command(key: bytes, value: bytes, lease: int = 0) -> internal_pb2.Command:
    return internal_pb2.Command(put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def test_wal_round_trip(tmp_path: Path) -> None:
    wal = WriteAheadLog(str(tmp_path))
    list(wal.replay(0))
    wal.open_for_append()
    wal.append([(1, b"one"), (2, b"two")])
    wal.append([(3, b"three")])
    wal.close()
    again = WriteAheadLog(str(tmp_path))
    assert list(again.replay(0)) == [(1, b"one"), (2, b"two"), (3, b"three")]
    assert list(WriteAheadLog(str(tmp_path)).replay(2)) == [(3, b"three")]
    assert again.recovery.dropped_bytes == 0


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_wal_torn_tail_is_cut_at_last_good_record(tmp_path: Path, damage: str) -> None:
    wal = WriteAheadLog(str(tmp_path))
    list(wal.replay(0))
    wal.open_for_append()
    wal.append([(1, b"one"), (2, b"two"), (3, b"three" * 10)])
    wal.close()
    (segment,) = tmp_path.glob("*.log")
    data = segment.read_bytes()
    if damage == "truncate":
        segment.write_bytes(data[:-7])
    else:
        segment.write_bytes(data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:])
    again = WriteAheadLog(str(tmp_path))
    assert list(again.replay(0)) == [(1, b"one"), (2, b"two")]
    assert again.recovery.dropped_bytes > 0
    # appending continues right after the last good record
    again.open_for_append()
    again.append([(3, b"new three")])
    again.close()
    assert list(WriteAheadLog(str(tmp_path)).replay(0))[-1] == (3, b"new three")


def test_wal_gap_after_snapshot_is_refused(tmp_path: Path) -> None:
    wal = WriteAheadLog(str(tmp_path))
    list(wal.replay(0))
    wal.open_for_append()
    wal.append([(1, b"one")])
    wal.rotate()
    wal.append([(2, b"two")])
    wal.close()
    os.remove(tmp_path / f"{1:020d}.log")
    with pytest.raises(WALGapError):
        list(WriteAheadLog(str(tmp_path)).replay(0))


def test_snapshot_round_trip_and_corruption(tmp_path: Path) -> None:
    snaps = SnapshotStore(str(tmp_path))
    assert snaps.load_latest() is None
    snaps.save(5, {"x": [1, 2, 3]})
    snaps.save(9, {"x": [4]})
    snaps.save(12, {"x": [5]})
    assert snaps.indexes() == [9, 12]  # older ones are pruned
    assert snaps.load_latest() == (12, {"x": [5]})
    path = tmp_path / f"{12:020d}.snap"
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptSnapshotError, match="checksum"):
        snaps.load_latest()


async def _fill(log: LocalLog, n: int) -> list[object]:
    return list(
        await asyncio.gather(
            *(log.propose(put_command(b"k%03d" % i, b"v%d" % i)) for i in range(n))
        )
    )


def test_local_log_group_commit_recovery_and_snapshots(tmp_path: Path) -> None:
    async def first_life() -> None:
        sm = StateMachine()
        log = LocalLog(str(tmp_path), sm, snapshot_count=50)
        log.recover()
        results = await _fill(log, 120)
        assert all(isinstance(r, rpc_pb2.PutResponse) for r in results)
        # many concurrent proposals shared few fsyncs
        assert log.commits < 120
        bad = await log.propose(put_command(b"x", b"y", lease=42))
        assert isinstance(bad, LeaseNotFound)
        with pytest.raises(RequestTooLarge):
            await log.propose(put_command(b"big", b"x" * 2_000_000))
        await log.close()
        assert sm.store.revision == 121

    asyncio.run(first_life())
    assert (tmp_path / "snap").exists() and list((tmp_path / "snap").glob("*.snap"))
    # covered segments were trimmed: fewer segments than snapshots taken + 1
    assert len(list((tmp_path / "wal").glob("*.log"))) <= 2

    sm = StateMachine()
    log = LocalLog(str(tmp_path), sm)
    log.recover()
    assert sm.store.revision == 121
    assert sm.applied_index == 121  # 120 puts + the failed put (a log entry too)
    assert sm.store.range(b"k", ALL_KEYS_END).count == 120
    assert sm.store.get(b"k119") is not None and sm.store.get(b"k119").value == b"v119"  # type: ignore[union-attr]
