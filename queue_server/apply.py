"""The state machine: every change to what clients can observe is applied here.

`StateMachine.apply(index, command)` is the one entry point for changes. It is a
deterministic function of the state and the command: it reads no clock, no random
numbers, no network, no disk. A request that fails is returned as an `EtcdError`
value (and changed nothing), never raised past apply, so every replica of the log
reaches the same state. Reads that need no log entry (Range, read-only Txn) are
served by `read_range` / `read_txn` on the current state.

Commands are `etcdserverpb.internal_pb2.Command` messages (etcdserverpb/internal.proto):
the log carries their serialized bytes, and replay after a restart goes through the
same `apply`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.alarms import AlarmTable
from queue_server.auth.store import AuthStore
from queue_server.cqs import state as cqs_state
from queue_server.cqs.state import CqsState
from queue_server.errors import EtcdError, NoSpace, ServerStopped
from queue_server.keyspace import grammar
from queue_server.keyspace.router import KeyspaceRouter
from queue_server.kv.executor import KVExecutor, is_read_only
from queue_server.lease.lessor import Lessor
from queue_server.mq.state import Assignment, QueueState, Release, sections_with_rows
from queue_server.mvcc.store import CommittedRevisions, Event, KeyValue, MVCCStore
from queue_server.proposals import ApplyResult
from queue_server.storage.snapshot_codec import STATE_FORMAT

log = logging.getLogger(__name__)

Command = internal_pb2.Command


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


Rows = dict[bytes, bytes | None]
"""Rows of a backend table changed since the last checkpoint: row key -> its
bytes, or None where the row is gone."""


class TableOwner(Protocol):
    """A part of the state that keeps its bulky rows (one per message or
    notification) in a backend table of its own, written as deltas at each
    checkpoint, instead of in the sections image, which a checkpoint writes
    whole. The rest of it (configs, counters) stays in `export_sections`."""

    table: str
    """Its table's name (storage.backend.TABLES)."""

    def keep_rows(self) -> None:
        """From now on, record the rows each change touches (`take_rows`)."""
        ...

    def take_rows(self) -> Rows:
        """The rows changed since the last call, for a checkpoint."""
        ...

    def return_rows(self, rows: Rows) -> None:
        """A checkpoint failed: `rows` (what `take_rows` gave) are unwritten;
        rows changed since then are newer and win."""
        ...


@dataclass(slots=True)
class Effects:
    """What one applied command changed that the node must act on. Apply only
    records it; the node driver (node/driver.py) carries it out."""

    commits: list[tuple[int, list[Event]]] = field(default_factory=list)
    """Committed write transactions, in revision order: (revision, events)."""
    assignments: list[Assignment] = field(default_factory=list)
    """Messages handed to consumers (delivered by the node hosting each)."""
    released: list[Release] = field(default_factory=list)
    """Messages consumers held and no longer do: acknowledged, or taken back
    (the node hosting each forgets its ack deadline and delivery lease)."""
    cqs_changed: set[str] = field(default_factory=set)
    """CQS queues that may have gained visible notifications or lost in-flight ones."""
    leases_granted: list[tuple[int, int]] = field(default_factory=list)
    """(lease id, TTL) of leases granted."""
    leases_revoked: list[int] = field(default_factory=list)
    members_changed: bool = False
    """A member published its name and URLs."""

    def __bool__(self) -> bool:
        return bool(
            self.commits
            or self.assignments
            or self.released
            or self.cqs_changed
            or self.leases_granted
            or self.leases_revoked
            or self.members_changed
        )


NO_EFFECTS = Effects()


@dataclass(slots=True)
class Checkpoint:
    """What one checkpoint writes: the state at log index `index`, as the key
    revisions made since the last one (entry code -> KeyValue, tombstones too),
    the committed revisions compaction dropped, the sections (plain data, for
    the image) and the tables' changed rows."""

    index: int
    writes: dict[int, KeyValue]
    dropped: list[int]
    sections: dict[str, Any]
    tables: dict[str, Rows]
    replace: bool = False
    """The state was restored from a snapshot: the backend's revisions and rows
    are replaced by these."""


class ApplyFailed(RuntimeError):
    """An apply raised what no request should raise (a bug, or a damaged entry).

    Fail-stop, as etcd panics: the failing write transaction was rolled back,
    the state machine refuses everything from now on, and the member stops."""

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(f"apply failed at log index {index}: {cause!r}")
        self.index = index
        self.reported = False  # logged and told to the server once


