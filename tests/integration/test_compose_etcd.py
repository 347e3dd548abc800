"""docker-compose.etcd.yml: three etcd members and two fronts, run as local processes.

There is no container engine here, so each service's command runs as a local
process (tests/support/compose.py's `localize` maps hostnames, ports and the
data dir): the etcd services with Debian's etcd, the fronts as
`python -m queue_server.cli`. What a user of the compose setup does is then
done with etcdctl: a write through one front is read through the other, and
each front's healthcheck command passes. Every process is ended by its pid.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.compose import (
    CLIENT_PORT,
    PortMap,
    flag_value,
    load_compose,
    local_healthcheck,
    localize,
)
from tests.support.processes import REPO_ROOT, free_port, terminate, wait_ready

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="needs Debian's etcd-server"),
]

COMPOSE_FILE = REPO_ROOT / "docker-compose.etcd.yml"
CTL_TIMEOUT = 30


def etcdctl(endpoints: str, *args: str) -> str:
    out = subprocess.run(
        ["etcdctl", f"--endpoints={endpoints}", *args],
        capture_output=True,
        text=True,
        timeout=CTL_TIMEOUT,
        env={**os.environ, "ETCDCTL_API": "3"},
        check=True,
    )
    return out.stdout


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(COMPOSE_FILE)


@pytest.fixture(scope="module")
def services(
    compose: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[int, int, list[str]]]]:
    """name -> (client port, metrics port, localized healthcheck), all running."""
    workdir = tmp_path_factory.mktemp("compose-etcd")
    specs = compose["services"]
    ports = PortMap(
        client={name: free_port() for name in specs},
        peer={name: free_port() for name in specs},
        metrics={name: free_port() for name in specs},
    )
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, tuple[int, int, list[str]]] = {}
    try:
        for name, svc in specs.items():
            data_dir = workdir / name
            args = localize(svc["command"], name, ports, data_dir)
            is_etcd = svc.get("entrypoint") == ["/usr/local/bin/etcd"]
            if is_etcd:
                assert flag_value(svc["command"], "--data-dir") == svc["volumes"][0].split(":")[1]
                cmd = ["etcd", *args]
            else:
                cmd = [sys.executable, "-m", "queue_server.cli", *args]
            with open(workdir / f"{name}.log", "ab") as log:
                procs.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
                )
            check: list[str] = []
            if "healthcheck" in svc:
                test = list(svc["healthcheck"]["test"])
                check = local_healthcheck(localize(test[1:], name, ports, data_dir))
            out[name] = (ports.client[name], ports.metrics[name], check)
        for proc, (port, _, _) in zip(procs, out.values(), strict=True):
            wait_ready(f"127.0.0.1:{port}", proc)
        yield out
    finally:
        for proc in reversed(procs):
            terminate(proc)


def test_the_file_has_three_etcd_members_and_two_fronts(compose: dict[str, Any]) -> None:
    services = compose["services"]
    etcds = [n for n, s in services.items() if s.get("entrypoint") == ["/usr/local/bin/etcd"]]
    fronts = [n for n, s in services.items() if n not in etcds]
    assert len(etcds) == 3 and len(fronts) == 2
    for name in fronts:
        backend = flag_value(services[name]["command"], "--backend-endpoints") or ""
        assert backend.split(",") == [f"http://{e}:{CLIENT_PORT}" for e in etcds]
        assert flag_value(services[name]["command"], "--data-dir") is None  # a front keeps none
        assert set(services[name]["depends_on"]) == set(etcds)
    assert set(compose["volumes"]) == {f"{e}-data" for e in etcds}


def test_a_write_through_one_front_is_read_through_the_other(
    services: dict[str, tuple[int, int, list[str]]],
) -> None:
    front1, front2 = (f"127.0.0.1:{services[n][0]}" for n in ("front1", "front2"))
    assert etcdctl(front1, "put", "/compose-etcd/k", "v1").strip() == "OK"
    assert etcdctl(front2, "get", "/compose-etcd/k", "--print-value-only") == "v1\n"
    members = etcdctl(front2, "member", "list")
    assert len(members.strip().splitlines()) == 3  # etcd's members, passed through


def test_every_fronts_healthcheck_passes(
    services: dict[str, tuple[int, int, list[str]]],
) -> None:
    for name in ("front1", "front2"):
        check = services[name][2]
        done = subprocess.run(check, capture_output=True, text=True, timeout=CTL_TIMEOUT)
        assert done.returncode == 0, f"{name}: {done.stderr}"


def test_the_fronts_keep_no_data(services: dict[str, tuple[int, int, list[str]]]) -> None:
    """The fronts' commands name no data dir, so the default one would be
    `default.etcd` in their working directory: a front must not create it."""
    assert "front1" in services
    assert not (REPO_ROOT / "default.etcd").exists()
