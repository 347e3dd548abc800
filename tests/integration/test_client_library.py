"""The client library (`queue_server.client`, issue 17 item 8) against real
server processes: produce in batches, consume, ack, nack, extend, prefetch,
resume after a restart and across a leader failover, redrive of dead letters,
the CQS consumer with seed 000's error rule and ReEnqueue's Footer only on a
clean exit, and the blocking API.

One server serves the module (each test its own queue names), with a short CQS
visibility timeout so redelivery is seen in seconds. Restart and failover tests
start their own processes. Every wait is bounded; "nothing more is delivered"
is a wait that must time out, kept short.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from etcdserverpb import cqs_pb2, rpc_pb2, rpc_pb2_grpc
from queue_server.client import (
    Client,
    Consumer,
    ConsumerClosed,
    DeliveryLost,
    Message,
    NoDeliveryLease,
    SyncClient,
    produce_op,
)
from tests.integration.cqs_support import Cqs, unique
from tests.support.cluster import Cluster
from tests.support.processes import ServerProcess

pytestmark = pytest.mark.integration

WAIT = 15.0
"""Seconds any one expected delivery may take."""
QUIET = 1.0
"""Seconds a wait for a delivery that must not come lasts."""
VISIBILITY = "2s"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("client") / "node1.etcd",
        extra_args=["--cqs-visibility-timeout", VISIBILITY],
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cqs(server: ServerProcess) -> Iterator[Cqs]:
    with grpc.insecure_channel(server.endpoint) as ch:
        yield Cqs(ch)


def name(stem: str) -> str:
    return f"{stem}-{uuid.uuid4().hex[:8]}"


async def take(consumer: Consumer, n: int, timeout: float = WAIT) -> list[Message]:
    """The next `n` deliveries (failing the test if they do not come in time)."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        m = await consumer.get(max(0.0, deadline - time.monotonic()))
        assert m is not None, f"{len(out)} of {n} deliveries within {timeout}s"
        out.append(m)
    return out


async def depth(client: Client, queue: str) -> int:
    base = f"/q/{queue}/".encode()
    request = rpc_pb2.RangeRequest(key=base + b"0", range_end=base + b":", count_only=True)
    return int((await client.connection.range(request)).count)


async def wait_depth(client: Client, queue: str, want: int) -> None:
    deadline = time.monotonic() + WAIT
    while (got := await depth(client, queue)) != want:
        assert time.monotonic() < deadline, f"{queue} holds {got}, not {want}"
        await asyncio.sleep(0.05)  # poll replicated state, bounded


# -- the etcd-key queue ------------------------------------------------------------


async def test_produce_in_batches_consume_and_ack(server: ServerProcess) -> None:
    queue = name("batch")
    async with Client([server.endpoint]) as client:
        producer = client.producer(queue)
        values = [b"v%03d" % i for i in range(300)]
        revisions = await producer.send_batch([(f"k{i:03d}", v) for i, v in enumerate(values)])
        # 128 puts per Txn (the server's --max-txn-ops): three Txns, in order
        assert len(revisions) == 300
        assert [revisions.count(r) for r in sorted(set(revisions))] == [128, 128, 44]
        assert revisions == sorted(revisions)
        async with client.consumer(queue) as consumer:
            got: list[Message] = []
            async for m in consumer:  # at most 64 held (the default prefetch): ack as they come
                got.append(m)
                assert await m.ack()
                if len(got) == 300:
                    break
            assert [m.value for m in got] == values  # one consumer: idx order
            first = got[0]
            assert first.queue == queue
            assert first.key == first.message_key == f"/q/{queue}/0000000000000001/k000".encode()
            assert first.producer_key == b"k000" and first.idx == 1
            assert [m.create_revision for m in got] == revisions
            assert not await first.ack(), "a second ack deletes nothing"
        assert await depth(client, queue) == 0


