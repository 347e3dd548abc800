"""Patroni (PostgreSQL HA) with its etcd3 DCS on our server: bootstrap and failover.

Patroni's `etcd3` DCS talks only to the HTTP/JSON gateway (`POST /v3/...`):
serializable ranges, nested transactions, lease grant and keep-alive, a watch
streamed over HTTP, and exact `etcdserver: ...` error strings. Here one server
of ours is the DCS of a two-node Patroni cluster of real PostgreSQL 15:

1. both nodes come up, one the leader and the other a streaming replica;
2. etcdctl sees the cluster's keys (`leader`, `members/...`, `config`,
   `initialize`) under `/service/qs-ha/`;
3. the leader's Patroni and its postmaster get SIGKILL; the replica must be
   promoted within the TTL plus a margin, and the `leader` key must name it.

Patroni is Debian's (3.0.2, `/usr/bin/patroni`, run by Debian's python3 with
`python3-psycopg2`): PostgreSQL refuses to run as root, so Patroni runs as an
unprivileged user, and pyenv's Python under /root (mode 0700) is not readable
by one. For the same reason the PostgreSQL data lives in a folder of its own
under the system temp dir, owned by that user (pytest's tmp_path is under a
0700 folder of root's); logs and configs stay in tmp_path.

Every process is ended by its pid: Patroni's from Popen, the postmasters' from
their `postmaster.pid`, their backends from psutil's children of that pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
import yaml

from tests.support.processes import ServerProcess, free_port

PATRONI_DEBIAN = "/usr/bin/patroni"
# Patroni 4.x from PyPI, installed by scripts/install-test-deps.sh (README, .ci/run) with
# `pip install --no-deps --target` (pure Python; its dependencies are Debian's, pulled by
# `patroni`): readable by the unprivileged user, run by Debian's python3.
PATRONI4_DIR = Path(os.environ.get("QS_PATRONI4_DIR", "/usr/local/lib/qs-patroni4"))
PG_BIN = Path("/usr/lib/postgresql/15/bin")
SCOPE = "qs-ha"
NAMESPACE = "/service/"
LOOP_WAIT = 1
# Patroni wants loop_wait + 2 * retry_timeout <= ttl, so a DCS hiccup
# demotes the leader before its key could expire under it; the smallest TTL
# (10, Flavour.ttl) fits 1 + 2 * 4.
RETRY_TIMEOUT = 4
# initdb, the first start, pg_basebackup and the replica's first start.
BOOTSTRAP_TIMEOUT = 90.0
# The dead leader's key lives until its lease expires (the TTL), then one or
# two of the replica's loops take it and promote: TTL plus this margin.
FAILOVER_MARGIN = 15.0
STOP_TIMEOUT = 20.0
PASSWORD = "qs-secret"

pytestmark = pytest.mark.integration


def require(present: bool, what: str) -> None:
    """Skip without `what`; under CI fail instead, since .ci/run installs it."""
    if present:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not installed, but .ci/run installs it: CI must not skip this")
    pytest.skip(f"{what} is not installed (.ci/run installs it)")


def unprivileged_user() -> pwd.struct_passwd:
    """The user Patroni and PostgreSQL run as: Debian's `postgres` (created by
    postgresql-common), else `qs-patroni`, created here when we are root."""
    for name in ("postgres", "qs-patroni"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
    if os.geteuid() != 0:
        pytest.skip("no unprivileged user to run PostgreSQL as, and not root to create one")
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "qs-patroni"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return pwd.getpwnam("qs-patroni")


@dataclass(frozen=True, slots=True)
class Flavour:
    """One Patroni: how to start it and the shortest TTL it accepts."""

    command: tuple[str, ...]
    ttl: int
    pythonpath: str = ""


@pytest.fixture(params=["debian-3.0", "pypi-4"])
def flavour(request: pytest.FixtureRequest) -> Flavour:
    """Debian's 3.0.2, or PyPI's 4.x (nested transactions, raft_term checks)
    run by Debian's python3 from PATRONI4_DIR; 4.x raises a TTL below 20 to 20."""
    require(Path(PATRONI_DEBIAN).exists(), "Debian's patroni (and python3-psycopg2)")
    require((PG_BIN / "postgres").exists(), "Debian's postgresql-15")
    require(shutil.which("etcdctl") is not None, "etcdctl")
    if request.param == "debian-3.0":
        return Flavour((PATRONI_DEBIAN,), ttl=10)
    require((PATRONI4_DIR / "patroni" / "__main__.py").exists(), f"Patroni 4.x in {PATRONI4_DIR}")
    return Flavour(("/usr/bin/python3", "-m", "patroni"), ttl=20, pythonpath=str(PATRONI4_DIR))


