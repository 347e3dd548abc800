"""One frozen `Config` built from etcd-style flags and their ETCD_* variables.

Flag names are etcd's wherever the meaning is etcd's. Every flag `--some-flag` can
also be set by the environment variable `ETCD_SOME_FLAG`; a flag given on the
command line wins over the variable, as in etcd.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn
from urllib.parse import urlsplit

from queue_server.compactor import parse_retention
from queue_server.durations import parse_go_duration
from queue_server.quota import DEFAULT_QUOTA_BYTES
from queue_server.watch.hub import DEFAULT_MAX_WATCHERS_PER_STREAM

SERVER_VERSION = "3.5.17"
"""The etcd release whose API we match (Status, /version, --version); clients
gate features on it."""

DEFAULT_MAX_REQUEST_BYTES = 1536 * 1024
"""etcd's default --max-request-bytes (1.5 MiB)."""
GRPC_OVERHEAD_BYTES = 512 * 1024
"""etcd lets gRPC receive this much more than --max-request-bytes, so that a
request slightly over the limit gets etcd's "request is too large" rather than a
transport error."""


DEFAULT_MAX_CONCURRENT_STREAMS = 2**32 - 1
"""etcd's default --max-concurrent-streams (math.MaxUint32: no limit)."""
DEFAULT_HEARTBEAT_MS = 100
"""etcd's --heartbeat-interval default: one raft tick, the leader's heartbeat."""
DEFAULT_ELECTION_MS = 1000
"""etcd's --election-timeout default: ten ticks without a leader start an election."""
MAX_ELECTION_MS = 50_000
"""etcd refuses longer election timeouts."""


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the server is told at start."""

    name: str
    data_dir: str
    listen_client_urls: tuple[str, ...]
    advertise_client_urls: tuple[str, ...]
    initial_advertise_peer_urls: tuple[str, ...]
    initial_cluster_token: str
    max_request_bytes: int
    max_txn_ops: int
    auto_compaction_mode: str
    auto_compaction_retention: str
    snapshot_count: int
    quota_backend_bytes: int
    unsafe_no_fsync: bool
    log_level: str
    grpc_keepalive_min_time: float
    grpc_keepalive_interval: float
    grpc_keepalive_timeout: float
    watch_progress_notify_interval: float
    cqs_visibility_timeout: float = 60.0
    log_format: str = "console"
    warning_apply_duration: float = 0.1
    listen_peer_urls: tuple[str, ...] = ("http://localhost:2380",)
    initial_cluster: tuple[tuple[str, tuple[str, ...]], ...] = ()
    initial_cluster_state: str = "new"
    listen_metrics_urls: tuple[str, ...] = ()
    client_tls: TLSFiles = field(default_factory=lambda: TLSFiles())
    peer_tls: TLSFiles = field(default_factory=lambda: TLSFiles())
    auth_token: str = "simple"
    auth_token_ttl: int = 300
    bcrypt_cost: int = 10
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS
    max_watchers_per_stream: int = DEFAULT_MAX_WATCHERS_PER_STREAM
    grpc_transport: str = "native"
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_MS
    election_timeout_ms: int = DEFAULT_ELECTION_MS
    backend_endpoints: tuple[str, ...] = ()
    """A front over these etcd client URLs (empty: a server with its own data)."""
    backend_cacert: str = ""
    backend_cert: str = ""
    backend_key: str = ""
    backend_user: str = ""

    @property
    def clustered(self) -> bool:
        """More than one member at bootstrap, or joining an existing cluster."""
        return len(self.initial_cluster) > 1 or self.initial_cluster_state == "existing"

    def listen_addresses(self) -> list[str]:
        """host:port pairs to bind, from --listen-client-urls."""
        return [url_to_address(u) for u in self.listen_client_urls]

    def metrics_addresses(self) -> list[tuple[str, int]]:
        """(host, port) pairs to bind, from --listen-metrics-urls."""
        return [metrics_address(u) for u in self.listen_metrics_urls]


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """One side's TLS flags (clients: --cert-file...; peers: --peer-cert-file...).

    `flag_prefix` is "" or "peer-", so that messages name the flags as given."""

    cert_file: str = ""
    key_file: str = ""
    trusted_ca_file: str = ""
    client_cert_auth: bool = False
    flag_prefix: str = ""

    @property
    def empty(self) -> bool:
        """No certificate and no key: as etcd's TLSInfo.Empty(), https cannot be served."""
        return not self.cert_file and not self.key_file

    def flag(self, name: str) -> str:
        return f"--{self.flag_prefix}{name}"


