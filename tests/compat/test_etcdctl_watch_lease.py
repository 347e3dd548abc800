"""etcdctl (3.4) watch, lease, lock, elect, endpoint, snapshot and alarm commands
against both servers, with the same expected output.

As in test_etcdctl.py, every test runs against our server and against a real
etcd, so an expectation is what etcd prints. Commands that keep running (watch,
lock and elect holders, observers) run in the background: a thread reads their
stdout line by line, the test awaits the lines it expects with a deadline, and
ends the process by its pid. Nothing waits by sleeping: a watch with no start
revision is known to be connected once it has printed a put made after it
started (`synced_watch`), a contender is known to wait once its key exists.

Where etcd 3.4 (the reference run here) and 3.5 (our target) print differently,
the test says so and expects 3.5 from our server.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from queue_server.mvcc.store import MVCCStore
from queue_server.restore import restore
from queue_server.storage.snapshot import SnapshotStore
from tests.compat.test_etcdctl import CTL_TIMEOUT, Ctl, b64, lines
from tests.compat.test_etcdctl import pytestmark as etcdctl_marks

pytestmark = etcdctl_marks

LINE_TIMEOUT = 10.0
"""How long a background command may take to print a line it owes."""
POLL_TIMEOUT = 15.0
"""How long a condition polled with etcdctl (a lease expiring, a waiter's key
appearing) may take."""
KILLED_BY_SIGTERM = -signal.SIGTERM
"""etcdctl watch does not catch SIGTERM (lock and elect do, and clean up)."""


@pytest.fixture(scope="module", params=["queue-server", "etcd", "front"])
def ctl(request: pytest.FixtureRequest) -> Iterator[Ctl]:
    """etcdctl against our server, a real etcd, and a front over a real etcd
    (which must answer exactly as that etcd does)."""
    fixture = {"queue-server": "server", "etcd": "etcd", "front": "front"}[request.param]
    proc = request.getfixturevalue(fixture)
    yield Ctl(proc.endpoint, request.param, getattr(proc, "backend", [""])[0])


class Background:
    """An etcdctl command left running. Its stdout is read line by line into a
    queue by a thread; stderr is collected for failure messages."""

    def __init__(self, ctl: Ctl, *args: str) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            ["etcdctl", f"--endpoints={ctl.endpoint}", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True),
            threading.Thread(
                target=lambda f: self._stderr.extend(f), args=(self.proc.stderr,), daemon=True
            ),
        ]
        for t in self._threads:
            t.start()
        self._eof = False

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self._lines.put(line.removesuffix("\n"))
        self._lines.put(None)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def _next(self, deadline: float) -> str | None:
        if self._eof:
            return None
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty as e:
            raise TimeoutError from e
        if line is None:
            self._eof = True
        return line

    def read(self, count: int, timeout: float = LINE_TIMEOUT) -> list[str]:
        """The next `count` lines of stdout (fails if they do not come in time)."""
        deadline = time.monotonic() + timeout
        got: list[str] = []
        while len(got) < count:
            try:
                line = self._next(deadline)
            except TimeoutError:
                line = None
            if line is None:
                pytest.fail(
                    f"etcdctl {' '.join(self.args)} printed {got} and then nothing "
                    f"(wanted {count} lines); stderr:\n{self.stderr}"
                )
            got.append(line)
        return got

    def read_until(self, done: Callable[[str], bool], timeout: float) -> list[str] | None:
        """Lines up to and including the first for which `done` is true, or None
        if it does not come within `timeout` (the lines read stay consumed)."""
        deadline = time.monotonic() + timeout
        got: list[str] = []
        while True:
            try:
                line = self._next(deadline)
            except TimeoutError:
                return None
            if line is None:
                pytest.fail(f"etcdctl {' '.join(self.args)} exited; stderr:\n{self.stderr}")
            got.append(line)
            if done(line):
                return got

    def nothing_printed(self) -> bool:
        return self._lines.empty()

    def stop(self) -> tuple[int, list[str]]:
        """SIGTERM by pid, wait; returns the exit code and any lines not read yet."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=CTL_TIMEOUT)
        for t in self._threads:
            t.join(timeout=CTL_TIMEOUT)
        rest: list[str] = []
        while not self._eof:
            line = self._next(time.monotonic() + LINE_TIMEOUT)
            if line is not None:
                rest.append(line)
        return rc, rest

    def wait(self) -> tuple[int, list[str]]:
        """Wait for the command to exit by itself; its exit code and unread lines."""
        rc = self.proc.wait(timeout=CTL_TIMEOUT)
        return rc, self.stop()[1]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=CTL_TIMEOUT)


