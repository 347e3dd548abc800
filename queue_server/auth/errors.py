"""The auth errors, one class per etcd 3.5 error (api/v3rpc/rpctypes/error.go):
the gRPC status code name and the exact text clients match on."""

from __future__ import annotations

from queue_server.errors import EtcdError


class RootUserNotExist(EtcdError):
    """Auth enable without a root user."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: root user does not exist"


class RootRoleNotExist(EtcdError):
    """Auth enable while the root user lacks the root role."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: root user does not have root role"


class UserAlreadyExist(EtcdError):
    """A user add of a name already taken."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: user name already exists"


class UserEmpty(EtcdError):
    """A request that needs a user and has none: a user add without a name, or no
    token while auth is enabled."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: user name is empty"


class UserNotFound(EtcdError):
    """A request names a user that does not exist."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: user name not found"


class RoleAlreadyExist(EtcdError):
    """A role add of a name already taken."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: role name already exists"


class RoleNotFound(EtcdError):
    """A request names a role that does not exist."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: role name not found"


class RoleEmpty(EtcdError):
    """A role add with an empty name."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: role name is empty"


class AuthFailed(EtcdError):
    """Authenticate with an unknown user or a wrong password."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: authentication failed, invalid user ID or password"


class PermissionDenied(EtcdError):
    """The caller"s roles do not permit the request."""

    code = "PERMISSION_DENIED"
    message = "etcdserver: permission denied"


class RoleNotGranted(EtcdError):
    """A role revoke of a role the user does not hold."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: role is not granted to the user"


class PermissionNotGranted(EtcdError):
    """A permission revoke of a permission the role does not have."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: permission is not granted to the role"


class PermissionNotGiven(EtcdError):
    """A permission grant with no permission in it."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: permission not given"


class AuthNotEnabled(EtcdError):
    """Authenticate while auth is disabled."""

    code = "FAILED_PRECONDITION"
    message = "etcdserver: authentication is not enabled"


class InvalidAuthToken(EtcdError):
    """A request with a token the server does not know (or no longer)."""

    code = "UNAUTHENTICATED"
    message = "etcdserver: invalid auth token"


class InvalidAuthMgmt(EtcdError):
    """An auth change refused: deleting root or the root role while auth is enabled,
    revoking root's root role, or a permission with an invalid key range."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: invalid auth management"
