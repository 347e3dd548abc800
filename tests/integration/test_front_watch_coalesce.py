"""Watches through a front share backend watches (queue_server/front/watch_coalesce.py).

A front over a real etcd (Debian's etcd-server): client watches of one key,
on several client streams, are one watch in etcd (its own gauges,
`etcd_debugging_mvcc_watcher_total` and `etcd_debugging_mvcc_watch_stream_total`
on its client URL's /metrics, say how many it holds); each client watch gets
every event with its own id; a cancel ends that watch only; the backend watch
ends with its last sharer; a watch from an old revision still gets the
history; the ids and refusals of a stream are etcd's, compared with etcd
itself; and when etcd dies, the clients' streams end with UNAVAILABLE. Every
wait is bounded: by the streams' deadlines, or a polling deadline for etcd's
gauges.
"""

from __future__ import annotations

import queue
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from tests.support.processes import EtcdProcess, FrontProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="needs Debian's etcd-server"),
]

STREAM_TIMEOUT = 30.0
"""Bounds every watch stream of these tests, and with it every read of one."""
CALL_TIMEOUT = 5.0
GAUGE_WAIT = 10.0

WATCHERS = "etcd_debugging_mvcc_watcher_total"
STREAMS = "etcd_debugging_mvcc_watch_stream_total"


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    etcd = EtcdProcess(tmp_path_factory.mktemp("etcd") / "backend.etcd").start()
    yield etcd
    etcd.stop()


@pytest.fixture(scope="module")
def front(backend: EtcdProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontProcess]:
    proc = FrontProcess(tmp_path_factory.mktemp("front") / "front.etcd", [backend.endpoint])
    proc.start()
    yield proc
    proc.stop()


class Watch:
    """One client Watch stream: requests are sent as the test goes, responses
    read one at a time (each read bounded by the stream's deadline)."""

    def __init__(self, endpoint: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        self.responses = rpc_pb2_grpc.WatchStub(self.channel).Watch(
            iter(self._requests.get, None), timeout=STREAM_TIMEOUT, metadata=metadata
        )

    def create(self, key: bytes, **fields: object) -> rpc_pb2.WatchResponse:
        """Send a create and return its created response."""
        self.send_create(key, **fields)
        response = self.next()
        assert response.created, response
        return response

    def send_create(self, key: bytes, **fields: object) -> None:
        create = rpc_pb2.WatchCreateRequest(key=key, **fields)  # type: ignore[arg-type]
        self._requests.put(rpc_pb2.WatchRequest(create_request=create))

    def cancel(self, watch_id: int) -> None:
        request = rpc_pb2.WatchCancelRequest(watch_id=watch_id)
        self._requests.put(rpc_pb2.WatchRequest(cancel_request=request))

    def progress(self) -> None:
        self._requests.put(rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest()))

    def next(self) -> rpc_pb2.WatchResponse:
        return next(self.responses)  # type: ignore[no-any-return]

    def events(self, count: int) -> list[tuple[int, int, bytes, bytes, int]]:
        """The next `count` events: (watch id, type, key, value, mod revision)."""
        got: list[tuple[int, int, bytes, bytes, int]] = []
        while len(got) < count:
            response = self.next()
            assert not response.created and not response.canceled, response
            got.extend(
                (response.watch_id, e.type, e.kv.key, e.kv.value, e.kv.mod_revision)
                for e in response.events
            )
        return got

    def close(self) -> None:
        self._requests.put(None)
        self.responses.cancel()
        self.channel.close()


def put(endpoint: str, key: bytes, value: bytes) -> int:
    with grpc.insecure_channel(endpoint) as channel:
        reply = rpc_pb2_grpc.KVStub(channel).Put(
            rpc_pb2.PutRequest(key=key, value=value), timeout=CALL_TIMEOUT
        )
    return int(reply.header.revision)


def gauges(etcd: EtcdProcess) -> dict[str, int]:
    with urllib.request.urlopen(f"http://{etcd.endpoint}/metrics", timeout=CALL_TIMEOUT) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (WATCHERS, STREAMS):
            out[name] = int(float(value))
    return out


