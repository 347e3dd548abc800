"""Plain values exchanged between the Raft core, its driver and its peers.

Everything here is an immutable dataclass with slots: log entries, the hard state,
snapshots, membership changes and messages. None of them refers to the core, so a
driver can persist and send them as it likes; the binary encodings below are the
suggested wire and disk format.

Encoding (format version 1, little-endian, fixed-width integers, no pickle)
---------------------------------------------------------------------------
Every top-level encoding starts with one version byte (`FORMAT_VERSION`); a decoder
refuses any other version, a short buffer, trailing bytes and unknown enum values
with `DecodeError`, never with another exception.

- Entry: ``term u64, index u64, kind u8, len u32, data``
- HardState: ``term u64, vote u64, commit u64``
- SnapshotMeta: ``index u64, term u64, n u32, n * voter u64``
- Snapshot: SnapshotMeta, then ``len u64, data``
- Message: ``type u8, flags u8 (bit 0 reject, bit 1 has snapshot), src, dst, term,
  log_term, index, commit, reject_hint (u64 each), len(context) u32, n_entries
  u32``, the context, the entries, then the snapshot if flagged.
- ConfChange (the data of a CONF_CHANGE entry): ``op u8, node_id u64, n u32,
  n * voter u64``, then the context (the rest of the buffer).

A heartbeat is 67 bytes; an entry costs 21 bytes plus its data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeVar

FORMAT_VERSION = 1
"""First byte of every encoding below; bump it when a layout changes."""


class DecodeError(ValueError):
    """Bytes that are not a valid encoding of the requested type and version."""


class EntryKind(IntEnum):
    """What a log entry carries: client data, or a membership change."""

    NORMAL = 0
    CONF_CHANGE = 1


@dataclass(frozen=True, slots=True)
class Entry:
    """One log entry. A leader's first entry of its term is NORMAL with empty data."""

    term: int
    index: int
    kind: EntryKind = EntryKind.NORMAL
    data: bytes = b""

    def to_bytes(self) -> bytes:
        """The versioned encoding of this entry alone (for a driver's log file)."""
        out = bytearray((FORMAT_VERSION,))
        _put_entry(out, self)
        return bytes(out)

    @classmethod
    def from_bytes(cls, buf: bytes) -> Entry:
        """Decode what `to_bytes` produced; `DecodeError` on anything else."""
        r = _Reader(buf)
        r.version()
        e = r.entry()
        r.end()
        return e


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be durable before any message of the same Ready is sent."""

    term: int = 0
    vote: int = 0
    commit: int = 0

    def to_bytes(self) -> bytes:
        """The versioned encoding of this hard state."""
        return bytes((FORMAT_VERSION,)) + _HARD_STATE.pack(self.term, self.vote, self.commit)

    @classmethod
    def from_bytes(cls, buf: bytes) -> HardState:
        """Decode what `to_bytes` produced; `DecodeError` on anything else."""
        r = _Reader(buf)
        r.version()
        term, vote, commit = r.unpack(_HARD_STATE)
        r.end()
        return cls(term, vote, commit)


@dataclass(frozen=True, slots=True)
class SnapshotMeta:
    """Where a snapshot sits in the log, and the voters in effect at that index."""

    index: int
    term: int
    voters: tuple[int, ...]

    def to_bytes(self) -> bytes:
        """The versioned encoding of this metadata."""
        out = bytearray((FORMAT_VERSION,))
        _put_meta(out, self)
        return bytes(out)

    @classmethod
    def from_bytes(cls, buf: bytes) -> SnapshotMeta:
        """Decode what `to_bytes` produced; `DecodeError` on anything else."""
        r = _Reader(buf)
        r.version()
        meta = r.meta()
        r.end()
        return meta


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A state-machine image at `meta.index` (opaque `data`) and its metadata."""

    meta: SnapshotMeta
    data: bytes = b""

    def to_bytes(self) -> bytes:
        """The versioned encoding of this snapshot."""
        out = bytearray((FORMAT_VERSION,))
        _put_snapshot(out, self)
        return bytes(out)

    @classmethod
    def from_bytes(cls, buf: bytes) -> Snapshot:
        """Decode what `to_bytes` produced; `DecodeError` on anything else."""
        r = _Reader(buf)
        r.version()
        snap = r.snapshot()
        r.end()
        return snap