class ConfigError(ValueError):
    """A flag or variable has a value the server cannot use."""


def url_to_address(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https", "unix", "unixs") or not parts.hostname:
        raise ConfigError(f"invalid URL {url!r}: expected http://host:port")
    if parts.scheme.startswith("unix"):
        return f"unix:{parts.netloc}{parts.path}"
    if parts.port is None:
        raise ConfigError(f"URL {url!r} has no port")
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port}"


def secure_url(url: str) -> bool:
    """An https:// (or unixs://) URL: served and dialled with TLS."""
    return urlsplit(url).scheme in ("https", "unixs")


def metrics_address(url: str) -> tuple[str, int]:
    """`http://host:port` as (host, port); the health listener speaks plain HTTP only."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"invalid metrics URL {url!r}: expected http://host:port")
    if parts.port is None:
        raise ConfigError(f"metrics URL {url!r} has no port")
    return parts.hostname, parts.port


def parse_duration(text: str) -> float:
    """Go-style durations ("5s", "1m30s", "100ms", "2h") in seconds; a flag's
    duration is never negative. The same reader as a queue's settings."""
    seconds = parse_go_duration(text)
    if seconds is None or seconds < 0:
        raise ConfigError(f"invalid duration {text!r}")
    return seconds


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}")


class _Version(argparse.Action):
    """`--version`: `version_text()` as it is (argparse's own would re-wrap it)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(version_text())
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse with etcd-sized errors: the problem and a pointer to --help,
    not the whole usage of every flag first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\nRun '{self.prog} --help' for the flags.\n")


def version_text() -> str:
    """What `--version` prints, in etcd's `Name Version:` lines."""
    try:
        ours = importlib.metadata.version("queue-server")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        ours = "unknown"
    return (
        f"queue-server Version: {ours}\n"
        f"etcd API Version: {SERVER_VERSION}\n"
        f"Python Version: {platform.python_version()}\n"
        f"OS/Arch: {sys.platform}/{platform.machine()}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="queue-server",
        description="An etcd v3 compatible server and durable message queue. "
        "Every flag can also be set as ETCD_<FLAG> (upper case, dashes as underscores).",
    )
    add = p.add_argument
    add("--version", action=_Version, nargs=0, help="print the version and exit")
    add("--name", default="default", help="human-readable name of this member")
    add("--data-dir", default="", help="directory for the data (default: ${name}.etcd)")
    add(
        "--listen-client-urls",
        default="http://localhost:2379",
        help="comma-separated URLs to listen on for client traffic",
    )
    add(
        "--advertise-client-urls",
        default="http://localhost:2379",
        help="comma-separated client URLs to advertise to clients",
    )
    add(
        "--listen-metrics-urls",
        default="",
        help="comma-separated http:// URLs to serve /metrics, /health, /readyz and /livez on",
    )
    add(
        "--initial-advertise-peer-urls",
        default="http://localhost:2380",
        help="peer URLs of this member, as reported by member list",
    )
    add("--initial-cluster-token", default="etcd-cluster", help="cluster identity token")
    add(
        "--listen-peer-urls",
        default="http://localhost:2380",
        help="comma-separated URLs to listen on for traffic from the other members",
    )
    add(
        "--initial-cluster",
        default="",
        help="the members at bootstrap, name=peer-url,... (default: this member alone)",
    )
    add(
        "--initial-cluster-state",
        default="new",
        choices=("new", "existing"),
        help="new: bootstrap the cluster; existing: join one (after member add)",
    )
    add(
        "--heartbeat-interval",
        type=int,
        default=DEFAULT_HEARTBEAT_MS,
        help="time (in milliseconds) of a heartbeat interval: one raft tick",
    )
    add(
        "--election-timeout",
        type=int,
        default=DEFAULT_ELECTION_MS,
        help="time (in milliseconds) for an election to timeout",
    )
    add(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest client request accepted, in bytes",
    )
    add("--max-txn-ops", type=int, default=128, help="most operations in one txn branch")
    add(
        "--max-concurrent-streams",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_STREAMS,
        help="most concurrent gRPC streams (calls) per client connection; more wait "
        "on the client (default: no limit, as etcd)",
    )
    add(
        "--grpc-transport",
        default="native",
        choices=("native", "grpcio"),
        help="what serves gRPC on the client URLs: our own HTTP/2 transport, or "
        "grpcio's server (the fallback while the native one matures)",
    )
    add(
        "--max-watchers-per-stream",
        type=int,
        default=DEFAULT_MAX_WATCHERS_PER_STREAM,
        help="most watchers on one Watch stream; more are cancelled with 'mvcc: too "
        "many watchers on the WatchStream' (0: no limit)",
    )
    add(
        "--auto-compaction-mode",
        default="periodic",
        choices=("periodic", "revision"),
        help="how --auto-compaction-retention is read: a duration or a revision count",
    )
    add(
        "--auto-compaction-retention",
        default="0",
        help="history to keep: '1h', '30m' or hours as a number (periodic), or a "
        "revision count (revision); 0 turns auto-compaction off",
    )
    add(
        "--quota-backend-bytes",
        type=int,
        default=0,
        help="raise a NOSPACE alarm when the data exceeds this many bytes (0: 2 GiB)",
    )
    add(
        "--snapshot-count",
        type=int,
        default=100_000,
        help="applied log entries between snapshots of the state",
    )
    add(
        "--unsafe-no-fsync",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="do not fsync the log (unsafe: acknowledged writes can be lost on a crash)",
    )
    add("--log-level", default="info", choices=("debug", "info", "warn", "error"))
    add(
        "--log-format",
        default="console",
        choices=("console", "json"),
        help="one line per record: text with key=value fields, or a JSON object",
    )
    add(
        "--experimental-warning-apply-duration",
        default="100ms",
        help="a request that takes longer is logged as 'apply request took too long'",
    )
    add(
        "--grpc-keepalive-min-time",
        default="5s",
        help="shortest interval a client may send keepalive pings at",
    )
    add("--grpc-keepalive-interval", default="2h", help="server-to-client ping interval")
    add("--grpc-keepalive-timeout", default="20s", help="wait for a ping answer before closing")
    add(
        "--experimental-watch-progress-notify-interval",
        default="10m",
        help="interval of progress notifications to watchers that asked for them",
    )
    add(
        "--cqs-visibility-timeout",
        default="60s",
        help="how long a dequeued CQS notification stays invisible unless acknowledged",
    )
    _add_tls_flags(p, "", "client")
    _add_tls_flags(p, "peer-", "peer")
    add("--auth-token", default="simple", help="auth token type: only 'simple' is supported")
    add(
        "--auth-token-ttl",
        type=int,
        default=300,
        help="seconds a simple token lives after its last use",
    )
    add("--bcrypt-cost", type=int, default=10, help="bcrypt cost of hashed passwords (4-31)")
    add(
        "--backend-endpoints",
        default="",
        help="run as a front over an existing etcd cluster: its comma-separated client "
        "URLs (no data dir is used; every call is forwarded)",
    )
    add("--backend-cacert", default="", help="PEM CA bundle to verify the backend with")
    add("--backend-cert", default="", help="PEM client certificate presented to the backend")
    add("--backend-key", default="", help="PEM private key of --backend-cert")
    add(
        "--backend-user",
        default="",
        help="name:password the front itself authenticates to the backend as",
    )
    return p


