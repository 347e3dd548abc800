"""A front's lifecycle: the client port serving the forwarded table (gRPC and
the HTTP/JSON gateway), the metrics and health listener, and a graceful stop.

What belongs here: composition for `queue-server --backend-endpoints`. A front
has no data dir and keeps nothing: its state is the backend connection and the
calls in flight. `/health` is the backend's health as this front sees it: a
linearizable Range through the backend, bounded as etcd bounds its own check.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from urllib.parse import parse_qs

import grpc
from grpc import aio

from etcdserverpb import cqs_pb2, rpc_pb2
from queue_server.alarms import AlarmTable
from queue_server.api.gateway_routes import GATEWAY_PAGES, gateway_settings
from queue_server.api.observer import RpcObserver
from queue_server.api.service_table import service_methods
from queue_server.config import GRPC_OVERHEAD_BYTES, Config, secure_url, url_to_address
from queue_server.errors import EtcdError, RequestTimeout
from queue_server.front.cqs import CqsFronts, FrontCqsService
from queue_server.front.forward import forward_methods
from queue_server.front.peers import Peers
from queue_server.front.queues import QueueFronts
from queue_server.front.upstream import (
    STALE_TOKEN_ERRORS,
    Upstream,
    UpstreamConfig,
    UpstreamError,
)
from queue_server.metrics import ServerMetrics
from queue_server.metrics_listener import (
    TEXT,
    HealthChecker,
    HealthListener,
    ListenError,
    Request,
    respond,
)
from queue_server.tls import TLSError, ignored_on_http, server_ssl_context
from queue_server.transport.grpc_protocol import ConnectionSettings
from queue_server.transport.h2 import STREAM_CAP, Limits
from queue_server.transport.methods import MethodTable
from queue_server.transport.server import NativeServer

log = logging.getLogger(__name__)

CQS_SERVICE = cqs_pb2.DESCRIPTOR.services_by_name["DtoChangeQueueService"]
STOP_GRACE_SECONDS = 5.0
STOPPED_MESSAGE = "etcdserver: server stopped"
HEALTH_KEY = b"health"
"""What the health check reads: etcd's own check reads this key too."""


class FrontStartError(RuntimeError):
    """The front cannot start: a flag, a file or a port."""


class BackendUnavailable(EtcdError):
    """The backend did not answer the front's health read."""

    code = "UNAVAILABLE"
    message = "etcdserver: backend unavailable"