class ConfChangeOp(IntEnum):
    """The membership operations a CONF_CHANGE entry can carry."""

    ADD = 1
    REMOVE = 2
    INIT = 3
    """The bootstrap entry (index 1, term 1) of a node started with its voters."""


@dataclass(frozen=True, slots=True)
class ConfChange:
    """The data of a CONF_CHANGE entry: one server added or removed, or the bootstrap set.

    `context` is opaque to Raft (a driver can put the new member's address there).
    """

    op: ConfChangeOp
    node_id: int = 0
    voters: tuple[int, ...] = ()
    context: bytes = b""

    def to_bytes(self) -> bytes:
        """The versioned encoding, used as the entry's data."""
        out = bytearray((FORMAT_VERSION,))
        out += _CONF.pack(self.op, self.node_id, len(self.voters))
        for v in self.voters:
            out += _U64.pack(v)
        out += self.context
        return bytes(out)

    @classmethod
    def from_bytes(cls, buf: bytes) -> ConfChange:
        """Decode an entry's data; `DecodeError` on anything else."""
        r = _Reader(buf)
        r.version()
        op, node_id, n = r.unpack(_CONF)
        voters = tuple(r.unpack(_U64)[0] for _ in range(n))
        context = r.rest()
        return cls(r.enum(ConfChangeOp, op), node_id, voters, context)

    def apply(self, voters: frozenset[int]) -> frozenset[int]:
        """The voter set after this change, given the set before it."""
        if self.op is ConfChangeOp.ADD:
            return voters | {self.node_id}
        if self.op is ConfChangeOp.REMOVE:
            return voters - {self.node_id}
        return frozenset(self.voters)


class MessageType(IntEnum):
    """Kinds of messages between nodes (numbers are part of the wire format)."""

    VOTE = 1
    VOTE_RESP = 2
    PRE_VOTE = 3
    PRE_VOTE_RESP = 4
    APP = 5
    APP_RESP = 6
    HEARTBEAT = 7
    HEARTBEAT_RESP = 8
    SNAP = 9
    READ_INDEX = 10
    """A follower forwards `read_index(context)` to its leader."""
    READ_INDEX_RESP = 11
    """The leader's answer to READ_INDEX: `index` is the read index."""
    TIMEOUT_NOW = 12
    """Leadership transfer: the leader tells a caught-up voter to campaign now."""


@dataclass(frozen=True, slots=True)
class Message:
    """One message between two nodes. Fields a type does not use stay at their zero.

    - VOTE / PRE_VOTE: `term` is the (prospective) term, `index`/`log_term` the
      candidate's last entry; `context` is ``b"transfer"`` for a transfer campaign.
    - *_RESP to votes: `reject`.
    - APP: `index`/`log_term` are the entry before `entries`, `commit` the leader's.
    - APP_RESP: `index` is the last index known to match; when `reject`, `index` is
      the rejected APP's `index`, `reject_hint` the follower's guess of the last
      matching index and `log_term` its term there (fast backtracking).
    - HEARTBEAT: `commit` (at most the follower's match), `context` for ReadIndex;
      HEARTBEAT_RESP echoes the context.
    - SNAP: `snapshot`.
    - READ_INDEX / READ_INDEX_RESP: `context`, and `index` in the answer.
    """

    type: MessageType
    src: int
    dst: int
    term: int = 0
    log_term: int = 0
    index: int = 0
    entries: tuple[Entry, ...] = field(default=())
    commit: int = 0
    reject: bool = False
    reject_hint: int = 0
    snapshot: Snapshot | None = None
    context: bytes = b""

    def to_bytes(self) -> bytes:
        """The versioned wire encoding (see the module docstring)."""
        flags = (1 if self.reject else 0) | (2 if self.snapshot is not None else 0)
        out = bytearray((FORMAT_VERSION,))
        out += _MSG_HEADER.pack(
            self.type,
            flags,
            self.src,
            self.dst,
            self.term,
            self.log_term,
            self.index,
            self.commit,
            self.reject_hint,
            len(self.context),
            len(self.entries),
        )
        out += self.context
        for e in self.entries:
            _put_entry(out, e)
        if self.snapshot is not None:
            _put_snapshot(out, self.snapshot)
        return bytes(out)

    @classmethod
    def from_bytes(cls, buf: bytes) -> Message:
        """Decode what `to_bytes` produced; `DecodeError` on anything else."""
        buf = bytes(buf)
        if len(buf) < 1 + _MSG_HEADER.size:
            raise DecodeError("truncated buffer")
        if buf[0] != FORMAT_VERSION:
            raise DecodeError(f"unsupported format version {buf[0]}")
        (mtype, flags, src, dst, term, log_term, index, commit, hint, nctx, nents) = (
            _MSG_HEADER.unpack_from(buf, 1)
        )
        kind = _MESSAGE_TYPES.get(mtype)
        if kind is None:
            raise DecodeError(f"unknown MessageType {mtype}")
        if flags & ~3:
            raise DecodeError(f"unknown message flags {flags:#x}")
        pos = 1 + _MSG_HEADER.size
        context = buf[pos : pos + nctx]
        if len(context) != nctx:
            raise DecodeError("truncated buffer")
        snapshot = None
        entries: tuple[Entry, ...] = ()
        if nents or flags & 2:
            r = _Reader(buf)
            r.pos = pos + nctx
            entries = tuple(r.entry() for _ in range(nents))
            snapshot = r.snapshot() if flags & 2 else None
            pos = r.pos
        else:
            pos += nctx
        if pos != len(buf):
            raise DecodeError(f"{len(buf) - pos} trailing bytes")
        return cls(
            kind,
            src,
            dst,
            term,
            log_term,
            index,
            entries,
            commit,
            bool(flags & 1),
            hint,
            snapshot,
            context,
        )


