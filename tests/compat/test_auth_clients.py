"""Auth with real clients: etcdctl 3.4 (Debian's etcd-client) and python-etcd3,
each run against our server and against a real etcd with the same steps, and the
outputs compared: user and role management, `auth enable`, `--user` logins,
refused operations and their error lines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import EtcdProcess, ServerProcess

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl is not installed"),
]

CTL_TIMEOUT = 20.0
ETCD3_SCRIPT = Path(__file__).with_name("etcd3_auth.py")


def ctl(endpoint: str, *args: str) -> dict[str, Any]:
    """etcdctl's exit code, stdout and its `Error:` lines (retries logged to
    stderr are left out)."""
    p = subprocess.run(
        ["etcdctl", f"--endpoints={endpoint}", *args],
        capture_output=True,
        text=True,
        timeout=CTL_TIMEOUT,
        env={**os.environ, "ETCDCTL_API": "3"},
        check=False,
    )
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    return {"rc": p.returncode, "out": p.stdout, "err": errors}


STEPS: list[tuple[str, ...]] = [
    ("auth", "enable"),  # no root user yet
    # etcdctl's `user add root` also creates the root role and grants it
    ("user", "add", "root", "--new-user-password", "rootpw"),
    ("role", "add", "app"),
    ("role", "add", "app"),
    ("role", "grant-permission", "app", "readwrite", "app/", "--prefix"),
    ("role", "grant-permission", "app", "read", "ro", "rp"),
    ("user", "add", "alice", "--new-user-password", "alicepw"),
    ("user", "add", "alice", "--new-user-password", "alicepw"),
    ("user", "grant-role", "alice", "app"),
    ("user", "grant-role", "alice", "nope"),
    ("user", "add", "bob", "--new-user-password", "bobpw"),
    ("auth", "enable"),
    ("auth", "enable"),  # no user: etcd asks who enables it even when enabled
    ("get", "app/a"),  # no user
    ("--user", "root:rootpw", "put", "other", "x"),
    ("--user", "alice:alicepw", "put", "app/a", "1"),
    ("--user", "alice:alicepw", "get", "app/a"),
    ("--user", "alice:alicepw", "get", "other"),
    ("--user", "alice:alicepw", "put", "other", "y"),
    ("--user", "alice:alicepw", "put", "ro", "y"),
    ("--user", "alice:alicepw", "get", "ro"),
    ("--user", "alice:alicepw", "get", "app/", "--prefix"),
    ("--user", "alice:alicepw", "get", "a", "--prefix"),
    ("--user", "alice:alicepw", "txn", "--interactive=false"),
    ("--user", "alice:alicepw", "del", "app/a"),
    ("--user", "alice:wrong", "get", "app/a"),
    ("--user", "nobody:pw", "get", "app/a"),
    ("--user", "bob:bobpw", "get", "app/a"),
    ("--user", "alice:alicepw", "user", "list"),
    ("--user", "alice:alicepw", "role", "add", "x"),
    ("--user", "alice:alicepw", "auth", "disable"),
    ("--user", "root:rootpw", "user", "list"),
    ("--user", "root:rootpw", "role", "list"),
    ("--user", "root:rootpw", "user", "get", "alice"),
    ("--user", "root:rootpw", "role", "get", "app"),
    ("--user", "root:rootpw", "user", "delete", "root"),
    ("--user", "root:rootpw", "user", "revoke-role", "root", "root"),
    ("--user", "root:rootpw", "role", "delete", "root"),
    ("--user", "root:rootpw", "role", "revoke-permission", "app", "nokey"),
    ("--user", "root:rootpw", "user", "revoke-role", "alice", "nope"),
    ("--user", "root:rootpw", "user", "revoke-role", "alice", "app"),
    ("--user", "alice:alicepw", "get", "app/a"),
    ("--user", "root:rootpw", "user", "grant-role", "alice", "app"),
    ("--user", "root:rootpw", "user", "delete", "bob"),
    ("--user", "bob:bobpw", "get", "app/a"),
    ("--user", "root:rootpw", "auth", "disable"),
    ("get", "other"),
    ("--user", "root:rootpw", "auth", "enable"),
]
"""The etcdctl session, in order (the txn step reads its ops from stdin)."""


def run_session(endpoint: str) -> list[dict[str, Any]]:
    results = []
    for step in STEPS:
        if "txn" in step:
            p = subprocess.run(
                ["etcdctl", f"--endpoints={endpoint}", *step],
                input='value("app/a") = "1"\n\nput app/b 2\n\nget ro\n\n',
                capture_output=True,
                text=True,
                timeout=CTL_TIMEOUT,
                env={**os.environ, "ETCDCTL_API": "3"},
                check=False,
            )
            errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
            results.append({"rc": p.returncode, "out": p.stdout, "err": errors})
        else:
            results.append(ctl(endpoint, *step))
    return results


def run_etcd3(endpoint: str) -> dict[str, Any]:
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    env.pop("PYTHONPATH", None)
    p = subprocess.run(
        [sys.executable, str(ETCD3_SCRIPT), endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ETCD3_SCRIPT.parent,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    result: dict[str, Any] = json.loads(p.stdout)
    return result


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("authctl") / "authctl.etcd", extra_args=["--bcrypt-cost", "4"]
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sessions(ours: ServerProcess, etcd: EtcdProcess) -> dict[str, Any]:
    """Both servers through the same etcdctl session, then python-etcd3."""
    result: dict[str, Any] = {}
    for kind, endpoint in (("ours", ours.endpoint), ("etcd", etcd.endpoint)):
        result[kind] = {"etcdctl": run_session(endpoint), "etcd3": run_etcd3(endpoint)}
    return result


def test_etcdctl_session_matches_etcd(sessions: dict[str, Any]) -> None:
    ours, ref = sessions["ours"]["etcdctl"], sessions["etcd"]["etcdctl"]
    for step, a, b in zip(STEPS, ours, ref, strict=True):
        assert a == b, f"etcdctl {' '.join(step)}: ours {a} etcd {b}"


def test_etcdctl_session_outputs(sessions: dict[str, Any]) -> None:
    """The outputs themselves (so a change on both sides is noticed)."""
    by_step: dict[str, Any] = {}  # the first run of each distinct step
    for step, result in zip(STEPS, sessions["ours"]["etcdctl"], strict=True):
        by_step.setdefault(" ".join(step), result)
    assert by_step["auth enable"]["err"] == ["Error: etcdserver: root user does not exist"]
    assert by_step["user add root --new-user-password rootpw"]["out"] == "User root created\n"
    assert by_step["get app/a"]["err"] == ["Error: etcdserver: user name is empty"]
    assert by_step["--user alice:alicepw get other"]["err"] == [
        "Error: etcdserver: permission denied"
    ]
    assert by_step["--user alice:alicepw get app/a"]["out"] == "app/a\n1\n"
    assert by_step["--user alice:wrong get app/a"]["err"] == [
        "Error: etcdserver: authentication failed, invalid user ID or password"
    ]
    assert by_step["--user root:rootpw user list"]["out"] == "alice\nbob\nroot\n"


def test_python_etcd3_matches_etcd(sessions: dict[str, Any]) -> None:
    ours, ref = sessions["ours"]["etcd3"], sessions["etcd"]["etcd3"]
    assert ours == ref
    assert ours["alice get app/a"] == "1"
    assert "etcdserver: permission denied" in ours["alice get other"]["text"]
    assert "etcdserver: user name is empty" in ours["no user"]["text"]
    assert "invalid user ID or password" in ours["bad password"]["text"]
    assert ours["root get other"] == "2"
