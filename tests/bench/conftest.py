"""etcd's benchmark tool for the Go-tool harness tests (cluster_tool, keyspace_tool).

The tool is etcd v3.4.23's tools/benchmark: `$ETCD_BENCHMARK` (.ci/run builds it and sets it),
else /tmp/tools/etcd-benchmark, else it is built here (once per session) from its sources in
`$QS_SHARED_TOOLS/etcd-benchmark` (`tests/support/shared_tools.py`). A test that needs it is
skipped, with the reason (naming the variable when the sources are missing), when there is no
etcd/etcdctl to compare with or the tool cannot be built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import shared_tools

BUILD_SCRIPT = "etcd-benchmark/build.sh"
"""Under $QS_SHARED_TOOLS: builds the tool from the unmodified sources beside it."""
BUILD_TIMEOUT = 300


def need_etcd() -> None:
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("no etcd/etcdctl on PATH (apt-get install etcd-server etcd-client)")


@pytest.fixture(scope="session")
def etcd_benchmark(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built tool; skips the test when there is no etcd/etcdctl beside it."""
    need_etcd()
    for given in (os.environ.get("ETCD_BENCHMARK"), "/tmp/tools/etcd-benchmark"):
        if given and Path(given).is_file():
            return Path(given)
    build = shared_tools.require(BUILD_SCRIPT, "etcd's benchmark tool (no $ETCD_BENCHMARK)")
    if shutil.which("go") is None:
        pytest.skip(
            "cannot build etcd's benchmark tool: no `go` on PATH (apt-get install golang-go)"
        )
    out = tmp_path_factory.mktemp("etcd-benchmark") / "etcd-benchmark"
    built = subprocess.run(
        ["bash", str(build), str(out)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    if built.returncode != 0 or not out.exists():
        pytest.skip(f"building etcd's benchmark tool failed: {built.stderr[-2000:]}")
    return out