_E = TypeVar("_E", bound=IntEnum)

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_ENTRY = struct.Struct("<QQBI")
_HARD_STATE = struct.Struct("<QQQ")
_META = struct.Struct("<QQI")
_CONF = struct.Struct("<BQI")
_MSG_HEADER = struct.Struct("<BBQQQQQQQII")


_MESSAGE_TYPES = {t.value: t for t in MessageType}


def _put_entry(out: bytearray, e: Entry) -> None:
    out += _ENTRY.pack(e.term, e.index, e.kind, len(e.data))
    out += e.data


def _put_meta(out: bytearray, meta: SnapshotMeta) -> None:
    out += _META.pack(meta.index, meta.term, len(meta.voters))
    for v in meta.voters:
        out += _U64.pack(v)


def _put_snapshot(out: bytearray, snap: Snapshot) -> None:
    _put_meta(out, snap.meta)
    out += _U64.pack(len(snap.data))
    out += snap.data


class _Reader:
    """A cursor over a buffer that turns every malformation into `DecodeError`."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = bytes(buf)
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise DecodeError("truncated buffer")
        chunk = self.buf[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, st: struct.Struct) -> tuple[int, ...]:
        if self.pos + st.size > len(self.buf):
            raise DecodeError("truncated buffer")
        values = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return tuple(values)

    def rest(self) -> bytes:
        chunk = self.buf[self.pos :]
        self.pos = len(self.buf)
        return chunk

    def version(self) -> None:
        (v,) = self.take(1)
        if v != FORMAT_VERSION:
            raise DecodeError(f"unsupported format version {v}")

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise DecodeError(f"{len(self.buf) - self.pos} trailing bytes")

    @staticmethod
    def enum(kind: type[_E], value: int) -> _E:
        try:
            return kind(value)
        except ValueError:
            raise DecodeError(f"unknown {kind.__name__} {value}") from None

    def entry(self) -> Entry:
        term, index, kind, n = self.unpack(_ENTRY)
        return Entry(term, index, self.enum(EntryKind, kind), self.take(n))

    def meta(self) -> SnapshotMeta:
        index, term, n = self.unpack(_META)
        if n * 8 > len(self.buf) - self.pos:
            raise DecodeError("truncated buffer")
        return SnapshotMeta(index, term, tuple(self.unpack(_U64)[0] for _ in range(n)))

    def snapshot(self) -> Snapshot:
        meta = self.meta()
        (n,) = self.unpack(_U64)
        return Snapshot(meta, self.take(n))