def _add_tls_flags(p: argparse.ArgumentParser, prefix: str, side: str) -> None:
    """etcd's TLS flags for one side: `--cert-file` ... or `--peer-cert-file` ..."""
    p.add_argument(
        f"--{prefix}cert-file",
        default="",
        help=f"PEM certificate (chain) this member presents on https {side} URLs",
    )
    p.add_argument(
        f"--{prefix}key-file", default="", help=f"PEM private key of --{prefix}cert-file"
    )
    p.add_argument(
        f"--{prefix}trusted-ca-file",
        default="",
        help=f"PEM CA bundle that {side} certificates must be signed by",
    )
    p.add_argument(
        f"--{prefix}client-cert-auth",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help=f"refuse {side}s without a certificate signed by --{prefix}trusted-ca-file",
    )


def _tls_files(a: argparse.Namespace, prefix: str) -> TLSFiles:
    dest = prefix.replace("-", "_")
    return TLSFiles(
        cert_file=getattr(a, f"{dest}cert_file"),
        key_file=getattr(a, f"{dest}key_file"),
        trusted_ca_file=getattr(a, f"{dest}trusted_ca_file"),
        client_cert_auth=bool(getattr(a, f"{dest}client_cert_auth")),
        flag_prefix=prefix,
    )


def check_tls(files: TLSFiles, urls: Sequence[str], kind: str) -> None:
    """What etcd refuses at start for one side's https URLs (file contents are
    checked when the server loads them, see `queue_server.tls`)."""
    https = [u for u in urls if secure_url(u)]
    if https and files.empty:
        raise ConfigError(
            f"TLS key/cert ({files.flag('cert-file')}, {files.flag('key-file')}) must be "
            f"provided for {kind} url {https[0]} with HTTPS scheme"
        )
    if bool(files.cert_file) != bool(files.key_file):
        given, missing = ("cert-file", "key-file") if files.cert_file else ("key-file", "cert-file")
        raise ConfigError(f"{files.flag(given)} is given without {files.flag(missing)}")
    if https and files.client_cert_auth and not files.trusted_ca_file:
        raise ConfigError(
            f"{files.flag('client-cert-auth')} needs {files.flag('trusted-ca-file')}: "
            f"the CA that {kind} certificates must be signed by"
        )


