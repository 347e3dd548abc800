"""The Go queue driver (tools/queue-bench) and `python -m benchmarks.queue_tool`, tiny sizes.

Builds the driver with scripts/build_queue_bench.sh, then runs the harness in quick mode on our
server alone (`--no-etcd`) for the `mq` (8 and 64 producers, and batched) and `recipe`
workloads: every run must pass the driver's delivery check (each message received once, none
missing, nothing left in the queue). A driver run that cannot finish must fail loudly: non-zero exit, `ok` false and the
reason in `failures`. No speed assertions.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import processes
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.bench

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT = 300
HARNESS_TIMEOUT = 120


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("go") is None:
        pytest.skip("no `go` on PATH (apt-get install golang-go): cannot build tools/queue-bench")
    out = tmp_path_factory.mktemp("queue-bench") / "queue-bench"
    built = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts" / "build_queue_bench.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    assert built.returncode == 0, f"build failed:\n{built.stdout}\n{built.stderr[-4000:]}"
    assert out.exists()
    return out


def run_harness(args: list[str]) -> subprocess.CompletedProcess[str]:
    return processes.run_harness("benchmarks.queue_tool", args, HARNESS_TIMEOUT)


def test_quick_mq_and_recipe_on_ours(driver: Path, tmp_path: Path) -> None:
    json_path = tmp_path / "queue-tool.json"
    md_path = tmp_path / "queue-tool.md"
    done = run_harness(
        [
            "--quick",
            "--no-etcd",
            "--workloads",
            "mq,mq-64,mq-batched,recipe",
            "--queue-tool",
            str(driver),
            "--json",
            str(json_path),
            "--out",
            str(md_path),
        ]
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-6000:]}"
    doc = json.loads(json_path.read_text())
    assert doc["meta"]["mode"] == "quick"
    runs = {r["run"]: r for r in doc["runs"]}
    assert set(runs) == {"mq", "mq-64", "mq-batched", "recipe"}
    for name, run in runs.items():
        assert run["server"] == "ours", name
        assert run["ok"], (name, run["error"])
        out = run["driver"]
        counts = out["counts"]
        total = out["params"]["total"]
        assert out["ok"] and out["failures"] == [], (name, out["failures"])
        assert counts["duplicates"] == 0, (name, counts)
        assert counts["missing"] == 0, (name, counts)
        assert counts["unknown"] == 0, (name, counts)
        assert counts["left_in_queue"] == 0, (name, counts)
        assert counts["produced"] == counts["received"] == out["count"] == total, (name, counts)
        assert out["per_second"] > 0
        assert out["server_cpu_us_per_unit"] is not None and out["server_cpu_us_per_unit"] > 0
    wide = runs["mq-64"]["driver"]["params"]
    assert (wide["producers"], wide["consumers"], wide["put_batch"], wide["ack_batch"]) == (
        64,
        8,
        1,
        1,
    )
    assert runs["mq"]["driver"]["params"]["put_batch"] == 1
    assert runs["mq-batched"]["driver"]["params"]["put_batch"] == 16
    assert runs["mq-batched"]["driver"]["params"]["ack_batch"] == 16
    # 16 puts per Txn: far fewer produce requests than messages
    batched = runs["mq-batched"]["driver"]["counts"]
    assert batched["produce_requests"] * 16 == batched["produced"]
    assert "claim_conflicts" in runs["recipe"]["driver"]["counts"]
    report = md_path.read_text()
    assert "Against the targets (issues 14 and 25)" in report
    assert "FAILED" not in report


def test_driver_fails_loudly_when_not_done_in_time(driver: Path, server: ServerProcess) -> None:
    """A run that cannot finish within --timeout reports what is missing and exits 1."""
    done = subprocess.run(
        [
            str(driver),
            "mq",
            f"--endpoint={server.endpoint}",
            "--total=500",
            "--inflight=1",
            "--producers=1",
            "--timeout=50ms",
            "--progress=0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    out = json.loads(done.stdout)
    assert out["ok"] is False
    assert any("timed out" in f for f in out["failures"]), out["failures"]
    assert out["counts"]["received"] < 500
    assert "FAILED" in done.stderr


def test_driver_rejects_bad_flags(driver: Path) -> None:
    done = subprocess.run(
        [str(driver), "mq", "--put-batch=16", "--inflight=8"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "--inflight must be at least --put-batch" in done.stderr
