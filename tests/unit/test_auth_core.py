"""Unit tests of the auth core (queue_server/auth/): the replicated store applied
through `StateMachine.apply` as the log feeds it, the permission checker with
etcd's range conventions, simple tokens with an injected clock, and snapshots.
No network; bcrypt at its lowest cost."""

from __future__ import annotations

import pytest

from etcdserverpb import auth_pb2, internal_pb2, rpc_pb2
from queue_server.apply import StateMachine
from queue_server.auth import errors
from queue_server.auth.passwords import check_password, hash_password
from queue_server.auth.perms import Checker, covers, merge, prefix_end, request_interval
from queue_server.auth.store import READ, READWRITE, WRITE
from queue_server.auth.tokens import SimpleTokens
from queue_server.errors import EtcdError

pytestmark = pytest.mark.unit

FAST = 4  # bcrypt's lowest cost: tests only need a valid hash


class Machine:
    """A state machine fed auth commands at increasing log indexes."""

    def __init__(self) -> None:
        self.sm = StateMachine()
        self.index = 0

    def auth(self, **request: object) -> object:
        self.index += 1
        return self.sm.apply(
            self.index,
            internal_pb2.Command(auth=internal_pb2.AuthCommand(**request)),  # type: ignore[arg-type]
        )[0]

    def ok(self, **request: object) -> None:
        result = self.auth(**request)
        assert not isinstance(result, EtcdError), result

    def fails(self, error: type[EtcdError], **request: object) -> None:
        result = self.auth(**request)
        assert isinstance(result, error), result


def user_add(name: str, password: str = "pw", no_password: bool = False) -> dict[str, object]:
    req = rpc_pb2.AuthUserAddRequest(
        name=name, options=auth_pb2.UserAddOptions(no_password=no_password)
    )
    if not no_password:
        req.hashedPassword = hash_password(password, FAST)
    return {"user_add": req}


def grant(role: str, key: bytes, end: bytes, perm: auth_pb2.Permission.Type) -> dict[str, object]:
    return {
        "role_grant_permission": rpc_pb2.AuthRoleGrantPermissionRequest(
            name=role, perm=auth_pb2.Permission(key=key, range_end=end, permType=perm)
        )
    }


