"""Enforcement of auth on the wire: who is calling, and may they make this call.

Who: `AuthGate.user_of(call)` reads the simple token from the gRPC metadata
key `token` (what etcdctl, clientv3 and python etcd3 send; `authorization` is
etcd's gateway spelling, also accepted). A token that is unknown, expired or
void is `etcdserver: invalid auth token` (UNAUTHENTICATED), on which etcd
clients authenticate again and retry. Without a token, the verified client
certificate's CN names the user (only a listener with --client-cert-auth asks for
certificates), as etcd does.

Whether: `METHOD_RULES` maps each guarded method (its full gRPC path) to a small
function that asks `queue_server.auth.perms.Checker`. `guard` is the middleware
that wraps each guarded method's handler with its rule (on either transport), so
the services themselves stay unaware of auth; while auth is disabled a call pays
one attribute read.
Watch is the exception: a refused watch is a canceled-watch response on a live
stream, so `WatchService` asks `AuthGate.watch_permitted` per create request.

Checks run on the member serving the call, against its applied auth state,
before anything is proposed (etcd checks again at apply with the auth revision;
see docs/auth.md).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, cast

from etcdserverpb import cqs_pb2, rpc_pb2, v3election_pb2, v3lock_pb2
from queue_server.api.errors import abort
from queue_server.apply import StateMachine
from queue_server.auth import errors
from queue_server.auth.perms import Checker
from queue_server.auth.store import READ, WRITE
from queue_server.auth.tokens import SimpleTokens
from queue_server.errors import EtcdError
from queue_server.transport.methods import Call, Handler, Method

TOKEN_METADATA_KEYS = ("token", "authorization")
"""etcd's rpctypes.TokenFieldNameGRPC and TokenFieldNameSwagger."""


class AuthGate:
    """The node's view of auth for the API layer: the checker over the replicated
    store, the node-local token table, and who a call comes from."""

    def __init__(self, state: StateMachine, tokens: SimpleTokens) -> None:
        self.state = state
        self.store = state.auth
        self.checker = Checker(state.auth)
        self.tokens = tokens

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    def user_of(self, call: Call) -> str | None:
        """The calling user (None: nobody), or InvalidAuthToken. While auth is
        disabled nobody is calling, whatever token is sent (etcd's AuthInfoFromCtx)."""
        if not self.enabled:
            return None
        for key, value in call.invocation_metadata():
            if key in TOKEN_METADATA_KEYS:
                user = self.tokens.user_of(value)
                if user is None:
                    raise errors.InvalidAuthToken()
                return user
        return call.client_common_name()  # etcd's AuthInfoFromTLS

    def lease_keys(self, lease_id: int) -> Iterable[bytes]:
        lease = self.state.lessor.leases.get(lease_id) if lease_id else None
        return lease.keys if lease is not None else ()

    def watch_permitted(self, call: Call, request: rpc_pb2.WatchCreateRequest) -> bool:
        """May this stream's user watch `request`'s range (READ)?"""
        if not self.enabled:
            return True
        try:
            user = self.user_of(call)
        except EtcdError:
            return False
        return self.checker.watch_permitted(user, request)


Rule = Callable[[AuthGate, str | None, Any], None]
"""Raise the etcd error if `user` may not make `request`."""


def _token_only(gate: AuthGate, user: str | None, request: Any) -> None:
    """No permission needed, but a token sent must be valid (checked by user_of)."""


def _admin(gate: AuthGate, user: str | None, request: Any) -> None:
    gate.checker.check_admin(user)


def _range(gate: AuthGate, user: str | None, r: rpc_pb2.RangeRequest) -> None:
    gate.checker.check_range(user, r)


def _put(gate: AuthGate, user: str | None, r: rpc_pb2.PutRequest) -> None:
    gate.checker.check_put(user, r, gate.lease_keys(r.lease))


def _delete(gate: AuthGate, user: str | None, r: rpc_pb2.DeleteRangeRequest) -> None:
    gate.checker.check_delete(user, r)


def _txn(gate: AuthGate, user: str | None, r: rpc_pb2.TxnRequest) -> None:
    gate.checker.check_txn(user, r, gate.lease_keys)


def _lease_revoke(gate: AuthGate, user: str | None, r: rpc_pb2.LeaseRevokeRequest) -> None:
    gate.checker.check_lease_revoke(user, gate.lease_keys(r.ID))


def _recipe(name: bytes, gate: AuthGate, user: str | None, perms: Sequence[int]) -> None:
    """Lock and election keys are `name/<lease hex>`: the whole `name/` prefix."""
    gate.checker.check_prefix(user, name + b"/", perms)


def _lock(gate: AuthGate, user: str | None, r: v3lock_pb2.LockRequest) -> None:
    _recipe(r.name, gate, user, (READ, WRITE))


def _unlock(gate: AuthGate, user: str | None, r: v3lock_pb2.UnlockRequest) -> None:
    gate.checker.check(user, r.key, b"", WRITE)


def _campaign(gate: AuthGate, user: str | None, r: v3election_pb2.CampaignRequest) -> None:
    _recipe(r.name, gate, user, (READ, WRITE))


