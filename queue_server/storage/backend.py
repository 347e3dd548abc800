"""The state machine's data on disk: an LMDB environment shaped like etcd's backend.

What belongs here: the file (`<data dir>/member/db/`, an LMDB environment), its
named sub-databases and their byte layouts, the one write transaction per
checkpoint, the read transactions readers use, and copies of the file. It
knows bytes and revisions, not the state machine: a key revision comes in as
anything with `KeyValue`'s six fields and goes out as those fields.

The sub-databases (etcd's bucket names where etcd has the bucket):

| db | key -> value |
|---|---|
| `key` | revision: main u64 BE, `_`, sub u64 BE, and `t` for a tombstone -> mvccpb.KeyValue (a tombstone's holds only the key), exactly etcd's `key` bucket |
| `meta` | `consistent_index` -> u64 BE, the applied log index the file holds everything up to; `raft_snapshot` -> the raft position of the checkpoint a cluster member took as its raft snapshot (bytes its raft storage encodes) |
| `state` | `sections` -> a QSNAP2 image of everything but the key revisions and the tables (leases, alarms, queues, CQS, members, auth, and the store's revision and compaction revision) at `consistent_index` |
| `t:<name>` | a table of a part of the state that keeps its rows here instead of in the sections (`TABLES`: the queues' messages, CQS notifications), written as deltas: row key -> row bytes |

Theory of operation
-------------------
The WAL is the durability; this file is the applied state at some index. A
checkpoint (`commit`) writes, in ONE LMDB write transaction, the key
revisions made since the last one, the revisions compaction dropped, the
sections image and the consistent index, then commits with LMDB's fsync: so
the file is always the whole state at exactly one log index, and a crash at
any moment leaves the previous checkpoint or the new one, never a mix.
Recovery opens the file and replays the WAL after `consistent_index`; the log
may drop segments up to an index only once a checkpoint at or past it has
committed.

The commit runs on the backend's own thread (LMDB lets a write transaction
live on any one thread); the event loop keeps one read transaction
(`reader`), renewed after each commit, and never writes. Other threads open
read transactions of their own (`begin_read`): LMDB's MVCC gives each a fixed
view while commits go on, which is what a snapshot stream or a hash needs.
"""

from __future__ import annotations

import os
import shutil
import struct
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import cast

import lmdb

from etcdserverpb import kv_pb2
from queue_server.storage.mapped_pages import MappedPages
from queue_server.storage.revisions import KeyValueFields, hash_change, position_of, revision_key

__all__ = ["Backend", "CommitBatch"]

_U64 = struct.Struct(">Q")

DEFAULT_MAP_BYTES = 64 << 30
"""The address space LMDB reserves for the file (not disk: the file grows as
pages are used). 64 GiB is eight times etcd's largest recommended quota; on
64-bit machines reserving it costs nothing."""

DB_DIR = os.path.join("member", "db")
"""Where the environment lives in a data dir."""

TABLES = ("cqs", "mq")
"""The row tables parts of the state may keep (see `CommitBatch.tables`)."""

RELEASE_PAGES_FROM_BYTES = 64 << 20
"""A file at least this large has its mapped pages released after each commit
and after a restart's scan (`MappedPages`): below it, what stays mapped is
small and keeping it saves the next reads their page faults."""

_CONSISTENT_INDEX = b"consistent_index"
_SECTIONS = b"sections"
_RAFT_SNAPSHOT = b"raft_snapshot"


def encode_kv(kv: KeyValueFields) -> bytes:
    """mvccpb.KeyValue bytes, as etcd's `key` bucket holds them."""
    return kv_pb2.KeyValue(
        key=kv.key,
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        value=kv.value,
        lease=kv.lease,
    ).SerializeToString()


def encode_tombstone(key: bytes) -> bytes:
    return kv_pb2.KeyValue(key=key).SerializeToString()


@dataclass(slots=True)
class CommitBatch:
    """What one checkpoint writes: the state at log index `index`.

    `writes` maps entry codes (`position << 1 | tombstone`) to the revision's
    fields; `deletes` lists entry codes compaction dropped (a code written in
    this same batch is simply not written); `sections` is the image of the
    rest of the state, or None if it is unchanged since the last checkpoint;
    `tables` maps a table name of `TABLES` to its rows changed since the last
    checkpoint (row key -> bytes, or None: the row is gone).
    """

    index: int
    writes: Mapping[int, KeyValueFields] = field(default_factory=dict)
    deletes: list[int] = field(default_factory=list)
    sections: bytes | None = None
    tables: Mapping[str, Mapping[bytes, bytes | None]] = field(default_factory=dict)
    replace: bool = False
    """Empty the key revisions and tables first: the state was restored from a
    snapshot, and `writes` and `tables` hold all of it."""
    raft_snapshot: bytes | None = None
    """A cluster member's raft position of this checkpoint, when the member
    takes it as its raft snapshot (kept as given, replacing the last one)."""


