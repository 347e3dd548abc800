"""python-etcd3 0.12.0 with auth, run in its own process (see etcd3_scenarios.py
for why): `PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python python etcd3_auth.py
HOST:PORT`. Expects the users of tests/compat/test_auth_clients.py (root, and
alice with READWRITE on `app/`) and auth enabled. Prints one JSON object: step ->
the value read, "ok", or the exception's class and text. Imports nothing from
this repository.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import etcd3  # type: ignore[import-untyped]


def outcome(step: Callable[[], Any]) -> Any:
    try:
        result = step()
    except Exception as e:  # the point is to report what the client raised
        return {"raised": type(e).__name__, "text": str(e)}
    return "ok" if result is None else result


def login(host: str, port: int, user: str, password: str) -> Any:
    """etcd3.client with a user. The client sends its token twice: as `token`
    metadata and as gRPC call credentials; grpc refuses call credentials on a
    plaintext channel (before any server sees the call), so on plaintext the
    credentials are dropped and the metadata, which etcd reads, carries the token."""
    client = etcd3.client(host, port, user=user, password=password)
    client.call_credentials = None
    return client


def main() -> None:
    host, port = sys.argv[1].rsplit(":", 1)
    out: dict[str, Any] = {}
    out["bad password"] = outcome(
        lambda: etcd3.client(host, int(port), user="alice", password="wrong").get("app/a")
    )
    out["no user"] = outcome(lambda: etcd3.client(host, int(port)).get("app/a"))
    out["plaintext call credentials"] = outcome(
        lambda: etcd3.client(host, int(port), user="alice", password="alicepw").get("app/a")
    )
    alice = login(host, int(port), "alice", "alicepw")
    out["alice put app/a"] = outcome(lambda: alice.put("app/a", "1") and None)
    out["alice get app/a"] = outcome(lambda: alice.get("app/a")[0].decode())
    out["alice get other"] = outcome(lambda: alice.get("other"))
    out["alice put other"] = outcome(lambda: alice.put("other", "1"))
    out["alice delete app/a"] = outcome(lambda: alice.delete("app/a"))
    root = login(host, int(port), "root", "rootpw")
    out["root put other"] = outcome(lambda: root.put("other", "2") and None)
    out["root get other"] = outcome(lambda: root.get("other")[0].decode())
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
