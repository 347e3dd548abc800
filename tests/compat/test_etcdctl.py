"""etcdctl (3.4, Debian's etcd-client) against the server: exact outputs.

Every test runs twice: against our server and against a real etcd, with the same
expected text. The etcd run proves that what we expect is what etcd prints, so a
pass against our server means "prints what etcd prints". Revisions are read from
the server under test (each module has fresh servers, but a test only assumes the
revisions its own writes produced).

Each test writes under its own key prefix. Tests that read or delete "from a key
on" use prefixes starting with "~", which sort after every "/ctl/..." key, and
clean up after themselves so they see only their own keys.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl is not installed"),
]

CTL_TIMEOUT = 20.0


@dataclass(frozen=True)
class Ctl:
    """etcdctl bound to one endpoint."""

    endpoint: str
    kind: str  # "queue-server", "etcd" or "front"
    member_endpoint: str = ""
    """The client URL MemberList advertises, when it is not `endpoint`: a front
    passes etcd's member list through, as grpc-proxy does."""

    @property
    def advertised(self) -> str:
        return self.member_endpoint or self.endpoint

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["etcdctl", f"--endpoints={self.endpoint}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=CTL_TIMEOUT,
            env={**os.environ, "ETCDCTL_API": "3"},
            check=False,
        )

    def ok(self, *args: str, stdin: str | None = None) -> str:
        """stdout of a command that must succeed."""
        p = self.run(*args, stdin=stdin)
        assert p.returncode == 0, f"etcdctl {' '.join(args)} failed: {p.stderr}"
        return p.stdout

    def json(self, *args: str, stdin: str | None = None) -> Any:
        return json.loads(self.ok(*args, "-w", "json", stdin=stdin))

    def error(self, *args: str, stdin: str | None = None) -> str:
        """The "Error: ..." line of a command that must fail with exit code 1
        (the client also logs its retries to stderr; those lines are skipped)."""
        p = self.run(*args, stdin=stdin)
        assert p.returncode == 1, f"etcdctl {' '.join(args)}: rc={p.returncode} {p.stdout}"
        assert p.stdout == ""
        errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, p.stderr
        return errors[0]

    def revision(self) -> int:
        """The server's current revision (a read of a key nobody writes)."""
        return int(self.json("get", "/ctl-probe")["header"]["revision"])


@pytest.fixture(scope="module", params=["queue-server", "etcd", "front"])
def ctl(request: pytest.FixtureRequest) -> Iterator[Ctl]:
    """etcdctl against our server, a real etcd, and a front over a real etcd
    (which must answer exactly as that etcd does)."""
    fixture = {"queue-server": "server", "etcd": "etcd", "front": "front"}[request.param]
    proc = request.getfixturevalue(fixture)
    yield Ctl(proc.endpoint, request.param, getattr(proc, "backend", [""])[0])


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def lines(*items: str) -> str:
    return "".join(f"{i}\n" for i in items)


# -- put / get ----------------------------------------------------------------


def test_put_and_get(ctl: Ctl) -> None:
    p = "/ctl/put-get/"
    assert ctl.ok("put", p + "a", "hello world") == "OK\n"
    assert ctl.ok("get", p + "a") == lines(p + "a", "hello world")
    assert ctl.ok("get", p + "missing") == ""
    assert ctl.ok("put", p + "a", "2", "--prev-kv") == lines("OK", p + "a", "hello world")
    assert ctl.ok("put", p + "new", "x", "--prev-kv") == "OK\n"  # nothing before
    assert ctl.ok("put", p + "b", stdin="from stdin") == "OK\n"
    assert ctl.ok("get", p + "b", "--print-value-only") == "from stdin\n"
    # an explicit range [a, b): a only
    assert ctl.ok("get", p + "a", p + "b") == lines(p + "a", "2")


