"""`python -m benchmarks.keyspace_tool --quick`: issue 23's storage benchmarks, tiny sizes.

One member of each kind loaded with 4 parts of 2,000 keys, stopped with SIGTERM, restarted
on its data dir and read; a 3-member cluster of each kind loaded with 3 parts of 1,000 keys
through its leader; the growth scenario at 3,000 keys. Checks that the JSON has every field,
that every key loaded is counted after the restart (and at the end of the other scenarios),
and that the figures are positive. No speed assertions: the targets are in the table only.

The tool comes from the `etcd_benchmark` fixture (tests/bench/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import processes

pytestmark = pytest.mark.bench

HARNESS_TIMEOUT = 120
"""About 20 s on 2 cores: three scenarios, each on fresh servers of each kind."""
KEYS, PARTS = 8_000, 4
CLUSTER_KEYS, CLUSTER_PARTS = 3_000, 3
GROWTH_KEYS, GROWTH_PROBE = 3_000, 1_000

PART_FIGURES = (
    "puts_per_s",
    "tool_s",
    "slowest_ms",
    "p99_ms",
    "p50_ms",
    "server_cpu_s",
    "cpu_us_per_put",
    "rss_mb_after",
)


def check_parts(side: dict[str, Any], count: int, total: int, cluster: bool = False) -> None:
    assert len(side["parts"]) == count, side["parts"]
    assert sum(p["requests"] for p in side["parts"]) == total
    for p in side["parts"]:
        assert p["ok"], p
        assert p["error"] is None, p
        for name in PART_FIGURES:
            assert p[name] is not None and p[name] > 0, (name, p)
        assert p["slowest_ms"] >= p["p99_ms"] >= p["p50_ms"], p
        assert p["command"] and "put" in p["command"], p
        if cluster:
            assert p["raft_term_before"] >= 1 and p["raft_term_after"] >= 1, p
            assert p["raft_term_after"] >= p["raft_term_before"], p
            assert p["leader"], p
        else:
            assert p["raft_term_before"] is None and p["leader"] is None, p


def test_quick_single_restart_cluster_and_growth(etcd_benchmark: Path, tmp_path: Path) -> None:
    json_path = tmp_path / "keyspace-tool.json"
    md_path = tmp_path / "keyspace-tool.md"
    done = processes.run_harness(
        "benchmarks.keyspace_tool",
        [
            "--quick",
            "--members",
            "1,3",
            "--keys",
            str(KEYS),
            "--parts",
            str(PARTS),
            "--cluster-keys",
            str(CLUSTER_KEYS),
            "--cluster-parts",
            str(CLUSTER_PARTS),
            "--growth",
            "--growth-keys",
            str(GROWTH_KEYS),
            "--growth-probe",
            str(GROWTH_PROBE),
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
    meta = doc["meta"]
    assert meta["mode"] == "quick"
    assert (meta["key_size"], meta["val_size"], meta["same_keys"]) == (16, 256, False)
    for name in ("date", "cpus", "etcd_version", "commit", "duration_s", "command"):
        assert meta[name], (name, meta)
    scenarios = {s["scenario"]: s for s in doc["scenarios"]}
    assert list(scenarios) == ["single", "cluster", "growth"]

    single = scenarios["single"]
    assert [p["key_size"] for p in single["parts"]] == [16, 17, 18, 19]
    assert all(p["total"] == KEYS // PARTS for p in single["parts"])
    for kind in ("ours", "etcd"):
        side = single[kind]
        assert side["ok"], (kind, side["error"], side["notes"])
        assert side["keys_expected"] == KEYS
        assert side["keys_counted"] == KEYS, side
        check_parts(side, PARTS, KEYS)
        assert side["puts_per_s"] > 0 and side["slowest_ms"] > 0
        rs = side["restart"]
        assert rs["count"] == KEYS, rs  # every key there after the restart
        assert rs["first_key_found"], rs
        assert rs["first_read_tries"] >= 1, rs
        for name in (
            "stop_s",
            "first_read_s",
            "rss_mb_after_first_read",
            "count_s",
            "rss_mb_after_count",
        ):
            assert rs[name] is not None and rs[name] > 0, (name, rs)
        assert rs["stop_exit_code"] is not None, rs

    cluster = scenarios["cluster"]
    for kind in ("ours", "etcd"):
        side = cluster[kind]
        assert side["ok"], (kind, side["error"], side["notes"])
        assert side["keys_counted"] == CLUSTER_KEYS, side
        check_parts(side, CLUSTER_PARTS, CLUSTER_KEYS, cluster=True)
        assert side["raft_term_start"] >= 1, side
        assert side["raft_term_end"] >= side["raft_term_start"], side
        assert side["restart"] is None

    growth = scenarios["growth"]
    assert [p["total"] for p in growth["parts"]] == [GROWTH_PROBE, 1_000, GROWTH_PROBE]
    for kind in ("ours", "etcd"):
        side = growth[kind]
        assert side["ok"], (kind, side["error"], side["notes"])
        assert side["keys_counted"] == GROWTH_KEYS, side
        check_parts(side, 3, GROWTH_KEYS)
        assert side["growth_ratio"] > 0, side

    # Every row of every table has a figure on both sides (elections may be 0).
    for sc in doc["scenarios"]:
        for row in sc["rows"]:
            elections = row["row"].startswith("elections")
            for kind in ("ours", "etcd"):
                assert row[kind] is not None, (sc["scenario"], row)
                assert row[kind] >= 0 if elections else row[kind] > 0, (sc["scenario"], row)
            if row["better"] in ("higher", "lower") and not elections:
                assert row["ours_over_etcd"] > 0, (sc["scenario"], row)

    report = md_path.read_text()
    assert "## One member: 8,000 puts in 4 parts, then a restart" in report
    assert "## Three members: 3,000 puts in 3 parts through the leader" in report
    assert "| restart to first read, s |" in report
    assert "| part 3: raft term after |" in report
    assert "| last / first put rate |" in report
    assert "FAILED" not in report
