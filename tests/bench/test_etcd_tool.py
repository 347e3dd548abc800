"""`python -m benchmarks.etcd_tool --quick`: ours and etcd side by side under etcd's own tool.

Runs the `put64` and `range64` rows (etcd v3.4.23's tools/benchmark against a fresh server of
each kind, one after the other) and checks the report: both sides ran, positive rates, latencies
and server CPU per request, no tool errors, the ratio is ours over etcd, and the Markdown names
every row. No speed assertions. The tool comes from the `etcd_benchmark` fixture
(tests/bench/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import processes

pytestmark = pytest.mark.bench

HARNESS_TIMEOUT = 150
"""Two rows, each on a fresh server of each kind: about 30 s on 2 cores."""


def test_quick_put_and_range_on_both_servers(etcd_benchmark: Path, tmp_path: Path) -> None:
    json_path = tmp_path / "etcd-tool.json"
    md_path = tmp_path / "etcd-tool.md"
    done = processes.run_harness(
        "benchmarks.etcd_tool",
        [
            "--quick",
            "--workloads",
            "put64,range64",
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
    rows = {r["workload"]: r for r in doc["results"]}
    assert list(rows) == ["put64", "range64"]
    for name, row in rows.items():
        for kind in ("ours", "etcd"):
            side = row[kind]
            assert side["ok"], (name, kind, side["error"])
            report = side["report"]
            assert report["rps"] > 0 and report["requests"] == row["count"], (name, kind, report)
            assert not report["errors"], (name, kind, report["errors"])
            assert 0 < report["percentiles_ms"]["50"] <= report["percentiles_ms"]["99"]
            assert side["cpu_us_per_request"] > 0, (name, kind)
        ratio = row["ours"]["report"]["rps"] / row["etcd"]["report"]["rps"]
        assert row["ours_over_etcd"] == pytest.approx(ratio)
    report_md = md_path.read_text()
    assert "| put64 |" in report_md and "| range64 |" in report_md
    assert "FAILED" not in report_md
