"""Start and stop real server processes (ours and, where installed, etcd) for tests.

Every process listens on 127.0.0.1 on a free port, keeps its data in a folder the
test owns, and is ended by its own pid. Readiness is awaited by calling
Maintenance.Status until it answers (bounded), never by sleeping.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import grpc

# Re-exported: the tests take free_port from here, beside the process helpers.
from benchmarks.servers import free_port as free_port
from etcdserverpb import rpc_pb2, rpc_pb2_grpc

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def open_channel(endpoint: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to `endpoint`: TLS with `credentials`, plain without."""
    if credentials is None:
        return grpc.insecure_channel(endpoint)
    return grpc.secure_channel(endpoint, credentials)


def wait_ready(
    endpoint: str,
    proc: subprocess.Popen[bytes] | None,
    timeout: float = READY_TIMEOUT,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Block until the server at `endpoint` answers Status (or fail); a TLS
    server is asked over TLS with `credentials`."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        with open_channel(endpoint, credentials) as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=1.0)
                rpc_pb2_grpc.MaintenanceStub(ch).Status(rpc_pb2.StatusRequest(), timeout=2.0)
                return
            except (grpc.FutureTimeoutError, grpc.RpcError) as e:
                last = e
    raise TimeoutError(f"server at {endpoint} not ready after {timeout}s: {last}")


def until_answered(call: Callable[[], object], bound: float, what: str) -> None:
    """Make `call` until it is answered, while it fails as a call to a member
    that went away does (UNAVAILABLE, DEADLINE_EXCEEDED) and for at most `bound`
    seconds; any other failure fails at once."""
    start = time.monotonic()
    while True:
        try:
            call()
            return
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            took = time.monotonic() - start
            assert took < bound, f"{what}: still not answered after {took:.1f}s: {e}"


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """End a process we started: SIGTERM, then SIGKILL if it has not exited
    within STOP_TIMEOUT."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT)


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`queue-server ARGS` to its end (bounded): for startup failures and restore."""
    return subprocess.run(
        [sys.executable, "-m", "queue_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
    )


def run_harness(module: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m MODULE ARGS` (a benchmark harness) to its end, bounded: past
    `timeout` it gets SIGTERM, so it stops the servers and drivers it started by
    their pids, then SIGKILL; the test fails with the end of its stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"{module} did not finish in {timeout}s\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class ServerProcess:
    """Our server, run as `python -m queue_server.cli` in its own process."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        extra_args: list[str] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """With `credentials` the client URL is https (the TLS flags go in
        `extra_args`) and readiness is asked over TLS with them."""
        self.data_dir = data_dir
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self.credentials = credentials
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        scheme = "http" if self.credentials is None else "https"
        return f"{scheme}://{self.endpoint}"

    def channel(self) -> grpc.Channel:
        """A channel to the client URL (TLS when the server serves https)."""
        return open_channel(self.endpoint, self.credentials)

    def command(self) -> list[str]:
        url = self.url
        return [
            sys.executable,
            "-m",
            "queue_server.cli",
            "--name",
            self.data_dir.name,
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            *self.extra_args,
        ]

    def start(self, wait: bool = True) -> Self:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=os.environ.copy(),
            )
        if wait:
            try:
                wait_ready(self.endpoint, self.proc, credentials=self.credentials)
            except BaseException:
                self.kill()  # not ready: a fixture that fails here never stops it
                raise
        return self

    def stop(self) -> int:
        """SIGTERM and wait: a clean shutdown. Returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT)
            raise

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=STOP_TIMEOUT)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class EtcdProcess:
    """A real etcd (Debian's etcd-server) for side-by-side comparisons."""

    @classmethod
    def restored_from(cls, snapshot: Path, data_dir: Path) -> EtcdProcess:
        """An etcd (not started) whose data dir `etcdctl snapshot restore` made
        from the bbolt `snapshot`, as a one-member cluster of its own."""
        etcd = cls(data_dir)
        peer = f"http://127.0.0.1:{etcd.peer_port}"
        subprocess.run(
            [
                *("etcdctl", "snapshot", "restore", str(snapshot), "--data-dir", str(data_dir)),
                *("--name", "ref", "--initial-cluster", f"ref={peer}"),
                *("--initial-advertise-peer-urls", peer),
            ],
            capture_output=True,
            timeout=60,
            check=True,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
        return etcd

    def __init__(
        self,
        data_dir: Path,
        extra_args: list[str] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """With `credentials` the client URL is https (its TLS flags go in
        `extra_args`) and readiness is asked over TLS with them."""
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.extra_args = list(extra_args or [])
        self.credentials = credentials

    @staticmethod
    def available() -> bool:
        return shutil.which("etcd") is not None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'http' if self.credentials is None else 'https'}://{self.endpoint}"

    def start(self) -> EtcdProcess:
        url = self.url
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            "etcd",
            "--name",
            "ref",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"ref={peer}",
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_ready(self.endpoint, self.proc, credentials=self.credentials)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc)


class EtcdCluster:
    """Three real etcd members (Debian's etcd-server) forming one cluster, on
    127.0.0.1 ports of their own; each is ended by its pid."""

    def __init__(self, workdir: Path, size: int = 3) -> None:
        self.members = [EtcdProcess(workdir / f"e{i}.etcd") for i in range(1, size + 1)]
        self.names = [f"e{i}" for i in range(1, size + 1)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def initial_cluster(self) -> str:
        return ",".join(
            f"{n}=http://127.0.0.1:{m.peer_port}"
            for n, m in zip(self.names, self.members, strict=True)
        )

    def start_member(self, i: int, state: str = "new") -> None:
        m, name = self.members[i], self.names[i]
        url, peer = f"http://{m.endpoint}", f"http://127.0.0.1:{m.peer_port}"
        cmd = [
            *("etcd", "--name", name, "--data-dir", str(m.data_dir)),
            *("--listen-client-urls", url, "--advertise-client-urls", url),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", self.initial_cluster()),
            *("--initial-cluster-state", state, "--initial-cluster-token", "front-tests"),
            *("--heartbeat-interval", "50", "--election-timeout", "500"),
        ]
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def start(self) -> EtcdCluster:
        for i in range(len(self.members)):
            self.start_member(i)
        for m in self.members:
            wait_ready(m.endpoint, m.proc)
        return self

    def leader(self) -> int:
        """The index of the member that leads now (asked of every live member)."""
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            with grpc.insecure_channel(m.endpoint) as ch:
                try:
                    st = rpc_pb2_grpc.MaintenanceStub(ch).Status(rpc_pb2.StatusRequest(), timeout=2)
                except grpc.RpcError:
                    continue
                if st.leader == st.header.member_id:
                    return self.members.index(m)
        raise RuntimeError("no etcd member says it leads")

    def kill(self, i: int) -> None:
        proc = self.members[i].proc
        assert proc is not None
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT)

    def restart(self, i: int) -> None:
        self.start_member(i, state="existing")
        wait_ready(self.members[i].endpoint, self.members[i].proc)

    def stop(self) -> None:
        for m in self.members:
            m.stop()


class FrontProcess(ServerProcess):
    """Our server as a front (`--backend-endpoints`) over real etcd endpoints.
    `data_dir` names its log file; a front creates nothing there."""

    def __init__(
        self, data_dir: Path, backend: list[str], extra_args: list[str] | None = None
    ) -> None:
        self.backend = backend
        self.backend_etcd: EtcdProcess | None = None
        """The one etcd behind it, when a fixture started one for it alone."""
        backend_urls = ",".join(e if "://" in e else f"http://{e}" for e in backend)
        # a front serves on the native transport only: the flag wins over an
        # ETCD_GRPC_TRANSPORT=grpcio that a test run may set for our servers
        args = ["--backend-endpoints", backend_urls, "--grpc-transport", "native"]
        super().__init__(data_dir, extra_args=[*args, *(extra_args or [])])
