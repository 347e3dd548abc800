"""TLS on the client and peer URLs: loading credentials.

What belongs here: reading and checking the PEM files named by etcd's TLS flags
(`--cert-file`, `--key-file`, `--trusted-ca-file`, `--client-cert-auth` and their
`--peer-*` twins), turning them into gRPC credentials and `ssl.SSLContext`s for
the listeners and for the connections to the other members (the peer wire,
`queue_server/replication/peer_wire.py`, takes contexts). Who a client is (its
certificate's CN) each transport reads from its own connection.
No I/O besides reading those files; no server state. Imports grpc and
`queue_server.config`, nothing else of ours.

Theory of operation, as etcd 3.5:

- An `https://` listen URL is served with the side's certificate and key; an
  `http://` one stays plain (given certificate flags are then ignored with a
  warning, as etcd warns).
- With `--client-cert-auth` (`--peer-client-cert-auth`) the TLS handshake refuses
  a caller without a certificate signed by `--trusted-ca-file`
  (`--peer-trusted-ca-file`). Without it no certificate is asked for.
- A member dials `https://` peer URLs verifying the peer's certificate against
  `--peer-trusted-ca-file` (the system roots when not given) and presents its own
  `--peer-cert-file` as the client certificate, so the same certificate is a
  server and a client certificate.
- With `--client-cert-auth` the common name (CN) of a client's verified
  certificate is its user name when auth is enabled: the auth layer asks
  `Call.client_common_name()` when a request carries no token (each transport
  reads it from its own TLS connection; grpcio's auth context in
  `transport/grpcio_fallback.py`).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from queue_server.config import Config, TLSFiles, secure_url


class TLSError(ValueError):
    """A TLS file is unreadable or not what its flag needs; the message says which."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """What the server binds and dials with; None where that side has no TLS files."""

    client_server: grpc.ServerCredentials | None
    peer_server: ssl.SSLContext | None
    peer_client: ssl.SSLContext | None


def load_credentials(config: Config) -> Credentials:
    """Read and check the TLS files the config needs; raises TLSError.

    Files of a side with no https listener are not read (etcd ignores them, with
    the warnings of `ignored_on_http`); the peer client context is made when
    any member has an https peer URL or peer TLS files are given."""
    peer = config.peer_tls
    serves_tls = any(secure_url(u) for u in config.listen_client_urls)
    peer_serves_tls = any(secure_url(u) for u in config.listen_peer_urls)
    peer_dials_tls = any(secure_url(u) for _, urls in config.initial_cluster for u in urls)
    return Credentials(
        client_server=server_credentials(config.client_tls) if serves_tls else None,
        peer_server=peer_server_ssl_context(peer) if peer_serves_tls else None,
        peer_client=peer_client_ssl_context(peer)
        if peer_dials_tls or not peer.empty or peer.trusted_ca_file
        else None,
    )


def server_credentials(files: TLSFiles) -> grpc.ServerCredentials | None:
    """Credentials for a side's https listeners, or None without cert and key."""
    if files.empty:
        return None
    cert, key = _key_pair(files)
    ca = _ca(files) if files.trusted_ca_file else None
    if files.client_cert_auth:
        if ca is None:  # check_tls refuses this for https URLs already
            raise TLSError(
                f"{files.flag('client-cert-auth')} needs {files.flag('trusted-ca-file')}"
            )
        return grpc.ssl_server_credentials([(key, cert)], ca, require_client_auth=True)
    return grpc.ssl_server_credentials([(key, cert)])


def server_ssl_context(files: TLSFiles) -> ssl.SSLContext:
    """TLS for the native transport's https client listeners: our certificate,
    ALPN h2 (gRPC) or http/1.1 (the HTTP/JSON gateway; h2 preferred), TLS 1.2 or later (as etcd), and with --client-cert-auth a client
    certificate signed by --trusted-ca-file (checked by `load_credentials` first)."""
    context = _listener_context(files)
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


def peer_server_ssl_context(files: TLSFiles) -> ssl.SSLContext:
    """TLS for the peer wire's https --listen-peer-urls, from the --peer-* files:
    our --peer-cert-file, TLS 1.2 or later, and with --peer-client-cert-auth a
    member that dials in must present a certificate signed by
    --peer-trusted-ca-file. Raises TLSError for unusable files."""
    _key_pair(files)
    if files.client_cert_auth:
        if not files.trusted_ca_file:  # check_tls refuses this for https URLs already
            raise TLSError(
                f"{files.flag('client-cert-auth')} needs {files.flag('trusted-ca-file')}"
            )
        _ca(files)
    return _listener_context(files)


def peer_client_ssl_context(files: TLSFiles) -> ssl.SSLContext:
    """TLS for dialling a peer's https URL on the peer wire, as the gRPC channel
    credentials do: the peer's certificate must be signed by --peer-trusted-ca-file
    (the system roots when none) and name the host of its URL; our
    --peer-cert-file, if given, is presented as the client certificate. Raises
    TLSError for unusable files."""
    ca = _ca(files).decode("ascii") if files.trusted_ca_file else None
    context = ssl.create_default_context(cadata=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if not files.empty:
        _key_pair(files)
        context.load_cert_chain(files.cert_file, files.key_file)
    return context


def _listener_context(files: TLSFiles) -> ssl.SSLContext:
    """Our certificate, TLS 1.2 or later, and with client-cert-auth a certificate
    signed by the trusted CA required of every caller."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(files.cert_file, files.key_file)
    if files.client_cert_auth:
        context.load_verify_locations(files.trusted_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    """Credentials for dialling a peer's https URL: verify it against the trusted
    CA (the system roots when none), and present our certificate if we have one."""
    ca = _ca(files) if files.trusted_ca_file else None
    if files.empty:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    cert, key = _key_pair(files)
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def ignored_on_http(files: TLSFiles, url: str, kind: str) -> list[str]:
    """etcd's warnings for an http URL while TLS flags are set (they do not apply)."""
    if secure_url(url):
        return []
    warnings = []
    if not files.empty:
        warnings.append(
            f"scheme is HTTP while key and cert files are present; "
            f"ignoring key and cert files {kind}_url={url}"
        )
    if files.client_cert_auth:
        warnings.append(
            f"scheme is HTTP while {files.flag('client-cert-auth')} is enabled; "
            f"ignoring client cert auth for this URL {kind}_url={url}"
        )
    return warnings


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TLSError(f"cannot read {flag} {path!r}: {e.strerror}") from e


def _key_pair(files: TLSFiles) -> tuple[bytes, bytes]:
    """(certificate chain, private key), checked to be PEM and to belong together
    (gRPC would only find out at the first handshake)."""
    cert = _read(files.cert_file, files.flag("cert-file"))
    key = _read(files.key_file, files.flag("key-file"))
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(files.cert_file, files.key_file)
    except (ssl.SSLError, ValueError) as e:
        raise TLSError(
            f"{files.flag('cert-file')} {files.cert_file!r} and {files.flag('key-file')} "
            f"{files.key_file!r} are not a PEM certificate and its private key: {e}"
        ) from e
    return cert, key


def _ca(files: TLSFiles) -> bytes:
    flag = files.flag("trusted-ca-file")
    ca = _read(files.trusted_ca_file, flag)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=ca.decode("ascii"))
    except (ssl.SSLError, ValueError) as e:
        raise TLSError(f"{flag} {files.trusted_ca_file!r} holds no PEM certificate: {e}") from e
    return ca
