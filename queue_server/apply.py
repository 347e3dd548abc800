"""The state machine: every change to what clients can observe is applied here.

`StateMachine.apply(index, command)` is the one entry point for changes. It is a
deterministic function of the state and the command: it reads no clock, no random
numbers, no network, no disk. A request that fails is returned as an `EtcdError`
value (and changed nothing), never raised past apply, so every replica of the log
reaches the same state. Reads that need no log entry (Range, read-only Txn) are
served by `read_range` / `read_txn` on the current state.

Commands are `queue_server.internal.Command` messages (etcdserverpb/internal.proto):
the log carries their serialized bytes, and replay after a restart goes through the
same `apply`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from google.protobuf.message import Message

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.alarms import AlarmTable
from queue_server.auth.store import AuthStore
from queue_server.cqs import commands as cqs_commands
from queue_server.cqs.state import CqsState
from queue_server.errors import EtcdError, NoSpace
from queue_server.kv.executor import KVExecutor, is_read_only
from queue_server.lease.lessor import Lessor
from queue_server.mq.keys import parse as parse_queue_key
from queue_server.mq.state import QueueState
from queue_server.mvcc.store import Event, KeyValue, MVCCStore

Command = internal_pb2.Command
ApplyResult = Message | EtcdError


class Proposer(Protocol):
    """A log in front of the state machine: the local log or Raft."""

    async def propose(self, command: internal_pb2.Command) -> ApplyResult:
        """Append `command`, wait until it is durable and applied, return its result."""
        ...

    @property
    def last_index(self) -> int:
        """Index of the newest entry appended to the log."""
        ...

    async def linearize(self) -> None:
        """Return once the local state reflects every write committed before the
        call (a no-op on a single node; a ReadIndex round in a cluster)."""
        ...


STATE_FORMAT = 1
"""Version of `export_state`'s layout; bump when it changes."""