@contextlib.contextmanager
def background(ctl: Ctl, *args: str) -> Iterator[Background]:
    proc = Background(ctl, *args)
    try:
        yield proc
    finally:
        proc.kill()  # a no-op once the test stopped it


def synced_watch(ctl: Ctl, sync_key: str, *args: str, json_output: bool = False) -> Background:
    """Start `etcdctl watch ARGS` (which must see puts of `sync_key`) and return
    it once it is connected: put `sync_key` until the watch prints that put,
    then consume everything it printed so far."""
    watch = Background(ctl, "watch", *args, *(["-w", "json"] if json_output else []))
    deadline = time.monotonic() + POLL_TIMEOUT
    n = 0
    while time.monotonic() < deadline:
        n += 1
        value = f"sync-{n}"
        ctl.ok("put", sync_key, value)

        def printed(line: str, value: str = value) -> bool:
            if json_output:
                return bool(json.loads(line)["Events"][-1]["kv"]["value"] == b64(value))
            return line == value

        # a watch connected before this put prints it; one that connected after
        # it prints the next one. Waiting longer each time keeps a slow but
        # connected watch from costing many puts (any number of them is fine:
        # all are consumed here).
        if watch.read_until(printed, timeout=min(LINE_TIMEOUT, 0.25 * 2 ** (n - 1))):
            return watch
    watch.kill()
    pytest.fail(f"etcdctl watch {' '.join(args)} never printed a put; stderr:\n{watch.stderr}")


def put_lines(key: str, value: str) -> list[str]:
    return ["PUT", key, value]


def del_lines(key: str) -> list[str]:
    return ["DELETE", key, ""]


# -- watch ----------------------------------------------------------------------


def test_watch_key(ctl: Ctl) -> None:
    k = "/ctlw/key/k"
    watch = synced_watch(ctl, k, k)
    try:
        ctl.ok("put", k, "v1")
        ctl.ok("put", k + "x", "other key")  # not watched
        ctl.ok("put", k, "v2")
        ctl.ok("del", k)
        ctl.ok("del", k)  # deletes nothing: no event
        ctl.ok("put", k, "v3")
        expected = [*put_lines(k, "v1"), *put_lines(k, "v2"), *del_lines(k), *put_lines(k, "v3")]
        assert watch.read(len(expected)) == expected
        assert watch.nothing_printed()
    finally:
        rc, rest = watch.stop()
    assert rest == []
    assert rc == KILLED_BY_SIGTERM, watch.stderr  # etcdctl watch does not catch SIGTERM


def test_watch_prefix(ctl: Ctl) -> None:
    p = "/ctlw/prefix/"
    watch = synced_watch(ctl, p + "sync", p, "--prefix")
    try:
        ctl.ok("put", p + "a", "1")
        ctl.ok("put", "/ctlw/prefix", "outside")  # the prefix without its "/"
        ctl.ok("put", p + "b/c", "2")
        # one txn, two events: printed in op order
        ctl.ok("txn", stdin=f"\nput {p}z 3\nput {p}y 4\n\n\n")
        ctl.ok("del", p, "--prefix")  # a, b/c, sync, y, z: in key order
        expected = [
            *put_lines(p + "a", "1"),
            *put_lines(p + "b/c", "2"),
            *put_lines(p + "z", "3"),
            *put_lines(p + "y", "4"),
            *del_lines(p + "a"),
            *del_lines(p + "b/c"),
            *del_lines(p + "sync"),
            *del_lines(p + "y"),
            *del_lines(p + "z"),
        ]
        assert watch.read(len(expected)) == expected
    finally:
        rc, rest = watch.stop()
    assert (rc, rest) == (KILLED_BY_SIGTERM, [])


