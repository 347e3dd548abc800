"""Fail-stop: an apply that raises what no request should (a bug, injected here)
leaves no partial write visible, and the member stops applying and serving; it
never half-applies and goes on. Admission: past MAX_UNAPPLIED proposals waiting,
etcd's `too many requests`, with memory bounded and the log fine afterwards.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.admission import MAX_UNAPPLIED
from queue_server.apply import Applier, ApplyFailed, StateMachine
from queue_server.errors import ServerStopped, TooManyRequests
from queue_server.keyspace.grammar import QueueKey
from queue_server.local_log import LocalLog

pytestmark = pytest.mark.unit

Command = internal_pb2.Command


def put(key: bytes, value: bytes = b"v") -> Command:
    return Command(put=rpc_pb2.PutRequest(key=key, value=value))


def txn_of(*commands: Command) -> Command:
    txn = rpc_pb2.TxnRequest()
    for c in commands:
        txn.success.add().request_put.CopyFrom(c.put)
    return Command(txn=txn)


def break_produce(sm: StateMachine, bad: bytes) -> None:
    """Inject a bug: producing message `bad` raises inside apply."""
    real = sm.queues.produce

    def produce(qk: QueueKey, value: bytes) -> bytes:
        if qk.key == bad:
            raise RuntimeError("injected")
        return real(qk, value)

    sm.queues.produce = produce  # type: ignore[method-assign]


def test_a_failing_apply_rolls_its_write_back_and_stops_the_machine() -> None:
    sm = StateMachine()
    sm.apply(1, put(b"/before"))
    revision = sm.store.revision
    digest = sm.store.hash_kv()
    break_produce(sm, b"boom")
    # the Txn's first put is made before the produce fails
    with pytest.raises(ApplyFailed) as failed:
        sm.apply(2, txn_of(put(b"/partial"), put(b"/q/jobs/p/boom")))
    assert failed.value.index == 2
    assert sm.store.get(b"/partial") is None
    assert sm.store.revision == revision and sm.store.hash_kv() == digest
    with pytest.raises(ServerStopped):
        sm.read_range(rpc_pb2.RangeRequest(key=b"/before"))
    with pytest.raises(ApplyFailed):
        sm.apply(3, put(b"/after"))
    assert sm.store.get(b"/after") is None


async def test_the_local_log_stops_on_a_failed_apply_and_a_restart_refuses(
    tmp_path: Path,
) -> None:
    sm = StateMachine()
    fatal: list[ApplyFailed] = []
    log = LocalLog(str(tmp_path), Applier(sm, on_fatal=fatal.append), fsync=False)
    log.recover()
    assert not isinstance(await log.propose(put(b"/ok")), Exception)
    break_produce(sm, b"boom")
    results = await asyncio.gather(
        log.propose(put(b"/q/jobs/p/boom")),
        log.propose(put(b"/queued-behind")),
        return_exceptions=True,
    )
    assert [type(r) for r in results] == [ServerStopped, ServerStopped]
    assert len(fatal) == 1 and fatal[0].index == 2
    with pytest.raises(ServerStopped):
        await log.propose(put(b"/later"))
    assert sm.store.get(b"/queued-behind") is None
    await log.close()

    # the entry is durable: a restart replays it, and refuses to start
    again = StateMachine()
    break_produce(again, b"boom")
    with pytest.raises(ApplyFailed):
        LocalLog(str(tmp_path), Applier(again), fsync=False).recover()


async def test_a_flood_of_proposals_gets_too_many_requests_then_recovers(
    tmp_path: Path,
) -> None:
    sm = StateMachine()
    log = LocalLog(str(tmp_path), Applier(sm), fsync=False)
    log.recover()
    flood = MAX_UNAPPLIED + 1000
    results = await asyncio.gather(
        *(log.propose(put(b"/flood/%d" % i)) for i in range(flood)), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, TooManyRequests)]
    assert len(refused) == 1000
    assert str(refused[0]) == "etcdserver: too many requests"
    assert all(not isinstance(r, BaseException) for r in results[:MAX_UNAPPLIED])
    assert sm.store.get(b"/flood/%d" % (MAX_UNAPPLIED - 1)) is not None
    assert sm.store.get(b"/flood/%d" % MAX_UNAPPLIED) is None  # refused: nothing written
    # the log caught up: it takes proposals again
    assert not isinstance(await log.propose(put(b"/after")), BaseException)
    assert log.last_index == sm.applied_index == MAX_UNAPPLIED + 1
    await log.close()
