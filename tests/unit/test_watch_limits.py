"""The watch hub's per-stream bounds, without a network: the watcher limit and
the backlog that pauses reading a stream's requests."""

from __future__ import annotations

import pytest

from etcdserverpb import rpc_pb2
from queue_server.mvcc.store import MVCCStore
from queue_server.watch.hub import (
    CANCEL_TOO_MANY_WATCHERS,
    OUTBOX_PAUSE_RESPONSES,
    PROGRESS_WATCH_ID,
    WatchHub,
)

pytestmark = pytest.mark.unit


def _create(key: bytes) -> rpc_pb2.WatchCreateRequest:
    return rpc_pb2.WatchCreateRequest(key=key)


def test_watchers_beyond_the_limit_are_refused_until_one_is_cancelled() -> None:
    store = MVCCStore()
    hub = WatchHub(lambda: store, 1 << 20, max_watchers_per_stream=3)
    stream = hub.open_stream(lambda: None)
    for i in range(4):
        hub.create(stream, _create(b"k%d" % i))
    answers = [stream.pop() for _ in range(4)]
    assert [a.watch_id for a in answers[:3]] == [0, 1, 2]
    refused = answers[3]
    assert refused.created and refused.canceled
    assert (refused.watch_id, refused.cancel_reason) == (
        PROGRESS_WATCH_ID,
        CANCEL_TOO_MANY_WATCHERS,
    )
    assert len(stream.watchers) == 3
    hub.cancel(stream, 1)
    stream.clear()
    hub.create(stream, _create(b"again"))
    assert not stream.pop().canceled
    other = hub.open_stream(lambda: None)  # the limit is per stream
    hub.create(other, _create(b"k"))
    assert not other.pop().canceled


def test_no_limit_when_zero() -> None:
    store = MVCCStore()
    hub = WatchHub(lambda: store, 1 << 20, max_watchers_per_stream=0)
    stream = hub.open_stream(lambda: None)
    for i in range(50):
        hub.create(stream, _create(b"k%d" % i))
    assert len(stream.watchers) == 50


def test_unread_answers_make_the_stream_backlogged() -> None:
    store = MVCCStore()
    hub = WatchHub(lambda: store, 1 << 20, max_watchers_per_stream=0)
    stream = hub.open_stream(lambda: None)
    for i in range(OUTBOX_PAUSE_RESPONSES - 1):
        hub.create(stream, _create(b"k%d" % i))
    assert not stream.backlogged
    hub.create(stream, _create(b"last"))
    assert stream.backlogged
    stream.pop()
    assert not stream.backlogged