class StateMachine:
    """Owns the MVCC store and the lease table; applies log commands in log order.

    `commit_listener` (the node's watch hub) is told of every committed write
    transaction's events, after the lease table has followed them.
    """

    def __init__(self) -> None:
        self.lessor = Lessor()
        self.alarms = AlarmTable()
        self.auth = AuthStore()
        self.cqs = CqsState()
        # member id -> (name, peer URLs, client URLs), as members published them
        self.members: dict[int, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}
        self.queues = QueueState(self.cqs)
        self.commit_listener: Callable[[int, list[Event]], None] | None = None
        self._use_store(MVCCStore())
        self.applied_index = 0

    def _use_store(self, store: MVCCStore) -> None:
        self.store = store
        store.on_commit = self._on_commit
        self.kv = KVExecutor(
            store,
            self.lessor.exists,
            self.queues.check_put,
            self.queues.rewrite_put,
            self.queues.rewrite_delete,
            self.queues.begin_checks,
            self._cqs_view,
        )

    def _cqs_view(self, key: bytes, end: bytes | None, revision: int) -> list[KeyValue]:
        if not self.cqs.queues:
            return []
        return self.cqs.view_range(key, end, revision)

    def _on_commit(self, revision: int, events: list[Event]) -> None:
        self.lessor.follow(revision, events)
        self.queues.follow(revision, events)
        self.cqs.follow(events)
        if self.commit_listener is not None:
            self.commit_listener(revision, events)

    # -- changes --------------------------------------------------------------

    def apply(self, index: int, command: internal_pb2.Command) -> ApplyResult:
        """Apply the command at log position `index`; returns the response message
        (its header carries only the revision) or the error it failed with."""
        if index <= self.applied_index:
            raise AssertionError(f"log index {index} applied twice (at {self.applied_index})")
        self.applied_index = index
        result = self._apply(command)
        self.queues.after_apply(self.store)
        return result

    def _apply(self, command: internal_pb2.Command) -> ApplyResult:
        kind = command.WhichOneof("op")
        try:
            if self.alarms.no_space and _needs_space(kind, command):
                raise NoSpace()
            if kind == "put":
                return self.kv.put(command.put)
            if kind == "delete_range":
                return self.kv.delete_range(command.delete_range)
            if kind == "txn":
                return self.kv.txn(command.txn)
            if kind == "compaction":
                return self.kv.compact(command.compaction)
            if kind == "lease_grant":
                return self._lease_grant(command.lease_grant)
            if kind == "lease_revoke":
                return self._lease_revoke(command.lease_revoke)
            if kind == "queue_requeue":
                r = command.queue_requeue
                dead = self.queues.requeue(r.queue, r.consumer, list(r.idx))
                return internal_pb2.QueueRequeueResponse(dead_lettered=dead)
            if kind == "cqs_dequeue":
                return self.cqs.dequeue(command.cqs_dequeue)
            if kind == "cqs_settle":
                return self.cqs.settle(command.cqs_settle)
            if kind == "cqs_enqueue":
                return self.cqs.enqueue(command.cqs_enqueue)
            if kind == "member_attributes":
                m = command.member_attributes
                self.members[m.id] = (m.name, tuple(m.peer_urls), tuple(m.client_urls))
                return m
            if kind == "auth":
                return self.auth.apply(command.auth)
            if kind == "alarm":
                resp = self.alarms.apply(command.alarm)
                resp.header.revision = self.store.revision
                return resp
        except EtcdError as e:
            return e
        raise AssertionError(f"unknown command {kind!r} at index {self.applied_index}")

    def _lease_grant(self, r: rpc_pb2.LeaseGrantRequest) -> rpc_pb2.LeaseGrantResponse:
        lease = self.lessor.grant(r.ID, r.TTL)
        resp = rpc_pb2.LeaseGrantResponse(ID=lease.lease_id, TTL=lease.ttl)
        resp.header.revision = self.store.revision
        return resp

    def _lease_revoke(self, r: rpc_pb2.LeaseRevokeRequest) -> rpc_pb2.LeaseRevokeResponse:
        resp = rpc_pb2.LeaseRevokeResponse()
        resp.header.revision = self.lessor.revoke(r.ID, self.store)
        return resp

    # -- reads ----------------------------------------------------------------

    def cqs_ack_of(self, r: rpc_pb2.DeleteRangeRequest) -> internal_pb2.Command | None:
        """The CqsSettle a delete of one CQS delivery key `/q/{queue}/{seq}/{token}`
        stands for, stamped with the proposer's clock now, or None for any other
        delete."""
        if r.range_end or not r.key.startswith(b"/q/"):
            return None
        qk = parse_queue_key(r.key)
        if qk is None or qk.kind != "message" or not self.cqs.is_cqs(qk.name):
            return None
        return cqs_commands.settle(qk.name.decode(), [qk.key.decode(errors="replace")])

    def read_range(self, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        return self.kv.range(request)

    def read_txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        """A Txn with no writes in any branch: served without a log entry."""
        return self.kv.txn(request)

    # -- snapshots ------------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        """Plain data describing the whole state, for a snapshot."""
        return {
            "format": STATE_FORMAT,
            "applied_index": self.applied_index,
            "mvcc": self.store.export_state(),
            "leases": self.lessor.export_state(),
            "alarms": self.alarms.export_state(),
            "queues": self.queues.export_state(),
            "cqs": self.cqs.export_state(),
            "members": dict(self.members),
            "auth": self.auth.export_state(),
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise RuntimeError(f"snapshot format {state.get('format')!r} is not {STATE_FORMAT}")
        self._use_store(MVCCStore.from_state(state["mvcc"]))
        self.lessor.restore_state(state["leases"], self.store)
        self.alarms.restore_state(state["alarms"])
        self.queues.restore_state(state["queues"], self.store)
        self.cqs.restore_state(state.get("cqs", []))
        self.members = dict(state.get("members", {}))
        self.auth.restore_state(state.get("auth"))
        self.applied_index = state["applied_index"]


def _needs_space(kind: str | None, command: internal_pb2.Command) -> bool:
    """What etcd's capped applier refuses under a NOSPACE alarm. A queue
    consumer's registry key is let through: consuming (and acknowledging) is how
    a full queue drains."""
    if kind == "put":
        qk = parse_queue_key(command.put.key) if command.put.key.startswith(b"/q") else None
        return qk is None or qk.kind != "consume"
    if kind in ("lease_grant", "cqs_enqueue"):
        return True
    return kind == "txn" and not is_read_only(command.txn)
