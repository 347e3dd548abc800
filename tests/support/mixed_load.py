"""A seeded stream of log commands of every kind, for the storage tests.

`MixedLoad(seed)` makes commands the way clients and the node's own parts
propose them (puts with and without leases, deletes, txns, compactions, lease
grants and revokes, an etcd-key queue's consumers, produces, acks and requeues,
a CQS queue's notifications, dequeues and settles, auth and member
attributes), and applies each one to its own in-memory `StateMachine` as it
makes it: that machine is the model the storage must agree with, and its
state picks what comes next (which message to ack, which token to settle,
which revision to compact).
"""

from __future__ import annotations

import json
import random
import uuid

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import StateMachine
from queue_server.errors import EtcdError
from queue_server.proposals import ApplyResult

Command = internal_pb2.Command

QUEUE = b"jobs"
DTO = "storeesl.v1"
START_MS = 1_700_000_000_000


def describe_result(result: ApplyResult) -> tuple[str, bytes | str]:
    """A result as a comparable value: a response's bytes, or an error's text."""
    if isinstance(result, EtcdError):
        return type(result).__name__, result.text
    return type(result).__name__, result.SerializeToString(deterministic=True)


class MixedLoad:
    """Commands chosen by `random.Random(seed)`, applied to `model` as made."""

    def __init__(self, seed: int, keys: int = 24) -> None:
        self.rng = random.Random(seed)
        self.model = StateMachine()
        self.commands: list[Command] = []
        self.results: list[tuple[str, bytes | str]] = []
        self.keys = [b"key/%02d" % i for i in range(keys)]
        self.now_ms = START_MS
        self.leases: list[int] = []
        self.next_lease = 0x100
        self.consumers: list[bytes] = []
        self.tokens: list[str] = []
        self.dequeues = 0
        self.notes = 0
        self.messages = 0
        for command in self._setup():
            self._apply(command)

    def _apply(self, command: Command) -> None:
        if not command.now_ms and command.WhichOneof("op") in ("put", "delete_range", "txn"):
            command.now_ms = self.now_ms
        result, _ = self.model.apply(len(self.commands) + 1, command)
        if isinstance(result, internal_pb2.CqsDequeueResponse):
            self.tokens.extend(n.ack_token for n in result.notifications)
        self.commands.append(command)
        self.results.append(describe_result(result))

    def _setup(self) -> list[Command]:
        queue_config = json.dumps({"prefetch": 2, "max_deliveries": 3}).encode()
        cqs_config = json.dumps({"cqs": {"subscriptions": [{"dto_type": DTO}], "depth": 4}})
        return [
            _put(b"/q/" + QUEUE + b"/config", queue_config),
            _put(b"/q/r/config", cqs_config.encode()),
            Command(auth=internal_pb2.AuthCommand(role_add=rpc_pb2.AuthRoleAddRequest(name="r"))),
            Command(
                member_attributes=internal_pb2.MemberAttributes(
                    id=0xA1, name="one", peer_urls=["http://10.0.0.1:2380"]
                )
            ),
        ]

    def take(self, n: int) -> list[Command]:
        """`n` more commands (applied to the model); returns all made so far."""
        for _ in range(n):
            self.now_ms += self.rng.randint(1, 500)
            self._apply(self._next())
        return self.commands

    def _next(self) -> Command:
        rng = self.rng
        kind = rng.choices(
            [
                "put",
                "put_leased",
                "delete",
                "delete_range",
                "txn",
                "compact",
                "grant",
                "revoke",
                "consumer",
                "produce",
                "ack",
                "requeue",
                "notify",
                "dequeue",
                "settle",
            ],
            weights=[30, 4, 6, 2, 5, 2, 2, 1, 1, 8, 4, 1, 5, 3, 3],
        )[0]
        store = self.model.store
        if kind == "put":
            return _put(rng.choice(self.keys), rng.randbytes(rng.randint(0, 40)))
        if kind == "put_leased" and self.leases:
            lease = rng.choice([*self.leases, 0xDEAD])  # 0xDEAD: never granted, refused
            return _put(rng.choice(self.keys), b"leased", lease=lease)
        if kind == "delete":
            return Command(delete_range=rpc_pb2.DeleteRangeRequest(key=rng.choice(self.keys)))
        if kind == "delete_range":
            a, b = sorted(rng.sample(self.keys, 2))
            return Command(delete_range=rpc_pb2.DeleteRangeRequest(key=a, range_end=b))
        if kind == "txn":
            key = rng.choice(self.keys)
            txn = rpc_pb2.TxnRequest()
            compare = txn.compare.add()
            compare.key = key
            compare.target = rpc_pb2.Compare.VERSION
            compare.result = rpc_pb2.Compare.GREATER
            compare.version = 1
            txn.success.add().request_put.CopyFrom(rpc_pb2.PutRequest(key=key, value=b"txn"))
            txn.failure.add().request_put.CopyFrom(
                rpc_pb2.PutRequest(key=rng.choice(self.keys), value=b"first")
            )
            return Command(txn=txn)
        if kind == "compact" and store.revision > max(store.compact_revision, 1):
            low = max(store.compact_revision + 1, 1)
            revision = rng.randint(low, store.revision)
            return Command(compaction=rpc_pb2.CompactionRequest(revision=revision))
        if kind == "grant":
            self.next_lease += 1
            self.leases.append(self.next_lease)
            return Command(lease_grant=rpc_pb2.LeaseGrantRequest(ID=self.next_lease, TTL=60))
        if kind == "revoke" and self.leases:
            lease = self.leases.pop(rng.randrange(len(self.leases)))
            return Command(lease_revoke=rpc_pb2.LeaseRevokeRequest(ID=lease))
        if kind == "consumer" or (kind in ("ack", "requeue") and not self.consumers):
            if self.consumers and rng.random() < 0.3:  # one leaves: its messages come back
                consumer = self.consumers.pop(rng.randrange(len(self.consumers)))
                return Command(delete_range=rpc_pb2.DeleteRangeRequest(key=_consumer(consumer)))
            consumer = str(uuid.UUID(int=rng.getrandbits(128))).encode()
            self.consumers.append(consumer)
            return _put(_consumer(consumer), b"node-%d" % rng.randint(1, 2))
        queue = self.model.queues.queues.get(QUEUE)
        held = [(idx, slot) for idx, slot in queue.holder.items()] if queue is not None else []
        if kind == "ack" and held:
            idx, slot = rng.choice(held)
            return Command(delete_range=rpc_pb2.DeleteRangeRequest(key=slot.held[idx]))
        if kind == "requeue" and held:
            idx, slot = rng.choice(held)
            return Command(
                queue_requeue=internal_pb2.QueueRequeue(
                    queue=QUEUE, consumer=slot.consumer_id, idx=[idx]
                )
            )
        if kind == "notify":
            self.notes += 1
            second = rng.randint(0, 59)
            note = {
                "dto_id": f"t/a/s/{self.notes % 7}/esls/{self.notes}",
                "sla_timestamp": f"2026-01-01T10:00:{second:02d}Z",
            }
            return _put(f"/q/dto:{DTO}/p/k{self.notes}".encode(), json.dumps(note).encode())
        if kind == "dequeue":
            self.dequeues += 1
            command = Command()
            d = command.cqs_dequeue
            d.queue, d.max, d.depth = "r", rng.randint(1, 3), -1
            d.now_ms, d.visible_until_ms = self.now_ms, self.now_ms + rng.randint(100, 5000)
            d.token_base = f"tok-{self.dequeues}-"
            return command
        if kind == "settle" and self.tokens:
            tokens = rng.sample(self.tokens, min(len(self.tokens), rng.randint(1, 2)))
            for token in tokens:
                self.tokens.remove(token)
            return Command(
                cqs_settle=internal_pb2.CqsSettle(
                    queue="r", tokens=tokens, now_ms=self.now_ms, release=rng.random() < 0.3
                )
            )
        self.messages += 1
        return _put(b"/q/" + QUEUE + b"/p/m-%d" % self.messages, rng.randbytes(16))


def _put(key: bytes, value: bytes, lease: int = 0) -> Command:
    return Command(put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def _consumer(consumer: bytes) -> bytes:
    return b"/q/" + QUEUE + b"/c/" + consumer