async def test_nack_gives_back_and_it_is_redelivered(server: ServerProcess) -> None:
    queue = name("nack")
    async with Client(server.endpoint) as client:
        await client.configure(queue, ack_deadline=30)
        async with client.consumer(queue) as consumer:
            await client.producer(queue).send(b"work", key="job")
            (m,) = await take(consumer, 1)
            assert m.lease, "under an ack deadline a delivery carries a delivery lease"
            assert await m.nack()
            (again,) = await take(consumer, 1, timeout=10)  # long before the 30 s deadline
            assert (again.create_revision, again.value) == (m.create_revision, b"work")
            assert (m.delivery_count, again.delivery_count) == (1, 2)
            assert again.mod_revision > m.mod_revision  # the revision it was handed out at
            assert again.lease != m.lease
            with pytest.raises(DeliveryLost):
                await m.extend()  # the first delivery is over
            assert not await m.nack()
            assert await again.ack()


async def test_nack_and_extend_without_a_delivery_lease_raise_and_keep_the_message(
    server: ServerProcess,
) -> None:
    queue = name("nolease")
    async with Client(server.endpoint) as client:
        await client.configure(queue, ack_deadline=0)
        lease = await client.connection.call(
            lambda s: s.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=60), timeout=5)
        )
        async with client.consumer(queue) as consumer:
            await client.producer(queue).send(b"own lease", lease=lease.ID)
            (m,) = await take(consumer, 1)
            assert m.lease == lease.ID  # the message's own lease: never revoke it
            with pytest.raises(NoDeliveryLease):
                await m.nack()
            with pytest.raises(NoDeliveryLease):
                await m.extend()
            assert await depth(client, queue) == 1, "the message is still there"
            assert await m.ack()


async def test_extend_keeps_a_delivery_past_its_deadline(server: ServerProcess) -> None:
    queue = name("extend")
    async with Client(server.endpoint) as client:
        await client.configure(queue, ack_deadline=2)
        async with client.consumer(queue) as consumer:
            await client.producer(queue).send_batch(
                [("kept", b"a"), ("lapsed", b"b"), ("auto", b"c")]
            )
            kept, lapsed, auto = await take(consumer, 3)
            assert kept.producer_key == b"kept"
            start = time.monotonic()
            redelivered: list[Message] = []
            async with auto.extending():  # extended by a task, every third of the deadline
                while time.monotonic() - start < 5.0:  # over twice the deadline
                    for held in [kept, *redelivered]:
                        assert await held.extend() == 2
                    m = await consumer.get(0.6)  # under a third of the deadline
                    if m is not None:
                        redelivered.append(m)
            # the one not extended came back; the extended ones did not
            assert [m.create_revision for m in redelivered] == [lapsed.create_revision]
            assert await kept.ack(), "still held: its ack removes it"
            assert await auto.ack()
            assert await redelivered[0].ack()


async def test_prefetch_is_honoured(server: ServerProcess) -> None:
    queue = name("prefetch")
    async with (
        Client(server.endpoint) as client,
        client.consumer(queue, prefetch=2) as consumer,
    ):
        assert (await client.settings(queue))["prefetch"] == 2
        await client.producer(queue).send_batch([b"1", b"2", b"3", b"4", b"5"])
        first = await take(consumer, 2)
        assert await consumer.get(QUIET) is None, "a third before an ack"
        assert await first[0].ack()
        (third,) = await take(consumer, 1)
        assert third.value == b"3"
        assert await consumer.get(QUIET) is None
        assert await first[1].ack() and await third.ack()
        rest = await take(consumer, 2)
        assert [m.value for m in rest] == [b"4", b"5"]
    # closing gives back what the consumer held: the next consumer gets it
    async with Client(server.endpoint) as client, client.consumer(queue) as successor:
        again = await take(successor, 2)
        assert [m.create_revision for m in again] == [m.create_revision for m in rest]
        assert all([await m.ack() for m in again])


