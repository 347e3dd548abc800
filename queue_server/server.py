"""Composition and lifecycle of one server: data dir, recovery, gRPC, shutdown.

`Server.start()` takes the data directory (one process per directory, enforced by
a lock), recovers the state from snapshot + log, binds the client URLs and starts
serving; `Server.stop()` stops accepting calls, ends watches, keepalive streams
and long polls at once with etcd's UNAVAILABLE "etcdserver: server stopped" and
other calls in flight after a short grace, lets its own bookkeeping writes
through, flushes and closes the log and releases the directory. The `stopped`
line is the last one logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import hashlib
import json
import logging
import os
import time
from collections.abc import Coroutine
from typing import Any
from urllib.parse import parse_qs

import lmdb
from google.protobuf.descriptor import ServiceDescriptor
from grpc import aio

from etcdserverpb import (
    cqs_pb2,
    internal_pb2,
    rpc_pb2,
    v3election_pb2,
    v3lock_pb2,
)
from queue_server.api.auth import AuthService
from queue_server.api.auth_gate import AuthGate, guard
from queue_server.api.cqs import CqsService, QueueWaiters
from queue_server.api.election import ElectionService
from queue_server.api.gateway_routes import GATEWAY_PAGES, gateway_settings
from queue_server.api.header import HeaderFiller
from queue_server.api.kv import KVService
from queue_server.api.lease import LeaseService
from queue_server.api.lock import LockService
from queue_server.api.maintenance import ClusterService, MaintenanceService
from queue_server.api.observer import RpcObserver
from queue_server.api.service_table import service_methods
from queue_server.api.watch import WatchService
from queue_server.apply import Applier, ApplyFailed, StateMachine
from queue_server.auth.tokens import SimpleTokens
from queue_server.compactor import CompactionPlanner, CompactionPolicy, parse_retention
from queue_server.config import GRPC_OVERHEAD_BYTES, Config, secure_url, url_to_address
from queue_server.cqs.visibility import VisibilityTimer
from queue_server.cqs.watch_view import CqsWatchConsumers
from queue_server.dashboard import DashboardSource, QueueHistory, Redriver
from queue_server.errors import EtcdError, LeaseNotFound, ServerStopped
from queue_server.lease.expiry import ExpiryClock, ExpiryPolicy
from queue_server.lease.ids import LeaseIdGenerator
from queue_server.local_log import BackendBehindLogError, LocalLog
from queue_server.metrics import Membership as MetricsMembership
from queue_server.metrics import ServerMetrics, StateCollector
from queue_server.metrics_listener import (
    TEXT,
    HealthChecker,
    HealthListener,
    ListenError,
    Request,
    respond,
)
from queue_server.mq.ack_policy import AckPolicy
from queue_server.mq.delivery import Delivery
from queue_server.mq.session import NodeSession
from queue_server.mvcc.store import MVCCStore
from queue_server.node.consumers import ConsumerDirectory
from queue_server.node.driver import NodeDriver, NodeParts
from queue_server.node.timers import Every, Timers
from queue_server.quota import QuotaGuard
from queue_server.recipes.local_client import LocalClient
from queue_server.replication.driver import ClusterLog
from queue_server.replication.membership import MemberInfo, Membership, member_id_for
from queue_server.replication.peer_wire import PeerTransport
from queue_server.replication.storage import RaftStorage
from queue_server.storage.backend import DB_DIR, Backend
from queue_server.storage.snapshot import CorruptSnapshotError
from queue_server.storage.wal import WALCorruptError, WALGapError
from queue_server.tls import (
    Credentials,
    TLSError,
    ignored_on_http,
    load_credentials,
    server_ssl_context,
)
from queue_server.transport.grpc_protocol import ConnectionSettings
from queue_server.transport.grpcio_fallback import ServedCalls, generic_handlers, stop_grpcio
from queue_server.transport.h2 import STREAM_CAP, Limits
from queue_server.transport.methods import MethodTable
from queue_server.transport.server import FLUSH_SECONDS, NativeServer
from queue_server.watch.hub import WatchHub

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_SECONDS = 0.5
"""How long the unary calls in flight at a stop may take to finish before they
are ended with UNAVAILABLE. A write waits for one fsync (milliseconds); one
that waits longer waits for a leader, which a stopping member will not see.
Watches, keepalive streams and long polls end at once (`NativeServer.stop`)."""
BACKGROUND_GRACE_SECONDS = 0.25
"""How long a stop lets the node's own bookkeeping writes (the messages of the
consumers it just disconnected, given back to their queues) go through the log
before cancelling them; a later start redoes what did not."""


STOPPED_MESSAGE = ServerStopped.message
"""What a call ended by a stop is told, with UNAVAILABLE: etcd's ErrGRPCStopped."""