def test_get_prefix(ctl: Ctl) -> None:
    p = "/ctl/prefix/"
    for k, v in [("a", "1"), ("ab", "2"), ("abc", "3"), ("b", "4")]:
        ctl.ok("put", p + k, v)
    assert ctl.ok("get", p + "a", "--prefix") == lines(p + "a", "1", p + "ab", "2", p + "abc", "3")
    assert ctl.ok("get", p + "ab", "--prefix", "--keys-only") == lines(p + "ab", "", p + "abc", "")
    assert ctl.ok("get", p, "--prefix", "--print-value-only") == lines("1", "2", "3", "4")
    assert ctl.ok("get", p + "zzz", "--prefix") == ""


def test_get_from_key(ctl: Ctl) -> None:
    p = "~a-from-key/"
    for k in ("1", "2", "3"):
        ctl.ok("put", p + k, "v" + k)
    try:
        assert ctl.ok("get", p + "2", "--from-key") == lines(p + "2", "v2", p + "3", "v3")
        assert ctl.ok("get", p + "2", "--from-key", "--keys-only", "--limit", "1") == lines(
            p + "2", ""
        )
        assert ctl.ok("get", "~~", "--from-key") == ""
    finally:
        ctl.ok("del", p, "--prefix")


def test_get_limit_and_json(ctl: Ctl) -> None:
    p = "/ctl/limit/"
    for k in ("a", "b", "c"):
        ctl.ok("put", p + k, k.upper())
    ctl.ok("put", p + "b", "B2")
    rev = ctl.revision()
    assert ctl.ok("get", p, "--prefix", "--limit", "2") == lines(p + "a", "A", p + "b", "B2")

    out = ctl.json("get", p, "--prefix", "--limit", "2")
    assert out["header"]["revision"] == rev
    assert out["count"] == 3
    assert out["more"] is True
    assert [kv["key"] for kv in out["kvs"]] == [b64(p + "a"), b64(p + "b")]
    assert [kv["value"] for kv in out["kvs"]] == [b64("A"), b64("B2")]
    a, b = out["kvs"]
    assert (a["create_revision"], a["mod_revision"], a["version"]) == (rev - 3, rev - 3, 1)
    assert (b["create_revision"], b["mod_revision"], b["version"]) == (rev - 2, rev, 2)
    assert "lease" not in a

    out = ctl.json("get", p, "--prefix", "--limit", "3")
    assert out["count"] == 3
    assert "more" not in out  # false is left out
    assert len(out["kvs"]) == 3

    # etcdctl 3.4 has no --count-only: the count comes with -w json
    assert "unknown flag: --count-only" in ctl.run("get", p, "--prefix", "--count-only").stderr
    out = ctl.json("get", p, "--prefix", "--keys-only")
    assert out["count"] == 3
    assert all("value" not in kv for kv in out["kvs"])

    out = ctl.json("get", p + "missing")
    assert out == {"header": out["header"]}  # no kvs, no count
    assert out["header"]["revision"] == rev
    assert set(out["header"]) == {"cluster_id", "member_id", "revision", "raft_term"}


def test_get_rev(ctl: Ctl) -> None:
    k = "/ctl/rev/k"
    ctl.ok("put", k, "v1")
    r1 = ctl.revision()
    ctl.ok("put", k, "v2")
    ctl.ok("del", k)
    r3 = ctl.revision()
    ctl.ok("put", k, "v3")
    assert ctl.ok("get", k, f"--rev={r1}") == lines(k, "v1")
    assert ctl.ok("get", k, f"--rev={r1 + 1}") == lines(k, "v2")
    assert ctl.ok("get", k, f"--rev={r3}") == ""
    assert ctl.ok("get", k) == lines(k, "v3")
    out = ctl.json("get", k, f"--rev={r1}")
    assert out["header"]["revision"] == r3 + 1  # the current revision, not the one read
    assert out["kvs"][0]["mod_revision"] == r1
    assert (
        ctl.error("get", k, f"--rev={r3 + 100}")
        == "Error: etcdserver: mvcc: required revision is a future revision"
    )


SORT_KEYS = ["d", "b", "a", "c"]  # in creation order