class PatroniNode:
    """One Patroni (and the PostgreSQL it runs), as `user`, logging to tmp_path."""

    def __init__(
        self,
        name: str,
        etcd_endpoint: str,
        data_root: Path,
        log_dir: Path,
        user: pwd.struct_passwd,
        flavour: Flavour,
    ) -> None:
        self.name = name
        self.flavour = flavour
        self.user = user
        self.api_port = free_port()
        self.pg_port = free_port()
        self.data_dir = data_root / name
        self.socket_dir = data_root / f"{name}-socket"
        self.config_path = data_root / f"{name}.yml"
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.config = self._config(etcd_endpoint, flavour.ttl)

    def _config(self, etcd_endpoint: str, ttl: int) -> dict[str, Any]:
        return {
            "scope": SCOPE,
            "namespace": NAMESPACE,
            "name": self.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{self.api_port}",
                "connect_address": f"127.0.0.1:{self.api_port}",
            },
            "etcd3": {"hosts": etcd_endpoint},
            "bootstrap": {
                "dcs": {
                    "ttl": ttl,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 1048576,
                    "postgresql": {"use_pg_rewind": False, "parameters": {"wal_level": "replica"}},
                },
                "initdb": [{"encoding": "UTF8"}, "data-checksums"],
                "pg_hba": [
                    "local all all trust",
                    "host replication replicator 127.0.0.1/32 md5",
                    "host all all 127.0.0.1/32 md5",
                ],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port}",
                "connect_address": f"127.0.0.1:{self.pg_port}",
                "data_dir": str(self.data_dir),
                "bin_dir": str(PG_BIN),
                "pgpass": str(self.socket_dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": PASSWORD},
                    "replication": {"username": "replicator", "password": PASSWORD},
                },
                "parameters": {
                    "unix_socket_directories": str(self.socket_dir),
                    "max_wal_senders": 5,
                    "max_replication_slots": 5,
                    "shared_buffers": "16MB",
                },
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }

    def start(self) -> None:
        self.socket_dir.mkdir(mode=0o700)
        os.chown(self.socket_dir, self.user.pw_uid, self.user.pw_gid)
        self.config_path.write_text(yaml.safe_dump(self.config))
        os.chown(self.config_path, self.user.pw_uid, self.user.pw_gid)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(self.socket_dir),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        }
        if self.flavour.pythonpath:
            env["PYTHONPATH"] = self.flavour.pythonpath
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.flavour.command, str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.socket_dir,
                env=env,
                user=self.user.pw_uid,
                group=self.user.pw_gid,
                extra_groups=[],
            )

    def api(self, path: str) -> tuple[int, Any]:
        """GET Patroni's REST API: (status, JSON body), (0, None) when it is down."""
        url = f"http://127.0.0.1:{self.api_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read() or b"null")
            except ValueError:
                return e.code, None
        except (OSError, ValueError):
            return 0, None

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def sql(self, query: str, check: bool = True) -> str | None:
        """One query by psql as the superuser over TCP; its single value (None
        when it fails and `check` is off)."""
        p = subprocess.run(
            [
                str(PG_BIN / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.pg_port),
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-Atc",
                query,
            ],
            capture_output=True,
            text=True,
            timeout=10,
            env={**os.environ, "PGPASSWORD": PASSWORD, "PGCONNECT_TIMEOUT": "3"},
        )
        if p.returncode != 0 and not check:
            return None
        assert p.returncode == 0, f"psql {query!r} on {self.name}: {p.stderr}"
        return p.stdout.strip()

    def kill(self) -> None:
        """SIGKILL Patroni and its postmaster (the crash of a whole machine).
        The backends notice their postmaster died and exit; they get SIGKILL too."""
        postgres = postgres_tree(self.postmaster_pid())
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT)
        kill_pids(postgres)

    def stop(self) -> None:
        """SIGTERM Patroni (it stops PostgreSQL), bounded; then SIGKILL what is left."""
        postgres = postgres_tree(self.postmaster_pid())
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT)
        kill_pids(postgres)

    def log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"--- {self.name} ---\n{text[-3000:]}"


def postgres_tree(pid: int | None) -> list[psutil.Process]:
    """A postmaster and its children, if it is a running postgres."""
    if pid is None:
        return []
    try:
        postmaster = psutil.Process(pid)
        if postmaster.name() not in ("postgres", "postmaster"):
            return []  # a stale postmaster.pid whose pid was reused
        return [postmaster, *postmaster.children(recursive=True)]
    except psutil.Error:
        return []


def kill_pids(processes: list[psutil.Process]) -> None:
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(processes, timeout=STOP_TIMEOUT)


T = TypeVar("T")