async def test_consumer_resumes_after_a_server_restart(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "node1.etcd").start()
    try:
        async with Client(srv.endpoint, retry_for=60) as client:
            queue = name("restart")
            async with client.consumer(queue) as consumer:
                await client.producer(queue).send(b"held", key="a")
                (held,) = await take(consumer, 1)
                srv.kill()
                srv.start()  # the same data dir and port
                await consumer.wait_watching(WAIT)
                # what it held and never acknowledged comes again on the new watch
                (again,) = await take(consumer, 1)
                assert (again.create_revision, again.value) == (held.create_revision, b"held")
                assert (held.delivery_count, again.delivery_count) == (1, 2)
                assert consumer.watches == 2
                await client.producer(queue).send(b"after", key="b")
                (after,) = await take(consumer, 1)
                assert after.value == b"after"
                assert await again.ack() and await after.ack()
                assert await depth(client, queue) == 0
    finally:
        srv.stop()


async def test_consumer_and_producer_go_on_across_a_leader_failover(cluster: Cluster) -> None:
    leader = cluster.wait_leader()
    others = [m for m in cluster.members if m is not leader]
    # the leader first: the consumer watches there and the producer writes there
    endpoints = [leader.endpoint, *(m.endpoint for m in others)]
    queue = name("failover")
    async with Client(endpoints, retry_for=60) as client:
        producer = client.producer(queue)
        async with client.consumer(queue) as consumer:
            assert consumer.endpoint == leader.endpoint
            await producer.send_batch([b"before-%d" % i for i in range(5)])
            for before in await take(consumer, 5):
                assert await before.ack()
            await producer.send(b"held")
            held = await take(consumer, 1)
            leader.kill()
            # the producer's next Txn moves on to a live member
            after = [b"after-%d" % i for i in range(20)]
            await producer.send_batch(after)
            await consumer.wait_watching(WAIT)
            assert consumer.endpoint in {m.endpoint for m in others}
            want = {b"held", *after}
            seen: set[bytes] = set()
            deadline = time.monotonic() + 3 * WAIT
            while not want <= seen:
                m = await consumer.get(max(0.0, deadline - time.monotonic()))
                assert m is not None, f"never delivered after the failover: {want - seen}"
                seen.add(m.value)
                # a message key, or the handed-over key of a non-dispatching member
                assert m.message_key == f"/q/{queue}/{m.idx:016d}/".encode() + m.producer_key
                assert m.key in (m.message_key, consumer.key + m.message_key[len(queue) + 3 :])
                await m.ack()
            assert held[0].value == b"held"
            await wait_depth(client, queue, 0)


async def test_redrive_moves_dead_letters_back(server: ServerProcess) -> None:
    queue = name("redrive")
    async with Client(server.endpoint) as client:
        await client.configure(queue, ack_deadline=30, max_deliveries=1)
        async with client.consumer(queue) as consumer:
            await client.producer(queue).send_batch([("x", b"1"), ("y", b"2"), ("z", b"3")])
            for m in await take(consumer, 3):
                assert await m.nack()  # one failed delivery: dead-lettered
            await wait_depth(client, f"{queue}.dead", 3)
            assert await depth(client, queue) == 0
            assert await client.redrive(queue, limit=1) == 1  # oldest first
            (back,) = await take(consumer, 1)
            assert (back.producer_key, back.value, back.delivery_count) == (b"x", b"1", 1)
            assert back.create_revision > 0 and back.message_key.startswith(f"/q/{queue}/".encode())
            assert await client.redrive(queue) == 2
            rest = await take(consumer, 2)
            assert sorted(m.value for m in [back, *rest]) == [b"1", b"2", b"3"]
            assert await depth(client, f"{queue}.dead") == 0
            assert await client.redrive(queue) == 0
            for m in [back, *rest]:
                assert await m.ack()


