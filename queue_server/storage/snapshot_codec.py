"""The records of a snapshot: `StateMachine.export_state()` to protobuf and back.

This module owns the mapping, field by field, between the state machine's
exported state (plain data: the layout `STATE_FORMAT` names) and the
messages of `etcdserverpb/snapshot.proto`, and every check a record read back
must pass before it becomes state. It does no I/O and knows nothing of files:
`storage/snapshot.py` frames the records, checksums them and reads them back.
It imports the generated messages and the revision layout
(`storage/revisions.py`), nothing else of the server.

Theory of operation. `encode_records` walks an exported state once and yields
the records in file order: the header (with how many of each item follow), the
store's revisions, its key histories in chunks of about `CHUNK_BYTES`, then
leases, alarms, queues (each followed by its messages' produce times in
chunks), CQS queues (each followed by its notifications in chunks), members
and auth. Only one chunk's messages exist at a time, so writing
never holds a second copy of the state.

`StateReader` is fed the records one at a time, in file order, and builds the
state in `export_state()`'s exact shapes (tuples where it has tuples), so
`restore_state` takes it as it is and a round trip compares equal. Everything
a record can get wrong is refused with `SnapshotFormatError`: another format
version, records out of order or repeated, fields this version does not know,
keys out of order, history positions that do not increase, duplicates where the
state has a dict or a set, and counts that differ from the header's. The types
of the fields are the schema's: protobuf parsing checks them, and a field sent
with another wire type is an unknown field, refused as such.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from etcdserverpb import kv_pb2
from etcdserverpb import snapshot_pb2 as pb
from queue_server.storage.revisions import SUB_BITS, SUB_MASK

STATE_FORMAT = 1
"""Version of `StateMachine.export_state`'s layout, which this module maps and
`apply.py` writes; bump it when the layout changes."""

FORMAT_VERSION = 1
"""Version of the records' schema. Bump it (and keep a reader for the old one)
when the meaning of a field changes; a reader refuses versions it does not know."""

CHUNK_BYTES = 1 << 20
"""Target size of one chunk record. Small enough that writing or reading holds
only about a MiB besides the state itself, large enough that per-record costs
(framing, one protobuf parse) are noise. A record exceeds it by at most one item."""

PRODUCED_PER_CHUNK = 1 << 17
"""Produce times in one QueueChunk: a few bytes each (delta-encoded), at most 20,
so a chunk stays within a few MiB however long the queue."""

ITEM_BYTES = 32
"""What one item costs in a chunk besides its bytes fields, for the size estimate
(a few varints and tags; the estimate only needs to be within a small factor)."""

NEVER_COMPACTED = -1
"""`MVCCStore.compact_revision` of a store never compacted."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RawRevisions:
    """Key histories as etcd's `key` bucket holds them, for `encode_records` in
    the place of the per-key lists: `items` yields (revision key, KeyValue bytes)
    in revision order (a backend read transaction's `key` db) and `key_count` is
    how many distinct keys they hold (the header's count)."""

    key_count: int
    items: Iterable[tuple[bytes, bytes]]

    def __len__(self) -> int:
        return self.key_count


class SnapshotFormatError(ValueError):
    """A record is not what this version of the format allows."""


@dataclass(frozen=True, slots=True)
class SnapshotContents:
    """A decoded snapshot: its applied index, the state for `restore_state`,
    and the raft position it stands for (0 and () on a single node)."""

    index: int
    state: dict[str, Any]
    raft_term: int = 0
    voters: tuple[int, ...] = ()


# -- encoding ------------------------------------------------------------------------


