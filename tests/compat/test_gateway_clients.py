"""Real HTTP/JSON gateway clients against the server: `etcd3gw` and `tooz`'s
etcd3gw driver (`etcd3+http://`).

Every test runs twice, against our server and against a real etcd (both module
scoped), with the same literal expectations, so an expectation is etcd's
behaviour, not ours. Revisions are compared relative to the scenario's start.

What the clients call: etcd3gw `GET /version` (to pick the API path), then
`POST /v3/` kv/put, kv/range, kv/deleterange, kv/txn, lease/grant,
kv/lease/revoke, kv/lease/timetolive, lease/keepalive (one message, read as one
JSON line), watch (a stream the client cuts by closing its socket),
maintenance/status and cluster/member/list. tooz's driver uses etcd3gw's
leases, txns and ranges only; its locks are txns on a key with a lease, and it
has no leader election (`watch_elected_as_leader` raises NotImplemented), so the
election here is the usual recipe on a tooz lock: the holder is the leader.

Waits are bounded: watch events are read on a thread with a deadline, lock
attempts and lease expiry are polled with deadlines.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import etcd3gw
import pytest
import tenacity
import tooz
from tooz import coordination

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(
        os.environ.get("ETCD_GRPC_TRANSPORT") == "grpcio",
        reason="the HTTP/JSON gateway is part of the native transport; grpcio's server "
        "speaks HTTP/2 only (--grpc-transport grpcio serves no gateway)",
    ),
]

HTTP_TIMEOUT = 5
"""Seconds etcd3gw (requests) waits for an answer: no call may hang the test."""
EVENT_TIMEOUT = 5.0
LEASE_TTL = 2
"""Seconds: the shortest lease either server grants (etcd's minimum with default
timing), so expiry is observed as soon as possible."""
EXPIRY_BOUND = 10.0
"""A lease of LEASE_TTL is gone well within this (etcd checks expiry every 500 ms)."""


@pytest.fixture(params=["server", "etcd", "front"], ids=["ours", "etcd", "front"])
def port(request: pytest.FixtureRequest) -> int:
    proc = request.getfixturevalue(request.param)
    return int(proc.port)


@pytest.fixture
def client(port: int) -> Any:
    return etcd3gw.client(host="127.0.0.1", port=port, timeout=HTTP_TIMEOUT)


def revision(client: Any) -> int:
    return int(client.status()["header"]["revision"])


def relative(meta: dict[str, Any], base: int) -> tuple[bytes, int, int, int]:
    return (
        meta["key"],
        int(meta["create_revision"]) - base,
        int(meta["mod_revision"]) - base,
        int(meta["version"]),
    )


def poll(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.05)


def take(events: Iterator[Any], cancel: Callable[[], None], count: int) -> list[Any]:
    """`count` events from an etcd3gw watch iterator (which blocks without a
    timeout), read on a thread; past EVENT_TIMEOUT the watch is cancelled, which
    ends the iterator, and the test fails."""
    got: queue.Queue[Any] = queue.Queue()

    def read() -> None:
        for event in events:
            got.put(event)
            if got.qsize() == count:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(EVENT_TIMEOUT)
    if reader.is_alive():
        cancel()
        reader.join(EVENT_TIMEOUT)
        pytest.fail(f"{got.qsize()} of {count} watch events within {EVENT_TIMEOUT}s")
    return [got.get_nowait() for _ in range(count)]


# -- etcd3gw ---------------------------------------------------------------------------


def test_discovers_v3_api(client: Any) -> None:
    assert client.api_path == "/v3/"
    assert client.status()["version"]
    assert len(client.members()) == 1


def test_kv(client: Any) -> None:
    base = revision(client)
    assert client.put("/gw/kv/a", "1") is True
    assert client.put("/gw/kv/b", b"\x00\xff") is True
    assert client.put("/gw/kv/a", "2") is True
    assert client.put("/gw/kw", "outside") is True
    assert client.get("/gw/kv/a") == [b"2"]
    assert client.get("/gw/kv/none") == []
    assert [(v, relative(m, base)) for v, m in client.get_prefix("/gw/kv/")] == [
        (b"2", (b"/gw/kv/a", 1, 3, 2)),
        (b"\x00\xff", (b"/gw/kv/b", 2, 2, 1)),
    ]
    assert [m["key"] for _, m in client.get_prefix("/gw/kv/", sort_order="descend")] == [
        b"/gw/kv/b",
        b"/gw/kv/a",
    ]
    # replace is a txn comparing the value
    assert client.replace("/gw/kv/a", "2", "3") is True
    assert client.replace("/gw/kv/a", "2", "4") is False
    assert client.get("/gw/kv/a") == [b"3"]
    # create is a txn comparing create_revision with 0
    assert client.create("/gw/kv/c", "new") is True
    assert client.create("/gw/kv/c", "again") is False
    assert client.delete("/gw/kv/a") is True
    assert client.delete("/gw/kv/a") is False
    assert client.get("/gw/kv/a") == []
    assert client.delete_prefix("/gw/kv/") is True
    assert client.get_prefix("/gw/kv/") == []
    assert client.get("/gw/kw") == [b"outside"]
    assert revision(client) == base + 8


def test_lease(client: Any) -> None:
    lease = client.lease(30)
    assert client.put("/gw/lease/k", "v", lease=lease)
    assert 28 <= lease.ttl() <= 30
    assert lease.refresh() == 30
    assert lease.keys() == [b"/gw/lease/k"]
    (_, meta) = client.get("/gw/lease/k", metadata=True)[0]
    assert int(meta["lease"]) == lease.id
    assert lease.revoke() is True
    assert client.get("/gw/lease/k") == []
    # a revoked lease: keepalive answers no TTL (etcd3gw: -1), TimeToLive -1
    assert lease.refresh() == -1
    assert lease.ttl() == -1
    assert lease.keys() == []


def test_lease_expiry(client: Any) -> None:
    lease = client.lease(LEASE_TTL)
    client.put("/gw/expiry/k", "v", lease=lease)
    poll(lambda: client.get("/gw/expiry/k") == [], EXPIRY_BOUND, "key of an expired lease")
    assert lease.ttl() == -1


def test_unknown_lease_error(client: Any) -> None:
    """A txn putting with a lease that does not exist: etcd3gw raises the
    answer's reason phrase (HTTP 404)."""
    with pytest.raises(etcd3gw.exceptions.Etcd3Exception) as raised:
        client.put("/gw/nolease", "v", lease=etcd3gw.lease.Lease(4242, client))
    assert raised.value.args == ("Not Found",)
    assert "requested lease not found" in (raised.value.detail_text or "")


