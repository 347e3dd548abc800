"""The auth errors, one class per etcd 3.5 error (api/v3rpc/rpctypes/error.go):
the gRPC status code name and the exact text clients match on."""

from __future__ import annotations

from queue_server.errors import EtcdError


def _error(name: str, code: str, message: str) -> type[EtcdError]:
    return type(name, (EtcdError,), {"code": code, "message": message, "__doc__": message})


RootUserNotExist = _error(
    "RootUserNotExist", "FAILED_PRECONDITION", "etcdserver: root user does not exist"
)
RootRoleNotExist = _error(
    "RootRoleNotExist", "FAILED_PRECONDITION", "etcdserver: root user does not have root role"
)
UserAlreadyExist = _error(
    "UserAlreadyExist", "FAILED_PRECONDITION", "etcdserver: user name already exists"
)
UserEmpty = _error("UserEmpty", "INVALID_ARGUMENT", "etcdserver: user name is empty")
UserNotFound = _error("UserNotFound", "FAILED_PRECONDITION", "etcdserver: user name not found")
RoleAlreadyExist = _error(
    "RoleAlreadyExist", "FAILED_PRECONDITION", "etcdserver: role name already exists"
)
RoleNotFound = _error("RoleNotFound", "FAILED_PRECONDITION", "etcdserver: role name not found")
RoleEmpty = _error("RoleEmpty", "INVALID_ARGUMENT", "etcdserver: role name is empty")
AuthFailed = _error(
    "AuthFailed",
    "INVALID_ARGUMENT",
    "etcdserver: authentication failed, invalid user ID or password",
)
PermissionDenied = _error("PermissionDenied", "PERMISSION_DENIED", "etcdserver: permission denied")
RoleNotGranted = _error(
    "RoleNotGranted", "FAILED_PRECONDITION", "etcdserver: role is not granted to the user"
)
PermissionNotGranted = _error(
    "PermissionNotGranted",
    "FAILED_PRECONDITION",
    "etcdserver: permission is not granted to the role",
)
PermissionNotGiven = _error(
    "PermissionNotGiven", "INVALID_ARGUMENT", "etcdserver: permission not given"
)
AuthNotEnabled = _error(
    "AuthNotEnabled", "FAILED_PRECONDITION", "etcdserver: authentication is not enabled"
)
InvalidAuthToken = _error("InvalidAuthToken", "UNAUTHENTICATED", "etcdserver: invalid auth token")
InvalidAuthMgmt = _error(
    "InvalidAuthMgmt", "INVALID_ARGUMENT", "etcdserver: invalid auth management"
)