def test_watch_rev_from_history(ctl: Ctl) -> None:
    k = "/ctlw/rev/k"
    ctl.ok("put", k, "1")
    first = ctl.revision()
    ctl.ok("put", k, "2")
    ctl.ok("del", k)
    ctl.ok("put", k, "3")
    # history from `first`, then live: no sync point needed
    with background(ctl, "watch", k, f"--rev={first}") as watch:
        history = [*put_lines(k, "1"), *put_lines(k, "2"), *del_lines(k), *put_lines(k, "3")]
        assert watch.read(len(history)) == history
        ctl.ok("put", k, "4")
        assert watch.read(3) == put_lines(k, "4")
        rc, rest = watch.stop()
    assert (rc, rest) == (KILLED_BY_SIGTERM, [])
    # from the middle of the history, of a prefix
    with background(ctl, "watch", "/ctlw/rev/", "--prefix", f"--rev={first + 2}") as watch:
        assert watch.read(9) == [*del_lines(k), *put_lines(k, "3"), *put_lines(k, "4")]
        rc, rest = watch.stop()
    assert (rc, rest) == (KILLED_BY_SIGTERM, [])


def test_watch_prev_kv(ctl: Ctl) -> None:
    k = "/ctlw/prev/k"
    ctl.ok("put", k, "1")
    first = ctl.revision()
    ctl.ok("put", k, "2")
    ctl.ok("del", k)
    with background(ctl, "watch", k, "--prev-kv", f"--rev={first}") as watch:
        # each event: type, then the previous key/value (none for a create), then the new
        assert watch.read(3) == ["PUT", k, "1"]
        assert watch.read(5) == ["PUT", k, "1", k, "2"]
        assert watch.read(5) == ["DELETE", k, "2", k, ""]
        ctl.ok("put", k, "3")  # created again: no previous
        assert watch.read(3) == ["PUT", k, "3"]
        rc, rest = watch.stop()
    assert (rc, rest) == (KILLED_BY_SIGTERM, [])


def test_watch_json(ctl: Ctl) -> None:
    p = "/ctlw/json/"
    ctl.ok("put", p + "a", "1")
    first = ctl.revision()
    ctl.ok("put", p + "a", "2")
    ctl.ok("txn", stdin=f"\ndel {p}a\nput {p}b x\n\n\n")
    now = ctl.revision()
    with background(ctl, "watch", p, "--prefix", "--prev-kv", f"--rev={first}", "-w", "json") as w:
        # the history comes as one response, at the revision the watch caught up at
        resp = json.loads(w.read(1)[0])
        assert set(resp) == {"Header", "Events", "CompactRevision", "Canceled", "Created"}
        assert (resp["CompactRevision"], resp["Canceled"], resp["Created"]) == (0, False, False)
        assert resp["Header"]["revision"] == now
        assert set(resp["Header"]) == {"cluster_id", "member_id", "revision", "raft_term"}
        a1 = {"key": b64(p + "a"), "create_revision": first, "mod_revision": first, "version": 1}
        a1["value"] = b64("1")
        a2 = {**a1, "mod_revision": first + 1, "version": 2, "value": b64("2")}
        assert resp["Events"] == [
            {"kv": a1},  # a PUT: "type" (0) is left out; a create has no prev_kv
            {"kv": a2, "prev_kv": a1},
            {"type": 1, "kv": {"key": b64(p + "a"), "mod_revision": now}, "prev_kv": a2},
            {
                "kv": {
                    "key": b64(p + "b"),
                    "create_revision": now,
                    "mod_revision": now,
                    "version": 1,
                    "value": b64("x"),
                }
            },
        ]
        ctl.ok("put", p + "b", "")  # an empty value is left out too
        live = json.loads(w.read(1)[0])
        assert live["Header"]["revision"] == now + 1
        b = live["Events"][0]
        assert b["kv"] == {
            "key": b64(p + "b"),
            "create_revision": now,
            "mod_revision": now + 1,
            "version": 2,
        }
        assert b["prev_kv"]["value"] == b64("x")
        rc, rest = w.stop()
    assert (rc, rest) == (KILLED_BY_SIGTERM, [])


