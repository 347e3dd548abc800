"""How one front reaches another front's client port.

What belongs here: the address a front id names, and `Peers`, the connections to the
fronts this one calls: a produce or an ack handed to the queue's dispatching front
(`direct.py`, over our HTTP/2 client) and a CQS call forwarded to it (`cqs.py`, over
a grpc channel, which also carries ReEnqueue's stream).

A front id is `{uuid}@{host}:{port}` for a front whose first client URL is http, and
`{uuid}@https://{host}:{port}` for one whose first client URL is https. Such a front
is dialled over TLS as etcd members dial each other's https peer URLs: its
certificate is verified against this front's `--trusted-ca-file` (the system roots
when none) and must name the host, and this front's `--cert-file`, when it has one,
is presented as the client certificate (a front with `--client-cert-auth` asks for
one). Fronts of one deployment therefore share a CA, as etcd members do.
"""

from __future__ import annotations

import ssl

import grpc
from grpc import aio

from queue_server.config import TLSFiles
from queue_server.front.h2_client import UnaryPool
from queue_server.tls import channel_credentials, peer_client_ssl_context

TLS_MARK = b"https://"


def front_id(uuid: bytes, address: str, tls: bool) -> bytes:
    """The id of the front `uuid` whose client port is `address` (host:port)."""
    return b"%s@%s%s" % (uuid, TLS_MARK if tls else b"", address.encode())


def front_address(front: bytes) -> tuple[str, bool]:
    """The host:port a front id names ("" when it names none), and whether that
    port is served over TLS."""
    at = front.partition(b"@")[2]
    if at.startswith(TLS_MARK):
        return at[len(TLS_MARK) :].decode(), True
    return at.decode(), False


class Peers:
    """One unary pool and one grpc channel per front this one calls, plain or TLS as
    that front's id says (module docstring); the TLS files are read at start."""

    def __init__(self, files: TLSFiles) -> None:
        self._context: ssl.SSLContext = peer_client_ssl_context(files)
        self._context.set_alpn_protocols(["h2"])
        self._credentials: grpc.ChannelCredentials = channel_credentials(files)
        self._pools: dict[bytes, UnaryPool] = {}
        self._channels: dict[bytes, aio.Channel] = {}

    def pool(self, front: bytes) -> UnaryPool:
        """Unary calls to the front `front` names."""
        key = front.partition(b"@")[2]  # the scheme and address: fronts there share it
        pool = self._pools.get(key)
        if pool is None:
            address, tls = front_address(front)
            host = address.rpartition(":")[0].strip("[]")
            pool = self._pools[key] = (
                UnaryPool([address], tls=self._context, server_hostname=host, connections=1)
                if tls
                else UnaryPool([address], connections=1)
            )
        return pool

    def channel(self, front: bytes) -> aio.Channel:
        """A grpc channel to the front `front` names."""
        key = front.partition(b"@")[2]
        channel = self._channels.get(key)
        if channel is None:
            address, tls = front_address(front)
            channel = self._channels[key] = (
                aio.secure_channel(address, self._credentials)
                if tls
                else aio.insecure_channel(address)
            )
        return channel

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.close()
        self._pools.clear()
        for channel in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()
