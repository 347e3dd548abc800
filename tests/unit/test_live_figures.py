"""Live queue figures, in-process on a fake clock (issue 17, items 1 and 2).

- CQS visibility expiry is time-driven: the node's `VisibilityTimer` proposes
  it once a notification's visibility passes, with no CQS call, and the
  figures (`queue_stats`, the Prometheus collector) change; only a member that
  may propose does.
- The produce time of an etcd-key queue message is replicated state: the
  command's `now_ms` (a Put's, or its Txn's), kept per message, carried into
  the dead-letter queue, dropped with the message, and through a snapshot.
"""

from __future__ import annotations

import json

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from etcdserverpb import snapshot_pb2 as pb
from queue_server.apply import StateMachine
from queue_server.metrics import Membership, ServerMetrics, StateCollector
from queue_server.queue_stats import COUNTERS, cqs_queue_stats, etcd_queue_stats
from queue_server.storage import snapshot, snapshot_codec
from tests.support.node_harness import FakeClock, Node, replay

pytestmark = pytest.mark.unit

Command = internal_pb2.Command
SLA = "1970-01-01T00:15:00Z"  # 900 s: before the fake clock's 1000 s


def wall_ms(node: Node) -> int:
    return node.timers.wall_ms()


def metric(node: Node, line_start: str) -> float:
    """One sample of this node's /metrics text."""
    metrics = ServerMetrics()
    metrics.watch_state(StateCollector(node.state, Membership(lambda: 1, 1, lambda: 0), node.clock))
    for line in metrics.render().decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {line_start}")


async def cqs_queue_with_one_in_flight(node: Node, visibility_ms: int) -> str:
    """A CQS queue `v` whose one notification was dequeued at the fake clock's
    now, invisible for `visibility_ms`; returns its ack token."""
    config = {"cqs": {"subscriptions": [{"dto_type": "order"}]}}
    await node.put(b"/q/v/config", json.dumps(config).encode())
    await node.put(
        b"/q/dto:order/p/k", json.dumps({"dto_id": "t/1", "sla_timestamp": SLA}).encode()
    )
    now = wall_ms(node)
    dequeue = Command(
        cqs_dequeue=internal_pb2.CqsDequeue(
            queue="v", max=1, depth=-1, now_ms=now, visible_until_ms=now + visibility_ms
        )
    )
    result = await node.log.propose(dequeue)
    assert isinstance(result, internal_pb2.CqsDequeueResponse)
    (n,) = result.notifications
    return n.ack_token


async def test_visibility_expiry_fires_from_the_timer_with_no_call() -> None:
    node = Node()
    token = await cqs_queue_with_one_in_flight(node, visibility_ms=2000)
    (row,) = cqs_queue_stats(node.state, node.clock())
    assert (row["pending"], row["in_flight"], row["sla_lag_s"]) == (0, 1, None)
    entries = len(node.log.entries)

    await node.tick(1.0)
    await node.tick(0.95)  # 1.95 s: still in flight, nothing proposed
    assert len(node.log.entries) == entries
    assert metric(node, 'queue_server_cqs_in_flight{queue="v"}') == 1

    await node.tick(0.1)  # 2.05 s: the timer proposes the expiry
    (row,) = cqs_queue_stats(node.state, node.clock())
    assert (row["pending"], row["in_flight"]) == (1, 0)
    assert row["sla_lag_s"] is not None and row["sla_lag_s"] > 0
    assert metric(node, 'queue_server_cqs_pending{queue="v"}') == 1
    assert metric(node, 'queue_server_cqs_in_flight{queue="v"}') == 0
    assert metric(node, 'queue_server_cqs_sla_lag_seconds{queue="v"}') > 0

    # one command, stamped with the proposer's clock: a replica applies the same
    (expire,) = [Command.FromString(e) for e in node.log.entries[entries:]]
    assert expire.WhichOneof("op") == "cqs_settle"
    assert list(expire.cqs_settle.tokens) == []
    assert expire.cqs_settle.now_ms == wall_ms(node)
    assert node.state.cqs.queues["v"].tree.held(token, wall_ms(node)) is None
    replayed, _ = replay(node.log.entries)
    assert replayed.export_state() == node.state.export_state()

    await node.tick(1.0)  # nothing more is due: no more proposals
    assert len(node.log.entries) == entries + 1


