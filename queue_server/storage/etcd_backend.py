"""etcd's backend database (its `snapshot.db`): our state to etcd's buckets and back.

This module owns what etcd 3.4/3.5 keep in their bbolt file and how our state
maps to it; `storage/bbolt.py` owns the file's bytes, `storage/snapshot.py` our
own QSNAP2 format. It imports those two, the generated messages and the
revision layout (`storage/revisions.py`), nothing else of the server.

etcd's buckets, as etcd 3.4.23 writes them (read back from a real
`etcdctl snapshot save` in tests/compat/test_etcd_snapshot.py):

| bucket | key -> value |
|---|---|
| `key` | revision: main u64 BE, `_`, sub u64 BE, and `t` for a tombstone -> mvccpb.KeyValue (a tombstone's holds only the key) |
| `meta` | `consistent_index` -> u64 BE; `finishedCompactRev`, `scheduledCompactRev` -> a revision key |
| `lease` | lease id u64 BE -> leasepb.Lease {ID, TTL} |
| `alarm` | etcdserverpb.AlarmMember -> empty |
| `auth` | `authEnabled` -> 0/1 byte, `authRevision` -> u64 BE |
| `authUsers`, `authRoles` | name -> authpb.User / authpb.Role |
| `members`, `members_removed` | member id, 16 hex digits -> JSON {id, peerURLs, name, clientURLs} |
| `cluster` | `clusterVersion` -> "3.5.0" |

Ours: bucket `queue-server` holds, under `qsnap2/<8 digits>` in chunks of
`CHUNK_BYTES`, a QSNAP2 snapshot of the whole state except the key histories
(the MVCC record keeps our revision and compact revision): queues, CQS,
leases, members, alarms and auth exactly. etcd ignores buckets it does not
know; we read it back, and without it (a real etcd file) build the state from
etcd's buckets alone.

Memory: writing holds our exported state (the caller's), one merge cursor per
key (the `key` bucket is in revision order, our histories in key order) and
one page; the QSNAP2 part goes through a temporary file. Reading builds the
state in memory, as restoring any snapshot does.
"""

from __future__ import annotations

import heapq
import io
import json
import struct
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO, Any

from google.protobuf.message import DecodeError

from etcdserverpb import auth_pb2, kv_pb2, rpc_pb2
from queue_server.storage import snapshot
from queue_server.storage.bbolt import BoltFormatError, BoltReader, BoltWriter
from queue_server.storage.revisions import SUB_BITS, SUB_MASK, position, revision_key
from queue_server.storage.snapshot_codec import (
    NEVER_COMPACTED,
    STATE_FORMAT,
    SnapshotContents,
    SnapshotFormatError,
)

__all__ = ["CLUSTER_VERSION", "OUR_BUCKET", "read_etcd_db", "write_etcd_db"]

OUR_BUCKET = b"queue-server"
OUR_CHUNK_PREFIX = b"qsnap2/"
CHUNK_BYTES = 1 << 20
"""Bytes of our QSNAP2 snapshot per value in our bucket: a value is written as
one (overflow) page run, so chunks keep the pages built at a time small."""

CLUSTER_VERSION = b"3.5.0"
"""The cluster version we say we are in the `cluster` bucket: our API is 3.5's."""

_REV = struct.Struct(">Q")


def parse_revision_key(raw: bytes) -> tuple[int, int, bool]:
    """(main, sub, tombstone) of a key-bucket key."""
    if len(raw) not in (17, 18) or raw[8:9] != b"_" or (len(raw) == 18 and raw[17:] != b"t"):
        raise SnapshotFormatError(f"{raw!r} is not an etcd revision key")
    return _REV.unpack_from(raw)[0], _REV.unpack_from(raw, 9)[0], len(raw) == 18


# -- leasepb.Lease, by hand: three int64 fields ------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf sends it
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_lease(lease_id: int, ttl: int) -> bytes:
    """leasepb.Lease{ID, TTL} (RemainingTTL, 3.5's checkpoint, left zero)."""
    return b"\x08" + _varint(lease_id) + b"\x10" + _varint(ttl)


def decode_lease(raw: bytes) -> tuple[int, int]:
    """(ID, TTL) of a leasepb.Lease; other fields (RemainingTTL) are skipped."""
    fields: dict[int, int] = {}
    at = 0
    while at < len(raw):
        tag, at = _read_varint(raw, at)
        if tag & 7 != 0:
            raise SnapshotFormatError(f"lease field {tag >> 3} is not a varint")
        value, at = _read_varint(raw, at)
        fields[tag >> 3] = value - (1 << 64) if value >> 63 else value
    return fields.get(1, 0), fields.get(2, 0)


