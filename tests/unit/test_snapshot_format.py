"""The snapshot file format (queue_server/storage/snapshot.py, snapshot_codec.py):
a real state round-trips exactly; a QSNAP1 pickle file is refused wherever it
comes from, never unpickled; bytes are data only, and anything damaged,
foreign or malformed is refused with CorruptSnapshotError and nothing else;
large states stream through a file without a second copy in memory."""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import struct
import time
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from etcdserverpb import snapshot_pb2 as pb
from queue_server.apply import StateMachine
from queue_server.replication.storage import RaftStorage
from queue_server.restore import restore
from queue_server.storage import snapshot, snapshot_codec
from queue_server.storage.revisions import position
from queue_server.storage.snapshot import CorruptSnapshotError, SnapshotStore
from tests.support.states import NOW_MS, rich_machine

pytestmark = pytest.mark.unit

LEADER = "snapshot from leader at 7"


def same(a: StateMachine, b: StateMachine) -> None:
    assert a.export_state() == b.export_state()
    assert a.store.hash_kv() == b.store.hash_kv()
    assert a.store.revision == b.store.revision


def restored(state: dict[str, Any]) -> StateMachine:
    sm = StateMachine()
    sm.restore_state(state)
    return sm


def legacy_bytes(index: int, value: object) -> bytes:
    """A file as the previous format wrote it: QSNAP1 header, then a pickle."""
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return b"QSNAP1\n" + struct.pack("<QIQ", index, zlib.crc32(payload), len(payload)) + payload


def framed(records: list[bytes]) -> bytes:
    """A QSNAP2 file of these raw records with a correct trailer: what a peer
    who computes the checksum could send."""
    body = snapshot.MAGIC + b"".join(struct.pack("<I", len(r)) + r for r in records)
    body += struct.pack("<I", 0)
    return body + struct.pack("<I", zlib.crc32(body))


def raw_records(data: bytes) -> list[bytes]:
    """The records of a valid QSNAP2 file, as bytes."""
    out: list[bytes] = []
    at = len(snapshot.MAGIC)
    while True:
        (n,) = struct.unpack_from("<I", data, at)
        at += 4
        if n == 0:
            return out
        out.append(data[at : at + n])
        at += n


# -- round trip ---------------------------------------------------------------------


def test_a_real_state_round_trips_exactly_with_its_raft_position(tmp_path: Path) -> None:
    sm = rich_machine()
    state = sm.export_state()
    data = snapshot.encode(sm.applied_index, state, raft_term=4, voters=(1, 2, 3))
    assert data.startswith(b"QSNAP2\n")
    got = snapshot.decode(data, LEADER)
    assert (got.index, got.raft_term, got.voters) == (sm.applied_index, 4, (1, 2, 3))
    assert got.state == state
    same(sm, restored(got.state))

    # the same through a file, and what it holds really is all of it
    store = SnapshotStore(str(tmp_path), fsync=False)
    assert store.save(sm.applied_index, state) == len(snapshot.encode(sm.applied_index, state))
    loaded = store.load_latest()
    assert loaded is not None and loaded.index == sm.applied_index
    assert (loaded.raft_term, loaded.voters) == (0, ())
    again = restored(loaded.state)
    same(sm, again)
    assert again.auth.enabled and again.auth.users["root"].is_root
    assert again.queues.queues[b"jobs"].holder and again.queues.queues[b"jobs"].pending
    tree = again.cqs.queues["r"].tree
    assert list(tree.pending())
    assert list(tree.in_flight_records())
    assert again.lessor.leases[0x1234].keys == {b"leased"}
    assert again.alarms.export_state() and len(again.members) == 2
    assert again.store.compact_revision == 2

    # and both go on the same way
    for command in (
        internal_pb2.Command(
            cqs_dequeue=internal_pb2.CqsDequeue(
                queue="r", max=5, depth=-1, now_ms=NOW_MS + 120_000, token_base="z-"
            )
        ),
        internal_pb2.Command(delete_range=rpc_pb2.DeleteRangeRequest(key=b"history")),
    ):
        index = sm.applied_index + 1
        a, _ = sm.apply(index, command)
        b, _ = again.apply(index, command)
        assert a == b
    same(sm, again)


def test_a_history_longer_than_a_chunk_is_split_and_joined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(snapshot_codec, "CHUNK_BYTES", 64)
    sm = rich_machine()
    state = sm.export_state()
    data = snapshot.encode(sm.applied_index, state)
    kinds = [pb.Record.FromString(r).WhichOneof("body") for r in raw_records(data)]
    assert kinds.count("keys") > len(state["mvcc"][2]) // 2
    keys = [
        h.key
        for r in raw_records(data)
        for h in pb.Record.FromString(r).keys.keys
        if pb.Record.FromString(r).WhichOneof("body") == "keys"
    ]
    assert keys.count(b"history") > 1  # continued in the next chunk
    assert snapshot.decode(data, LEADER).state == state


