"""The replicated part of CQS: queues, subscriptions and their notifications.

What belongs here: every CQS change that must be the same on every replica,
applied from the log. No I/O and no clock: times come in the commands (Unix ms
read by the proposer), and so do ack-token bases, so apply stays deterministic.

- A CQS queue is an etcd-key queue whose `/q/{name}/config` JSON has a `cqs`
  object: `{"cqs": {"subscriptions": [{"dto_type": .., "alias_name": ..}],
  "depth": 4}}`. `CreateOrConfigureQueue` writes that key, and so may any etcd
  client; `follow` keeps the queues in step with it (deleting it deletes the
  queue). `depth` is fixed when the queue is created.
- Publishing is an etcd put on `/q/dto:{type}/p/{key}`: `check_publish` refuses
  a malformed value before anything changes, and `publish` (inside the put's
  apply) fans the notification out to every subscribed queue; nothing is written
  under the key. A put on `/q/{queue}/p/{key}` of a CQS queue enqueues into that
  queue alone.
- `dequeue`, `settle` and `enqueue` apply the CQS log commands.

`take_changed()` names the queues that may have gained visible notifications
or lost in-flight ones in the last command: one of its effects, for the node's
long-polls and etcd watch view.

`CqsState` is CQS's `QueuePlugin` of the keyspace router (keyspace/router.py):
it claims the queues whose config has a `cqs` object and the publication
points `dto:{type}`; a single-key delete of a delivery key `/q/{queue}/{seq}/
{token}` acknowledges it inside apply (in a Txn too).

The `cqs` table (on a backend: apply.TableOwner)
------------------------------------------------
On a backend the notifications are rows of the backend's `t:cqs` table, and a
checkpoint's sections hold only each queue's config and counters (name,
subscriptions, prefetch, depth, seq: `export_sections`), whatever the queue
holds. Each queue gets a table id (u32, from a counter, never reused while
the process runs) when it is made; its rows are

| key | value |
|---|---|
| table id (4 bytes BE) | the queue's name (UTF-8): its header row, first of its rows |
| table id, `priority + 2**103` (13 bytes BE) | one notification (below) |

so the keys sort by queue, then in the queue's order (`priority = sla_us << 40
| (63 - segments) << 34 | seq`, unique in a queue: seq is), and a restart's
load is one cursor walk in priority order. Ids, not names, lead the keys: a
key stays 17 bytes (LMDB keys stop at 511) and a queue deleted and made again
under its name never meets its old rows.

A notification row's value is a packed struct (`n`: one byte below 255, else
255 and four bytes BE; strings UTF-8 with surrogatepass):

    flags (1 byte: bit 0 is_parent), n + dto_type, n + alias
    n + tracking_id
    n + token, and if the token is not empty: visible_at (i64 BE, Unix ms)
    dto_id, to the end

`sla_us` and `seq` are in the key. Not pb.Notification: every change writes its
row's bytes into the journal while it is applied (so a checkpoint takes the
journal in O(1), below), so a row must cost a few byte joins from the entry
the tree already holds (its first part is cached per kind), not a message
built per change; a restart reads a row back with slices, no message objects.

The journal (`RowJournal`, shared by the queues): row key -> the row's bytes
as they are now, or None (gone). Every change to a notification writes its
row when it happens: publish, direct enqueue and ReEnqueue (a merge into a
pending copy with a sooner SLA moves the row to its new key), dequeue into
flight, ack, release, visibility expiry, extension; a queue made writes its
header, a queue deleted writes None for its header and every row (its size,
once). `take_rows` hands the journal's dict itself to the checkpoint and starts
a new one; `return_rows` puts a failed checkpoint's rows back under any newer
ones. `restore_state(state, rows)` rebuilds the queues from the sections and
the table; from an `export_state` (rows None: a snapshot file, a member's Raft
snapshot, a data dir converted) every row is journaled, and so are the old
queues' deletions. `sections_with_rows` folds the rows back into the sections
(pure data, on a thread) for a snapshot of the whole state.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf import json_format, timestamp_pb2
from google.protobuf.message import DecodeError

from etcdserverpb import cqs_pb2, internal_pb2
from queue_server.cqs.tree import (
    DEFAULT_DEPTH,
    DamagedRow,
    Record,
    RowJournal,
    SlaQueue,
    decode_row,
    table_key,
    text,
    utf8,
)
from queue_server.errors import EtcdError
from queue_server.keyspace import grammar as keys
from queue_server.keyspace.config import ConfigFields, QueueConfig
from queue_server.keyspace.grammar import QueueKey
from queue_server.mvcc.store import Event, KeyValue, MVCCStore

DTO_QUEUE_PREFIX = b"dto:"
"""Queues named `dto:{dto_type}` are publication points, not queues."""
MAX_DEPTH = 32
"""The largest `depth` a queue may be created with."""

DEFAULT_PREFETCH = 8
"""Notifications one etcd watch consumer may hold when the `cqs` object does
not say."""

JOURNALED_ROW_BYTES = 360
"""The memory one journaled row takes until its checkpoint has committed,
about (measured with bench ids: its key's and its value's objects and the
journal's slot, ~200 B, and its share of the LMDB write transaction's pages)."""


class QueueNotFound(EtcdError):
    code = "NOT_FOUND"
    message = "cqs: queue not found"


class TokenNotHeld(EtcdError):
    code = "FAILED_PRECONDITION"
    message = "cqs: ack_token is unknown, acknowledged or expired"


class InvalidNotification(EtcdError):
    code = "INVALID_ARGUMENT"
    message = "cqs: invalid change notification"


@dataclass(slots=True)
class Published:
    """A validated publication (or split item): what goes into a queue."""

    dto_type: str
    dto_id: str
    is_parent: bool
    alias: str
    sla_us: int
    tracking_id: str


@dataclass(slots=True)
class CqsQueue:
    """One CQS queue: its subscriptions and its notifications."""

    name: str
    subscriptions: list[tuple[str, str]]
    tree: SlaQueue
    prefetch: int = DEFAULT_PREFETCH  # for etcd watch consumers
    table_id: int = 0  # its rows' key prefix in the `cqs` table (0: none yet)

    @property
    def depth(self) -> int:
        return self.tree.depth


def parse_cqs_config(fields: ConfigFields) -> tuple[list[tuple[str, str]], int, int] | None:
    """(subscriptions, depth, prefetch) of a config's `cqs` object, None when it
    has none; refuses a field outside its type or range (InvalidQueueConfig).

    The schema: `subscriptions` a list of {"dto_type": non-empty string,
    "alias_name": string}; `depth` an integer 0..MAX_DEPTH (0: DEFAULT_DEPTH);
    `prefetch` an integer >= 1. No other field."""
    cqs = fields.nested("cqs")
    if cqs is None:
        return None
    cqs.only(("subscriptions", "depth", "prefetch"))
    subs = cqs.raw.get("subscriptions", [])
    if not isinstance(subs, list):
        raise cqs.refuse("subscriptions", subs, "is not a list")
    out: list[tuple[str, str]] = []
    for i, sub in enumerate(subs):
        where = f"subscriptions[{i}]"
        if not isinstance(sub, dict) or set(sub) - {"dto_type", "alias_name"}:
            raise cqs.refuse(where, sub, 'is not {"dto_type": ..., "alias_name": ...}')
        dto_type, alias = sub.get("dto_type", ""), sub.get("alias_name", "")
        if not isinstance(dto_type, str) or not dto_type:
            raise cqs.refuse(f"{where}.dto_type", dto_type, "is not a non-empty string")
        if not isinstance(alias, str):
            raise cqs.refuse(f"{where}.alias_name", alias, "is not a string")
        if (dto_type, alias) not in out:
            out.append((dto_type, alias))
    # Leniently (apply) true/false pass as 1/0, as apply always took them;
    # strings and fractions never did.
    depth = cqs.integer("depth", DEFAULT_DEPTH, minimum=0, maximum=MAX_DEPTH, coerced=False)
    prefetch = cqs.integer("prefetch", DEFAULT_PREFETCH, minimum=1, coerced=False)
    return out, depth or DEFAULT_DEPTH, prefetch


TIMESTAMP_MIN_SECONDS = -62_135_596_800  # 0001-01-01T00:00:00Z
TIMESTAMP_MAX_SECONDS = 253_402_300_799  # 9999-12-31T23:59:59Z
"""google.protobuf.Timestamp's valid range. A notification's SLA outside it could
not be shown as RFC 3339 (the Range view and watch consumers print it), so it is
refused at publication, as a JSON SLA outside it already is."""


def _sla_us(ts: Any) -> int:
    return int(ts.seconds) * 1_000_000 + int(ts.nanos) // 1000


def parse_publication(dto_type: str | None, value: bytes) -> Published:
    """A published value: JSON `{dto_id, alias_name?, sla_timestamp, tracking_id?}`
    or a serialized DtoChangeNotification. `dto_type` is the one the key names;
    None (a direct enqueue) takes it from the value. Raises InvalidNotification."""

    def bad(why: str) -> InvalidNotification:
        return InvalidNotification(f"cqs: invalid change notification: {why}")

    if value[:1] == b"{":
        return _parse_json_publication(dto_type, value, bad)
    n = cqs_pb2.DtoChangeNotification()
    try:
        n.ParseFromString(value)
    except DecodeError as e:
        raise bad("neither JSON nor a DtoChangeNotification") from e
    if n.WhichOneof("urn") == "parent_id":
        raise bad("parent_id is CQS-internal and cannot be published")
    if not n.HasField("sla_timestamp"):
        raise bad("sla_timestamp is required")
    sla = n.sla_timestamp
    if not (
        TIMESTAMP_MIN_SECONDS <= sla.seconds <= TIMESTAMP_MAX_SECONDS
        and 0 <= sla.nanos <= 999_999_999
    ):
        raise bad(
            f"sla_timestamp (seconds {sla.seconds}, nanos {sla.nanos}) is not a valid "
            "Timestamp (years 0001 to 9999, nanos 0 to 999999999)"
        )
    return _published(
        dto_type, n.dto_type, n.dto_id, n.alias_name, _sla_us(n.sla_timestamp), n.tracking_id, bad
    )


_JSON_FIELDS = frozenset(
    {"dto_id", "parent_id", "alias_name", "sla_timestamp", "tracking_id", "dto_type"}
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _parse_json_publication(
    dto_type: str | None, value: bytes, bad: Callable[[str], InvalidNotification]
) -> Published:
    """The JSON form, read with `json` and `datetime` (protobuf's json_format
    costs several times more, and publishing is a hot path)."""
    try:
        raw = json.loads(value)
    except ValueError as e:
        raise bad(f"not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise bad("expected a JSON object")
    for name, field_value in raw.items():
        if name not in _JSON_FIELDS:
            raise bad(f"unknown field {name!r}")
        if not isinstance(field_value, str):
            raise bad(f"{name} must be a string")
    if "parent_id" in raw:
        raise bad("parent_id is CQS-internal and cannot be published")
    sla = raw.get("sla_timestamp")
    if sla is None:
        raise bad("sla_timestamp is required")
    return _published(
        dto_type,
        raw.get("dto_type", ""),
        raw.get("dto_id", ""),
        raw.get("alias_name", ""),
        _rfc3339_us(sla, bad),
        raw.get("tracking_id", ""),
        bad,
    )


def _rfc3339_us(text: str, bad: Callable[[str], InvalidNotification]) -> int:
    """Microseconds since the epoch of an RFC 3339 timestamp with an offset."""
    try:
        dt = datetime.fromisoformat(text)
        if dt.tzinfo is None or "T" not in text:
            raise ValueError("not RFC 3339")
        return (dt - _EPOCH) // _MICROSECOND
    except ValueError:
        ts = timestamp_pb2.Timestamp()
        try:  # what datetime does not read (nanoseconds) protobuf may
            ts.FromJsonString(text)
        except ValueError as e:
            raise bad(f"sla_timestamp {text!r} is not RFC 3339: {e}") from e
        return _sla_us(ts)


def _published(
    key_type: str | None,
    value_type: str,
    dto_id: str,
    alias: str,
    sla_us: int,
    tracking_id: str,
    bad: Callable[[str], InvalidNotification],
) -> Published:
    if key_type is None:
        if not value_type:
            raise bad("dto_type is required")
        key_type = value_type
    elif value_type and value_type != key_type:
        raise bad(f"dto_type {value_type!r} is not the key's {key_type!r}")
    if not dto_id:
        raise bad("dto_id is required")
    return Published(key_type, dto_id, False, alias, sla_us, tracking_id)


def check_split_item(item: cqs_pb2.SplitItem) -> None:
    """The seed's field-level rules for a ReEnqueue item."""
    if not item.dto_type:
        raise InvalidNotification("cqs: split item has no dto_type")
    urn = item.WhichOneof("urn")
    if urn is None or not getattr(item, urn):
        raise InvalidNotification("cqs: split item has neither dto_id nor parent_id")


