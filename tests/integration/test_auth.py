"""Auth end to end on a real server process, with our generated stubs: the Auth
service's rules and errors, tokens in the `token` metadata, enforcement on every
RPC family (the auth matrix), and auth state surviving kill -9.

The matrix test prints its table (family x allowed/denied) and, when
AUTH_MATRIX_OUT names a file, writes it there as JSON.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from etcdserverpb import (
    auth_pb2,
    cqs_pb2,
    cqs_pb2_grpc,
    rpc_pb2,
    rpc_pb2_grpc,
    v3election_pb2,
    v3election_pb2_grpc,
    v3lock_pb2,
    v3lock_pb2_grpc,
)
from tests.integration.test_queue import WatchStream, consumer_key, new_id
from tests.support.cluster import Cluster
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.integration

WAIT = 10.0
FAST_BCRYPT = ["--bcrypt-cost", "4"]
READ, WRITE, READWRITE = (
    auth_pb2.Permission.READ,
    auth_pb2.Permission.WRITE,
    auth_pb2.Permission.READWRITE,
)


class _Token(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Adds the `token` metadata etcd clients send to every call."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, details: Any) -> Any:
        metadata = [*list(details.metadata or []), ("token", self.token)]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class Client:
    """Stubs on one channel, carrying a token once logged in."""

    def __init__(self, endpoint: str, token: str | None = None) -> None:
        self.raw = grpc.insecure_channel(endpoint)
        self.channel = (
            grpc.intercept_channel(self.raw, _Token(token)) if token is not None else self.raw
        )
        self.auth = rpc_pb2_grpc.AuthStub(self.channel)
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.lease = rpc_pb2_grpc.LeaseStub(self.channel)
        self.maintenance = rpc_pb2_grpc.MaintenanceStub(self.channel)
        self.lock = v3lock_pb2_grpc.LockStub(self.channel)
        self.election = v3election_pb2_grpc.ElectionStub(self.channel)
        self.cqs = cqs_pb2_grpc.DtoChangeQueueServiceStub(self.channel)

    def close(self) -> None:
        self.raw.close()


def login(endpoint: str, name: str, password: str) -> Client:
    anon = Client(endpoint)
    try:
        token = anon.auth.Authenticate(
            rpc_pb2.AuthenticateRequest(name=name, password=password), timeout=WAIT
        ).token
    finally:
        anon.close()
    return Client(endpoint, token)


def status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str | None]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def denied(call: Callable[[], object]) -> None:
    assert status(call) == (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied")


def prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def perm(key: bytes, end: bytes, kind: auth_pb2.Permission.Type) -> auth_pb2.Permission:
    return auth_pb2.Permission(key=key, range_end=end, permType=kind)


def setup_auth(c: Client) -> None:
    """root (root role), alice (role `app`: the prefixes below), bob (no roles)."""
    a = c.auth
    a.UserAdd(rpc_pb2.AuthUserAddRequest(name="root", password="rootpw"), timeout=WAIT)
    a.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"), timeout=WAIT)
    a.RoleAdd(rpc_pb2.AuthRoleAddRequest(name="app"), timeout=WAIT)
    for p in (
        perm(b"app/", prefix_end(b"app/"), READWRITE),
        perm(b"ro/", prefix_end(b"ro/"), READ),
        perm(b"/q/aq/", prefix_end(b"/q/aq/"), READWRITE),
        perm(b"/q/cq/", prefix_end(b"/q/cq/"), READWRITE),
        perm(b"/q/dto:authdto/", prefix_end(b"/q/dto:authdto/"), WRITE),
        perm(b"lk/", prefix_end(b"lk/"), READWRITE),
        perm(b"el/", prefix_end(b"el/"), READWRITE),
    ):
        a.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(name="app", perm=p))
    for name in ("alice", "bob"):
        a.UserAdd(rpc_pb2.AuthUserAddRequest(name=name, password=name + "pw"), timeout=WAIT)
    a.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user="alice", role="app"), timeout=WAIT)
    a.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=WAIT)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("auth") / "auth1.etcd", extra_args=FAST_BCRYPT
    ).start()
    c = Client(srv.endpoint)
    try:
        # Before enabling: the root rules.
        e = status(lambda: c.auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=WAIT))
        assert e == (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: root user does not exist")
        c.auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="root", password="x"), timeout=WAIT)
        e = status(lambda: c.auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=WAIT))
        assert e == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "etcdserver: root user does not have root role",
        )
        c.auth.UserDelete(rpc_pb2.AuthUserDeleteRequest(name="root"), timeout=WAIT)
        e = status(
            lambda: c.auth.Authenticate(
                rpc_pb2.AuthenticateRequest(name="root", password="x"), timeout=WAIT
            )
        )
        assert e == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "etcdserver: authentication is not enabled",
        )
        setup_auth(c)
    finally:
        c.close()
    yield srv
    srv.stop()


def test_auth_service_rules_and_errors(server: ServerProcess) -> None:
    anon = Client(server.endpoint)
    root = login(server.endpoint, "root", "rootpw")
    alice = login(server.endpoint, "alice", "alicepw")
    try:
        e = status(
            lambda: anon.auth.Authenticate(
                rpc_pb2.AuthenticateRequest(name="alice", password="nope"), timeout=WAIT
            )
        )
        assert e == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "etcdserver: authentication failed, invalid user ID or password",
        )
        assert status(lambda: anon.kv.Range(rpc_pb2.RangeRequest(key=b"app/x"))) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "etcdserver: user name is empty",
        )
        bogus = Client(server.endpoint, "not-a-token.1")
        assert status(lambda: bogus.kv.Range(rpc_pb2.RangeRequest(key=b"app/x"))) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "etcdserver: invalid auth token",
        )
        bogus.close()
        st = root.auth.AuthStatus(rpc_pb2.AuthStatusRequest(), timeout=WAIT)
        assert st.enabled and st.authRevision > 1
        users = root.auth.UserList(rpc_pb2.AuthUserListRequest(), timeout=WAIT).users
        assert list(users) == ["alice", "bob", "root"]
        assert list(root.auth.RoleList(rpc_pb2.AuthRoleListRequest(), timeout=WAIT).roles) == [
            "app"
        ]
        got = root.auth.RoleGet(rpc_pb2.AuthRoleGetRequest(role="app"), timeout=WAIT)
        assert [p.key for p in got.perm][:2] == [b"/q/aq/", b"/q/cq/"]  # sorted by key
        # non-root: own user and own roles only
        own = alice.auth.UserGet(rpc_pb2.AuthUserGetRequest(name="alice"), timeout=WAIT)
        assert list(own.roles) == ["app"]
        alice.auth.RoleGet(rpc_pb2.AuthRoleGetRequest(role="app"), timeout=WAIT)
        denied(lambda: alice.auth.UserGet(rpc_pb2.AuthUserGetRequest(name="bob"), timeout=WAIT))
        denied(lambda: alice.auth.UserList(rpc_pb2.AuthUserListRequest(), timeout=WAIT))
        denied(lambda: alice.auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name="x"), timeout=WAIT))
        denied(lambda: alice.auth.AuthDisable(rpc_pb2.AuthDisableRequest(), timeout=WAIT))
        denied(lambda: alice.maintenance.Defragment(rpc_pb2.DefragmentRequest(), timeout=WAIT))
        denied(lambda: alice.kv.Compact(rpc_pb2.CompactionRequest(revision=1), timeout=WAIT))
        # etcd's rules and texts for root management
        fp = grpc.StatusCode.FAILED_PRECONDITION
        ia = grpc.StatusCode.INVALID_ARGUMENT
        cases: list[tuple[Callable[[], object], tuple[grpc.StatusCode, str]]] = [
            (
                lambda: root.auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="alice", password="p")),
                (fp, "etcdserver: user name already exists"),
            ),
            (
                lambda: root.auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="", password="p")),
                (ia, "etcdserver: user name is empty"),
            ),
            (
                lambda: root.auth.UserGet(rpc_pb2.AuthUserGetRequest(name="ghost")),
                (fp, "etcdserver: user name not found"),
            ),
            (
                lambda: root.auth.RoleGet(rpc_pb2.AuthRoleGetRequest(role="ghost")),
                (fp, "etcdserver: role name not found"),
            ),
            (
                lambda: root.auth.UserGrantRole(
                    rpc_pb2.AuthUserGrantRoleRequest(user="bob", role="ghost")
                ),
                (fp, "etcdserver: role name not found"),
            ),
            (
                lambda: root.auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name="app")),
                (fp, "etcdserver: role name already exists"),
            ),
            (
                lambda: root.auth.UserDelete(rpc_pb2.AuthUserDeleteRequest(name="root")),
                (ia, "etcdserver: invalid auth management"),
            ),
            (
                lambda: root.auth.UserRevokeRole(
                    rpc_pb2.AuthUserRevokeRoleRequest(name="root", role="root")
                ),
                (ia, "etcdserver: invalid auth management"),
            ),
            (
                lambda: root.auth.UserRevokeRole(
                    rpc_pb2.AuthUserRevokeRoleRequest(name="bob", role="app")
                ),
                (fp, "etcdserver: role is not granted to the user"),
            ),
            (
                lambda: root.auth.RoleRevokePermission(
                    rpc_pb2.AuthRoleRevokePermissionRequest(role="app", key=b"nope")
                ),
                (fp, "etcdserver: permission is not granted to the role"),
            ),
        ]
        for call, expected in cases:
            assert status(call) == expected
        # a password change voids the user's tokens; the new password works
        root.auth.UserAdd(rpc_pb2.AuthUserAddRequest(name="carol", password="c1"), timeout=WAIT)
        carol = login(server.endpoint, "carol", "c1")
        assert status(lambda: carol.kv.Range(rpc_pb2.RangeRequest(key=b"app/x")))[0] == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        root.auth.UserChangePassword(
            rpc_pb2.AuthUserChangePasswordRequest(name="carol", password="c2"), timeout=WAIT
        )
        assert status(lambda: carol.kv.Range(rpc_pb2.RangeRequest(key=b"app/x"))) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "etcdserver: invalid auth token",
        )
        carol.close()
        login(server.endpoint, "carol", "c2").close()
        root.auth.UserDelete(rpc_pb2.AuthUserDeleteRequest(name="carol"), timeout=WAIT)
    finally:
        for c in (anon, root, alice):
            c.close()


def test_streaming_rpcs_are_guarded(server: ServerProcess) -> None:
    """Server-streaming (Snapshot, Observe) and client-streaming (ReEnqueue, checked
    on its header) methods go through the same rules."""
    root = login(server.endpoint, "root", "rootpw")
    alice = login(server.endpoint, "alice", "alicepw")
    bob = login(server.endpoint, "bob", "bobpw")
    try:
        snapshot = rpc_pb2.SnapshotRequest()
        denied(lambda: next(iter(alice.maintenance.Snapshot(snapshot, timeout=WAIT))))
        assert next(iter(root.maintenance.Snapshot(snapshot, timeout=WAIT))).blob
        observe = v3election_pb2.LeaderRequest(name=b"el")
        denied(lambda: next(iter(bob.election.Observe(observe, timeout=WAIT))))

        def reenqueue(c: Client) -> object:
            frames = [
                cqs_pb2.ReEnqueueRequest(
                    header=cqs_pb2.ReEnqueueRequest.Header(queue_name="cq", ack_token="t")
                ),
                cqs_pb2.ReEnqueueRequest(footer=cqs_pb2.ReEnqueueRequest.Footer()),
            ]
            return c.cqs.ReEnqueue(iter(frames), timeout=WAIT)

        denied(lambda: reenqueue(bob))
        assert status(lambda: reenqueue(alice))[0] != grpc.StatusCode.PERMISSION_DENIED
    finally:
        for c in (root, alice, bob):
            c.close()


def _watch_outcome(c: Client, key: bytes) -> tuple[grpc.StatusCode, str]:
    stream = WatchStream(c.channel)
    try:
        create = rpc_pb2.WatchCreateRequest(key=key)
        stream._requests.put(rpc_pb2.WatchRequest(create_request=create))
        resp = stream.next()
        assert resp.created, resp
        if resp.canceled:
            assert resp.cancel_reason == "etcdserver: permission denied", resp
            return grpc.StatusCode.PERMISSION_DENIED, resp.cancel_reason
        return grpc.StatusCode.OK, ""
    finally:
        stream.close()


def _consume(c: Client, producer: Client) -> tuple[grpc.StatusCode, str]:
    """Watch a consumer key of queue `aq`; allowed means a message arrives."""
    stream = WatchStream(c.channel)
    try:
        consumer = new_id()
        create = rpc_pb2.WatchCreateRequest(key=consumer_key(b"aq", consumer))
        stream._requests.put(rpc_pb2.WatchRequest(create_request=create))
        resp = stream.next()
        if resp.canceled:
            assert resp.cancel_reason == "etcdserver: permission denied"
            return grpc.StatusCode.PERMISSION_DENIED, resp.cancel_reason
        producer.kv.Put(rpc_pb2.PutRequest(key=b"/q/aq/p/m-" + consumer, value=b"v"))
        (event,) = stream.events(1)
        assert event.kv.key.startswith(b"/q/aq/0"), event
        producer.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=event.kv.key), timeout=WAIT)
        return grpc.StatusCode.OK, ""
    finally:
        stream.close()


def _lease_with_key(root: Client, key: bytes) -> int:
    lease = root.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=60), timeout=WAIT).ID
    root.kv.Put(rpc_pb2.PutRequest(key=key, value=b"v", lease=lease), timeout=WAIT)
    return int(lease)


def test_auth_matrix(server: ServerProcess) -> None:
    """Each RPC family, for alice (holds the permission) and bob (does not)."""
    root = login(server.endpoint, "root", "rootpw")
    users = {
        "alice": login(server.endpoint, "alice", "alicepw"),
        "bob": login(server.endpoint, "bob", "bobpw"),
    }
    # a queue message to acknowledge, and a CQS queue with one notification
    root.kv.Put(rpc_pb2.PutRequest(key=b"ro/k", value=b"v"), timeout=WAIT)
    root.cqs.CreateOrConfigureQueue(
        cqs_pb2.CreateOrConfigureQueueRequest(
            queue_name="cq", subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type="authdto")]
        ),
        timeout=WAIT,
    )

    def ack(c: Client) -> object:
        key = b"/q/aq/p/ack-" + new_id()
        root.kv.Put(rpc_pb2.PutRequest(key=key, value=b"v"), timeout=WAIT)
        msgs = root.kv.Range(
            rpc_pb2.RangeRequest(key=b"/q/aq/0", range_end=b"/q/aq/:"), timeout=WAIT
        ).kvs
        target = next(m.key for m in msgs if m.key.endswith(key[len(b"/q/aq/p/") :]))
        return c.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=target), timeout=WAIT)

    def cqs_round(c: Client) -> object:
        publication = json.dumps({"dto_id": "d1", "sla_timestamp": "2026-01-01T00:00:00Z"})
        root.kv.Put(
            rpc_pb2.PutRequest(key=b"/q/dto:authdto/p/" + new_id(), value=publication.encode())
        )
        got = c.cqs.BatchDequeue(
            cqs_pb2.BatchDequeueRequest(queue_name="cq", max_notifications=10), timeout=WAIT
        )
        return c.cqs.BatchAcknowledge(
            cqs_pb2.BatchAcknowledgeRequest(
                queue_name="cq", ack_tokens=[n.ack_token for n in got.notifications]
            ),
            timeout=WAIT,
        )

    def txn(c: Client) -> object:
        nested = rpc_pb2.TxnRequest(
            success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"app/n", value=b"1"))]
        )
        return c.kv.Txn(
            rpc_pb2.TxnRequest(
                compare=[rpc_pb2.Compare(key=b"app/t", target=rpc_pb2.Compare.VERSION)],
                success=[
                    rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=b"ro/k")),
                    rpc_pb2.RequestOp(request_txn=nested),
                ],
            ),
            timeout=WAIT,
        )

    def lock(c: Client) -> object:
        lease = c.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30), timeout=WAIT).ID
        held = c.lock.Lock(v3lock_pb2.LockRequest(name=b"lk", lease=lease), timeout=WAIT)
        return c.lock.Unlock(v3lock_pb2.UnlockRequest(key=held.key), timeout=WAIT)

    def election(c: Client) -> object:
        lease = c.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30), timeout=WAIT).ID
        won = c.election.Campaign(
            v3election_pb2.CampaignRequest(name=b"el", lease=lease, value=b"me"), timeout=WAIT
        )
        return c.election.Resign(v3election_pb2.ResignRequest(leader=won.leader), timeout=WAIT)

    families: dict[str, Callable[[Client], tuple[grpc.StatusCode, str | None]]] = {
        "Range (READ app/ prefix)": lambda c: status(
            lambda: c.kv.Range(
                rpc_pb2.RangeRequest(key=b"app/", range_end=prefix_end(b"app/")), timeout=WAIT
            )
        ),
        "Put (WRITE app/k)": lambda c: status(
            lambda: c.kv.Put(rpc_pb2.PutRequest(key=b"app/k", value=b"v"), timeout=WAIT)
        ),
        "Put to a READ-only key": lambda c: status(
            lambda: c.kv.Put(rpc_pb2.PutRequest(key=b"ro/k", value=b"v"), timeout=WAIT)
        ),
        "DeleteRange (WRITE app/k)": lambda c: status(
            lambda: c.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"app/k"), timeout=WAIT)
        ),
        "Txn (compare, range, nested put)": lambda c: status(lambda: txn(c)),
        "Watch (READ ro/k)": lambda c: _watch_outcome(c, b"ro/k"),
        "LeaseRevoke (WRITE attached app/l)": lambda c: status(
            lambda: c.lease.LeaseRevoke(
                rpc_pb2.LeaseRevokeRequest(ID=_lease_with_key(root, b"app/l")), timeout=WAIT
            )
        ),
        "Lock + Unlock (lk/)": lambda c: status(lambda: lock(c)),
        "Election Campaign + Resign (el/)": lambda c: status(lambda: election(c)),
        "Queue produce (Put /q/aq/p/k)": lambda c: status(
            lambda: c.kv.Put(rpc_pb2.PutRequest(key=b"/q/aq/p/k", value=b"v"), timeout=WAIT)
        ),
        "Queue consume (watch /q/aq/c/uuid)": lambda c: _consume(c, root),
        "Queue ack (delete /q/aq/{idx}/k)": lambda c: status(lambda: ack(c)),
        "CQS BatchDequeue + BatchAcknowledge (cq)": lambda c: status(lambda: cqs_round(c)),
        "CQS CreateOrConfigureQueue (cq)": lambda c: status(
            lambda: c.cqs.CreateOrConfigureQueue(
                cqs_pb2.CreateOrConfigureQueueRequest(
                    queue_name="cq",
                    subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type="authdto")],
                ),
                timeout=WAIT,
            )
        ),
    }
    expect_alice_denied = {"Put to a READ-only key"}
    matrix: dict[str, dict[str, str]] = {}
    try:
        for family, run in families.items():
            row = {name: run(c)[0].name for name, c in users.items()}
            matrix[family] = row
            assert row["bob"] == "PERMISSION_DENIED", (family, row)
            alice_expected = "PERMISSION_DENIED" if family in expect_alice_denied else "OK"
            assert row["alice"] == alice_expected, (family, row)
        # the two drained queues hold nothing bob's refused calls left behind
    finally:
        for c in (root, *users.values()):
            c.close()
        width = max(len(f) for f in families)
        print(f"\n{'RPC family':<{width}}  alice (granted)    bob (no role)")
        for family, row in matrix.items():
            print(f"{family:<{width}}  {row['alice']:<17}  {row['bob']}")
        out = os.environ.get("AUTH_MATRIX_OUT")
        if out:
            Path(out).write_text(json.dumps(matrix, indent=2))


def test_auth_state_survives_kill_9(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "authcrash.etcd", extra_args=FAST_BCRYPT).start()
    try:
        c = Client(srv.endpoint)
        setup_auth(c)
        c.close()
        srv.kill()
        srv.start()
        anon = Client(srv.endpoint)
        assert status(lambda: anon.kv.Range(rpc_pb2.RangeRequest(key=b"app/x")))[1] == (
            "etcdserver: user name is empty"
        )
        anon.close()
        root = login(srv.endpoint, "root", "rootpw")
        assert root.auth.AuthStatus(rpc_pb2.AuthStatusRequest(), timeout=WAIT).enabled
        assert list(root.auth.UserList(rpc_pb2.AuthUserListRequest(), timeout=WAIT).users) == [
            "alice",
            "bob",
            "root",
        ]
        root.close()
        alice = login(srv.endpoint, "alice", "alicepw")
        alice.kv.Put(rpc_pb2.PutRequest(key=b"app/after", value=b"v"), timeout=WAIT)
        denied(lambda: alice.kv.Put(rpc_pb2.PutRequest(key=b"other", value=b"v"), timeout=WAIT))
        denied(lambda: alice.auth.AuthDisable(rpc_pb2.AuthDisableRequest(), timeout=WAIT))
        root = login(srv.endpoint, "root", "rootpw")
        root.auth.AuthDisable(rpc_pb2.AuthDisableRequest(), timeout=WAIT)
        root.close()
        # disabled: a token still sent is ignored, everything is allowed
        alice.kv.Put(rpc_pb2.PutRequest(key=b"other", value=b"v"), timeout=WAIT)
        alice.auth.UserList(rpc_pb2.AuthUserListRequest(), timeout=WAIT)
        alice.close()
    finally:
        srv.stop()


def _login_when_replicated(endpoint: str, name: str, password: str) -> Client:
    """Log in on a member once the auth changes reached it (bounded)."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            return login(endpoint, name, password)
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise


def test_auth_replicates_to_every_member(tmp_path: Path) -> None:
    """Users, roles and the enabled flag travel through the Raft log; tokens are
    the issuing member's own."""
    cluster = Cluster(tmp_path, extra_args=FAST_BCRYPT).start()
    try:
        first, other = cluster.members[0], cluster.members[2]
        c = Client(first.endpoint)
        setup_auth(c)
        c.close()
        alice = _login_when_replicated(other.endpoint, "alice", "alicepw")
        alice.kv.Put(rpc_pb2.PutRequest(key=b"app/replicated", value=b"v"), timeout=WAIT)
        denied(lambda: alice.kv.Put(rpc_pb2.PutRequest(key=b"other", value=b"v"), timeout=WAIT))
        alice.close()
        anon = Client(first.endpoint)
        token = anon.auth.Authenticate(
            rpc_pb2.AuthenticateRequest(name="alice", password="alicepw"), timeout=WAIT
        ).token
        anon.close()
        here, elsewhere = Client(first.endpoint, token), Client(other.endpoint, token)
        here.kv.Range(rpc_pb2.RangeRequest(key=b"app/replicated"), timeout=WAIT)
        # simple tokens are node-local: another member does not know it
        assert status(lambda: elsewhere.kv.Range(rpc_pb2.RangeRequest(key=b"app/x"))) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "etcdserver: invalid auth token",
        )
        here.close()
        elsewhere.close()
    finally:
        cluster.stop()
