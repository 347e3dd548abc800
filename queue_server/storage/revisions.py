"""How a key revision is named, everywhere it is kept: the in-memory index, the
backend's `key` db, snapshots and HashKV.

A change's position is one integer, `revision << SUB_BITS | sub`: `sub` numbers
the changes inside one write transaction (etcd's sub-revision), so a delete of
many keys in one revision still orders its events as they were made. In the
backend a position is etcd's 17-byte revision key (`revision_key`), 18 with the
tombstone mark. Pure functions and one Protocol: nothing here does I/O.
"""

from __future__ import annotations

import struct
import zlib
from typing import Protocol

SUB_BITS = 32
"""Bits of a position that hold the sub-revision."""
SUB_MASK = (1 << SUB_BITS) - 1
_U64 = struct.Struct(">Q")


class KeyValueFields(Protocol):
    """One key revision, as the index hands it to the backend and the backend
    hands it back (mvcc.store.KeyValue, or mvccpb.KeyValue itself)."""

    key: bytes
    create_revision: int
    mod_revision: int
    version: int
    value: bytes
    lease: int


def position(revision: int, sub: int = SUB_MASK) -> int:
    """The position of change `sub` of `revision` (default: its last)."""
    return (revision << SUB_BITS) | sub


def revision_key(pos: int, tombstone: bool) -> bytes:
    """etcd's `key`-db key of the change at `pos` (mvcc revToBytes, `t` for a
    tombstone)."""
    key = _U64.pack(pos >> SUB_BITS) + b"_" + _U64.pack(pos & SUB_MASK)
    return key + b"t" if tombstone else key


def position_of(revision_key_bytes: bytes) -> tuple[int, bool]:
    """The position and tombstone flag of a `key`-db key."""
    main = _U64.unpack_from(revision_key_bytes, 0)[0]
    sub = _U64.unpack_from(revision_key_bytes, 9)[0]
    return main << SUB_BITS | sub, len(revision_key_bytes) == 18


def hash_change(h: int, key: bytes, code: int, value: bytes | None) -> int:
    """The HashKV checksum `h` extended by one change (`value` None: a tombstone).
    `code` is the index's entry code, `position << 1 | tombstone`."""
    h = zlib.crc32(key, h)
    h = zlib.crc32((code >> 1).to_bytes(12, "big"), h)
    return zlib.crc32(b"\x00" if value is None else b"\x01" + value, h)
