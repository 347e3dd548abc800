"""The etcdserverpb.Watch service: one bidirectional stream, many watchers.

The handler reads requests in one task (create, cancel, progress) and writes the
stream's outbox in another: the watch hub only ever appends to the outbox, so a
slow client never blocks apply or other streams. When the outbox has room again
the writer asks the hub to catch the stream's lagging watchers up from history.
While the outbox is backlogged (a client sending requests faster than it reads
their answers) the reader stops reading, so HTTP/2 flow control holds the client
back instead of the server queueing answers without bound.

A watch create is checked before the hub sees it, as etcd checks permissions:
a user who may not read the range, or a malformed queue consumer key (a range
on a consumer key, an empty or non-UUID consumer id, the other spelling's word;
`keyspace/grammar.py`), is answered created and canceled at once with the
reason, and the stream stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import ClassVar

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from queue_server.api.header import HeaderFiller
from queue_server.auth.errors import PermissionDenied
from queue_server.keyspace import grammar
from queue_server.transport.methods import Call
from queue_server.watch.hub import PROGRESS_WATCH_ID, WatchHub, WatchStream

log = logging.getLogger(__name__)


WRITE_BATCH = 256
"""Responses handed to the transport in one write: what waited in the outbox
since the last write goes out together, a bounded number at a time."""

WIRE_MEMO_BYTES = 512 * 1024
"""Serialized responses remembered for other streams, in bytes (a commit's
fan-out of small events many times over; large values are not held long)."""

DEFAULT_PROGRESS_INTERVAL = 600.0
"""etcd's default --experimental-watch-progress-notify-interval (10 minutes)."""


class Signal:
    """`asyncio.Event` for the one task that waits on it, bound to the loop it was
    made on: `Event.wait` looks the running loop up on every wait (a `getpid()`
    each time), and a stream's writer waits once per batch it writes."""

    __slots__ = ("_loop", "_waiter", "is_set")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self.is_set = False

    def set(self) -> None:
        if self.is_set:
            return
        self.is_set = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self.is_set = False

    async def wait(self) -> None:
        """Return once set (at once if it is)."""
        if self.is_set:
            return
        waiter = self._waiter = self._loop.create_future()
        await waiter


class WatchService(rpc_pb2_grpc.WatchServicer):
    """Serves Watch streams from one `WatchHub`."""

    waiting_methods: ClassVar[frozenset[str]] = frozenset({"Watch"})
    """Watch streams last as long as the client wants (a stop ends them at
    once: `Method.waits`)."""

    def __init__(
        self,
        hub: WatchHub,
        header: HeaderFiller,
        permitted: Callable[[Call, rpc_pb2.WatchCreateRequest], bool] | None = None,
    ) -> None:
        self.hub = hub
        self.header = header
        # Auth (queue_server.api.auth_gate): may this stream's user watch that range?
        self.permitted = permitted
        # The hub hands one response object to the watchers of many streams
        # (same watch id, same events): each is serialized once. Keyed by id(),
        # holding the object so the id cannot be reused while it is here.
        self._wire: dict[int, tuple[rpc_pb2.WatchResponse, bytes]] = {}
        self._wire_bytes = 0

    async def Watch(
        self, request_iterator: AsyncIterator[rpc_pb2.WatchRequest], context: Call
    ) -> None:
        wake = Signal()
        room = Signal()
        stream = self.hub.open_stream(wake.set)
        reader = asyncio.get_running_loop().create_task(
            self._read(request_iterator, stream, context, room)
        )
        reader.add_done_callback(lambda _: wake.set())
        try:
            await self._write(stream, wake, room, reader, context)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self.hub.close_stream(stream)

    async def _read(
        self,
        requests: AsyncIterator[rpc_pb2.WatchRequest],
        stream: WatchStream,
        context: Call,
        room: Signal,
    ) -> None:
        hub = self.hub
        permitted = self.permitted
        async for req in requests:
            while stream.backlogged:
                room.clear()
                await room.wait()
            kind = req.WhichOneof("request_union")
            if kind == "create_request":
                create = req.create_request
                if permitted is not None and not permitted(context, create):
                    reason = PermissionDenied.message
                    stream.push(_refused(create.watch_id, hub.store.revision, reason))
                elif (problem := grammar.watch_problem(create.key, create.range_end)) is not None:
                    reason = grammar.malformed(create.key, problem).text
                    log.warning(
                        "queue watch refused key=%r range_end=%r reason=%r",
                        grammar.show(create.key),
                        grammar.show(create.range_end),
                        problem,
                    )
                    # -1, as etcd answers a watch its mvcc layer refuses: the
                    # request's id (0: "any") could name a live watch of the stream
                    stream.push(_refused(PROGRESS_WATCH_ID, hub.store.revision, reason))
                else:
                    hub.create(stream, create)
            elif kind == "cancel_request":
                hub.cancel(stream, req.cancel_request.watch_id)
            elif kind == "progress_request":
                hub.request_progress(stream)

    async def _write(
        self,
        stream: WatchStream,
        wake: Signal,
        room: Signal,
        reader: asyncio.Task[None],
        context: Call,
    ) -> None:
        ids = self.header
        wire = self._wire
        while True:
            while stream.outbox:
                batch: list[bytes] = []
                while stream.outbox and len(batch) < WRITE_BATCH:
                    response = stream.pop()
                    known = wire.get(id(response))
                    if known is not None and known[0] is response:
                        batch.append(known[1])  # the same response, for another stream
                        continue
                    # The hub sets each response's revision (etcd's
                    # newResponseHeader: a compaction cancel has none); only the
                    # member's identity is added here, never the current revision.
                    header = response.header
                    header.cluster_id = ids.cluster_id
                    header.member_id = ids.member_id
                    header.raft_term = ids.raft_term
                    payload = response.SerializeToString()
                    self._wire_bytes += len(payload)
                    if self._wire_bytes > WIRE_MEMO_BYTES:
                        wire.clear()
                        self._wire_bytes = len(payload)
                    wire[id(response)] = (response, payload)
                    batch.append(payload)
                await context.write_many(batch)
            room.set()  # the outbox is empty: the reader may go on
            if stream.has_room and stream.unsynced():
                self.hub.catch_up(stream)
                if stream.outbox:
                    continue
            if reader.done():
                return  # the client closed its side (or the stream broke)
            wake.clear()
            await wake.wait()


def _refused(watch_id: int, revision: int, reason: str) -> rpc_pb2.WatchResponse:
    """etcd 3.5's answer to a watch create it refuses: created and canceled at
    once, with the reason; the stream stays open. etcd gives the request's
    watch id to a watch the user may not read, and -1 to one its mvcc layer
    refuses."""
    response = rpc_pb2.WatchResponse(
        watch_id=watch_id,
        created=True,
        canceled=True,
        cancel_reason=reason,
    )
    response.header.revision = revision
    return response