def encode_records(
    index: int, state: dict[str, Any], raft_term: int, voters: Iterable[int]
) -> Iterator[pb.Record]:
    """The records of `state` (an `export_state()`) at applied index `index`, in
    file order. A state that does not fit the schema is a bug of the caller:
    ValueError or TypeError, loudly."""
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"state format {state.get('format')!r} is not {STATE_FORMAT}")
    if state["applied_index"] != index:
        raise ValueError(f"state applied index {state['applied_index']} is not {index}")
    revision, compact_revision, keys = state["mvcc"]
    yield pb.Record(
        header=pb.Header(
            format_version=FORMAT_VERSION,
            applied_index=index,
            raft_term=raft_term,
            voters=list(voters),
            key_count=len(keys),
            lease_count=len(state["leases"]),
            alarm_count=len(state["alarms"]),
            queue_count=len(state["queues"]),
            cqs_queue_count=len(state["cqs"]),
            member_count=len(state["members"]),
        )
    )
    yield pb.Record(mvcc=pb.Mvcc(revision=revision, compact_revision=compact_revision))
    if isinstance(keys, RawRevisions):
        yield from _revision_chunks(keys.items)
    else:
        yield from _key_chunks(keys)
    for leases in _chunks(state["leases"], lambda _: ITEM_BYTES):
        yield pb.Record(
            leases=pb.LeaseChunk(leases=[pb.Lease(lease_id=i, ttl=t) for i, t in leases])
        )
    for alarms in _chunks(state["alarms"], lambda _: ITEM_BYTES):
        yield pb.Record(
            alarms=pb.AlarmChunk(alarms=[pb.Alarm(member_id=m, alarm=a) for m, a in alarms])
        )
    for queue in state["queues"]:
        yield pb.Record(queue=_queue(queue))
        produced = queue[4]["produced_ms"]  # (idx, ms), idx ascending
        for at in range(0, len(produced), PRODUCED_PER_CHUNK):
            yield pb.Record(queue_chunk=_produced_chunk(produced[at : at + PRODUCED_PER_CHUNK]))
    for cqs_queue in state["cqs"]:
        yield from _cqs_records(cqs_queue)
    for members in _chunks(state["members"].items(), _member_bytes):
        yield pb.Record(members=pb.MemberChunk(members=[_member(m) for m in members]))
    yield pb.Record(auth=_auth(state["auth"]))


def _chunks(items: Iterable[T], size_of: Callable[[T], int]) -> Iterator[list[T]]:
    """`items` in lists of about `CHUNK_BYTES` each, by `size_of`'s estimate."""
    batch: list[T] = []
    size = 0
    for item in items:
        batch.append(item)
        size += size_of(item)
        if size >= CHUNK_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _key_chunks(keys: list[tuple[bytes, list[int], list[Any]]]) -> Iterator[pb.Record]:
    """Key histories in chunks; a history larger than a chunk is split, its rest
    starting the next chunk under the same key."""
    record = pb.Record()
    size = 0
    for key, positions, changes in keys:
        if not changes or len(positions) != len(changes):
            raise ValueError(f"key {key!r} has {len(positions)} positions, {len(changes)} changes")
        history = None
        for pos, kv in zip(positions, changes, strict=True):
            if size >= CHUNK_BYTES:
                yield record
                record, size, history = pb.Record(), 0, None
            if history is None:
                history = record.keys.keys.add(key=key)
                size += len(key) + ITEM_BYTES
            change = history.changes.add(revision=pos >> SUB_BITS, sub=pos & SUB_MASK)
            if kv is None:
                change.tombstone = True
            else:
                create, mod, version, value, lease = kv
                change.create_revision = create
                change.mod_revision = mod
                change.version = version
                change.value = value
                change.lease = lease
                size += len(value)
            size += ITEM_BYTES
    if size:
        yield record


def _revision_chunks(items: Iterable[tuple[bytes, bytes]]) -> Iterator[pb.Record]:
    record = pb.Record()
    chunk = record.revisions
    size = 0
    for revision_key, value in items:
        chunk.revision_keys.append(revision_key)
        chunk.values.append(value)
        size += len(value) + ITEM_BYTES
        if size >= CHUNK_BYTES:
            yield record
            record, size = pb.Record(), 0
            chunk = record.revisions
    if size:
        yield record


def _queue(queue: tuple[Any, ...]) -> pb.Queue:
    name, spelling, next_idx, attempts, assignment = queue
    return pb.Queue(
        name=name,
        spelling=spelling,
        next_idx=next_idx,
        attempts=[pb.Attempt(idx=i, count=n) for i, n in attempts.items()],
        next_consumer=assignment["next_consumer"],
        consumers=[
            pb.Consumer(consumer_id=c, node=node, held=held)
            for c, node, held in assignment["consumers"]
        ],
        produced_count=len(assignment["produced_ms"]),
    )


def _produced_chunk(produced: list[tuple[int, int]]) -> pb.QueueChunk:
    return pb.QueueChunk(
        produced_idx_delta=_deltas([idx for idx, _ in produced]),
        produced_ms_delta=_deltas([ms for _, ms in produced]),
    )


def _deltas(values: list[int]) -> list[int]:
    """The first value, then each one's difference to the one before."""
    return [b - a for a, b in zip([0, *values], values, strict=False)]


