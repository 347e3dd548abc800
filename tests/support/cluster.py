"""A cluster of our server processes on loopback, for tests.

Each member is a `ServerProcess` with its own client and peer port and data dir;
`--initial-cluster` names them all. Who leads is read from Maintenance.Status on
every live member (bounded polls, never sleeps as synchronisation).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.peer_proxy import PeerProxy
from tests.support.processes import ServerProcess, free_port, wait_ready

LEADER_TIMEOUT = 20.0


class Member(ServerProcess):
    """One member: a server process that knows its peer port."""

    def __init__(
        self,
        data_dir: Path,
        peer_port: int,
        cluster_args: list[str],
        listen_peer_port: int | None = None,
        peer_scheme: str = "http",
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """`peer_port` is the advertised one; the member listens on
        `listen_peer_port` when a proxy stands in between. `peer_scheme` https
        needs the --peer-* TLS flags in `cluster_args`; `credentials`, an https
        client URL (see `ServerProcess`)."""
        self.peer_port = peer_port
        peer = f"{peer_scheme}://127.0.0.1:{peer_port}"
        listen = f"{peer_scheme}://127.0.0.1:{listen_peer_port or peer_port}"
        super().__init__(
            data_dir,
            extra_args=[
                "--listen-peer-urls",
                listen,
                "--initial-advertise-peer-urls",
                peer,
                *cluster_args,
            ],
            credentials=credentials,
        )
        self.stopped = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and not self.stopped

    def pause(self) -> None:
        """SIGSTOP: the member is cut off (no traffic in or out) but keeps its state."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def status(self, timeout: float = 2.0) -> rpc_pb2.StatusResponse:
        with self.channel() as ch:
            response: rpc_pb2.StatusResponse = rpc_pb2_grpc.MaintenanceStub(ch).Status(
                rpc_pb2.StatusRequest(), timeout=timeout
            )
            return response


class Cluster:
    """`size` members started together with one --initial-cluster."""

    def __init__(
        self,
        root: Path,
        size: int = 3,
        extra_args: list[str] | None = None,
        proxied: bool = False,
        peer_scheme: str = "http",
        member_args: dict[str, list[str]] | None = None,
    ) -> None:
        """With `proxied`, each member's peer traffic comes in through a
        `PeerProxy` (see `proxy_of`), so a test can cut a member off. With
        `peer_scheme` https the --peer-* TLS flags go in `extra_args`;
        `member_args` (by name, n1...) come after them, so they win."""
        names = [f"n{i + 1}" for i in range(size)]
        peers = {name: free_port() for name in names}
        initial = ",".join(f"{n}={peer_scheme}://127.0.0.1:{p}" for n, p in peers.items())
        args = ["--initial-cluster", initial, "--initial-cluster-token", "test-cluster"]
        args += list(extra_args or [])
        self.proxies: dict[str, PeerProxy] = {}
        self.members = []
        for name in names:
            listen = None
            if proxied:
                listen = free_port()
                self.proxies[name] = PeerProxy(peers[name], listen).start()
            own = args + (member_args or {}).get(name, [])
            self.members.append(Member(root / name, peers[name], own, listen, peer_scheme))

    def proxy_of(self, member: Member) -> PeerProxy:
        return self.proxies[member.data_dir.name]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> Cluster:
        self.start_members()
        self.wait_leader()
        return self

    def start_members(self) -> None:
        """Start every member and wait until each serves clients (not for a leader)."""
        for m in self.members:
            m.start(wait=False)
        for m in self.members:
            assert m.proc is not None
            wait_ready(m.endpoint, m.proc, credentials=m.credentials)

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            if m.stopped:
                m.resume()
            m.stop()

    def by_id(self, member_id: int) -> Member:
        for m in self.members:
            if m.alive and m.status().header.member_id == member_id:
                return m
        raise LookupError(f"no live member {member_id:x}")

    def wait_leader(self, timeout: float = LEADER_TIMEOUT, exclude: Member | None = None) -> Member:
        """The member every live member (but `exclude`) names as leader."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                live = [m for m in self.members if m.alive and m is not exclude]
                leaders = {m.status().leader for m in live}
                if len(leaders) == 1 and 0 not in leaders:
                    (leader_id,) = leaders
                    found = self.by_id(leader_id)
                    if found is not exclude:
                        return found
                last = f"members name {sorted(leaders)}"
            except (grpc.RpcError, LookupError) as e:
                last = str(e)
            time.sleep(0.05)  # a poll interval, bounded by the deadline
        raise TimeoutError(f"no single leader after {timeout}s: {last}")
