"""The etcdserverpb.Auth service: enable/disable, status, authenticate, users, roles.

Every handler has the four steps: check who may ask (the root role for all but
Authenticate, a user's own UserGet and the RoleGet of a role the user holds, as
etcd's authApplierV3), call the core (a read of the replicated `AuthStore`, or an
`AuthCommand` proposed through the log), turn a core error into etcd's status,
fill the header.

Passwords are hashed here, on the proposer, in a thread (bcrypt is slow on
purpose), and travel in the log only as etcd 3.5's `hashedPassword`; apply never
hashes. Authenticate checks the password in a thread too, then issues a simple
token from the node's table.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from etcdserverpb import auth_pb2, internal_pb2, rpc_pb2, rpc_pb2_grpc
from queue_server.api.auth_gate import AuthGate
from queue_server.api.errors import R, abort, propose_or_abort
from queue_server.api.header import HeaderFiller
from queue_server.apply import Proposer
from queue_server.auth import errors
from queue_server.auth.passwords import BCRYPT_COST, check_password, hash_password
from queue_server.errors import EtcdError
from queue_server.transport.methods import Call


class AuthService(rpc_pb2_grpc.AuthServicer):
    """Serves Auth: reads from the auth store, changes through the log."""

    def __init__(
        self, gate: AuthGate, log: Proposer, header: HeaderFiller, bcrypt_cost: int = BCRYPT_COST
    ) -> None:
        self.gate = gate
        self.store = gate.store
        self.log = log
        self.header = header
        self.bcrypt_cost = bcrypt_cost

    async def _require_admin(self, context: Call) -> None:
        try:
            self.gate.checker.check_admin(self.gate.user_of(context))
        except EtcdError as e:
            await abort(context, e)

    async def _change(self, context: Call, response: type[R], /, **request: Any) -> R:
        """Admin check, then propose one AuthCommand and answer its `response`."""
        await self._require_admin(context)
        command = internal_pb2.Command(auth=internal_pb2.AuthCommand(**request))
        return await propose_or_abort(self.log, command, context, self.header, response)

    async def _admin_read(self, context: Call) -> None:
        try:
            self.gate.checker.check_admin(self.gate.user_of(context))
            await self.log.linearize()
        except EtcdError as e:
            await abort(context, e)

    async def _hash(self, password: str) -> str:
        return await asyncio.to_thread(hash_password, password, self.bcrypt_cost)

    async def AuthEnable(
        self, request: rpc_pb2.AuthEnableRequest, context: Call
    ) -> rpc_pb2.AuthEnableResponse:
        return await self._change(context, rpc_pb2.AuthEnableResponse, auth_enable=request)

    async def AuthDisable(
        self, request: rpc_pb2.AuthDisableRequest, context: Call
    ) -> rpc_pb2.AuthDisableResponse:
        return await self._change(context, rpc_pb2.AuthDisableResponse, auth_disable=request)

    async def AuthStatus(
        self, request: rpc_pb2.AuthStatusRequest, context: Call
    ) -> rpc_pb2.AuthStatusResponse:
        await self._admin_read(context)
        resp = rpc_pb2.AuthStatusResponse(
            enabled=self.store.enabled, authRevision=self.store.revision
        )
        self.header.fill(resp.header)
        return resp

    async def Authenticate(
        self, request: rpc_pb2.AuthenticateRequest, context: Call
    ) -> rpc_pb2.AuthenticateResponse:
        try:
            token = await self._authenticate(request.name, request.password)
        except EtcdError as e:
            await abort(context, e)
        resp = rpc_pb2.AuthenticateResponse(token=token)
        self.header.fill(resp.header)
        return resp

    async def _authenticate(self, name: str, password: str) -> str:
        if not self.store.enabled:
            raise errors.AuthNotEnabled()
        user = self.store.users.get(name)
        if user is None or user.no_password:
            raise errors.AuthFailed()
        credentials = user.credential_revision
        if not await asyncio.to_thread(check_password, user.password, password):
            raise errors.AuthFailed()
        # The store may have changed while bcrypt ran (etcd: the same check by revision).
        user = self.store.users.get(name)
        if user is None or user.credential_revision != credentials or not self.store.enabled:
            raise errors.AuthFailed()
        return self.gate.tokens.assign(name)

    async def UserAdd(
        self, request: rpc_pb2.AuthUserAddRequest, context: Call
    ) -> rpc_pb2.AuthUserAddResponse:
        await self._require_admin(context)  # before paying for a hash
        if not request.name:
            await abort(context, errors.UserEmpty())
        r = rpc_pb2.AuthUserAddRequest(name=request.name, options=request.options)
        if not request.options.no_password:
            r.hashedPassword = await self._hash(request.password)
        return await self._change(context, rpc_pb2.AuthUserAddResponse, user_add=r)

    async def UserGet(
        self, request: rpc_pb2.AuthUserGetRequest, context: Call
    ) -> rpc_pb2.AuthUserGetResponse:
        try:
            user = self.gate.user_of(context)
            if user != request.name:  # one's own roles need no admin
                self.gate.checker.check_admin(user)
            await self.log.linearize()
            roles = self.store.user_roles(request.name)
        except EtcdError as e:
            await abort(context, e)
        resp = rpc_pb2.AuthUserGetResponse(roles=roles)
        self.header.fill(resp.header)
        return resp

    async def UserList(
        self, request: rpc_pb2.AuthUserListRequest, context: Call
    ) -> rpc_pb2.AuthUserListResponse:
        await self._admin_read(context)
        resp = rpc_pb2.AuthUserListResponse(users=self.store.user_names())
        self.header.fill(resp.header)
        return resp

    async def UserDelete(
        self, request: rpc_pb2.AuthUserDeleteRequest, context: Call
    ) -> rpc_pb2.AuthUserDeleteResponse:
        return await self._change(context, rpc_pb2.AuthUserDeleteResponse, user_delete=request)

    async def UserChangePassword(
        self, request: rpc_pb2.AuthUserChangePasswordRequest, context: Call
    ) -> rpc_pb2.AuthUserChangePasswordResponse:
        await self._require_admin(context)  # before paying for a hash
        r = rpc_pb2.AuthUserChangePasswordRequest(name=request.name)
        user = self.store.users.get(request.name)
        if user is not None and not user.no_password:
            r.hashedPassword = await self._hash(request.password)
        return await self._change(
            context, rpc_pb2.AuthUserChangePasswordResponse, user_change_password=r
        )

    async def UserGrantRole(
        self, request: rpc_pb2.AuthUserGrantRoleRequest, context: Call
    ) -> rpc_pb2.AuthUserGrantRoleResponse:
        return await self._change(
            context, rpc_pb2.AuthUserGrantRoleResponse, user_grant_role=request
        )

    async def UserRevokeRole(
        self, request: rpc_pb2.AuthUserRevokeRoleRequest, context: Call
    ) -> rpc_pb2.AuthUserRevokeRoleResponse:
        return await self._change(
            context, rpc_pb2.AuthUserRevokeRoleResponse, user_revoke_role=request
        )

    async def RoleAdd(
        self, request: rpc_pb2.AuthRoleAddRequest, context: Call
    ) -> rpc_pb2.AuthRoleAddResponse:
        return await self._change(context, rpc_pb2.AuthRoleAddResponse, role_add=request)

    async def RoleGet(
        self, request: rpc_pb2.AuthRoleGetRequest, context: Call
    ) -> rpc_pb2.AuthRoleGetResponse:
        try:
            user = self.gate.user_of(context)
            if user is None or not self.store.has_role(user, request.role):
                self.gate.checker.check_admin(user)
            await self.log.linearize()
            perms = self.store.role_permissions(request.role)
        except EtcdError as e:
            await abort(context, e)
        resp = rpc_pb2.AuthRoleGetResponse(
            perm=[
                auth_pb2.Permission(key=k, range_end=e, permType=cast(Any, t)) for k, e, t in perms
            ]
        )
        self.header.fill(resp.header)
        return resp

    async def RoleList(
        self, request: rpc_pb2.AuthRoleListRequest, context: Call
    ) -> rpc_pb2.AuthRoleListResponse:
        await self._admin_read(context)
        resp = rpc_pb2.AuthRoleListResponse(roles=self.store.role_names())
        self.header.fill(resp.header)
        return resp

    async def RoleDelete(
        self, request: rpc_pb2.AuthRoleDeleteRequest, context: Call
    ) -> rpc_pb2.AuthRoleDeleteResponse:
        return await self._change(context, rpc_pb2.AuthRoleDeleteResponse, role_delete=request)

    async def RoleGrantPermission(
        self, request: rpc_pb2.AuthRoleGrantPermissionRequest, context: Call
    ) -> rpc_pb2.AuthRoleGrantPermissionResponse:
        return await self._change(
            context, rpc_pb2.AuthRoleGrantPermissionResponse, role_grant_permission=request
        )

    async def RoleRevokePermission(
        self, request: rpc_pb2.AuthRoleRevokePermissionRequest, context: Call
    ) -> rpc_pb2.AuthRoleRevokePermissionResponse:
        return await self._change(
            context, rpc_pb2.AuthRoleRevokePermissionResponse, role_revoke_permission=request
        )
