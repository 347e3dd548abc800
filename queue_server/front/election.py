"""One front's claim on a registry key, and what it does while it holds it.

What belongs here: `RegistryHolder`, the election every dispatcher of a front
runs (the etcd-key queue's `Dispatcher`, CQS's `CqsDispatcher` and `FanOut`).
It campaigns for its registry key with the front's session lease
(`Txn(If create_revision(key) == 0, Then put key = front id)`), runs the
subclass's `dispatch` while it holds the key, and otherwise waits for the key's
deletion, watching the holder's front for its death (`liveness.py`) so that a
SIGKILLed holder is replaced in well under its lease. Every write a holder makes
is guarded by `guard()`: value(key) == this front's id, so a deposed holder
changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from grpc import aio

from etcdserverpb import kv_pb2, rpc_pb2
from queue_server.front.h2_client import CallError
from queue_server.front.liveness import watch_front
from queue_server.front.peers import front_address
from queue_server.front.session import (
    CALL_TIMEOUT,
    LEASE_NOT_FOUND,
    RETRY_SECONDS,
    FrontSession,
    put_op,
)
from queue_server.keyspace import grammar

log = logging.getLogger(__name__)


class RegistryHolder:
    """Campaigns for `registry` and runs `dispatch` while this front holds it."""

    def __init__(self, session: FrontSession, registry: bytes) -> None:
        self.session = session
        self.registry = registry
        self.probes: dict[bytes, asyncio.Future[None]] = {}
        """Front id -> the watch for its death, for the fronts this holder depends on."""
        self.stopping = False
        """Set by `stop`: the campaign ends at its next turn. A task's cancel alone
        is not enough on Python 3.11, whose `asyncio.wait_for` can lose one that
        meets the end of what it waits for."""

    def stop(self) -> None:
        self.stopping = True

    async def dispatch(self) -> None:
        """Serve the key's queue until deposed (returns) or failed (raises)."""
        raise NotImplementedError

    def guard(self) -> rpc_pb2.Compare:
        """The compare every write of the holder carries."""
        return rpc_pb2.Compare(
            key=self.registry,
            target=rpc_pb2.Compare.VALUE,
            result=rpc_pb2.Compare.EQUAL,
            value=self.session.front_id,
        )

    async def campaign(self) -> None:
        lease = 0
        while not self.stopping:
            try:
                lease = await self.session.ready()
                won = await self.session.kv.Txn(
                    rpc_pb2.TxnRequest(
                        compare=[
                            rpc_pb2.Compare(
                                key=self.registry,
                                target=rpc_pb2.Compare.CREATE,
                                result=rpc_pb2.Compare.EQUAL,
                                create_revision=0,
                            )
                        ],
                        success=[put_op(self.registry, self.session.front_id, lease)],
                        failure=[
                            rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=self.registry))
                        ],
                    ),
                    metadata=await self.session.metadata(),
                    timeout=CALL_TIMEOUT,
                )
                holder = (
                    won.responses[0].response_range.kvs[0].value
                    if not won.succeeded and won.responses[0].response_range.kvs
                    else self.session.front_id
                )
                if won.succeeded or holder == self.session.front_id:
                    log.info("dispatching queue=%s", grammar.show(self.registry))
                    try:
                        await self.dispatch()
                    finally:
                        for probe in self.probes.values():
                            probe.cancel()
                        self.probes.clear()
                else:
                    held = won.responses[0].response_range.kvs[0]
                    await self._wait_for_vacancy(won.header.revision, held)
                    continue  # vacant: campaign at once
            except aio.AioRpcError as e:
                log.warning("queue %s: %s", grammar.show(self.registry), e.details())
                if e.details() == LEASE_NOT_FOUND:
                    self.session.lost(lease)
            except CallError as e:
                log.warning("queue %s: %s", grammar.show(self.registry), e.message)
            except Exception:
                log.exception("queue %s: dispatcher failed", grammar.show(self.registry))
            await asyncio.sleep(RETRY_SECONDS)

    async def _wait_for_vacancy(self, revision: int, held: kv_pb2.KeyValue) -> None:
        """Until the registry key is deleted: its holder's lease expired, or the
        holder was seen dead (`liveness.py`) and its lease revoked."""
        probe = asyncio.ensure_future(self.watch_front(held.value, held.lease))
        try:
            async for events in self.watch(self.registry, b"", revision + 1):
                if any(event.type == kv_pb2.Event.DELETE for event in events):
                    return
        finally:
            probe.cancel()

    async def watch_front(self, front: bytes, lease: int) -> None:
        """Revoke `lease` when the front named `front` is seen dead."""
        address, _ = front_address(front)
        if not address or front == self.session.front_id:
            return

        async def revoke() -> None:
            with contextlib.suppress(CallError):
                await self.session.revoke(lease)

        await watch_front(address.encode(), revoke)

    def probe_front(self, kv: kv_pb2.KeyValue) -> None:
        """Watch the front named by `kv`'s value for its death (once per front);
        `kv` is on that front's session lease."""
        if kv.value != self.session.front_id and kv.value not in self.probes:
            self.probes[bytes(kv.value)] = asyncio.ensure_future(
                self.watch_front(kv.value, kv.lease)
            )

    def watch(self, key: bytes, range_end: bytes, start: int) -> AsyncIterator[list[kv_pb2.Event]]:
        return watch_events(self.session, key, range_end, start)


async def watch_events(
    session: FrontSession, key: bytes, range_end: bytes, start: int
) -> AsyncIterator[list[kv_pb2.Event]]:
    """The events of a watch, one response at a time (etcd never splits a
    revision's events over responses unless asked to fragment)."""
    create = rpc_pb2.WatchCreateRequest(key=key, range_end=range_end, start_revision=start)
    stream = session.watches.Watch(metadata=await session.metadata())
    try:
        await stream.write(rpc_pb2.WatchRequest(create_request=create))
        while True:
            reply = await stream.read()
            if not isinstance(reply, rpc_pb2.WatchResponse):
                return  # grpc.aio.EOF: the stream ended
            if reply.canceled:
                return
            if reply.events:
                yield list(reply.events)
    finally:
        stream.cancel()
