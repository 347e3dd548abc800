"""etcd-key queue consumers behind etcd's own `grpc-proxy` (Debian's etcd 3.4).

The proxy shares one upstream watch among the clients watching the same key,
and it passes an event on only if its revision is not older than what that
client's watch has already seen (or, for a new watch, than the revision it was
created at). So:

- a message produced before its consumer's watch (a backlog) and a message given
  back and delivered again must carry a revision newer than the watch has seen,
  or the proxy drops it: deliveries carry the revision they were handed out at;
- a consumer that goes away while another client of the proxy still watches the
  same key is invisible to the server (the upstream watch stays): its messages
  come back at their ack deadline, which every queue has by default (30 s);
- LeaseKeepAlive on a delivery's lease, through the proxy, keeps the message.

Every wait is bounded; the proxy and the server are ended by their pids.
"""

from __future__ import annotations

import queue
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.servers import free_port
from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.integration.test_queue import (
    PUT,
    WatchStream,
    configure,
    consumer_key,
    depth,
    new_id,
    produce,
    suffix_of,
)
from tests.support.processes import ServerProcess, terminate, wait_ready

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="needs Debian's etcd-server"),
]

WAIT = 10.0
STREAM_SECONDS = 60.0


class GrpcProxy:
    """`etcd grpc-proxy start` in front of one endpoint, on a port of its own."""

    def __init__(self, upstream: str, workdir: Path) -> None:
        self.port = free_port()
        self.log_path = workdir / "grpc-proxy.log"
        cmd = [
            "etcd",
            "grpc-proxy",
            "start",
            f"--endpoints={upstream}",
            f"--listen-addr=127.0.0.1:{self.port}",
            f"--data-dir={workdir / 'proxy.data'}",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        wait_ready(self.endpoint, self.proc)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        terminate(self.proc)


@pytest.fixture(scope="module")
def proxy(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcProxy]:
    p = GrpcProxy(server.endpoint, tmp_path_factory.mktemp("grpc-proxy"))
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def kv(server: ServerProcess) -> Iterator[rpc_pb2_grpc.KVStub]:
    """Writes straight to the server (producers need no proxy)."""
    with server.channel() as ch:
        yield rpc_pb2_grpc.KVStub(ch)


def through(proxy: GrpcProxy) -> grpc.Channel:
    """A client connection of its own to the proxy (one per consumer, as separate
    processes would have)."""
    return grpc.insecure_channel(proxy.endpoint)


def test_backlog_and_acks_pass_the_proxy(proxy: GrpcProxy, kv: rpc_pb2_grpc.KVStub) -> None:
    """Messages produced before the consumer's watch reach it through the proxy,
    each delivery newer than the last, and deletes through the proxy ack them."""
    name = b"px-backlog"
    configure(kv, name, prefetch=1)  # one at a time: each ack hands out the next
    for i in range(3):
        produce(kv, name, b"m%d" % i)
    with through(proxy) as ch:
        stream = WatchStream(ch)
        try:
            stream.watch(consumer_key(name, new_id()))
            proxied_kv = rpc_pb2_grpc.KVStub(ch)
            seen = []
            last = 0
            for _ in range(3):
                (delivery,) = stream.events(1)
                assert delivery.type == PUT
                assert delivery.kv.mod_revision > last  # never older than the last
                last = delivery.kv.mod_revision
                seen.append(suffix_of(delivery.kv.key))
                deleted = proxied_kv.DeleteRange(
                    rpc_pb2.DeleteRangeRequest(key=delivery.kv.key), timeout=WAIT
                ).deleted
                assert deleted == 1
            assert seen == [b"m0", b"m1", b"m2"]
            assert depth(kv, name) == 0
        finally:
            stream.close()


def test_consumer_that_leaves_is_replaced(proxy: GrpcProxy, kv: rpc_pb2_grpc.KVStub) -> None:
    """A consumer behind the proxy takes a message and disconnects without an
    ack: the next consumer, also behind the proxy, gets it."""
    name = b"px-leave"
    with through(proxy) as first_ch:
        first = WatchStream(first_ch)
        first.watch(consumer_key(name, new_id()))
        produce(kv, name, b"job", b"payload")
        (taken,) = first.events(1)
        first.close()
    with through(proxy) as second_ch:
        second = WatchStream(second_ch)
        try:
            second.watch(consumer_key(name, new_id()))
            # the server sees the first go when the proxy cancels its upstream
            # watch; at the latest the default ack deadline (30 s) takes it back
            (again,) = second.events(1, timeout=45.0)
            assert (suffix_of(again.kv.key), again.kv.value) == (b"job", b"payload")
            assert again.kv.create_revision == taken.kv.create_revision
            assert again.kv.mod_revision > taken.kv.mod_revision
            assert again.kv.version == 2  # it came back once
        finally:
            second.close()


def test_hidden_departure_comes_back_at_the_ack_deadline(
    proxy: GrpcProxy, kv: rpc_pb2_grpc.KVStub
) -> None:
    """Two clients of the proxy watch the same consumer key: one upstream watch.
    When the one doing the work goes, the server cannot see it; the message comes
    back at its ack deadline and is delivered again, and the proxy passes the
    redelivery on to the client still watching."""
    name = b"px-hidden"
    configure(kv, name, ack_deadline=2)
    key = consumer_key(name, new_id())
    with through(proxy) as watcher_ch, through(proxy) as worker_ch:
        watcher = WatchStream(watcher_ch)
        worker = WatchStream(worker_ch)
        try:
            watcher.watch(key)
            worker.watch(key)
            produce(kv, name, b"job")
            (first,) = worker.events(1)
            worker.close()  # gone without an ack; the upstream watch stays
            t0 = time.monotonic()
            events = watcher.events(1)
            if events[0].kv.mod_revision == first.kv.mod_revision:
                events = watcher.events(1, timeout=WAIT)  # the first delivery, seen too
            (redelivered,) = events
            # not sooner than the deadline: the server never saw the worker go
            assert time.monotonic() - t0 > 1.0
            assert redelivered.kv.create_revision == first.kv.create_revision
            assert redelivered.kv.mod_revision > first.kv.mod_revision
            assert redelivered.kv.version == 2
        finally:
            worker.close()
            watcher.close()


def test_keepalive_through_the_proxy_keeps_the_message(
    proxy: GrpcProxy, kv: rpc_pb2_grpc.KVStub
) -> None:
    """LeaseKeepAlive on the delivery's lease, sent through the proxy, starts
    the deadline over: the message stays with its consumer well past it."""
    name = b"px-keep"
    configure(kv, name, ack_deadline=1)
    with through(proxy) as ch:
        stream = WatchStream(ch)
        try:
            stream.watch(consumer_key(name, new_id()))
            produce(kv, name, b"long-job")
            (delivery,) = stream.events(1)
            delivery_lease = delivery.kv.lease
            assert delivery_lease
            requests: queue.Queue[rpc_pb2.LeaseKeepAliveRequest | None] = queue.Queue()
            answers = rpc_pb2_grpc.LeaseStub(ch).LeaseKeepAlive(
                iter(requests.get, None), timeout=STREAM_SECONDS
            )
            end = time.monotonic() + 4.0  # four deadlines
            try:
                while time.monotonic() < end:
                    requests.put(rpc_pb2.LeaseKeepAliveRequest(ID=delivery_lease))
                    answer = next(answers)
                    kept, ttl = answer.ID, answer.TTL
                    assert (kept, ttl) == (delivery_lease, 1)
                    time.sleep(0.3)  # a client's keepalive period: a third of the TTL
            finally:
                requests.put(None)
            # still ours: the ack deletes it, and nothing was delivered again
            assert stream.responses.empty()
            deleted = rpc_pb2_grpc.KVStub(ch).DeleteRange(
                rpc_pb2.DeleteRangeRequest(key=delivery.kv.key), timeout=WAIT
            )
            assert deleted.deleted == 1
        finally:
            stream.close()
