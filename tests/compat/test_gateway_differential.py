"""The HTTP/JSON gateway, side by side with real etcd's (grpc-gateway on the client port).

The same HTTP requests go to a real etcd and to our server (both fresh, module
scoped, so absolute revisions agree); status codes and JSON bodies are compared
after `normalise`: the header's cluster_id, member_id and raft_term are dropped,
tokens and member identities are replaced by placeholders, a lease's remaining
TTL is compared within a second.

Known differences, normalised here and listed in docs/compatibility.md: etcd
3.4.23 (the reference run here) fills no header in an empty Alarm answer and
no revision in MemberList's header, we (as etcd 3.5 for Alarm) do; a body that
is not JSON is refused with the same status and code but Python's parser text.

Also here: several requests on one keep-alive connection (and pipelined), and
gRPC (etcdctl) and HTTP/1.1 on the same port at once.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.processes import EtcdProcess, ServerProcess

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(
        os.environ.get("ETCD_GRPC_TRANSPORT") == "grpcio",
        reason="the HTTP/JSON gateway is part of the native transport; grpcio's server "
        "speaks HTTP/2 only (--grpc-transport grpcio serves no gateway)",
    ),
]

TIMEOUT = 10.0


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Client:
    """One keep-alive HTTP/1.1 connection to a client port."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
        self.reason = ""
        """The reason phrase of the last answer to `post`."""

    def post(self, path: str, body: Any, token: str | None = None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        raw = body if isinstance(body, str) else json.dumps(body)
        self.conn.request("POST", path, body=raw, headers=headers)
        response = self.conn.getresponse()
        self.reason = response.reason
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, data.decode()

    def get(self, path: str) -> tuple[int, bytes, str]:
        self.conn.request("GET", path)
        response = self.conn.getresponse()
        return response.status, response.read(), response.getheader("Content-Type") or ""

    def close(self) -> None:
        self.conn.close()


def normalise(value: Any) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "header" and isinstance(item, dict):
                item = {k: v for k, v in item.items() if k == "revision"}
            elif key == "token":
                item = "<token>"
            out[key] = normalise(item)
        return out
    if isinstance(value, list):
        return [normalise(v) for v in value]
    return value


class Pair:
    """The same requests to etcd and to us; `step` asserts they answer alike."""

    def __init__(self, etcd: EtcdProcess, ours: ServerProcess) -> None:
        self.ref = Client(etcd.endpoint)
        self.ours = Client(ours.endpoint)
        self.ref_token: str | None = None
        self.our_token: str | None = None

    def both(self, path: str, body: Any, auth: bool = False) -> tuple[Any, Any]:
        ref = self.ref.post(path, body, self.ref_token if auth else None)
        ours = self.ours.post(path, body, self.our_token if auth else None)
        return ref, ours

    def step(self, path: str, body: Any, auth: bool = False, status: int = 200) -> Any:
        ref, ours = self.both(path, body, auth)
        assert ref[0] == status, f"etcd answered {ref} to {path} {body}"
        assert (ours[0], normalise(ours[1])) == (ref[0], normalise(ref[1])), (
            f"{path} {body}\netcd: {ref}\nours: {ours}"
        )
        return ours[1]


@pytest.fixture(scope="module")
def pair(etcd: EtcdProcess, server: ServerProcess) -> Iterator[Pair]:
    p = Pair(etcd, server)
    yield p
    p.ref.close()
    p.ours.close()


def test_kv(pair: Pair) -> None:
    pair.step("/v3/kv/put", {"key": b64("/a/1"), "value": b64("one")})
    pair.step("/v3/kv/put", {"key": b64("/a/2"), "value": b64("two"), "prev_kv": True})
    pair.step("/v3/kv/put", {"key": b64("/a/2"), "value": b64("deux"), "prevKv": True})
    pair.step("/v3/kv/range", {"key": b64("/a/1")})
    pair.step("/v3/kv/range", {"key": b64("/a/"), "range_end": b64("/a0")})
    pair.step("/v3/kv/range", {"key": b64("/a/"), "rangeEnd": b64("/a0"), "count_only": True})
    pair.step(
        "/v3/kv/range",
        {"key": b64("/a/"), "range_end": b64("/a0"), "sort_order": "DESCEND", "limit": "1"},
    )
    pair.step("/v3/kv/range", {"key": b64("/none")})
    pair.step("/v3/kv/range", {"key": b64("/a/1"), "unknown_field": 1})
    pair.step("/v3/kv/deleterange", {"key": b64("/a/1"), "prev_kv": True})
    txn = {
        "compare": [
            {"key": b64("/a/2"), "result": "EQUAL", "target": "VALUE", "value": b64("deux")}
        ],
        "success": [
            {"request_put": {"key": b64("/a/3"), "value": b64("three")}},
            {"requestRange": {"key": b64("/a/2")}},
        ],
        "failure": [{"request_delete_range": {"key": b64("/a/2")}}],
    }
    pair.step("/v3/kv/txn", txn)
    pair.step("/v3/kv/txn", txn | {"compare": [{"key": b64("/a/2"), "version": "7"}]})


def test_compaction(pair: Pair) -> None:
    for value in ("1", "2", "3"):
        pair.step("/v3/kv/put", {"key": b64("/c/k"), "value": b64(value)})
    _, ours = pair.ours.post("/v3/kv/range", {"key": b64("/c/k")})
    revision = int(ours["header"]["revision"])
    pair.step("/v3/kv/compaction", {"revision": str(revision - 1), "physical": True})
    pair.step("/v3/kv/range", {"key": b64("/c/k"), "revision": revision - 2}, status=400)
    pair.step("/v3/kv/compaction", {"revision": revision - 2}, status=400)


def test_errors(pair: Pair) -> None:
    pair.step("/v3/kv/put", {"key": "", "value": b64("x")}, status=400)
    pair.step("/v3/kv/range", {"key": b64("k"), "revision": 100000}, status=400)
    pair.step("/v3/lease/revoke", {"ID": 424242}, status=404)
    pair.step("/v3/lease/timetolive", {"ID": 424242})
    for malformed in ({"key": b64("k"), "limit": "x"}, "not json"):
        # Go's and Python's parsers word their errors differently: status and code.
        ref, ours = pair.both("/v3/kv/range", malformed)
        assert ref[0] == ours[0] == 400
        assert ref[1]["code"] == ours[1]["code"] == 3
    ref, ours = pair.both("/v3/kv/no-such-method", {})
    assert ref == ours == (404, "Not Found\n")
    ref, ours = pair.ref.get("/v3/kv/range"), pair.ours.get("/v3/kv/range")
    assert ref[:2] == ours[:2] == (405, b"Method Not Allowed\n")


def test_error_reason_phrase(pair: Pair) -> None:
    """An error answer's status line carries the reason phrase, as etcd's (Go's
    net/http) does: clients show it (etcd3gw raises it as the error's text,
    requests' raise_for_status puts it in its message)."""
    cases = [
        ("/v3/kv/put", {"key": ""}, 400, "Bad Request"),
        (
            "/v3/kv/txn",
            {"success": [{"request_put": {"key": b64("k"), "lease": 4242}}]},
            404,
            "Not Found",
        ),
        ("/v3/auth/authenticate", {"name": "nobody", "password": "x"}, 412, "Precondition Failed"),
    ]
    for path, body, status, reason in cases:
        ref, ours = pair.both(path, body)
        assert (ref[0], pair.ref.reason) == (status, reason), f"etcd answered {ref} to {path}"
        assert (ours[0], pair.ours.reason) == (status, reason), f"{path} {body}: {ours}"


def test_lease(pair: Pair) -> None:
    pair.step("/v3/lease/grant", {"TTL": 60, "ID": 1000})
    pair.step("/v3/lease/grant", {"TTL": "30", "ID": "1001"})
    pair.step("/v3/kv/put", {"key": b64("/l/k"), "value": b64("v"), "lease": 1000})
    ref, ours = pair.both("/v3/lease/timetolive", {"ID": 1000, "keys": True})
    assert ref[0] == ours[0] == 200
    assert abs(int(ref[1].pop("TTL")) - int(ours[1].pop("TTL"))) <= 1
    assert normalise(ours[1]) == normalise(ref[1])
    pair.step("/v3/kv/lease/timetolive", {"ID": 424242})
    ref, ours = pair.both("/v3/lease/leases", {})
    assert ref[0] == ours[0] == 200
    assert sorted(ours[1]["leases"], key=str) == sorted(ref[1]["leases"], key=str)
    pair.step("/v3/lease/revoke", {"ID": 1001})
    pair.step("/v3/kv/lease/leases", {})
    pair.step("/v3/lease/revoke", {"ID": 1001}, status=404)


def test_cluster_and_maintenance(pair: Pair) -> None:
    ref, ours = pair.both("/v3/cluster/member/list", {})
    assert ref[0] == ours[0] == 200
    assert len(ours[1]["members"]) == len(ref[1]["members"]) == 1
    assert set(ours[1]["members"][0]) == set(ref[1]["members"][0])
    ref, ours = pair.both("/v3/maintenance/status", {})
    assert ref[0] == ours[0] == 200
    assert set(ours[1]) == set(ref[1])
    ref, ours = pair.both("/v3/maintenance/alarm", {"action": "GET"})
    assert ref[0] == ours[0] == 200
    ours[1].pop("header")  # etcd 3.4 sends none here, 3.5 fills it
    assert ours[1] == ref[1] == {}


class Stream:
    """A streamed gateway call on a raw socket: the request body is sent in
    chunks as the test goes, the answer read one JSON line at a time."""

    def __init__(self, endpoint: str, path: str) -> None:
        host, port = endpoint.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        self.file = self.sock.makefile("rb")
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {endpoint}\r\n"
            "Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n".encode()
        )
        self.head: list[bytes] = []
        self._lines: list[bytes] = []
        self._rest = b""

    def send(self, message: dict[str, Any]) -> None:
        """One message, a chunk of its own, the body left open (ours reads and answers at once;
        etcd's gateway is `send_body`'s)."""
        data = json.dumps(message).encode() + b"\n"
        self.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))

    def send_body(self, *messages: dict[str, Any]) -> None:
        """The whole request body, a chunk a message and the last chunk, in one write.

        When Go's HTTP/1.1 server writes an answer's head it discards what the handler
        has not yet read of the request body, and etcd's gateway reads the body on
        another goroutine than the one that answers. A message that has arrived but is
        not yet read when the first answer goes out is lost (a CI run lost a keepalive's
        third request so). Written at once, the body comes whole with the first read.
        """
        out = b""
        for message in messages:
            data = json.dumps(message).encode() + b"\n"
            out += b"%x\r\n%s\r\n" % (len(data), data)
        self.sock.sendall(out + b"0\r\n\r\n")

    def _read_head(self) -> None:
        while not self.head or self.head[-1] != b"\r\n":
            line = self.file.readline()
            assert line, "connection closed before the answer's head"
            if line.startswith(b"HTTP/1.1 1"):  # 100 Continue
                self.file.readline()
                continue
            self.head.append(line)

    def status(self) -> int:
        self._read_head()
        return int(self.head[0].split()[1])

    def recv(self) -> Any:
        """The next JSON line; None at the end of the answer."""
        self._read_head()
        while b"\n" not in self._rest:
            size = int(self.file.readline().strip(), 16)
            if size == 0:
                return None
            self._rest += self.file.read(size)
            self.file.readline()
        line, _, self._rest = self._rest.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def watch_script(endpoint: str, client: Client) -> list[Any]:
    """etcd's gateway answers a stream once its request body has ended (Go's
    HTTP/1.1 server does not read and write at once), so the requests go first."""
    stream = Stream(endpoint, "/v3/watch")
    try:
        stream.send_body({"create_request": {"key": b64("/w/k"), "prev_kv": True}})
        got = [stream.status(), stream.recv()]
        client.post("/v3/kv/put", {"key": b64("/w/k"), "value": b64("1")})
        got.append(stream.recv())
        client.post("/v3/kv/deleterange", {"key": b64("/w/k")})
        got.append(stream.recv())
    finally:
        stream.close()
    stream = Stream(endpoint, "/v3/watch")
    try:
        stream.send_body(
            {"create_request": {"key": b64("/w/k"), "watch_id": 7}},
            {"cancel_request": {"watch_id": 7}},
        )
        got += [stream.status(), stream.recv(), stream.recv()]
    finally:
        stream.close()
    return got