def wait_gauges(etcd: EtcdProcess, want: dict[str, int]) -> None:
    """Poll etcd's gauges until they read `want` (etcd has no event to await for them)."""
    deadline = time.monotonic() + GAUGE_WAIT
    while (now := gauges(etcd)) != want:
        assert time.monotonic() < deadline, f"etcd's gauges read {now}, not {want}"
        time.sleep(0.05)


def test_watches_of_one_key_share_one_backend_watch(
    front: FrontProcess, backend: EtcdProcess
) -> None:
    key = b"/coalesce/one"
    before = gauges(backend)
    a, b, c = (Watch(front.endpoint) for _ in range(3))
    try:
        assert a.create(key).watch_id == 0
        assert a.create(key).watch_id == 1  # a second watch of the same key on one stream
        assert b.create(key).watch_id == 0
        assert c.create(key, watch_id=7).watch_id == 7  # the id a create asks for
        # four client watches on three streams: one watch, on one stream, in etcd
        wait_gauges(backend, {WATCHERS: before[WATCHERS] + 1, STREAMS: before[STREAMS] + 1})

        r1 = put(front.endpoint, key, b"1")
        r2 = put(front.endpoint, key, b"2")
        put(front.endpoint, key + b"/other", b"not watched")
        mine = [(kv_pb2.Event.PUT, key, b"1", r1), (kv_pb2.Event.PUT, key, b"2", r2)]
        got_a = a.events(4)
        assert sorted(got_a) == sorted([(i, *e) for i in (0, 1) for e in mine])
        assert b.events(2) == [(0, *e) for e in mine]
        assert c.events(2) == [(7, *e) for e in mine]

        # a cancel ends that watch only, and is answered for its own id
        b.cancel(0)
        canceled = b.next()
        assert (canceled.watch_id, canceled.canceled) == (0, True)
        r3 = put(front.endpoint, key, b"3")
        assert c.events(1) == [(7, kv_pb2.Event.PUT, key, b"3", r3)]
        assert sorted(a.events(2)) == [(i, kv_pb2.Event.PUT, key, b"3", r3) for i in (0, 1)]
        # b's stream is empty now: its next response is a new watch's created one
        assert b.create(key).watch_id == 1
        wait_gauges(backend, {WATCHERS: before[WATCHERS] + 1, STREAMS: before[STREAMS] + 1})
    finally:
        for w in (a, b, c):
            w.close()
    # the backend watch ends with its last sharer (the shared stream stays open)
    wait_gauges(backend, {WATCHERS: before[WATCHERS], STREAMS: before[STREAMS] + 1})


def test_a_watch_that_joins_later_gets_what_follows_its_created_revision(
    front: FrontProcess,
) -> None:
    key = b"/coalesce/later"
    first, second = Watch(front.endpoint), Watch(front.endpoint)
    try:
        first.create(key)
        r1 = put(front.endpoint, key, b"1")
        assert first.events(1) == [(0, kv_pb2.Event.PUT, key, b"1", r1)]
        created = second.create(key)
        assert created.header.revision >= r1  # as etcd's: the revision it was created at
        r2 = put(front.endpoint, key, b"2")
        assert first.events(1) == [(0, kv_pb2.Event.PUT, key, b"2", r2)]
        assert second.events(1) == [(0, kv_pb2.Event.PUT, key, b"2", r2)]  # not the first put
    finally:
        first.close()
        second.close()


def test_a_watch_from_an_old_revision_gets_the_history(
    front: FrontProcess, backend: EtcdProcess
) -> None:
    key = b"/coalesce/history"
    revisions = [put(front.endpoint, key, v) for v in (b"1", b"2", b"3")]
    now, old = Watch(front.endpoint), Watch(front.endpoint)
    try:
        now.create(key)
        before = gauges(backend)
        old.create(key, start_revision=revisions[0])
        # the broadcast has passed the old revision: that watch is etcd's own, on
        # a backend stream of the client's own
        wait_gauges(backend, {WATCHERS: before[WATCHERS] + 1, STREAMS: before[STREAMS] + 1})
        history = [
            (0, kv_pb2.Event.PUT, key, v, r)
            for v, r in zip((b"1", b"2", b"3"), revisions, strict=True)
        ]
        assert old.events(3) == history
        r4 = put(front.endpoint, key, b"4")
        assert now.events(1) == [(0, kv_pb2.Event.PUT, key, b"4", r4)]
        assert old.events(1) == [(0, kv_pb2.Event.PUT, key, b"4", r4)]
        # a start revision the broadcast has not reached yet joins it
        joined = Watch(front.endpoint)
        try:
            joined.create(key, start_revision=r4 + 1)
            wait_gauges(backend, {WATCHERS: before[WATCHERS] + 1, STREAMS: before[STREAMS] + 1})
            r5 = put(front.endpoint, key, b"5")
            assert joined.events(1) == [(0, kv_pb2.Event.PUT, key, b"5", r5)]
        finally:
            joined.close()
    finally:
        now.close()
        old.close()


