"""The LMDB file's pages mapped into this process: finding the map and letting go of them.

LMDB reads through a read-only shared mapping of its data file. Every page a
read or a commit's tree walk touches stays mapped into the process after it,
and counts in its resident set (`RssFile`), although it is page cache the
kernel may reclaim at any time. A restart's scan of 1,000,000 key revisions, or
a commit into a table of 5,000,000 CQS notifications, leaves hundreds of MB of
them, and `VmRSS` (what operators and quotas read) shows the process as that
much larger.

`MappedPages.release` drops the process's mappings of those pages with
`madvise(MADV_DONTNEED)`. For a shared file mapping that loses nothing: the
pages stay in the page cache, and the next read of one faults it back in (a
minor fault, no disk read while the kernel keeps it cached). LMDB's map is
never written through (the environment is opened without `writemap`), so no
dirty page is dropped either.

Linux only; elsewhere `release` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

__all__ = ["MappedPages"]

_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def _map_start(data_file: str) -> int | None:
    """The start address of this process's mapping of `data_file`, from
    /proc/self/maps (None if it is not mapped or the table is unreadable)."""
    try:
        target = os.stat(data_file)
        with open("/proc/self/maps", "rb") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6:
                    continue
                inode = int(fields[4])
                if inode != target.st_ino:
                    continue
                if os.fsdecode(fields[5].rstrip(b"\n")) != data_file:
                    continue
                return int(fields[0].split(b"-")[0], 16)
    except (OSError, ValueError):
        return None
    return None


class MappedPages:
    """One LMDB data file's mapping in this process (see the module docstring).

    Made after the environment is opened, and made again after it is reopened
    (a defragment's swap maps the new file elsewhere).
    """

    def __init__(self, data_file: str):
        self.data_file = os.path.abspath(data_file)
        self._start = _map_start(self.data_file) if _madvise is not None else None
        self.releases = 0
        """How many times `release` dropped pages (for tests and metrics)."""

    @property
    def found(self) -> bool:
        """Whether the mapping was found (False off Linux)."""
        return self._start is not None

    def release(self) -> None:
        """Drop the process's mapped pages of the file, up to its current size
        (any thread; concurrent readers fault what they touch back in)."""
        if self._start is None or _madvise is None:
            return
        try:
            size = os.path.getsize(self.data_file)
        except OSError:
            return
        length = (size + _PAGE - 1) // _PAGE * _PAGE
        if length and _madvise(self._start, length, _MADV_DONTNEED) == 0:
            self.releases += 1
