"""docker-compose.yml and the Dockerfile: their structure, and the compose services'
own commands run as a three-member cluster of local processes (no Docker engine
here; see tests/support/compose.py for what stands in for the container runtime),
driven with etcdctl as a user of the compose setup would. docs/cluster.md's path
without Docker documents those very commands."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import subprocess
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support.compose import (
    CLIENT_PORT,
    DOCKERFILE,
    METRICS_PORT,
    ComposeCluster,
    PortMap,
    data_dir_flag,
    flag_value,
    load_compose,
    localize,
    volume_target,
)
from tests.support.processes import REPO_ROOT

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl is not installed"),
]

NAMES = ["n1", "n2", "n3"]
CLUSTER_DOC = REPO_ROOT / "docs" / "cluster.md"
CTL_TIMEOUT = 15.0
WATCH_TIMEOUT = 10.0


def etcdctl(endpoints: str, *args: str) -> str:
    """stdout of an etcdctl command that must succeed."""
    p = subprocess.run(
        ["etcdctl", f"--endpoints={endpoints}", "--command-timeout=5s", *args],
        capture_output=True,
        text=True,
        timeout=CTL_TIMEOUT,
        env={**os.environ, "ETCDCTL_API": "3"},
        check=False,
    )
    assert p.returncode == 0, f"etcdctl {' '.join(args)} failed ({p.returncode}): {p.stderr}"
    return p.stdout


def etcdctl_json(endpoints: str, *args: str) -> Any:
    return json.loads(etcdctl(endpoints, *args, "-w", "json"))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def cluster(
    compose: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ComposeCluster]:
    c = ComposeCluster.from_compose(compose, tmp_path_factory.mktemp("compose"))
    c.start()
    try:
        yield c
    finally:
        c.stop()


# -- the files -------------------------------------------------------------------


def test_compose_file_structure(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert sorted(services) == NAMES
    builds = {json.dumps(s["build"], sort_keys=True) for s in services.values()}
    assert len(builds) == 1, "every member is built from the same context and Dockerfile"
    build = services["n1"]["build"]
    context = REPO_ROOT / (build if isinstance(build, str) else build["context"])
    dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
    assert (context / dockerfile).resolve() == DOCKERFILE

    declared = set(compose["volumes"])
    published: list[int] = []
    for name, svc in services.items():
        cmd = svc["command"]
        assert flag_value(cmd, "--name") == name
        assert flag_value(cmd, "--advertise-client-urls") == f"http://{name}:{CLIENT_PORT}"
        assert flag_value(cmd, "--initial-advertise-peer-urls") == f"http://{name}:2380"
        assert flag_value(cmd, "--listen-client-urls") == f"http://0.0.0.0:{CLIENT_PORT}"
        assert flag_value(cmd, "--listen-metrics-urls") == f"http://0.0.0.0:{METRICS_PORT}"
        assert flag_value(cmd, "--initial-cluster") == ",".join(
            f"{n}=http://{n}:2380" for n in NAMES
        )
        # etcd's own cluster flags, as an etcd compose file would give them.
        assert flag_value(cmd, "--heartbeat-interval") == "100"
        assert flag_value(cmd, "--election-timeout") == "1000"
        assert flag_value(cmd, "--snapshot-count") == "10000"
        # A named volume of its own, mounted where --data-dir points.
        (volume,) = svc["volumes"]
        source = str(volume).split(":")[0]
        assert source in declared and source.startswith(name)
        assert data_dir_flag(cmd) == volume_target(svc)
        # The client port is published to the host.
        (port,) = svc["ports"]
        host_port, container_port = str(port).rsplit(":", 1)
        assert int(container_port) == CLIENT_PORT
        published.append(int(host_port))
        # Healthy when /health says so, on this container's own metrics port, asked
        # with the image's Python (the slim image has no curl).
        check = svc["healthcheck"]
        assert check["test"][:3] == ["CMD", "python", "-c"]
        assert f"'http://127.0.0.1:{METRICS_PORT}/health'" in check["test"][3]
        assert {"interval", "timeout", "retries"} <= set(check)
    assert len(set(published)) == 3, f"host ports must differ: {published}"


def documented_commands(path: Path, program: str) -> list[list[str]]:
    """The `program` commands of a Markdown file's indented code blocks, each
    with its continuation lines, as argument lists."""
    commands: list[list[str]] = []
    current: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if current is None and line.startswith("    ") and text.startswith(program + " "):
            current = ""
        if current is not None:
            current += text.removesuffix("\\") + " "
            if not text.endswith("\\"):
                commands.append(shlex.split(current))
                current = None
    return commands


def test_cluster_doc_runs_the_compose_commands_as_local_processes(
    compose: dict[str, Any],
) -> None:
    """docs/cluster.md's three members without Docker are the compose services'
    commands with each container port moved to a local one: clients on the host
    ports compose publishes, peers and metrics on the next two. The `cluster`
    fixture below runs those commands."""
    documented = {
        flag_value(c, "--name"): c[1:]
        for c in documented_commands(CLUSTER_DOC, "queue-server")
        if c[0] == "queue-server"
    }
    services = compose["services"]
    client = {name: int(str(svc["ports"][0]).split(":")[0]) for name, svc in services.items()}
    ports = PortMap(
        client=client,
        peer={name: port + 1 for name, port in client.items()},
        metrics={name: port + 2 for name, port in client.items()},
    )
    for name, svc in services.items():
        local = localize(svc["command"], name, ports, Path(f"{name}.etcd"))
        assert documented.get(name) == local, f"docs/cluster.md's {name} is not compose's"


def test_dockerfile_installs_the_package_and_etcdctl() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\S*\s*$", text, re.M)
    assert re.search(r"^RUN pip install \.", text, re.M)
    assert "etcd-client" in text
    assert re.search(r'^ENTRYPOINT \["queue-server"\]\s*$', text, re.M)
    # The entrypoint is the console script the test runs as `python -m queue_server.cli`.
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["queue-server"] == "queue_server.cli:main"
    # Every folder the package is built from is copied into the image.
    for package in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        top = package.rstrip("*")
        assert re.search(rf"^COPY {top} ", text, re.M), f"{top}/ is not copied"


# -- the cluster -----------------------------------------------------------------


def test_healthchecks_pass(cluster: ComposeCluster) -> None:
    for m in cluster.members:
        p = subprocess.run(
            m.healthcheck, capture_output=True, text=True, timeout=CTL_TIMEOUT, check=False
        )
        assert p.returncode == 0, f"{m.name}: {p.stdout}{p.stderr}"


def test_each_member_health_endpoint_says_true(cluster: ComposeCluster) -> None:
    for m in cluster.members:
        url = f"http://127.0.0.1:{m.metrics_port}/health"
        with urllib.request.urlopen(url, timeout=CTL_TIMEOUT) as resp:
            assert resp.status == 200, m.name
            assert json.load(resp) == {"health": "true", "reason": ""}, m.name


def test_put_on_one_get_on_the_others(cluster: ComposeCluster) -> None:
    n1, n2, n3 = (cluster.member(n) for n in NAMES)
    assert etcdctl(cluster.endpoints, "put", "/compose/k", "v1").strip() == "OK"
    assert etcdctl(n2.url, "get", "/compose/k") == "/compose/k\nv1\n"
    assert etcdctl(n3.url, "get", "/compose/k") == "/compose/k\nv1\n"
    # And the other way round: written on n3, read on n1.
    assert etcdctl(n3.url, "put", "/compose/k", "v2").strip() == "OK"
    assert etcdctl(n1.url, "get", "/compose/k", "--print-value-only") == "v2\n"


def test_member_list_names_every_member_with_its_client_url(cluster: ComposeCluster) -> None:
    out = etcdctl(cluster.endpoints, "member", "list")
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines()]
    # id, status, name, peer urls, client urls, is learner
    assert sorted((r[2], r[4], r[1]) for r in rows) == [
        (m.name, m.url, "started") for m in cluster.members
    ]
    ids = etcdctl_json(cluster.endpoints, "member", "list")["members"]
    assert len({m["ID"] for m in ids}) == 3


def test_endpoint_status_shows_exactly_one_leader(cluster: ComposeCluster) -> None:
    # --cluster reaches the members through the client URLs member list gives.
    statuses = etcdctl_json(cluster.member("n1").url, "endpoint", "status", "--cluster")
    assert sorted(s["Endpoint"] for s in statuses) == sorted(m.url for m in cluster.members)
    leaders = {s["Status"]["leader"] for s in statuses}
    assert len(leaders) == 1 and 0 not in leaders
    own_ids = [s["Status"]["header"]["member_id"] for s in statuses]
    assert sum(1 for i in own_ids if i in leaders) == 1
    assert len({s["Status"]["header"]["cluster_id"] for s in statuses}) == 1


class LineReader:
    """Lines of a subprocess's stdout, read by a thread, taken with a bounded wait."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def take(self, n: int, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        out: list[str] = []
        while len(out) < n:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"got {out} of {n} lines after {timeout}s") from None
            if line is None:
                raise EOFError(f"watch ended after {out}")
            out.append(line)
        return out