class FrontServer:
    """One front over the backend etcd cluster named by --backend-endpoints."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.fatal = asyncio.Event()
        self.failed: str | None = None
        self.bound_ports: list[int] = []
        self.upstream: Upstream | None = None
        self.native: NativeServer | None = None
        self.health: HealthListener | None = None
        self.queues: QueueFronts | None = None
        self.cqs: CqsFronts | None = None

    async def start(self) -> None:
        cfg = self.config
        try:
            # one context for every https client URL, built (and its files checked) once
            https = any(secure_url(u) for u in cfg.listen_client_urls)
            client_tls = server_ssl_context(cfg.client_tls) if https else None
            self.upstream = Upstream(
                UpstreamConfig(
                    cfg.backend_endpoints,
                    cacert=cfg.backend_cacert,
                    cert=cfg.backend_cert,
                    key=cfg.backend_key,
                    user=cfg.backend_user,
                )
            )
            peers = Peers(cfg.client_tls)  # how this front dials the others
        except (TLSError, UpstreamError) as e:
            raise FrontStartError(str(e)) from e
        self.upstream.start()
        self.queues = QueueFronts(self.upstream, peers)
        self.cqs = CqsFronts(self.queues.session)
        self.queues.cqs_queues = self.cqs.known
        self.metrics.registry.register(self.queues.figures)
        observer = RpcObserver(self.metrics.registry, cfg.warning_apply_duration)
        cqs_service = FrontCqsService(self.cqs, cfg.cqs_visibility_timeout)
        table = MethodTable(
            [
                *forward_methods(self.upstream, self.queues),
                *service_methods(CQS_SERVICE, cqs_service),
            ]
        ).wrapped(observer.middleware)
        pages = dict.fromkeys(GATEWAY_PAGES, self._health_page)
        self.native = NativeServer(
            ConnectionSettings(
                table.by_raw_path(),
                Limits(
                    max_concurrent_streams=min(cfg.max_concurrent_streams, STREAM_CAP),
                    ping_min_interval=cfg.grpc_keepalive_min_time,
                ),
                max_receive_message=cfg.max_request_bytes + GRPC_OVERHEAD_BYTES,
                keepalive_interval=cfg.grpc_keepalive_interval,
                keepalive_timeout=cfg.grpc_keepalive_timeout,
                gateway=gateway_settings(
                    table, pages, cfg.max_request_bytes * 4 // 3 + GRPC_OVERHEAD_BYTES
                ),
                stopped_message=STOPPED_MESSAGE,
                # A front keeps no node and so no node clock: its transport times
                # its rate limits and pings on the monotonic clock, as before.
                clock=time.monotonic,
            )
        )
        for url in cfg.listen_client_urls:
            for warning in ignored_on_http(cfg.client_tls, url, "client"):
                log.warning(warning)
            host, _, port = url_to_address(url).rpartition(":")
            context = client_tls if secure_url(url) else None
            try:
                bound = await self.native.listen(host, int(port), context)
            except OSError as e:
                raise FrontStartError(f"cannot listen on {host}:{port}: {e.strerror}") from e
            if not self.bound_ports:
                self.queues.session.advertise(self._reachable_at(host, bound), secure_url(url))
            self.bound_ports.append(bound)
        self.cqs.start()
        self.health = HealthListener(
            HealthChecker(
                AlarmTable(),
                leader_id=lambda: 1,  # the backend's leader: the read below proves it
                linearize=self._backend_read,
                render_metrics=self.metrics.render,
                dashboard_state=self.queues.figures.dashboard,
            )
        )
        try:
            await self.health.start(cfg.metrics_addresses())
        except ListenError as e:
            raise FrontStartError(str(e)) from e
        log.info(
            "front ready to serve client requests listen=%s backend=%s pid=%d",
            ",".join(cfg.listen_client_urls),
            ",".join(self.upstream.addresses),
            os.getpid(),
        )

    async def _backend_read(self) -> None:
        """A linearizable Range of one key through the backend."""
        assert self.upstream is not None
        read = self.upstream.channel.unary_unary(
            "/etcdserverpb.KV/Range",
            request_serializer=rpc_pb2.RangeRequest.SerializeToString,
            response_deserializer=rpc_pb2.RangeResponse.FromString,
        )
        timeout = self.health.checker.range_timeout if self.health else 1.0
        request = rpc_pb2.RangeRequest(key=HEALTH_KEY, count_only=True)
        try:
            try:
                metadata = await self.upstream.own_metadata()
                await read(request, metadata=metadata, timeout=timeout)
            except aio.AioRpcError as e:
                if e.details() not in STALE_TOKEN_ERRORS or not self.config.backend_user:
                    raise
                metadata = await self.upstream.own_metadata(refresh=True)
                await read(request, metadata=metadata, timeout=timeout)
        except aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RequestTimeout() from None
            if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                return  # etcd's own check counts a permission error as healthy
            raise BackendUnavailable(f"{BackendUnavailable.message}: {e.details()}") from None

    def _reachable_at(self, host: str, port: int) -> str:
        """Where other fronts reach this one's first client port: its listen
        address, or for a wildcard one the first advertised client URL."""
        if host in ("", "0.0.0.0", "::", "[::]") and self.config.advertise_client_urls:
            return url_to_address(self.config.advertise_client_urls[0])
        return f"{host}:{port}"

    async def _health_page(self, path: str, query: str) -> tuple[int, str, bytes]:
        if self.health is None:
            return 503, TEXT, b"starting\n"
        request = Request("GET", path, parse_qs(query, keep_blank_values=True))
        response = await respond(self.health.checker, request)
        return response.status.value, response.content_type, response.body

    async def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        if self.native is not None:
            await self.native.stop(grace)
        if self.health is not None:
            await self.health.stop()
        if self.cqs is not None:
            await self.cqs.stop()
        if self.queues is not None:
            await self.queues.stop()
        if self.upstream is not None:
            await self.upstream.close()