async def test_redrive_reads_the_dead_letter_setting(server: ServerProcess) -> None:
    queue, dead = name("redrive-named"), name("parking")
    async with Client(server.endpoint) as client:
        await client.configure(queue, ack_deadline=30, max_deliveries=1, dead_letter=dead)
        async with client.consumer(queue) as consumer:
            await client.producer(queue).send(b"v", key="k")
            (m,) = await take(consumer, 1)
            assert await m.nack()
            await wait_depth(client, dead, 1)
            assert await client.redrive(queue) == 1
            (back,) = await take(consumer, 1)
            assert back.value == b"v"
            assert await back.ack()


async def test_ack_with_is_exactly_once(server: ServerProcess) -> None:
    queue, out = name("txn-in"), name("txn-out")
    async with Client(server.endpoint) as client:
        async with client.consumer(queue) as consumer:
            await client.producer(queue).send(b"order", key="o1")
            (m,) = await take(consumer, 1)
            assert await m.ack_with(produce_op(out, "o1", b"invoice"))
            assert not await m.ack_with(produce_op(out, "o1", b"invoice"))  # a redelivery
        assert await depth(client, out) == 1


async def test_closing_the_client_ends_its_consumers(server: ServerProcess) -> None:
    client = Client(server.endpoint)
    consumer = await client.consumer(name("closing")).start()
    await client.close()
    with pytest.raises(ConsumerClosed):
        await asyncio.wait_for(consumer.get(), WAIT)
    await consumer.close()
    with pytest.raises(ConsumerClosed):
        await consumer.get(0)


# -- CQS --------------------------------------------------------------------------