def test_lock(client: Any) -> None:
    """etcd3gw's lock does not block: acquire is one txn that fails while the key
    is held, so the waiter retries (bounded) and must succeed only after the
    release."""
    first = client.lock("gw-lock", ttl=30)
    second = client.lock("gw-lock", ttl=30)
    assert first.acquire() is True
    assert first.is_acquired()
    attempts = 0
    released = threading.Event()
    acquired_after_release: list[bool] = []

    def wait_for_lock() -> None:
        nonlocal attempts
        deadline = time.monotonic() + EVENT_TIMEOUT
        while time.monotonic() < deadline:
            was_released = released.is_set()
            attempts += 1
            if second.acquire():
                acquired_after_release.append(was_released)
                return
            time.sleep(0.05)

    waiter = threading.Thread(target=wait_for_lock, daemon=True)
    waiter.start()
    poll(lambda: attempts >= 3, EVENT_TIMEOUT, "the waiter's attempts")
    assert not acquired_after_release
    assert not second.is_acquired()
    released.set()
    assert first.release() is True
    waiter.join(EVENT_TIMEOUT)
    assert acquired_after_release == [True]
    assert second.is_acquired() and not first.is_acquired()
    assert second.refresh() == 30
    assert first.release() is False  # not the holder
    assert second.release() is True
    assert client.get("/locks/gw-lock") == []


def test_watch_key(client: Any) -> None:
    base = revision(client)
    events, cancel = client.watch("/gw/watch/k")
    client.put("/gw/watch/other", "x")
    client.put("/gw/watch/k", "v1")
    client.delete("/gw/watch/k")
    put, delete = take(events, cancel, 2)
    cancel()
    assert "type" not in put  # PUT is the enum's default: left out
    assert relative(put["kv"], base) == (b"/gw/watch/k", 2, 2, 1)
    assert put["kv"]["value"] == b"v1"
    assert delete["type"] == "DELETE"
    assert delete["kv"]["key"] == b"/gw/watch/k"
    assert int(delete["kv"]["mod_revision"]) - base == 3
    assert next(events, None) is None  # cancelled: the iterator ends
    client.put("/gw/watch/k", "after")  # the server goes on after the cut stream
    assert client.get("/gw/watch/k") == [b"after"]


