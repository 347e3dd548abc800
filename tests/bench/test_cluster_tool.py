"""`python -m benchmarks.cluster_tool --quick`: 3-member clusters of ours and of etcd, tiny sizes.

Runs the `put-spread` row (etcd's own Go load generator against all three members of each
cluster) and the `failover` row with two leader kills, and checks the report is sane: positive
rates and CPU figures, one failover sample per kill, and no acknowledged put lost. No speed
assertions (the targets are reported in the table, not enforced here).

The tool is etcd v3.4.23's tools/benchmark: `$ETCD_BENCHMARK` (.ci/run builds it and sets it),
else /tmp/tools/etcd-benchmark, else it is built here from its sources in
`$QS_SHARED_TOOLS/etcd-benchmark` (`tests/support/shared_tools.py`); without them the test is
skipped, naming the variable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import processes, shared_tools

pytestmark = pytest.mark.bench

BUILD_SCRIPT = "etcd-benchmark/build.sh"
"""Under $QS_SHARED_TOOLS: builds the tool from the unmodified sources beside it."""
BUILD_TIMEOUT = 300
HARNESS_TIMEOUT = 150
"""Two rows, each on a fresh cluster of each kind: about 40 s on 2 cores."""
KILLS = 2


@pytest.fixture(scope="module")
def etcd_benchmark(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for given in (os.environ.get("ETCD_BENCHMARK"), "/tmp/tools/etcd-benchmark"):
        if given and Path(given).is_file():
            return Path(given)
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("no etcd/etcdctl on PATH (apt-get install etcd-server etcd-client)")
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


def test_quick_put_spread_and_failover(etcd_benchmark: Path, tmp_path: Path) -> None:
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("no etcd/etcdctl on PATH (apt-get install etcd-server etcd-client)")
    json_path = tmp_path / "cluster-tool.json"
    md_path = tmp_path / "cluster-tool.md"
    done = processes.run_harness(
        "benchmarks.cluster_tool",
        [
            "--quick",
            "--workloads",
            "put-spread,failover",
            "--kills",
            str(KILLS),
            "--tool",
            str(etcd_benchmark),
            "--json",
            str(json_path),
            "--out",
            str(md_path),
        ],
        HARNESS_TIMEOUT,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-6000:]}"
    doc = json.loads(json_path.read_text())
    assert doc["meta"]["mode"] == "quick"
    rows = {r["workload"]: r for r in doc["rows"]}
    assert set(rows) == {"put-spread", "failover"}

    for kind in ("ours", "etcd"):
        put = rows["put-spread"][kind]
        assert put["ok"], (kind, put["error"])
        assert put["rate"] > 0, put
        assert put["requests"] > 0, put
        assert put["server_cpu_us_per_request"] > 0, put
        assert put["tool_cpu_us_per_request"] > 0, put
        assert put["p50_ms"] > 0, put
        assert put["p99_ms"] >= put["p50_ms"], put
        assert len(put["detail"]["endpoints"]) == 3, put["detail"]
        assert not put["detail"]["report"]["errors"], put["detail"]["report"]["errors"]

        fo = rows["failover"][kind]
        assert fo["ok"], (kind, fo["error"])
        detail = fo["detail"]
        assert len(detail["samples_s"]) == KILLS, detail
        assert all(0 < s < 20 for s in detail["samples_s"]), detail
        assert min(detail["samples_s"]) <= fo["figure_s"] <= max(detail["samples_s"])
        assert detail["acked_puts"] > 0, detail
        assert detail["lost_puts"] == [], detail
        assert len(detail["killed"]) == KILLS

    assert rows["put-spread"]["ours_over_etcd"] > 0
    report = md_path.read_text()
    assert "| put-spread |" in report and "| failover |" in report
    assert "FAILED" not in report