def test_watch_json_live(ctl: Ctl) -> None:
    k = "/ctlw/json-live/k"
    watch = synced_watch(ctl, k, k, json_output=True)
    try:
        ctl.ok("put", k, "v")
        [kv] = ctl.json("get", k)["kvs"]
        resp = json.loads(watch.read(1)[0])
        assert resp["Header"]["revision"] == kv["mod_revision"]
        assert resp["Events"] == [{"kv": kv}]
        assert kv["value"] == b64("v") and kv["create_revision"] < kv["mod_revision"]
    finally:
        rc, rest = watch.stop()
    assert (rc, rest) == (KILLED_BY_SIGTERM, [])


def test_watch_exec(ctl: Ctl) -> None:
    k = "/ctlw/exec/k"
    ctl.ok("put", k, "1")
    rev = ctl.revision()
    ctl.ok("del", k)
    script = (
        'echo "ran $ETCD_WATCH_EVENT_TYPE $ETCD_WATCH_KEY=$ETCD_WATCH_VALUE @$ETCD_WATCH_REVISION"'
    )
    with background(ctl, "watch", k, f"--rev={rev}", "--", "sh", "-c", script) as watch:
        # the history is one response: its events printed, then the command run
        # once per event, with the response's revision (etcdctl quotes with %q)
        assert watch.read(8) == [
            *put_lines(k, "1"),
            *del_lines(k),
            f'ran "PUT" "{k}"="1" @{rev + 1}',
            f'ran "DELETE" "{k}"="" @{rev + 1}',
        ]
        ctl.ok("put", k, "2")
        assert watch.read(4) == [*put_lines(k, "2"), f'ran "PUT" "{k}"="2" @{rev + 2}']
        rc, rest = watch.stop()
    assert (rc, rest) == (KILLED_BY_SIGTERM, [])


def test_watch_compacted_revision(ctl: Ctl) -> None:
    k = "/ctlw/compacted/k"
    ctl.ok("put", k, "1")
    old = ctl.revision()
    ctl.ok("put", k, "2")
    ctl.ok("compact", str(old + 1))
    with background(ctl, "watch", k, f"--rev={old}") as watch:
        rc, rest = watch.wait()
        assert rest == []
        assert rc == 5  # etcdctl's ExitInterrupted
        assert watch.stderr == (
            "watch was canceled (etcdserver: mvcc: required revision has been compacted)\n"
            "Error: watch is canceled by the server\n"
        )


# -- lease ----------------------------------------------------------------------

GRANTED = re.compile(r"lease ([0-9a-f]+) granted with TTL\((\d+)s\)\n")


def grant(ctl: Ctl, ttl: int) -> str:
    out = ctl.ok("lease", "grant", str(ttl))
    m = GRANTED.fullmatch(out)
    assert m is not None, out
    return m.group(1)


