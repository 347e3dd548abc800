"""Run the services of docker-compose.yml as local processes, for tests.

This machine has the Docker client but no engine, so the compose file is read with
PyYAML and each service's `command` is run as `python -m queue_server.cli` (what
the image's `queue-server` entrypoint runs), with what Docker would provide
replaced by local equivalents:

- service hostnames (and the wildcard or loopback host a member listens on) by
  127.0.0.1;
- the container ports 2379 (clients), 2380 (peers) and 2381 (/health, the
  metrics listener) of each service by free loopback ports of its own;
- the image's `python` (the healthcheck's interpreter) by the test's own;
- the data dir, where the service mounts its named volume, by a folder per service
  under the test's tmp dir.

Every process is ended by its own pid in `ComposeCluster.stop`. Readiness is
awaited by calling Maintenance.Status (bounded), never by sleeping.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import REPO_ROOT, STOP_TIMEOUT, free_port

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
CLIENT_PORT = 2379
PEER_PORT = 2380
METRICS_PORT = 2381
LOCAL_HOSTS = frozenset({"0.0.0.0", "localhost", "127.0.0.1"})
"""Hosts that mean "this container" in a service's own command or healthcheck."""
READY_TIMEOUT = 20.0

_URL = re.compile(r"(?P<scheme>https?)://(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d+)")


def load_compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    assert isinstance(doc, dict), f"{path} is not a YAML mapping"
    return doc


def volume_target(service: Mapping[str, Any]) -> str:
    """Where the service mounts its (single) named volume."""
    targets = [str(v).split(":")[1] for v in service.get("volumes", [])]
    assert len(targets) == 1, f"expected one volume, got {service.get('volumes')}"
    return targets[0]


@dataclass(frozen=True)
class PortMap:
    """Where each service's container ports are on this machine."""

    client: Mapping[str, int]
    peer: Mapping[str, int]
    metrics: Mapping[str, int]

    def port(self, host: str, port: int) -> int:
        tables = {CLIENT_PORT: self.client, PEER_PORT: self.peer, METRICS_PORT: self.metrics}
        table = tables.get(port)
        if table is None:
            raise ValueError(f"no local mapping for container port {port} of {host}")
        return table[host]


def localize(args: Sequence[str], service: str, ports: PortMap, data_dir: Path) -> list[str]:
    """A service's command (or healthcheck) with hostnames, ports and the data dir
    replaced by their local equivalents. `data_dir` replaces the volume's path."""
    target = data_dir_flag(args)

    def url(m: re.Match[str]) -> str:
        host = m["host"]
        if host in LOCAL_HOSTS:
            host = service
        if host not in ports.client:
            raise ValueError(f"{service}: URL {m[0]} names no compose service")
        return f"{m['scheme']}://127.0.0.1:{ports.port(host, int(m['port']))}"

    out: list[str] = []
    for arg in args:
        if target is not None and arg in (target, f"--data-dir={target}"):
            arg = arg.replace(target, str(data_dir))
        out.append(_URL.sub(url, arg))
    return out


def local_healthcheck(args: Sequence[str]) -> list[str]:
    """A healthcheck run with this machine's interpreter where the image's is named."""
    program, *rest = args
    return [sys.executable if program == "python" else program, *rest]


def data_dir_flag(args: Sequence[str]) -> str | None:
    return flag_value(args, "--data-dir")


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in `args`, given as `--flag=X` or `--flag X`."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


@dataclass
class Member:
    """One compose service run as a local process."""

    name: str
    args: list[str]
    healthcheck: list[str]
    client_port: int
    metrics_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class ComposeCluster:
    """The services of a compose file, each a local `queue-server` process."""

    members: list[Member] = field(default_factory=list)

    @classmethod
    def from_compose(cls, compose: Mapping[str, Any], workdir: Path) -> ComposeCluster:
        services: Mapping[str, Any] = compose["services"]
        ports = PortMap(
            client={name: free_port() for name in services},
            peer={name: free_port() for name in services},
            metrics={name: free_port() for name in services},
        )
        members = []
        for name, svc in services.items():
            data_dir = workdir / name
            assert data_dir_flag(svc["command"]) == volume_target(svc)
            test = list(svc["healthcheck"]["test"])
            assert test[0] == "CMD", f"{name}: healthcheck must be exec form"
            members.append(
                Member(
                    name=name,
                    args=localize(svc["command"], name, ports, data_dir),
                    healthcheck=local_healthcheck(localize(test[1:], name, ports, data_dir)),
                    client_port=ports.client[name],
                    metrics_port=ports.metrics[name],
                    data_dir=data_dir,
                    log_path=workdir / f"{name}.log",
                )
            )
        return cls(members)

    @property
    def endpoints(self) -> str:
        """All client URLs, comma-separated, as etcdctl --endpoints takes them."""
        return ",".join(m.url for m in self.members)

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def start(self) -> ComposeCluster:
        for m in self.members:
            with open(m.log_path, "ab") as log:
                m.proc = subprocess.Popen(
                    [sys.executable, "-m", "queue_server.cli", *m.args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO_ROOT,
                    env=os.environ.copy(),
                )
        try:
            self.wait_for_leader()
        except BaseException:
            self.stop()
            raise
        return self

    def statuses(self) -> dict[str, rpc_pb2.StatusResponse]:
        """Maintenance.Status of every member that answers now."""
        out: dict[str, rpc_pb2.StatusResponse] = {}
        for m in self.members:
            with grpc.insecure_channel(m.endpoint) as ch, contextlib.suppress(grpc.RpcError):
                out[m.name] = rpc_pb2_grpc.MaintenanceStub(ch).Status(
                    rpc_pb2.StatusRequest(), timeout=1.0
                )
        return out

    def wait_for_leader(self, timeout: float = READY_TIMEOUT) -> int:
        """Block until every member answers Status and names the same leader, and
        every member has published its name (member list); return the leader's id."""
        deadline = time.monotonic() + timeout
        seen: dict[str, tuple[int, int]] = {}
        while time.monotonic() < deadline:
            for m in self.members:
                assert m.proc is not None
                if m.proc.poll() is not None:
                    raise RuntimeError(f"{m.name} exited with {m.proc.returncode}:\n{m.log_tail()}")
            statuses = self.statuses()
            seen = {name: (s.leader, s.header.member_id) for name, s in statuses.items()}
            leaders = {leader for leader, _ in seen.values()}
            if len(seen) == len(self.members) and len(leaders) == 1 and 0 not in leaders:
                leader = leaders.pop()
                if self._all_published():
                    return leader
            time.sleep(0.1)  # poll interval of a bounded wait, not synchronisation
        logs = "\n".join(f"--- {m.name}\n{m.log_tail()}" for m in self.members)
        raise TimeoutError(f"no common leader after {timeout}s: {seen}\n{logs}")

    def _all_published(self) -> bool:
        with grpc.insecure_channel(self.members[0].endpoint) as ch:
            try:
                resp = rpc_pb2_grpc.ClusterStub(ch).MemberList(
                    rpc_pb2.MemberListRequest(), timeout=1.0
                )
            except grpc.RpcError:
                return False
        return sorted(m.name for m in resp.members) == sorted(m.name for m in self.members)

    def stop(self) -> None:
        """SIGTERM every process this cluster started, then wait for each (SIGKILL
        after STOP_TIMEOUT)."""
        running = [m.proc for m in self.members if m.proc is not None]
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT)
