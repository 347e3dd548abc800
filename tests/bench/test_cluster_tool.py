"""`python -m benchmarks.cluster_tool --quick`: 3-member clusters of ours and of etcd, tiny sizes.

Runs the `put-spread` row (etcd's own Go load generator against all three members of each
cluster) and the `failover` row with two leader kills, and checks the report is sane: positive
rates and CPU figures, one failover sample per kill, and no acknowledged put lost. No speed
assertions (the targets are reported in the table, not enforced here).

The tool comes from the `etcd_benchmark` fixture (tests/bench/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import processes

pytestmark = pytest.mark.bench

HARNESS_TIMEOUT = 150
"""Two rows, each on a fresh cluster of each kind: about 40 s on 2 cores."""
KILLS = 2


def test_quick_put_spread_and_failover(etcd_benchmark: Path, tmp_path: Path) -> None:
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
