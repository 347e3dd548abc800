"""Composition and lifecycle of one server: data dir, recovery, gRPC, shutdown.

`Server.start()` takes the data directory (one process per directory, enforced by
a lock), recovers the state from snapshot + log, binds the client URLs and starts
serving; `Server.stop()` stops accepting calls, lets in-flight calls finish within
a grace period, flushes the log and releases the directory.
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

from grpc import aio

from etcdserverpb import (
    cqs_pb2_grpc,
    internal_pb2,
    rpc_pb2_grpc,
    v3election_pb2_grpc,
    v3lock_pb2_grpc,
)
from queue_server.api.cqs import CqsService, QueueWaiters
from queue_server.api.election import ElectionService
from queue_server.api.header import HeaderFiller
from queue_server.api.kv import KVService
from queue_server.api.lease import LeaseService
from queue_server.api.lock import LockService
from queue_server.api.maintenance import ClusterService, MaintenanceService, MemberInfo
from queue_server.api.registry import GenericHandlersOnly
from queue_server.api.watch import WatchService, run_progress_notifier
from queue_server.apply import StateMachine
from queue_server.compactor import CompactionPlanner, parse_retention, run_compactor
from queue_server.config import GRPC_OVERHEAD_BYTES, Config
from queue_server.cqs.watch_view import CqsWatchConsumers
from queue_server.errors import EtcdError, LeaseNotFound
from queue_server.lease.expiry import ExpiryClock
from queue_server.lease.ids import LeaseIdGenerator
from queue_server.mq.dispatcher import Dispatcher
from queue_server.mvcc.store import Event
from queue_server.quota import QuotaGuard
from queue_server.recipes.local_client import LocalClient
from queue_server.storage.local_log import LocalLog
from queue_server.watch.hub import WatchHub

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_SECONDS = 5.0
DISPATCHER_TICK_SECONDS = 0.5
"""How often stuck consumers and ack deadlines are checked: half a second is fine
against the 5 s stuck rule and second-granularity deadlines."""
"""How long in-flight calls may take to finish at shutdown before being cut."""


class StartupError(RuntimeError):
    """The server cannot start (port busy, data dir unusable); the message says why."""


def member_id_for(peer_urls: tuple[str, ...], cluster_token: str) -> int:
    """A member id derived the way etcd derives one: from its peer URLs and the
    cluster token, so it is stable across restarts."""
    digest = hashlib.sha1(("".join(sorted(peer_urls)) + cluster_token).encode()).digest()
    return int.from_bytes(digest[:8], "big")


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
        self.log: LocalLog | None = None
        self.grpc_server: aio.Server | None = None
        self.bound_ports: list[int] = []
        self._lock_fd = -1
        self._compactor: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self.expiry = ExpiryClock()

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

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        term = self._take_data_dir()
        self.log = LocalLog(
            cfg.data_dir,
            self.state,
            fsync=not cfg.unsafe_no_fsync,
            snapshot_count=cfg.snapshot_count,
            max_request_bytes=cfg.max_request_bytes,
        )
        try:
            self.log.recover()
        except OSError as e:
            raise StartupError(f"cannot read data dir {cfg.data_dir!r}: {e}") from e
        # Every lease gets a full TTL from now, as after an etcd leader election.
        lessor = self.state.lessor
        for lease in lessor.leases.values():
            self.expiry.granted(lease.lease_id, lease.ttl)
        lessor.on_grant = self.expiry.granted
        lessor.on_revoke = self.expiry.revoked

        member_id = member_id_for(cfg.initial_advertise_peer_urls, cfg.initial_cluster_token)
        header = HeaderFiller(
            cluster_id=cluster_id_for([member_id]),
            member_id=member_id,
            raft_term=term,
            current_revision=lambda: self.state.store.revision,
        )
        member = MemberInfo(
            member_id, cfg.name, cfg.initial_advertise_peer_urls, cfg.advertise_client_urls
        )
        server = aio.server(options=self._grpc_options())
        writes = QuotaGuard(self.log, self.state, cfg.quota_backend_bytes, member_id)
        ids = LeaseIdGenerator(member_id)
        services = GenericHandlersOnly(server)
        rpc_pb2_grpc.add_KVServicer_to_server(
            KVService(self.state, writes, header, cfg.max_txn_ops), services
        )
        rpc_pb2_grpc.add_MaintenanceServicer_to_server(
            MaintenanceService(
                self.state,
                self.log,
                header,
                lambda: _dir_size(cfg.data_dir),
                self.log.snapshot_now,
            ),
            services,
        )
        rpc_pb2_grpc.add_ClusterServicer_to_server(ClusterService(member, header), services)
        self.watch_hub = WatchHub(lambda: self.state.store, cfg.max_request_bytes)
        lessor = self.state.lessor
        self.dispatcher = Dispatcher(
            lambda: self.state.store,
            self.state.queues,
            cfg.name,
            self.log.propose,
            self._spawn,
            new_lease_id=lambda: ids.next(lessor.leases),
        )
        self.dispatcher.rebuild()
        self.watch_hub.queue_consumers = self.dispatcher
        hub_on_commit, dispatcher_on_commit = self.watch_hub.on_commit, self.dispatcher.on_commit

        def on_commit(revision: int, events: list[Event]) -> None:
            hub_on_commit(revision, events)
            dispatcher_on_commit(revision, events)

        self.state.commit_listener = on_commit
        rpc_pb2_grpc.add_WatchServicer_to_server(WatchService(self.watch_hub, header), services)
        rpc_pb2_grpc.add_LeaseServicer_to_server(
            LeaseService(self.state, writes, self.expiry, header, ids, self.dispatcher), services
        )
        self.cqs_waiters = QueueWaiters()
        cqs_view = CqsWatchConsumers(
            self.state.cqs,
            lambda: self.state.store,
            self.log.propose,
            self._spawn,
            cfg.cqs_visibility_timeout,
        )
        self.dispatcher.cqs_view = cqs_view
        waiters_notify, view_on_change = self.cqs_waiters.notify, cqs_view.on_change

        def on_cqs_change(name: str) -> None:
            waiters_notify(name)
            view_on_change(name)

        self.state.cqs.on_change = on_cqs_change
        cqs_pb2_grpc.add_DtoChangeQueueServiceServicer_to_server(
            CqsService(self.state, writes, self.cqs_waiters, cfg.cqs_visibility_timeout), services
        )
        recipes = LocalClient(self.state, writes, self.watch_hub)
        v3lock_pb2_grpc.add_LockServicer_to_server(LockService(recipes, header, ids), services)
        v3election_pb2_grpc.add_ElectionServicer_to_server(
            ElectionService(recipes, header, ids), services
        )
        for address in cfg.listen_addresses():
            try:
                port = server.add_insecure_port(address)
            except RuntimeError as e:
                raise StartupError(
                    f"cannot listen on {address}: address in use or unavailable"
                ) from e
            if port == 0:
                raise StartupError(f"cannot listen on {address}: address in use or unavailable")
            self.bound_ports.append(port)
        await server.start()
        self.grpc_server = server
        # What recovery loaded lives as long as the process: keep the collector
        # from scanning it again and again.
        gc.freeze()
        self._start_compactor()
        loop = asyncio.get_running_loop()
        self._tasks.append(
            loop.create_task(
                run_progress_notifier(self.watch_hub, cfg.watch_progress_notify_interval)
            )
        )
        self._tasks.append(loop.create_task(self.expiry.run(self._revoke_expired)))
        self._tasks.append(loop.create_task(self._tick_dispatcher()))
        log.info(
            "ready to serve client requests name=%s listen=%s data_dir=%s revision=%d term=%d",
            cfg.name,
            ",".join(cfg.listen_client_urls),
            cfg.data_dir,
            self.state.store.revision,
            term,
        )

    def _grpc_options(self) -> list[tuple[str, Any]]:
        cfg = self.config
        return [
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

    def _start_compactor(self) -> None:
        cfg = self.config
        retention = parse_retention(cfg.auto_compaction_mode, cfg.auto_compaction_retention)
        if retention <= 0:
            return
        planner = CompactionPlanner(cfg.auto_compaction_mode, retention)
        planner.last_compacted = self.state.store.compact_revision

        async def compact(revision: int) -> None:
            assert self.log is not None
            command = internal_pb2.Command()
            command.compaction.revision = revision
            result = await self.log.propose(command)
            if isinstance(result, EtcdError):
                raise result

        self._compactor = asyncio.get_running_loop().create_task(
            run_compactor(planner, lambda: self.state.store.revision, compact)
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background proposal, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _tick_dispatcher(self) -> None:
        while True:
            await asyncio.sleep(DISPATCHER_TICK_SECONDS)
            self.dispatcher.tick(time.monotonic())

    async def _revoke_expired(self, lease_id: int) -> None:
        assert self.log is not None
        command = internal_pb2.Command()
        command.lease_revoke.ID = lease_id
        result = await self.log.propose(command)
        if isinstance(result, EtcdError) and not isinstance(result, LeaseNotFound):
            raise result
        log.debug("lease expired lease=%x", lease_id)

    async def stop(self, grace: float = SHUTDOWN_GRACE_SECONDS) -> None:
        """Stop serving; in-flight calls get `grace` seconds; the log is flushed."""
        if self._compactor is not None:
            self._compactor.cancel()
        for task in self._tasks:
            task.cancel()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace)
        if self.log is not None:
            await self.log.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        log.info("stopped name=%s revision=%d", self.config.name, self.state.store.revision)

    async def wait_for_termination(self) -> None:
        if self.grpc_server is not None:
            await self.grpc_server.wait_for_termination()
