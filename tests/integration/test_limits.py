"""Limits, each with its error, and memory under floods from one client.

| limit | flag (default) | error |
|---|---|---|
| request size | --max-request-bytes (1.5 MiB) | INVALID_ARGUMENT "etcdserver: request is too large"; past it + 512 KiB the transport's RESOURCE_EXHAUSTED |
| ops per txn | --max-txn-ops (128) | INVALID_ARGUMENT "etcdserver: too many operations in txn request" |
| watchers per stream | --max-watchers-per-stream (10 000) | the create is answered created+canceled, watch_id -1, cancel_reason "mvcc: too many watchers on the WatchStream" |
| streams per connection | --max-concurrent-streams (no limit, as etcd) | none: HTTP/2 makes further calls wait on the client |
| queue depth | `max_depth` in /q/{name}/config (0: none) | RESOURCE_EXHAUSTED "etcdserver: queue {name} is full (max_depth N)" |

Floods measure the server's RSS (psutil) and bound its growth per object.
FLOOD_OBJECTS raises the flood sizes (e.g. 20000 leases; CI uses fewer, since
each grant is a log write).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.integration

MAX_REQUEST_BYTES = 4096
MAX_TXN_OPS = 8
DEFAULT_WATCHERS_PER_STREAM = 10_000
WATCH_FLOOD = 20_000
LEASE_FLOOD = int(os.environ.get("FLOOD_OBJECTS", "4000"))
BYTES_PER_WATCHER = 2048
"""Bound on RSS growth per watcher (measured: about 500 bytes)."""
BYTES_PER_LEASE = 2048
"""Bound on RSS growth per lease (measured: about 650 bytes)."""


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("limits") / "limits.etcd",
        extra_args=[
            "--max-request-bytes",
            str(MAX_REQUEST_BYTES),
            "--max-txn-ops",
            str(MAX_TXN_OPS),
            "--unsafe-no-fsync",  # the lease flood is log writes; fsync adds nothing here
        ],
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ch(limited: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(limited.endpoint) as channel:
        yield channel


def _code(e: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[grpc.StatusCode, str]:
    return e.value.code(), e.value.details() or ""


def test_request_too_large(ch: grpc.Channel) -> None:
    kv = rpc_pb2_grpc.KVStub(ch)
    kv.Put(rpc_pb2.PutRequest(key=b"small", value=b"x" * (MAX_REQUEST_BYTES - 100)), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
        kv.Put(rpc_pb2.PutRequest(key=b"big", value=b"x" * MAX_REQUEST_BYTES), timeout=5)
    assert _code(e) == (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large")
    with pytest.raises(grpc.RpcError) as e:  # past gRPC's margin: the transport refuses
        kv.Put(rpc_pb2.PutRequest(key=b"huge", value=b"x" * (600 * 1024)), timeout=5)
    assert _code(e)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_too_many_txn_ops(ch: grpc.Channel) -> None:
    kv = rpc_pb2_grpc.KVStub(ch)

    def txn(n: int) -> rpc_pb2.TxnRequest:
        ops = [
            rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"t%d" % i, value=b"v"))
            for i in range(n)
        ]
        return rpc_pb2.TxnRequest(success=ops)

    assert kv.Txn(txn(MAX_TXN_OPS), timeout=5).succeeded
    with pytest.raises(grpc.RpcError) as e:
        kv.Txn(txn(MAX_TXN_OPS + 1), timeout=5)
    assert _code(e) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "etcdserver: too many operations in txn request",
    )


def test_queue_max_depth(ch: grpc.Channel) -> None:
    kv = rpc_pb2_grpc.KVStub(ch)
    kv.Put(rpc_pb2.PutRequest(key=b"/q/lim/config", value=json.dumps({"max_depth": 2}).encode()))
    for i in range(2):
        kv.Put(rpc_pb2.PutRequest(key=b"/q/lim/p/m%d" % i, value=b"m"), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
        kv.Put(rpc_pb2.PutRequest(key=b"/q/lim/p/m2", value=b"m"), timeout=5)
    assert _code(e) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "etcdserver: queue lim is full (max_depth 2)",
    )


def _rss(server: ServerProcess) -> int:
    assert server.proc is not None
    return int(psutil.Process(server.proc.pid).memory_info().rss)


def test_watch_create_flood_is_limited_per_stream(limited: ServerProcess, ch: grpc.Channel) -> None:
    """WATCH_FLOOD creates on one stream: the first 10 000 are watchers, the rest
    are refused with etcd-style cancel responses; memory stays under the bound."""
    creates = [
        rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"w%d" % i))
        for i in range(WATCH_FLOOD)
    ]
    done = False

    def requests() -> Iterator[rpc_pb2.WatchRequest]:
        yield from creates
        deadline = time.monotonic() + 60
        while not done and time.monotonic() < deadline:
            time.sleep(0.05)

    before = _rss(limited)
    stream = rpc_pb2_grpc.WatchStub(ch).Watch(requests(), timeout=120)
    created = refused = 0
    try:
        for resp in stream:
            if resp.canceled:
                assert resp.watch_id == -1
                assert resp.cancel_reason == "mvcc: too many watchers on the WatchStream"
                refused += 1
            elif resp.created:
                created += 1
            if created + refused == WATCH_FLOOD:
                break
        growth = _rss(limited) - before
    finally:
        done = True
        stream.cancel()
    assert created == DEFAULT_WATCHERS_PER_STREAM
    assert refused == WATCH_FLOOD - DEFAULT_WATCHERS_PER_STREAM
    print(f"\nwatch flood: {growth / created:.0f} bytes of RSS per watcher")
    assert growth < BYTES_PER_WATCHER * created


def test_lease_grant_flood_memory_is_bounded_per_lease(
    limited: ServerProcess, ch: grpc.Channel
) -> None:
    """Leases are replicated state with no count limit in etcd; their memory is
    bounded per lease, and in total by the space quota (64 bytes each)."""
    lease = rpc_pb2_grpc.LeaseStub(ch)
    before = _rss(limited)
    pending = []
    for _ in range(LEASE_FLOOD):
        pending.append(lease.LeaseGrant.future(rpc_pb2.LeaseGrantRequest(TTL=3600), timeout=60))
        if len(pending) >= 256:
            for f in pending:
                f.result()
            pending = []
    for f in pending:
        f.result()
    growth = _rss(limited) - before
    print(f"\nlease flood: {growth / LEASE_FLOOD:.0f} bytes of RSS per lease")
    assert growth < BYTES_PER_LEASE * LEASE_FLOOD
    assert len(lease.LeaseLeases(rpc_pb2.LeaseLeasesRequest(), timeout=10).leases) >= LEASE_FLOOD


def test_max_concurrent_streams_makes_further_calls_wait(tmp_path: Path) -> None:
    """--max-concurrent-streams 2: with two Watch streams open on a connection, a
    third call on it waits (HTTP/2 flow control, as with etcd) and goes through
    once a stream closes; another connection is not affected."""
    srv = ServerProcess(tmp_path / "streams.etcd", extra_args=["--max-concurrent-streams", "2"])
    srv.start()
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
    release = threading.Event()

    def held_open() -> Iterator[rpc_pb2.WatchRequest]:
        yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"a"))
        release.wait(30)  # a half-close would end the Watch: stay open until released

    try:
        with grpc.insecure_channel(srv.endpoint, options=options) as channel:
            watch = rpc_pb2_grpc.WatchStub(channel)
            kv = rpc_pb2_grpc.KVStub(channel)
            kv.Range(rpc_pb2.RangeRequest(key=b"a"), timeout=5)
            streams = []
            for _ in range(2):
                s = watch.Watch(held_open(), timeout=30)
                assert next(s).created
                streams.append(s)
            with pytest.raises(grpc.RpcError) as e:
                kv.Range(rpc_pb2.RangeRequest(key=b"a"), timeout=1)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with grpc.insecure_channel(srv.endpoint, options=options) as other:
                rpc_pb2_grpc.KVStub(other).Range(rpc_pb2.RangeRequest(key=b"a"), timeout=5)
            streams[0].cancel()
            kv.Range(rpc_pb2.RangeRequest(key=b"a"), timeout=5)
            streams[1].cancel()
    finally:
        release.set()
        srv.stop()