def _read_varint(raw: bytes, at: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if at >= len(raw) or shift > 63:
            raise SnapshotFormatError("a truncated or overlong varint in a lease")
        b = raw[at]
        at += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, at


# -- writing ---------------------------------------------------------------------------


def _key_bucket(keys: list[tuple[bytes, list[int], list[Any]]]) -> Iterator[tuple[bytes, bytes]]:
    """The key bucket's items in revision order, merged from per-key histories."""

    def history(
        key: bytes, positions: list[int], changes: list[Any]
    ) -> Iterator[tuple[int, bytes, Any]]:
        for pos, change in zip(positions, changes, strict=True):
            yield pos, key, change

    for pos, key, change in heapq.merge(*(history(*k) for k in keys), key=lambda c: c[0]):
        if change is None:
            yield revision_key(pos, True), kv_pb2.KeyValue(key=key).SerializeToString()
        else:
            create, mod, version, value, lease = change
            kv = kv_pb2.KeyValue(
                key=key,
                create_revision=create,
                mod_revision=mod,
                version=version,
                value=value,
                lease=lease,
            )
            yield revision_key(pos, False), kv.SerializeToString()


def _member_items(members: dict[int, Any]) -> list[tuple[bytes, bytes]]:
    items = []
    for member_id, (name, peer_urls, client_urls) in sorted(members.items()):
        doc = {"id": member_id, "peerURLs": list(peer_urls), "name": name}
        if client_urls:
            doc["clientURLs"] = list(client_urls)
        items.append(
            (f"{member_id:016x}".encode(), json.dumps(doc, separators=(",", ":")).encode())
        )
    return items


def _auth_buckets(auth: dict[str, Any]) -> dict[bytes, list[tuple[bytes, bytes]]]:
    users = []
    for name, password, roles, no_password, _ in sorted(auth["users"]):
        user = auth_pb2.User(name=name.encode(), password=password, roles=sorted(roles))
        user.options.no_password = bool(no_password)
        users.append((name.encode(), user.SerializeToString()))
    roles = []
    for name, perms in sorted(auth["roles"].items()):
        role = auth_pb2.Role(name=name.encode())
        for key, range_end, perm_type in perms:
            role.keyPermission.add(permType=perm_type, key=key, range_end=range_end)
        roles.append((name.encode(), role.SerializeToString()))
    flag = b"\x01" if auth["enabled"] else b"\x00"
    return {
        b"auth": [(b"authEnabled", flag), (b"authRevision", _REV.pack(auth["revision"]))],
        b"authUsers": users,
        b"authRoles": roles,
    }


def _our_chunks(
    state: dict[str, Any], index: int, raft_term: int, voters: tuple[int, ...]
) -> Iterator[tuple[bytes, bytes]]:
    """Our bucket: the state without key histories, as QSNAP2, in chunks."""
    revision, compact_revision, _ = state["mvcc"]
    rest = dict(state, mvcc=(revision, compact_revision, []))
    with tempfile.TemporaryFile() as spool:
        snapshot.write_snapshot(spool, index, rest, raft_term=raft_term, voters=voters)
        spool.seek(0)
        n = 0
        while chunk := spool.read(CHUNK_BYTES):
            yield OUR_CHUNK_PREFIX + f"{n:08d}".encode(), chunk
            n += 1


def write_etcd_db(
    fileobj: IO[bytes],
    index: int,
    state: dict[str, Any],
    *,
    raft_term: int = 0,
    voters: tuple[int, ...] = (),
    key_items: Iterable[tuple[bytes, bytes]] | None = None,
) -> int:
    """Write `state` (an `export_state()` at applied index `index`) to the
    empty, seekable `fileobj` as an etcd backend database; returns its size.
    `key_items`, when given, is the `key` bucket itself in revision order
    (the LMDB backend's `key` db, which has etcd's layout), and the state's own
    key histories are not used."""
    _, compact_revision, keys = state["mvcc"]  # etcd derives its revision from the keys
    writer = BoltWriter(fileobj)
    writer.bucket(b"key", _key_bucket(keys) if key_items is None else key_items)
    meta = [(b"consistent_index", _REV.pack(index))]
    if compact_revision != NEVER_COMPACTED:
        rev = revision_key(position(compact_revision, 0), False)
        meta += [(b"finishedCompactRev", rev), (b"scheduledCompactRev", rev)]
    writer.bucket(b"meta", meta)
    writer.bucket(
        b"lease",
        sorted(
            (_REV.pack(i & ((1 << 64) - 1)), encode_lease(i, ttl)) for i, ttl in state["leases"]
        ),
    )
    alarms = [
        (rpc_pb2.AlarmMember(memberID=m, alarm=a).SerializeToString(), b"")
        for m, a in state["alarms"]
    ]
    writer.bucket(b"alarm", sorted(alarms))
    for name, items in _auth_buckets(state["auth"]).items():
        writer.bucket(name, items)
    writer.bucket(b"members", _member_items(state["members"]))
    writer.bucket(b"members_removed", [])
    writer.bucket(b"cluster", [(b"clusterVersion", CLUSTER_VERSION)])
    writer.bucket(OUR_BUCKET, _our_chunks(state, index, raft_term, voters))
    return writer.finish()


# -- reading ---------------------------------------------------------------------------


def is_bbolt(head: bytes) -> bool:
    """Whether a file starting with `head` (its first page) looks like bbolt:
    page 0 is a meta page with bbolt's magic."""
    return len(head) >= 24 and head[16:20] == b"\xed\xda\x0c\xed"


def read_etcd_db(data: bytes | memoryview, name: str) -> SnapshotContents:
    """The state in an etcd backend database: ours exactly if our bucket is
    there, else built from etcd's buckets (see docs/compatibility.md for what
    is taken and what is left). Refuses damage as SnapshotFormatError."""
    try:
        reader = BoltReader(data)
        ours = _read_ours(reader, name)
        keys, top = _read_keys(reader)
        compact = NEVER_COMPACTED
        finished = reader.get(b"meta", b"finishedCompactRev")
        if finished is not None:
            compact = parse_revision_key(finished)[0]
        index_raw = reader.get(b"meta", b"consistent_index")
        index = _REV.unpack(index_raw)[0] if index_raw is not None and len(index_raw) == 8 else 0
        if ours is not None:
            state = ours.state
            revision, our_compact, _ = state["mvcc"]
            state["mvcc"] = (max(revision, top, compact), max(our_compact, compact), keys)
            return SnapshotContents(ours.index, state, ours.raft_term, ours.voters)
        leases = [decode_lease(v) for _, v in reader.items(b"lease")]
        state = {
            "format": STATE_FORMAT,
            "applied_index": index,
            "mvcc": (max(top, compact, 0), compact, keys),
            "leases": leases,
            "alarms": [],
            "queues": [],
            "cqs": [],
            "members": {},
            "auth": _read_auth(reader),
        }
        return SnapshotContents(index, state)
    except (BoltFormatError, DecodeError, UnicodeDecodeError, struct.error) as e:
        raise SnapshotFormatError(f"{name}: {e}") from None


def _read_ours(reader: BoltReader, name: str) -> SnapshotContents | None:
    chunks = list(reader.items(OUR_BUCKET))
    if not chunks:
        return None
    expected = [OUR_CHUNK_PREFIX + f"{n:08d}".encode() for n in range(len(chunks))]
    if [k for k, _ in chunks] != expected:
        raise SnapshotFormatError(f"bucket {OUR_BUCKET!r} holds keys other than its chunks")
    spool = io.BytesIO(b"".join(v for _, v in chunks))
    return snapshot.read_snapshot(spool, f"{name} (bucket {OUR_BUCKET.decode()})")


def _read_keys(reader: BoltReader) -> tuple[list[tuple[bytes, list[int], list[Any]]], int]:
    """Key histories (in key order) from the key bucket, and its top revision."""
    histories: dict[bytes, tuple[list[int], list[Any]]] = {}
    top = 0
    for raw, value in reader.items(b"key"):
        main, sub, tombstone = parse_revision_key(raw)
        if sub > SUB_MASK:
            raise SnapshotFormatError(f"sub revision {sub} out of range")
        kv = kv_pb2.KeyValue.FromString(value)
        if not kv.key:
            raise SnapshotFormatError(f"revision {main}.{sub} has no key")
        positions, changes = histories.setdefault(kv.key, ([], []))
        positions.append(main << SUB_BITS | sub)
        if tombstone:
            changes.append(None)
        else:
            changes.append((kv.create_revision, kv.mod_revision, kv.version, kv.value, kv.lease))
        top = main
    return [(k, *histories[k]) for k in sorted(histories)], top


def _read_auth(reader: BoltReader) -> dict[str, Any]:
    enabled = reader.get(b"auth", b"authEnabled") == b"\x01"
    revision_raw = reader.get(b"auth", b"authRevision")
    revision = _REV.unpack(revision_raw)[0] if revision_raw and len(revision_raw) == 8 else 0
    users = []
    for _, raw in reader.items(b"authUsers"):
        u = auth_pb2.User.FromString(raw)
        users.append((u.name.decode(), u.password, sorted(set(u.roles)), u.options.no_password, 0))
    roles = {}
    for _, raw in reader.items(b"authRoles"):
        r = auth_pb2.Role.FromString(raw)
        roles[r.name.decode()] = [(p.key, p.range_end, p.permType) for p in r.keyPermission]
    return {
        "enabled": enabled,
        "revision": revision,
        "enable_revision": revision if enabled else 0,
        "users": users,
        "roles": roles,
    }
