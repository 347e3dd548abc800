"""Unit tests of snapshots taken from the LMDB backend: a QSNAP2 file whose key
histories are RevisionChunks written straight from a read transaction reads back
as the state `export_state` gives, and a restore from it replaces what the
backend held (a follower installing a leader's snapshot)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import Checkpoint, StateMachine
from queue_server.mvcc.store import ALL_KEYS_END
from queue_server.storage import snapshot
from queue_server.storage.backend import Backend, CommitBatch
from queue_server.storage.snapshot_codec import RawRevisions

pytestmark = pytest.mark.unit


def _commit(backend: Backend, sm: StateMachine, cp: Checkpoint) -> None:
    image = snapshot.encode(cp.index, cp.sections)
    backend.commit(CommitBatch(cp.index, cp.writes, cp.dropped, image, cp.tables, cp.replace))
    backend.renew_reader()
    sm.checkpoint_done()


def _drive(sm: StateMachine, start: int, commands: list[internal_pb2.Command]) -> int:
    index = start
    for command in commands:
        index += 1
        sm.apply(index, command)
    return index


def _puts(prefix: bytes, n: int) -> list[internal_pb2.Command]:
    return [
        internal_pb2.Command(put=rpc_pb2.PutRequest(key=prefix + b"%03d" % i, value=b"v%d" % i))
        for i in range(n)
    ]


def test_a_snapshot_of_raw_revisions_reads_back_as_the_exported_state(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path / "db"), fsync=False)
    sm = StateMachine()
    sm.use_backend(backend)
    index = _drive(sm, 0, _puts(b"a", 30))
    _commit(backend, sm, sm.checkpoint())
    index = _drive(
        sm,
        index,
        [
            *_puts(b"a", 5),  # second versions
            internal_pb2.Command(
                delete_range=rpc_pb2.DeleteRangeRequest(key=b"a010", range_end=b"a020")
            ),
            internal_pb2.Command(compaction=rpc_pb2.CompactionRequest(revision=20)),
        ],
    )
    _commit(backend, sm, sm.checkpoint())  # some revisions committed, then dropped
    expected = sm.export_state()

    sections = sm.export_sections(full=True)
    revision, compact_revision, _ = sections["mvcc"]
    txn = backend.begin_read()
    try:
        keys = RawRevisions(sm.store.history_key_count, backend.raw_revisions(txn))
        out = io.BytesIO()
        snapshot.write_snapshot(out, index, dict(sections, mvcc=(revision, compact_revision, keys)))
    finally:
        txn.abort()
    read = snapshot.decode(out.getvalue(), "raw.snap")
    assert read.index == index
    assert read.state == expected


def test_a_restore_replaces_what_the_backend_held(tmp_path: Path) -> None:
    leader = StateMachine()
    _drive(leader, 0, _puts(b"new", 10))
    state = leader.export_state()

    backend = Backend(str(tmp_path / "db"), fsync=False)
    follower = StateMachine()
    follower.use_backend(backend)
    _drive(follower, 0, _puts(b"old", 20))
    _commit(backend, follower, follower.checkpoint())
    follower.restore_state(state)
    cp = follower.checkpoint()
    assert cp.replace
    _commit(backend, follower, cp)
    backend.close()

    again = StateMachine()
    backend = Backend(str(tmp_path / "db"), fsync=False)
    again.use_backend(backend)
    image = backend.sections()
    assert image is not None
    again.restore_state(snapshot.decode(image, "x").state, backend.scan_keys(), backend.table_rows)
    assert again.export_state() == state
    assert [kv.key for kv in again.store.range(b"", ALL_KEYS_END).kvs] == [
        b"new%03d" % i for i in range(10)
    ]
