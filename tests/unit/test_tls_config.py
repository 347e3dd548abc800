"""etcd's TLS flags: parsing (flags and ETCD_* variables), what is refused before
start, the warnings for http URLs, and the checks on the PEM files themselves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from queue_server.config import ConfigError, TLSFiles, parse_config
from queue_server.tls import TLSError, ignored_on_http, load_credentials
from tests.support.tls import Pki, make_pki

pytestmark = pytest.mark.unit

HTTPS = "https://127.0.0.1:2379"
CERT_AND_KEY = ["--cert-file", "a", "--key-file", "b"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_flags_and_variables() -> None:
    c = parse_config(
        ["--cert-file", "s.crt", "--key-file", "s.key", "--client-cert-auth"],
        {"ETCD_TRUSTED_CA_FILE": "ca.crt", "ETCD_PEER_CLIENT_CERT_AUTH": "true"},
    )
    assert c.client_tls == TLSFiles("s.crt", "s.key", "ca.crt", True, "")
    assert c.peer_tls == TLSFiles("", "", "", True, "peer-")
    assert parse_config([]).client_tls.empty


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--listen-client-urls", HTTPS],
            f"TLS key/cert (--cert-file, --key-file) must be provided for client url {HTTPS}",
        ),
        (
            ["--listen-peer-urls", "https://127.0.0.1:2380"],
            "TLS key/cert (--peer-cert-file, --peer-key-file) must be provided for peer url",
        ),
        (["--cert-file", "s.crt"], "--cert-file is given without --key-file"),
        (["--peer-key-file", "p.key"], "--peer-key-file is given without --peer-cert-file"),
        (
            ["--listen-client-urls", HTTPS, *CERT_AND_KEY, "--client-cert-auth"],
            "--client-cert-auth needs --trusted-ca-file",
        ),
    ],
)
def test_refused_before_start(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(argv)


def test_http_urls_ignore_tls_flags_with_etcds_warnings() -> None:
    """etcd starts, warns and serves plain http; so do we."""
    c = parse_config([*CERT_AND_KEY, "--client-cert-auth"])
    warnings = ignored_on_http(c.client_tls, "http://127.0.0.1:2379", "client")
    assert [w.split(";")[0] for w in warnings] == [
        "scheme is HTTP while key and cert files are present",
        "scheme is HTTP while --client-cert-auth is enabled",
    ]
    assert ignored_on_http(c.client_tls, HTTPS, "client") == []
    assert load_credentials(c).client_server is None  # not read: no https URL


def _https(pki: Pki, cert: Path, key: Path, ca: Path | None = None) -> list[str]:
    args = ["--listen-client-urls", HTTPS, "--cert-file", str(cert), "--key-file", str(key)]
    return args + (["--trusted-ca-file", str(ca), "--client-cert-auth"] if ca else [])


def test_good_files_load(pki: Pki) -> None:
    c = parse_config(_https(pki, pki.server.cert, pki.server.key, pki.ca))
    creds = load_credentials(c)
    assert creds.client_server is not None
    assert creds.peer_server is None and creds.peer_client is None


def test_bad_files_are_named(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.crt"
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = [
        (_https(pki, missing, pki.server.key), f"cannot read --cert-file '{missing}'"),
        (_https(pki, pki.server.cert, missing), f"cannot read --key-file '{missing}'"),
        (_https(pki, pki.server.cert, pki.client.key), "are not a PEM certificate and its"),
        (_https(pki, junk, pki.server.key), "are not a PEM certificate and its"),
        (
            _https(pki, pki.server.cert, pki.server.key, junk),
            "--trusted-ca-file",
        ),
        (
            _https(pki, pki.server.cert, pki.server.key, missing),
            "cannot read --trusted-ca-file",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(TLSError, match=re.escape(message)):
            load_credentials(parse_config(argv))


def test_peer_files_checked_for_https_peers(pki: Pki, tmp_path: Path) -> None:
    peers = "n1=https://127.0.0.1:2380,n2=https://127.0.0.1:12380"
    argv = ["--name", "n1", "--initial-cluster", peers]
    argv += ["--listen-peer-urls", "https://127.0.0.1:2380"]
    argv += ["--peer-cert-file", str(pki.server.cert), "--peer-key-file", str(pki.server.key)]
    creds = load_credentials(parse_config([*argv, "--peer-trusted-ca-file", str(pki.ca)]))
    assert creds.peer_server is not None and creds.peer_client is not None
    with pytest.raises(TLSError, match="cannot read --peer-trusted-ca-file"):
        load_credentials(parse_config([*argv, "--peer-trusted-ca-file", str(tmp_path / "x")]))