def test_watch_prefix(client: Any) -> None:
    base = revision(client)
    events, cancel = client.watch_prefix("/gw/wp/", prev_kv=True)
    client.put("/gw/wq", "outside")
    client.put("/gw/wp/a", "1")
    client.put("/gw/wp/a", "2")
    client.delete("/gw/wp/a")
    got = take(events, cancel, 3)
    cancel()
    assert [(e.get("type", "PUT"), e["kv"]["key"], e["kv"].get("value")) for e in got] == [
        ("PUT", b"/gw/wp/a", b"1"),
        ("PUT", b"/gw/wp/a", b"2"),
        ("DELETE", b"/gw/wp/a", None),
    ]
    assert [int(e["kv"]["mod_revision"]) - base for e in got] == [2, 3, 4]
    # prev_kv comes as the gateway sends it (etcd3gw decodes only kv)
    assert "prev_kv" not in got[0]
    assert got[2]["prev_kv"]["version"] == "2"
    assert next(events, None) is None


def test_watch_once_from_revision(client: Any) -> None:
    base = revision(client)
    client.put("/gw/once/k", "old")
    event = client.watch_once("/gw/once/k", timeout=EVENT_TIMEOUT, start_revision=base + 1)
    assert event["kv"]["value"] == b"old"
    with pytest.raises(etcd3gw.exceptions.WatchTimedOut):
        client.watch_once("/gw/once/never", timeout=0.5)


# -- tooz ------------------------------------------------------------------------------


class Coordinators:
    """tooz coordinators on one server, each stopped at the end."""

    def __init__(self, port: int, lock_timeout: int, membership_timeout: int) -> None:
        self.url = (
            f"etcd3+http://127.0.0.1:{port}?timeout={HTTP_TIMEOUT}"
            f"&lock_timeout={lock_timeout}&membership_timeout={membership_timeout}"
        )
        self.started: list[Any] = []

    def new(self, member_id: bytes) -> Any:
        coordinator = coordination.get_coordinator(self.url, member_id)
        coordinator.start()
        self.started.append(coordinator)
        return coordinator

    def stop(self, coordinator: Any) -> None:
        self.started.remove(coordinator)
        coordinator.stop()

    def stop_all(self) -> None:
        for coordinator in list(self.started):
            self.stop(coordinator)


@pytest.fixture
def coordinators(port: int) -> Iterator[Coordinators]:
    group = Coordinators(port, lock_timeout=30, membership_timeout=30)
    yield group
    group.stop_all()


@pytest.fixture
def short_coordinators(port: int) -> Iterator[Coordinators]:
    """Locks and memberships on leases of LEASE_TTL: a silent member is dropped soon."""
    group = Coordinators(port, lock_timeout=LEASE_TTL, membership_timeout=LEASE_TTL)
    yield group
    group.stop_all()


def test_tooz_lock(coordinators: Coordinators) -> None:
    alice, bob = coordinators.new(b"alice"), coordinators.new(b"bob")
    assert alice.heartbeat() == 30
    held, wanted = alice.get_lock(b"tooz-lock"), bob.get_lock(b"tooz-lock")
    assert held.acquire(blocking=False) is True
    assert held.acquired
    assert wanted.acquire(blocking=False) is False
    with pytest.raises(tenacity.RetryError):
        wanted.acquire(blocking=0.5)  # retried for half a second, then given up
    alice.heartbeat()  # refreshes the held lock's lease

    result: list[bool] = []
    waiter = threading.Thread(
        target=lambda: result.append(wanted.acquire(blocking=EVENT_TIMEOUT)), daemon=True
    )
    waiter.start()
    assert held.release() is True
    waiter.join(EVENT_TIMEOUT + 2)
    assert result == [True]
    assert wanted.acquired and not held.acquired
    assert held.release() is False
    assert wanted.release() is True