def test_get_sort(ctl: Ctl) -> None:
    p = "/ctl/sort/"
    # values: a=6 b=5 c=3 d=0; versions: a=2 b=2 c=1 d=2; created d, b, a, c;
    # modified (last) c, b, d, a
    for k, v in [("d", "2"), ("b", "4"), ("a", "1"), ("c", "3"), ("b", "5"), ("d", "0")]:
        ctl.ok("put", p + k, v)
    ctl.ok("put", p + "a", "6")
    expected = {
        "KEY": "abcd",
        "CREATE": "dbac",
        "MODIFY": "cbda",
        "VALUE": "dcba",
        "VERSION": "cabd",  # ties (version 2) stay in key order
    }
    for target, order in expected.items():
        got = ctl.ok("get", p, "--prefix", "--keys-only", f"--sort-by={target}")
        assert got == lines(*[x for k in order for x in (p + k, "")]), target
        got = ctl.ok("get", p, "--prefix", "--keys-only", f"--sort-by={target}", "--order=ASCEND")
        assert got == lines(*[x for k in order for x in (p + k, "")]), target
        descending = "".join(reversed(order))
        if target == "VERSION":
            descending = "abdc"  # ties keep key order descending too
        got = ctl.ok("get", p, "--prefix", "--keys-only", f"--sort-by={target}", "--order=DESCEND")
        assert got == lines(*[x for k in descending for x in (p + k, "")]), target
    assert ctl.ok("get", p, "--prefix", "--print-value-only", "--order=DESCEND") == lines(
        "0", "3", "5", "6"
    )
    # With an order, etcd sorts every key and then limits; with a target alone it
    # limits first (in key order: a, b, c) and sorts what it fetched.
    assert ctl.ok(
        "get", p, "--prefix", "--print-value-only", "--sort-by=VALUE", "--order=ASCEND", "--limit=2"
    ) == lines("0", "3")
    assert ctl.ok(
        "get", p, "--prefix", "--print-value-only", "--sort-by=VALUE", "--limit=2"
    ) == lines("3", "5")


# -- put flags ------------------------------------------------------------------


def test_put_ignore_value_and_lease(ctl: Ctl) -> None:
    k = "/ctl/ignore/k"
    assert ctl.error("put", k, "--ignore-value") == "Error: etcdserver: key not found"
    assert ctl.error("put", k, "v", "--ignore-lease") == "Error: etcdserver: key not found"
    ctl.ok("put", k, "v1")
    assert ctl.ok("put", k, "--ignore-value") == "OK\n"
    assert ctl.ok("put", k, "--ignore-value", "--prev-kv") == lines("OK", k, "v1")
    assert ctl.ok("put", k, "v2", "--ignore-lease") == "OK\n"
    out = ctl.json("get", k)
    kv = out["kvs"][0]
    assert (kv["value"], kv["version"]) == (b64("v2"), 4)
    # etcdctl itself refuses a value with --ignore-value (exit code 128, no request)
    p = ctl.run("put", k, "v3", "--ignore-value")
    assert p.returncode == 128
    assert "Error: put command needs only 1 argument when 'ignore-value' is set" in p.stderr
    assert ctl.ok("get", k, "--print-value-only") == "v2\n"


def test_put_with_unknown_lease(ctl: Ctl) -> None:
    k = "/ctl/lease/k"
    rev = ctl.revision()
    assert (
        ctl.error("put", k, "v", "--lease=1234") == "Error: etcdserver: requested lease not found"
    )
    assert ctl.ok("get", k) == ""
    assert ctl.revision() == rev


# -- del ------------------------------------------------------------------------


def test_del_prefix_prev_kv(ctl: Ctl) -> None:
    p = "/ctl/del/"
    for k, v in [("a", "1"), ("b", "2"), ("c", "3")]:
        ctl.ok("put", p + k, v)
    assert ctl.ok("del", p + "a") == "1\n"
    assert ctl.ok("del", p + "a") == "0\n"
    assert ctl.ok("del", p, "--prefix", "--prev-kv") == lines("2", p + "b", "2", p + "c", "3")
    assert ctl.ok("del", p, "--prefix") == "0\n"
    ctl.ok("put", p + "x", "1")
    out = ctl.json("del", p, "--prefix", "--prev-kv")
    assert out["deleted"] == 1
    assert out["prev_kvs"][0]["key"] == b64(p + "x")
    assert out["header"]["revision"] == ctl.revision()