def with_root(m: Machine) -> None:
    m.ok(**user_add("root", "rootpw"))
    m.ok(user_grant_role=rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"))


def test_enable_needs_root_user_with_root_role() -> None:
    m = Machine()
    m.fails(errors.RootUserNotExist, auth_enable=rpc_pb2.AuthEnableRequest())
    m.ok(**user_add("root"))
    m.fails(errors.RootRoleNotExist, auth_enable=rpc_pb2.AuthEnableRequest())
    m.ok(user_grant_role=rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"))
    m.ok(auth_enable=rpc_pb2.AuthEnableRequest())
    assert m.sm.auth.enabled
    # root cannot be deleted, nor lose the root role, nor the root role go, while enabled
    m.fails(errors.InvalidAuthMgmt, user_delete=rpc_pb2.AuthUserDeleteRequest(name="root"))
    m.fails(
        errors.InvalidAuthMgmt,
        user_revoke_role=rpc_pb2.AuthUserRevokeRoleRequest(name="root", role="root"),
    )
    m.fails(errors.InvalidAuthMgmt, role_delete=rpc_pb2.AuthRoleDeleteRequest(role="root"))
    m.ok(auth_disable=rpc_pb2.AuthDisableRequest())
    assert not m.sm.auth.enabled


def test_user_and_role_errors_and_revision() -> None:
    m = Machine()
    assert m.sm.auth.revision == 1
    m.fails(errors.UserEmpty, **user_add(""))
    m.ok(**user_add("alice"))
    m.fails(errors.UserAlreadyExist, **user_add("alice"))
    m.fails(errors.RoleEmpty, role_add=rpc_pb2.AuthRoleAddRequest(name=""))
    m.ok(role_add=rpc_pb2.AuthRoleAddRequest(name="r"))
    m.fails(errors.RoleAlreadyExist, role_add=rpc_pb2.AuthRoleAddRequest(name="r"))
    m.fails(
        errors.RoleNotFound,
        user_grant_role=rpc_pb2.AuthUserGrantRoleRequest(user="alice", role="x"),
    )
    m.fails(
        errors.UserNotFound, user_grant_role=rpc_pb2.AuthUserGrantRoleRequest(user="bob", role="r")
    )
    m.ok(user_grant_role=rpc_pb2.AuthUserGrantRoleRequest(user="alice", role="r"))
    m.fails(
        errors.RoleNotGranted,
        user_revoke_role=rpc_pb2.AuthUserRevokeRoleRequest(name="alice", role="zz"),
    )
    m.fails(errors.RoleNotFound, **grant("nope", b"a", b"", READ))
    m.fails(errors.InvalidAuthMgmt, **grant("r", b"b", b"a", READ))
    m.ok(**grant("r", b"a", b"", READ))
    m.ok(**grant("r", b"a", b"", READWRITE))  # same range: type updated, not added
    assert m.sm.auth.role_permissions("r") == [(b"a", b"", READWRITE)]
    m.fails(
        errors.PermissionNotGranted,
        role_revoke_permission=rpc_pb2.AuthRoleRevokePermissionRequest(role="r", key=b"zz"),
    )
    m.ok(role_delete=rpc_pb2.AuthRoleDeleteRequest(role="r"))
    assert m.sm.auth.user_roles("alice") == []
    m.fails(errors.UserNotFound, user_delete=rpc_pb2.AuthUserDeleteRequest(name="bob"))
    assert m.sm.auth.revision == 7  # one per successful change, from 1


def test_snapshot_round_trip() -> None:
    m = Machine()
    with_root(m)
    m.ok(role_add=rpc_pb2.AuthRoleAddRequest(name="r"))
    m.ok(**grant("r", b"k", b"\x00", WRITE))
    m.ok(auth_enable=rpc_pb2.AuthEnableRequest())
    other = StateMachine()
    other.restore_state(m.sm.export_state())
    assert other.auth.export_state() == m.sm.auth.export_state()
    assert other.auth.enabled and other.auth.users["root"].is_root
    legacy = m.sm.export_state()
    del legacy["auth"]
    other.restore_state(legacy)
    assert not other.auth.enabled and not other.auth.users


def test_password_hash_and_check() -> None:
    hashed = hash_password("secret", FAST)
    import base64

    raw = base64.b64decode(hashed)
    assert check_password(raw, "secret")
    assert not check_password(raw, "wrong")
    assert not check_password(b"", "")


@pytest.mark.parametrize(
    ("perms", "key", "end", "allowed"),
    [
        ([(b"a", b"")], b"a", b"", True),
        ([(b"a", b"")], b"b", b"", False),
        ([(b"a", b"")], b"a", b"b", False),  # a key permission does not cover a range
        ([(b"a", b"c")], b"a", b"c", True),
        ([(b"a", b"c")], b"b", b"", True),
        ([(b"a", b"c")], b"c", b"", False),
        ([(b"a", b"c")], b"a", b"d", False),
        ([(b"a", b"c"), (b"c", b"e")], b"b", b"d", True),  # adjacent ranges join
        ([(b"a", b"c"), (b"d", b"e")], b"b", b"d", False),  # a gap
        ([(b"a", b"\x00")], b"zzz", b"\x00", True),  # open ranges
        ([(b"a", b"z")], b"b", b"\x00", False),
        ([(b"\x00", b"\x00")], b"\x00", b"\x00", True),  # everything
        ([(b"/q/x/", prefix_end(b"/q/x/"))], b"/q/x/p/k", b"", True),
        ([(b"/q/x/", prefix_end(b"/q/x/"))], b"/q/y/p/k", b"", False),
    ],
)
def test_range_coverage(
    perms: list[tuple[bytes, bytes]], key: bytes, end: bytes, allowed: bool
) -> None:
    merged = merge(request_interval(k, e) for k, e in perms)
    assert covers(merged, request_interval(key, end)) is allowed


def test_checker_rules() -> None:
    m = Machine()
    with_root(m)
    m.ok(**user_add("alice"))
    m.ok(role_add=rpc_pb2.AuthRoleAddRequest(name="reader"))
    m.ok(**grant("reader", b"foo", b"fop", READ))
    m.ok(role_add=rpc_pb2.AuthRoleAddRequest(name="writer"))
    m.ok(**grant("writer", b"foo/w", b"", WRITE))
    m.ok(user_grant_role=rpc_pb2.AuthUserGrantRoleRequest(user="alice", role="reader"))
    m.ok(user_grant_role=rpc_pb2.AuthUserGrantRoleRequest(user="alice", role="writer"))
    checker = Checker(m.sm.auth)
    # disabled: everything goes, even with no user
    checker.check_admin(None)
    checker.check_range(None, rpc_pb2.RangeRequest(key=b"x"))
    m.ok(auth_enable=rpc_pb2.AuthEnableRequest())
    with pytest.raises(errors.UserEmpty):
        checker.check_range(None, rpc_pb2.RangeRequest(key=b"x"))
    checker.check_range("root", rpc_pb2.RangeRequest(key=b"x", range_end=b"\x00"))
    checker.check_admin("root")
    with pytest.raises(errors.PermissionDenied):
        checker.check_admin("alice")
    with pytest.raises(errors.UserNotFound):
        checker.check_admin("ghost")
    checker.check_range("alice", rpc_pb2.RangeRequest(key=b"foo", range_end=b"fop"))
    with pytest.raises(errors.PermissionDenied):
        checker.check_range("alice", rpc_pb2.RangeRequest(key=b"foo", range_end=b"\x00"))
    checker.check_put("alice", rpc_pb2.PutRequest(key=b"foo/w"), [])
    with pytest.raises(errors.PermissionDenied):
        checker.check_put("alice", rpc_pb2.PutRequest(key=b"foo/x"), [])
    with pytest.raises(errors.PermissionDenied):  # its lease holds a key alice cannot write
        checker.check_put("alice", rpc_pb2.PutRequest(key=b"foo/w", lease=7), [b"other"])
    checker.check_put("alice", rpc_pb2.PutRequest(key=b"foo/w", prev_kv=True), [])
    with pytest.raises(errors.PermissionDenied):
        checker.check_delete("alice", rpc_pb2.DeleteRangeRequest(key=b"foo/a"))
    # txn: compares need READ, ops their own, nested txns too
    op_put = rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"foo/w"))
    op_bad = rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"foo/nope"))
    ok_txn = rpc_pb2.TxnRequest(compare=[rpc_pb2.Compare(key=b"foo/a")], success=[op_put])
    checker.check_txn("alice", ok_txn, lambda _: [])
    nested = rpc_pb2.TxnRequest(
        failure=[rpc_pb2.RequestOp(request_txn=rpc_pb2.TxnRequest(success=[op_bad]))]
    )
    with pytest.raises(errors.PermissionDenied):
        checker.check_txn("alice", nested, lambda _: [])
    with pytest.raises(errors.PermissionDenied):
        checker.check_txn(
            "alice", rpc_pb2.TxnRequest(compare=[rpc_pb2.Compare(key=b"z")]), lambda _: []
        )
    assert checker.watch_permitted("alice", rpc_pb2.WatchCreateRequest(key=b"foo1"))
    assert not checker.watch_permitted("alice", rpc_pb2.WatchCreateRequest(key=b"bar"))
    # a permission revoked takes effect at once (the cache follows the store)
    m.ok(
        role_revoke_permission=rpc_pb2.AuthRoleRevokePermissionRequest(
            role="reader", key=b"foo", range_end=b"fop"
        )
    )
    assert not checker.watch_permitted("alice", rpc_pb2.WatchCreateRequest(key=b"foo1"))