def test_watch_stream(pair: Pair, etcd: EtcdProcess, server: ServerProcess) -> None:
    ref = watch_script(etcd.endpoint, pair.ref)
    ours = watch_script(server.endpoint, pair.ours)
    assert normalise(ours) == normalise(ref)
    assert ref[1]["result"]["created"] is True
    assert ref[-1]["result"]["canceled"] is True


def keepalive_script(endpoint: str, client: Client) -> list[Any]:
    client.post("/v3/lease/grant", {"TTL": 60, "ID": 2000})
    stream = Stream(endpoint, "/v3/lease/keepalive")
    try:
        # The last names no lease: TTL 0, as etcd answers.
        stream.send_body({"ID": 2000}, {"ID": "2000"}, {"ID": 31337})
        got = [stream.status()]
        while (line := stream.recv()) is not None:  # the answer ends with the body
            got.append(line)
        return got
    finally:
        stream.close()
        client.post("/v3/lease/revoke", {"ID": 2000})


def test_keepalive_stream(pair: Pair, etcd: EtcdProcess, server: ServerProcess) -> None:
    ref = keepalive_script(etcd.endpoint, pair.ref)
    ours = keepalive_script(server.endpoint, pair.ours)
    assert normalise(ours) == normalise(ref)
    assert len(ref) == 4 and ref[1]["result"]["TTL"] == "60"


