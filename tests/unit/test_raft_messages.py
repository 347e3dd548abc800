"""Unit tests of the Raft value types' binary encodings (raft/messages.py) and
of the in-memory log (raft/log.py): round trips for arbitrary values, and
refusal of truncated, extended, corrupted or foreign-version buffers."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raft import (
    FORMAT_VERSION,
    ConfChange,
    ConfChangeOp,
    DecodeError,
    Entry,
    EntryKind,
    HardState,
    Message,
    MessageType,
    Snapshot,
    SnapshotMeta,
)
from raft.log import LogSafetyError, RaftLog

pytestmark = pytest.mark.unit

u64 = st.integers(min_value=0, max_value=2**64 - 1)
small = st.integers(min_value=0, max_value=1000)
blobs = st.binary(max_size=64)

entries = st.builds(Entry, u64, u64, st.sampled_from(EntryKind), blobs)
metas = st.builds(SnapshotMeta, u64, u64, st.lists(u64, max_size=7).map(tuple))
snapshots = st.builds(Snapshot, metas, blobs)
messages = st.builds(
    Message,
    type=st.sampled_from(MessageType),
    src=u64,
    dst=u64,
    term=u64,
    log_term=u64,
    index=u64,
    entries=st.lists(entries, max_size=5).map(tuple),
    commit=u64,
    reject=st.booleans(),
    reject_hint=u64,
    snapshot=st.none() | snapshots,
    context=blobs,
)
conf_changes = st.builds(
    ConfChange, st.sampled_from(ConfChangeOp), u64, st.lists(u64, max_size=5).map(tuple), blobs
)


@given(messages)
def test_message_round_trip(m: Message) -> None:
    buf = m.to_bytes()
    assert buf[0] == FORMAT_VERSION
    assert Message.from_bytes(buf) == m


@given(entries, metas, snapshots, st.builds(HardState, u64, u64, u64), conf_changes)
def test_value_round_trips(
    e: Entry, meta: SnapshotMeta, snap: Snapshot, hs: HardState, cc: ConfChange
) -> None:
    assert Entry.from_bytes(e.to_bytes()) == e
    assert SnapshotMeta.from_bytes(meta.to_bytes()) == meta
    assert Snapshot.from_bytes(snap.to_bytes()) == snap
    assert HardState.from_bytes(hs.to_bytes()) == hs
    assert ConfChange.from_bytes(cc.to_bytes()) == cc


@given(messages, st.data())
def test_truncated_or_extended_messages_are_refused(m: Message, data: st.DataObject) -> None:
    buf = m.to_bytes()
    cut = data.draw(st.integers(min_value=0, max_value=len(buf) - 1))
    with pytest.raises(DecodeError):
        Message.from_bytes(buf[:cut])
    with pytest.raises(DecodeError):
        Message.from_bytes(buf + b"\0")


def test_foreign_versions_and_unknown_values_are_refused() -> None:
    buf = bytearray(Message(MessageType.APP, 1, 2, term=3).to_bytes())
    with pytest.raises(DecodeError, match="version"):
        Message.from_bytes(bytes([FORMAT_VERSION + 1]) + bytes(buf[1:]))
    buf[1] = 200  # message type
    with pytest.raises(DecodeError, match="MessageType"):
        Message.from_bytes(bytes(buf))
    with pytest.raises(DecodeError):
        Entry.from_bytes(b"")


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_garbage_never_raises_anything_but_decode_error(buf: bytes) -> None:
    for kind in (Message, Entry, HardState, Snapshot, SnapshotMeta):
        with contextlib.suppress(DecodeError):
            kind.from_bytes(buf)


def test_heartbeat_encoding_is_compact() -> None:
    beat = Message(MessageType.HEARTBEAT, 1, 2, term=7, commit=100)
    assert len(beat.to_bytes()) == 67


# -- RaftLog ------------------------------------------------------------------------------


def log_of(*terms: int) -> RaftLog:
    return RaftLog(0, 0, [Entry(t, i, EntryKind.NORMAL, b"") for i, t in enumerate(terms, 1)])


def test_maybe_append_truncates_only_at_the_first_conflict() -> None:
    log = log_of(1, 1, 2, 2)
    assert log.unstable_entries() == []  # restored entries are stable
    same = [Entry(1, 2), Entry(2, 3)]
    assert log.maybe_append(1, 1, 0, same) == 3
    assert log.last_index == 4 and log.unstable_entries() == []  # nothing changed
    assert log.maybe_append(2, 1, 2, [Entry(2, 3), Entry(3, 4), Entry(3, 5)]) == 5
    assert [e.term for e in log.unstable_entries()] == [3, 3]
    assert log.committed == 2
    assert log.maybe_append(5, 2, 9, []) is None  # term mismatch at 5


def test_truncating_a_committed_entry_is_a_safety_error() -> None:
    log = log_of(1, 1, 2)
    log.commit_to(3)
    with pytest.raises(LogSafetyError):
        log.append([Entry(3, 3)])


def test_find_conflict_by_term_skips_whole_terms() -> None:
    log = log_of(1, 1, 2, 2, 2, 4, 4, 4)
    assert log.find_conflict_by_term(8, 3) == 5
    assert log.find_conflict_by_term(8, 4) == 8
    assert log.find_conflict_by_term(20, 1) == 2
    assert log.find_conflict_by_term(8, 0) == 0


def test_stable_to_ignores_entries_replaced_since_the_ready() -> None:
    log = log_of()
    log.append([Entry(1, 1), Entry(1, 2)])
    log.append([Entry(2, 2)])  # replaced before the driver acknowledged (2, term 1)
    log.stable_to(2, 1)
    assert [(e.index, e.term) for e in log.unstable_entries()] == [(1, 1), (2, 2)]
    log.stable_to(2, 2)
    assert log.unstable_entries() == []


def test_committed_entries_wait_for_stability_and_compaction_keeps_terms() -> None:
    log = log_of(1, 1)
    log.append([Entry(2, 3)])
    log.commit_to(3)
    assert [e.index for e in log.next_committed()] == [1, 2]
    log.stable_to(3, 2)
    assert [e.index for e in log.next_committed()] == [1, 2, 3]
    log.applied = 3
    assert log.compact(2) == 1
    assert (log.first_index, log.term(2), log.term(1), log.term(3)) == (3, 1, None, 2)
    with pytest.raises(ValueError):
        log.slice(2, 3)
