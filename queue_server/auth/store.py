"""The auth store: replicated state, changed only through the log.

What it owns: whether auth is enabled, the users (bcrypt password hash, sorted
roles, the no-password option), the roles (their key permissions) and the auth
revision, which counts every successful change (it starts at 1, as etcd's does).

Rules of this module:
- `apply` is deterministic and cheap: the proposer already hashed the password
  (etcd 3.5 carries it base64-encoded in `hashedPassword`), so no bcrypt, clock,
  randomness or I/O happens here. A refused change raises an `EtcdError`, which
  the state machine returns as the command's result; nothing changed then.
- Who may ask for a change (the root role) is the API layer's question, decided
  before proposing (`queue_server.auth.perms.check_admin`); the store keeps etcd's
  own invariants: the root user and role cannot be deleted and root cannot lose
  the root role while auth is enabled, and auth cannot be enabled without a root
  user holding the root role.
- Reads (`user_roles`, `role_permissions`, lists) never change anything.

The role named "root" need not exist as a role for a user to hold it (etcd lets
`user grant-role root root` work on a fresh cluster); holding it means every
permission on every key.
"""

from __future__ import annotations

import base64
import binascii
import bisect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from google.protobuf.message import Message

from etcdserverpb import auth_pb2, internal_pb2, rpc_pb2
from queue_server.auth import errors

ROOT_USER = "root"
ROOT_ROLE = "root"

READ = auth_pb2.Permission.READ
WRITE = auth_pb2.Permission.WRITE
READWRITE = auth_pb2.Permission.READWRITE


class Perm(NamedTuple):
    """One key permission of a role: [key, range_end) or the key alone when
    range_end is empty; range_end b"\\0" means every key from `key` on."""

    key: bytes
    range_end: bytes
    perm_type: int


ROOT_PERM = Perm(b"", b"\x00", READWRITE)
"""What RoleGet shows for the root role, as etcd does."""


@dataclass(slots=True)
class User:
    name: str
    password: bytes
    """bcrypt hash; empty for a no-password user."""
    roles: list[str] = field(default_factory=list)
    """Sorted, no duplicates."""
    no_password: bool = False
    credential_revision: int = 0
    """The auth revision at which the user was added or its password changed:
    tokens issued before it are void."""

    @property
    def is_root(self) -> bool:
        i = bisect.bisect_left(self.roles, ROOT_ROLE)
        return i < len(self.roles) and self.roles[i] == ROOT_ROLE


def valid_permission_range(key: bytes, range_end: bytes) -> bool:
    """etcd's isValidPermissionRange: a key, a key range with key < range_end, or
    an open range (range_end b"\\0")."""
    if not key:
        return False
    return not range_end or key < range_end or range_end == b"\x00"


