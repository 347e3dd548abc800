"""A watcher that a compaction cancelled, in the hub without a network: it keeps
its id on the stream until the client cancels it, as etcd's watch stream keeps
it (tests/compat/test_differential.py compares the same against a real etcd),
and, as in etcd 3.5, it holds back a stream-wide progress response meanwhile,
which etcd 3.4, the reference run there, does not."""

from __future__ import annotations

import pytest

from etcdserverpb import rpc_pb2
from queue_server.mvcc.store import MVCCStore
from queue_server.watch.hub import CANCEL_DUPLICATE_ID, PROGRESS_WATCH_ID, WatchHub, WatchStream

pytestmark = pytest.mark.unit

KEY = b"k"


def _put(store: MVCCStore, value: bytes) -> None:
    txn = store.write()
    txn.put(KEY, value)
    txn.end()


def _answers(stream: WatchStream) -> list[rpc_pb2.WatchResponse]:
    out = []
    while stream.outbox:
        out.append(stream.pop())
    return out


def _compacted_watch(watch_id: int) -> tuple[MVCCStore, WatchHub, WatchStream]:
    """A store at revision 3 compacted at 2, and a stream whose watch `watch_id`
    started at 1 and got its compaction cancel."""
    store = MVCCStore()
    for value in (b"1", b"2", b"3"):
        _put(store, value)
    store.compact(2)
    hub = WatchHub(lambda: store, 1 << 20)
    store.on_commit = hub.on_commit
    stream = hub.open_stream(lambda: None)
    hub.create(stream, rpc_pb2.WatchCreateRequest(key=KEY, start_revision=1, watch_id=watch_id))
    hub.catch_up(stream)
    created, canceled = _answers(stream)
    assert created.created and created.watch_id == watch_id
    assert canceled.canceled and canceled.compact_revision == 2
    assert not canceled.header.revision  # etcd leaves it unset on this one
    return store, hub, stream


def test_the_compacted_watch_keeps_its_id_until_the_client_cancels_it() -> None:
    store, hub, stream = _compacted_watch(5)
    hub.create(stream, rpc_pb2.WatchCreateRequest(key=KEY, watch_id=5))
    [duplicate] = _answers(stream)
    assert (duplicate.watch_id, duplicate.cancel_reason) == (PROGRESS_WATCH_ID, CANCEL_DUPLICATE_ID)
    assert not stream.unsynced()  # nothing to catch up on
    hub.catch_up(stream)
    _put(store, b"4")  # not in the fan-out index either
    assert not _answers(stream)

    hub.cancel(stream, 5)
    [answer] = _answers(stream)
    assert answer == rpc_pb2.WatchResponse(
        header=rpc_pb2.ResponseHeader(revision=store.revision), watch_id=5, canceled=True
    )
    hub.cancel(stream, 5)
    assert not _answers(stream)  # gone now
    hub.create(stream, rpc_pb2.WatchCreateRequest(key=KEY, watch_id=5))
    [again] = _answers(stream)
    assert again.created and not again.canceled and again.watch_id == 5


def test_an_auto_id_skips_the_compacted_watch() -> None:
    _store, hub, stream = _compacted_watch(1)
    hub.create(stream, rpc_pb2.WatchCreateRequest(key=KEY))
    hub.create(stream, rpc_pb2.WatchCreateRequest(key=KEY))
    assert [a.watch_id for a in _answers(stream)] == [0, 2]


def test_the_compacted_watch_holds_back_progress_until_cancelled() -> None:
    store, hub, stream = _compacted_watch(5)
    hub.create(stream, rpc_pb2.WatchCreateRequest(key=KEY, watch_id=6))  # synced
    _answers(stream)
    hub.request_progress(stream)
    hub.catch_up(stream)
    assert not _answers(stream)
    _put(store, b"4")
    assert [(a.watch_id, len(a.events)) for a in _answers(stream)] == [(6, 1)]  # still held
    hub.cancel(stream, 6)  # a synced one: still held back
    assert [a.watch_id for a in _answers(stream)] == [6]
    hub.cancel(stream, 5)
    canceled, progress = _answers(stream)
    assert (canceled.watch_id, canceled.canceled) == (5, True)
    assert progress == rpc_pb2.WatchResponse(
        header=rpc_pb2.ResponseHeader(revision=store.revision), watch_id=PROGRESS_WATCH_ID
    )