def test_auth(pair: Pair) -> None:
    """Last: auth stays enabled on both servers afterwards."""
    pair.step("/v3/auth/role/add", {"name": "root"})
    pair.step("/v3/auth/user/add", {"name": "root", "password": "pw"})
    pair.step("/v3/auth/user/grant", {"user": "root", "role": "root"})
    pair.step("/v3/auth/user/add", {"name": "u1", "password": "pw1"})
    pair.step("/v3/auth/role/add", {"name": "r1"})
    pair.step(
        "/v3/auth/role/grant",
        {"name": "r1", "perm": {"permType": "READ", "key": b64("/r/"), "range_end": b64("/r0")}},
    )
    pair.step("/v3/auth/user/grant", {"user": "u1", "role": "r1"})
    pair.step("/v3/auth/enable", {})
    pair.step("/v3/auth/authenticate", {"name": "root", "password": "bad"}, status=400)
    pair.ref_token = pair.ref.post("/v3/auth/authenticate", {"name": "root", "password": "pw"})[1][
        "token"
    ]
    pair.our_token = pair.ours.post("/v3/auth/authenticate", {"name": "root", "password": "pw"})[1][
        "token"
    ]
    pair.step("/v3/kv/put", {"key": b64("/r/k"), "value": b64("v")}, auth=True)
    pair.step("/v3/kv/range", {"key": b64("/r/k")}, auth=True)
    pair.step("/v3/auth/user/get", {"name": "u1"}, auth=True)
    pair.step("/v3/auth/role/get", {"role": "r1"}, auth=True)
    pair.step("/v3/auth/user/list", {}, auth=True)
    pair.ref_token = pair.ref.post("/v3/auth/authenticate", {"name": "u1", "password": "pw1"})[1][
        "token"
    ]
    pair.our_token = pair.ours.post("/v3/auth/authenticate", {"name": "u1", "password": "pw1"})[1][
        "token"
    ]
    pair.step("/v3/kv/range", {"key": b64("/r/k")}, auth=True)
    pair.step("/v3/kv/put", {"key": b64("/r/k"), "value": b64("w")}, auth=True, status=403)
    pair.step("/v3/kv/range", {"key": b64("/other")}, auth=True, status=403)
    pair.ref_token = pair.our_token = "bogus.token"
    pair.step("/v3/kv/range", {"key": b64("/r/k")}, auth=True, status=401)