# -- QSNAP1 (pickled) files: refused everywhere, never unpickled --------------------


def test_a_qsnap1_file_in_the_snap_dir_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "snap" / f"{7:020d}.snap"
    path.parent.mkdir()
    path.write_bytes(legacy_bytes(7, SideEffect(marker)))
    store = SnapshotStore(str(path.parent), fsync=False)
    loaded, broken = store.load_usable()
    assert loaded is None and len(broken) == 1
    assert "QSNAP1" in str(broken[0]) and "never read" in str(broken[0])
    assert broken[0].index == 7
    assert not marker.exists()
    assert path.read_bytes().startswith(b"QSNAP1\n")  # left for the operator as it was


def test_a_qsnap1_raft_snapshot_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    snap_dir = tmp_path / "raft" / "snap"
    snap_dir.mkdir(parents=True)
    wrapped = {"index": 39, "term": 3, "voters": [1, 2], "state": SideEffect(marker)}
    (snap_dir / f"{39:020d}.snap").write_bytes(legacy_bytes(39, wrapped))
    storage = RaftStorage(str(tmp_path), fsync=False)
    try:
        with pytest.raises(CorruptSnapshotError, match="QSNAP1"):
            storage.load()
    finally:
        storage.close()
    assert not marker.exists()


def test_restore_refuses_a_qsnap1_transfer_file_and_makes_no_data_dir(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    old = legacy_bytes(3, SideEffect(marker))
    padded = old + bytes(-len(old) % 512)  # the old server's etcdctl stream
    source = tmp_path / "old.db"
    source.write_bytes(padded + hashlib.sha256(padded).digest())
    with pytest.raises(CorruptSnapshotError, match=r"QSNAP1.*nothing is ever unpickled"):
        restore(str(source), str(tmp_path / "data"))
    assert not (tmp_path / "data").exists() and not marker.exists()


def test_restore_installs_our_own_file_as_it_is_whatever_its_length(tmp_path: Path) -> None:
    """A QSNAP2 file is never a transfer stream: one whose length happens to be
    32 past a multiple of 512 is not taken for one (and refused on a sha256)."""
    sm = rich_machine()
    state = sm.export_state()
    for pad in range(snapshot.SECTOR_BYTES):
        state["auth"]["users"] = [("u" * (pad + 1), b"", [], True, 0)]
        data = snapshot.encode(sm.applied_index, state)
        if len(data) % snapshot.SECTOR_BYTES == 32:
            break
    assert len(data) % snapshot.SECTOR_BYTES == 32
    source = tmp_path / "plain.snap"
    source.write_bytes(data)
    assert restore(str(source), str(tmp_path / "data")) == sm.applied_index
    (installed,) = (tmp_path / "data" / "snap").glob("*.snap")
    assert installed.read_bytes() == data


# -- nothing received is ever unpickled ----------------------------------------------


class SideEffect:
    """Unpickling this creates a directory: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def test_decode_never_unpickles(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps(SideEffect(marker))
    attempts = {
        "a bare pickle": evil,
        "a legacy QSNAP1 file": legacy_bytes(7, SideEffect(marker)),
        "a pickle behind the new magic": snapshot.MAGIC + evil,
        "a pickle as a record": framed([evil]),
    }
    for what, data in attempts.items():
        with pytest.raises(CorruptSnapshotError, match=f"^{LEADER} is not a valid snapshot"):
            snapshot.decode(data, LEADER)
        with pytest.raises(CorruptSnapshotError):
            snapshot.verify(data, LEADER)
        assert not marker.exists(), what
    with pytest.raises(CorruptSnapshotError, match="QSNAP1"):
        snapshot.decode(attempts["a legacy QSNAP1 file"], LEADER)


# -- damage and malformed records ---------------------------------------------------


def test_every_truncation_and_bit_flip_is_refused() -> None:
    sm = rich_machine()
    data = snapshot.encode(sm.applied_index, sm.export_state(), raft_term=2, voters=(1,))
    for n in range(len(data)):
        with pytest.raises(CorruptSnapshotError):
            snapshot.decode(data[:n], LEADER)
    for at in range(len(data)):
        flipped = data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]
        with pytest.raises(CorruptSnapshotError, match=r"checksum|does not start"):
            snapshot.decode(flipped, LEADER)
    for junk in (b"", b"\x00" * 64, os.urandom(4096), b"QSNAP2\n" + os.urandom(100)):
        with pytest.raises(CorruptSnapshotError):
            snapshot.decode(junk, LEADER)
    with pytest.raises(CorruptSnapshotError):
        snapshot.decode(data + b"\x00", LEADER)  # trailing bytes


@functools.cache
def _good_bytes() -> bytes:
    sm = rich_machine()
    return snapshot.encode(sm.applied_index, sm.export_state())


def _good_records() -> list[pb.Record]:
    return [pb.Record.FromString(r) for r in raw_records(_good_bytes())]


def _edit(kind: str, change: Callable[[Any], list[bytes] | None]) -> list[bytes]:
    """The rich state's records, with `change(message)` applied to the first
    record of `kind`; if `change` returns records, they replace that record."""
    out: list[bytes] = []
    done = False
    for record in _good_records():
        if not done and record.WhichOneof("body") == kind:
            done = True
            replaced = change(getattr(record, kind))
            if replaced is not None:
                out.extend(replaced)
                continue
        out.append(record.SerializeToString())
    assert done
    return out


def _set(**fields: Any) -> Callable[[Any], None]:
    def change(message: Any) -> None:
        for name, value in fields.items():
            setattr(message, name, value)

    return change


def _twice(field: str) -> Callable[[Any], None]:
    def change(message: Any) -> None:
        items = getattr(message, field)
        items.add().CopyFrom(items[0])

    return change


def _twice_in_flight(chunk: pb.CqsChunk) -> None:
    for _ in range(2):
        chunk.in_flight.add(token="t", notification=pb.Notification(dto_id="x"))


def _add_key(key: bytes, *changes: pb.Change) -> Callable[[pb.KeyChunk], None]:
    def change(chunk: pb.KeyChunk) -> None:
        chunk.keys.add(key=key, changes=changes)

    return change


def _then(**record: Any) -> Callable[[Any], list[bytes]]:
    """Keep the record and put `pb.Record(**record)` after it."""

    def change(message: Any) -> list[bytes]:
        kind = message.DESCRIPTOR.name
        this = pb.Record(**{_KIND_OF[kind]: message})
        return [this.SerializeToString(), pb.Record(**record).SerializeToString()]

    return change


def _record_kinds() -> dict[str, str]:
    """Each Record body's message name -> its field name in the oneof."""
    kinds: dict[str, str] = {}
    for f in pb.Record.DESCRIPTOR.fields:
        assert f.message_type is not None, f.name  # every body is a message
        kinds[f.message_type.name] = f.name
    return kinds


_KIND_OF = _record_kinds()


def _header_with(extra: bytes, before: bool = False) -> Callable[[pb.Header], list[bytes]]:
    """The header record with `extra` raw field bytes after (or before) its own."""

    def change(header: pb.Header) -> list[bytes]:
        own = header.SerializeToString()
        body = extra + own if before else own + extra
        return [b"\x0a" + bytes([len(body)]) + body]

    return change


UNKNOWN_FIELD = b"\xf8\x07\x01"  # field 127, varint 1
WRONG_WIRE_TYPE = b"\x0a\x01\x00"  # Header.format_version (a varint) as length-delimited
BAD_UTF8_MEMBER = b"\x4a\x06\x0a\x04\x12\x02\xff\xfe"  # members { members { name: ff fe } }

MALFORMED: dict[str, tuple[list[bytes], str]] = {
    "a newer format version": (_edit("header", _set(format_version=2)), "format version 2"),
    "an unknown field": (_edit("header", _header_with(UNKNOWN_FIELD)), "does not know"),
    "a field of the wrong type": (
        _edit("header", _header_with(WRONG_WIRE_TYPE, before=True)),
        "does not know|does not parse",
    ),
    "a record that is not a Record": (_edit("mvcc", lambda m: [b"\xff\xff\xff"]), "parse"),
    "an invalid field number": (_edit("mvcc", lambda m: [b"\x00\x00"]), "parse"),
    "no header first": (_edit("header", lambda h: []), "not the header"),
    "a second header": (
        _edit("header", _then(header=pb.Header(format_version=1))),
        "out of order",
    ),
    "sections out of order": (_edit("auth", _then(keys=pb.KeyChunk())), "out of order"),
    "a missing section": (_edit("auth", lambda a: []), "missing"),
    "a count that does not match": (_edit("header", _set(lease_count=7)), "announces 7 leases"),
    "keys out of order": (
        _edit("keys", _add_key(b"\x00first", pb.Change(revision=1))),
        "out of order",
    ),
    "a key with no changes": (_edit("keys", _add_key(b"\xffzz")), "no changes"),
    "a tombstone with a value": (
        _edit("keys", _add_key(b"\xffzz", pb.Change(revision=1, tombstone=True, value=b"x"))),
        "tombstone",
    ),
    "a change from the future": (
        _edit("keys", _add_key(b"\xffzz", pb.Change(revision=10**6))),
        "revision 1000000",
    ),
    "a history out of order": (
        _edit("keys", _add_key(b"\xffzz", pb.Change(revision=3), pb.Change(revision=2))),
        "history is out of order",
    ),
    "a lease twice": (_edit("leases", _twice("leases")), "twice"),
    "a user twice": (_edit("auth", _twice("users")), "twice"),
    "a consumer twice": (_edit("queue", _twice("consumers")), "twice"),
    "CQS notifications without a queue": (
        _edit("queue", _then(cqs_chunk=pb.CqsChunk())),
        "before any",
    ),
    "an ack token twice": (_edit("cqs_chunk", _twice_in_flight), "twice"),
    "invalid UTF-8 in a string": (_edit("members", lambda m: [BAD_UTF8_MEMBER]), "parse"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_records_that_pass_the_checksum_are_still_checked(case: str) -> None:
    records, message = MALFORMED[case]
    with pytest.raises(CorruptSnapshotError, match=message):
        snapshot.decode(framed(records), LEADER)


def test_a_huge_record_length_is_refused_before_reading_it() -> None:
    data = framed([b"x"])
    at = len(snapshot.MAGIC)
    huge = data[:at] + struct.pack("<I", 0xFFFFFFF0) + data[at + 4 :]
    body = huge[:-4]
    with pytest.raises(CorruptSnapshotError, match="runs past"):
        snapshot.decode(body + struct.pack("<I", zlib.crc32(body)), LEADER)


# -- large states stream --------------------------------------------------------------


def _large_state(keys: int, value_bytes: int) -> dict[str, Any]:
    state = StateMachine().export_state()
    value = b"v" * value_bytes
    state["mvcc"] = (
        keys,
        0,
        [
            (b"key/%08d" % i, [position(i + 1, 0)], [(i + 1, i + 1, 1, value, 0)])
            for i in range(keys)
        ],
    )
    return state


def test_a_large_state_streams_through_a_file(tmp_path: Path) -> None:
    started = time.monotonic()
    state = _large_state(200_000, 16)
    path = tmp_path / "big.snap"
    with open(path, "wb") as f:
        size = snapshot.write_snapshot(f, 0, state)
    assert size == path.stat().st_size
    with open(path, "rb") as f:
        got = snapshot.read_snapshot(f, str(path))
    assert got.state == state
    records = raw_records(path.read_bytes())
    assert len(records) > 5 and max(map(len, records)) < 2 * snapshot_codec.CHUNK_BYTES
    assert time.monotonic() - started < 10


def test_reading_holds_no_second_copy_of_the_file(tmp_path: Path) -> None:
    """Few, large values, so the state is about the file's size and tracing is
    quick: reading adds at most a chunk or two besides the state it returns."""
    state = _large_state(20_000, 1000)
    path = tmp_path / "big.snap"
    with open(path, "wb") as f:
        size = snapshot.write_snapshot(f, 0, state)
    del state
    with open(path, "rb") as f:
        tracemalloc.start()
        try:
            got = snapshot.read_snapshot(f, str(path))
            retained, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert len(got.state["mvcc"][2]) == 20_000
    assert size > 16 * snapshot_codec.CHUNK_BYTES
    assert peak - retained < 4 * snapshot_codec.CHUNK_BYTES < size // 4


def test_write_holds_no_second_copy_either(tmp_path: Path) -> None:
    state = _large_state(20_000, 1000)
    with open(tmp_path / "big.snap", "wb") as f:
        tracemalloc.start()
        try:
            size = snapshot.write_snapshot(f, 0, state)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 4 * snapshot_codec.CHUNK_BYTES < size // 4


def test_a_snapshot_whose_header_disagrees_with_its_file_name_is_refused(
    tmp_path: Path,
) -> None:
    sm = rich_machine()
    store = SnapshotStore(str(tmp_path), fsync=False)
    (tmp_path / f"{99:020d}.snap").write_bytes(snapshot.encode(sm.applied_index, sm.export_state()))
    with pytest.raises(CorruptSnapshotError, match="index 39") as e:
        store.load_latest()
    assert e.value.index == 99


def test_an_etcdctl_stream_loses_its_checked_sha256_and_ours_pass_through() -> None:
    body = bytes(range(256)) * 8  # a whole number of sectors, as a bbolt file is
    wrapped = body + hashlib.sha256(body).digest()
    assert snapshot.unwrap_transfer(wrapped, "x") == body
    assert snapshot.unwrap_transfer(body, "x") == body  # a bare db has no digest
    with pytest.raises(CorruptSnapshotError, match="sha256"):
        snapshot.unwrap_transfer(wrapped[:-1] + bytes([wrapped[-1] ^ 1]), "x")