def test_del_from_key(ctl: Ctl) -> None:
    keep = "/ctl/del-from-key/keep"
    p = "~b-del-from-key/"
    ctl.ok("put", keep, "stays")
    for k in ("1", "2", "3"):
        ctl.ok("put", p + k, k)
    assert ctl.ok("del", p + "2", "--from-key", "--prev-kv") == lines(
        "2", p + "2", "2", p + "3", "3"
    )
    assert ctl.ok("del", p, "--from-key") == "1\n"
    assert ctl.ok("get", keep, "--print-value-only") == "stays\n"


# -- txn ------------------------------------------------------------------------


def test_txn_success_and_failure(ctl: Ctl) -> None:
    p = "/ctl/txn/"
    ctl.ok("put", p + "a", "1")
    ctl.ok("put", p + "b", "2")
    ctl.ok("put", p + "b", "2")
    out = ctl.json("get", p + "a")
    create_a = out["kvs"][0]["create_revision"]
    mod_b = out["header"]["revision"]

    success = (
        f'value("{p}a") = "1"\n'
        f'version("{p}b") = "2"\n'
        f'create("{p}a") = "{create_a}"\n'
        f'mod("{p}b") = "{mod_b}"\n'
        "\n"
        f"get {p}a\n"
        f'put {p}c "hello world"\n'
        f"del {p}b\n"
        f"get {p} --prefix\n"
        "\n"
        f"put {p}never x\n"
        "\n"
    )
    assert ctl.ok("txn", stdin=success) == lines(
        "SUCCESS", "", p + "a", "1", "", "OK", "", "1", "", p + "a", "1", p + "c", "hello world"
    )

    failure = (
        f'value("{p}a") != "1"\n'
        f'version("{p}a") > "0"\n'
        "\n"
        f"put {p}never x\n"
        "\n"
        f"get {p}a\n"
        f"put {p}a 2\n"
        f"del {p}c\n"
        "\n"
    )
    assert ctl.ok("txn", stdin=failure) == lines("FAILURE", "", p + "a", "1", "", "OK", "", "1")
    assert ctl.ok("get", p, "--prefix") == lines(p + "a", "2")

    # the other comparisons: < and >, on each target
    rev = ctl.revision()

    def compares(version_below: int) -> str:
        return (
            f'mod("{p}a") < "{rev + 1}"\n'
            f'create("{p}a") > "0"\n'
            f'version("{p}a") < "{version_below}"\n'
            f'value("{p}a") > "1"\n'
            "\n"
            f"put {p}ok yes\n"
            "\n\n"
        )

    assert ctl.ok("txn", stdin=compares(3)) == lines("SUCCESS", "", "OK")
    assert ctl.ok("txn", stdin=compares(2)) == "FAILURE\n"  # an empty branch: no responses

    # a value compare on a missing key is false, even against ""
    missing = f'value("{p}missing") = ""\n\nput {p}x 1\n\nput {p}x 2\n\n'
    assert ctl.ok("txn", stdin=missing) == lines("FAILURE", "", "OK")
    assert ctl.ok("get", p + "x", "--print-value-only") == "2\n"


def test_txn_json(ctl: Ctl) -> None:
    p = "/ctl/txn-json/"
    ctl.ok("put", p + "a", "1")
    out = ctl.json("txn", stdin=f'value("{p}a") = "1"\n\nput {p}a 2\nget {p}a\n\n\n')
    rev = ctl.revision()
    assert out["header"]["revision"] == rev
    assert out["succeeded"] is True
    put, get = out["responses"]
    assert put == {"Response": {"ResponsePut": {"header": {"revision": rev}}}}
    rr = get["Response"]["ResponseRange"]
    assert rr["header"] == {"revision": rev}
    assert rr["count"] == 1
    assert rr["kvs"] == [
        {
            "key": b64(p + "a"),
            "create_revision": rev - 1,
            "mod_revision": rev,
            "version": 2,
            "value": b64("2"),
        }
    ]
    out = ctl.json("txn", stdin=f'value("{p}a") = "1"\n\n\nget {p}a\n\n')
    assert "succeeded" not in out  # false is left out
    assert out["header"]["revision"] == rev


