"""The native gRPC server: listeners, TLS, and a graceful stop.

What belongs here: binding the client URLs (plain TCP, or TLS with ALPN `h2`
from an `ssl.SSLContext`), keeping the set of live `GrpcConnection`s, and
stopping them. Knows nothing of etcd.

A stop, in order: close the listeners; GOAWAY every connection; end the calls
that would never end by themselves (`Method.waits`: watches, keepalive
streams, long polls) with UNAVAILABLE at once; give the other calls in flight
up to a grace period, then end them too; let each connection write what it has and close (a client
that reads gets its trailers and GOAWAY within milliseconds); cut, after
`FLUSH_SECONDS`, the connections of clients that do not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from queue_server.transport.grpc_protocol import ConnectionSettings, GrpcConnection

LISTEN_BACKLOG = 1024
"""Pending connections the kernel queues for us (benchmarks open hundreds at once)."""
FLUSH_SECONDS = 2.0
"""How long a stop lets connections write their last bytes (trailers, GOAWAY)
before cutting them. A client that reads takes milliseconds; one that does not
read (a full socket or no flow-control window) would hold the stop forever."""


class NativeServer:
    """Serves one `ConnectionSettings` (method table and limits) on its listeners."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self.connections: set[GrpcConnection] = set()
        self._servers: list[asyncio.Server] = []
        self._stopped = asyncio.Event()
        self._no_connections = asyncio.Event()
        self._no_connections.set()

    def _connection(self) -> GrpcConnection:
        conn = GrpcConnection(self.settings, self._forget)
        self.connections.add(conn)
        self._no_connections.clear()
        return conn

    def _forget(self, conn: GrpcConnection) -> None:
        self.connections.discard(conn)
        if not self.connections:
            self._no_connections.set()

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
        """Stop accepting; end the waiting calls at once, the other calls
        in flight after up to `grace` seconds; close every connection once its
        last bytes are written (cut after `FLUSH_SECONDS`)."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.drain()
            conn.end_calls(waiting_only=True)
        busy = [c for c in self.connections if c.serving]
        if grace > 0 and busy:
            waits = [asyncio.ensure_future(c.idle.wait()) for c in busy]
            _, pending = await asyncio.wait(waits, timeout=grace)
            for w in pending:
                w.cancel()
        for conn in list(self.connections):
            conn.end_calls(waiting_only=False)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_connections.wait(), FLUSH_SECONDS)
        for conn in list(self.connections):
            conn.close_now()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
