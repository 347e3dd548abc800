"""`queue-server restore SNAPSHOT --data-dir DIR`: a new data dir from a snapshot.

The snapshot may be what Maintenance.Snapshot streams (`etcdctl snapshot
save`): an etcd backend database (bbolt) with our state in a bucket of its own;
a real etcd's `snapshot.db` (from `etcdctl snapshot save`, or a data dir's
`member/snap/db`), whose keys, revisions, compaction point, leases and auth
become ours (`storage/etcd_backend.py`); or our own QSNAP2 file. Restoring
checks it in full, refuses a data dir that already holds data, and installs the
state as the dir's only snapshot (QSNAP2), so the server started on DIR begins
at the snapshot's state with an empty log. A file in the legacy pickle format
(from an older server) is read, being a local file the operator chose, and
installed rewritten in today's format.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import os
import sys
from collections.abc import Sequence

from queue_server.storage import etcd_backend
from queue_server.storage.snapshot import (
    SHA256_BYTES,
    CorruptSnapshotError,
    SnapshotContents,
    SnapshotStore,
    from_transfer,
    read_local_snapshot,
)
from queue_server.storage.snapshot_codec import SnapshotFormatError

log = logging.getLogger(__name__)


def restore(snapshot_path: str, data_dir: str) -> int:
    """Install the snapshot into a new data dir; returns the snapshot's index."""
    with open(snapshot_path, "rb") as f:
        data = f.read()
    bbolt = etcd_backend.is_bbolt(data)
    if bbolt:
        snap, legacy = _read_bbolt(data, snapshot_path), False
    else:
        data = from_transfer(data, snapshot_path)
        snap, legacy = read_local_snapshot(io.BytesIO(data), snapshot_path)
    if os.path.isdir(data_dir) and os.listdir(data_dir):
        raise FileExistsError(f"data dir {data_dir!r} is not empty")
    os.makedirs(os.path.join(data_dir, "wal"), mode=0o700, exist_ok=True)
    store = SnapshotStore(os.path.join(data_dir, "snap"))
    if bbolt:
        try:
            store.save(snap.index, snap.state, snap.raft_term, snap.voters)
        except (ValueError, TypeError) as e:
            raise CorruptSnapshotError(
                f"{snapshot_path}: the etcd database's state does not fit a snapshot: {e}"
            ) from None
        log.info(
            "snapshot restored from an etcd database path=%s index=%d revision=%d",
            snapshot_path,
            snap.index,
            snap.state["mvcc"][0],
        )
    elif legacy:
        try:
            store.save(snap.index, snap.state, snap.raft_term, snap.voters)
        except (ValueError, TypeError) as e:
            raise CorruptSnapshotError(
                f"{snapshot_path}: legacy snapshot cannot be rewritten in the new format: {e}"
            ) from None
        log.warning(
            "snapshot rewritten from legacy pickle format path=%s index=%d from=QSNAP1 to=QSNAP2",
            snapshot_path,
            snap.index,
        )
    else:
        store.save_encoded(snap.index, data)
    return snap.index


def _read_bbolt(data: bytes, name: str) -> SnapshotContents:
    """An etcd backend database: as `etcdctl snapshot save` writes it (followed
    by its sha256, checked here as etcdctl snapshot restore does) or a bare
    `member/snap/db` (a whole number of pages, no hash)."""
    if len(data) % 512 == SHA256_BYTES:
        body, digest = data[:-SHA256_BYTES], data[-SHA256_BYTES:]
        if hashlib.sha256(body).digest() != digest:
            raise CorruptSnapshotError(f"snapshot {name} fails its sha256 check")
        data = body
    try:
        return etcd_backend.read_etcd_db(data, name)
    except SnapshotFormatError as e:
        raise CorruptSnapshotError(f"{name} is not a valid etcd database: {e}") from None


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="queue-server restore", description="Create a data dir from a snapshot file."
    )
    parser.add_argument(
        "snapshot",
        help="a file written by `etcdctl snapshot save` (from us or from etcd), or our own snapshot",
    )
    parser.add_argument("--data-dir", required=True, help="the new data dir (must be empty)")
    args = parser.parse_args(argv)
    try:
        index = restore(args.snapshot, args.data_dir)
    except (OSError, CorruptSnapshotError) as e:
        print(f"queue-server restore: {e}", file=sys.stderr)
        return 1
    print(f"restored snapshot at index {index} into {args.data_dir}")
    return 0