class AuthStore:
    """Users, roles and the enabled flag of one replica."""

    def __init__(self) -> None:
        self.enabled = False
        self.revision = 1
        self.enable_revision = 0
        """The auth revision when auth was last enabled: older tokens are void."""
        self.users: dict[str, User] = {}
        self.roles: dict[str, list[Perm]] = {}
        self.generation = 0
        """Bumped on every change, so derived caches (merged permissions) know
        when to rebuild; not replicated."""

    # -- changes --------------------------------------------------------------

    def apply(self, command: internal_pb2.AuthCommand) -> Message:
        """Apply one auth change; raises an EtcdError (with nothing changed) if
        etcd would refuse it."""
        kind = command.WhichOneof("request")
        handler = getattr(self, f"_{kind}", None)
        if handler is None:
            raise AssertionError(f"unknown auth command {kind!r}")
        response: Message = handler(getattr(command, kind))
        return response

    def _commit(self) -> None:
        self.revision += 1
        self.generation += 1

    def _auth_enable(self, r: rpc_pb2.AuthEnableRequest) -> rpc_pb2.AuthEnableResponse:
        if not self.enabled:
            root = self.users.get(ROOT_USER)
            if root is None:
                raise errors.RootUserNotExist()
            if not root.is_root:
                raise errors.RootRoleNotExist()
            self.enabled = True
            self.enable_revision = self.revision
            self.generation += 1
        return rpc_pb2.AuthEnableResponse()

    def _auth_disable(self, r: rpc_pb2.AuthDisableRequest) -> rpc_pb2.AuthDisableResponse:
        if self.enabled:
            self.enabled = False
            self._commit()
        return rpc_pb2.AuthDisableResponse()

    def _user_add(self, r: rpc_pb2.AuthUserAddRequest) -> rpc_pb2.AuthUserAddResponse:
        if not r.name:
            raise errors.UserEmpty()
        if r.name in self.users:
            raise errors.UserAlreadyExist()
        no_password = r.options.no_password
        self._commit()
        self.users[r.name] = User(
            r.name,
            b"" if no_password else _decode_hash(r.hashedPassword),
            [],
            no_password,
            self.revision,
        )
        return rpc_pb2.AuthUserAddResponse()

    def _user_delete(self, r: rpc_pb2.AuthUserDeleteRequest) -> rpc_pb2.AuthUserDeleteResponse:
        if self.enabled and r.name == ROOT_USER:
            raise errors.InvalidAuthMgmt()
        if r.name not in self.users:
            raise errors.UserNotFound()
        del self.users[r.name]
        self._commit()
        return rpc_pb2.AuthUserDeleteResponse()

    def _user_change_password(
        self, r: rpc_pb2.AuthUserChangePasswordRequest
    ) -> rpc_pb2.AuthUserChangePasswordResponse:
        user = self.users.get(r.name)
        if user is None:
            raise errors.UserNotFound()
        self._commit()
        if not user.no_password:
            user.password = _decode_hash(r.hashedPassword)
        user.credential_revision = self.revision
        return rpc_pb2.AuthUserChangePasswordResponse()

    def _user_grant_role(
        self, r: rpc_pb2.AuthUserGrantRoleRequest
    ) -> rpc_pb2.AuthUserGrantRoleResponse:
        user = self.users.get(r.user)
        if user is None:
            raise errors.UserNotFound()
        if r.role != ROOT_ROLE and r.role not in self.roles:
            raise errors.RoleNotFound()
        if r.role not in user.roles:  # granting twice is ignored, as in etcd
            bisect.insort(user.roles, r.role)
            self._commit()
        return rpc_pb2.AuthUserGrantRoleResponse()

    def _user_revoke_role(
        self, r: rpc_pb2.AuthUserRevokeRoleRequest
    ) -> rpc_pb2.AuthUserRevokeRoleResponse:
        if self.enabled and r.name == ROOT_USER and r.role == ROOT_ROLE:
            raise errors.InvalidAuthMgmt()
        user = self.users.get(r.name)
        if user is None:
            raise errors.UserNotFound()
        if r.role not in user.roles:
            raise errors.RoleNotGranted()
        user.roles.remove(r.role)
        self._commit()
        return rpc_pb2.AuthUserRevokeRoleResponse()

    def _role_add(self, r: rpc_pb2.AuthRoleAddRequest) -> rpc_pb2.AuthRoleAddResponse:
        if not r.name:
            raise errors.RoleEmpty()
        if r.name in self.roles:
            raise errors.RoleAlreadyExist()
        self.roles[r.name] = []
        self._commit()
        return rpc_pb2.AuthRoleAddResponse()

    def _role_delete(self, r: rpc_pb2.AuthRoleDeleteRequest) -> rpc_pb2.AuthRoleDeleteResponse:
        if self.enabled and r.role == ROOT_ROLE:
            raise errors.InvalidAuthMgmt()
        if r.role not in self.roles:
            raise errors.RoleNotFound()
        del self.roles[r.role]
        for user in self.users.values():
            if r.role in user.roles:
                user.roles.remove(r.role)
        self._commit()
        return rpc_pb2.AuthRoleDeleteResponse()

    def _role_grant_permission(
        self, r: rpc_pb2.AuthRoleGrantPermissionRequest
    ) -> rpc_pb2.AuthRoleGrantPermissionResponse:
        if not r.HasField("perm"):
            raise errors.PermissionNotGiven()
        if not valid_permission_range(r.perm.key, r.perm.range_end):
            raise errors.InvalidAuthMgmt()
        perms = self.roles.get(r.name)
        if perms is None:
            raise errors.RoleNotFound()
        new = Perm(r.perm.key, r.perm.range_end, r.perm.permType)
        for i, p in enumerate(perms):
            if p.key == new.key and p.range_end == new.range_end:
                perms[i] = new  # same range: the type is updated
                break
        else:
            bisect.insort(perms, new)
        self._commit()
        return rpc_pb2.AuthRoleGrantPermissionResponse()

    def _role_revoke_permission(
        self, r: rpc_pb2.AuthRoleRevokePermissionRequest
    ) -> rpc_pb2.AuthRoleRevokePermissionResponse:
        perms = self.roles.get(r.role)
        if perms is None:
            raise errors.RoleNotFound()
        kept = [p for p in perms if p.key != r.key or p.range_end != r.range_end]
        if len(kept) == len(perms):
            raise errors.PermissionNotGranted()
        self.roles[r.role] = kept
        self._commit()
        return rpc_pb2.AuthRoleRevokePermissionResponse()

    # -- reads ----------------------------------------------------------------

    def user_roles(self, name: str) -> list[str]:
        user = self.users.get(name)
        if user is None:
            raise errors.UserNotFound()
        return list(user.roles)

    def role_permissions(self, name: str) -> list[Perm]:
        if name == ROOT_ROLE:
            if name not in self.roles:
                raise errors.RoleNotFound()
            return [ROOT_PERM]
        perms = self.roles.get(name)
        if perms is None:
            raise errors.RoleNotFound()
        return list(perms)

    def user_names(self) -> list[str]:
        return sorted(self.users)

    def role_names(self) -> list[str]:
        return sorted(self.roles)

    def has_role(self, user: str, role: str) -> bool:
        u = self.users.get(user)
        return u is not None and role in u.roles

    # -- snapshots ------------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "revision": self.revision,
            "enable_revision": self.enable_revision,
            "users": [
                (u.name, u.password, list(u.roles), u.no_password, u.credential_revision)
                for u in self.users.values()
            ],
            "roles": {name: [tuple(p) for p in perms] for name, perms in self.roles.items()},
        }

    def restore_state(self, state: dict[str, Any] | None) -> None:
        """Load `export_state`'s output; None (a snapshot from before auth) is the
        empty store."""
        fresh = AuthStore()
        if state is not None:
            fresh.enabled = bool(state["enabled"])
            fresh.revision = int(state["revision"])
            fresh.enable_revision = int(state["enable_revision"])
            for name, password, roles, no_password, cred_rev in state["users"]:
                fresh.users[name] = User(name, password, sorted(roles), no_password, cred_rev)
            for name, perms in state["roles"].items():
                fresh.roles[name] = sorted(Perm(*p) for p in perms)
        self.enabled, self.revision = fresh.enabled, fresh.revision
        self.enable_revision = fresh.enable_revision
        self.users, self.roles = fresh.users, fresh.roles
        self.generation += 1


def _decode_hash(hashed: str) -> bytes:
    """The bcrypt hash the proposer put in `hashedPassword` (base64, as etcd)."""
    try:
        return base64.b64decode(hashed, validate=True)
    except (binascii.Error, ValueError):
        return b""  # never matches a password: the user can only be a no-password one
