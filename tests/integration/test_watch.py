"""Watch through our generated stubs against a real server process: ordering
across history and live events, slow watchers, cancel, filters, compaction,
progress and fragments."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import grpc
import psutil
import pytest

from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.integration


class WatchCall(Protocol):
    """A Watch call as grpc returns it: an iterator of responses that can be cancelled."""

    def __iter__(self) -> Iterator[rpc_pb2.WatchResponse]: ...
    def __next__(self) -> rpc_pb2.WatchResponse: ...
    def cancel(self) -> bool: ...


class WatchClient:
    """One Watch stream; requests go in through a queue, responses are read on demand."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        self.responses: WatchCall = rpc_pb2_grpc.WatchStub(channel).Watch(self._iter(), timeout=120)

    def _iter(self) -> Iterator[rpc_pb2.WatchRequest]:
        while True:
            req = self._requests.get()
            if req is None:
                return
            yield req

    def create(self, **kw: object) -> rpc_pb2.WatchResponse:
        self._requests.put(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(**kw)))  # type: ignore[arg-type]
        resp = next(self.responses)
        assert resp.created
        return resp

    def send(self, req: rpc_pb2.WatchRequest) -> None:
        self._requests.put(req)

    def next(self) -> rpc_pb2.WatchResponse:
        return next(self.responses)

    def close(self) -> None:
        self._requests.put(None)
        self.responses.cancel()


def put(kv: rpc_pb2_grpc.KVStub, key: bytes, value: bytes) -> int:
    return int(kv.Put(rpc_pb2.PutRequest(key=key, value=value), timeout=10).header.revision)


def test_history_then_live_every_event_once_in_order(channel: grpc.Channel) -> None:
    """10 000 writes interleaved with a watcher that starts at an old revision."""
    kv = rpc_pb2_grpc.KVStub(channel)
    first = put(kv, b"ord/0", b"0")
    for i in range(1, 3000):
        put(kv, b"ord/%d" % (i % 50), b"%d" % i)
    w = WatchClient(channel)
    w.create(key=b"ord/", range_end=b"ord0", start_revision=first)
    done = threading.Event()

    def writer() -> None:
        for i in range(3000, 10000):
            put(kv, b"ord/%d" % (i % 50), b"%d" % i)
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    seen: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + 90
    while len(seen) < 10000 and time.monotonic() < deadline:
        resp = w.next()
        seen.extend((e.kv.mod_revision, e.kv.value) for e in resp.events)
    t.join(timeout=60)
    w.close()
    assert done.is_set()
    assert len(seen) == 10000
    assert [int(v) for _, v in seen] == list(range(10000))
    revs = [r for r, _ in seen]
    assert revs == sorted(revs) and len(set(revs)) == 10000


def test_slow_watcher_does_not_block_and_memory_stays_bounded(tmp_path: Path) -> None:
    """A watcher that never reads while 80 MiB of values pass a writer and a fast
    watcher: the fast one gets everything, the server does not buffer for the
    slow one (history is compacted as it goes, so the store stays small too), and
    when the slow one finally reads it learns it fell behind compaction."""
    srv = ServerProcess(tmp_path / "slow.etcd").start()
    try:
        assert srv.proc is not None
        proc = psutil.Process(srv.proc.pid)
        with (
            grpc.insecure_channel(srv.endpoint) as slow_ch,
            grpc.insecure_channel(srv.endpoint) as ch,
        ):
            kv = rpc_pb2_grpc.KVStub(ch)
            slow = WatchClient(slow_ch)
            slow_id = slow.create(key=b"s/", range_end=b"s0").watch_id  # and then never read
            fast = WatchClient(ch)
            fast.create(key=b"s/", range_end=b"s0")
            rss_before = proc.memory_info().rss
            value = b"x" * 4096
            n = 20000
            received = 0
            peak = 0
            for i in range(n):
                rev = put(kv, b"s/%d" % (i % 100), value)
                if i % 1000 == 999:
                    kv.Compact(rpc_pb2.CompactionRequest(revision=rev), timeout=10)
                    while received < i + 1:  # the fast watcher keeps up
                        received += len(fast.next().events)
                    peak = max(peak, proc.memory_info().rss - rss_before)
            assert received == n
            assert peak < 40 * 1024 * 1024, f"server grew {peak / 2**20:.1f} MiB"
            # the slow watcher: whatever was buffered, then a compaction cancel
            got = 0
            while True:
                resp = slow.next()
                got += len(resp.events)
                if resp.canceled:
                    assert resp.watch_id == slow_id and resp.compact_revision > 0
                    break
            assert 0 < got < n
            slow.close()
            fast.close()
    finally:
        srv.stop()