def _notification(row: tuple[Any, ...]) -> pb.Notification:
    dto_type, dto_id, is_parent, alias, sla_us, tracking_id, seq = row
    return pb.Notification(
        dto_type=dto_type,
        dto_id=dto_id,
        is_parent=is_parent,
        alias=alias,
        sla_us=sla_us,
        tracking_id=tracking_id,
        seq=seq,
    )


def _notification_bytes(row: tuple[Any, ...]) -> int:
    return len(row[0]) + len(row[1]) + len(row[3]) + len(row[5]) + ITEM_BYTES


def _whole(value: float) -> int:
    """A visibility time as the integer it is (the commands' clock is Unix ms)."""
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"visibility time {value!r} is not a whole number of ms")
        return int(value)
    return value


def _cqs_records(queue: dict[str, Any]) -> Iterator[pb.Record]:
    """A CQS queue's settings, then its pending and in-flight notifications."""
    tree = queue["tree"]
    yield pb.Record(
        cqs_queue=pb.CqsQueue(
            name=queue["name"],
            subscriptions=[
                pb.Subscription(dto_type=t, alias_name=a) for t, a in queue["subscriptions"]
            ],
            prefetch=queue["prefetch"],
            depth=tree["depth"],
            seq=tree["seq"],
            pending_count=len(tree["pending"]),
            in_flight_count=len(tree["in_flight"]),
        )
    )
    for rows in _chunks(tree["pending"], _notification_bytes):
        yield pb.Record(cqs_chunk=pb.CqsChunk(pending=[_notification(r) for r in rows]))
    for rows in _chunks(tree["in_flight"], lambda r: len(r[0]) + _notification_bytes(r[2:])):
        yield pb.Record(
            cqs_chunk=pb.CqsChunk(
                in_flight=[
                    pb.InFlight(
                        token=r[0], visible_at=_whole(r[1]), notification=_notification(r[2:])
                    )
                    for r in rows
                ]
            )
        )


def _member_bytes(item: tuple[int, tuple[str, tuple[str, ...], tuple[str, ...]]]) -> int:
    name, peers, clients = item[1]
    return len(name) + sum(map(len, peers)) + sum(map(len, clients)) + ITEM_BYTES


def _member(item: tuple[int, tuple[str, tuple[str, ...], tuple[str, ...]]]) -> pb.Member:
    member_id, (name, peers, clients) = item
    return pb.Member(id=member_id, name=name, peer_urls=peers, client_urls=clients)


def _auth(auth: dict[str, Any]) -> pb.Auth:
    return pb.Auth(
        enabled=auth["enabled"],
        revision=auth["revision"],
        enable_revision=auth["enable_revision"],
        users=[
            pb.User(
                name=name,
                password=password,
                roles=roles,
                no_password=no_password,
                credential_revision=credential_revision,
            )
            for name, password, roles, no_password, credential_revision in auth["users"]
        ],
        roles=[
            pb.Role(
                name=name,
                permissions=[
                    pb.Permission(key=k, range_end=end, perm_type=t) for k, end, t in perms
                ],
            )
            for name, perms in auth["roles"].items()
        ],
    )


# -- decoding ------------------------------------------------------------------------


def parse_record(raw: bytes) -> pb.Record:
    """One record's bytes as a message, refusing fields this version does not
    know. Our writer's encoding is canonical, so a record that does not
    re-encode to its own length carried something else (unknown fields, a field
    with another wire type, a field given twice)."""
    record = pb.Record()
    try:
        record.ParseFromString(raw)
    except DecodeError as e:
        raise SnapshotFormatError(f"a record does not parse ({e})") from None
    record.DiscardUnknownFields()
    if record.ByteSize() != len(raw):
        raise SnapshotFormatError("a record holds fields this format version does not know")
    if record.WhichOneof("body") is None:
        raise SnapshotFormatError("a record has no body")
    return record


_CHUNK_OF = {"cqs_chunk": "cqs_queue", "queue_chunk": "queue", "revisions": "keys"}
_RANKS = {
    f.name: pb.Record.DESCRIPTOR.fields_by_name[_CHUNK_OF.get(f.name, f.name)].number
    for f in pb.Record.DESCRIPTOR.fields
}
"""A record kind's place in the file: its field number; a queue and its chunks
share one place, since they alternate."""

