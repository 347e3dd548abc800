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

from typing import Any, Protocol

from google.protobuf.message import Message

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.errors import EtcdError
from queue_server.kv.executor import KVExecutor
from queue_server.mvcc.store import MVCCStore

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


STATE_FORMAT = 1
"""Version of `export_state`'s layout; bump when it changes."""


class StateMachine:
    """Owns the MVCC store and applies log commands to it in log order."""

    def __init__(self) -> None:
        self.store = MVCCStore()
        self.kv = KVExecutor(self.store)
        self.applied_index = 0

    # -- changes --------------------------------------------------------------

    def apply(self, index: int, command: internal_pb2.Command) -> ApplyResult:
        """Apply the command at log position `index`; returns the response message
        (its header carries only the revision) or the error it failed with."""
        if index <= self.applied_index:
            raise AssertionError(f"log index {index} applied twice (at {self.applied_index})")
        self.applied_index = index
        kind = command.WhichOneof("op")
        try:
            if kind == "put":
                return self.kv.put(command.put)
            if kind == "delete_range":
                return self.kv.delete_range(command.delete_range)
            if kind == "txn":
                return self.kv.txn(command.txn)
            if kind == "compaction":
                return self.kv.compact(command.compaction)
        except EtcdError as e:
            return e
        raise AssertionError(f"unknown command {kind!r} at index {index}")

    # -- reads ----------------------------------------------------------------

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
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise RuntimeError(f"snapshot format {state.get('format')!r} is not {STATE_FORMAT}")
        on_commit = self.store.on_commit
        self.store = MVCCStore.from_state(state["mvcc"])
        self.store.on_commit = on_commit
        self.kv = KVExecutor(self.store, self.kv.lease_exists)
        self.applied_index = state["applied_index"]
