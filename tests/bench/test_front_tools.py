"""`benchmarks.front_tool --quick` and `benchmarks.front_queue_tool --quick`: the harnesses of
fronts over etcd run end to end and report what they say they do. No speed assertions.

front_tool runs put64 and range64 straight to a fresh etcd, through a front and through etcd's
grpc-proxy, and put64 so over a 3-member etcd (every path given all three members);
front_queue_tool runs etcd's queue recipe and tools/queue-bench `mq` through 1, 2 and 3 fronts
over a 3-member etcd, then SIGKILLs the dispatching front. The Go tools come from
the `etcd_benchmark` fixture (tests/bench/conftest.py) and scripts/build_queue_bench.sh.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support import processes

pytestmark = pytest.mark.bench

REPO_ROOT = Path(__file__).resolve().parents[2]
HARNESS_TIMEOUT = 240
BUILD_TIMEOUT = 300


def run_front_tool(etcd_benchmark: Path, out: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """`benchmarks.front_tool --quick` with `flags`; (its JSON, its Markdown)."""
    json_path, md_path = out / "front.json", out / "front.md"
    done = processes.run_harness(
        "benchmarks.front_tool",
        [
            *("--quick", *flags, "--tool", str(etcd_benchmark)),
            *("--json", str(json_path), "--out", str(md_path)),
        ],
        HARNESS_TIMEOUT,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-6000:]}"
    return json.loads(json_path.read_text()), md_path.read_text()


def test_quick_kv_straight_through_a_front_and_through_grpc_proxy(
    etcd_benchmark: Path, tmp_path: Path
) -> None:
    doc, text = run_front_tool(etcd_benchmark, tmp_path)
    assert [r["workload"] for r in doc["rows"]] == ["put64", "range64"]
    for row in doc["rows"]:
        assert set(row["paths"]) == {"etcd", "front", "grpc-proxy"}
        for path, side in row["paths"].items():
            result = side["result"]
            assert result["ok"], (row["workload"], path, result["error"])
            assert result["report"]["rps"] > 0 and not result["report"]["errors"]
            assert side["etcd_cpu_s"] > 0
    assert "| put64 | front |" in text and "| range64 | grpc-proxy |" in text


def test_quick_put_over_a_three_member_etcd_names_its_leader(
    etcd_benchmark: Path, tmp_path: Path
) -> None:
    doc, text = run_front_tool(etcd_benchmark, tmp_path, "--members", "3", "--workloads", "put64")
    assert doc["meta"]["members"] == 3
    (row,) = doc["rows"]
    for path, side in row["paths"].items():
        result = side["result"]
        assert result["ok"] and result["report"]["rps"] > 0, (path, result["error"])
        assert result["command"][1].count(",") == (2 if path == "etcd" else 0)
        assert any(note.startswith("etcd's leader is n") for note in result["notes"])
    assert "- put64, front: etcd's leader is n" in text


def test_quick_queue_through_fronts_and_the_failover(tmp_path: Path) -> None:
    if shutil.which("go") is None or shutil.which("etcd") is None:
        pytest.skip("needs `go` (tools/queue-bench) and Debian's etcd-server")
    driver = tmp_path / "queue-bench"
    built = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "build_queue_bench.sh"), str(driver)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    json_path = tmp_path / "front-queue.json"
    done = processes.run_harness(
        "benchmarks.front_queue_tool",
        ["--quick", "--queue-tool", str(driver), "--kills", "2", "--json", str(json_path)],
        HARNESS_TIMEOUT,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-6000:]}"
    doc = json.loads(json_path.read_text())
    assert list(doc["rows"]) == ["recipe", "recipe-4", "fronts=1", "fronts=2", "fronts=3"]
    for name, row in doc["rows"].items():
        assert row["ok"] and row["per_second"] > 0, (name, row.get("failures"))
        assert row["cpu_s"]["etcd"] > 0
    assert doc["failover"]["ok"] and len(doc["failover"]["seconds"]) == 2
    assert all(0 < s < 20 for s in doc["failover"]["seconds"])