def test_lease_grant_and_timetolive(ctl: Ctl) -> None:
    p = "/ctll/ttl/"
    lease = grant(ctl, 100)
    assert ctl.ok("put", p + "b", "1", f"--lease={lease}") == "OK\n"
    assert ctl.ok("put", p + "a", "2", f"--lease={lease}") == "OK\n"
    out = ctl.json("get", p + "a")
    assert out["kvs"][0]["lease"] == int(lease, 16)

    m = re.fullmatch(
        rf"lease {lease} granted with TTL\(100s\), remaining\((\d+)s\)\n",
        ctl.ok("lease", "timetolive", lease),
    )
    assert m is not None and 95 <= int(m.group(1)) <= 100
    m = re.fullmatch(
        rf"lease {lease} granted with TTL\(100s\), remaining\((\d+)s\), "
        r"attached keys\(\[(.*)\]\)\n",
        ctl.ok("lease", "timetolive", lease, "--keys"),
    )
    assert m is not None
    assert sorted(m.group(2).split(" ")) == [p + "a", p + "b"]  # etcd: Go map order

    out = ctl.json("lease", "timetolive", lease, "--keys")
    assert out["id"] == int(lease, 16)
    assert out["granted-ttl"] == 100
    assert 95 <= out["ttl"] <= 100
    assert sorted(out["keys"]) == [b64(p + "a"), b64(p + "b")]
    assert out["revision"] == ctl.revision()
    assert set(out) == {
        "cluster_id",
        "member_id",
        "revision",
        "raft_term",
        "id",
        "ttl",
        "granted-ttl",
        "keys",
    }

    out = ctl.json("lease", "grant", "50")
    assert out["TTL"] == 50
    assert out["Error"] == ""
    assert out["ID"] > 0
    assert out["revision"] == ctl.revision()  # a grant is not a KV write


def test_lease_minimum_and_maximum_ttl(ctl: Ctl) -> None:
    # etcd's minimum TTL with its default timing is 2s (1.5 election timeouts)
    for ttl in ("1", "0", "-5"):
        out = ctl.ok("lease", "grant", "--", ttl)
        m = GRANTED.fullmatch(out)
        assert m is not None and m.group(2) == "2", out
        ctl.ok("lease", "revoke", m.group(1))
    ctl.ok("lease", "revoke", grant(ctl, 9_000_000_000))  # etcd's MaxLeaseTTL
    assert (
        ctl.error("lease", "grant", "9000000001")
        == "Error: failed to grant lease (etcdserver: too large lease TTL)"
    )


def test_lease_keep_alive_once(ctl: Ctl) -> None:
    lease = grant(ctl, 60)
    assert ctl.ok("lease", "keep-alive", "--once", lease) == (
        f"lease {lease} keepalived with TTL(60)\n"
    )
    out = ctl.json("lease", "keep-alive", "--once", lease)
    assert out["ID"] == int(lease, 16)
    assert out["TTL"] == 60
    assert out["revision"] == ctl.revision()
    ctl.ok("lease", "revoke", lease)
    # a revoked lease: etcdctl exits with ExitBadConnection (2)
    p = ctl.run("lease", "keep-alive", "--once", lease)
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr.splitlines()[-1] == "Error: etcdserver: requested lease not found"


def test_lease_revoke(ctl: Ctl) -> None:
    p = "/ctll/revoke/"
    lease = grant(ctl, 60)
    ctl.ok("put", p + "a", "1", f"--lease={lease}")
    ctl.ok("put", p + "b", "2", f"--lease={lease}")
    ctl.ok("put", p + "c", "3")
    rev = ctl.revision()
    assert ctl.ok("lease", "revoke", lease) == f"lease {lease} revoked\n"
    assert ctl.ok("get", p, "--prefix") == lines(p + "c", "3")
    assert ctl.revision() == rev + 1  # both keys deleted in one revision
    assert ctl.ok("lease", "timetolive", lease) == f"lease {lease} already expired\n"
    out = ctl.json("lease", "timetolive", lease, "--keys")
    assert (out["id"], out["ttl"], out["granted-ttl"], out["keys"]) == (
        int(lease, 16),
        -1,
        0,
        None,
    )
    assert (
        ctl.error("lease", "revoke", lease)
        == "Error: failed to revoke lease (etcdserver: requested lease not found)"
    )
    # a lease that never existed
    assert (
        ctl.error("lease", "revoke", "1234")
        == "Error: failed to revoke lease (etcdserver: requested lease not found)"
    )
    assert ctl.ok("lease", "timetolive", "1234") == "lease 0000000000001234 already expired\n"
    # revoking a lease without keys writes nothing
    empty = grant(ctl, 60)
    rev = ctl.revision()
    ctl.ok("lease", "revoke", empty)
    assert ctl.revision() == rev


