"""Small file-system helpers shared by the WAL and the snapshot store."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a new, renamed or removed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