class StateMachine:
    """Owns the MVCC store, the lease table and the queue keyspace; applies log
    commands in log order. `apply` returns each command's result and `Effects`."""

    def __init__(self, backend: CommittedRevisions | None = None) -> None:
        self.backend = backend
        """Where checkpointed key revisions are read from (storage.backend), or
        None: the whole store in memory (a cluster member, unit tests)."""
        self.lessor = Lessor()
        self.alarms = AlarmTable()
        self.auth = AuthStore()
        self.cqs = CqsState()
        # member id -> (name, peer URLs, client URLs), as members published them
        self.members: dict[int, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}
        self.queues = QueueState()
        self.router = KeyspaceRouter([self.cqs, self.queues])
        self._effects = Effects()
        self._use_store(MVCCStore(backend))
        self.applied_index = 0
        self.failed: ApplyFailed | None = None

    def use_backend(self, backend: CommittedRevisions) -> None:
        """Keep the key revisions in `backend` (before anything is applied), and
        the parts' rows in its tables."""
        assert self.applied_index == 0 and self.store.revision == 1, "state already built"
        self.backend = backend
        self._use_store(MVCCStore(backend))
        for owner in self._table_owners():
            owner.keep_rows()

    @property
    def pending_bytes(self) -> int:
        """About the bytes held in memory for the next checkpoint: the store's
        key revisions and the CQS rows journaled (a load of notifications moves
        no revision)."""
        return self.store.pending_bytes + self.cqs.pending_row_bytes

    def _table_owners(self) -> list[TableOwner]:
        return [self.cqs, self.queues]

    def _use_store(self, store: MVCCStore) -> None:
        self.store = store
        store.on_commit = self._on_commit
        self.kv = KVExecutor(store, self.lessor.exists, self.router)

    def _on_commit(self, revision: int, events: list[Event]) -> None:
        self.lessor.follow(revision, events)
        self.router.follow(revision, events)
        self._effects.commits.append((revision, events))

    # -- changes --------------------------------------------------------------

    def apply(self, index: int, command: internal_pb2.Command) -> tuple[ApplyResult, Effects]:
        """Apply the command at log position `index`: its response message (its
        header carries only the revision) or the error it failed with, and what
        it changed that the node must act on. Raises `ApplyFailed` (and refuses
        everything after) if applying raised anything but an `EtcdError`."""
        if self.failed is not None:
            raise self.failed
        if index <= self.applied_index:
            raise AssertionError(f"log index {index} applied twice (at {self.applied_index})")
        self.applied_index = index
        try:
            self.router.begin_command(command.now_ms)
            result = self._apply(command)
            self.router.after_apply(self.store)
        except Exception as e:
            self.failed = ApplyFailed(index, e)
            self._effects = Effects()
            raise self.failed from e
        effects = self._effects
        effects.assignments = self.queues.take_assignments()
        effects.released = self.queues.take_released()
        effects.cqs_changed = self.cqs.take_changed()
        effects.leases_granted, effects.leases_revoked = self.lessor.take_changes()
        if not effects:
            return result, NO_EFFECTS
        self._effects = Effects()
        return result, effects

    def skip(self, index: int) -> None:
        """A log entry with no command for the state machine (a new leader's
        empty entry): it only moves the applied index."""
        if self.failed is not None:
            raise self.failed
        if index > self.applied_index:
            self.applied_index = index

    def apply_member_change(
        self, index: int, member_id: int, added: bool, peer_urls: tuple[str, ...]
    ) -> Effects:
        """A Raft membership change at `index`: the member joins with its peer URLs
        (its name and client URLs come when it publishes them), or leaves."""
        self.skip(index)
        if added:
            self.members.setdefault(member_id, ("", peer_urls, ()))
        else:
            self.members.pop(member_id, None)
        return Effects(members_changed=True)

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
                self._effects.members_changed = True
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

    def read_range(self, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        self._check_serving()
        return self.kv.range(request)

    def read_txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        """A Txn with no writes in any branch: served without a log entry."""
        self._check_serving()
        return self.kv.txn(request)

    def _check_serving(self) -> None:
        """After a failed apply nothing is served: the state may be half-changed."""
        if self.failed is not None:
            raise ServerStopped()

    # -- snapshots ------------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        """Plain data describing the whole state, for a snapshot."""
        state = self.export_sections(full=True)
        state["mvcc"] = self.store.export_state()
        return state

    def export_sections(self, full: bool = False) -> dict[str, Any]:
        """`export_state` without the key histories (its mvcc part holds only the
        revision and compaction revision): what a checkpoint writes beside the
        key revisions it takes from `store.take_batch`. `full`: with the rows
        the parts keep in tables too (a Raft snapshot file's state)."""
        kept = self.backend is not None and not full  # the owners' rows are in their tables
        return {
            "format": STATE_FORMAT,
            "applied_index": self.applied_index,
            "mvcc": (self.store.revision, self.store.compact_revision, []),
            "leases": self.lessor.export_state(),
            "alarms": self.alarms.export_state(),
            "queues": self.queues.export_sections() if kept else self.queues.export_state(),
            "cqs": self.cqs.export_sections() if kept else self.cqs.export_state(),
            "members": dict(self.members),
            "auth": self.auth.export_state(),
        }

    def restore_state(
        self,
        state: dict[str, Any],
        revisions: Iterator[tuple[int, bool, bytes, int]] | None = None,
        tables: Callable[[str], Iterator[tuple[bytes, bytes]]] | None = None,
    ) -> None:
        """Become `state` (an `export_state`, or an `export_sections` whose key
        revisions come from `revisions`: the backend's scan, see
        `MVCCStore.load_revisions`, and whose parts' rows come from `tables`,
        the backend's tables by name). From an exported state every key
        revision and row is pending: the caller checkpoints them."""
        if state.get("format") != STATE_FORMAT:
            raise RuntimeError(f"snapshot format {state.get('format')!r} is not {STATE_FORMAT}")
        store = MVCCStore.from_state(state["mvcc"], self.backend)
        if revisions is not None:
            store.load_revisions(revisions)
        self._use_store(store)
        self.lessor.restore_state(state["leases"], self.store)
        self.alarms.restore_state(state["alarms"])
        queue_rows = tables("mq") if tables is not None else None
        self.queues.restore_state(state["queues"], self.store, queue_rows)
        self.cqs.restore_state(state.get("cqs", []), tables("cqs") if tables is not None else None)
        self.router.forget()
        self.members = dict(state.get("members", {}))
        self.auth.restore_state(state.get("auth"))
        self.applied_index = state["applied_index"]

    def checkpoint(self) -> Checkpoint:
        """What a checkpoint writes, at the applied index. The revisions stay
        readable until `checkpoint_done` or `checkpoint_failed`."""
        replace = self.store.replaces_committed
        writes, dropped = self.store.take_batch()
        tables = {owner.table: owner.take_rows() for owner in self._table_owners()}
        sections = self.export_sections()
        return Checkpoint(self.applied_index, writes, dropped, sections, tables, replace)

    def checkpoint_done(self) -> None:
        """The backend holds the checkpoint and its reader sees it."""
        self.store.batch_committed()

    def checkpoint_failed(self, checkpoint: Checkpoint) -> None:
        """The checkpoint was not written; its revisions and rows are pending again."""
        self.store.batch_failed(checkpoint.dropped)
        self.store.replaces_committed = self.store.replaces_committed or checkpoint.replace
        for owner in self._table_owners():
            owner.return_rows(checkpoint.tables.get(owner.table, {}))


def sections_with_tables(
    sections: dict[str, Any], tables: Callable[[str], Iterator[tuple[bytes, bytes]]]
) -> dict[str, Any]:
    """A backend's sections (an `export_sections`) with the parts' rows from
    `tables` folded back in: `export_sections(full=True)` as it was at that
    checkpoint, what a snapshot of the whole state holds. Pure data, so a thread
    with a read transaction can make it."""
    return dict(
        sections,
        queues=sections_with_rows(sections["queues"], tables("mq")),
        cqs=cqs_state.sections_with_rows(sections["cqs"], tables("cqs")),
    )


def _needs_space(kind: str | None, command: internal_pb2.Command) -> bool:
    """What etcd's capped applier refuses under a NOSPACE alarm. A queue
    consumer's registry key is let through: consuming (and acknowledging) is how
    a full queue drains."""
    if kind == "put":
        return grammar.parse_consumer(command.put.key) is None
    if kind in ("lease_grant", "cqs_enqueue"):
        return True
    return kind == "txn" and not is_read_only(command.txn)


class EffectsSink(Protocol):
    """Who acts on what applied commands decided (the node driver)."""

    def applied(self, effects: Effects) -> None:
        """One command's effects, in log order."""
        ...

    def batch_applied(self) -> None:
        """The log applied the batch it had (one group commit, one Ready): what
        was held back to be sent together (deliveries) goes now."""
        ...


class _NoSink:
    def applied(self, effects: Effects) -> None:
        return None

    def batch_applied(self) -> None:
        return None


class Applier:
    """The one path from a log (the local log or Raft) into the state machine.

    Each entry's effects go to `sink` (the node driver; nothing while a log is
    replayed at startup, before the driver runs), and the log says when it has
    applied a batch (`batch_applied`). An `ApplyFailed` is logged
    once with what to do, `on_fatal` is told (the server stops), and the
    error goes on up: the log that applied it refuses everything after.
    """

    def __init__(
        self,
        state: StateMachine,
        sink: EffectsSink | None = None,
        on_fatal: Callable[[ApplyFailed], None] | None = None,
    ) -> None:
        self.state = state
        self.sink: EffectsSink = sink if sink is not None else _NoSink()
        self.on_fatal = on_fatal

    def apply(self, index: int, command: internal_pb2.Command) -> ApplyResult:
        try:
            result, effects = self.state.apply(index, command)
        except ApplyFailed as e:
            if not e.reported:
                e.reported = True
                log.critical(
                    "%s; stopping: the entry is in the log and every start will replay it, "
                    "so restore from a snapshot or report the bug",
                    e,
                    exc_info=e.__cause__,
                )
                if self.on_fatal is not None:
                    self.on_fatal(e)
            raise
        if effects is not NO_EFFECTS:
            self.sink.applied(effects)
        return result

    def batch_applied(self) -> None:
        """The log applied a batch of entries (see `EffectsSink.batch_applied`)."""
        self.sink.batch_applied()
