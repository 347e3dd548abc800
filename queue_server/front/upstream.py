"""The front's connection to the backend etcd cluster: one grpcio channel over
every endpoint, its TLS and its credentials.

What belongs here: turning `--backend-endpoints` into a channel target, the
channel options that make it fail over, the backend's TLS files, and the
front's own auth token when `--backend-user` is given. Forwarding calls is
`front/forward.py`'s.

Failover. The endpoints are resolved once, at start, into one `ipv4:`/`ipv6:`
target of every address, with the `pick_first` policy: grpc connects to the
first address that answers and, when that connection breaks, to the next one
that does, as clientv3's balancer does. A call that was never sent on a broken
connection is retried on the next one by grpc itself (its transparent retry);
a call in flight when its member dies fails with UNAVAILABLE, as it does
through clientv3, and the client decides whether to retry it.

Unary calls (every KV, Lease and queue call) go over `unary`, the front's own
HTTP/2 client, which `front/leader.py` keeps on the member that leads: etcd
proposes every write there, and a follower would forward each one.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc
from grpc import aio

from etcdserverpb import rpc_pb2
from queue_server.front.h2_client import UnaryPool
from queue_server.front.leader import LeaderPreference


class UpstreamError(ValueError):
    """`--backend-endpoints` or the backend TLS flags cannot be used."""


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """How to reach the backend: its client URLs, TLS files, and the user the
    front itself acts as (`name:password`, empty: none)."""

    endpoints: tuple[str, ...]
    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    insecure_skip_verify: bool = False


KEEPALIVE_MS = 10_000
"""Pings on an idle backend connection, so a member that vanished without a
FIN (a cut network) is noticed in seconds, not at the next call's timeout."""

MAX_MESSAGE_BYTES = 2**31 - 1
"""The front lets etcd's own limits decide (--max-request-bytes and the
client's); grpcio's 4 MiB default would refuse a large Range response that
etcd serves."""


def _addresses(endpoints: Sequence[str]) -> tuple[list[str], bool, str]:
    """(host:port of every address, whether TLS, the first host name)."""
    out: list[str] = []
    secure: set[bool] = set()
    first_host = ""
    for url in endpoints:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise UpstreamError(f"--backend-endpoints: {url!r} is not http(s)://host:port")
        secure.add(parts.scheme == "https")
        first_host = first_host or parts.hostname
        try:
            infos = socket.getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise UpstreamError(f"--backend-endpoints: cannot resolve {url!r}: {e}") from None
        for family, _, _, _, sockaddr in infos:
            ip = str(sockaddr[0])
            host = f"[{ip}]" if family == socket.AF_INET6 else ip
            address = f"{host}:{parts.port}"
            if address not in out:
                out.append(address)
    if len(secure) > 1:
        raise UpstreamError("--backend-endpoints mixes http and https URLs")
    if not out:
        raise UpstreamError("--backend-endpoints is empty")
    return out, secure == {True}, first_host


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UpstreamError(f"{flag} {path}: {e.strerror}") from None


AUTH_TIMEOUT = 5.0
AUTH_NOT_ENABLED = "etcdserver: authentication is not enabled"
STALE_TOKEN_ERRORS = frozenset({"etcdserver: invalid auth token", "etcdserver: user name is empty"})
"""What etcd answers a call whose token it no longer takes (expired, or auth
enabled since): the front authenticates again and retries once."""


class Upstream:
    """The channel to the backend, and the metadata the front's own calls carry."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        addresses, secure, first_host = _addresses(config.endpoints)
        self.addresses = addresses
        ipv6 = all(a.startswith("[") for a in addresses)
        target = ("ipv6:" if ipv6 else "ipv4:") + ",".join(addresses)
        if not ipv6 and any(a.startswith("[") for a in addresses):
            target = addresses[0]  # a mix of families: grpc takes one per target
        options: list[tuple[str, object]] = [
            ("grpc.lb_policy_name", "pick_first"),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.enable_retries", 1),
        ]
        tls: ssl.SSLContext | None = None
        if secure:
            if bool(config.cert) != bool(config.key):
                raise UpstreamError("--backend-cert and --backend-key go together")
            tls = _client_context(config)
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(config.cacert, "--backend-cacert")
                if config.cacert
                else None,
                private_key=_read(config.key, "--backend-key") if config.key else None,
                certificate_chain=_read(config.cert, "--backend-cert") if config.cert else None,
            )
            options.append(("grpc.ssl_target_name_override", first_host))
            self.channel = aio.secure_channel(target, credentials, options=options)
        else:
            if config.cert or config.key or config.cacert:
                raise UpstreamError(
                    "--backend-cacert/--backend-cert/--backend-key need https endpoints"
                )
            self.channel = aio.insecure_channel(target, options=options)
        self.unary = UnaryPool(addresses, tls, first_host)
        """Unary calls go over our own HTTP/2 client (`front/h2_client.py`);
        streams and the front's own calls over `channel`."""
        self.leader = LeaderPreference(self.unary, tls, first_host, self.own_metadata)
        """Keeps `unary` on the backend's leader (`front/leader.py`)."""
        self._token = ""
        self._token_lock = asyncio.Lock()

    def start(self) -> None:
        """The background work of the connection: following the leader."""
        self.leader.start()

    async def own_metadata(self, refresh: bool = False) -> tuple[tuple[str, str], ...]:
        """The metadata of the front's own calls: its token, when `--backend-user`
        is given and the backend's auth is on (fetched once, and again when
        `refresh` says the backend no longer takes it)."""
        if not self.config.user:
            return ()
        async with self._token_lock:
            if refresh or not self._token:
                name, _, password = self.config.user.partition(":")
                authenticate = self.channel.unary_unary(
                    "/etcdserverpb.Auth/Authenticate",
                    request_serializer=rpc_pb2.AuthenticateRequest.SerializeToString,
                    response_deserializer=rpc_pb2.AuthenticateResponse.FromString,
                )
                try:
                    reply = await authenticate(
                        rpc_pb2.AuthenticateRequest(name=name, password=password),
                        timeout=AUTH_TIMEOUT,
                    )
                except aio.AioRpcError as e:
                    if e.details() == AUTH_NOT_ENABLED:
                        self._token = ""
                        return ()  # asked again next time: auth may be enabled later
                    raise
                self._token = reply.token
        return (("token", self._token),)

    async def close(self) -> None:
        await self.leader.stop()
        await self.unary.close()
        await self.channel.close(grace=None)


def _client_context(config: UpstreamConfig) -> ssl.SSLContext:
    """TLS to the backend: its CA (or the system's), our certificate if given, ALPN h2."""
    try:
        context = ssl.create_default_context(cafile=config.cacert or None)
        if config.cert:
            context.load_cert_chain(config.cert, config.key)
    except (OSError, ssl.SSLError) as e:
        raise UpstreamError(f"backend TLS files: {e}") from None
    context.set_alpn_protocols(["h2"])
    return context