def test_watches_of_other_shapes_are_other_backend_watches(
    front: FrontProcess, backend: EtcdProcess
) -> None:
    key = b"/coalesce/shapes"
    put(front.endpoint, key, b"0")
    plain, prev, no_put = Watch(front.endpoint), Watch(front.endpoint), Watch(front.endpoint)
    try:
        plain.create(key)
        before = gauges(backend)
        prev.create(key, prev_kv=True)
        no_put.create(key, filters=[rpc_pb2.WatchCreateRequest.NOPUT])
        # two more backend watches, on the same shared backend stream
        wait_gauges(backend, {WATCHERS: before[WATCHERS] + 2, STREAMS: before[STREAMS]})
        r1 = put(front.endpoint, key, b"1")
        with grpc.insecure_channel(front.endpoint) as channel:
            r2 = rpc_pb2_grpc.KVStub(channel).DeleteRange(
                rpc_pb2.DeleteRangeRequest(key=key), timeout=CALL_TIMEOUT
            )
        assert plain.events(2) == [
            (0, kv_pb2.Event.PUT, key, b"1", r1),
            (0, kv_pb2.Event.DELETE, key, b"", r2.header.revision),
        ]
        response = prev.next()
        assert [(e.kv.value, e.prev_kv.value) for e in response.events] == [(b"1", b"0")]
        assert no_put.events(1) == [(0, kv_pb2.Event.DELETE, key, b"", r2.header.revision)]
    finally:
        for w in (plain, prev, no_put):
            w.close()


def _script(w: Watch) -> list[tuple[int, bool, bool, str]]:
    """Ids, refusals, cancels and a progress request on one stream, as
    (watch id, created, canceled, cancel reason) of each response."""
    key = b"/coalesce/script"
    w.send_create(key, watch_id=5)
    w.send_create(key)  # the next free id: 0
    w.send_create(key, watch_id=5)  # a duplicate
    w.send_create(b"/coalesce/z", range_end=b"/coalesce/a")  # an empty range
    w.send_create(key, prev_kv=True)  # 1
    w.cancel(77)  # not a watch of this stream: no answer
    w.cancel(5)
    w.send_create(key, watch_id=5)  # free again
    w.progress()
    return [
        (r.watch_id, r.created, r.canceled, r.cancel_reason) for r in (w.next() for _ in range(8))
    ]


def test_a_streams_ids_refusals_and_cancels_are_etcds(
    front: FrontProcess, backend: EtcdProcess
) -> None:
    through_front, direct = Watch(front.endpoint), Watch(backend.endpoint)
    try:
        expected = _script(direct)
        assert expected[:3] == [
            (5, True, False, ""),
            (0, True, False, ""),
            (-1, True, True, "mvcc: duplicate watch ID provided on the WatchStream"),
        ]
        assert _script(through_front) == expected
    finally:
        through_front.close()
        direct.close()


def test_when_etcd_dies_the_shared_watches_end_with_unavailable(tmp_path: Path) -> None:
    etcd = EtcdProcess(tmp_path / "dies.etcd").start()
    front = FrontProcess(tmp_path / "front.etcd", [etcd.endpoint]).start()
    watches = [Watch(front.endpoint) for _ in range(2)]
    try:
        for w in watches:
            w.create(b"/coalesce/dies")
        assert etcd.proc is not None
        etcd.proc.kill()
        etcd.proc.wait(timeout=CALL_TIMEOUT)
        for w in watches:
            with pytest.raises(grpc.RpcError) as failed:
                w.next()
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    finally:
        for w in watches:
            w.close()
        front.stop()
        etcd.stop()