class StartupError(RuntimeError):
    """The server cannot start (port busy, data dir unusable); the message says why."""


def cluster_id_for(member_ids: list[int]) -> int:
    digest = hashlib.sha1(b"".join(m.to_bytes(8, "big") for m in sorted(member_ids))).digest()
    return int.from_bytes(digest[:8], "big")


def _dir_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while we looked (log trimming)
                total += os.path.getsize(os.path.join(root, name))
    return total


class Server:
    """One etcd-compatible member serving clients."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = StateMachine()
        self.log: LocalLog | ClusterLog | None = None
        self.cluster: ClusterLog | None = None
        """The log when this member is one of a Raft cluster (the same object)."""
        self.header: HeaderFiller | None = None
        self.peers: PeerTransport | None = None
        self.session: NodeSession | None = None
        self._published = False
        self.grpc_server: aio.Server | NativeServer | None = None
        self._grpcio_calls = ServedCalls(STOPPED_MESSAGE)
        """The calls served on grpcio (--grpc-transport grpcio), for a stop."""
        self.bound_ports: list[int] = []
        self._lock_fd = -1
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = False
        """Set once a stop has let the background writes through: none start after."""
        self.timers = Timers(time.monotonic)
        self.expiry = ExpiryClock(self.timers.clock, forward_keep_alive=self._forward_keep_alive)
        self.driver = NodeDriver(self.timers)
        self.applier = Applier(self.state, self.driver, self._apply_failed)
        self.failed: ApplyFailed | None = None
        self.fatal = asyncio.Event()
        """Set when the server must stop on its own (a failed apply)."""
        self.health: HealthListener | None = None
        self.metrics = ServerMetrics()
        self._leader_changes = 0
        self.tls = Credentials(None, None, None)

    # -- data directory -------------------------------------------------------

    def _take_data_dir(self) -> int:
        """Create and lock the data dir; returns this start's raft term."""
        data_dir = self.config.data_dir
        try:
            os.makedirs(data_dir, mode=0o700, exist_ok=True)
            fd = os.open(os.path.join(data_dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise StartupError(f"cannot use data dir {data_dir!r}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise StartupError(f"data dir {data_dir!r} is in use by another process") from e
        self._lock_fd = fd
        return self._next_term()

    def _next_term(self) -> int:
        """Each start is a new term, as each start of a one-member etcd is a new
        election (a fresh member starts at term 2)."""
        path = os.path.join(self.config.data_dir, "member.json")
        meta: dict[str, Any] = {}
        if os.path.exists(path):
            with open(path) as f:
                meta = json.load(f)
        meta["term"] = int(meta.get("term", 1)) + 1
        tmp = path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(meta, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            raise StartupError(
                f"cannot write to data dir {self.config.data_dir!r}: {e.strerror}"
            ) from e
        return int(meta["term"])

    def _disk_full(self, member_id: int) -> None:
        """The log found the disk full: raise NOSPACE, as the quota would, so
        writes are refused (capped mode) until space is freed and the alarm
        disarmed. Applied in memory, since the log has no room for it; a disarm
        goes through the log once there is room again."""
        if not self.state.alarms.no_space:
            alarm = rpc_pb2.AlarmRequest(
                action=rpc_pb2.AlarmRequest.ACTIVATE, memberID=member_id, alarm=rpc_pb2.NOSPACE
            )
            self.state.alarms.apply(alarm)
            log.warning("alarm raised alarm=NOSPACE reason=disk_full member=%x", member_id)

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        """Build the parts, hand them to the node driver, bind the ports."""
        cfg = self.config
        try:
            self.tls = load_credentials(cfg)
        except TLSError as e:
            raise StartupError(str(e)) from e
        term = self._take_data_dir()
        member_id, cluster_members = await self._open_log()
        assert self.log is not None
        if self.cluster is not None:
            term = self.cluster.term  # the Raft term, not the restart count
        header = HeaderFiller(
            cluster_id=cluster_id_for(cluster_members),
            member_id=member_id,
            raft_term=term,
            current_revision=lambda: self.state.store.revision,
        )
        self.header = header
        membership = self._membership(member_id)
        writes = QuotaGuard(self.log, self.state, cfg.quota_backend_bytes, member_id)
        ids = LeaseIdGenerator(member_id, self.timers.wall_ms)
        self._build_node(ids)
        self.writes = writes
        table = self._method_table(header, membership, writes, ids)
        self.metrics.watch_state(
            StateCollector(
                self.state,
                MetricsMembership(membership.leader_id, member_id, lambda: self._leader_changes),
                self.timers.wall,
            )
        )
        await self._serve_clients(table)
        if self.cluster is not None:
            self.cluster.on_restored = self._restored_from_leader
            await self.cluster.start()
        # What recovery loaded lives as long as the process: keep the collector
        # from scanning it again and again.
        gc.freeze()
        self._tasks.append(asyncio.get_running_loop().create_task(self.timers.run()))
        await self._serve_health(member_id, membership)
        log.info(
            "ready to serve client requests name=%s listen=%s data_dir=%s revision=%d term=%d",
            cfg.name,
            ",".join(cfg.listen_client_urls),
            cfg.data_dir,
            self.state.store.revision,
            term,
        )

    def _open_backend(self) -> Backend:
        """The state machine's LMDB environment in the data dir."""
        cfg = self.config
        try:
            return Backend(os.path.join(cfg.data_dir, DB_DIR), fsync=not cfg.unsafe_no_fsync)
        except lmdb.Error as e:
            raise StartupError(f"data dir {cfg.data_dir!r}: cannot open the backend: {e}") from e

    async def _open_log(self) -> tuple[int, list[int]]:
        """The local log or Raft, recovered; this member's id and the founders'."""
        cfg = self.config
        member_id = member_id_for(cfg.initial_advertise_peer_urls, cfg.initial_cluster_token)
        cluster_members = [member_id]
        if cfg.clustered:
            member_id, cluster_members = await self._open_cluster_log()
        else:
            self.state.use_backend(self._open_backend())
            self.log = local = LocalLog(
                cfg.data_dir,
                self.applier,
                fsync=not cfg.unsafe_no_fsync,
                snapshot_count=cfg.snapshot_count,
                max_request_bytes=cfg.max_request_bytes,
            )
            local.on_no_space = lambda: self._disk_full(member_id)
        assert self.log is not None
        try:
            self.log.recover()
        except OSError as e:
            raise StartupError(f"cannot read data dir {cfg.data_dir!r}: {e}") from e
        except (
            CorruptSnapshotError,
            WALCorruptError,
            WALGapError,
            BackendBehindLogError,
            ApplyFailed,
            lmdb.Error,
        ) as e:
            # Never serve a state that may be missing acknowledged writes.
            raise StartupError(f"data dir {cfg.data_dir!r} is damaged: {e}") from e
        # Every lease gets a full TTL from now, as after an etcd leader election.
        self._rearm_leases()
        return member_id, cluster_members

    def _membership(self, member_id: int) -> Membership:
        cfg = self.config
        me = MemberInfo(
            member_id, cfg.name, cfg.initial_advertise_peer_urls, cfg.advertise_client_urls
        )
        founders = (
            {
                member_id_for(urls, cfg.initial_cluster_token): urls
                for _, urls in cfg.initial_cluster
            }
            if cfg.clustered
            else {}
        )
        return Membership(
            self.state,
            me,
            cfg.initial_cluster_token,
            founders,
            self.cluster,
            self.peers,
            self._removed,
        )

    def _build_node(self, ids: LeaseIdGenerator) -> None:
        """The node-local parts, then the driver that feeds them what apply decides."""
        cfg = self.config
        assert self.log is not None
        lessor = self.state.lessor
        store_of = self._store_of
        propose = self.log.propose
        node_name = cfg.name.encode()
        if self.cluster is not None:
            self.session = NodeSession(
                propose, lessor, self.expiry, lambda: ids.next(lessor.leases)
            )
        clustered = self.session is not None
        self.delivery = Delivery(
            store_of,
            self.state.queues,
            node_name,
            propose,
            self._spawn,
            self.timers.clock,
            new_lease_id=lambda: ids.next(lessor.leases),
            dispatching_node=self._dispatching_node if clustered else None,
        )
        cqs_view = CqsWatchConsumers(
            self.state.cqs,
            store_of,
            propose,
            self._spawn,
            cfg.cqs_visibility_timeout,
            self.timers.clock,
            self.timers.wall_ms,
        )
        self.cqs_view = cqs_view
        self.consumers = ConsumerDirectory(
            self.state.queues,
            self.state.cqs,
            self.delivery,
            cqs_view,
            store_of,
            propose,
            self._spawn,
            session=self.session.lease if self.session is not None else None,
            dispatching_node=self._dispatching_node if clustered else None,
        )
        self.watch_hub = WatchHub(
            store_of, cfg.max_request_bytes, cfg.max_watchers_per_stream, self.consumers
        )
        self.cqs_waiters = QueueWaiters()
        self.driver.start(
            NodeParts(
                self.watch_hub,
                self.consumers,
                self.delivery,
                (self.cqs_waiters.notify, cqs_view.on_change),
                self.expiry,
            )
        )
        self.consumers.rebuild()
        self._add_timer_policies()

    def _method_table(
        self,
        header: HeaderFiller,
        membership: Membership,
        writes: QuotaGuard,
        ids: LeaseIdGenerator,
    ) -> MethodTable:
        """Every service's methods, wrapped by the observer and the auth gate."""
        cfg = self.config
        assert self.log is not None
        observer = RpcObserver(self.metrics.registry, cfg.warning_apply_duration)
        auth = AuthGate(
            self.state, SimpleTokens(self.state.auth, self.timers.clock, cfg.auth_token_ttl)
        )
        recipes = LocalClient(self.state, writes, self.watch_hub)
        etcd = rpc_pb2.DESCRIPTOR.services_by_name
        services: list[tuple[ServiceDescriptor, object]] = [
            (etcd["Auth"], AuthService(auth, writes, header, cfg.bcrypt_cost)),
            (
                etcd["KV"],
                KVService(self.state, writes, header, cfg.max_txn_ops, self.timers.wall_ms),
            ),
            (
                etcd["Maintenance"],
                MaintenanceService(
                    self.state,
                    self.log,
                    header,
                    lambda: _dir_size(cfg.data_dir),
                    self.log,
                    membership.leader_id,
                ),
            ),
            (etcd["Cluster"], ClusterService(membership, header)),
            (etcd["Watch"], WatchService(self.watch_hub, header, auth.watch_permitted)),
            (
                etcd["Lease"],
                LeaseService(
                    self.state, writes, self.expiry, header, ids, self.timers.clock, self.delivery
                ),
            ),
            (
                cqs_pb2.DESCRIPTOR.services_by_name["DtoChangeQueueService"],
                CqsService(
                    self.state,
                    writes,
                    self.cqs_waiters,
                    cfg.cqs_visibility_timeout,
                    self.timers.wall_ms,
                ),
            ),
            (v3lock_pb2.DESCRIPTOR.services_by_name["Lock"], LockService(recipes, header, ids)),
            (
                v3election_pb2.DESCRIPTOR.services_by_name["Election"],
                ElectionService(recipes, header, ids),
            ),
        ]
        # Auth: every method that needs a permission is guarded by the gate's
        # middleware (queue_server/api/auth_gate.py).
        return MethodTable(
            m for descriptor, servicer in services for m in service_methods(descriptor, servicer)
        ).wrapped(observer.middleware, lambda method: guard(method, auth))

    async def _serve_health(self, member_id: int, membership: Membership) -> None:
        """The --listen-metrics-urls listener: health, metrics, the dashboard."""
        cfg = self.config
        assert self.log is not None
        self.health = HealthListener(
            HealthChecker(
                self.state.alarms,
                membership.leader_id,
                self.log.linearize,
                self.metrics.render,
                DashboardSource(
                    self.state,
                    member_id,
                    cfg.name,
                    membership.leader_id,
                    lambda: [(m.member_id, m.name, m.client_urls) for m in membership.members()],
                    clock=self.timers.clock,
                    wall=self.timers.wall,
                    history=self.history,
                    quota=lambda: (self.writes.used_bytes(), self.writes.quota_bytes),
                ).snapshot,
                redrive=Redriver(self.state, self.writes.propose, self.timers.wall_ms),
            )
        )
        try:
            await self.health.start(cfg.metrics_addresses())
        except ListenError as e:
            raise StartupError(str(e)) from e

    def _store_of(self) -> MVCCStore:
        """The state machine's current store (a snapshot restore replaces it)."""
        return self.state.store

    def _add_timer_policies(self) -> None:
        """Everything the node does as time passes, on the driver's one clock."""
        cfg = self.config
        timers = self.timers
        timers.add("queue-acks", AckPolicy(self.delivery, self.watch_hub))
        timers.add("lease-expiry", ExpiryPolicy(self.expiry, self._revoke_expired, self._spawn))
        timers.add("cqs-visibility", self.cqs_view)
        assert self.log is not None
        cluster_log = self.cluster
        timers.add(
            "cqs-expiry",
            VisibilityTimer(
                self.state.cqs,
                self.log.propose,
                self._spawn,
                timers.wall_ms,
                # the leader's clock decides, as for lease expiry
                (lambda: cluster_log.is_leader) if cluster_log is not None else None,
            ),
        )
        self.history = QueueHistory(self.state, timers.clock())
        timers.add("dashboard-history", self.history)
        hub = self.watch_hub
        timers.add(
            "watch-progress",
            Every(cfg.watch_progress_notify_interval, lambda now: hub.progress_tick()),
        )
        if self.session is not None:
            timers.add("member-session", self.session)
        retention = parse_retention(cfg.auto_compaction_mode, cfg.auto_compaction_retention)
        if retention > 0:
            planner = CompactionPlanner(cfg.auto_compaction_mode, retention)
            planner.last_compacted = self.state.store.compact_revision
            timers.add(
                "auto-compaction",
                CompactionPolicy(
                    planner, lambda: self.state.store.revision, self._compact, self._spawn
                ),
            )

    def _apply_failed(self, error: ApplyFailed) -> None:
        """Fail-stop: an apply failed; stop serving, and exit with status 1."""
        self.failed = error
        self.fatal.set()

    async def _serve_clients(self, table: MethodTable) -> None:
        """Serve `table` on the client URLs, with the transport --grpc-transport names."""
        cfg = self.config
        if cfg.grpc_transport == "grpcio":
            server = aio.server(options=self._grpc_options())
            server.add_generic_rpc_handlers(generic_handlers(table, self._grpcio_calls))
            self.bound_ports += self._bind(server, cfg.listen_client_urls)
            await server.start()
            self.grpc_server = server
            return
        limits = Limits(
            max_concurrent_streams=min(cfg.max_concurrent_streams, STREAM_CAP),
            ping_min_interval=cfg.grpc_keepalive_min_time,
        )
        pages = dict.fromkeys(GATEWAY_PAGES, self._health_page)
        native = NativeServer(
            ConnectionSettings(
                table.by_raw_path(),
                limits,
                max_receive_message=cfg.max_request_bytes + GRPC_OVERHEAD_BYTES,
                keepalive_interval=cfg.grpc_keepalive_interval,
                keepalive_timeout=cfg.grpc_keepalive_timeout,
                # The HTTP/JSON gateway on the same port, over the same table. A
                # JSON body carries bytes in base64 (a third larger) plus names.
                gateway=gateway_settings(
                    table, pages, cfg.max_request_bytes * 4 // 3 + GRPC_OVERHEAD_BYTES
                ),
                stopped_message=STOPPED_MESSAGE,
                clock=self.timers.clock,
            )
        )
        self.grpc_server = native
        for url in cfg.listen_client_urls:
            for warning in ignored_on_http(cfg.client_tls, url, "client"):
                log.warning(warning)
            address = url_to_address(url)
            if address.startswith("unix:"):
                raise StartupError(
                    f"cannot listen on {url}: unix sockets need --grpc-transport grpcio"
                )
            host, _, port = address.rpartition(":")
            tls = server_ssl_context(cfg.client_tls) if secure_url(url) else None
            try:
                self.bound_ports.append(await native.listen(host, int(port), tls))
            except OSError as e:
                raise StartupError(
                    f"cannot listen on {address}: address in use or unavailable"
                ) from e

    async def _health_page(self, path: str, query: str) -> tuple[int, str, bytes]:
        """/health, /metrics (and the probes) on the client port, as the
        --listen-metrics-urls listener answers them."""
        if self.health is None:
            return 503, TEXT, b"starting\n"
        request = Request("GET", path, parse_qs(query, keep_blank_values=True))
        response = await respond(self.health.checker, request)
        return response.status.value, response.content_type, response.body

    def _bind(self, server: aio.Server, urls: tuple[str, ...]) -> list[int]:
        """Listen on the client URLs (grpcio): https ones with the client TLS
        credentials (config checking made sure they exist), http ones in the clear."""
        files = self.config.client_tls
        credentials = self.tls.client_server
        ports = []
        for url in urls:
            address = url_to_address(url)
            for warning in ignored_on_http(files, url, "client"):
                log.warning(warning)
            try:
                if secure_url(url):
                    assert credentials is not None, "check_tls lets no https URL go without"
                    port = server.add_secure_port(address, credentials)
                else:
                    port = server.add_insecure_port(address)
            except RuntimeError as e:
                raise StartupError(
                    f"cannot listen on {address}: address in use or unavailable"
                ) from e
            if port == 0:
                raise StartupError(f"cannot listen on {address}: address in use or unavailable")
            ports.append(port)
        return ports

    def _removed(self) -> None:
        """This member was removed from the cluster: stop serving, as etcd does."""
        log.warning("this member was removed from the cluster; stopping")
        if self.grpc_server is not None:
            self._spawn(self._stop_serving())

    async def _stop_serving(self) -> None:
        await asyncio.sleep(1.0)  # let the MemberRemove answer go out first
        await self._stop_transport(SHUTDOWN_GRACE_SECONDS)

    async def _stop_transport(self, grace: float) -> None:
        """Stop the client port's transport (see `NativeServer.stop`)."""
        server = self.grpc_server
        if isinstance(server, NativeServer):
            await server.stop(grace)
        elif server is not None:
            await stop_grpcio(server, self._grpcio_calls, grace, FLUSH_SECONDS)

    def _restored_from_leader(self) -> None:
        """A snapshot from the leader replaced the state: rebuild what follows it."""
        self._rearm_leases()
        self.consumers.rebuild()
        for name in list(self.state.cqs.queues):
            self.cqs_waiters.notify(name)

    def _rearm_leases(self) -> None:
        """Every lease gets a full TTL from now (at start, and when this member
        becomes the leader, as etcd's lessor promotion does)."""
        for lease in self.state.lessor.leases.values():
            self.expiry.granted(lease.lease_id, lease.ttl)

    async def _open_cluster_log(self) -> tuple[int, list[int]]:
        """The Raft log of a member of --initial-cluster, and the peer listener.
        Returns this member's id and the founding members' ids."""
        cfg = self.config
        ids = {
            name: member_id_for(urls, cfg.initial_cluster_token)
            for name, urls in cfg.initial_cluster
        }
        me = ids[cfg.name]
        self.state.use_backend(self._open_backend())
        storage = RaftStorage(cfg.data_dir, fsync=not cfg.unsafe_no_fsync)
        peers = PeerTransport(
            me, client_ssl=self.tls.peer_client, snapshot_dir=storage.snapshot_dir
        )
        for name, urls in cfg.initial_cluster:
            if ids[name] != me:
                peers.set_peer(ids[name], urls[0])
        heartbeat = cfg.heartbeat_interval_ms / 1000
        cluster_log = ClusterLog(
            self.applier,
            me,
            sorted(ids.values()),
            peers,
            storage,
            keep_alive=lambda lease_id: self.expiry.keep_alive(lease_id),
            heartbeat_seconds=heartbeat,
            election_ticks=max(1, round(cfg.election_timeout_ms / cfg.heartbeat_interval_ms)),
            snapshot_count=cfg.snapshot_count,
            max_request_bytes=cfg.max_request_bytes,
            join=cfg.initial_cluster_state == "existing",
        )
        self.log = self.cluster = cluster_log
        self.peers = peers
        for url in cfg.listen_peer_urls:
            for warning in ignored_on_http(cfg.peer_tls, url, "peer"):
                log.warning(warning)
        try:
            await peers.serve(list(cfg.listen_peer_urls), self.tls.peer_server, cluster_log)
        except OSError as e:
            raise StartupError(
                f"cannot listen on {','.join(cfg.listen_peer_urls)}: address in use or unavailable"
            ) from e
        cluster_log.on_leader_change = self._leader_changed
        return me, sorted(ids.values())

    def _leader_changed(self, leader: int) -> None:
        """A new leader or a new term: headers carry the term; a new leader re-arms
        lease deadlines; members publish themselves once a leader exists."""
        assert self.cluster is not None
        if self.header is not None:
            self.header.raft_term = self.cluster.term
        if leader:
            self._leader_changes += 1
        if leader == self.cluster.member_id:
            self._rearm_leases()
            self.consumers.claim_registries()
        if leader:
            self._spawn(self._publish_attributes())

    async def _publish_attributes(self) -> None:
        """Tell the cluster this member's name and URLs (once per start)."""
        if self._published or self.header is None:
            return
        self._published = True
        cfg = self.config
        command = internal_pb2.Command()
        m = command.member_attributes
        m.id = self.header.member_id
        m.name = cfg.name
        m.peer_urls.extend(cfg.initial_advertise_peer_urls)
        m.client_urls.extend(cfg.advertise_client_urls)
        assert self.log is not None
        try:
            await self.log.propose(command)
        except EtcdError as e:
            self._published = False
            log.warning("publishing member attributes failed: %s", e)

    def _dispatching_node(self) -> bytes:
        """The member whose name `/q/{name}` shows: the leader, which orders the
        assignments of messages to consumers (this member while none is known)."""
        assert self.cluster is not None
        member = self.state.members.get(self.cluster.leader_id)
        return (member[0] if member is not None else self.config.name).encode()

    def _forward_keep_alive(self, lease_id: int) -> None:
        """A keepalive on a follower also refreshes the leader's clock."""
        if self.cluster is not None:
            self.cluster.forward_keep_alive(lease_id)

    def _grpc_options(self) -> list[tuple[str, Any]]:
        """Options of grpcio's client server (--grpc-transport grpcio)."""
        cfg = self.config
        return [
            # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS (etcd's --max-concurrent-streams);
            # grpc takes a C int, and anything at or above it means "no limit".
            ("grpc.max_concurrent_streams", min(cfg.max_concurrent_streams, 2**31 - 1)),
            ("grpc.max_receive_message_length", cfg.max_request_bytes + GRPC_OVERHEAD_BYTES),
            ("grpc.max_send_message_length", 2**31 - 1),
            # Lenient keepalive enforcement, as etcd's: clients may ping every
            # --grpc-keepalive-min-time, also with no call open, without strikes.
            ("grpc.keepalive_permit_without_calls", 1),
            (
                "grpc.http2.min_recv_ping_interval_without_data_ms",
                int(cfg.grpc_keepalive_min_time * 1000),
            ),
            (
                "grpc.http2.min_ping_interval_without_data_ms",
                int(cfg.grpc_keepalive_min_time * 1000),
            ),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.keepalive_time_ms", int(cfg.grpc_keepalive_interval * 1000)),
            ("grpc.keepalive_timeout_ms", int(cfg.grpc_keepalive_timeout * 1000)),
            # A busy port must fail to bind rather than be shared.
            ("grpc.so_reuseport", 0),
        ]

    async def _compact(self, revision: int) -> None:
        """Auto-compaction's proposal (the leader compacts for everyone)."""
        assert self.log is not None
        if self.cluster is not None and not self.cluster.is_leader:
            return
        command = internal_pb2.Command()
        command.compaction.revision = revision
        result = await self.log.propose(command)
        if isinstance(result, EtcdError):
            raise result

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background proposal, keeping a reference until it ends (none
        once the server is stopping: the log is closing)."""
        if self._stopping:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _revoke_expired(self, lease_id: int) -> None:
        assert self.log is not None
        if self.cluster is not None and not self.cluster.is_leader:
            return  # the leader's clock decides; this one is re-armed if it leads
        command = internal_pb2.Command()
        command.lease_revoke.ID = lease_id
        result = await self.log.propose(command)
        if isinstance(result, EtcdError) and not isinstance(result, LeaseNotFound):
            raise result
        log.debug("lease expired lease=%x", lease_id)

    async def stop(self, grace: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Stop serving: watches, keepalive streams and long polls end at once,
        other calls in flight get `grace` seconds; then the background writes,
        then the log is flushed and closed. Logs `stopped` last."""
        if self.health is not None:
            await self.health.stop()
        for task in self._tasks:
            task.cancel()
        await self._stop_transport(grace)
        await self._end_background()
        if self.log is not None:
            await self.log.close()
        if self.peers is not None:
            await self.peers.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        log.info("stopped name=%s revision=%d", self.config.name, self.state.store.revision)

    async def _end_background(self) -> None:
        """Let the background writes in flight (those the stop caused: messages
        of disconnected consumers given back) through the log for up to
        BACKGROUND_GRACE_SECONDS, then cancel the rest and start no more."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=BACKGROUND_GRACE_SECONDS)
        self._stopping = True
        left = set(self._background)
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=BACKGROUND_GRACE_SECONDS)

    async def wait_for_termination(self) -> None:
        if self.grpc_server is not None:
            await self.grpc_server.wait_for_termination()