class Unavailable(grpc.RpcError):
    """What a downstream gRPC service raises when it is down."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


async def test_cqs_batch_acknowledges_by_the_seed_rule(server: ServerProcess, cqs: Cqs) -> None:
    queue, dto = unique("renderer"), unique("storeesl.v1")
    cqs.configure(queue, [dto])
    for i, kind in enumerate(["ok", "transient", "permanent"]):
        cqs.publish(dto, f"t/a/s/b/esls/{kind}", f"2026-06-01T10:00:0{i}Z")
    parked: list[str] = []

    def handler(n: cqs_pb2.DtoChangeNotification) -> None:
        if n.dto_id.endswith("transient"):
            raise RuntimeError("downstream") from Unavailable()
        if n.dto_id.endswith("permanent"):
            raise ValueError("bad data")

    async def park(n: cqs_pb2.DtoChangeNotification, error: BaseException) -> None:
        parked.append(n.dto_id)

    async with Client(server.endpoint) as client:
        consumer = client.cqs(queue, max_notifications=10, wait_ms=5000)
        outcome = await consumer.process(handler, on_permanent=park)
        assert len(outcome.notifications) == 3
        assert [n.dto_id.rsplit("/", 1)[1] for n in outcome.acknowledged] == ["ok", "permanent"]
        assert [n.dto_id for n, _ in outcome.transient] == ["t/a/s/b/esls/transient"]
        assert [type(e) for _, e in outcome.permanent] == [ValueError]
        assert parked == ["t/a/s/b/esls/permanent"]
        # only the transient one comes back, after the visibility timeout
        again = await consumer.dequeue(wait_ms=8000)
        assert [n.dto_id for n in again] == ["t/a/s/b/esls/transient"]
        await consumer.acknowledge([n.ack_token for n in again])
        assert await consumer.dequeue(wait_ms=2500) == []


async def test_cqs_reenqueue_sends_the_footer_only_on_a_clean_exit(
    server: ServerProcess, cqs: Cqs
) -> None:
    queue, dto = unique("splitter"), unique("design.v1")
    cqs.configure(queue, [dto])
    cqs.publish(dto, "t/a/designs/d1", "2026-06-01T10:00:00Z", tracking_id="trk")
    async with Client(server.endpoint) as client:
        consumer = client.cqs(queue, wait_ms=5000)
        (original,) = await consumer.dequeue()

        with pytest.raises(RuntimeError, match="listing the stores failed"):
            async with consumer.re_enqueue(original) as split:
                await split.add_parent("eslimage.v1", "t/a/s/s1/esls")
                raise RuntimeError("listing the stores failed")
        # no Footer: the original is still held (a Header-only probe is CANCELLED)
        assert cqs.token_status(queue, original.ack_token) == grpc.StatusCode.CANCELLED

        async with consumer.re_enqueue(original) as split:
            await split.add_parent("eslimage.v1", "t/a/s/s1/esls")
            await split.add_all(
                cqs_pb2.SplitItem(dto_type="eslimage.v1", parent_id=f"t/a/s/s{i}/esls")
                for i in (2, 3)
            )
        assert split.response is not None and split.response.acknowledged
        assert split.response.items_enqueued >= 2
        assert cqs.token_status(queue, original.ack_token) == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as refused:
            async with consumer.re_enqueue(original) as late:
                await late.add_dto("eslimage.v1", "t/a/s/s9/esls/1")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        items = await consumer.dequeue(max_notifications=10, prefix_depth=2, wait_ms=0)
        assert sorted(n.parent_id for n in items) == [f"t/a/s/s{i}/esls" for i in (1, 2, 3)]
        assert {n.tracking_id for n in items} == {"trk"}  # inherited from the original
        await consumer.acknowledge([n.ack_token for n in items])


# -- the blocking API --------------------------------------------------------------


def test_sync_api_produce_consume_ack_nack_and_cqs(server: ServerProcess, cqs: Cqs) -> None:
    queue = name("sync")
    with SyncClient(server.endpoint) as client:
        client.configure(queue, ack_deadline=30)
        with client.consumer(queue) as consumer:
            revisions = client.producer(queue).send_batch([("a", b"1"), ("b", b"2")])
            got = []
            for m in consumer:
                got.append(m)
                if len(got) == 2:
                    break
            assert [m.value for m in got] == [b"1", b"2"]
            assert [m.create_revision for m in got] == revisions
            assert got[0].ack()
            with got[1].extending(every=0.1):
                assert consumer.get(0.3) is None
            assert got[1].extend() == 30
            assert got[1].nack()
            again = consumer.get(WAIT)
            assert again is not None and again.value == b"2"
            assert again.ack()
            assert consumer.get(QUIET) is None

        cq, dto = unique("sync-cqs"), unique("link.v2")
        cqs.configure(cq, [dto])
        cqs.publish(dto, "t/a/s/b/links/1", "2026-06-01T10:00:00Z")
        cqs.publish(dto, "t/a/s/b/links/2", "2026-06-01T10:00:01Z")
        consumer_cqs = client.cqs(cq, wait_ms=5000)
        first, second = consumer_cqs.dequeue(max_notifications=2)
        with pytest.raises(KeyError), consumer_cqs.re_enqueue(first) as split:
            split.add_dto("link.v2", "t/a/s/b/links/1/x")
            raise KeyError("stop")
        assert cqs.token_status(cq, first.ack_token) == grpc.StatusCode.CANCELLED
        with consumer_cqs.re_enqueue(first) as split:
            pass  # Header + Footer: acknowledges the original
        assert split.response is not None and split.response.acknowledged
        outcome = consumer_cqs.process(lambda n: None, batch=[second])
        assert outcome.tokens == [second.ack_token]
        assert cqs.token_status(cq, second.ack_token) == grpc.StatusCode.FAILED_PRECONDITION


def test_client_stub_sees_the_same_server(server: ServerProcess) -> None:
    """The library's keys are plain etcd keys: a produce is visible to any client."""
    queue = name("plain")
    with SyncClient(server.endpoint) as client:
        client.producer(queue).send(b"v", key="k")
    with grpc.insecure_channel(server.endpoint) as ch:
        found = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(key=f"/q/{queue}/0000000000000001/k".encode()), timeout=5
        )
    assert [kv.value for kv in found.kvs] == [b"v"]