def wait_for(
    what: str, check: Callable[[], T | None], timeout: float, nodes: list[PatroniNode]
) -> T:
    """Poll `check()` until it returns something truthy, bounded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node in nodes:
            if node.proc is not None and node.proc.poll() is not None and node.proc.returncode > 0:
                raise AssertionError(f"patroni {node.name} exited while waiting for {what}")
        result = check()
        if result:
            return result
        time.sleep(0.5)
    tails = "\n".join(n.log_tail() for n in nodes)
    raise AssertionError(f"no {what} after {timeout}s\n{tails}")


def etcdctl_get_prefix(endpoint: str, prefix: str) -> dict[str, str]:
    p = subprocess.run(
        ["etcdctl", f"--endpoints={endpoint}", "get", "--prefix", prefix],
        capture_output=True,
        text=True,
        timeout=10,
        env={**os.environ, "ETCDCTL_API": "3"},
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    return dict(zip(lines[0::2], lines[1::2], strict=True))


def patronictl_list(node: PatroniNode) -> list[dict[str, Any]]:
    """`patronictl list` (Debian's, as root: it only reads) in JSON."""
    p = subprocess.run(
        ["/usr/bin/patronictl", "-c", str(node.config_path), "list", "-f", "json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    return list(json.loads(p.stdout))


@pytest.fixture
def data_root() -> Iterator[Path]:
    """A folder the unprivileged user owns (see the module docstring), removed after."""
    user = unprivileged_user()
    root = Path(tempfile.mkdtemp(prefix="qs-patroni-"))
    os.chown(root, user.pw_uid, user.pw_gid)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path / "qs").start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def nodes(
    flavour: Flavour, server: ServerProcess, data_root: Path, tmp_path: Path
) -> Iterator[list[PatroniNode]]:
    user = unprivileged_user()
    pair = [
        PatroniNode(n, server.endpoint, data_root, tmp_path, user, flavour) for n in ("pg0", "pg1")
    ]
    try:
        yield pair
    finally:
        for node in pair:
            node.stop()


def roles(nodes: list[PatroniNode]) -> tuple[PatroniNode, PatroniNode] | None:
    """(leader, replica) once one node is the leader and the other streams from it."""
    leaders = [n for n in nodes if n.api("/leader")[0] == 200]
    replicas = [n for n in nodes if n.api("/replica")[0] == 200]
    if len(leaders) != 1 or len(replicas) != 1:
        return None
    leader, replica = leaders[0], replicas[0]
    _, status = leader.api("/patroni")
    streaming = [
        r
        for r in (status or {}).get("replication", [])
        if r.get("application_name") == replica.name and r.get("state") == "streaming"
    ]
    return (leader, replica) if streaming else None


def test_bootstrap_and_failover(
    flavour: Flavour, server: ServerProcess, nodes: list[PatroniNode]
) -> None:
    started = time.monotonic()
    # The first node starts alone so it bootstraps (initdb); the second clones it.
    nodes[0].start()
    wait_for("leader", lambda: nodes[0].api("/leader")[0] == 200, BOOTSTRAP_TIMEOUT, nodes)
    nodes[1].start()
    leader, replica = wait_for("streaming replica", lambda: roles(nodes), BOOTSTRAP_TIMEOUT, nodes)
    bootstrapped = time.monotonic()

    # What Patroni keeps in the DCS, as any etcd client sees it.
    prefix = f"{NAMESPACE}{SCOPE}/"
    keys = etcdctl_get_prefix(server.endpoint, prefix)
    for key in (
        "leader",
        "config",
        "initialize",
        f"members/{leader.name}",
        f"members/{replica.name}",
    ):
        assert prefix + key in keys, sorted(keys)
    assert keys[prefix + "leader"] == leader.name
    assert json.loads(keys[prefix + "config"])["ttl"] == flavour.ttl
    assert json.loads(keys[prefix + f"members/{replica.name}"])["role"] == "replica"
    # patronictl reads the DCS with linearizable ranges, and asks each member.
    members = {m["Member"]: m for m in patronictl_list(leader)}
    assert members[leader.name]["Role"] == "Leader", members
    assert members[replica.name]["Role"] == "Replica", members

    # A row written on the leader reaches the replica.
    leader.sql("CREATE TABLE failover_probe (v text); INSERT INTO failover_probe VALUES ('before')")
    wait_for(
        "replicated row",
        lambda: (
            replica.sql("SELECT string_agg(v, ',') FROM failover_probe", check=False) == "before"
        ),
        10.0,
        nodes,
    )

    leader.kill()
    killed = time.monotonic()

    def promoted_replica() -> bool:
        # Patroni answers /leader once it holds the leader key, a moment before
        # PostgreSQL has left recovery: both must be true.
        return (
            replica.api("/leader")[0] == 200
            and replica.sql("SELECT pg_is_in_recovery()", check=False) == "f"
        )

    wait_for("promotion", promoted_replica, flavour.ttl + FAILOVER_MARGIN, nodes)
    promoted = time.monotonic()
    assert replica.sql("SELECT string_agg(v, ',') FROM failover_probe") == "before"
    keys = etcdctl_get_prefix(server.endpoint, prefix)
    assert keys[prefix + "leader"] == replica.name
    print(
        f"bootstrap {bootstrapped - started:.1f}s, failover {promoted - killed:.1f}s (ttl {flavour.ttl}s)"
    )
