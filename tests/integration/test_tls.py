"""TLS on client and peer URLs, as etcd 3.5: https client URLs with our stubs and
etcdctl, --client-cert-auth refusing clients without a trusted certificate, the
client certificate's CN as grpcio's auth context has it
(`queue_server.transport.grpcio_fallback.client_common_name`), a cluster over
https peer URLs with --peer-client-cert-auth, and startup errors.

Certificates are made per module by `tests.support.tls.make_pki`."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from queue_server.transport.grpcio_fallback import client_common_name
from tests.support.cluster import Cluster
from tests.support.processes import ServerProcess, free_port, open_channel, run_cli
from tests.support.tls import CLIENT_CN, CertFiles, Pki, make_pki

pytestmark = pytest.mark.integration

CALL_TIMEOUT = 10.0
REFUSED_TIMEOUT = 5.0
"""A refused handshake fails the call at once (UNAVAILABLE); this only bounds it."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_tls_args(pki: Pki, cert_auth: bool) -> list[str]:
    args = ["--cert-file", str(pki.server.cert), "--key-file", str(pki.server.key)]
    args += ["--trusted-ca-file", str(pki.ca)]
    return [*args, "--client-cert-auth"] if cert_auth else args


def peer_tls_args(pki: Pki, cert: CertFiles) -> list[str]:
    return [
        "--peer-cert-file",
        str(cert.cert),
        "--peer-key-file",
        str(cert.key),
        "--peer-trusted-ca-file",
        str(pki.ca),
        "--peer-client-cert-auth",
    ]


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[ServerProcess]:
    """One server on an https client URL with --client-cert-auth."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("tls") / "s.etcd",
        extra_args=client_tls_args(pki, cert_auth=True),
        credentials=pki.credentials(pki.client),
    ).start()
    yield srv
    srv.stop()


def put_get(channel: grpc.Channel, key: bytes, value: bytes) -> list[tuple[bytes, bytes]]:
    kv = rpc_pb2_grpc.KVStub(channel)
    kv.Put(rpc_pb2.PutRequest(key=key, value=value), timeout=CALL_TIMEOUT)
    resp = kv.Range(rpc_pb2.RangeRequest(key=key), timeout=CALL_TIMEOUT)
    return [(x.key, x.value) for x in resp.kvs]


def refused(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        rpc_pb2_grpc.KVStub(channel).Range(rpc_pb2.RangeRequest(key=b"k"), timeout=REFUSED_TIMEOUT)
    code: grpc.StatusCode = e.value.code()
    return code


def etcdctl(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["etcdctl", f"--endpoints=https://{endpoint}", "--dial-timeout=3s", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "ETCDCTL_API": "3"},
    )


# -- client URLs ----------------------------------------------------------------


def test_stubs_put_and_get_over_tls(tls_server: ServerProcess) -> None:
    with tls_server.channel() as ch:
        assert put_get(ch, b"tls/k", b"v1") == [(b"tls/k", b"v1")]


def test_etcdctl_with_cacert_cert_and_key(tls_server: ServerProcess, pki: Pki) -> None:
    certs = [f"--cacert={pki.ca}", f"--cert={pki.client.cert}", f"--key={pki.client.key}"]
    put = etcdctl(tls_server.endpoint, *certs, "put", "tls/ctl", "hello")
    assert put.returncode == 0, put.stderr
    got = etcdctl(tls_server.endpoint, *certs, "get", "tls/ctl")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["tls/ctl", "hello"]
    # Without a client certificate, etcdctl is refused as well.
    bare = etcdctl(tls_server.endpoint, f"--cacert={pki.ca}", "--command-timeout=3s", "get", "x")
    assert bare.returncode != 0


def test_client_without_a_certificate_is_refused(tls_server: ServerProcess, pki: Pki) -> None:
    with open_channel(tls_server.endpoint, pki.credentials()) as ch:
        assert refused(ch) == grpc.StatusCode.UNAVAILABLE


def test_client_with_an_untrusted_certificate_is_refused(
    tls_server: ServerProcess, pki: Pki
) -> None:
    with open_channel(tls_server.endpoint, pki.credentials(pki.untrusted)) as ch:
        assert refused(ch) == grpc.StatusCode.UNAVAILABLE


def test_plain_http_client_against_the_https_port_fails(tls_server: ServerProcess) -> None:
    with grpc.insecure_channel(tls_server.endpoint) as ch:
        assert refused(ch) == grpc.StatusCode.UNAVAILABLE


def test_client_that_does_not_trust_the_server_fails(tls_server: ServerProcess, pki: Pki) -> None:
    key, chain = pki.client.pair()
    creds = grpc.ssl_channel_credentials(pki.untrusted_ca.read_bytes(), key, chain)
    with open_channel(tls_server.endpoint, creds) as ch:
        assert refused(ch) == grpc.StatusCode.UNAVAILABLE


# -- the client certificate's common name --------------------------------------

_SERVICE = "test.Identity"


async def _whoami(request: bytes, context: aio.ServicerContext[bytes, bytes]) -> bytes:
    name = client_common_name(context)
    return b"-" if name is None else name.encode()


async def _ask_name(pki: Pki, cert_auth: bool, cert: CertFiles | None) -> bytes:
    handler = grpc.method_handlers_generic_handler(
        _SERVICE, {"WhoAmI": grpc.unary_unary_rpc_method_handler(_whoami)}
    )
    server = aio.server()
    server.add_generic_rpc_handlers((handler,))
    key, chain = pki.server.pair()
    creds = (
        grpc.ssl_server_credentials([(key, chain)], pki.ca.read_bytes(), require_client_auth=True)
        if cert_auth
        else grpc.ssl_server_credentials([(key, chain)])
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        async with aio.secure_channel(f"127.0.0.1:{port}", pki.credentials(cert)) as ch:
            call = ch.unary_unary(
                f"/{_SERVICE}/WhoAmI", request_serializer=None, response_deserializer=None
            )
            answer: bytes = await call(b"", timeout=CALL_TIMEOUT)
            return answer
    finally:
        await server.stop(0)


async def test_client_common_name_is_the_verified_certificate_cn(pki: Pki) -> None:
    assert await _ask_name(pki, cert_auth=True, cert=pki.client) == CLIENT_CN.encode()
    # No certificate asked for (no --client-cert-auth): no name, even if one is offered.
    assert await _ask_name(pki, cert_auth=False, cert=pki.client) == b"-"
    assert await _ask_name(pki, cert_auth=False, cert=None) == b"-"


# -- peer URLs ------------------------------------------------------------------


def test_cluster_over_https_peer_urls_elects_and_replicates(tmp_path: Path, pki: Pki) -> None:
    c = Cluster(tmp_path, peer_scheme="https", extra_args=peer_tls_args(pki, pki.server))
    try:
        c.start()
        leader = c.wait_leader()
        follower, other = [m for m in c.members if m is not leader]
        # A put on a follower is forwarded to the leader, then replicated: both
        # over the TLS peer channels.
        with follower.channel() as ch:
            rpc_pb2_grpc.KVStub(ch).Put(
                rpc_pb2.PutRequest(key=b"peer/k", value=b"v"), timeout=CALL_TIMEOUT
            )
        with other.channel() as ch:
            resp = rpc_pb2_grpc.KVStub(ch).Range(
                rpc_pb2.RangeRequest(key=b"peer/k"), timeout=CALL_TIMEOUT
            )
        assert [(x.key, x.value) for x in resp.kvs] == [(b"peer/k", b"v")]
    finally:
        c.stop()


def test_member_with_an_untrusted_peer_certificate_cannot_join(tmp_path: Path, pki: Pki) -> None:
    c = Cluster(
        tmp_path,
        peer_scheme="https",
        extra_args=peer_tls_args(pki, pki.server),
        member_args={"n3": peer_tls_args(pki, pki.untrusted)},
    )
    n1, n2, n3 = c.members
    try:
        c.start_members()
        leader = c.wait_leader(exclude=n3)
        assert leader in (n1, n2)
        assert {n1.status().leader, n2.status().leader} == {leader.status().header.member_id}
        with n2.channel() as ch:
            assert put_get(ch, b"peer/two", b"v") == [(b"peer/two", b"v")]
        # The leader's appends and heartbeats to n3 fail the handshake (and so do
        # n3's votes to them): n3 knows no leader and has none of the data.
        assert n3.status().leader == 0
        with n3.channel() as ch:
            resp = rpc_pb2_grpc.KVStub(ch).Range(
                rpc_pb2.RangeRequest(key=b"peer/two", serializable=True), timeout=CALL_TIMEOUT
            )
        assert list(resp.kvs) == []
    finally:
        c.stop()


# -- startup errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("https-without-cert", "TLS key/cert (--cert-file, --key-file) must be provided"),
        ("missing-cert-file", "cannot read --cert-file"),
        ("key-of-another-cert", "are not a PEM certificate and its private key"),
        ("peer-https-without-cert", "TLS key/cert (--peer-cert-file, --peer-key-file)"),
    ],
)
def test_bad_tls_config_fails_at_startup(tmp_path: Path, pki: Pki, case: str, message: str) -> None:
    url = f"https://127.0.0.1:{free_port()}"
    args = ["--data-dir", str(tmp_path / "bad.etcd"), "--listen-client-urls", url]
    if case == "missing-cert-file":
        args += ["--cert-file", str(tmp_path / "nope.crt"), "--key-file", str(pki.server.key)]
    elif case == "key-of-another-cert":
        args += ["--cert-file", str(pki.server.cert), "--key-file", str(pki.client.key)]
    elif case == "peer-https-without-cert":
        args = ["--data-dir", str(tmp_path / "bad.etcd")]
        args += ["--listen-peer-urls", f"https://127.0.0.1:{free_port()}"]
    r = run_cli(args)
    assert r.returncode == 1
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_the_client_certificate_cn_is_the_user_under_auth(tmp_path: Path, pki: Pki) -> None:
    """With --client-cert-auth and auth enabled, a call without a token is made by
    the user its certificate's CN names, with that user's permissions (etcd's
    AuthInfoFromTLS)."""
    srv = ServerProcess(
        tmp_path / "a.etcd",
        extra_args=[*client_tls_args(pki, cert_auth=True), "--bcrypt-cost", "4"],
        credentials=pki.credentials(pki.client),
    ).start()
    try:
        with open_channel(srv.endpoint, pki.credentials(pki.client)) as ch:
            auth = rpc_pb2_grpc.AuthStub(ch)
            kv = rpc_pb2_grpc.KVStub(ch)
            kv.Put(rpc_pb2.PutRequest(key=b"app/x", value=b"1"), timeout=CALL_TIMEOUT)
            auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="root", password="pw"), timeout=30)
            auth.UserGrantRole(
                rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"), timeout=CALL_TIMEOUT
            )
            auth.UserAdd(
                rpc_pb2.AuthUserAddRequest(name=CLIENT_CN, password="pw2"), timeout=CALL_TIMEOUT
            )
            auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name="reader"), timeout=CALL_TIMEOUT)
            grant = rpc_pb2.AuthRoleGrantPermissionRequest(name="reader")
            grant.perm.permType = grant.perm.READ
            grant.perm.key, grant.perm.range_end = b"app/", b"app0"
            auth.RoleGrantPermission(grant, timeout=CALL_TIMEOUT)
            auth.UserGrantRole(
                rpc_pb2.AuthUserGrantRoleRequest(user=CLIENT_CN, role="reader"),
                timeout=CALL_TIMEOUT,
            )
            auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=CALL_TIMEOUT)

            got = kv.Range(rpc_pb2.RangeRequest(key=b"app/x"), timeout=CALL_TIMEOUT)
            assert [kv_.value for kv_ in got.kvs] == [b"1"]
            with pytest.raises(grpc.RpcError) as err:
                kv.Put(rpc_pb2.PutRequest(key=b"app/x", value=b"2"), timeout=CALL_TIMEOUT)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert err.value.details() == "etcdserver: permission denied"
    finally:
        srv.stop()