def test_tooz_group(coordinators: Coordinators) -> None:
    alice, bob = coordinators.new(b"alice"), coordinators.new(b"bob")
    alice.create_group(b"workers").get()
    with pytest.raises(coordination.GroupAlreadyExist):
        bob.create_group(b"workers").get()
    with pytest.raises(coordination.GroupNotCreated):
        alice.join_group(b"nobody-made-this").get()
    alice.join_group(b"workers", b"cap-a").get()
    bob.join_group(b"workers", b"cap-b").get()
    with pytest.raises(coordination.MemberAlreadyExist):
        bob.join_group(b"workers").get()
    assert alice.get_members(b"workers").get() == {b"alice", b"bob"}
    assert bob.get_members_with_capabilities(b"workers").get() == {
        b"alice": b"cap-a",
        b"bob": b"cap-b",
    }
    bob.update_capabilities(b"workers", b"cap-b2").get()
    assert alice.get_member_capabilities(b"workers", b"bob").get() == b"cap-b2"
    with pytest.raises(coordination.GroupNotEmpty):
        alice.delete_group(b"workers").get()
    alice.leave_group(b"workers").get()
    assert bob.get_members(b"workers").get() == {b"bob"}
    with pytest.raises(coordination.MemberNotJoined):
        alice.leave_group(b"workers").get()
    bob.leave_group(b"workers").get()
    bob.delete_group(b"workers").get()
    with pytest.raises(coordination.GroupNotCreated):
        alice.get_members(b"workers").get()


def test_tooz_driver_has_no_leader_election(coordinators: Coordinators) -> None:
    alice = coordinators.new(b"alice")
    with pytest.raises(tooz.NotImplemented):
        alice.watch_elected_as_leader(b"election", lambda event: None)


class Candidate:
    """A member of the election group that campaigns for the leader lock."""

    def __init__(self, coordinators: Coordinators, name: bytes) -> None:
        self.name = name
        self.coordinator = coordinators.new(name)
        self.lock = self.coordinator.get_lock(b"leader")
        self.alive = True
        self.left: list[bytes] = []
        self.coordinator.join_group(b"election").get()

    def step(self) -> None:
        """One turn of its loop: heartbeat (membership and lock leases), try for
        the lock if not leading, run the group watchers."""
        self.coordinator.heartbeat()
        if not self.lock.acquired:
            self.lock.acquire(blocking=False)
        self.coordinator.run_watchers()


def run_election(candidates: list[Candidate], until: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + EXPIRY_BOUND
    while not until():
        assert time.monotonic() < deadline, f"{what}: not within {EXPIRY_BOUND}s"
        for candidate in candidates:
            if candidate.alive:
                candidate.step()
        time.sleep(0.05)


def leaders(candidates: list[Candidate]) -> list[bytes]:
    return [c.name for c in candidates if c.alive and c.lock.acquired]


def test_tooz_leader_election(short_coordinators: Coordinators) -> None:
    """Three candidates, one leader at a time. The first leader resigns (releases
    and stops): another leads at once. The second leader dies (stops
    heartbeating): its lock's lease expires and the last one leads, and sees it
    leave the group through `run_watchers`."""
    short_coordinators.new(b"founder").create_group(b"election").get()
    candidates = [Candidate(short_coordinators, name) for name in (b"a", b"b", b"c")]
    for candidate in candidates:
        candidate.coordinator.watch_leave_group(
            b"election", lambda event, c=candidate: c.left.append(event.member_id)
        )
    run_election(candidates, lambda: len(leaders(candidates)) == 1, "a first leader")
    for _ in range(3):  # it stays the only one while all heartbeat
        for candidate in candidates:
            candidate.step()
        assert len(leaders(candidates)) == 1

    first = next(c for c in candidates if c.lock.acquired)
    assert first.lock.release() is True
    first.alive = False
    short_coordinators.stop(first.coordinator)  # leaves the group
    resigned_at = time.monotonic()
    run_election(candidates, lambda: len(leaders(candidates)) == 1, "a leader after resigning")
    assert time.monotonic() - resigned_at < LEASE_TTL, "the resigned lock was not free at once"

    second = next(c for c in candidates if c.alive and c.lock.acquired)
    second.alive = False  # dies: no heartbeat, no release
    (last,) = (c for c in candidates if c.alive)
    run_election(candidates, lambda: last.lock.acquired, "a leader after the leader died")
    run_election(candidates, lambda: second.name in last.left, "the dead leader leaving")
    assert leaders(candidates) == [last.name]
    assert last.coordinator.get_members(b"election").get() == {last.name}
