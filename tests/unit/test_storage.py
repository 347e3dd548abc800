"""Unit tests of the durable log: WAL records, torn tails, snapshots, recovery,
group commit. Files only, no network."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import Applier, StateMachine
from queue_server.errors import LeaseNotFound, NoSpace, RequestTooLarge
from queue_server.mvcc.store import ALL_KEYS_END
from queue_server.storage.local_log import LocalLog
from queue_server.storage.snapshot import CorruptSnapshotError, SnapshotStore
from queue_server.storage.wal import (
    SECTOR_BYTES,
    WALCorruptError,
    WALFullError,
    WALGapError,
    WriteAheadLog,
)

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


def _state_at(index: int) -> dict[str, object]:
    """A real state with `index` entries applied (one key each)."""
    sm = StateMachine()
    for i in range(1, index + 1):
        sm.apply(i, put_command(b"k%03d" % i, b"v%d" % i))
    return sm.export_state()


def test_snapshot_round_trip_and_corruption(tmp_path: Path) -> None:
    snaps = SnapshotStore(str(tmp_path))
    assert snaps.load_latest() is None
    states = {index: _state_at(index) for index in (5, 9, 12)}
    for index, state in states.items():
        snaps.save(index, state)
    assert snaps.indexes() == [9, 12]  # older ones are pruned
    loaded = snaps.load_latest()
    assert loaded is not None and (loaded.index, loaded.state) == (12, states[12])
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
        log = LocalLog(str(tmp_path), Applier(sm), snapshot_count=50)
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
    log = LocalLog(str(tmp_path), Applier(sm))
    log.recover()
    assert sm.store.revision == 121
    assert sm.applied_index == 121  # 120 puts + the failed put (a log entry too)
    assert sm.store.range(b"k", ALL_KEYS_END).count == 120
    assert sm.store.get(b"k119") is not None and sm.store.get(b"k119").value == b"v119"  # type: ignore[union-attr]


def _three_records(directory: Path, middle: bytes = b"two") -> tuple[Path, bytes]:
    wal = WriteAheadLog(str(directory))
    list(wal.replay(0))
    wal.open_for_append()
    wal.append([(1, b"one"), (2, middle), (3, b"three")])
    wal.close()
    (segment,) = directory.glob("*.log")
    return segment, segment.read_bytes()


def test_wal_torn_tail_is_logged_with_offset_and_bytes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    segment, data = _three_records(tmp_path)
    segment.write_bytes(data[:-4])
    third = len(data) - (16 + len(b"three"))
    wal = WriteAheadLog(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert [i for i, _ in wal.replay(0)] == [1, 2]
    assert wal.recovery.dropped_offset == third
    assert wal.recovery.dropped_bytes == len(data) - 4 - third
    assert f"offset={third} dropped_bytes={len(data) - 4 - third}" in caplog.text
    assert segment.stat().st_size == third  # cut, so appends follow record 2


@pytest.mark.parametrize("where", ["payload", "length", "index"])
def test_wal_damage_before_good_records_is_refused(tmp_path: Path, where: str) -> None:
    """A bad record followed by good ones is not a torn write: cutting there would
    drop acknowledged records, so recovery refuses (etcd: crc mismatch)."""
    segment, data = _three_records(tmp_path)
    second = 16 + len(b"one")
    at = {"payload": second + 16, "length": second + 1, "index": second + 8}[where]
    segment.write_bytes(data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :])
    with pytest.raises(WALCorruptError, match=f"offset {second}.*index 2.*index 3"):
        list(WriteAheadLog(str(tmp_path)).replay(0))
    assert segment.read_bytes()[:at] == data[:at]  # nothing cut


def test_wal_zeroed_sector_is_a_torn_write(tmp_path: Path) -> None:
    """etcd's torn-entry rule: a bad record holding an all-zero sector was cut by
    a crash (its batch never acknowledged), even if a later record of the same
    batch reached the disk."""
    segment, data = _three_records(tmp_path, middle=b"x" * (3 * SECTOR_BYTES))
    second = 16 + len(b"one")
    start = -(-(second + 16) // SECTOR_BYTES) * SECTOR_BYTES
    damaged = data[:start] + bytes(SECTOR_BYTES) + data[start + SECTOR_BYTES :]
    segment.write_bytes(damaged)
    wal = WriteAheadLog(str(tmp_path))
    assert [i for i, _ in wal.replay(0)] == [1]
    assert wal.recovery.dropped_offset == second


def test_wal_damage_before_a_later_segment_is_refused(tmp_path: Path) -> None:
    wal = WriteAheadLog(str(tmp_path))
    list(wal.replay(0))
    wal.open_for_append()
    wal.append([(1, b"one"), (2, b"two")])
    wal.rotate()
    wal.append([(3, b"three")])
    wal.close()
    first = tmp_path / f"{1:020d}.log"
    first.write_bytes(first.read_bytes()[:-2])
    with pytest.raises(WALCorruptError, match="later segments"):
        list(WriteAheadLog(str(tmp_path)).replay(0))


def _snapshotted_log(directory: Path, trim: bool) -> None:
    """A log with snapshots at 50 and 100 and 120 entries; `trim` keeps only the
    segments after the newest snapshot, as a long-running server would."""

    async def life() -> None:
        log = LocalLog(str(directory), Applier(StateMachine()), snapshot_count=50)
        log.recover()
        if not trim:  # as if each trim were cut short by a crash
            log.wal.remove_covered = lambda snapshot_index: 0  # type: ignore[method-assign]
        for first, n in ((0, 50), (50, 50), (100, 20)):  # one batch each
            await asyncio.gather(
                *(log.propose(put_command(b"k%03d" % i, b"v")) for i in range(first, first + n))
            )
        await log.close()

    asyncio.run(life())
    if not trim:
        return
    snaps = sorted((directory / "snap").glob("*.snap"))
    assert [int(p.stem) for p in snaps] == [50, 100]
    assert [int(p.stem) for p in sorted((directory / "wal").glob("*.log"))] == [101]


def test_corrupt_newest_snapshot_falls_back_only_when_the_log_reaches_back(
    tmp_path: Path,
) -> None:
    _snapshotted_log(tmp_path, trim=True)
    newest = tmp_path / "snap" / f"{100:020d}.snap"
    data = newest.read_bytes()
    newest.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    # the log starts at 101, the older snapshot is at 50: refused, never served
    with pytest.raises(CorruptSnapshotError, match=r"checksum.*refusing to start"):
        LocalLog(str(tmp_path), Applier(StateMachine())).recover()
    assert newest.exists()

    # with the segments since the older snapshot still there (a crash before
    # trimming), the older snapshot plus the log is provably the same state
    other = tmp_path / "untrimmed"
    _snapshotted_log(other, trim=False)
    newest = other / "snap" / f"{100:020d}.snap"
    newest.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    sm = StateMachine()
    LocalLog(str(other), Applier(sm)).recover()
    assert sm.store.revision == 121 and sm.store.range(b"k", ALL_KEYS_END).count == 120
    assert not newest.exists() and newest.with_suffix(".snap.broken").exists()


class SmallDisk:
    """A disk with `free` bytes left, at the WAL's write call: writes what fits
    to the real file, then fails with ENOSPC, as a full file system does."""

    def __init__(self, free: int) -> None:
        self.free = free

    def write(self, fd: int, data: memoryview) -> int:
        if self.free <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, data[: self.free])
        self.free -= n
        return n


def test_wal_full_disk_cuts_the_partial_write(tmp_path: Path) -> None:
    wal = WriteAheadLog(str(tmp_path))
    list(wal.replay(0))
    wal.open_for_append()
    disk = SmallDisk(40)
    wal.write_fd = disk.write  # type: ignore[method-assign]
    wal.append([(1, b"one")])
    with pytest.raises(WALFullError):
        wal.append([(2, b"two" * 10)])  # 9 of its bytes fit
    disk.free = 1000
    wal.append([(2, b"two")])
    wal.close()
    assert list(WriteAheadLog(str(tmp_path)).replay(0)) == [(1, b"one"), (2, b"two")]


def test_local_log_full_disk_refuses_with_nospace_then_recovers(tmp_path: Path) -> None:
    alarms: list[int] = []

    async def life() -> None:
        sm = StateMachine()
        log = LocalLog(str(tmp_path), Applier(sm))
        log.recover()
        log.on_no_space = lambda: alarms.append(sm.applied_index)
        disk = SmallDisk(2000)
        log.wal.write_fd = disk.write  # type: ignore[method-assign]
        ok = 0
        for i in range(100):  # one at a time until the disk is full
            try:
                result = await log.propose(put_command(b"k%03d" % i, b"v" * 50))
            except NoSpace:
                break
            assert isinstance(result, rpc_pb2.PutResponse)
            ok += 1
        assert 0 < ok < 100 and alarms == [ok]
        # a whole batch (and what queued behind it) is refused, nothing applied
        results = await asyncio.gather(
            *(log.propose(put_command(b"b%03d" % i, b"v")) for i in range(20)),
            return_exceptions=True,
        )
        assert all(isinstance(r, NoSpace) for r in results)
        assert sm.store.revision == ok + 1 and sm.applied_index == ok
        # nothing half-applied, and after space comes back writes go on
        disk.free = 1 << 20
        after = await log.propose(put_command(b"after", b"x"))
        assert isinstance(after, rpc_pb2.PutResponse)
        assert after.header.revision == ok + 2
        await log.close()

    asyncio.run(life())
    sm = StateMachine()
    LocalLog(str(tmp_path), Applier(sm)).recover()
    assert sm.store.get(b"after") is not None
    assert sm.store.range(b"k", ALL_KEYS_END).count == sm.store.revision - 2


def test_wal_gap_is_seen_even_when_the_newest_segment_is_empty(tmp_path: Path) -> None:
    """After a snapshot at 40 the log is an empty segment named 41: replaying
    from an older snapshot (30) must see that 31..40 are gone."""
    wal = WriteAheadLog(str(tmp_path))
    wal.last_index = 40
    wal.open_for_append()
    wal.close()
    assert [p.name for p in tmp_path.glob("*.log")] == [f"{41:020d}.log"]
    with pytest.raises(WALGapError):
        list(WriteAheadLog(str(tmp_path)).replay(30))
    assert list(WriteAheadLog(str(tmp_path)).replay(40)) == []


class FullSnapshots(SnapshotStore):
    """A snapshot directory whose disk is full for the first `full` saves."""

    def __init__(self, directory: str, full: int) -> None:
        super().__init__(directory)
        self.full = full

    def save(self, index: int, state: object) -> int:
        if self.full > 0:
            self.full -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().save(index, state)


def test_failed_snapshot_keeps_writing_and_retries_later(tmp_path: Path) -> None:
    async def life() -> None:
        log = LocalLog(str(tmp_path), Applier(StateMachine()), snapshot_count=10)
        log.recover()
        log.snapshots = FullSnapshots(str(tmp_path / "snap"), full=1)
        for i in range(25):  # one at a time: a snapshot is due at 10, then at 20
            assert isinstance(
                await log.propose(put_command(b"k%02d" % i, b"v")), rpc_pb2.PutResponse
            )
        await log.close()
        assert log.snapshots.indexes() == [20]

    asyncio.run(life())
    sm = StateMachine()
    LocalLog(str(tmp_path), Applier(sm)).recover()
    assert sm.store.revision == 26