async def test_an_acknowledged_notification_is_not_expired() -> None:
    node = Node()
    token = await cqs_queue_with_one_in_flight(node, visibility_ms=1000)
    await node.log.propose(
        Command(cqs_settle=internal_pb2.CqsSettle(queue="v", tokens=[token], now_ms=wall_ms(node)))
    )
    entries = len(node.log.entries)
    await node.tick(1.5)
    assert len(node.log.entries) == entries  # nothing in flight: nothing to propose
    (row,) = cqs_queue_stats(node.state, node.clock())
    assert (row["pending"], row["in_flight"]) == (0, 0)


async def test_a_member_that_may_not_propose_leaves_expiry_to_the_leader() -> None:
    node = Node()
    await cqs_queue_with_one_in_flight(node, visibility_ms=500)
    leader = [False]
    node.cqs_expiry.may_propose = lambda: leader[0]  # as the server wires a cluster member
    entries = len(node.log.entries)
    await node.tick(1.0)
    assert len(node.log.entries) == entries
    assert node.state.cqs.queues["v"].tree.in_flight == 1
    leader[0] = True  # it became the leader
    await node.tick(0.2)
    assert node.state.cqs.queues["v"].tree.in_flight == 0


# -- produce times --------------------------------------------------------------------


def put(key: bytes, value: bytes, now_ms: int) -> Command:
    return Command(put=rpc_pb2.PutRequest(key=key, value=value), now_ms=now_ms)


def test_a_put_stamps_its_message_and_a_txn_put_the_txns_time() -> None:
    sm = StateMachine()
    sm.apply(1, put(b"/q/jobs/p/a", b"1", 1_000_000))
    txn = rpc_pb2.TxnRequest(
        success=[
            rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"/q/jobs/p/b", value=b"2")),
            rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"/queue/jobs/producer/c")),
        ]
    )
    sm.apply(2, Command(txn=txn, now_ms=1_002_000))
    sm.apply(3, Command(put=rpc_pb2.PutRequest(key=b"/q/jobs/p/d")))  # unstamped (old entry)
    q = sm.queues.queues[b"jobs"]
    assert q.produced_ms == {1: 1_000_000, 2: 1_002_000, 3: 1_002_000}
    (row,) = etcd_queue_stats(sm, 1_005.5)
    assert row["oldest_pending_age_s"] == 5.5
    # the oldest goes: the next one's age, and a deleted message keeps no stamp
    sm.apply(4, Command(delete_range=rpc_pb2.DeleteRangeRequest(key=q.pending.peekitem(0)[1])))
    assert 1 not in q.produced_ms
    (row,) = etcd_queue_stats(sm, 1_005.5)
    assert row["oldest_pending_age_s"] == 3.5
    # never negative when this member's clock is behind the proposer's
    (row,) = etcd_queue_stats(sm, 1_001.0)
    assert row["oldest_pending_age_s"] == 0.0


def test_a_dead_letter_keeps_its_produce_time() -> None:
    sm = StateMachine()
    sm.apply(1, put(b"/q/dl/config", json.dumps({"max_deliveries": 1}).encode(), 5_000))
    sm.apply(2, put(b"/q/dl/c/" + b"0" * 8 + b"-0000-4000-8000-" + b"0" * 12, b"node", 6_000))
    sm.apply(3, put(b"/q/dl/p/m", b"body", 7_000))
    q = sm.queues.queues[b"dl"]
    assert q.holder, "assigned to the consumer"
    (slot,) = q.consumers.values()
    requeue = internal_pb2.QueueRequeue(queue=b"dl", consumer=slot.consumer_id, idx=[1])
    sm.apply(4, Command(queue_requeue=requeue, now_ms=99_000))
    dead = sm.queues.queues[b"dl.dead"]
    assert dead.produced_ms == {1: 7_000} and q.produced_ms == {}


