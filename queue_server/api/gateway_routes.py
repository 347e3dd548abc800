"""etcd's HTTP/JSON gateway routes: which URL calls which method of the table.

What belongs here: the URL of every etcd RPC as etcd 3.5's rpc.proto,
v3lock.proto and v3election.proto bind it (`google.api.http` post rules,
additional bindings included), and `gateway_settings`, which resolves them
against the SAME `MethodTable` the gRPC side serves (its middleware, auth gate
and limits), plus `/version` for the plain GET pages. The HTTP and JSON work is
the transport's (`queue_server/transport/gateway.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from queue_server.config import SERVER_VERSION
from queue_server.transport.gateway import GatewaySettings, Page, Route
from queue_server.transport.methods import MethodTable

ROUTES: Mapping[str, str] = {
    "/v3/kv/range": "/etcdserverpb.KV/Range",
    "/v3/kv/put": "/etcdserverpb.KV/Put",
    "/v3/kv/deleterange": "/etcdserverpb.KV/DeleteRange",
    "/v3/kv/txn": "/etcdserverpb.KV/Txn",
    "/v3/kv/compaction": "/etcdserverpb.KV/Compact",
    "/v3/watch": "/etcdserverpb.Watch/Watch",
    "/v3/lease/grant": "/etcdserverpb.Lease/LeaseGrant",
    "/v3/lease/revoke": "/etcdserverpb.Lease/LeaseRevoke",
    "/v3/kv/lease/revoke": "/etcdserverpb.Lease/LeaseRevoke",
    "/v3/lease/keepalive": "/etcdserverpb.Lease/LeaseKeepAlive",
    "/v3/lease/timetolive": "/etcdserverpb.Lease/LeaseTimeToLive",
    "/v3/kv/lease/timetolive": "/etcdserverpb.Lease/LeaseTimeToLive",
    "/v3/lease/leases": "/etcdserverpb.Lease/LeaseLeases",
    "/v3/kv/lease/leases": "/etcdserverpb.Lease/LeaseLeases",
    "/v3/cluster/member/add": "/etcdserverpb.Cluster/MemberAdd",
    "/v3/cluster/member/remove": "/etcdserverpb.Cluster/MemberRemove",
    "/v3/cluster/member/update": "/etcdserverpb.Cluster/MemberUpdate",
    "/v3/cluster/member/list": "/etcdserverpb.Cluster/MemberList",
    "/v3/cluster/member/promote": "/etcdserverpb.Cluster/MemberPromote",
    "/v3/maintenance/alarm": "/etcdserverpb.Maintenance/Alarm",
    "/v3/maintenance/status": "/etcdserverpb.Maintenance/Status",
    "/v3/maintenance/defragment": "/etcdserverpb.Maintenance/Defragment",
    "/v3/maintenance/hash": "/etcdserverpb.Maintenance/Hash",
    "/v3/maintenance/hashkv": "/etcdserverpb.Maintenance/HashKV",
    "/v3/maintenance/snapshot": "/etcdserverpb.Maintenance/Snapshot",
    "/v3/maintenance/transfer-leadership": "/etcdserverpb.Maintenance/MoveLeader",
    "/v3/maintenance/downgrade": "/etcdserverpb.Maintenance/Downgrade",
    "/v3/auth/enable": "/etcdserverpb.Auth/AuthEnable",
    "/v3/auth/disable": "/etcdserverpb.Auth/AuthDisable",
    "/v3/auth/status": "/etcdserverpb.Auth/AuthStatus",
    "/v3/auth/authenticate": "/etcdserverpb.Auth/Authenticate",
    "/v3/auth/user/add": "/etcdserverpb.Auth/UserAdd",
    "/v3/auth/user/get": "/etcdserverpb.Auth/UserGet",
    "/v3/auth/user/list": "/etcdserverpb.Auth/UserList",
    "/v3/auth/user/delete": "/etcdserverpb.Auth/UserDelete",
    "/v3/auth/user/changepw": "/etcdserverpb.Auth/UserChangePassword",
    "/v3/auth/user/grant": "/etcdserverpb.Auth/UserGrantRole",
    "/v3/auth/user/revoke": "/etcdserverpb.Auth/UserRevokeRole",
    "/v3/auth/role/add": "/etcdserverpb.Auth/RoleAdd",
    "/v3/auth/role/get": "/etcdserverpb.Auth/RoleGet",
    "/v3/auth/role/list": "/etcdserverpb.Auth/RoleList",
    "/v3/auth/role/delete": "/etcdserverpb.Auth/RoleDelete",
    "/v3/auth/role/grant": "/etcdserverpb.Auth/RoleGrantPermission",
    "/v3/auth/role/revoke": "/etcdserverpb.Auth/RoleRevokePermission",
    "/v3/lock/lock": "/v3lockpb.Lock/Lock",
    "/v3/lock/unlock": "/v3lockpb.Lock/Unlock",
    "/v3/election/campaign": "/v3electionpb.Election/Campaign",
    "/v3/election/proclaim": "/v3electionpb.Election/Proclaim",
    "/v3/election/leader": "/v3electionpb.Election/Leader",
    "/v3/election/observe": "/v3electionpb.Election/Observe",
    "/v3/election/resign": "/v3electionpb.Election/Resign",
}
"""URL -> gRPC method path, from etcd 3.5's google.api.http annotations."""

HOLD_OPEN = frozenset({"/etcdserverpb.Watch/Watch"})
"""Streams that go on after the request body ends: etcd's watch server keeps
sending when its client half-closes (its receive loop returns nil on EOF), and
`curl -d '{"create_request": ...}' /v3/watch` relies on it. LeaseKeepAlive ends
on EOF in etcd, so it is not here."""

GATEWAY_PAGES = ("/health", "/metrics", "/livez", "/readyz")
"""The --listen-metrics-urls pages also answered on the client port (as etcd
answers /health and /metrics there)."""

CLUSTER_VERSION = "3.5.0"
"""What etcd 3.5 reports as the cluster version (major.minor.0)."""


def version_body() -> bytes:
    """etcd's /version: the server and the cluster version."""
    versions = {"etcdserver": SERVER_VERSION, "etcdcluster": CLUSTER_VERSION}
    return json.dumps(versions, separators=(",", ":")).encode()


async def get_version(path: str, query: str) -> tuple[int, str, bytes]:
    return 200, "application/json", version_body()


def gateway_settings(
    table: MethodTable, pages: Mapping[str, Page], max_body: int
) -> GatewaySettings:
    """The gateway over `table`: every route whose method the table serves."""
    routes = {}
    for url, path in ROUTES.items():
        method = table.methods.get(path)
        if method is not None:
            routes[url] = Route(method, hold_open=path in HOLD_OPEN)
    return GatewaySettings(routes, {"/version": get_version, **pages}, max_body)