def _proclaim(gate: AuthGate, user: str | None, r: v3election_pb2.ProclaimRequest) -> None:
    _recipe(r.leader.name, gate, user, (READ, WRITE))


def _resign(gate: AuthGate, user: str | None, r: v3election_pb2.ResignRequest) -> None:
    gate.checker.check(user, r.leader.key, b"", WRITE)


def _leader(gate: AuthGate, user: str | None, r: v3election_pb2.LeaderRequest) -> None:
    _recipe(r.name, gate, user, (READ,))


def cqs_queue_prefix(queue_name: str) -> bytes:
    """A CQS queue's keys: its etcd view and the producer keys that feed it."""
    return b"/q/" + queue_name.encode() + b"/"


def _cqs(gate: AuthGate, user: str | None, r: Any) -> None:
    """CQS RPCs read and change their queue: READ and WRITE on /q/{queue_name}/."""
    gate.checker.check_prefix(user, cqs_queue_prefix(r.queue_name), (READ, WRITE))


def _cqs_reenqueue(gate: AuthGate, user: str | None, r: cqs_pb2.ReEnqueueRequest) -> None:
    _cqs(gate, user, r.header)


_CQS = "/dtoflow.changequeue.v1.DtoChangeQueueService/"
METHOD_RULES: dict[str, Rule] = {
    "/etcdserverpb.KV/Range": _range,
    "/etcdserverpb.KV/Put": _put,
    "/etcdserverpb.KV/DeleteRange": _delete,
    "/etcdserverpb.KV/Txn": _txn,
    "/etcdserverpb.KV/Compact": _admin,
    "/etcdserverpb.Lease/LeaseGrant": _token_only,
    "/etcdserverpb.Lease/LeaseRevoke": _lease_revoke,
    "/etcdserverpb.Maintenance/Defragment": _admin,
    "/etcdserverpb.Maintenance/Hash": _admin,
    "/etcdserverpb.Maintenance/HashKV": _admin,
    "/etcdserverpb.Maintenance/Snapshot": _admin,
    "/etcdserverpb.Maintenance/MoveLeader": _admin,
    "/etcdserverpb.Maintenance/Downgrade": _admin,
    "/etcdserverpb.Cluster/MemberAdd": _admin,
    "/etcdserverpb.Cluster/MemberRemove": _admin,
    "/etcdserverpb.Cluster/MemberUpdate": _admin,
    "/etcdserverpb.Cluster/MemberPromote": _admin,
    "/v3lockpb.Lock/Lock": _lock,
    "/v3lockpb.Lock/Unlock": _unlock,
    "/v3electionpb.Election/Campaign": _campaign,
    "/v3electionpb.Election/Proclaim": _proclaim,
    "/v3electionpb.Election/Resign": _resign,
    "/v3electionpb.Election/Leader": _leader,
    "/v3electionpb.Election/Observe": _leader,
    _CQS + "CreateOrConfigureQueue": _cqs,
    _CQS + "BatchDequeue": _cqs,
    _CQS + "BatchAcknowledge": _cqs,
    _CQS + "ReEnqueue": _cqs_reenqueue,
}
"""The guarded methods. Not here, as in etcd: Status, Alarm, MemberList,
LeaseKeepAlive, LeaseTimeToLive, LeaseLeases; the Auth service guards itself and
Watch asks per create request."""


async def _enforce(gate: AuthGate, rule: Rule, request: Any, call: Call) -> None:
    try:
        rule(gate, gate.user_of(call), request)
    except EtcdError as e:
        await abort(call, e)


def guard(method: Method, gate: AuthGate) -> Handler:
    """Middleware: `method`'s handler with its METHOD_RULES rule checked first
    (while auth is enabled); methods without a rule are left as they are."""
    rule = METHOD_RULES.get(method.path)
    inner = method.handler
    if rule is None:
        return inner
    if method.request_streaming:
        if method.response_streaming:
            return inner  # no bidi method has a rule (Watch asks per request)

        async def stream_unary(requests: AsyncIterator[Any], call: Call) -> Any:
            """The first message names what the stream works on (ReEnqueue's
            header): check it, then hand the whole stream on."""
            assert rule is not None
            if gate.enabled:
                it = aiter(requests)
                first = await anext(it, None)
                if first is not None:
                    await _enforce(gate, rule, first, call)
                requests = _prepend(first, it)
            return await inner(requests, call)

        return stream_unary
    if inspect.isasyncgenfunction(inner):

        async def unary_stream_gen(request: Any, call: Call) -> AsyncIterator[Any]:
            assert rule is not None
            if gate.enabled:
                await _enforce(gate, rule, request, call)
            async for response in inner(request, call):
                yield response

        return unary_stream_gen

    async def enforced(request: Any, call: Call) -> Any:
        assert rule is not None
        await _enforce(gate, rule, request, call)
        return await inner(request, call)

    def unary(request: Any, call: Call) -> Awaitable[Any]:
        # A plain function, not a coroutine: while auth is off (the common case)
        # the call awaits the inner handler itself, one coroutine fewer per call.
        if gate.enabled:
            return enforced(request, call)
        return cast(Awaitable[Any], inner(request, call))

    return unary


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    if first is not None:
        yield first
    async for item in rest:
        yield item