def _env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Use ETCD_* variables as defaults, so that flags still win."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        var = "ETCD_" + action.dest.upper()
        if var in environ:
            raw = environ[var]
            value = action.type(raw) if callable(action.type) else raw
            if action.choices is not None and value not in action.choices:
                raise ConfigError(f"{var}={raw!r}: expected one of {list(action.choices)}")
            action.default = value


def parse_initial_cluster(text: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`n1=http://a:2380,n2=http://b:2380` as ((name, (url, ...)), ...), in first-seen
    order; a name given twice has several peer URLs, as in etcd."""
    members: dict[str, list[str]] = {}
    for part in _csv(text):
        name, sep, url = part.partition("=")
        if not sep or not name or "://" not in url:
            raise ConfigError(f"--initial-cluster: {part!r} is not name=peer-url")
        members.setdefault(name, []).append(url)
    if not members:
        raise ConfigError("--initial-cluster is empty")
    return tuple((name, tuple(urls)) for name, urls in members.items())


def check_raft_timing(heartbeat_ms: int, election_ms: int) -> None:
    """etcd's rules (and words) for --heartbeat-interval and --election-timeout."""
    if heartbeat_ms <= 0:
        raise ConfigError("--heartbeat-interval must be positive")
    if election_ms < 5 * heartbeat_ms:
        raise ConfigError(
            f"--election-timeout[{election_ms}ms] should be at least as 5 times as "
            f"--heartbeat-interval[{heartbeat_ms}ms]"
        )
    if election_ms > MAX_ELECTION_MS:
        raise ConfigError(
            f"--election-timeout[{election_ms}ms] is too long, and should be set less "
            f"than {MAX_ELECTION_MS}ms"
        )


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    parser = build_parser()
    _env_defaults(parser, os.environ if environ is None else environ)
    a = parser.parse_args(argv)
    if a.max_request_bytes <= 0:
        raise ConfigError("--max-request-bytes must be positive")
    if a.max_txn_ops <= 0:
        raise ConfigError("--max-txn-ops must be positive")
    if a.snapshot_count <= 0:
        raise ConfigError("--snapshot-count must be positive")
    check_raft_timing(a.heartbeat_interval, a.election_timeout)
    if a.max_concurrent_streams <= 0:
        raise ConfigError("--max-concurrent-streams must be positive")
    if a.max_watchers_per_stream < 0:
        raise ConfigError("--max-watchers-per-stream must be 0 (no limit) or positive")
    config = Config(
        name=a.name,
        data_dir=a.data_dir or f"{a.name}.etcd",
        listen_client_urls=_csv(a.listen_client_urls),
        advertise_client_urls=_csv(a.advertise_client_urls),
        initial_advertise_peer_urls=_csv(a.initial_advertise_peer_urls),
        initial_cluster_token=a.initial_cluster_token,
        max_request_bytes=a.max_request_bytes,
        max_txn_ops=a.max_txn_ops,
        auto_compaction_mode=a.auto_compaction_mode,
        auto_compaction_retention=a.auto_compaction_retention,
        snapshot_count=a.snapshot_count,
        heartbeat_interval_ms=a.heartbeat_interval,
        election_timeout_ms=a.election_timeout,
        quota_backend_bytes=a.quota_backend_bytes
        if a.quota_backend_bytes > 0
        else DEFAULT_QUOTA_BYTES,
        unsafe_no_fsync=bool(a.unsafe_no_fsync),
        log_level=a.log_level,
        log_format=a.log_format,
        warning_apply_duration=parse_duration(a.experimental_warning_apply_duration),
        grpc_keepalive_min_time=parse_duration(a.grpc_keepalive_min_time),
        grpc_keepalive_interval=parse_duration(a.grpc_keepalive_interval),
        grpc_keepalive_timeout=parse_duration(a.grpc_keepalive_timeout),
        watch_progress_notify_interval=parse_duration(
            a.experimental_watch_progress_notify_interval
        ),
        cqs_visibility_timeout=parse_duration(a.cqs_visibility_timeout),
        listen_peer_urls=_csv(a.listen_peer_urls),
        initial_cluster=parse_initial_cluster(
            a.initial_cluster
            or ",".join(f"{a.name}={u}" for u in _csv(a.initial_advertise_peer_urls))
        ),
        initial_cluster_state=a.initial_cluster_state,
        listen_metrics_urls=_csv(a.listen_metrics_urls),
        client_tls=_tls_files(a, ""),
        peer_tls=_tls_files(a, "peer-"),
        auth_token=a.auth_token,
        auth_token_ttl=a.auth_token_ttl,
        bcrypt_cost=a.bcrypt_cost,
        max_concurrent_streams=a.max_concurrent_streams,
        max_watchers_per_stream=a.max_watchers_per_stream,
        grpc_transport=a.grpc_transport,
        backend_endpoints=_csv(a.backend_endpoints),
        backend_cacert=a.backend_cacert,
        backend_cert=a.backend_cert,
        backend_key=a.backend_key,
        backend_user=a.backend_user,
    )
    names = [name for name, _ in config.initial_cluster]
    if config.name not in names:
        raise ConfigError(
            f"--initial-cluster has no member named {config.name!r} (--name): {','.join(names)}"
        )
    if config.cqs_visibility_timeout <= 0:
        raise ConfigError("--cqs-visibility-timeout must be positive")
    if config.auth_token.split(",")[0] != "simple":
        raise ConfigError(f"--auth-token {config.auth_token!r}: only 'simple' is supported")
    if config.auth_token_ttl <= 0:
        raise ConfigError("--auth-token-ttl must be positive")
    if not 4 <= config.bcrypt_cost <= 31:
        raise ConfigError("--bcrypt-cost must be between 4 and 31")
    config.listen_addresses()  # fail early on a bad URL
    config.metrics_addresses()
    check_tls(config.client_tls, config.listen_client_urls, "client")
    check_tls(config.peer_tls, config.listen_peer_urls, "peer")
    if config.backend_user and ":" not in config.backend_user:
        raise ConfigError("--backend-user must be name:password")
    if config.backend_endpoints and config.grpc_transport != "native":
        raise ConfigError("--backend-endpoints is served on --grpc-transport native only")
    parse_retention(config.auto_compaction_mode, config.auto_compaction_retention)
    return config
