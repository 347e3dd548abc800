"""Unit tests of the durable log: WAL records, torn tails, snapshot files (now
read only to convert an old data dir), recovery from the backend, group
commit, full disks. Files only (a real LMDB backend), no network."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path

import lmdb
import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import Applier, StateMachine
from queue_server.errors import LeaseNotFound, NoSpace, RequestTooLarge
from queue_server.local_log import LocalLog
from queue_server.mvcc.store import ALL_KEYS_END
from queue_server.storage.backend import DB_DIR, Backend, CommitBatch
from queue_server.storage.snapshot import CorruptSnapshotError, SnapshotStore
from queue_server.storage.wal import (
    SECTOR_BYTES,
    WALCorruptError,
    WALFullError,
    WALGapError,
    WriteAheadLog,
)
from tests.support.local_logs import WAIT, RecordingApplier, die, legacy_data_dir, settled

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


async def _fill(log: LocalLog, first: int, n: int) -> list[object]:
    return list(
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    log.propose(put_command(b"k%03d" % i, b"v%d" % i))
                    for i in range(first, first + n)
                )
            ),
            WAIT,
        )
    )


def test_local_log_group_commit_recovery_and_checkpoints(tmp_path: Path) -> None:
    async def first_life() -> None:
        sm = StateMachine()
        log = LocalLog(str(tmp_path), Applier(sm), snapshot_count=50)
        log.recover()
        results = []
        for first in range(0, 120, 30):  # four rounds of 30 proposals at once
            results += await _fill(log, first, 30)
            await settled(log)
        assert all(isinstance(r, rpc_pb2.PutResponse) for r in results)
        # many concurrent proposals shared few fsyncs
        assert log.commits < 120
        # a checkpoint every 50 entries or more, each one trimming the WAL
        assert log.checkpoints >= 2
        assert 100 <= log.backend.consistent_index <= 120
        bad = await log.propose(put_command(b"x", b"y", lease=42))
        assert isinstance(bad, LeaseNotFound)
        with pytest.raises(RequestTooLarge):
            await log.propose(put_command(b"big", b"x" * 2_000_000))
        assert sm.store.revision == 121
        die(log)  # no close(): the restart must replay the tail

    asyncio.run(first_life())
    # covered segments were trimmed
    assert len(list((tmp_path / "wal").glob("*.log"))) <= 2

    sm = StateMachine()
    applier = RecordingApplier(sm)
    log = LocalLog(str(tmp_path), applier)
    log.recover()
    # only the tail after the backend's consistent index was replayed
    consistent_index = log.backend.consistent_index
    assert applier.indexes == list(range(consistent_index + 1, 122))
    assert sm.store.revision == 121
    assert sm.applied_index == 121  # 120 puts + the failed put (a log entry too)
    assert sm.store.range(b"k", ALL_KEYS_END).count == 120
    assert sm.store.get(b"k119") is not None and sm.store.get(b"k119").value == b"v119"  # type: ignore[union-attr]
    asyncio.run(log.close())  # checkpoints: the next start replays nothing
    applier = RecordingApplier(StateMachine())
    LocalLog(str(tmp_path), applier).recover()
    assert applier.indexes == [] and applier.state.store.revision == 121


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


def test_corrupt_newest_snapshot_falls_back_only_when_the_log_reaches_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Snapshot files are read only to convert a data dir of the old format:
    there the fallback rule holds as before. Snapshots at 50 and 100, the
    newest damaged: refused when the log starts at 101, converted (from the
    older snapshot and the log) when the segments since 50 are still there."""
    commands = [put_command(b"k%03d" % i, b"v") for i in range(120)]
    trimmed = tmp_path / "trimmed"
    legacy_data_dir(trimmed, commands, snapshots=[50, 100])
    assert [int(p.stem) for p in sorted((trimmed / "wal").glob("*.log"))] == [101]
    newest = trimmed / "snap" / f"{100:020d}.snap"
    data = newest.read_bytes()
    newest.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    # the log starts at 101, the older snapshot is at 50: refused, never served
    log = LocalLog(str(trimmed), Applier(StateMachine()))
    with pytest.raises(CorruptSnapshotError, match=r"checksum.*refusing to start"):
        log.recover()
    log.backend.close()
    assert newest.exists() and not (trimmed / "snap.converted").exists()

    # with the segments since the older snapshot still there (a crash before
    # trimming), the older snapshot plus the log is provably the same state
    other = tmp_path / "untrimmed"
    legacy_data_dir(other, commands, snapshots=[50, 100], trim=False)
    newest = other / "snap" / f"{100:020d}.snap"
    newest.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    sm = StateMachine()
    applier = RecordingApplier(sm)
    log = LocalLog(str(other), applier)
    with caplog.at_level(logging.WARNING):
        log.recover()
    assert applier.indexes == list(range(51, 121))  # from the older snapshot on
    assert sm.store.revision == 121 and sm.store.range(b"k", ALL_KEYS_END).count == 120
    assert "snapshot fallback used_index=50" in caplog.text
    assert "data dir converted" in caplog.text
    assert log.backend.consistent_index == 120
    converted = other / "snap.converted"
    assert not (other / "snap").exists()
    assert not (converted / newest.name).exists()
    assert (converted / (newest.name + ".broken")).exists()
    state = sm.export_state()
    asyncio.run(log.close())
    # the next start reads the backend; the snapshot files are not looked at
    again = StateMachine()
    applier = RecordingApplier(again)
    LocalLog(str(other), applier).recover()
    assert applier.indexes == [] and again.export_state() == state


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
    wal.write_fd = disk.write
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
        log.wal.write_fd = disk.write
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


