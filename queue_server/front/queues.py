"""The etcd-key queue served by fronts, with all of its state in the backend etcd.

What belongs here (docs/front-queue-design.md has the design): `QueueFronts`,
what the forwarding asks of the queues, and the consumer side of a front.

- A watch of exactly `/q/{name}/c/{uuid}` is a consumer: the front registers it
  at that key (its value this front's id, on the session lease of
  `session.py`) and forwards a prefix watch of `/q/{name}/c/{uuid}/` in its
  place, on which the hand-outs arrive. When the watch is cancelled or its
  stream ends, the registration is deleted; when the front dies, etcd deletes
  it with the lease. A consumer watch of a broken shape is refused as the
  embedded server refuses it (docs/queue.md, "Refused keys"), without a word to
  etcd.
- The front that registers a queue's consumer campaigns to dispatch the queue
  (`dispatcher.py`).
- Produces and acks go to the dispatching front when they can (`direct.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from grpc import aio

from etcdserverpb import rpc_pb2
from queue_server.front.admission import Admission
from queue_server.front.direct import DirectWrites
from queue_server.front.dispatcher import Dispatcher
from queue_server.front.figures import FrontFigures
from queue_server.front.peers import Peers
from queue_server.front.session import (
    CALL_TIMEOUT,
    LEASE_NOT_FOUND,
    RETRY_SECONDS,
    FrontSession,
    delete_op,
    prefix_end,
    put_op,
)
from queue_server.front.upstream import Upstream
from queue_server.keyspace import grammar

log = logging.getLogger(__name__)

REFUSED_WATCH_ID = -1
"""The watch id etcd gives a create its mvcc layer refuses (the embedded
server's `PROGRESS_WATCH_ID` too)."""


RETRY_ATTEMPTS = 60
"""Tries to write or delete a consumer's registration, RETRY_SECONDS apart: 30 s
of a backend that does not answer."""


CQS_CONSUMER_REFUSED = (
    "etcdserver: a CQS queue over etcd is consumed with BatchDequeue, not with a watch"
)


class Refused(Exception):
    """A stream request answered by the front itself: `response` goes to the
    client, nothing to the backend."""

    def __init__(self, response: bytes) -> None:
        super().__init__()
        self.response = response


def _refused_watch(reason: str) -> bytes:
    response = rpc_pb2.WatchResponse(
        watch_id=REFUSED_WATCH_ID, created=True, canceled=True, cancel_reason=reason
    )
    return bytes(response.SerializeToString())


@dataclass(slots=True)
class WatchStreamState:
    """The consumers one forwarded Watch stream registered."""

    creating: list[bytes | None] = field(default_factory=list)
    """The registration key of each create sent and not yet answered (None: not a consumer)."""
    consumers: dict[int, bytes] = field(default_factory=dict)
    """Backend watch id -> registration key."""


class ConsumerTap:
    """One forwarded Watch stream as the queues see it (a `forward.StreamTap`)."""

    def __init__(self, queues: QueueFronts) -> None:
        self.queues = queues
        self.state = WatchStreamState()

    async def request(self, data: bytes) -> bytes:
        return await self.queues.on_watch_request(data, self.state)

    def response(self, data: bytes) -> None:
        self.queues.on_watch_response(data, self.state)

    def end(self) -> None:
        self.queues.on_watch_stream_end(self.state)


class QueueFronts:
    """The queue side of a front: consumer registrations and dispatchers."""

    def __init__(self, upstream: Upstream, peers: Peers) -> None:
        self.session = FrontSession(upstream, peers)
        self.session.renewed.append(self._register_again)
        self.admission = Admission(self.session)
        self.direct = DirectWrites(self, own_credentials=bool(upstream.config.user))
        self.figures = FrontFigures(self.session)
        self.live: dict[bytes, grammar.QueueKey] = {}
        """The registrations of this front's consumer watches."""
        self.dispatchers: dict[bytes, Dispatcher] = {}
        self.cqs_queues: set[str] = set()
        """The CQS queues over etcd (`CqsFronts.known`): not watch-consumed here."""
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- what the Watch forwarding asks ---------------------------------------------------

    def watch_tap(self) -> ConsumerTap:
        return ConsumerTap(self)

    def shares_watch(self, create: rpc_pb2.WatchCreateRequest) -> bool:
        """Whether a create may share a backend watch with others
        (`watch_coalesce.py`): not a queue key, so `on_watch_request` would
        neither refuse nor rewrite it. The queues' watches keep a stream of
        their own, as they are."""
        problem = grammar.watch_problem(create.key, create.range_end)
        return problem is None and grammar.parse(create.key) is None

    async def on_watch_request(self, data: bytes, state: WatchStreamState) -> bytes:
        """The request to send the backend in place of `data`."""
        request = rpc_pb2.WatchRequest.FromString(data)
        which = request.WhichOneof("request_union")
        if which == "create_request":
            create = request.create_request
            problem = grammar.watch_problem(create.key, create.range_end)
            if problem is not None:
                log.warning(
                    "queue watch refused key=%r reason=%r", grammar.show(create.key), problem
                )
                raise Refused(_refused_watch(grammar.malformed(create.key, problem).text))
            parsed = grammar.parse(create.key)
            if parsed is None or parsed.kind != "consume" or create.range_end:
                state.creating.append(None)
                return data
            if not grammar.valid_consumer_id(parsed.consumer):
                state.creating.append(None)
                return data
            if parsed.spelling == grammar.SHORT and parsed.name.decode(errors="replace") in (
                self.cqs_queues
            ):
                raise Refused(_refused_watch(CQS_CONSUMER_REFUSED))
            registration = bytes(create.key)
            revision = await self.register(registration, parsed)
            log.info("consumer registered key=%s", grammar.show(registration))
            state.creating.append(registration)
            create.key = registration + b"/"
            create.range_end = prefix_end(create.key)
            # the dispatcher may hand out before this watch reaches etcd: watch
            # from the registration on, so no hand-out is missed
            create.start_revision = max(create.start_revision, revision + 1)
            # deliveries are PUTs; the deletes of acks and give-backs are not the
            # consumer's business (embedded, its watch never sees them either)
            if rpc_pb2.WatchCreateRequest.NODELETE not in create.filters:
                create.filters.append(rpc_pb2.WatchCreateRequest.NODELETE)
            return bytes(request.SerializeToString())
        if which == "cancel_request":
            watch_id = request.cancel_request.watch_id
            if watch_id in state.consumers:
                self._spawn(self.unregister(state.consumers.pop(watch_id)))
        return data

    def on_watch_response(self, data: bytes, state: WatchStreamState) -> None:
        if not state.creating:
            return
        response = rpc_pb2.WatchResponse.FromString(data)
        if response.created:
            registration = state.creating.pop(0)
            if registration is not None:
                if response.canceled:
                    self._spawn(self.unregister(registration))
                else:
                    state.consumers[response.watch_id] = registration

    def on_watch_stream_end(self, state: WatchStreamState) -> None:
        for registration in [*state.consumers.values(), *filter(None, state.creating)]:
            self._spawn(self.unregister(registration))
        state.consumers.clear()
        state.creating.clear()

    async def register(self, registration: bytes, parsed: grammar.QueueKey) -> int:
        """Write the registration; returns its revision.

        A registration still in etcd is an earlier watch of the same consumer
        whose end was not seen yet (its stream broke with the backend's): it is
        deleted first, so the dispatcher takes its deliveries back, and this
        watch, which starts after the new registration, is handed them again."""
        lease = await self.session.ready()
        metadata = await self.session.metadata()
        put = put_op(registration, self.session.front_id, lease)
        absent = rpc_pb2.Compare(
            key=registration,
            target=rpc_pb2.Compare.CREATE,
            result=rpc_pb2.Compare.EQUAL,
            create_revision=0,
        )
        try:
            reply = await self.session.kv.Txn(
                rpc_pb2.TxnRequest(
                    compare=[absent], success=[put], failure=[delete_op(registration)]
                ),
                metadata=metadata,
                timeout=CALL_TIMEOUT,
            )
        except aio.AioRpcError as e:
            if e.details() == LEASE_NOT_FOUND:
                self.session.lost(lease)  # the client's watch fails; its retry finds a new one
            raise
        if not reply.succeeded:
            log.info("consumer registered again key=%s", grammar.show(registration))
            reply = await self.session.kv.Txn(
                rpc_pb2.TxnRequest(success=[put]), metadata=metadata, timeout=CALL_TIMEOUT
            )
        self.live[registration] = parsed
        self.ensure_dispatcher(parsed.spelling, parsed.name)
        return int(reply.header.revision)

    def _register_again(self) -> None:
        """The session lease expired (etcd did not hear from this front for its
        TTL), and with it every registration: the dispatchers have taken their
        deliveries back. The watches are still open, so register them again on
        the new lease, and they are handed messages again."""
        for registration, parsed in list(self.live.items()):
            log.info("consumer registered again key=%s", grammar.show(registration))
            self._spawn(self._reregister(registration, parsed))

    async def _reregister(self, registration: bytes, parsed: grammar.QueueKey) -> None:
        for _ in range(RETRY_ATTEMPTS):
            if registration not in self.live:
                return  # its watch ended meanwhile
            try:
                await self.register(registration, parsed)
                return
            except aio.AioRpcError as e:
                log.warning(
                    "consumer %s not registered again yet: %s", grammar.show(registration), e
                )
            await asyncio.sleep(RETRY_SECONDS)

    def ensure_dispatcher(self, spelling: bytes, name: bytes) -> None:
        """Campaign to dispatch the queue `name`, unless this front already does."""
        registry = grammar.registry_key(spelling, name)
        if registry not in self.dispatchers:
            dispatcher = Dispatcher(self.session, spelling, name, self.ensure_dispatcher)
            self.dispatchers[registry] = dispatcher
            self._spawn(dispatcher.campaign())

    async def unregister(self, registration: bytes) -> None:
        """Delete the registration if it is still this front's. Retried while
        the backend does not answer: a registration left behind would keep its
        deliveries from every other consumer for as long as this front lives."""
        log.info("consumer gone key=%s", grammar.show(registration))
        self.live.pop(registration, None)
        request = rpc_pb2.TxnRequest(
            compare=[
                rpc_pb2.Compare(
                    key=registration,
                    target=rpc_pb2.Compare.VALUE,
                    result=rpc_pb2.Compare.EQUAL,
                    value=self.session.front_id,
                )
            ],
            success=[delete_op(registration)],
        )
        for _ in range(RETRY_ATTEMPTS):
            try:
                await self.session.kv.Txn(
                    request, metadata=await self.session.metadata(), timeout=CALL_TIMEOUT
                )
                return
            except aio.AioRpcError as e:
                log.warning("consumer %s not unregistered yet: %s", grammar.show(registration), e)
            await asyncio.sleep(RETRY_SECONDS)

    async def stop(self) -> None:
        for dispatcher in self.dispatchers.values():
            dispatcher.stop()
        for task in list(self._tasks):
            task.cancel()
        await self.session.peers.close()
        await self.session.stop()
