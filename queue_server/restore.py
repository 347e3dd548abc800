"""`queue-server restore SNAPSHOT --data-dir DIR`: a new data dir from a snapshot.

The snapshot may be what Maintenance.Snapshot streams (`etcdctl snapshot
save`): an etcd backend database (bbolt) with our state in a bucket of its own;
a real etcd's `snapshot.db` (from `etcdctl snapshot save`, or a data dir's
`member/snap/db`), whose keys, revisions, compaction point, leases and auth
become ours (`storage/etcd_backend.py`); or our own QSNAP2 file. Restoring
checks it in full, refuses a data dir that already holds data, and installs the
state as the dir's only snapshot (QSNAP2), so the server started on DIR begins
at the snapshot's state with an empty log. A QSNAP1 file (the pickle format of
older releases) is refused with a line saying how to convert it.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Sequence

from queue_server.storage import etcd_backend
from queue_server.storage.snapshot import (
    CorruptSnapshotError,
    SnapshotStore,
    read_snapshot,
    unwrap_transfer,
)
from queue_server.storage.snapshot_codec import SnapshotFormatError

log = logging.getLogger(__name__)


def restore(snapshot_path: str, data_dir: str) -> int:
    """Install the snapshot into a new data dir; returns the snapshot's index."""
    with open(snapshot_path, "rb") as f:
        data = unwrap_transfer(f.read(), snapshot_path)
    bbolt = etcd_backend.is_bbolt(data)
    if bbolt:
        try:
            snap = etcd_backend.read_etcd_db(data, snapshot_path)
        except SnapshotFormatError as e:
            raise CorruptSnapshotError(
                f"{snapshot_path} is not a valid etcd database: {e}"
            ) from None
    else:
        snap = read_snapshot(io.BytesIO(data), snapshot_path)
    if os.path.isdir(data_dir) and os.listdir(data_dir):
        raise FileExistsError(f"data dir {data_dir!r} is not empty")
    os.makedirs(os.path.join(data_dir, "wal"), mode=0o700, exist_ok=True)
    store = SnapshotStore(os.path.join(data_dir, "snap"))
    if not bbolt:
        store.save_encoded(snap.index, data)  # today's format: installed as it is
        return snap.index
    try:
        store.save(snap.index, snap.state, snap.raft_term, snap.voters)
    except (ValueError, TypeError) as e:
        raise CorruptSnapshotError(
            f"{snapshot_path}: its state cannot be written as a snapshot: {e}"
        ) from None
    log.info(
        "snapshot restored path=%s from=etcd-db to=QSNAP2 index=%d revision=%d",
        snapshot_path,
        snap.index,
        snap.state["mvcc"][0],
    )
    return snap.index


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