def test_cancel_filters_prev_kv_and_txn_grouping(channel: grpc.Channel) -> None:
    kv = rpc_pb2_grpc.KVStub(channel)
    w = WatchClient(channel)
    a = w.create(key=b"f/a", prev_kv=True).watch_id
    b = w.create(key=b"f/", range_end=b"f0", filters=[rpc_pb2.WatchCreateRequest.NOPUT]).watch_id
    assert a != b
    put(kv, b"f/a", b"1")
    put(kv, b"f/a", b"2")
    kv.Txn(
        rpc_pb2.TxnRequest(
            success=[
                rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=b"f/a")),
                rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"f/b", value=b"x")),
            ]
        ),
        timeout=10,
    )
    r1, r2, r3 = w.next(), w.next(), w.next()
    assert (r1.watch_id, [e.kv.value for e in r1.events]) == (a, [b"1"])
    assert not r1.events[0].HasField("prev_kv")  # a create event has none
    assert (r2.watch_id, r2.events[0].prev_kv.value) == (a, b"1")
    # the txn's delete reaches both watchers; the NOPUT one sees only the delete
    rest = [r3, w.next()]
    by_id = {r.watch_id: r for r in rest}
    assert [e.type for e in by_id[a].events] == [kv_pb2.Event.DELETE]
    assert by_id[a].events[0].prev_kv.value == b"2"
    assert [(e.type, e.kv.key) for e in by_id[b].events] == [(kv_pb2.Event.DELETE, b"f/a")]
    w.send(rpc_pb2.WatchRequest(cancel_request=rpc_pb2.WatchCancelRequest(watch_id=a)))
    c = w.next()
    assert c.canceled and c.watch_id == a
    w.close()


def test_watch_from_compacted_revision_is_cancelled_with_compact_revision(
    channel: grpc.Channel,
) -> None:
    kv = rpc_pb2_grpc.KVStub(channel)
    old = put(kv, b"c/k", b"1")
    rev = put(kv, b"c/k", b"2")
    kv.Compact(rpc_pb2.CompactionRequest(revision=rev), timeout=10)
    w = WatchClient(channel)
    created = w.create(key=b"c/k", start_revision=old)
    resp = w.next()
    assert resp.canceled and resp.compact_revision == rev and resp.watch_id == created.watch_id
    w.close()


def test_progress_request_and_duplicate_ids(channel: grpc.Channel) -> None:
    kv = rpc_pb2_grpc.KVStub(channel)
    w = WatchClient(channel)
    w.create(key=b"p/k", watch_id=7)
    w.send(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"p/x", watch_id=7)))
    dup = w.next()
    assert dup.created and dup.canceled and dup.watch_id == -1
    assert dup.cancel_reason == "mvcc: duplicate watch ID provided on the WatchStream"
    rev = put(kv, b"other", b"v")
    w.send(rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest()))
    progress = w.next()
    assert progress.watch_id == -1 and not progress.events and progress.header.revision >= rev
    w.close()


def test_fragmented_response_reassembles(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "frag.etcd", extra_args=["--max-request-bytes", "4096"]).start()
    try:
        with grpc.insecure_channel(srv.endpoint) as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            w = WatchClient(ch)
            for i in range(10):
                put(kv, b"g/%d" % i, b"v" * 1000)
            # one delete of ten keys: one response of ten events whose prev_kvs
            # together exceed the 4 KiB limit
            w.create(key=b"g/", range_end=b"g0", fragment=True, prev_kv=True)
            kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"g/", range_end=b"g0"), timeout=10)
            parts = [w.next()]
            while parts[-1].fragment:
                parts.append(w.next())
            assert len(parts) > 1
            assert sum(len(p.events) for p in parts) == 10
            w.close()
    finally:
        srv.stop()