def test_produce_times_survive_a_snapshot_round_trip() -> None:
    sm = StateMachine()
    stamps = [1_700_000_000_000, 1_700_000_000_500, 1_699_999_999_000, 1_700_000_003_000]
    for i, ms in enumerate(stamps, 1):
        sm.apply(i, put(b"/q/s/p/m%d" % i, b"x", ms))
    sm.apply(5, put(b"/q/s/p/unstamped", b"x", 0))
    second = sm.queues.queues[b"s"].pending[2]
    sm.apply(6, Command(delete_range=rpc_pb2.DeleteRangeRequest(key=second)))
    state = sm.export_state()
    data = snapshot.encode(sm.applied_index, state)
    got = snapshot.decode(data, "test")
    assert got.state == state
    again = StateMachine()
    again.restore_state(got.state)
    q = again.queues.queues[b"s"]
    assert q.produced_ms == {1: stamps[0], 3: stamps[2], 4: stamps[3]}
    wall = 1_700_000_010.0

    def replicated(rows: list[dict[str, object]]) -> list[dict[str, object]]:
        """The rows without the counters, which count since the process started."""
        return [{k: v for k, v in row.items() if k not in COUNTERS} for row in rows]

    assert replicated(etcd_queue_stats(again, wall)) == replicated(etcd_queue_stats(sm, wall))
    assert etcd_queue_stats(again, wall)[0]["oldest_pending_age_s"] == 10.0


def test_produce_times_go_in_chunks_and_broken_ones_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sm = StateMachine()
    for i in range(1, 6):
        sm.apply(i, put(b"/q/s/p/m%d" % i, b"x", 10 * i))
    state = sm.export_state()
    monkeypatch.setattr(snapshot_codec, "PRODUCED_PER_CHUNK", 2)
    records = list(snapshot_codec.encode_records(5, state, 0, ()))
    chunks = [r.queue_chunk for r in records if r.WhichOneof("body") == "queue_chunk"]
    assert [list(c.produced_idx_delta) for c in chunks] == [[1, 1], [3, 1], [5]]
    assert [list(c.produced_ms_delta) for c in chunks] == [[10, 10], [30, 10], [50]]
    assert snapshot.decode(snapshot.encode(5, state), "test").state == state

    def refused(records: list[pb.Record]) -> None:
        reader = snapshot_codec.StateReader()
        with pytest.raises(snapshot_codec.SnapshotFormatError):
            for r in records:
                reader.add(r)
            reader.finish()

    def with_chunk(i: int, idx: list[int], ms: list[int]) -> list[pb.Record]:
        out = [pb.Record() for _ in records]
        for o, r in zip(out, records, strict=True):
            o.CopyFrom(r)
        chunk = [r for r in out if r.WhichOneof("body") == "queue_chunk"][i].queue_chunk
        chunk.ClearField("produced_idx_delta")
        chunk.ClearField("produced_ms_delta")
        chunk.produced_idx_delta.extend(idx)
        chunk.produced_ms_delta.extend(ms)
        return out

    refused(with_chunk(0, [1, 0], [10, 10]))  # an index twice
    refused(with_chunk(1, [2, 1], [30, 10]))  # not after the chunk before
    refused(with_chunk(2, [5], []))  # lists of two lengths
    refused([r for r in records if r.queue_chunk != chunks[1]])  # a chunk lost
    queue_at = next(i for i, r in enumerate(records) if r.WhichOneof("body") == "queue")
    refused(records[:queue_at] + records[queue_at + 1 :])  # times before any queue


def test_fake_clock_is_both_faces_of_the_timers() -> None:
    node = Node(FakeClock(1234.5))
    assert node.timers.wall_ms() == 1_234_500