def test_lease_list(ctl: Ctl) -> None:
    def listed() -> set[str]:
        out = ctl.ok("lease", "list").splitlines()
        assert out[0] == f"found {len(out) - 1} leases"
        return set(out[1:])

    before = listed()
    new = {grant(ctl, 60), grant(ctl, 60)}
    assert listed() == before | new  # etcd lists them in Go map order
    out = ctl.json("lease", "list")
    assert {format(x["id"], "016x") for x in out["leases"]} == before | new
    assert out["revision"] == ctl.revision()
    gone = new.pop()
    ctl.ok("lease", "revoke", gone)
    assert listed() == before | new


def test_lease_expiry_deletes_keys(ctl: Ctl) -> None:
    p = "/ctll/expiry/"
    lease = grant(ctl, 2)
    ctl.ok("put", p + "a", "1", f"--lease={lease}")
    ctl.ok("put", p + "b", "2", f"--lease={lease}")
    ctl.ok("put", p + "c", "3")
    rev = ctl.revision()
    m = re.fullmatch(
        rf"lease {lease} granted with TTL\(2s\), remaining\((\d)s\)\n",
        ctl.ok("lease", "timetolive", lease),
    )
    assert m is not None and int(m.group(1)) <= 2
    deadline = time.monotonic() + POLL_TIMEOUT
    while ctl.ok("get", p, "--prefix", "--keys-only") != lines(p + "c", ""):
        assert time.monotonic() < deadline, "the lease's keys were not deleted in time"
    assert ctl.revision() == rev + 1  # both keys, one revision
    assert ctl.ok("lease", "timetolive", lease) == f"lease {lease} already expired\n"
    assert (
        ctl.error("put", p + "a", "x", f"--lease={lease}")
        == "Error: etcdserver: requested lease not found"
    )


# -- lock and elect -------------------------------------------------------------


def keys_under(ctl: Ctl, prefix: str) -> list[dict[str, Any]]:
    out = ctl.json("get", prefix, "--prefix")
    kvs: list[dict[str, Any]] = out.get("kvs", [])
    return kvs


