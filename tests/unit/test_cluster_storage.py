"""Unit tests of a member's raft storage: replay, suffix replacement, snapshots,
and a torn tail, on a real directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from queue_server.replication.storage import (
    RaftStorage,
    StoredEntry,
    encode_entry,
    encode_hard_state,
)
from queue_server.storage import snapshot
from tests.support.states import rich_machine

pytestmark = pytest.mark.unit


def write(storage: RaftStorage, records: list[bytes]) -> None:
    data, last = storage.encode(records)
    storage.write(data, last)


def entries(*spec: tuple[int, int]) -> list[StoredEntry]:
    return [StoredEntry(i, t, 0, f"{i}@{t}".encode()) for i, t in spec]


def test_entries_and_hard_state_come_back(tmp_path: Path) -> None:
    s = RaftStorage(str(tmp_path))
    assert s.load().entries == []
    write(s, [encode_hard_state(1, 7, 0)] + [encode_entry(e) for e in entries((1, 1), (2, 1))])
    write(s, [encode_hard_state(2, 0, 2)])
    s.close()
    got = RaftStorage(str(tmp_path)).load()
    assert (got.term, got.vote, got.commit) == (2, 0, 2)
    assert [(e.index, e.term, e.data) for e in got.entries] == [(1, 1, b"1@1"), (2, 1, b"2@1")]


def test_a_rewritten_index_replaces_it_and_everything_after(tmp_path: Path) -> None:
    s = RaftStorage(str(tmp_path))
    s.load()
    write(s, [encode_entry(e) for e in entries((1, 1), (2, 1), (3, 1))])
    write(s, [encode_entry(e) for e in entries((2, 2))])  # a new leader overwrote 2..3
    s.close()
    got = RaftStorage(str(tmp_path)).load()
    assert [(e.index, e.term) for e in got.entries] == [(1, 1), (2, 2)]


def test_snapshot_keeps_later_entries_and_drops_old_segments(tmp_path: Path) -> None:
    s = RaftStorage(str(tmp_path))
    s.load()
    write(s, [encode_entry(e) for e in entries(*[(i, 1) for i in range(1, 11)])])
    state = rich_machine().export_state()
    state["applied_index"] = 8  # as if the state stood at raft index 8
    job = s.snapshot_job(8, state, 1, [1, 2, 3], (1, 1, 9), entries((9, 1), (10, 1)))
    write_after = [encode_entry(e) for e in entries((11, 2))]
    assert job() > 0
    write(s, write_after)
    s.close()
    wal_dir = tmp_path / "raft" / "wal"
    assert len(os.listdir(wal_dir)) == 1  # the segment before the snapshot is gone
    reopened = RaftStorage(str(tmp_path))
    got = reopened.load()
    with open(reopened.snapshot_path(8), "rb") as f:  # the file a follower is sent
        assert snapshot.read_snapshot(f, "snap").state == state
    assert (got.snapshot_index, got.snapshot_term, got.voters) == (8, 1, (1, 2, 3))
    assert got.state == state
    assert (got.term, got.vote, got.commit) == (1, 1, 9)
    assert [(e.index, e.term) for e in got.entries] == [(9, 1), (10, 1), (11, 2)]


def test_a_received_snapshot_is_adopted_and_the_log_restarts_after_it(tmp_path: Path) -> None:
    s = RaftStorage(str(tmp_path))
    s.load()
    write(s, [encode_entry(e) for e in entries(*[(i, 1) for i in range(1, 4)])])
    state = rich_machine().export_state()
    state["applied_index"] = 20
    received = os.path.join(s.snapshot_dir, "peer-1.incoming.tmp")
    with open(received, "wb") as f:  # as the peer transport writes it
        snapshot.write_snapshot(f, 20, state, raft_term=3, voters=[1, 2, 3])
    assert s.install_job(20, received, (3, 2, 20))() > 0
    s.close()
    assert not os.path.exists(received)
    got = RaftStorage(str(tmp_path)).load()
    assert (got.snapshot_index, got.snapshot_term, got.state) == (20, 3, state)
    assert (got.term, got.vote, got.commit) == (3, 2, 20)
    assert got.entries == []  # nothing of the old log is kept


def test_an_interrupted_receive_leaves_nothing_after_a_restart(tmp_path: Path) -> None:
    s = RaftStorage(str(tmp_path))
    s.load()
    s.close()
    partial = os.path.join(s.snapshot_dir, "peer-2.incoming.tmp")
    with open(partial, "wb") as f:
        f.write(b"QSNAP2\n half of a snapshot")
    got = RaftStorage(str(tmp_path)).load()
    assert got.state is None and not os.path.exists(partial)


def test_torn_tail_is_cut_and_appending_goes_on(tmp_path: Path) -> None:
    s = RaftStorage(str(tmp_path))
    s.load()
    write(s, [encode_entry(e) for e in entries((1, 1), (2, 1))])
    s.close()
    (segment,) = (tmp_path / "raft" / "wal").iterdir()
    with open(segment, "ab") as f:
        f.write(b"\x10\x00\x00\x00garbage")  # a record cut short by a crash
    s = RaftStorage(str(tmp_path))
    got = s.load()
    assert [e.index for e in got.entries] == [1, 2]
    write(s, [encode_entry(e) for e in entries((3, 1))])
    s.close()
    assert [e.index for e in RaftStorage(str(tmp_path)).load().entries] == [1, 2, 3]