class Backend:
    """One LMDB environment holding the applied state (see the module docstring).

    Thread rules: `commit`, `copy_compacted` and the `begin_read` readers run on
    any thread, one commit at a time; `reader`, `get_kv` and `renew_reader`
    belong to the event loop.
    """

    def __init__(self, path: str, *, fsync: bool = True, map_bytes: int = DEFAULT_MAP_BYTES):
        self.path = path
        self.fsync = fsync
        self.map_bytes = map_bytes
        os.makedirs(path, exist_ok=True)
        self._open()

    def _open(self) -> None:
        self.env = lmdb.open(
            self.path,
            map_size=self.map_bytes,
            max_dbs=4 + len(TABLES),
            sync=self.fsync,
            metasync=self.fsync,
            readahead=False,
            meminit=False,
        )
        self._key = self.env.open_db(b"key")
        self._meta = self.env.open_db(b"meta")
        self._state = self.env.open_db(b"state")
        self._tables = {name: self.env.open_db(b"t:" + name.encode()) for name in TABLES}
        self.reader = self.env.begin(buffers=False)
        self._in_use = self._measure_in_use()
        self.mapped = MappedPages(os.path.join(self.path, "data.mdb"))

    def release_mapped_pages(self) -> None:
        """Drop the file's pages from this process's resident set if the file is
        large (`RELEASE_PAGES_FROM_BYTES`): after a commit, and after a restart
        has scanned it (any thread)."""
        if self.file_bytes >= RELEASE_PAGES_FROM_BYTES:
            self.mapped.release()

    # -- what the file holds ------------------------------------------------------------

    @property
    def consistent_index(self) -> int:
        """The log index the file holds the state at (0: nothing checkpointed)."""
        raw = self.reader.get(_CONSISTENT_INDEX, db=self._meta)
        return _U64.unpack(raw)[0] if raw is not None else 0

    def sections(self, txn: lmdb.Transaction | None = None) -> bytes | None:
        """The sections image of the last checkpoint, or None before the first."""
        raw = (txn or self.reader).get(_SECTIONS, db=self._state)
        return bytes(raw) if raw is not None else None

    def raft_snapshot(self, txn: lmdb.Transaction | None = None) -> bytes | None:
        """The raft position of the last checkpoint taken as a raft snapshot."""
        raw = (txn or self.reader).get(_RAFT_SNAPSHOT, db=self._meta)
        return bytes(raw) if raw is not None else None

    def get_kv(self, position: int) -> kv_pb2.KeyValue:
        """The put at `position`, from the loop's reader (it must be committed)."""
        raw = self.reader.get(revision_key(position, False), db=self._key)
        if raw is None:
            raise KeyError(f"no key revision at position {position:#x} in {self.path}")
        return kv_pb2.KeyValue.FromString(raw)

    def revisions(self, txn: lmdb.Transaction | None = None) -> Iterator[tuple[int, bool, bytes]]:
        """Every key revision in revision order: (position, tombstone, KeyValue bytes)."""
        cursor = (txn or self.reader).cursor(db=self._key)
        # Transactions are begun with buffers=False: keys and values are bytes.
        for raw_key, raw_value in cast(Iterator[tuple[bytes, bytes]], cursor.iternext()):
            position, tombstone = position_of(raw_key)
            yield position, tombstone, raw_value

    def hash_revisions(self, txn: lmdb.Transaction, bound: int) -> int:
        """`MVCCStore.hash_kv` from a read transaction: over the changes in
        revision order whose entry code is at most `bound` (any thread)."""
        h = zlib.crc32(b"key")
        parse = kv_pb2.KeyValue.FromString
        for pos, tombstone, raw in self.revisions(txn):
            code = pos << 1 | tombstone
            if code > bound:
                break
            kv = parse(raw)
            h = hash_change(h, kv.key, code, None if tombstone else kv.value)
        return h

    def scan_keys(self) -> Iterator[tuple[int, bool, bytes, int]]:
        """Every key revision in revision order as the store's index needs it:
        (position, tombstone, key, lease); a restart's one scan."""
        parse = kv_pb2.KeyValue.FromString
        for position, tombstone, raw in self.revisions():
            kv = parse(raw)
            yield position, tombstone, kv.key, kv.lease

    def table_rows(
        self, name: str, txn: lmdb.Transaction | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """The rows of table `name` in key order."""
        cursor = (txn or self.reader).cursor(db=self._tables[name])
        yield from cast(Iterator[tuple[bytes, bytes]], cursor.iternext())

    def consistent_index_in(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_CONSISTENT_INDEX, db=self._meta)
        return _U64.unpack(raw)[0] if raw is not None else 0

    def raw_revisions(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, bytes]]:
        """The `key` db as etcd's bucket: (revision key, KeyValue bytes)."""
        cursor = txn.cursor(db=self._key)
        yield from cast(Iterator[tuple[bytes, bytes]], cursor.iternext())

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the pages the trees use (etcd's dbSizeInUse), as of the last
        commit."""
        return self._in_use

    @property
    def file_bytes(self) -> int:
        """The size of the data file (etcd's dbSize)."""
        try:
            return os.path.getsize(os.path.join(self.path, "data.mdb"))
        except OSError:
            return 0

    def _measure_in_use(self) -> int:
        """Pages of the data's trees (key revisions and sections), not LMDB's
        fixed meta and catalogue pages: an empty store uses nothing, as the
        quota expects (etcd's dbSizeInUse also counts bbolt's few fixed pages)."""
        with self.env.begin() as txn:
            stats = [txn.stat(db) for db in (self._key, self._state, *self._tables.values())]
        pages = sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"] for s in stats)
        return pages * self.env.stat()["psize"]

    # -- reads in other threads ---------------------------------------------------------

    def begin_read(self) -> lmdb.Transaction:
        """A read transaction with a fixed view, for any one thread; abort it
        when done (it holds pages from reuse while open)."""
        return self.env.begin(buffers=False)

    # -- writes -------------------------------------------------------------------------

    def commit(self, batch: CommitBatch) -> None:
        """Write one checkpoint in one transaction and make it durable (runs on
        the backend thread; raises `lmdb.MapFullError` or OSError on a full disk,
        with nothing written)."""
        key_db = self._key
        with self.env.begin(write=True) as txn:
            if batch.replace:
                for db in (self._key, self._state, *self._tables.values()):
                    txn.drop(db, delete=False)
            put = txn.put
            delete = txn.delete
            for code in batch.deletes:
                delete(revision_key(code >> 1, bool(code & 1)), db=key_db)
            for code, kv in batch.writes.items():  # apply order: revision order
                tombstone = bool(code & 1)
                value = encode_tombstone(kv.key) if tombstone else encode_kv(kv)
                put(revision_key(code >> 1, tombstone), value, db=key_db)
            for name, rows in batch.tables.items():
                table = self._tables[name]
                for row_key, row in rows.items():
                    if row is None:
                        delete(row_key, db=table)
                    else:
                        put(row_key, row, db=table)
            if batch.sections is not None:
                put(_SECTIONS, batch.sections, db=self._state)
            put(_CONSISTENT_INDEX, _U64.pack(batch.index), db=self._meta)
            if batch.raft_snapshot is not None:
                put(_RAFT_SNAPSHOT, batch.raft_snapshot, db=self._meta)
        self._in_use = self._measure_in_use()
        self.release_mapped_pages()

    def renew_reader(self) -> None:
        """On the loop, after a commit: the reader sees the new checkpoint."""
        self.reader.abort()
        self.reader = self.env.begin(buffers=False)

    # -- defragmenting ------------------------------------------------------------------

    def copy_compacted(self, into: str) -> None:
        """A compacted copy of the file (free pages dropped) into directory
        `into`, from a read transaction: commits may go on meanwhile, and the copy
        is of the state when it began (any thread)."""
        shutil.rmtree(into, ignore_errors=True)  # a copy a crash or a full disk cut short
        os.makedirs(into)
        self.env.copy(into, compact=True)

    def swap_in(self, copied: str) -> None:
        """Replace the file with a copy `copy_compacted` made (on the loop, with
        no commit since the copy began and none in flight)."""
        self.reader.abort()
        self.env.close()
        os.replace(os.path.join(copied, "data.mdb"), os.path.join(self.path, "data.mdb"))
        shutil.rmtree(copied, ignore_errors=True)
        self._open()

    def close(self) -> None:
        self.reader.abort()
        self.env.close()