class FullDisk(Backend):
    """A real backend whose first `full` commits find the disk full, as LMDB
    reports it: the write transaction aborted, nothing written."""

    def __init__(self, path: str, full: int, error: BaseException) -> None:
        super().__init__(path)
        self.full = full
        self.error = error

    def commit(self, batch: CommitBatch) -> None:
        if self.full > 0:
            self.full -= 1
            with self.env.begin(write=True) as txn:  # begun, then refused: aborted
                txn.put(b"half", b"written")
                raise self.error
        super().commit(batch)


@pytest.mark.parametrize(
    "error",
    [
        lmdb.DiskError("mdb_txn_commit: No space left on device"),
        lmdb.MapFullError("mdb_put: MDB_MAP_FULL: Environment mapsize limit reached"),
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    ],
    ids=["DiskError", "MapFullError", "ENOSPC"],
)
def test_failed_checkpoint_keeps_writing_and_retries_later(
    tmp_path: Path, error: BaseException
) -> None:
    alarms: list[int] = []

    async def life() -> None:
        sm = StateMachine()
        sm.use_backend(FullDisk(os.path.join(tmp_path, DB_DIR), full=1, error=error))
        log = LocalLog(str(tmp_path), Applier(sm), snapshot_count=10)
        log.recover()
        log.on_no_space = lambda: alarms.append(sm.applied_index)
        for i in range(25):  # one at a time: a checkpoint is due at 10, then after it
            result = await asyncio.wait_for(log.propose(put_command(b"k%02d" % i, b"v")), WAIT)
            assert isinstance(result, rpc_pb2.PutResponse)
            await settled(log)
            if i == 9:  # the first checkpoint failed: NOSPACE raised, nothing lost
                assert len(alarms) == 1 and log.checkpoints == 0
                assert log.backend.consistent_index == 0
            # every write so far reads back, whatever the backend holds
            assert [kv.key for kv in sm.store.range(b"k", ALL_KEYS_END).kvs] == [
                b"k%02d" % j for j in range(i + 1)
            ]
        assert len(alarms) == 1  # one failure, one alarm
        assert log.checkpoints == 2 and log.backend.consistent_index == 21
        # nothing of the failed transaction was written, and the WAL was trimmed
        # only past the checkpoint that held the failed one's revisions
        assert log.backend.reader.get(b"half") is None
        assert [int(p.stem) for p in (tmp_path / "wal").glob("*.log")] == [22]
        die(log)

    asyncio.run(life())
    sm = StateMachine()
    applier = RecordingApplier(sm)
    LocalLog(str(tmp_path), applier).recover()
    assert applier.indexes == [22, 23, 24, 25]
    assert sm.store.revision == 26
    assert [kv.key for kv in sm.store.range(b"k", ALL_KEYS_END).kvs] == [
        b"k%02d" % j for j in range(25)
    ]