def test_tokens_expire_renew_and_void() -> None:
    m = Machine()
    with_root(m)
    m.ok(**user_add("alice", "pw1"))
    m.ok(auth_enable=rpc_pb2.AuthEnableRequest())
    now = [100.0]
    tokens = SimpleTokens(m.sm.auth, ttl=10.0, clock=lambda: now[0])
    t = tokens.assign("alice")
    assert t != tokens.assign("alice")
    now[0] += 9
    assert tokens.user_of(t) == "alice"  # renews
    now[0] += 9
    assert tokens.user_of(t) == "alice"
    now[0] += 10
    assert tokens.user_of(t) is None
    assert tokens.user_of("garbage") is None
    t = tokens.assign("alice")
    m.ok(
        user_change_password=rpc_pb2.AuthUserChangePasswordRequest(
            name="alice", hashedPassword=hash_password("pw2", FAST)
        )
    )
    assert tokens.user_of(t) is None  # a password change voids old tokens
    t = tokens.assign("alice")
    r = tokens.assign("root")
    m.ok(auth_disable=rpc_pb2.AuthDisableRequest())
    m.ok(auth_enable=rpc_pb2.AuthEnableRequest())
    assert tokens.user_of(t) is None and tokens.user_of(r) is None  # disable voids all


def test_guarded_methods_exist_and_cover_every_key_rpc() -> None:
    """Every rule names a real method, and every method of the key-touching
    services has a rule (so a new RPC cannot slip past auth unnoticed)."""
    from etcdserverpb import cqs_pb2, v3election_pb2, v3lock_pb2
    from queue_server.api.auth_gate import METHOD_RULES

    methods = {
        f"/{service.full_name}/{m.name}"
        for module in (rpc_pb2, v3lock_pb2, v3election_pb2, cqs_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for m in service.methods
    }
    assert set(METHOD_RULES) <= methods, set(METHOD_RULES) - methods
    unguarded = {
        "/etcdserverpb.KV/" + name for name in ("Range", "Put", "DeleteRange", "Txn", "Compact")
    } | {m for m in methods if m.startswith(("/v3lockpb.", "/v3electionpb.", "/dtoflow."))}
    assert unguarded <= set(METHOD_RULES), unguarded - set(METHOD_RULES)


def test_auth_flags_and_variables() -> None:
    from queue_server.config import ConfigError, parse_config

    default = parse_config([], environ={})
    assert (default.auth_token, default.auth_token_ttl, default.bcrypt_cost) == ("simple", 300, 10)
    cfg = parse_config(["--auth-token-ttl", "30"], environ={"ETCD_BCRYPT_COST": "4"})
    assert (cfg.auth_token_ttl, cfg.bcrypt_cost) == (30, 4)
    assert parse_config([], environ={"ETCD_AUTH_TOKEN_TTL": "7"}).auth_token_ttl == 7
    for argv in (["--auth-token", "jwt"], ["--auth-token-ttl", "0"], ["--bcrypt-cost", "3"]):
        with pytest.raises(ConfigError):
            parse_config(argv, environ={})
