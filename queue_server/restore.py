"""`queue-server restore SNAPSHOT --data-dir DIR`: a new data dir from a snapshot.

The snapshot is what Maintenance.Snapshot streams (`etcdctl snapshot save`): our
snapshot file format. Restoring checks it in full, refuses a data dir that
already holds data, and installs the file as the dir's only snapshot, so the
server started on DIR begins at the snapshot's state with an empty log. A file
in the legacy pickle format (from an older server) is read, being a local file
the operator chose, and installed rewritten in today's format.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Sequence

from queue_server.storage.snapshot import (
    CorruptSnapshotError,
    SnapshotStore,
    from_transfer,
    read_local_snapshot,
)

log = logging.getLogger(__name__)


def restore(snapshot_path: str, data_dir: str) -> int:
    """Install the snapshot into a new data dir; returns the snapshot's index."""
    with open(snapshot_path, "rb") as f:
        data = from_transfer(f.read(), snapshot_path)
    snap, legacy = read_local_snapshot(io.BytesIO(data), snapshot_path)
    if os.path.isdir(data_dir) and os.listdir(data_dir):
        raise FileExistsError(f"data dir {data_dir!r} is not empty")
    os.makedirs(os.path.join(data_dir, "wal"), mode=0o700, exist_ok=True)
    store = SnapshotStore(os.path.join(data_dir, "snap"))
    if legacy:
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


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="queue-server restore", description="Create a data dir from a snapshot file."
    )
    parser.add_argument("snapshot", help="a file written by `etcdctl snapshot save`")
    parser.add_argument("--data-dir", required=True, help="the new data dir (must be empty)")
    args = parser.parse_args(argv)
    try:
        index = restore(args.snapshot, args.data_dir)
    except (OSError, CorruptSnapshotError) as e:
        print(f"queue-server restore: {e}", file=sys.stderr)
        return 1
    print(f"restored snapshot at index {index} into {args.data_dir}")
    return 0
