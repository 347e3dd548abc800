"""A state machine with something in every part of its state, built the way the
log builds it (commands through `StateMachine.apply`), for snapshot tests.

`rich_machine()` holds keys with history, a tombstone and a compaction, leases
with keys attached, an etcd-key queue with held, pending and redelivered
messages, a CQS queue with pending and in-flight notifications, auth users and
roles (auth enabled), members and an alarm.
"""

from __future__ import annotations

import base64
import json

from etcdserverpb import auth_pb2, internal_pb2, rpc_pb2
from queue_server.apply import StateMachine

Command = internal_pb2.Command

CONSUMER_A = b"11111111-1111-1111-1111-111111111111"
CONSUMER_B = b"22222222-2222-2222-2222-222222222222"
LEASE_ID = 0x1234
NOW_MS = 1_000_000
FAKE_HASH = base64.b64encode(b"$2b$04$" + b"x" * 53).decode()
"""A `hashedPassword` as a proposer sends it; never checked against a password here."""


class Builder:
    """A state machine fed commands at consecutive log indexes."""

    def __init__(self) -> None:
        self.sm = StateMachine()
        self.index = 0

    def apply(self, command: internal_pb2.Command) -> object:
        self.index += 1
        result, _ = self.sm.apply(self.index, command)
        return result

    def put(self, key: bytes, value: bytes = b"v", lease: int = 0) -> object:
        return self.apply(Command(put=rpc_pb2.PutRequest(key=key, value=value, lease=lease)))

    def auth(self, **request: object) -> object:
        return self.apply(Command(auth=internal_pb2.AuthCommand(**request)))  # type: ignore[arg-type]


def rich_machine() -> StateMachine:
    b = Builder()
    # keys: history, a tombstone, a compaction that dropped some of it
    for i in range(3):
        b.put(b"history", b"v%d" % i)
    b.put(b"gone", b"soon")
    b.apply(Command(delete_range=rpc_pb2.DeleteRangeRequest(key=b"gone")))
    b.apply(Command(compaction=rpc_pb2.CompactionRequest(revision=2)))
    b.put(b"history", b"after compaction")
    b.apply(Command(delete_range=rpc_pb2.DeleteRangeRequest(key=b"history")))
    b.put(b"history", b"again")
    # leases, one with a key
    b.apply(Command(lease_grant=rpc_pb2.LeaseGrantRequest(ID=LEASE_ID, TTL=30)))
    b.apply(Command(lease_grant=rpc_pb2.LeaseGrantRequest(ID=LEASE_ID + 1, TTL=60)))
    b.put(b"leased", b"v", lease=LEASE_ID)
    # an etcd-key queue: two consumers, prefetch 1, held, pending and redelivered
    b.put(b"/q/jobs/config", json.dumps({"prefetch": 1, "max_deliveries": 5}).encode())
    b.put(b"/q/jobs/c/" + CONSUMER_A, b"n1")
    b.put(b"/q/jobs/c/" + CONSUMER_B, b"n2")
    for i in range(5):
        b.put(b"/q/jobs/p/job-%d" % i, b"payload %d" % i)
    b.put(b"/q/jobs/c/" + CONSUMER_A, b"n3")  # moved node: its message is delivered again
    # a CQS queue with pending and in-flight notifications
    dto = "storeesl.v1"
    b.put(
        b"/q/r/config",
        json.dumps({"cqs": {"subscriptions": [{"dto_type": dto}], "depth": 4}}).encode(),
    )
    for i, second in enumerate((30, 10, 20, 40)):
        note = {"dto_id": f"t/a/s/{i}/esls/{i}", "sla_timestamp": f"2026-01-01T10:00:{second}Z"}
        b.put(f"/q/dto:{dto}/p/k{i}".encode(), json.dumps(note).encode())
    dequeue = Command()
    d = dequeue.cqs_dequeue
    d.queue, d.max, d.depth, d.now_ms, d.visible_until_ms, d.token_base = (
        "r",
        2,
        -1,
        NOW_MS,
        NOW_MS + 60_000,
        "tok-",
    )
    b.apply(dequeue)
    # auth: a root user, a user with a role and permissions, enabled
    b.auth(role_add=rpc_pb2.AuthRoleAddRequest(name="root"))
    b.auth(role_add=rpc_pb2.AuthRoleAddRequest(name="reader"))
    b.auth(
        role_grant_permission=rpc_pb2.AuthRoleGrantPermissionRequest(
            name="reader",
            perm=auth_pb2.Permission(key=b"a", range_end=b"b", permType=auth_pb2.Permission.READ),
        )
    )
    b.auth(user_add=rpc_pb2.AuthUserAddRequest(name="root", hashedPassword=FAKE_HASH))
    b.auth(user_grant_role=rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"))
    b.auth(
        user_add=rpc_pb2.AuthUserAddRequest(
            name="bob", options=auth_pb2.UserAddOptions(no_password=True)
        )
    )
    b.auth(user_grant_role=rpc_pb2.AuthUserGrantRoleRequest(user="bob", role="reader"))
    b.auth(auth_enable=rpc_pb2.AuthEnableRequest())
    # members, then an alarm (last: NOSPACE refuses writes after it)
    b.index += 1
    b.sm.apply_member_change(b.index, 0xA1, True, ("http://10.0.0.1:2380",))
    b.apply(
        Command(
            member_attributes=internal_pb2.MemberAttributes(
                id=0xA1,
                name="one",
                peer_urls=["http://10.0.0.1:2380"],
                client_urls=["http://10.0.0.1:2379"],
            )
        )
    )
    b.index += 1
    b.sm.apply_member_change(b.index, 0xB2, True, ("http://10.0.0.2:2380",))
    b.apply(
        Command(
            alarm=rpc_pb2.AlarmRequest(
                action=rpc_pb2.AlarmRequest.ACTIVATE, memberID=0xA1, alarm=rpc_pb2.NOSPACE
            )
        )
    )
    return b.sm
