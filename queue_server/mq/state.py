"""The replicated part of etcd-key queues: what must be the same on every node.

A queue's messages are ordinary MVCC keys (`/q/{name}/{idx}/{key}`), so reads,
watches, compaction, snapshots and replication treat them like any key. What
this module adds lives in the state machine, so it is deterministic:

- producing: inside apply, a put on `/q/{name}/p/{key}` becomes a put of the next
  message key of the queue (`rewrite_put`), refused if the queue is at max_depth;
- per queue: the next idx (never reused, so an old delivery key can never ack a
  newer message), the depth (kept in step with committed events), the settings
  parsed from `/q/{name}/config`, and the delivery attempts of messages that came
  back unacknowledged;
- `requeue`: count a failed delivery; at max_deliveries, move the message to the
  dead-letter queue (delete here, produce there) in the same revision.

Which consumer holds which message is not here: that is node-local
(`dispatcher.py`); after a restart every message is pending again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from queue_server.cqs.state import CqsState, parse_cqs_config
from queue_server.errors import EtcdError
from queue_server.mq import keys
from queue_server.mvcc.store import Event, MVCCStore

DEFAULT_PREFETCH = 64
"""Unacknowledged messages one consumer may hold when the queue does not say."""


class QueueFull(EtcdError):
    code = "RESOURCE_EXHAUSTED"
    message = "etcdserver: queue is full"


class InvalidQueueConfig(EtcdError):
    code = "INVALID_ARGUMENT"
    message = "etcdserver: invalid queue config"


@dataclass(slots=True)
class QueueSettings:
    """Per-queue settings, from the JSON value of `/q/{name}/config`."""

    ack_deadline: float = 0.0  # seconds a delivery may stay unacknowledged; 0: forever
    max_deliveries: int = 0  # deliveries before dead-lettering; 0: unlimited
    dead_letter: bytes = b""  # dead-letter queue name; default "{name}.dead"
    prefetch: int = DEFAULT_PREFETCH  # unacknowledged messages per consumer
    max_depth: int = 0  # pending + in-flight messages; 0: unlimited

    @classmethod
    def parse(cls, value: bytes) -> QueueSettings:
        try:
            raw = json.loads(value or b"{}")
        except ValueError as e:
            raise InvalidQueueConfig(f"etcdserver: invalid queue config: {e}") from e
        if not isinstance(raw, dict):
            raise InvalidQueueConfig("etcdserver: invalid queue config: expected a JSON object")
        s = cls()
        known = {"ack_deadline", "max_deliveries", "dead_letter", "prefetch", "max_depth", "cqs"}
        unknown = set(raw) - known
        if unknown:
            raise InvalidQueueConfig(
                f"etcdserver: invalid queue config: unknown setting {sorted(unknown)[0]!r}"
            )
        try:
            s.ack_deadline = float(raw.get("ack_deadline", 0))
            s.max_deliveries = int(raw.get("max_deliveries", 0))
            s.dead_letter = str(raw.get("dead_letter", "")).encode()
            s.prefetch = int(raw.get("prefetch", DEFAULT_PREFETCH))
            s.max_depth = int(raw.get("max_depth", 0))
        except (TypeError, ValueError) as e:
            raise InvalidQueueConfig(f"etcdserver: invalid queue config: {e}") from e
        if s.ack_deadline < 0 or s.max_deliveries < 0 or s.prefetch < 1 or s.max_depth < 0:
            raise InvalidQueueConfig("etcdserver: invalid queue config: negative or zero limit")
        if b"/" in s.dead_letter:
            raise InvalidQueueConfig("etcdserver: invalid queue config: dead_letter is one segment")
        if "cqs" in raw:
            try:
                parse_cqs_config(raw["cqs"])
            except ValueError as e:
                raise InvalidQueueConfig(f"etcdserver: invalid queue config: {e}") from e
        return s


@dataclass(slots=True)
class QueueInfo:
    """Replicated facts about one queue."""

    name: bytes
    spelling: bytes
    next_idx: int = 1
    depth: int = 0
    settings: QueueSettings = field(default_factory=QueueSettings)
    attempts: dict[int, int] = field(default_factory=dict)

    def dead_letter_name(self) -> bytes:
        return self.settings.dead_letter or self.name + b".dead"


class QueueState:
    """All queues of the state machine."""

    def __init__(self, cqs: CqsState | None = None) -> None:
        self.queues: dict[bytes, QueueInfo] = {}
        self.cqs = cqs if cqs is not None else CqsState()
        # produces already checked in the request being checked, per queue
        self._checked_produces: dict[bytes, int] = {}

    def begin_checks(self) -> None:
        """A new request's puts are about to be checked."""
        self._checked_produces.clear()
        self.cqs.begin_checks()

    def queue(self, name: bytes, spelling: bytes) -> QueueInfo:
        """The queue, created on first use with the spelling it was first used with."""
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = QueueInfo(name, spelling)
        return q

    # -- hooks into KV apply ----------------------------------------------------

    def check_put(self, key: bytes, value: bytes) -> None:
        """Refuse, before anything changes, a produce over max_depth or a bad config."""
        if not key.startswith((keys.SHORT, keys.LONG)):
            return
        qk = keys.parse(key)
        if qk is None:
            return
        if qk.kind == "produce":
            if self.cqs.claims(qk):
                self.cqs.check_publish(qk, value)
                return
            q = self.queues.get(qk.name)
            earlier = self._checked_produces.get(qk.name, 0)
            if q is not None and q.settings.max_depth and q.depth + earlier >= q.settings.max_depth:
                raise QueueFull(
                    f"etcdserver: queue {qk.name.decode(errors='replace')} is full "
                    f"(max_depth {q.settings.max_depth})"
                )
            self._checked_produces[qk.name] = earlier + 1
        elif qk.kind == "config":
            QueueSettings.parse(value)

    def rewrite_put(self, key: bytes, value: bytes) -> bytes | None:
        """The key a put really writes: a producer key becomes the queue's next
        message key; a CQS publication is fanned out and writes nothing (None);
        any other key is itself."""
        if not key.startswith((keys.SHORT, keys.LONG)):
            return key
        qk = keys.parse(key)
        if qk is None or qk.kind != "produce":
            return key
        if self.cqs.claims(qk):
            self.cqs.publish(qk, value)
            return None
        q = self.queue(qk.name, qk.spelling)
        idx = q.next_idx
        q.next_idx += 1
        return keys.message_key(q.spelling, q.name, idx, qk.key)

    def follow(self, revision: int, events: list[Event]) -> None:
        """Store hook: depth and settings in step with committed changes."""
        for e in events:
            key = e.kv.key
            if not key.startswith((keys.SHORT, keys.LONG)):
                continue
            qk = keys.parse(key)
            if qk is None:
                continue
            if qk.kind == "message":
                q = self.queue(qk.name, qk.spelling)
                if e.is_delete:
                    q.depth -= 1
                    q.attempts.pop(qk.idx, None)
                elif e.prev_kv is None:
                    q.depth += 1
                    q.next_idx = max(q.next_idx, qk.idx + 1)
            elif qk.kind == "config":
                q = self.queue(qk.name, qk.spelling)
                q.settings = QueueSettings() if e.is_delete else QueueSettings.parse(e.kv.value)
            elif qk.kind == "registry" and not e.is_delete:
                self.queue(qk.name, qk.spelling)

    # -- requeue ----------------------------------------------------------------

    def requeue(self, store: MVCCStore, name: bytes, idxs: list[int]) -> list[int]:
        """Count a failed delivery for each message still queued; returns the idx of
        those moved to the dead-letter queue (all in one revision)."""
        q = self.queues.get(name)
        if q is None:
            return []
        moved: list[tuple[int, bytes, bytes, int]] = []
        for idx in idxs:
            prefix = keys.message_key(q.spelling, q.name, idx, b"")
            found = store.range(prefix, prefix[:-1] + b"0").kvs  # "/" + 1 == "0"
            if not found:
                continue
            kv = found[0]
            n = q.attempts.get(idx, 0) + 1
            q.attempts[idx] = n
            if q.settings.max_deliveries and n >= q.settings.max_deliveries:
                moved.append((idx, kv.key, kv.value, kv.lease))
        if moved:
            dead = self.queue(q.dead_letter_name(), q.spelling)
            with store.write() as txn:
                for _idx, key, value, lease in moved:
                    txn.delete_range(key, None)
                    suffix = key.rsplit(b"/", 1)[1]
                    new_idx = dead.next_idx
                    dead.next_idx += 1
                    txn.put(
                        keys.message_key(dead.spelling, dead.name, new_idx, suffix), value, lease
                    )
        return [m[0] for m in moved]

    # -- snapshots --------------------------------------------------------------

    def export_state(self) -> list[tuple[bytes, bytes, int, dict[int, int]]]:
        return [(q.name, q.spelling, q.next_idx, dict(q.attempts)) for q in self.queues.values()]

    def restore_state(self, state: list[Any], store: MVCCStore) -> None:
        """Counters and attempts from the snapshot; depth and settings from the store."""
        self.queues = {}
        for name, spelling, next_idx, attempts in state:
            self.queues[name] = QueueInfo(name, spelling, next_idx, attempts=dict(attempts))
        for spelling in (keys.SHORT, keys.LONG):
            end = spelling[:-1] + b"0"  # every key under the spelling
            for kv in store.range(spelling, end).kvs:
                qk = keys.parse(kv.key)
                if qk is None:
                    continue
                if qk.kind == "message":
                    self.queue(qk.name, qk.spelling).depth += 1
                elif qk.kind == "config":
                    self.queue(qk.name, qk.spelling).settings = QueueSettings.parse(kv.value)
