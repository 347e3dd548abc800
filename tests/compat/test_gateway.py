"""The HTTP/JSON gateway on our own server: keep-alive, pipelining, chunked
bodies, the body limit, the GET pages, and gRPC and HTTP/1.1 on one port at once.
(What etcd answers alike is in test_gateway_differential.py.)"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.compat.test_gateway_differential import TIMEOUT, Client, Stream, b64
from tests.support.processes import EtcdProcess, ServerProcess
from tests.support.tls import make_pki

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(
        os.environ.get("ETCD_GRPC_TRANSPORT") == "grpcio",
        reason="the HTTP/JSON gateway is part of the native transport; grpcio's server "
        "speaks HTTP/2 only (--grpc-transport grpcio serves no gateway)",
    ),
]


def test_version_health_metrics(etcd: EtcdProcess, server: ServerProcess) -> None:
    ours = Client(server.endpoint)
    ref = Client(etcd.endpoint)
    status, body, _ = ours.get("/version")
    assert status == 200
    assert set(json.loads(body)) == set(json.loads(ref.get("/version")[1]))
    assert json.loads(body)["etcdserver"].startswith("3.5.")
    status, body, _ = ours.get("/health")
    assert status == 200 and json.loads(body)["health"] == "true"
    status, body, _ = ours.get("/metrics")
    assert status == 200 and b"grpc_server_started_total" in body
    ours.close()
    ref.close()


def test_keep_alive_and_pipelining(server: ServerProcess) -> None:
    client = Client(server.endpoint)
    client.post("/v3/kv/put", {"key": b64("/ka/k"), "value": b64("v")})
    sock = client.conn.sock
    for _ in range(5):
        status, body = client.post("/v3/kv/range", {"key": b64("/ka/k")})
        assert status == 200 and body["count"] == "1"
    status, body = client.post("/v3/kv/put", {"key": ""})
    assert status == 400 and body["code"] == 3
    status, _, _ = client.get("/version")
    assert status == 200
    assert client.conn.sock is sock, "every request went on the one connection"
    client.close()
    # Three requests written at once (pipelined), one of them with a chunked body.
    host, port = server.endpoint.split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        body = json.dumps({"key": b64("/ka/k")}).encode()
        unary = b"POST /v3/kv/range HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
            len(body),
            body,
        )
        chunked = b"POST /v3/kv/range HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunked += b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        s.sendall(
            unary + chunked + unary.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n")
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 3
    assert data.count(b'"count":"1"') == 3


def test_large_body_refused(server: ServerProcess) -> None:
    client = Client(server.endpoint)
    value = "x" * (3 * 1024 * 1024)
    status, body = client.post("/v3/kv/put", {"key": b64("big"), "value": b64(value)})
    assert status == 429 and body["code"] == 8
    client.close()


@pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl not installed")
def test_grpc_and_http_on_one_port(server: ServerProcess) -> None:
    client = Client(server.endpoint)
    stream = Stream(server.endpoint, "/v3/watch")
    stream.send({"create_request": {"key": b64("/both/k")}})
    assert stream.status() == 200
    assert stream.recv()["result"]["created"] is True
    put = subprocess.run(
        ["etcdctl", "--endpoints", server.endpoint, "put", "/both/k", "from-grpc"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )
    assert put.returncode == 0, put.stderr
    event = stream.recv()["result"]["events"][0]
    assert base64.b64decode(event["kv"]["value"]) == b"from-grpc"
    status, body = client.post("/v3/kv/range", {"key": b64("/both/k")})
    assert status == 200
    assert base64.b64decode(body["kvs"][0]["value"]) == b"from-grpc"
    get = subprocess.run(
        ["etcdctl", "--endpoints", server.endpoint, "get", "/both/k", "--print-value-only"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )
    assert get.stdout.strip() == "from-grpc"
    stream.close()
    client.close()


def test_https_gateway_and_grpc(tmp_path: Path) -> None:
    """On an https client URL, an ALPN http/1.1 client gets the gateway and a
    gRPC (h2) client still gets gRPC."""
    pki = make_pki(tmp_path / "pki")
    srv = ServerProcess(
        tmp_path / "tls.etcd",
        extra_args=["--cert-file", str(pki.server.cert), "--key-file", str(pki.server.key)],
        credentials=pki.credentials(),
    ).start()
    try:
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.check_hostname = False
        context.set_alpn_protocols(["http/1.1"])
        host, port = srv.endpoint.split(":")
        conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=TIMEOUT)
        conn.request("POST", "/v3/kv/put", body=json.dumps({"key": b64("t"), "value": b64("v")}))
        response = conn.getresponse()
        assert response.status == 200, response.read()
        response.read()
        assert conn.sock.selected_alpn_protocol() == "http/1.1"
        with srv.channel() as channel:
            stub = rpc_pb2_grpc.KVStub(channel)
            got = stub.Range(rpc_pb2.RangeRequest(key=b"t"), timeout=TIMEOUT)
        assert got.kvs[0].value == b"v"
        conn.close()
    finally:
        srv.stop()
