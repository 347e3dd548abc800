"""The native gRPC server: listeners, TLS, and a graceful stop.

What belongs here: binding the client URLs (plain TCP, or TLS with ALPN `h2`
from an `ssl.SSLContext`), keeping the set of live `GrpcConnection`s, and
stopping: close the listeners, GOAWAY every connection, let the calls in flight
finish within a grace period, then cut what is left. Knows nothing of etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from queue_server.transport.grpc_protocol import ConnectionSettings, GrpcConnection

LISTEN_BACKLOG = 1024
"""Pending connections the kernel queues for us (benchmarks open hundreds at once)."""


class NativeServer:
    """Serves one `ConnectionSettings` (method table and limits) on its listeners."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self.connections: set[GrpcConnection] = set()
        self._servers: list[asyncio.Server] = []
        self._stopped = asyncio.Event()

    def _connection(self) -> GrpcConnection:
        conn = GrpcConnection(self.settings, self.connections.discard)
        self.connections.add(conn)
        return conn

    async def listen(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (port 0: any); returns the bound port. Raises
        OSError when the address is busy or unavailable."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            self._connection,
            host.strip("[]"),
            port,
            ssl=tls,
            backlog=LISTEN_BACKLOG,
            reuse_address=True,
            ssl_handshake_timeout=10.0 if tls is not None else None,
        )
        self._servers.append(server)
        sockets = server.sockets or ()
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def stop(self, grace: float) -> None:
        """Stop accepting, drain every connection for up to `grace` seconds,
        then cut the rest."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.drain()
        if grace > 0 and self.connections:
            waits = [asyncio.ensure_future(c.idle.wait()) for c in list(self.connections)]
            _, pending = await asyncio.wait(waits, timeout=grace)
            for w in pending:
                w.cancel()
        for conn in list(self.connections):
            conn.close_now()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