_SINGLE = frozenset({"header", "mvcc", "auth"})
"""Kinds that appear exactly once."""


class StateReader:
    """Builds a state from records fed in file order (`add`), then `finish`."""

    def __init__(self) -> None:
        self._rank = 0  # the place of the last record
        self._header: pb.Header | None = None
        self._mvcc: tuple[int, int] | None = None
        self._keys: list[tuple[bytes, list[int], list[Any]]] = []
        # key -> (positions, changes), from RevisionChunks (in revision order)
        self._by_key: dict[bytes, tuple[list[int], list[Any]]] = {}
        self._last_position = 0
        self._leases: list[tuple[int, int]] = []
        self._lease_ids: set[int] = set()
        self._alarms: list[tuple[int, int]] = []
        self._queues: list[tuple[Any, ...]] = []
        self._queue_names: set[bytes] = set()
        self._produced_counts: list[int] = []  # produce times each queue announced
        self._cqs: list[dict[str, Any]] = []
        self._cqs_names: set[str] = set()
        self._tokens: set[str] = set()  # in-flight ack tokens of the last CQS queue
        self._cqs_counts: list[tuple[int, int]] = []  # (pending, in flight) each announced
        self._members: dict[int, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}
        self._auth: dict[str, Any] | None = None
        self._add: dict[str, Callable[[Any], None]] = {
            "header": self._add_header,
            "mvcc": self._add_mvcc,
            "keys": self._add_keys,
            "revisions": self._add_revisions,
            "leases": self._add_leases,
            "alarms": self._add_alarms,
            "queue": self._add_queue,
            "queue_chunk": self._add_queue_chunk,
            "cqs_queue": self._add_cqs_queue,
            "cqs_chunk": self._add_cqs_chunk,
            "members": self._add_members,
            "auth": self._add_auth,
        }

    def add(self, record: pb.Record) -> None:
        kind = record.WhichOneof("body")
        if kind is None:
            raise SnapshotFormatError("a record has no body")
        rank = _RANKS[kind]
        if rank < self._rank or (kind in _SINGLE and rank == self._rank):
            raise SnapshotFormatError(f"a {kind} record out of order")
        if self._header is None and kind != "header":
            raise SnapshotFormatError(f"the first record is {kind}, not the header")
        if self._mvcc is None and kind not in ("header", "mvcc"):
            raise SnapshotFormatError(f"a {kind} record before the mvcc record")
        if kind == "cqs_chunk" and not self._cqs:
            raise SnapshotFormatError("CQS notifications before any CQS queue")
        if kind == "queue_chunk" and (not self._queues or self._cqs):
            raise SnapshotFormatError("produce times before any queue")
        self._rank = rank
        self._add[kind](getattr(record, kind))

    def finish(self) -> SnapshotContents:
        """The snapshot, once every record was added."""
        if self._by_key:
            if self._keys:
                raise SnapshotFormatError("both key histories and revisions")
            self._keys = [(k, *history) for k, history in sorted(self._by_key.items())]
            self._by_key = {}
        header = self._header
        if header is None or self._mvcc is None or self._auth is None:
            raise SnapshotFormatError("the header, mvcc or auth record is missing")
        _count("keys", header.key_count, len(self._keys))
        _count("leases", header.lease_count, len(self._leases))
        _count("alarms", header.alarm_count, len(self._alarms))
        _count("queues", header.queue_count, len(self._queues))
        _count("CQS queues", header.cqs_queue_count, len(self._cqs))
        _count("members", header.member_count, len(self._members))
        for etcd_queue, produced in zip(self._queues, self._produced_counts, strict=True):
            found = len(etcd_queue[4]["produced_ms"])
            _count(f"produce times in {etcd_queue[0]!r}", produced, found)
        for queue, (pending, in_flight) in zip(self._cqs, self._cqs_counts, strict=True):
            tree = queue["tree"]
            _count(f"pending in {queue['name']!r}", pending, len(tree["pending"]))
            _count(f"in flight in {queue['name']!r}", in_flight, len(tree["in_flight"]))
        state = {
            "format": STATE_FORMAT,
            "applied_index": header.applied_index,
            "mvcc": (*self._mvcc, self._keys),
            "leases": self._leases,
            "alarms": self._alarms,
            "queues": self._queues,
            "cqs": self._cqs,
            "members": self._members,
            "auth": self._auth,
        }
        return SnapshotContents(header.applied_index, state, header.raft_term, tuple(header.voters))

    # -- one method per record kind ----------------------------------------------------

    def _add_header(self, header: pb.Header) -> None:
        if header.format_version != FORMAT_VERSION:
            raise SnapshotFormatError(
                f"format version {header.format_version} is not {FORMAT_VERSION}"
            )
        self._header = header

    def _add_mvcc(self, mvcc: pb.Mvcc) -> None:
        if not NEVER_COMPACTED <= mvcc.compact_revision <= mvcc.revision:
            raise SnapshotFormatError(
                f"compact revision {mvcc.compact_revision} outside "
                f"{NEVER_COMPACTED}..{mvcc.revision}"
            )
        self._mvcc = (mvcc.revision, mvcc.compact_revision)

    def _add_keys(self, chunk: pb.KeyChunk) -> None:
        assert self._mvcc is not None  # add() saw to it
        top = self._mvcc[0]
        keys = self._keys
        for i, history in enumerate(chunk.keys):
            key = history.key
            if not history.changes:
                raise SnapshotFormatError(f"key {key!r} has no changes")
            if i == 0 and keys and keys[-1][0] == key:  # continues the previous chunk
                _, positions, changes = keys[-1]
            elif not key or (keys and key <= keys[-1][0]):
                raise SnapshotFormatError(f"key {key!r} is empty or out of order")
            else:
                positions, changes = [], []
                keys.append((key, positions, changes))
            last = positions[-1] if positions else 0
            for c in history.changes:
                if not 1 <= c.revision <= top:
                    raise SnapshotFormatError(f"key {key!r} has a change at revision {c.revision}")
                pos = c.revision << SUB_BITS | c.sub
                if pos <= last:
                    raise SnapshotFormatError(f"key {key!r}'s history is out of order")
                last = pos
                positions.append(pos)
                if c.tombstone:
                    if c.create_revision or c.mod_revision or c.version or c.value or c.lease:
                        raise SnapshotFormatError(f"key {key!r} has a tombstone with a value")
                    changes.append(None)
                else:
                    changes.append((c.create_revision, c.mod_revision, c.version, c.value, c.lease))

    def _add_revisions(self, chunk: pb.RevisionChunk) -> None:
        assert self._mvcc is not None  # add() saw to it
        top = self._mvcc[0]
        if len(chunk.revision_keys) != len(chunk.values):
            raise SnapshotFormatError("a revision chunk with keys and values unpaired")
        by_key = self._by_key
        for raw, value in zip(chunk.revision_keys, chunk.values, strict=True):
            if (
                len(raw) not in (17, 18)
                or raw[8:9] != b"_"
                or (len(raw) == 18 and raw[17:] != b"t")
            ):
                raise SnapshotFormatError(f"revision key {raw!r} is not etcd's layout")
            main = int.from_bytes(raw[:8], "big")
            sub = int.from_bytes(raw[9:17], "big")
            if not 1 <= main <= top or sub > SUB_MASK:
                raise SnapshotFormatError(f"a change at revision {main}")
            pos = main << SUB_BITS | sub
            if pos <= self._last_position:
                raise SnapshotFormatError("revisions out of order")
            self._last_position = pos
            try:
                kv = kv_pb2.KeyValue.FromString(value)
            except DecodeError:
                raise SnapshotFormatError(f"revision {main}.{sub} is not a KeyValue") from None
            if not kv.key:
                raise SnapshotFormatError(f"revision {main}.{sub} has no key")
            history = by_key.get(kv.key)
            if history is None:
                history = by_key[kv.key] = ([], [])
            history[0].append(pos)
            if len(raw) == 18:
                history[1].append(None)
            else:
                history[1].append(
                    (kv.create_revision, kv.mod_revision, kv.version, kv.value, kv.lease)
                )

    def _add_leases(self, chunk: pb.LeaseChunk) -> None:
        for lease in chunk.leases:
            if lease.lease_id in self._lease_ids:
                raise SnapshotFormatError(f"lease {lease.lease_id:x} appears twice")
            self._lease_ids.add(lease.lease_id)
            self._leases.append((lease.lease_id, lease.ttl))

    def _add_alarms(self, chunk: pb.AlarmChunk) -> None:
        for alarm in chunk.alarms:
            pair = (alarm.member_id, alarm.alarm)
            if self._alarms and pair <= self._alarms[-1]:
                raise SnapshotFormatError("alarms out of order or repeated")
            self._alarms.append(pair)

    def _add_queue(self, queue: pb.Queue) -> None:
        if queue.name in self._queue_names:
            raise SnapshotFormatError(f"queue {queue.name!r} appears twice")
        self._queue_names.add(queue.name)
        attempts = _unique({a.idx: a.count for a in queue.attempts}, len(queue.attempts))
        consumers = [(c.consumer_id, c.node, list(c.held)) for c in queue.consumers]
        if len({c[0] for c in consumers}) != len(consumers):
            raise SnapshotFormatError(f"queue {queue.name!r} has a consumer twice")
        self._queues.append(
            (
                queue.name,
                queue.spelling,
                queue.next_idx,
                attempts,
                {
                    "next_consumer": queue.next_consumer,
                    "consumers": consumers,
                    "produced_ms": [],
                },
            )
        )
        self._produced_counts.append(queue.produced_count)

    def _add_queue_chunk(self, chunk: pb.QueueChunk) -> None:
        name = self._queues[-1][0]
        idx_deltas, ms_deltas = chunk.produced_idx_delta, chunk.produced_ms_delta
        if len(idx_deltas) != len(ms_deltas):
            raise SnapshotFormatError(
                f"queue {name!r} has {len(idx_deltas)} produce indexes "
                f"and {len(ms_deltas)} produce times"
            )
        produced: list[tuple[int, int]] = self._queues[-1][4]["produced_ms"]
        last = produced[-1][0] if produced else 0
        if idx_deltas and (idx_deltas[0] <= last or 0 in idx_deltas[1:]):
            raise SnapshotFormatError(f"queue {name!r} has produce times out of order")
        produced.extend(zip(accumulate(idx_deltas), accumulate(ms_deltas), strict=True))

    def _add_cqs_queue(self, queue: pb.CqsQueue) -> None:
        if queue.name in self._cqs_names:
            raise SnapshotFormatError(f"CQS queue {queue.name!r} appears twice")
        self._cqs_names.add(queue.name)
        self._tokens = set()
        self._cqs.append(
            {
                "name": queue.name,
                "subscriptions": [(s.dto_type, s.alias_name) for s in queue.subscriptions],
                "prefetch": queue.prefetch,
                "tree": {"depth": queue.depth, "seq": queue.seq, "pending": [], "in_flight": []},
            }
        )
        self._cqs_counts.append((queue.pending_count, queue.in_flight_count))

    def _add_cqs_chunk(self, chunk: pb.CqsChunk) -> None:
        tree = self._cqs[-1]["tree"]
        tree["pending"].extend(_row(n) for n in chunk.pending)
        for f in chunk.in_flight:
            if f.token in self._tokens:
                raise SnapshotFormatError(f"ack token {f.token!r} appears twice")
            self._tokens.add(f.token)
            tree["in_flight"].append((f.token, f.visible_at, *_row(f.notification)))

    def _add_members(self, chunk: pb.MemberChunk) -> None:
        for m in chunk.members:
            if m.id in self._members:
                raise SnapshotFormatError(f"member {m.id:x} appears twice")
            self._members[m.id] = (m.name, tuple(m.peer_urls), tuple(m.client_urls))

    def _add_auth(self, auth: pb.Auth) -> None:
        users = [
            (u.name, u.password, list(u.roles), u.no_password, u.credential_revision)
            for u in auth.users
        ]
        if len({u[0] for u in users}) != len(users):
            raise SnapshotFormatError("a user appears twice")
        roles = _unique(
            {
                r.name: [(p.key, p.range_end, p.perm_type) for p in r.permissions]
                for r in auth.roles
            },
            len(auth.roles),
        )
        self._auth = {
            "enabled": auth.enabled,
            "revision": auth.revision,
            "enable_revision": auth.enable_revision,
            "users": users,
            "roles": roles,
        }


def _row(n: pb.Notification) -> tuple[str, str, bool, str, int, str, int]:
    return (n.dto_type, n.dto_id, n.is_parent, n.alias, n.sla_us, n.tracking_id, n.seq)


def _unique(mapping: dict[Any, Any], items: int) -> dict[Any, Any]:
    """`mapping`, built from `items` pairs, unless a key was given twice."""
    if len(mapping) != items:
        raise SnapshotFormatError("a key appears twice in a map")
    return mapping


def _count(what: str, announced: int, found: int) -> None:
    if announced != found:
        raise SnapshotFormatError(f"the header announces {announced} {what}, {found} follow")
