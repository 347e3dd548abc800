"""The replicated part of etcd-key queues: what must be the same on every node.

A queue's messages are ordinary MVCC keys (`/q/{name}/{idx}/{key}`), so reads,
watches, compaction, snapshots and replication treat them like any key. What
this module adds lives in the state machine, so it is deterministic:

- producing: inside apply, a put on `/q/{name}/p/{key}` becomes a put of the next
  message key of the queue (`rewrite_put`), refused if the queue is at max_depth;
  a delete of a handed-over delivery key `/q/{name}/c/{uuid}/{idx}/{key}`
  becomes a delete of its message key (`rewrite_delete`);
- per queue: the next idx (never reused, so an old delivery key can never ack a
  newer message), the depth, the settings parsed from `/q/{name}/config`, the
  delivery attempts of messages that came back unacknowledged, and when each
  message was produced: the `now_ms` of the command that created its key (the
  proposer's clock, Unix ms; a Put inside a Txn has the Txn's), one int per
  message, so the age of the oldest pending message is the same on every
  member and after a restart (WAL replay applies the same stamps). A message
  moved to the dead-letter queue keeps its stamp;
- the consumers, from their registry keys `/q/{name}/c/{uuid}` (value: the node
  hosting the watch), and which consumer holds which message. Messages are
  handed out in apply, so every replica agrees on who holds what, and a
  consumer's node (any member of a cluster) delivers what it is assigned. A
  consumer whose registry key goes (its watch ended, or its node's session
  lease expired) gives its messages back, counted as a failed delivery;
- `requeue`: a consumer gives messages back (ack deadline, a revoked delivery
  lease); at max_deliveries a message moves to the dead-letter queue in a
  revision of its own at the end of the command.

How deliveries reach a watch stream, ack deadlines and stuck streams are the
node's (`delivery.py`, `ack_policy.py`, `node/consumers.py`). The node reads
this state only through the queries of `QueueState` (`held_by`, `spelling_of`,
`ack_deadline_of`, `queues_with_consumers`) and learns of a delivery that
ended (acknowledged, or taken back) from the command's effects
(`take_released`), never by looking into the queues' dicts.

Checkpoints: the backend table `t:mq`
-------------------------------------
On a backend (`storage/backend.py`) this part is an `apply.TableOwner`. A
checkpoint's sections image holds only what is per queue: name, spelling,
next idx, the round-robin position (`next_consumer`) and the consumers in join
order with their nodes, so its size follows the number of queues and
consumers, never of messages. Each message the queue knows (pending or held)
has a row, written as a delta with the checkpoint:

    row key    {name} "/" idx (u64 BE)
    row value  layout (u8, 1) | produced_ms (i64 BE) | attempts (u64 BE)
               | hand-out (i64 BE) | holder (the rest: a consumer id; empty: pending)

A name holds no "/", so each queue's rows are one run in idx order, and queues
follow in the order of `name + "/"` (as their message keys sort in the store:
`a.dead` before `a`). `produced_ms` 0 is unknown. `hand-out` orders a
consumer's holds as it received them, which decides the order they are given
back in (and so the dead-letter idx each gets): the queue's `next_consumer`
when the message was handed out, which only grows; holds of a state restored
from a full export are numbered below zero in their order. The value is a
fixed struct rather than a protobuf message: there is one row per message,
millions of them, written and read on the event loop's side of a checkpoint
and at every restart, and a struct packs in a fraction of a microsecond with
no optional or repeated parts to tag; the leading layout byte leaves room to
change it, and a row of another layout is refused.

Who holds a message is in the rows, not the sections: a consumer's holds are
bounded by its `prefetch`, but prefetch has no upper bound, so the sections
would not be. Which messages exist (and their keys) is not in the rows either:
a restart takes it from the store's index (`MVCCStore.keys_in`), which holds
every key anyway, without loading a message value; config values are read.

After `keep_rows`, every change to a message's row (produced, handed out,
given back, acknowledged or deleted, dead-lettered, redriven) marks its
(name, idx) in a journal; `take_rows` turns the marks into the rows' current
bytes (None: gone), so a row changed many times between checkpoints is
written once, and `return_rows` marks a failed checkpoint's rows again, to be
taken with their newest bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from sortedcontainers import SortedDict

from queue_server.errors import EtcdError
from queue_server.keyspace import grammar as keys
from queue_server.keyspace.config import ConfigFields, QueueConfig, parse_config
from queue_server.keyspace.grammar import QueueKey
from queue_server.mvcc.store import Event, MVCCStore

DEFAULT_PREFETCH = 64
"""Unacknowledged messages one consumer may hold when the queue does not say."""


class QueueFull(EtcdError):
    code = "RESOURCE_EXHAUSTED"
    message = "etcdserver: queue is full"


DEFAULT_ACK_DEADLINE = 30.0
"""Seconds a delivery may stay unacknowledged when the queue does not say (SQS's
and NATS's default). Redelivery then never depends on seeing a consumer's stream
close, which a proxy in between (etcd's grpc-proxy keeps its upstream watch) may
hide; a consumer with longer work extends it with LeaseKeepAlive."""

MAX_ACK_DEADLINE = 9_000_000_000
"""etcd's largest lease TTL (lease.MaxLeaseTTL), in seconds."""

ROW_LAYOUT = 1
"""The first byte of every row value of table `mq` (see the module docstring)."""
_ROW = struct.Struct(">BqQq")  # layout, produced_ms, attempts, hand-out; then the holder
_IDX = struct.Struct(">Q")


def row_key(name: bytes, idx: int) -> bytes:
    """The `mq` table's key of message `idx` of queue `name`."""
    return name + b"/" + _IDX.pack(idx)


def parse_row_key(key: bytes) -> tuple[bytes, int]:
    """(queue name, idx) of a row key."""
    if len(key) < 10 or key[-9] != 0x2F:  # a name of one byte or more, "/", u64
        raise ValueError(f"mq row key {key!r} is not name/u64")
    return key[:-9], _IDX.unpack_from(key, len(key) - 8)[0]


def _pack_row(produced_ms: int, attempts: int, hand_out: int, holder: bytes) -> bytes:
    return _ROW.pack(ROW_LAYOUT, produced_ms, attempts, hand_out) + holder


@dataclass(frozen=True, slots=True)
class MessageRow:
    """One row of table `mq`: what the state keeps of one message besides its key."""

    produced_ms: int = 0
    attempts: int = 0
    hand_out: int = 0
    holder: bytes = b""  # consumer id; empty: pending

    def encode(self) -> bytes:
        return _pack_row(self.produced_ms, self.attempts, self.hand_out, self.holder)

    @classmethod
    def decode(cls, raw: bytes) -> MessageRow:
        if len(raw) < _ROW.size or raw[0] != ROW_LAYOUT:
            raise ValueError(f"mq row {raw[: _ROW.size]!r} is not of layout {ROW_LAYOUT}")
        _layout, produced_ms, attempts, hand_out = _ROW.unpack_from(raw)
        return cls(produced_ms, attempts, hand_out, bytes(raw[_ROW.size :]))


@dataclass(slots=True)
class QueueSettings:
    """Per-queue settings, from the JSON value of `/q/{name}/config`.

    The schema (docs/queue.md, "Settings"): `prefetch` an integer >= 1,
    `max_deliveries` and `max_depth` integers >= 0, `ack_deadline` a duration
    ("30s", "1m30s" or a number of seconds) up to `MAX_ACK_DEADLINE`,
    `dead_letter` one key segment. `keyspace/config.py` says how a field is
    read strictly (before a put is proposed) or leniently (in apply)."""

    ack_deadline: float = (
        DEFAULT_ACK_DEADLINE  # seconds a delivery may stay unacknowledged; 0: forever
    )
    max_deliveries: int = 0  # deliveries before dead-lettering; 0: unlimited
    dead_letter: bytes = b""  # dead-letter queue name; default "{name}.dead"
    prefetch: int = DEFAULT_PREFETCH  # unacknowledged messages per consumer
    max_depth: int = 0  # pending + in-flight messages; 0: unlimited

    FIELDS = frozenset({"ack_deadline", "max_deliveries", "dead_letter", "prefetch", "max_depth"})

    @classmethod
    def parse(cls, value: bytes, key: bytes = b"/q/{name}/config") -> QueueSettings:
        """The settings of a config value alone (its other fields ignored), read
        as apply reads them; `key` is where it is, for messages."""
        return cls.of(ConfigFields(key, parse_config(key, value), strict=False))

    @classmethod
    def of(cls, fields: ConfigFields) -> QueueSettings:
        """The etcd-key queue's fields of a parsed config; refuses a field
        outside its type or range (an InvalidQueueConfig naming it)."""
        s = cls()  # absent fields keep the dataclass's defaults
        # A delivery's ack deadline is a lease TTL to clients (LeaseKeepAlive
        # answers it), so it has a lease's bounds.
        s.ack_deadline = fields.duration("ack_deadline", s.ack_deadline, MAX_ACK_DEADLINE)
        s.max_deliveries = fields.integer("max_deliveries", s.max_deliveries, minimum=0)
        s.dead_letter = fields.segment("dead_letter", "").encode()
        s.prefetch = fields.integer("prefetch", s.prefetch, minimum=1)
        s.max_depth = fields.integer("max_depth", s.max_depth, minimum=0)
        return s


@dataclass(slots=True)
class Assignment:
    """Messages the state machine handed to one consumer in one command: the
    node hosting the consumer's watch delivers them."""

    queue: bytes
    consumer: bytes
    node: bytes
    items: list[tuple[int, bytes]]  # (idx, message key), oldest first
    revision: int
    """The store's revision when they were handed out: the delivery events'
    `mod_revision`. Deliveries to one consumer never go back in revision, as the
    events of an etcd watch never do (etcd's grpc-proxy drops those that do)."""


Release = tuple[bytes, bytes, int]
"""(queue, consumer id, idx): a message that consumer held and holds no more,
acknowledged (its key deleted) or taken back (given back, or the consumer left
or moved to another node). The node hosting the consumer forgets the
delivery's ack deadline and lease."""

_NOTHING_HELD: Mapping[int, bytes] = MappingProxyType({})


@dataclass(eq=False, slots=True)
class ConsumerSlot:
    """A consumer as the state machine knows it: its registry key's value (the
    node hosting its watch) and the messages assigned to it (idx -> key)."""

    consumer_id: bytes
    node: bytes
    held: dict[int, bytes] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class QueueInfo:
    """Replicated facts about one queue, including who holds which message."""

    name: bytes
    spelling: bytes
    next_idx: int = 1
    settings: QueueSettings = field(default_factory=QueueSettings)
    attempts: dict[int, int] = field(default_factory=dict)
    # idx -> when it was produced (Unix ms, its command's stamp); absent: unknown
    # (an entry from before commands carried one)
    produced_ms: dict[int, int] = field(default_factory=dict)
    pending: SortedDict = field(default_factory=SortedDict)  # idx -> message key
    holder: dict[int, ConsumerSlot] = field(default_factory=dict)
    # idx -> its hand-out number, for each held message (the rows' order of a
    # consumer's holds; see the module docstring)
    hand_out: dict[int, int] = field(default_factory=dict)
    consumers: dict[bytes, ConsumerSlot] = field(default_factory=dict)  # in join order
    next_consumer: int = 0
    # counted since this process started (metrics; not part of snapshots)
    produced: int = 0  # message keys created: produces, dead letters in, redrives
    delivered: int = 0
    acked: int = 0
    redelivered: int = 0
    dead_lettered: int = 0

    @property
    def depth(self) -> int:
        """Messages queued: pending or held by a consumer."""
        return len(self.pending) + len(self.holder)

    def dead_letter_name(self) -> bytes:
        return self.settings.dead_letter or self.name + b".dead"

    def oldest_pending_ms(self) -> int:
        """When the oldest pending message (the lowest idx waiting for a
        consumer) was produced, Unix ms; 0 when none is pending or its time is
        unknown."""
        pending = self.pending
        if not pending:
            return 0
        return self.produced_ms.get(pending.peekitem(0)[0], 0)

    def row(self, idx: int) -> bytes | None:
        """Message `idx`'s row bytes now, or None: the queue no longer has it."""
        slot = self.holder.get(idx)
        if slot is None:
            if idx not in self.pending:
                return None
            return _pack_row(self.produced_ms.get(idx, 0), self.attempts.get(idx, 0), 0, b"")
        produced_ms, attempts = self.produced_ms.get(idx, 0), self.attempts.get(idx, 0)
        return _pack_row(produced_ms, attempts, self.hand_out.get(idx, 0), slot.consumer_id)

    def message_idxs(self) -> Iterator[int]:
        """Every message the queue knows: pending, then held."""
        yield from self.pending
        yield from self.holder


class QueueState:
    """All etcd-key queues of the state machine, and the assignment of their
    messages: the etcd-key queue's `QueuePlugin` (keyspace/router.py).

    Assignment is part of apply: after a command, every queue whose messages,
    consumers or settings changed hands its pending messages out (oldest first,
    round-robin over consumers in join order, at most `prefetch` held each), and
    each hand-out is an `Assignment` in `take_assignments()`, one of the
    command's effects. Every replica computes the same assignment; the node
    hosting the consumer's watch delivers. A hold that ends (acknowledged, or
    taken back) is a `Release` in `take_released()`, another effect.

    Only apply creates queues or changes them. Node-local code asks the read
    queries below (`held_by`, `spelling_of`, `ack_deadline_of`,
    `queues_with_consumers`); the figures (`queue_stats.py`, the dashboard)
    read `queues`, and never change it.
    """

    config_fields = QueueSettings.FIELDS

    def __init__(self) -> None:
        self.queues: dict[bytes, QueueInfo] = {}
        # produces already checked in the request being checked, per queue
        self._checked_produces: dict[bytes, int] = {}
        # queues to hand out after this command; messages to dead-letter first
        self._dirty: set[QueueInfo] = set()
        self._to_dead: list[tuple[QueueInfo, int]] = []
        self._given_back: list[tuple[QueueInfo, int]] = []
        self._assigned: list[Assignment] = []
        self._released: list[Release] = []
        self._now_ms = 0  # the command's stamp: new message keys are produced then
        # With a backend: queue name -> the idx of its rows changed since `take_rows`
        self._touched: dict[bytes, set[int]] | None = None

    def _queue(self, name: bytes, spelling: bytes) -> QueueInfo:
        """The queue, created on first use with the spelling it was first used with."""
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = QueueInfo(name, spelling)
        return q

    def _touched_of(self, q: QueueInfo) -> set[int] | None:
        """Where the rows of `q` that a change touches are journaled (None: no
        journal is kept)."""
        touched = self._touched
        if touched is None:
            return None
        idxs = touched.get(q.name)
        if idxs is None:
            idxs = touched[q.name] = set()
        return idxs

    def _touch_all(self) -> None:
        """Journal every message there is."""
        for q in self.queues.values():
            idxs = self._touched_of(q)
            if idxs is not None:
                idxs.update(q.message_idxs())

    def take_assignments(self) -> list[Assignment]:
        """What the last command handed out (and forget it)."""
        out, self._assigned = self._assigned, []
        return out

    def take_released(self) -> list[Release]:
        """The holds the last command ended, in the order it ended them (and
        forget them)."""
        out, self._released = self._released, []
        return out

    # -- reads for the node: they never change the state ------------------------

    def held_by(self, name: bytes, consumer_id: bytes, node: bytes) -> Mapping[int, bytes]:
        """What consumer `consumer_id` of queue `name` holds (idx -> message
        key, a read-only view), if its registry key names `node`; empty if the
        queue or the consumer is unknown, or the consumer is on another node."""
        q = self.queues.get(name)
        slot = q.consumers.get(consumer_id) if q is not None else None
        if slot is None or slot.node != node:
            return _NOTHING_HELD
        return MappingProxyType(slot.held)

    def spelling_of(self, name: bytes, default: bytes) -> bytes:
        """The prefix queue `name` is spelled with (`/q/` or `/queue/`), or
        `default` when there is no such queue yet."""
        q = self.queues.get(name)
        return q.spelling if q is not None else default

    def ack_deadline_of(self, name: bytes) -> float:
        """Seconds a delivery of queue `name` may stay unacknowledged (0:
        forever); the default for a queue that does not exist."""
        q = self.queues.get(name)
        return q.settings.ack_deadline if q is not None else DEFAULT_ACK_DEADLINE

    def queues_with_consumers(self) -> list[tuple[bytes, bytes]]:
        """(name, spelling) of every queue that has a consumer, in creation order."""
        return [(q.name, q.spelling) for q in self.queues.values() if q.consumers]

    # -- the plugin hooks (inside KV apply) ---------------------------------------

    def begin_command(self, now_ms: int) -> None:
        self._now_ms = now_ms

    def claims(self, qk: QueueKey) -> bool:
        return True  # whatever no other product claims

    def begin_request(self) -> None:
        self._checked_produces.clear()

    def check_produce(self, qk: QueueKey, value: bytes) -> None:
        """Refuse, before anything changes, a produce over max_depth."""
        q = self.queues.get(qk.name)
        earlier = self._checked_produces.get(qk.name, 0)
        if q is not None and q.settings.max_depth and q.depth + earlier >= q.settings.max_depth:
            raise QueueFull(
                f"etcdserver: queue {qk.name.decode(errors='replace')} is full "
                f"(max_depth {q.settings.max_depth})"
            )
        self._checked_produces[qk.name] = earlier + 1

    def produce(self, qk: QueueKey, value: bytes) -> bytes:
        """A producer key becomes the queue's next message key."""
        q = self._queue(qk.name, qk.spelling)
        idx = q.next_idx
        q.next_idx += 1
        return keys.message_key(q.spelling, q.name, idx, qk.key)

    def check_config(self, key: bytes, config: QueueConfig, *, strict: bool) -> None:
        QueueSettings.of(ConfigFields(key, config, strict))

    def configure(self, qk: QueueKey, config: QueueConfig | None) -> None:
        q = self._queue(qk.name, qk.spelling)
        if config is None:
            q.settings = QueueSettings()
        else:
            key = keys.config_key(qk.spelling, qk.name)
            q.settings = QueueSettings.of(ConfigFields(key, config, strict=False))
        self._dirty.add(q)

    def delete(self, qk: QueueKey, key: bytes, now_ms: int) -> bytes:
        """A handed-over delivery key `/q/{name}/c/{uuid}/{idx}/{key}` stands for
        its message key; a message key is itself."""
        if qk.kind != "delivery":
            return key
        q = self.queues.get(qk.name)
        spelling = q.spelling if q is not None else qk.spelling
        return keys.message_key(spelling, qk.name, qk.idx, qk.key)

    def view_range(
        self, key: bytes, end: bytes | None, revision: int, limit: int
    ) -> tuple[list[Any], int]:
        return [], 0  # every message is a key of the store

    def follow(self, qk: QueueKey, e: Event) -> None:
        """Consumers and pending messages in step with committed changes."""
        kind = qk.kind
        if kind == "message":
            q = self._queue(qk.name, qk.spelling)
            if e.is_delete:
                q.attempts.pop(qk.idx, None)
                q.produced_ms.pop(qk.idx, None)
                if q.pending.pop(qk.idx, None) is None:
                    slot = q.holder.pop(qk.idx, None)
                    if slot is not None:
                        q.acked += 1
                        slot.held.pop(qk.idx, None)
                        q.hand_out.pop(qk.idx, None)
                        self._released.append((q.name, slot.consumer_id, qk.idx))
                        self._dirty.add(q)  # room in its prefetch window
            elif e.prev_kv is None:
                q.produced += 1
                if self._now_ms:
                    q.produced_ms[qk.idx] = self._now_ms
                q.next_idx = max(q.next_idx, qk.idx + 1)
                q.pending[qk.idx] = e.kv.key
                self._dirty.add(q)
            else:
                return  # the same message put again: nothing of its row changes
            touched = self._touched_of(q)
            if touched is not None:
                touched.add(qk.idx)
        elif kind == "consume":
            self._follow_consumer(self._queue(qk.name, qk.spelling), qk.consumer, e)
        elif kind == "registry" and not e.is_delete:
            self._queue(qk.name, qk.spelling)

    def _follow_consumer(self, q: QueueInfo, consumer_id: bytes, e: Event) -> None:
        """A consumer registry key changed: the consumer joins, moves to another
        node, or leaves; what it held comes back as a failed delivery."""
        slot = q.consumers.get(consumer_id)
        if e.is_delete:
            if slot is not None:
                del q.consumers[consumer_id]
                self._take_back(q, slot, list(slot.held))
        elif slot is None:
            q.consumers[consumer_id] = ConsumerSlot(consumer_id, e.kv.value)
        elif slot.node != e.kv.value:
            slot.node = e.kv.value
            self._take_back(q, slot, list(slot.held))
        self._dirty.add(q)

    def _take_back(self, q: QueueInfo, slot: ConsumerSlot, idxs: list[int]) -> int:
        """Count a failed delivery of each message `slot` still holds; it is
        pending again, or dead-lettered after this command at max_deliveries."""
        n = 0
        touched = self._touched_of(q)
        for idx in idxs:
            key = slot.held.pop(idx, None)
            if key is None:
                continue
            del q.holder[idx]
            q.hand_out.pop(idx, None)
            self._released.append((q.name, slot.consumer_id, idx))
            if touched is not None:
                touched.add(idx)
            n += 1
            attempts = q.attempts.get(idx, 0) + 1
            q.attempts[idx] = attempts
            if q.settings.max_deliveries and attempts >= q.settings.max_deliveries:
                self._to_dead.append((q, idx))
            else:
                self._given_back.append((q, idx))
            q.pending[idx] = key
        if n:
            q.redelivered += n
            self._dirty.add(q)
        return n

    # -- requeue ----------------------------------------------------------------

    def requeue(self, name: bytes, consumer_id: bytes, idxs: list[int]) -> list[int]:
        """Messages given back by their consumer (ack deadline passed, a delivery
        lease revoked, a stream that went away while another watch of the same
        consumer stays): each counts a failed delivery. Returns the idx of those
        that will move to the dead-letter queue (in `after_apply`)."""
        q = self.queues.get(name)
        if q is None:
            return []
        first = len(self._to_dead)
        if consumer_id:
            slot = q.consumers.get(consumer_id)
            if slot is not None:
                self._take_back(q, slot, idxs)
        else:  # an entry from before consumers were replicated: any holder
            for idx in idxs:
                slot = q.holder.get(idx)
                if slot is not None:
                    self._take_back(q, slot, [idx])
        return [idx for _q, idx in self._to_dead[first:]]

    def after_apply(self, store: MVCCStore) -> None:
        """End of a command: put again what was taken back unacknowledged and
        dead-letter what reached max_deliveries (one more revision each), then
        hand pending messages out."""
        if self._given_back:
            self._rewrite_given_back(store)
        if self._to_dead:
            self._dead_letter(store)
        if self._dirty:
            dirty = sorted(self._dirty, key=lambda q: q.name)  # the same order everywhere
            self._dirty.clear()
            for q in dirty:
                self._assign(q, store.revision)

    def _rewrite_given_back(self, store: MVCCStore) -> None:
        """Messages taken back unacknowledged are put again, unchanged, in a
        revision of their own: a message's `version` is one more than the times
        it came back, and its next delivery has a revision newer than the last
        one its consumer saw (a requeue writes nothing else, and a watch's events
        must move forward)."""
        given, self._given_back = self._given_back, []
        with store.write() as txn:
            for q, idx in given:
                key = q.pending.get(idx)
                if key is None:
                    continue  # acknowledged in the meantime
                kv = store.get(key)
                if kv is not None:
                    txn.put(key, kv.value, kv.lease)

    def _dead_letter(self, store: MVCCStore) -> None:
        moves, self._to_dead = self._to_dead, []
        stamps: list[tuple[QueueInfo, int, int]] = []  # (dead queue, new idx, produced)
        with store.write() as txn:
            for q, idx in moves:
                key = q.pending.get(idx)
                if key is None:
                    continue  # acknowledged or moved in the meantime
                kv = store.get(key)
                if kv is None:  # pragma: no cover - pending keys exist
                    continue
                dead = self._queue(q.dead_letter_name(), q.spelling)
                q.dead_lettered += 1
                new_idx = dead.next_idx
                dead.next_idx += 1
                stamps.append((dead, new_idx, q.produced_ms.get(idx, 0)))
                txn.delete_range(key, None)
                suffix = key.rsplit(b"/", 1)[1]
                txn.put(
                    keys.message_key(dead.spelling, dead.name, new_idx, suffix), kv.value, kv.lease
                )
        # committed (and followed): a dead letter keeps when it was produced
        for dead, new_idx, produced in stamps:
            if produced:
                dead.produced_ms[new_idx] = produced
            else:
                dead.produced_ms.pop(new_idx, None)

    def _assign(self, q: QueueInfo, revision: int) -> None:
        """Hand pending messages out, oldest first, round-robin over consumers
        with room in their prefetch window."""
        pending = q.pending
        if not pending or not q.consumers:
            return
        prefetch = q.settings.prefetch
        slots = list(q.consumers.values())
        n = len(slots)
        without_room = 0
        batches: dict[ConsumerSlot, list[tuple[int, bytes]]] = {}
        touched = self._touched_of(q)
        while pending and without_room < n:
            slot = slots[q.next_consumer % n]
            q.next_consumer += 1
            if len(slot.held) >= prefetch:
                without_room += 1
                continue
            without_room = 0
            idx, key = pending.popitem(0)
            slot.held[idx] = key
            q.holder[idx] = slot
            q.hand_out[idx] = q.next_consumer  # grows with every hand-out
            if touched is not None:
                touched.add(idx)
            q.delivered += 1
            batches.setdefault(slot, []).append((idx, key))
        for slot, items in batches.items():
            self._assigned.append(Assignment(q.name, slot.consumer_id, slot.node, items, revision))

    # -- snapshots --------------------------------------------------------------

    def export_state(self) -> list[tuple[Any, ...]]:
        return [
            (
                q.name,
                q.spelling,
                q.next_idx,
                dict(q.attempts),
                {
                    "next_consumer": q.next_consumer,
                    "consumers": [
                        (s.consumer_id, s.node, list(s.held)) for s in q.consumers.values()
                    ],
                    "produced_ms": sorted(q.produced_ms.items()),
                },
            )
            for q in self.queues.values()
        ]

    # -- checkpoints (apply.TableOwner) -------------------------------------

    table = "mq"

    def keep_rows(self) -> None:
        """From now on, journal each message row a change touches (every
        message there is counts as touched: the table has none of them yet)."""
        self._touched = {}
        self._touch_all()

    def take_rows(self) -> dict[bytes, bytes | None]:
        """The rows changed since the last call (row key -> bytes, None: gone),
        in key order, and an empty journal."""
        touched = self._touched
        if not touched:
            return {}
        self._touched = {}
        rows: dict[bytes, bytes | None] = {}
        pack_idx, pack = _IDX.pack, _ROW.pack
        for name in sorted(touched, key=lambda n: n + b"/"):  # the rows' key order
            prefix = name + b"/"
            q = self.queues.get(name)
            if q is None:
                rows.update((prefix + pack_idx(idx), None) for idx in sorted(touched[name]))
                continue
            # q.row() inlined: a checkpoint may take every message of a large load
            holder, pending, produced, attempts = q.holder, q.pending, q.produced_ms, q.attempts
            for idx in sorted(touched[name]):
                key = prefix + pack_idx(idx)
                slot = holder.get(idx)
                if slot is not None:
                    head = pack(
                        ROW_LAYOUT,
                        produced.get(idx, 0),
                        attempts.get(idx, 0),
                        q.hand_out.get(idx, 0),
                    )
                    rows[key] = head + slot.consumer_id
                elif idx in pending:
                    rows[key] = pack(ROW_LAYOUT, produced.get(idx, 0), attempts.get(idx, 0), 0)
                else:
                    rows[key] = None
        return rows

    def return_rows(self, rows: dict[bytes, bytes | None]) -> None:
        """A checkpoint failed: its rows are journaled again, so the next one
        takes them as they are then (newer changes win, being the state)."""
        touched = self._touched
        if touched is None:
            return
        for key in rows:
            name, idx = parse_row_key(key)
            idxs = touched.get(name)
            if idxs is None:
                idxs = touched[name] = set()
            idxs.add(idx)

    def export_sections(self) -> list[Any]:
        """What a checkpoint's sections image holds of this part: export_state's
        layout with only the per-queue scalars and the consumers (no attempts,
        holds or produce times: those are the table's rows). Its size follows the
        queues and consumers, not the messages."""
        return [
            (
                q.name,
                q.spelling,
                q.next_idx,
                {},
                {
                    "next_consumer": q.next_consumer,
                    "consumers": [(s.consumer_id, s.node, []) for s in q.consumers.values()],
                    "produced_ms": [],
                },
            )
            for q in self.queues.values()
        ]

    def restore_state(
        self,
        state: list[Any],
        store: MVCCStore,
        rows: Iterable[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Become `state`: an `export_state`, or (with `rows`, the `mq` table in
        key order) an `export_sections` whose per-message data are the rows.
        Which messages exist and the settings come from the store (its index for
        the message keys, no value loaded; the config values). With a journal,
        what did not come from rows is journaled: an exported state's messages
        (and the ones this state had: their rows go), so the next checkpoint
        writes them."""
        if rows is None:  # the table still holds this state's rows: they go
            self._touch_all()
        elif self._touched is not None:  # the table holds the state restored
            self._touched = {}
        self.queues = {}
        self._dirty.clear()
        self._to_dead = []
        self._given_back = []
        self._released = []
        held: dict[bytes, list[tuple[bytes, bytes, list[int]]]] = {}
        for name, spelling, next_idx, attempts, *rest in state:
            q = self.queues[name] = QueueInfo(name, spelling, next_idx, attempts=dict(attempts))
            if rest:
                q.next_consumer = rest[0]["next_consumer"]
                held[name] = rest[0]["consumers"]
                q.produced_ms = dict(rest[0].get("produced_ms", ()))
        for spelling in (keys.SHORT, keys.LONG):
            end = spelling[:-1] + b"0"  # every key under the spelling
            for key in store.keys_in(spelling, end):
                qk = keys.parse(key)
                if qk is None:
                    continue
                if qk.kind == "message":
                    self._queue(qk.name, qk.spelling).pending[qk.idx] = key
                elif qk.kind == "config":
                    kv = store.get(key)
                    assert kv is not None  # keys_in lists the keys that exist
                    self._queue(qk.name, qk.spelling).settings = QueueSettings.parse(kv.value, key)
        for name, consumers in held.items():
            q = self.queues[name]
            seq = -sum(len(idxs) for _c, _n, idxs in consumers)  # below every hand-out to come
            for consumer_id, node, idxs in consumers:
                slot = q.consumers[consumer_id] = ConsumerSlot(consumer_id, node)
                for idx in idxs:
                    key = q.pending.pop(idx, None)
                    if key is not None:
                        slot.held[idx] = key
                        q.holder[idx] = slot
                        q.hand_out[idx] = seq
                    seq += 1
        row_counts = self._restore_rows(rows) if rows is not None else {}
        if self._touched is None:
            return
        for q in self.queues.values():
            if rows is None or row_counts.get(q.name, 0) != q.depth:
                # an exported state, or sections that held this queue's data
                # (a backend written before the queue kept rows)
                marks = self._touched_of(q)
                assert marks is not None
                marks.update(q.message_idxs())

    def _restore_rows(self, rows: Iterable[tuple[bytes, bytes]]) -> dict[bytes, int]:
        """Per-message data from the `mq` table's rows (after the message keys
        were found); how many rows each queue had. A row whose message or holder
        the state does not know is refused: the rows and the keys are one
        checkpoint's."""
        counts: dict[bytes, int] = {}
        held: dict[bytes, list[tuple[int, int, bytes]]] = {}  # (hand-out, idx, holder)
        queues = self.queues
        for key, raw in rows:
            name, idx = parse_row_key(key)
            row = MessageRow.decode(raw)
            q = queues.get(name)
            if q is None or idx not in q.pending:
                raise ValueError(
                    f"mq row of message {idx} of queue {name!r}, which has no message key"
                )
            counts[name] = counts.get(name, 0) + 1
            if row.produced_ms:
                q.produced_ms[idx] = row.produced_ms
            if row.attempts:
                q.attempts[idx] = row.attempts
            if row.holder:
                held.setdefault(name, []).append((row.hand_out, idx, row.holder))
        for name, holds in held.items():
            q = queues[name]
            holds.sort()
            for hand_out, idx, consumer_id in holds:
                slot = q.consumers.get(consumer_id)
                if slot is None:
                    raise ValueError(
                        f"mq row of message {idx} of queue {name!r} held by {consumer_id!r}, "
                        "which is not a consumer"
                    )
                slot.held[idx] = q.pending.pop(idx)
                q.holder[idx] = slot
                q.hand_out[idx] = hand_out
        return counts


def sections_with_rows(sections: list[Any], rows: Iterable[tuple[bytes, bytes]]) -> list[Any]:
    """`QueueState.export_sections` (as a backend's sections hold it) and the
    `mq` table's rows, in key order, as `export_state` gives them: what a
    snapshot of the whole state needs. Pure data, for a thread holding a read
    transaction."""
    attempts: dict[bytes, dict[int, int]] = {}
    produced: dict[bytes, list[tuple[int, int]]] = {}
    held: dict[bytes, list[tuple[int, int, bytes]]] = {}
    for key, raw in rows:
        name, idx = parse_row_key(key)
        row = MessageRow.decode(raw)
        if row.attempts:
            attempts.setdefault(name, {})[idx] = row.attempts
        if row.produced_ms:
            produced.setdefault(name, []).append((idx, row.produced_ms))
        if row.holder:
            held.setdefault(name, []).append((row.hand_out, idx, row.holder))
    out: list[Any] = []
    for name, spelling, next_idx, queue_attempts, *rest in sections:
        assignment: dict[str, Any] = dict(rest[0]) if rest else {"next_consumer": 0}
        assignment.setdefault("consumers", [])
        by_holder: dict[bytes, list[int]] = {}
        for _hand_out, idx, holder in sorted(held.get(name, ())):
            by_holder.setdefault(holder, []).append(idx)
        assignment["consumers"] = [
            (c, node, [*idxs, *by_holder.get(c, ())]) for c, node, idxs in assignment["consumers"]
        ]
        assignment["produced_ms"] = sorted(
            [*assignment.get("produced_ms", ()), *produced.get(name, ())]
        )
        out.append(
            (name, spelling, next_idx, {**queue_attempts, **attempts.get(name, {})}, assignment)
        )
    return out
