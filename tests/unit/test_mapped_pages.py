"""The backend lets go of the LMDB pages its reads and commits leave mapped
(`storage.mapped_pages`): they count in the process's RSS though they are page
cache, and a large keyspace would show hundreds of MB of them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from queue_server.storage import backend as backend_module
from queue_server.storage.backend import Backend, CommitBatch

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="madvise and /proc/self/maps are Linux's"
)

ROWS = 60_000
ROW = b"n" * 200


def rss_file_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_the_pages_a_scan_touches_are_released_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend_module, "RELEASE_PAGES_FROM_BYTES", 1 << 20)
    backend = Backend(str(tmp_path), fsync=False)
    try:
        assert backend.mapped.found
        rows = {b"%08d" % i: ROW for i in range(ROWS)}
        backend.commit(CommitBatch(index=7, tables={"cqs": rows}))
        assert backend.mapped.releases == 1, "a commit into a large file releases its pages"
        backend.renew_reader()

        before = rss_file_kib()
        assert sum(1 for _ in backend.table_rows("cqs")) == ROWS
        scanned = rss_file_kib()
        file_kib = backend.file_bytes >> 10
        assert scanned - before > file_kib // 2, "the scan maps the file's pages"

        backend.release_mapped_pages()
        assert rss_file_kib() < scanned - file_kib // 2, "released pages leave the RSS"
        # Nothing is lost: the reader faults them back in.
        assert dict(backend.table_rows("cqs")) == rows
        assert backend.consistent_index == 7
    finally:
        backend.close()


def test_a_small_file_keeps_its_pages(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path), fsync=False)
    try:
        backend.commit(CommitBatch(index=1, tables={"mq": {b"k": b"v"}}))
        backend.release_mapped_pages()
        assert backend.mapped.releases == 0
    finally:
        backend.close()


def test_a_swapped_in_copy_is_found_again(tmp_path: Path) -> None:
    backend = Backend(str(tmp_path / "db"), fsync=False)
    try:
        backend.commit(CommitBatch(index=3, tables={"mq": {b"k": b"v"}}))
        backend.copy_compacted(str(tmp_path / "copy"))
        backend.swap_in(str(tmp_path / "copy"))
        assert backend.mapped.found
        assert dict(backend.table_rows("mq")) == {b"k": b"v"}
    finally:
        backend.close()
