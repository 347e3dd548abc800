"""The npm `etcd3` client (Node, over @grpc/grpc-js: an HTTP/2 and gRPC stack
independent of ours and of grpcio) against a real server process.

`tests/compat/node/etcd3_suite.js` drives one server through KV (string, buffer
and number values, prefix ranges with sort and limit, delete with previous
values), txn, leases (grant, keepalive stream, put with a lease, time-to-live,
revoke), watches (live events in order with previous values, replay from a
revision, cancel, a watch at a compacted revision), the package's lock and
election recipes, namespaces, and etcd's error mapping (unknown lease,
compacted and future revisions). It prints one JSON object; the tests here
check its values. The same suite run against real etcd checks that the
expectations are etcd's.

The package is pinned in `tests/compat/node/package.json` and its lock file;
scripts/install-test-deps.sh (README, .ci/run) installs it with `npm ci`. Without node or the
installed package the tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import EtcdProcess, FrontProcess, ServerProcess

pytestmark = pytest.mark.compat

NODE_DIR = Path(__file__).resolve().parent / "node"
SUITE = NODE_DIR / "etcd3_suite.js"
SUITE_TIMEOUT = 120

# Fields that differ between servers without either being wrong.
VOLATILE = {("status", "version")}


def _need_node() -> str:
    """The node binary, with the npm etcd3 package installed beside the suite."""
    node = shutil.which("node")
    if node is None:
        missing, how = "node is not installed", "install Node 18+ with npm"
    elif not (NODE_DIR / "node_modules" / "etcd3").is_dir():
        missing = "tests/compat/node/node_modules is missing"
        how = "run `npm ci` in tests/compat/node"
    else:
        return node
    if os.environ.get("CI"):
        pytest.fail(f"{missing}, but CI needs it: .ci/run runs npm ci in tests/compat/node")
    pytest.skip(f"{missing} ({how})")


@dataclass
class SuiteRun:
    returncode: int
    stdout: str
    stderr: str
    report: dict[str, Any]

    def step(self, name: str) -> dict[str, Any]:
        errors: dict[str, str] = self.report.get("errors", {})
        assert name not in errors, f"step {name} failed: {errors[name]}"
        results: dict[str, dict[str, Any]] = self.report["results"]
        assert name in results, f"step {name} did not report: {self.stderr[-2000:]}"
        return results[name]


def run_suite(node: str, endpoint: str) -> SuiteRun:
    env = {k: v for k, v in os.environ.items() if k != "SKIP_STEPS"}
    proc = subprocess.run(
        [node, str(SUITE), endpoint],
        cwd=NODE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT,
    )
    lines = proc.stdout.strip().splitlines()
    try:
        report: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        report = {}
    return SuiteRun(proc.returncode, proc.stdout, proc.stderr, report)


@pytest.fixture(scope="module")
def node() -> str:
    return _need_node()


@pytest.fixture(scope="module")
def suite(node: str, server: ServerProcess) -> SuiteRun:
    """One run of the suite against the module's server (node checked first, so
    a missing node skips before a server starts)."""
    return run_suite(node, server.endpoint)


def test_suite_passes(suite: SuiteRun) -> None:
    detail = f"stdout: {suite.stdout[-3000:]}\nstderr: {suite.stderr[-3000:]}"
    assert suite.returncode == 0, detail
    assert suite.report["ok"] is True, detail
    assert suite.report["errors"] == {}, detail


def test_status(suite: SuiteRun) -> None:
    st = suite.step("status")
    assert st["version"].startswith("3.5.")
    assert st["leader_set"] is True


def test_put_get(suite: SuiteRun) -> None:
    r = suite.step("put_get")
    assert r["string"] == "hello"
    assert r["previous"] == "hello"
    assert r["missing"] is None
    assert r["exists"] is True
    assert r["buffer_hex"] == "0001027f80feff"
    assert r["number"] == 42
    assert r["version"] == "2"
    assert r["create_lt_mod"] is True
    assert r["header_revision_gt_put"] is True


def test_get_all_prefix_sort_limit(suite: SuiteRun) -> None:
    r = suite.step("get_all")
    assert r["all"] == {"a": "v5", "b": "v4", "c": "v3", "d": "v2", "e": "v1"}
    assert r["count"] == 5
    assert r["keys_desc_limit3"] == ["e", "d", "c"]
    assert r["by_value_limit2"] == [["e", "v1"], ["d", "v2"]]
    assert r["limit2_more"] is True
    assert r["limit2_count"] == "5"
    assert r["limit2_kvs"] == 2
    assert r["last_created"] == ["e"]


def test_delete(suite: SuiteRun) -> None:
    r = suite.step("delete")
    assert r["deleted_one"] == "1"
    assert r["deleted_missing"] == "0"
    assert r["prefix_previous"] == [["b", "B"], ["c", "C"]]
    assert r["left"] == 0


def test_txn(suite: SuiteRun) -> None:
    r = suite.step("txn")
    assert r["hit_succeeded"] is True
    assert r["hit_responses"] == ["response_put", "response_range"]
    assert r["hit_range_value"] == "v2"
    assert r["after_hit"] == "v2"
    assert r["miss_succeeded"] is False
    assert r["miss_responses"] == ["response_range", "response_put"]
    assert r["miss_range_value"] == "v2"
    assert r["after_miss"] == "v2"
    assert r["else_key"] == "ran"
    assert r["absent_version_zero"] is True
    assert r["multi_compare_succeeded"] is True
    assert r["multi_deleted"] == "1"


def test_lease_keepalive_and_revoke(suite: SuiteRun) -> None:
    r = suite.step("lease")
    assert r["id_matches_kv"] is True
    assert r["first_keepalive_id_matches"] is True
    assert r["first_keepalive_ttl"] == "3"
    assert r["second_keepalive_ttl"] == "3"
    assert r["keepalive_once_ttl"] == "3"
    assert r["ttl_granted"] == "3"
    assert r["ttl_remaining_ok"] is True
    assert r["ttl_keys"] == ["/lease/k"]
    assert r["revoked"] is True
    assert r["value_after_revoke"] is None
    assert r["ttl_after_revoke"] == "-1"


def test_watch_events_in_order_then_cancel(suite: SuiteRun) -> None:
    r = suite.step("watch")
    assert r["events"] == [
        {"type": "put", "value": "a", "prev": None},
        {"type": "put", "value": "b", "prev": "a"},
        {"type": "delete", "value": "", "prev": "b"},
    ]
    assert r["revisions_increase"] is True
    assert r["events_after_cancel"] == 0


def test_watch_replays_from_revision(suite: SuiteRun) -> None:
    assert suite.step("watch_from_revision")["replayed"] == ["one", "two"]


def test_watch_at_compacted_revision(suite: SuiteRun) -> None:
    r = suite.step("watch_compacted")
    # etcd cancels it with compact_revision set and an empty cancel_reason
    assert r["error"] == {"class": "EtcdError", "message": "Watcher canceled: "}
    assert r["live_value"] == "newer"


def test_lock(suite: SuiteRun) -> None:
    r = suite.step("lock")
    assert r["do_value"] == "done"
    assert r["key_held"] is True
    assert r["key_has_lease"] is True
    assert r["contended"] == {
        "class": "EtcdLockFailedError",
        "message": "Failed to acquire a lock on <run>/lock/l",
    }
    assert r["held_after_release"] is False
    assert r["reacquired"] is True


def test_election(suite: SuiteRun) -> None:
    r = suite.step("election")
    assert r["leader_while_c1"] == "candidate-1"
    assert r["c2_elected_while_c1_led"] is False
    assert r["leader_after_proclaim"] == "candidate-1b"
    assert r["leader_after_resign"] == "candidate-2"
    assert r["leader_at_end"] is None
    assert r["observed"] == ["candidate-1", "candidate-1b", "candidate-2", None]


def test_namespace(suite: SuiteRun) -> None:
    r = suite.step("namespace")
    assert r["inside"] == {"x": "1", "y": "2"}
    assert r["outside"] == "1"
    assert r["left_after_delete_all"] == 0


def test_etcd_errors_map_to_the_package_classes(suite: SuiteRun) -> None:
    r = suite.step("errors")
    lease_not_found = "etcdserver: requested lease not found"
    for case in ("bad_lease", "bad_revoke"):
        assert r[case]["class"] == "EtcdLeaseInvalidError", r[case]
        assert f"5 NOT_FOUND: {lease_not_found}" in r[case]["message"], r[case]
    assert r["bad_lease_wrote"] is False
    compacted = "11 OUT_OF_RANGE: etcdserver: mvcc: required revision has been compacted"
    assert r["compacted"] == {"class": "GRPCOutOfRangeError", "message": compacted}
    assert r["compact_again"] == {"class": "GRPCOutOfRangeError", "message": compacted}
    assert r["value_at_compact_revision"] == "new"
    assert r["future"] == {
        "class": "GRPCOutOfRangeError",
        "message": "11 OUT_OF_RANGE: etcdserver: mvcc: required revision is a future revision",
    }


def _comparable(report: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = json.loads(json.dumps(report["results"]))
    for step, field in VOLATILE:
        results.get(step, {}).pop(field, None)
    return results


@pytest.mark.skipif(
    os.environ.get("ETCD_GRPC_TRANSPORT") == "grpcio",
    reason="the etcd run doesn't involve our transport; the native run covers it",
)
def test_same_results_as_etcd(node: str, suite: SuiteRun, etcd: EtcdProcess) -> None:
    """The suite against real etcd passes and reports what it reports against us."""
    ref = run_suite(node, etcd.endpoint)
    assert ref.returncode == 0, f"stdout: {ref.stdout[-3000:]}\nstderr: {ref.stderr[-3000:]}"
    assert suite.returncode == 0
    assert _comparable(suite.report) == _comparable(ref.report)


def test_suite_passes_through_a_front(node: str, front: FrontProcess) -> None:
    """The same suite through a front (--backend-endpoints) over a real etcd:
    every step runs without an error, as it does against our own server."""
    run = run_suite(node, front.endpoint)
    detail = f"stdout: {run.stdout[-3000:]}\nstderr: {run.stderr[-3000:]}"
    assert run.returncode == 0, detail
    assert run.report["ok"] is True, detail
    assert run.report["errors"] == {}, detail