def _seq(row: tuple[int, Record, bool]) -> int:
    return row[0]


def notification_of(record: Record) -> cqs_pb2.DtoChangeNotification:
    n = cqs_pb2.DtoChangeNotification(
        ack_token=record.token,
        dto_type=record.dto_type,
        alias_name=record.alias,
        tracking_id=record.tracking_id,
    )
    if record.is_parent:
        n.parent_id = record.dto_id
    else:
        n.dto_id = record.dto_id
    n.sla_timestamp.seconds, micros = divmod(record.sla_us, 1_000_000)
    n.sla_timestamp.nanos = micros * 1000
    return n


@dataclass
class CqsState:
    """All CQS queues of the state machine."""

    config_fields: frozenset[str] = frozenset({"cqs"})
    queues: dict[str, CqsQueue] = field(default_factory=dict)
    published: int = 0  # publications applied
    dropped: int = 0  # publications with no subscriber
    _subscribers: dict[str, list[tuple[CqsQueue, str]]] = field(default_factory=dict)
    _checked: dict[tuple[str | None, bytes], Published] = field(default_factory=dict)
    _changed_names: set[str] = field(default_factory=set)
    _reindexed_names: frozenset[bytes] = frozenset()  # the queue names, as key bytes
    _journal: RowJournal | None = None  # rows changed since the last checkpoint
    _next_table_id: int = 1

    def _changed(self, name: str) -> None:
        self._changed_names.add(name)

    def take_changed(self) -> set[str]:
        """The queues the last command changed (and forget them)."""
        out, self._changed_names = self._changed_names, set()
        return out

    def get(self, name: str) -> CqsQueue:
        q = self.queues.get(name)
        if q is None:
            raise QueueNotFound(f"cqs: queue {name!r} not found")
        return q

    def is_cqs(self, name: bytes) -> bool:
        return name in self._reindexed_names

    def owns_consumer(self, qk: QueueKey) -> bool:
        """Whether a consumer key `qk` (`/q/{name}/c/{uuid}`) is a CQS queue's,
        from the state as it is now: the queue is a CQS queue (the router
        offers CQS its claim first, so such a queue is never the etcd-key
        queue's). A read for node-local code, which must not ask the router."""
        return qk.spelling == keys.SHORT and self.is_cqs(qk.name)

    # -- configuration (follows /q/{name}/config) ---------------------------------

    def check_config(self, key: bytes, config: QueueConfig, *, strict: bool) -> None:
        parse_cqs_config(ConfigFields(key, config, strict))

    def configure(self, qk: QueueKey, config: QueueConfig | None) -> None:
        """A config key changed: a `cqs` object makes (or keeps) the queue a CQS
        queue; without one (or deleted) the CQS queue is gone."""
        if qk.spelling != keys.SHORT:
            return
        name = qk.name.decode(errors="replace")
        key = keys.config_key(qk.spelling, qk.name)
        parsed = None if config is None else parse_cqs_config(ConfigFields(key, config, False))
        if parsed is None:
            gone = self.queues.pop(name, None)
            if gone is not None:
                self._drop_rows(gone)
                self._reindex()
            return
        subs, depth, prefetch = parsed
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = CqsQueue(name, subs, SlaQueue(depth=depth))
            self._give_table(q, write=True)
        q.subscriptions = subs
        q.prefetch = prefetch
        self._reindex()
        self._changed(name)

    def _reindex(self) -> None:
        self._reindexed_names = frozenset(name.encode() for name in self.queues)
        index: dict[str, list[tuple[CqsQueue, str]]] = {}
        for q in self.queues.values():
            for dto_type, alias in q.subscriptions:
                index.setdefault(dto_type, []).append((q, alias))
        self._subscribers = index

    # -- publishing (hooks into the put of a producer key) -------------------------

    def claims(self, qk: QueueKey) -> bool:
        """Whether the key belongs to a CQS queue or a publication point."""
        return qk.spelling == keys.SHORT and (
            qk.name.startswith(DTO_QUEUE_PREFIX) or self.is_cqs(qk.name)
        )

    def begin_command(self, now_ms: int) -> None:
        return None  # CQS commands carry their own time

    def begin_request(self) -> None:
        """A new request is about to be checked: forget the last one's parses."""
        self._checked.clear()

    def check_produce(self, qk: QueueKey, value: bytes) -> None:
        """Refuse a malformed publication before anything changes; the parse is
        kept for `publish` in the same request."""
        dto_type = self._dto_type_of(qk)
        self._checked[(dto_type, value)] = parse_publication(dto_type, value)

    def _dto_type_of(self, qk: QueueKey) -> str | None:
        if qk.name.startswith(DTO_QUEUE_PREFIX):
            return qk.name[len(DTO_QUEUE_PREFIX) :].decode(errors="replace")
        return None  # a direct enqueue: the value names its type

    def produce(self, qk: QueueKey, value: bytes) -> None:
        """A put of a producer key publishes; nothing is written under the key."""
        self.publish(qk, value)

    def delete(self, qk: QueueKey, key: bytes, now_ms: int) -> bytes | int:
        """A delete of a delivery key `/q/{queue}/{seq}/{token}` acknowledges the
        token (how many it settled); any other key is itself."""
        if qk.kind != "message" or not self.is_cqs(qk.name):
            return key
        settle = internal_pb2.CqsSettle(
            queue=qk.name.decode(), tokens=[qk.key.decode(errors="replace")], now_ms=now_ms
        )
        return self.settle(settle).settled

    def follow(self, qk: QueueKey, event: Event) -> None:
        return None  # notifications are not keys; registry keys are the node's

    def after_apply(self, store: MVCCStore) -> None:
        return None

    def publish(self, qk: QueueKey, value: bytes) -> int:
        """Fan a publication out (or enqueue it directly); returns the queues reached."""
        self.published += 1
        dto_type = self._dto_type_of(qk)
        p = self._checked.pop((dto_type, value), None) or parse_publication(dto_type, value)
        if not qk.name.startswith(DTO_QUEUE_PREFIX):
            self._add(self.queues[qk.name.decode(errors="replace")], p)
            return 1
        reached = 0
        for q, alias in self._subscribers.get(p.dto_type, ()):
            if alias == p.alias:
                self._add(q, p)
                reached += 1
        if not reached:
            self.dropped += 1
        return reached

    def _add(self, q: CqsQueue, p: Published) -> None:
        q.tree.insert(p.dto_type, p.dto_id, p.sla_us, p.is_parent, p.alias, p.tracking_id)
        self._changed(q.name)

    # -- log commands -------------------------------------------------------------

    def _expire(self, q: CqsQueue, now_ms: int) -> None:
        if q.tree.expire(now_ms):
            self._changed(q.name)

    def dequeue(self, c: internal_pb2.CqsDequeue) -> internal_pb2.CqsDequeueResponse:
        q = self.get(c.queue)
        self._expire(q, c.now_ms)
        taken = q.tree.dequeue(c.max, c.depth, c.visible_until_ms, c.token_base)
        resp = internal_pb2.CqsDequeueResponse()
        for r in taken:
            resp.notifications.append(notification_of(r))
            resp.seq.append(q.tree.seq_of(r))
        return resp

    def settle(self, c: internal_pb2.CqsSettle) -> internal_pb2.CqsSettleResponse:
        q = self.get(c.queue)
        self._expire(q, c.now_ms)
        tokens = list(c.tokens)
        done = q.tree.release(tokens) if c.release else q.tree.ack(tokens)
        if done:  # visible again, or room for a watch consumer
            self._changed(q.name)
        return internal_pb2.CqsSettleResponse(settled=done)

    def enqueue(self, c: internal_pb2.CqsEnqueue) -> internal_pb2.CqsEnqueueResponse:
        """ReEnqueue items: all checked first, so a bad one changes nothing but
        the expiry due at `now_ms` (which any command applies first)."""
        q = self.get(c.queue)
        self._expire(q, c.now_ms)
        original = q.tree.held(c.original, c.now_ms)
        if original is None:
            raise TokenNotHeld()
        for item in c.items:
            check_split_item(item)
        sla, tracking = original.sla_us, original.tracking_id
        for item in c.items:
            urn = item.WhichOneof("urn")
            q.tree.insert(
                item.dto_type,
                getattr(item, urn or "dto_id"),
                sla,
                urn == "parent_id",
                item.alias_name,
                tracking,
            )
        if c.visible_until_ms:
            q.tree.extend(c.original, c.visible_until_ms)
        if c.commit:
            q.tree.ack([c.original])
        if c.items:
            self._changed(q.name)
        return internal_pb2.CqsEnqueueResponse(enqueued=len(c.items))

    # -- the etcd view of the queues -----------------------------------------------

    def view_range(
        self, key: bytes, end: bytes | None, revision: int, limit: int = 0
    ) -> tuple[list[KeyValue], int]:
        """The notifications of CQS queues inside [key, end) (`end` None: the key
        alone; b"": no upper bound), as keys `/q/{queue}/{seq}/pending` (pending)
        and `/q/{queue}/{seq}/{ack_token}` (in flight) with the notification as
        JSON: the first `limit` of them in key order (0: all; -1: none), and how
        many there are. They exist only now: every key carries the current
        revision. Counting walks the queue once; only the keys returned are
        sorted and encoded, so a limited Range of a large queue stays cheap (an
        inspection view, not a way to consume)."""

        def inside(k: bytes) -> bool:
            if end is None:
                return k == key
            return key <= k and (end == b"" or k < end)

        out: list[KeyValue] = []
        count = 0
        for name, q in self.queues.items():
            prefix = b"/q/" + name.encode() + b"/"
            upper = prefix[:-1] + b"0"  # every key under the prefix sorts below this
            if end is None:
                if not key.startswith(prefix):
                    continue
            elif key >= upper or (end != b"" and end <= prefix):
                continue
            queue = name.encode()
            tree = q.tree

            def rows(tree: SlaQueue = tree) -> Iterator[tuple[int, Record, bool]]:
                for r in tree.pending():
                    yield tree.seq_of(r), r, False
                for r, _ in tree.in_flight_records():
                    yield tree.seq_of(r), r, True

            def key_of(seq: int, r: Record, held: bool, queue: bytes = queue) -> bytes:
                token = r.token.encode() if held else b"pending"
                return keys.message_key(keys.SHORT, queue, seq, token)

            # Every message key is prefix + IDX_DIGITS digits + "/" + a token,
            # so a range from at most the lowest digits to past the highest
            # (clients count `/q/{name}/0` to `/q/{name}/:`) holds them all.
            lowest = prefix + b"0" * keys.IDX_DIGITS
            past_highest = prefix + b"9" * keys.IDX_DIGITS + b"0"
            whole = end is not None and key <= lowest and (end == b"" or end >= past_highest)
            if whole:  # every key of the queue is inside: count without building keys
                count += len(tree) + tree.in_flight
                found: Iterable[tuple[int, Record, bool]] = rows()
            else:
                chosen = [row for row in rows() if inside(key_of(*row))]
                count += len(chosen)
                found = chosen
            if limit < 0:
                continue
            ordered = (
                heapq.nsmallest(limit, found, key=_seq) if limit > 0 else sorted(found, key=_seq)
            )
            for seq, r, held in ordered:
                n = notification_of(r)
                if not held:
                    n.ack_token = ""
                value = json_format.MessageToJson(n, preserving_proto_field_name=True, indent=None)
                out.append(KeyValue(key_of(seq, r, held), revision, revision, 1, value.encode(), 0))
        if limit > 0 and len(out) > limit:
            out = sorted(out, key=lambda kv: kv.key)[:limit]
        return out, count

    # -- snapshots ----------------------------------------------------------------

    def export_state(self) -> list[dict[str, Any]]:
        return [
            {
                "name": q.name,
                "subscriptions": list(q.subscriptions),
                "prefetch": q.prefetch,
                "tree": q.tree.export_state(),
            }
            for q in self.queues.values()
        ]

    # -- checkpoints (apply.TableOwner) -------------------------------------

    table = "cqs"

    def keep_rows(self) -> None:
        """From now on every change to a notification writes its row into the
        journal `take_rows` hands to a checkpoint (see the module docstring)."""
        if self._journal is not None:
            return
        self._journal = RowJournal()
        for q in self.queues.values():
            self._give_table(q, write=True)

    def take_rows(self) -> dict[bytes, bytes | None]:
        """The rows changed since the last call, as they are now: the journal
        itself (O(1): each change wrote its row's bytes when it happened)."""
        journal = self._journal
        if journal is None or not journal.rows:
            return {}
        rows, journal.rows = journal.rows, {}
        for q in self.queues.values():
            q.tree.journal_swapped()
        return rows

    def return_rows(self, rows: dict[bytes, bytes | None]) -> None:
        """A checkpoint failed: its rows are pending again, under any newer
        change of the same row."""
        journal = self._journal
        if journal is None:
            return
        current = journal.rows
        for key, row in rows.items():
            current.setdefault(key, row)

    @property
    def pending_row_bytes(self) -> int:
        """About the memory the journal holds until a checkpoint takes it."""
        journal = self._journal
        return 0 if journal is None else len(journal.rows) * JOURNALED_ROW_BYTES

    def _give_table(self, q: CqsQueue, *, write: bool) -> None:
        """Give `q` its table id (if it has none) and, when rows are kept,
        attach it to the journal; `write` puts its header row and every row it
        has into the journal (a new queue, or one not read from the table)."""
        if not q.table_id:
            q.table_id = self._next_table_id
            self._next_table_id += 1
        journal = self._journal
        if journal is None:
            return
        q.tree.keep_rows(journal, q.table_id)
        if write:
            table = table_key(q.table_id)
            rows = journal.rows
            rows[table] = utf8(q.name)
            for key, row in q.tree.rows():
                rows[table + key] = row

    def _drop_rows(self, q: CqsQueue) -> None:
        """`q` is gone: so are its rows (the deletion costs its size once)."""
        journal = self._journal
        if journal is None or not q.table_id:
            return
        table = table_key(q.table_id)
        rows = journal.rows
        rows[table] = None
        for key in q.tree.row_keys():
            rows[table + key] = None

    def export_sections(self) -> list[Any]:
        """What a checkpoint's sections image holds of this part: each queue's
        config and counters, no notification (those are the table's rows), so
        its size does not grow with the queues'."""
        if self._journal is None:
            return self.export_state()
        return [
            {
                "name": q.name,
                "subscriptions": list(q.subscriptions),
                "prefetch": q.prefetch,
                "tree": q.tree.export_sections(),
            }
            for q in self.queues.values()
        ]

    def restore_state(
        self,
        state: Iterable[dict[str, Any]],
        rows: Iterator[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Become `state`: an `export_state` (`rows` None), or an
        `export_sections` whose notifications are `rows`, the `cqs` table in
        key order. Notifications found in the sections (a full export, or a
        backend written before the table was used) are written into the
        journal when rows are kept, so the next checkpoint moves them there."""
        journal = self._journal
        if journal is not None:
            if rows is None:  # the table may hold the old queues' rows
                for q in self.queues.values():
                    self._drop_rows(q)
            else:  # the table is the state
                journal.rows = {}
        self.queues = {}
        in_sections: set[str] = set()
        for s in state:
            subs = [(str(t), str(a)) for t, a in s["subscriptions"]]
            tree = s["tree"]
            self.queues[s["name"]] = CqsQueue(
                s["name"], subs, SlaQueue.from_state(tree), s["prefetch"]
            )
            if tree["pending"] or tree["in_flight"]:
                in_sections.add(s["name"])
        if rows is not None:
            self._load_rows(rows)
        for q in self.queues.values():
            self._give_table(q, write=not q.table_id or q.name in in_sections)
        self._reindex()

    def _load_rows(self, rows: Iterator[tuple[bytes, bytes]]) -> None:
        """The `cqs` table into the queues the sections named: a header row
        (the queue's 4-byte key, its name) before each queue's rows."""
        row = next(rows, None)
        while row is not None:
            key, value = row
            if len(key) != 4:
                raise DamagedRow(f"a cqs row {key.hex()} of no queue")
            name = text(value)
            q = self.queues.get(name)
            if q is None or q.table_id:
                raise DamagedRow(
                    f"the cqs table has rows of queue {name!r}, which the sections "
                    + ("name twice" if q is not None else "do not have")
                )
            q.table_id = int.from_bytes(key, "big")
            self._next_table_id = max(self._next_table_id, q.table_id + 1)
            after: list[tuple[bytes, bytes]] = []  # the first row past this queue's

            def mine(
                table: bytes = key, after: list[tuple[bytes, bytes]] = after
            ) -> Iterator[tuple[bytes, bytes]]:
                for k, v in rows:
                    if not k.startswith(table) or len(k) == 4:
                        after.append((k, v))
                        return
                    yield k[4:], v

            q.tree.load_rows(mine())
            row = after[0] if after else None


def sections_with_rows(
    sections: list[dict[str, Any]], rows: Iterable[tuple[bytes, bytes]]
) -> list[dict[str, Any]]:
    """`CqsState.export_sections` (as a backend's sections hold it) and the
    `cqs` table's rows, in key order, as `export_state` gives them: what a
    snapshot of the whole state needs. Pure data, for a thread holding a read
    transaction."""
    found: dict[str, tuple[list[Any], list[Any]]] = {}
    table = b""
    into: tuple[list[Any], list[Any]] | None = None
    for key, value in rows:
        if len(key) == 4:
            table = key
            into = found.setdefault(text(value), ([], []))
        elif into is not None and key.startswith(table):
            row, token, visible_at = decode_row(key[4:], value)
            if token:
                into[1].append((token, visible_at, *row))
            else:
                into[0].append(row)
        else:
            raise DamagedRow(f"a cqs row {key.hex()} of no queue")
    out = []  # sections written before the table was used hold their notifications
    for s in sections:
        pending, in_flight = found.pop(s["name"], ([], []))
        tree = s["tree"]
        out.append(
            dict(
                s,
                tree=dict(
                    tree,
                    pending=[*tree["pending"], *pending],
                    in_flight=[*tree["in_flight"], *in_flight],
                ),
            )
        )
    if found:
        raise DamagedRow(f"the cqs table has rows of queues the sections do not: {sorted(found)}")
    return out
