"""The argument set every Go-driven harness shares (`benchmarks/options.py`), in-process.

Each harness's parser is built from `add_common_args`; a usage error must exit with status 2
and name what is wrong, and what resolves must be what the harness then runs with.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from benchmarks import cluster_tool, etcd_tool, keyspace_tool, queue_tool
from benchmarks.options import add_common_args, chosen_workloads, resolve_common_args
from benchmarks.servers import REPO_ROOT

pytestmark = [pytest.mark.bench, pytest.mark.unit]

HARNESSES = [etcd_tool, queue_tool, cluster_tool, keyspace_tool]


def parser(**kwargs: object) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness")
    add_common_args(p, 10.0, 100.0, **kwargs)  # type: ignore[arg-type]
    return p


@pytest.mark.parametrize("harness", HARNESSES, ids=lambda m: m.__name__.split(".")[-1])
def test_every_harness_takes_the_shared_options(
    harness: object, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        harness.parse_args(["--help"])  # type: ignore[attr-defined]
    assert ended.value.code == 0
    text = capsys.readouterr().out
    for option in ("--quick", "--tool", "--queue-tool", "--etcd", "--ours-dir", "--out", "--json"):
        assert option in text, option
    assert "--timeout" in text


def test_workloads_keep_their_order_and_an_unknown_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    p = parser(workloads=["a", "b", "c"])
    by_name = {"a": 1, "b": 2, "c": 3}
    assert chosen_workloads(p, p.parse_args([]).workloads, by_name) == [1, 2, 3]
    assert chosen_workloads(p, "c, a", by_name) == [3, 1]
    with pytest.raises(SystemExit) as ended:
        chosen_workloads(p, "a,zz", by_name)
    assert ended.value.code == 2
    assert "unknown workload(s) ['zz']; choose from a,b,c" in capsys.readouterr().err


def test_ours_dir_without_a_server_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("no etcd/etcdctl on PATH (apt-get install etcd-server etcd-client)")
    p = parser()
    args = p.parse_args(["--ours-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as ended:
        resolve_common_args(p, args, 10.0, 100.0, need_tool=False)
    assert ended.value.code == 2
    assert f"no queue_server/cli.py in --ours-dir {tmp_path}" in capsys.readouterr().err


def test_resolved_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("etcdctl") is None:
        pytest.skip("no etcdctl on PATH (apt-get install etcd-client)")
    p = parser(etcd_optional=True)
    args = p.parse_args(["--no-etcd", "--quick"])
    resolve_common_args(p, args, 10.0, 100.0, need_tool=False)
    assert args.etcd is None
    assert args.ours_dir == REPO_ROOT
    assert args.timeout == 10.0
    args = p.parse_args(["--no-etcd", "--timeout", "7"])
    resolve_common_args(p, args, 10.0, 100.0, need_tool=False)
    assert args.timeout == 7.0
    missing = tmp_path / "no-such-driver"
    args = p.parse_args(["--no-etcd", "--queue-tool", str(missing)])
    with pytest.raises(SystemExit) as ended:
        resolve_common_args(p, args, 10.0, 100.0, need_tool=False, need_queue_tool=True)
    assert ended.value.code == 2
    assert f"no queue driver at {missing}" in capsys.readouterr().err