def test_watch_on_one_member_sees_writes_through_another(cluster: ComposeCluster) -> None:
    n1, n2 = cluster.member("n1"), cluster.member("n2")
    # Watch from the next revision on, so the watch sees the writes below even if
    # it is established after them: no race, nothing to wait for.
    rev = int(etcdctl_json(n1.url, "get", "/compose/w/")["header"]["revision"]) + 1
    watch = subprocess.Popen(
        ["etcdctl", f"--endpoints={n1.url}", "watch", "--prefix", f"--rev={rev}", "/compose/w/"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "ETCDCTL_API": "3"},
    )
    try:
        assert watch.stdout is not None
        reader = LineReader(watch.stdout)
        etcdctl(n2.url, "put", "/compose/w/a", "1")
        etcdctl(n2.url, "put", "/compose/w/b", "2")
        etcdctl(n2.url, "del", "/compose/w/a")
        assert reader.take(8, WATCH_TIMEOUT) == [
            "PUT",
            "/compose/w/a",
            "1",
            "PUT",
            "/compose/w/b",
            "2",
            "DELETE",
            "/compose/w/a",
        ]
    finally:
        watch.terminate()
        watch.wait(timeout=CTL_TIMEOUT)


def test_each_member_keeps_its_data_in_its_own_volume_folder(
    cluster: ComposeCluster, compose: dict[str, Any]
) -> None:
    for m in cluster.members:
        assert m.data_dir.is_dir() and any(m.data_dir.iterdir()), m.name
        # Nothing went to the container path or to the default ${name}.etcd.
        assert not Path(volume_target(compose["services"][m.name])).exists()
        assert not (REPO_ROOT / f"{m.name}.etcd").exists()