def test_txn_errors(ctl: Ctl) -> None:
    p = "/ctl/txn-errors/"
    rev = ctl.revision()
    # no compares (the first line is blank), then the success branch
    dup = f"\nput {p}a 1\nput {p}a 2\n\n\n"
    assert ctl.error("txn", stdin=dup) == "Error: etcdserver: duplicate key given in txn request"
    lease = f"\nput {p}a 1 --lease=1234\n\n\n"
    assert ctl.error("txn", stdin=lease) == "Error: etcdserver: requested lease not found"
    assert ctl.revision() == rev


# -- compaction -----------------------------------------------------------------


def test_compaction(ctl: Ctl) -> None:
    k = "/ctl/compact/k"
    ctl.ok("put", k, "v1")
    old = ctl.revision()
    ctl.ok("put", k, "v2")
    ctl.ok("put", k, "v3")
    now = ctl.revision()
    assert (
        ctl.error("compact", str(now + 1))
        == "Error: etcdserver: mvcc: required revision is a future revision"
    )
    assert ctl.ok("compact", str(old + 1)) == f"compacted revision {old + 1}\n"
    assert (
        ctl.error("get", k, f"--rev={old}")
        == "Error: etcdserver: mvcc: required revision has been compacted"
    )
    assert ctl.ok("get", k, f"--rev={old + 1}") == lines(k, "v2")
    assert (
        ctl.error("compaction", str(old + 1))
        == "Error: etcdserver: mvcc: required revision has been compacted"
    )
    assert ctl.ok("compaction", str(now), "--physical") == f"compacted revision {now}\n"
    assert ctl.ok("get", k, f"--rev={now}") == lines(k, "v3")
    assert ctl.revision() == now  # compaction is not a write


# -- endpoint and member --------------------------------------------------------


def test_endpoint_status(ctl: Ctl) -> None:
    rev = ctl.revision()
    [entry] = ctl.json("endpoint", "status")
    assert entry["Endpoint"] == ctl.endpoint
    st = entry["Status"]
    header = st["header"]
    assert header["revision"] == rev
    assert header["member_id"] == st["leader"]  # one member: it leads
    assert header["cluster_id"] > 0
    assert header["raft_term"] == st["raftTerm"] >= 1
    assert st["raftIndex"] >= st["raftAppliedIndex"] >= 1
    assert st["dbSize"] > 0
    assert re.fullmatch(r"3\.[45]\.\d+", st["version"])

    # the table row: endpoint, member id in hex, version, db size, leader?,
    # learner?, raft term, raft index, applied index, errors
    row = ctl.ok("endpoint", "status")
    member = format(header["member_id"], "x")
    assert re.fullmatch(
        rf"{re.escape(ctl.endpoint)}, {member}, {re.escape(st['version'])}, "
        rf"\d+(\.\d+)? [kMG]?B, true, false, {st['raftTerm']}, \d+, \d+, \n",
        row,
    ), row


def test_endpoint_health(ctl: Ctl) -> None:
    p = ctl.run("endpoint", "health")
    assert p.returncode == 0
    assert p.stdout == ""
    out = p.stderr  # etcdctl 3.4 prints the health line to stderr
    assert re.fullmatch(
        rf"{re.escape(ctl.endpoint)} is healthy: successfully committed proposal: "
        r"took = \d+(\.\d+)?(ns|µs|ms|s)\n",
        out,
    ), out
    [health] = ctl.json("endpoint", "health")
    assert health["endpoint"] == ctl.endpoint
    assert health["health"] is True
    assert "error" not in health


def test_member_list(ctl: Ctl) -> None:
    out = ctl.json("member", "list")
    [member] = out["members"]
    assert member["ID"] == out["header"]["member_id"]
    assert member["clientURLs"] == [f"http://{ctl.advertised}"]
    assert member["name"]
    assert len(member["peerURLs"]) == 1
    assert "isLearner" not in member
    row = ctl.ok("member", "list")
    assert row == (
        f"{format(member['ID'], 'x')}, started, {member['name']}, "
        f"{member['peerURLs'][0]}, http://{ctl.advertised}, false\n"
    )