def await_keys(ctl: Ctl, prefix: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + POLL_TIMEOUT
    while len(kvs := keys_under(ctl, prefix)) != count:
        assert time.monotonic() < deadline, f"{prefix}: {len(kvs)} keys, wanted {count}"
    return kvs


def test_lock_runs_command(ctl: Ctl) -> None:
    name = "/ctlk/run"
    script = 'echo "key=$ETCD_LOCK_KEY rev=$ETCD_LOCK_REV"'
    p = ctl.run("lock", name, "--", "sh", "-c", script)
    assert p.returncode == 0, p.stderr
    m = re.fullmatch(rf"key={re.escape(name)}/([0-9a-f]+) rev=(\d+)\n", p.stdout)
    assert m is not None, p.stdout
    assert int(m.group(2)) == ctl.revision() - 1  # created the key; the unlock deleted it
    assert keys_under(ctl, name) == []  # unlocked after the command
    # etcdctl 3.4 leaves its session's lease (--ttl, 10s) to expire. (The key
    # spells the lease with %x, etcdctl's lease commands with %016x.)
    lease = format(int(m.group(1), 16), "016x")
    assert re.fullmatch(
        rf"lease {lease} granted with TTL\(10s\), remaining\((10|9|8)s\)\n",
        ctl.ok("lease", "timetolive", lease),
    )
    # the command's exit status is the error
    p = ctl.run("lock", name, "--", "sh", "-c", "exit 3")
    assert (p.returncode, p.stdout) == (1, "")
    assert p.stderr.splitlines()[-1] == "Error: exit status 3"
    assert keys_under(ctl, name) == []


def test_lock_contenders_are_serialised(ctl: Ctl) -> None:
    name = "/ctlk/two"
    with background(ctl, "lock", name) as first:
        # without a command etcdctl prints the lock's key and value ("") and holds it
        held = first.read(2)
        assert re.fullmatch(rf"{re.escape(name)}/[0-9a-f]+", held[0]) and held[1] == ""
        script = 'echo "got $ETCD_LOCK_KEY"'
        with background(ctl, "lock", name, "--", "sh", "-c", script) as second:
            kvs = await_keys(ctl, name, 2)  # the second waits with its own key
            first_kv, second_kv = sorted(kvs, key=lambda kv: kv["create_revision"])
            assert base64.b64decode(first_kv["key"]).decode() == held[0]
            assert second.proc.poll() is None and second.nothing_printed()
            rc, rest = first.stop()  # SIGTERM: unlock, revoke the session
            assert (rc, rest) == (0, [])
            assert second.read(1) == [f"got {base64.b64decode(second_kv['key']).decode()}"]
            rc, rest = second.wait()
            assert (rc, rest) == (0, []), second.stderr
    assert keys_under(ctl, name) == []


def test_elect(ctl: Ctl) -> None:
    name = "/ctle/one"
    assert ctl.run("elect", name).returncode == 128  # no proposal and no -l
    with (
        background(ctl, "elect", "-l", name) as observer,
        background(ctl, "elect", name, "first") as first,
    ):
        leader = first.read(2)
        assert re.fullmatch(rf"{re.escape(name)}/[0-9a-f]+", leader[0])
        assert leader[1] == "first"
        assert observer.read(2) == leader
        with background(ctl, "elect", name, "second") as second:
            await_keys(ctl, name, 2)  # a candidate waiting
            assert second.nothing_printed() and second.proc.poll() is None
            [kv] = [
                kv for kv in keys_under(ctl, name) if base64.b64decode(kv["value"]) == b"second"
            ]
            rc, rest = first.stop()  # resigns
            assert (rc, rest) == (0, [])
            new_leader = [base64.b64decode(kv["key"]).decode(), "second"]
            assert second.read(2) == new_leader
            assert observer.read(2) == new_leader
            rc, rest = second.stop()
            assert (rc, rest) == (0, [])
        assert keys_under(ctl, name) == []
        rc, rest = observer.stop()
        assert rest == []


# -- endpoint -------------------------------------------------------------------


def test_endpoint_status_counts_log_entries(ctl: Ctl) -> None:
    def status() -> dict[str, Any]:
        [entry] = ctl.json("endpoint", "status")
        st: dict[str, Any] = entry["Status"]
        assert st["raftAppliedIndex"] == st["raftIndex"]  # one member: applied at once
        return st

    # no lease left by earlier tests may expire meanwhile (an expiry is an entry)
    for lease in ctl.ok("lease", "list").splitlines()[1:]:
        ctl.run("lease", "revoke", lease)  # may just have expired
    before = status()
    ctl.ok("put", "/ctls/k", "v")  # one entry
    lease = grant(ctl, 60)  # one entry
    ctl.ok("lease", "timetolive", lease)  # none: the leader answers
    ctl.ok("lease", "keep-alive", "--once", lease)  # none
    ctl.ok("get", "/ctls/k")  # none: a linearizable read is not an entry
    ctl.ok("lease", "revoke", lease)  # one entry
    after = status()
    assert after["raftIndex"] - before["raftIndex"] == 3
    assert after["header"]["revision"] - before["header"]["revision"] == 1
    assert after["raftTerm"] == before["raftTerm"]
    assert after["leader"] == before["leader"] == after["header"]["member_id"]


def test_endpoint_cluster(ctl: Ctl) -> None:
    # --cluster finds the endpoints through MemberList's client URLs
    url = f"http://{ctl.advertised}"
    [entry] = ctl.json("endpoint", "status", "--cluster")
    assert entry["Endpoint"] == url
    assert entry["Status"]["header"]["revision"] == ctl.revision()
    [health] = ctl.json("endpoint", "health", "--cluster")
    assert set(health) == {"endpoint", "health", "took"}
    assert (health["endpoint"], health["health"]) == (url, True)
    p = ctl.run("endpoint", "health", "--cluster")
    assert p.returncode == 0 and p.stdout == ""
    assert re.fullmatch(
        rf"{re.escape(url)} is healthy: successfully committed proposal: "
        r"took = \d+(\.\d+)?(ns|µs|ms|s)\n",
        p.stderr,
    ), p.stderr


# -- maintenance: alarm, defrag, hashkv, snapshot ---------------------------------


def test_alarm_list_and_disarm(ctl: Ctl) -> None:
    assert ctl.ok("alarm", "list") == ""
    assert ctl.ok("alarm", "disarm") == ""
    out = ctl.json("alarm", "list")
    if ctl.kind != "queue-server":  # etcd, or a front over it
        assert out == {}  # etcd 3.4 leaves AlarmResponse.header unset
    else:
        # etcd 3.5 fills it (v3rpc/maintenance.go Alarm); no alarms: no field
        assert set(out) == {"header"}
        assert out["header"]["revision"] == ctl.revision()
    # etcdctl 3.4 disarms "all" by listing the alarms and disarming each, and
    # prints a response it builds itself: no header, whatever the server
    assert ctl.json("alarm", "disarm") == {}


def test_defrag(ctl: Ctl) -> None:
    assert ctl.ok("defrag") == f"Finished defragmenting etcd member[{ctl.endpoint}]\n"


def test_endpoint_hashkv(ctl: Ctl) -> None:
    def hashkv() -> int:
        [entry] = ctl.json("endpoint", "hashkv")
        assert entry["Endpoint"] == ctl.endpoint
        resp = entry["HashKV"]
        assert resp["header"]["revision"] == ctl.revision()
        return int(resp["hash"])

    ctl.ok("put", "/ctlm/hash", "something to hash")
    first = hashkv()
    assert hashkv() == first  # nothing changed
    m = re.fullmatch(rf"{re.escape(ctl.endpoint)}, (\d+)\n", ctl.ok("endpoint", "hashkv"))
    assert m is not None and int(m.group(1)) == first
    ctl.ok("put", "/ctlm/hash", "another value")
    assert hashkv() != first


def test_snapshot_save(ctl: Ctl, tmp_path: Path) -> None:
    ctl.ok("put", "/ctlm/snap", "v")
    rev = ctl.revision()
    path = tmp_path / "snap.db"
    assert ctl.ok("snapshot", "save", str(path)) == f"Snapshot saved at {path}\n"
    assert path.stat().st_size > 0
    assert not path.with_name("snap.db.part").exists()
    # a bbolt file etcdctl can read, from either server (ours carries our queue
    # state in a bucket of its own, which etcd counts and otherwise ignores)
    st = ctl.json("snapshot", "status", str(path))
    assert st["revision"] == rev
    assert st["totalKey"] > 0
    assert st["totalSize"] == path.stat().st_size - 32
    if ctl.kind == "queue-server":
        restore(str(path), str(tmp_path / "restored"))
        loaded = SnapshotStore(str(tmp_path / "restored" / "snap")).load_latest()
        assert loaded is not None
        store = MVCCStore.from_state(loaded.state["mvcc"])
        assert store.revision == rev and store.get(b"/ctlm/snap") is not None
