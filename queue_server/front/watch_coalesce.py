"""A front's Watch streams: client watches of one shape share one backend watch.

What belongs here: the front's Watch handler (`WatchHub.handler`), the table of
shared backend watches (broadcasts) keyed by the shape of their create, the
backend Watch streams that carry them, and the watch ids each client stream
sees. `forward.py` only installs the handler.

The design (docs/cluster-design.md, "Fronts over etcd", on watches):

- A create is shared when its shape allows it: key, range_end, filters,
  prev_kv and progress_notify (and the client's `hasleader`) are the shape; a
  fragmented watch, a queue key (what `queues.py` taps: consumer watches and
  the keys it refuses) and a range etcd refuses are never shared.
- Every shared create is first checked with the client's own credentials: a
  serializable count-only Range of the watched range. A refusal of any kind
  sends the create to the client's own backend stream, which answers exactly
  as etcd would (permission denied, invalid token, ...). The shared backend
  watches run as the front itself (`--backend-user`, or no token).
- A broadcast is opened by a create with start_revision 0. A later create
  joins it when the broadcast has not passed what that create is owed: for
  start_revision 0 always, at revision C = max(the Range's revision, the
  broadcast's): its created response says C and it is handed the events after
  C. A create with start_revision S joins only when the broadcast has not seen
  revision S yet; otherwise (history) it gets a backend watch of its own.
  Every event the backend sends for a broadcast after a client joined has a
  revision above the broadcast's revision at that moment, so a joiner misses
  nothing it is owed, and is handed nothing older.
- Each client stream keeps etcd's ids (0, 1, 2, ... or the id a create asks
  for; a duplicate is refused as mvcc refuses it), for shared and own watches
  alike: the front maps the ids of the client's own backend stream too, and
  that stream is opened only when the client needs it. Created responses go
  out in the order of the creates (clientv3 pairs them by order), so a stream's
  creates are handled one at a time.
- The queues' tap (`queues.watch_tap`) sees the client's own backend stream
  only, with the backend's ids, exactly as before.
- A client's cancel gets `canceled: true` for its id at once; the backend
  watch is cancelled when its last sharer leaves. A compaction cancel or any
  other cancel by the backend goes to every sharer with its own id.
- A client's progress request is answered with the lower revision of the
  answers of every backend stream its watches are on, once their events up to
  it are queued.
- When a shared backend stream breaks (its member died, `hasleader` lost the
  leader), every client stream with a watch on it is aborted with that status,
  as each was when it had a backend stream of its own: clients resume from
  their last revision, through the front, as they do against etcd.
- A client that does not read its events is not allowed to hold the others
  back: past OUTBOX_LIMIT bytes queued for it, its stream is aborted with
  UNAVAILABLE (its own backend stream is instead held back, as before).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from grpc import aio

from etcdserverpb import rpc_pb2
from queue_server.front.h2_client import CallError
from queue_server.front.queues import Refused
from queue_server.front.upstream import STALE_TOKEN_ERRORS, Upstream
from queue_server.transport.methods import Call
from queue_server.transport.status import Status

log = logging.getLogger(__name__)

WATCH_PATH = "/etcdserverpb.Watch/Watch"
RANGE_PATH = "/etcdserverpb.KV/Range"

UNAVAILABLE_TEXT = "etcdserver: backend unavailable: "
"""As forward.py says a backend that did not answer."""

AUTO_WATCH_ID = 0
"""A create's watch_id that asks etcd to choose (mvcc's AutoWatchID)."""
NO_WATCH_ID = -1
"""The id of a refused create and of a stream's progress response."""
DUPLICATE_ID_REASON = "mvcc: duplicate watch ID provided on the WatchStream"

CHECK_TIMEOUT = 5.0
"""Bounds the Range that checks a shared create's permission (then: its own watch)."""
OUTBOX_LIMIT = 32 * 1024 * 1024
"""Bytes of responses queued for a client past which a shared watch gives up on it."""

Failure = tuple[Status, str]
"""How a client stream is aborted."""

_MASK64 = (1 << 64) - 1


# -- wire helpers -----------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= _MASK64  # int64: a negative value is ten bytes of two's complement
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def with_watch_id(data: bytes, watch_id: int) -> bytes:
    """A serialized WatchResponse with its watch_id set to `watch_id`: the field
    is appended, and protobuf takes the last value of a scalar field, so the
    events are not serialized again for each client."""
    return data + b"\x10" + _varint(watch_id)


def failure_of(error: aio.AioRpcError) -> Failure:
    """The status a client sees for a backend stream's error (forward.py's words)."""
    code = Status(error.code().value[0])
    details = error.details() or ""
    if code is Status.UNAVAILABLE and not details.startswith("etcdserver:"):
        details = UNAVAILABLE_TEXT + details
    return code, details


def _bytes(request: Any) -> bytes:
    return request if type(request) is bytes else bytes(request.SerializeToString())


def _identity(data: bytes) -> bytes:
    return data


# -- the pure bookkeeping ---------------------------------------------------------------


class IdSpace:
    """The watch ids of one client stream, handed out as etcd's mvcc watchStream
    does: a create's own id if it asks for one, else the next unused one."""

    def __init__(self) -> None:
        self.used: set[int] = set()
        self.next = 0

    def take(self, wanted: int) -> int | None:
        """The id for a create asking for `wanted`; None: a duplicate."""
        if wanted == AUTO_WATCH_ID:
            while self.next in self.used:
                self.next += 1
            wanted = self.next
            self.next += 1
        elif wanted in self.used:
            return None
        self.used.add(wanted)
        return wanted

    def free(self, watch_id: int) -> None:
        self.used.discard(watch_id)


@dataclass(frozen=True, slots=True)
class Shape:
    """What makes two creates' watches the same backend watch."""

    key: bytes
    range_end: bytes
    filters: tuple[rpc_pb2.WatchCreateRequest.FilterType, ...]
    prev_kv: bool
    progress_notify: bool
    leader: bool
    """The client asked for `hasleader`: its backend stream must end without one."""

    def create_request(self) -> bytes:
        create = rpc_pb2.WatchCreateRequest(
            key=self.key,
            range_end=self.range_end,
            filters=list(self.filters),
            prev_kv=self.prev_kv,
            progress_notify=self.progress_notify,
        )
        return bytes(rpc_pb2.WatchRequest(create_request=create).SerializeToString())


def shape_of(create: rpc_pb2.WatchCreateRequest, leader: bool) -> Shape | None:
    """The shape of a create that may share a backend watch; None: it may not
    (a fragmented watch, or what etcd itself refuses or spells specially)."""
    key, end = bytes(create.key), bytes(create.range_end)
    if create.fragment or not key:
        return None
    if end and end != b"\x00" and key >= end:
        return None  # etcd's "watcher range is empty": its own stream says so
    filters = tuple(sorted(set(create.filters)))
    return Shape(key, end, filters, create.prev_kv, create.progress_notify, leader)


class Outlet:
    """Where a broadcast hands one client stream its responses."""

    ids: IdSpace
    shared: dict[int, Sharer]

    def offer(self, data: bytes) -> None:
        """Queue a response for the client (a slow client is failed, not waited for)."""
        raise NotImplementedError

    def fail(self, failure: Failure) -> None:
        """Abort the client's stream."""
        raise NotImplementedError


@dataclass(eq=False, slots=True)
class Sharer:
    """One client watch on a broadcast."""

    outlet: Outlet
    watch_id: int
    start: int
    """The first revision it is owed."""
    broadcast: Broadcast
    filtering: bool = True
    """Responses may still hold events before `start` (just after it joined)."""

    def owed(self, response: rpc_pb2.WatchResponse, data: bytes) -> bytes | None:
        """What of `response` (serialized: `data`) this watcher is owed."""
        if not self.filtering:
            return with_watch_id(data, self.watch_id)
        if not response.events:  # a progress notification
            if response.header.revision + 1 < self.start:
                return None
            self.filtering = False
            return with_watch_id(data, self.watch_id)
        events = [e for e in response.events if e.kv.mod_revision >= self.start]
        if not events:
            return None
        self.filtering = False  # the events after these are later still
        if len(events) == len(response.events):
            return with_watch_id(data, self.watch_id)
        mine = rpc_pb2.WatchResponse()
        mine.CopyFrom(response)
        del mine.events[:]
        mine.events.extend(events)
        mine.watch_id = self.watch_id
        return bytes(mine.SerializeToString())


@dataclass(slots=True)
class Joining:
    """A create waiting for its broadcast's created response."""

    outlet: Outlet
    wanted: int
    start_revision: int
    header: rpc_pb2.ResponseHeader
    joined: asyncio.Future[bool]


class Broadcast:
    """One backend watch, and the client watches it is handed to."""

    def __init__(self, hub: WatchHub, shape: Shape, stream: SharedStream) -> None:
        self.hub = hub
        self.shape = shape
        self.stream = stream
        self.backend_id: int | None = None
        """None until the backend's created response."""
        self.revision = 0
        """The highest revision the backend has said anything of for this watch."""
        self.sharers: dict[Sharer, None] = {}
        self.waiting: list[Joining] = []

    @property
    def live(self) -> bool:
        return self.backend_id is not None

    def passed(self, start_revision: int) -> bool:
        """Whether a watch from `start_revision` (0: now) would miss events here."""
        return start_revision != 0 and start_revision <= self.revision

    def attach(
        self, outlet: Outlet, wanted: int, start_revision: int, header: rpc_pb2.ResponseHeader
    ) -> None:
        """Hand the client its created response now; every later event is its."""
        watch_id = outlet.ids.take(wanted)
        assert watch_id is not None, "a duplicate id is refused before a create joins"
        revision = max(header.revision, self.revision)
        sharer = Sharer(outlet, watch_id, start_revision or revision + 1, self)
        self.sharers[sharer] = None
        outlet.shared[watch_id] = sharer
        created = rpc_pb2.WatchResponse(watch_id=watch_id, created=True)
        created.header.CopyFrom(header)
        created.header.revision = revision
        outlet.offer(bytes(created.SerializeToString()))

    def created(self, response: rpc_pb2.WatchResponse) -> None:
        """The backend's answer to this broadcast's create."""
        waiting, self.waiting = self.waiting, []
        if response.canceled:  # refused: each create gets a watch of its own
            self.hub.forget(self)
            for joining in waiting:
                if not joining.joined.done():
                    joining.joined.set_result(False)
            if response.cancel_reason in STALE_TOKEN_ERRORS:
                self.stream.retired = True
            log.info("shared watch refused reason=%r", response.cancel_reason)
            return
        self.backend_id = int(response.watch_id)
        self.revision = int(response.header.revision)
        self.stream.by_id[self.backend_id] = self
        for joining in waiting:
            if joining.joined.done():
                continue  # its client went away meanwhile
            if self.passed(joining.start_revision):
                joining.joined.set_result(False)
                continue
            self.attach(joining.outlet, joining.wanted, joining.start_revision, joining.header)
            joining.joined.set_result(True)
        if not self.sharers:
            self.close()

    def deliver(self, response: rpc_pb2.WatchResponse, data: bytes) -> None:
        """A backend response for this watch, handed to every sharer."""
        self.revision = max(self.revision, int(response.header.revision))
        if response.canceled:  # compacted, or ended by the backend
            self.hub.forget(self)
            for sharer in self.sharers:
                sharer.outlet.shared.pop(sharer.watch_id, None)
                sharer.outlet.ids.free(sharer.watch_id)
                sharer.outlet.offer(with_watch_id(data, sharer.watch_id))
            self.sharers.clear()
            return
        for sharer in list(self.sharers):
            out = sharer.owed(response, data)
            if out is not None:
                sharer.outlet.offer(out)

    def leave(self, sharer: Sharer) -> None:
        self.sharers.pop(sharer, None)
        if not self.sharers and not self.waiting and self.live:
            self.close()

    def close(self) -> None:
        """Nobody shares it any more: cancel the backend watch."""
        self.hub.forget(self)
        if self.backend_id is not None:
            self.stream.by_id.pop(self.backend_id, None)
            cancel = rpc_pb2.WatchRequest(
                cancel_request=rpc_pb2.WatchCancelRequest(watch_id=self.backend_id)
            )
            self.stream.send(bytes(cancel.SerializeToString()))

    def fail(self, failure: Failure) -> None:
        for sharer in self.sharers:
            sharer.outlet.fail(failure)
        for joining in self.waiting:
            joining.outlet.fail(failure)
            joining.joined.cancel()
        self.sharers.clear()
        self.waiting.clear()


# -- the backend side -------------------------------------------------------------------


class SharedStream:
    """One backend Watch stream carrying broadcasts (one per `hasleader` value)."""

    def __init__(self, hub: WatchHub, call: Any) -> None:
        self.hub = hub
        self.call = call
        self.creating: deque[Broadcast] = deque()
        """Broadcasts whose create was sent, in order (etcd answers creates in order)."""
        self.by_id: dict[int, Broadcast] = {}
        self.retired = False
        """No new broadcast here (the backend stopped taking its token)."""
        self.broken = False
        self._outgoing: asyncio.Queue[bytes] = asyncio.Queue()
        self._progress: list[asyncio.Future[rpc_pb2.WatchResponse]] | None = None
        self._progress_next: list[asyncio.Future[rpc_pb2.WatchResponse]] = []
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._write())]

    def send(self, data: bytes) -> None:
        if not self.broken:
            self._outgoing.put_nowait(data)

    def create(self, broadcast: Broadcast) -> None:
        self.creating.append(broadcast)
        self.send(broadcast.shape.create_request())

    async def progress(self) -> rpc_pb2.WatchResponse:
        """The backend's progress response to a request sent from now on: the
        events before it have been handed out when it comes."""
        answer: asyncio.Future[rpc_pb2.WatchResponse] = asyncio.get_running_loop().create_future()
        if self._progress is None:
            self._progress = [answer]
            self._send_progress()
        else:
            self._progress_next.append(answer)
        return await answer

    def _send_progress(self) -> None:
        request = rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest())
        self.send(bytes(request.SerializeToString()))

    def _progressed(self, response: rpc_pb2.WatchResponse) -> None:
        answered, self._progress = self._progress or [], None
        for answer in answered:
            if not answer.done():
                answer.set_result(response)
        if self._progress_next:
            self._progress, self._progress_next = self._progress_next, []
            self._send_progress()

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self._outgoing.get())
        except (aio.AioRpcError, asyncio.InvalidStateError):
            self.call.cancel()  # the reader reports it

    async def _read(self) -> None:
        failure: Failure = (Status.UNAVAILABLE, UNAVAILABLE_TEXT + "the watch stream ended")
        try:
            while True:
                data = await self.call.read()
                if type(data) is not bytes:  # grpc.aio.EOF
                    break
                self._dispatch(data)
        except aio.AioRpcError as e:
            failure = failure_of(e)
        except asyncio.CancelledError:
            failure = (Status.UNAVAILABLE, UNAVAILABLE_TEXT + "the front is stopping")
            raise
        finally:
            self._broke(failure)

    def _dispatch(self, data: bytes) -> None:
        response = rpc_pb2.WatchResponse.FromString(data)
        self.hub.saw(response.header)
        if response.created:
            if self.creating:
                self.creating.popleft().created(response)
        elif response.watch_id == NO_WATCH_ID:
            self._progressed(response)
        else:
            broadcast = self.by_id.get(response.watch_id)
            if broadcast is not None:
                if response.canceled:
                    del self.by_id[response.watch_id]
                broadcast.deliver(response, data)
        self.hub.tidy(self)

    def _broke(self, failure: Failure) -> None:
        if self.broken:
            return
        self.broken = True
        log.info("shared watch stream ended: %s %s", failure[0].name, failure[1])
        self.hub.dropped(self)
        for broadcast in [*self.creating, *self.by_id.values()]:
            self.hub.forget(broadcast)
            broadcast.fail(failure)
        self.creating.clear()
        self.by_id.clear()
        for answer in [*(self._progress or []), *self._progress_next]:
            answer.cancel()
        self.close()

    @property
    def idle(self) -> bool:
        return not self.creating and not self.by_id

    def close(self) -> None:
        self.call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()


class WatchHub:
    """A front's broadcasts, and its Watch handler."""

    def __init__(
        self,
        upstream: Upstream,
        tap: Callable[[], Any] | None = None,
        shares: Callable[[rpc_pb2.WatchCreateRequest], bool] | None = None,
    ) -> None:
        """`tap` makes each client stream's `forward.StreamTap` (it sees the
        client's own backend stream); `shares` says whether a create may share
        a backend watch at all (the queues keep theirs)."""
        self.upstream = upstream
        self.tap = tap
        self.shares = shares
        self.open_stream = upstream.channel.stream_stream(WATCH_PATH, _identity, _identity)
        self.streams: dict[bool, SharedStream] = {}
        self.broadcasts: dict[Shape, Broadcast] = {}
        self.header = rpc_pb2.ResponseHeader()
        """The latest header from the backend: for the responses the front makes."""
        self._lock = asyncio.Lock()

    def saw(self, header: rpc_pb2.ResponseHeader) -> None:
        if header.revision >= self.header.revision:
            self.header.CopyFrom(header)

    def forget(self, broadcast: Broadcast) -> None:
        if self.broadcasts.get(broadcast.shape) is broadcast:
            del self.broadcasts[broadcast.shape]

    def dropped(self, stream: SharedStream) -> None:
        for leader, mine in list(self.streams.items()):
            if mine is stream:
                del self.streams[leader]

    def tidy(self, stream: SharedStream) -> None:
        """A retired stream is closed once it carries nothing."""
        if stream.retired and stream.idle:
            self.dropped(stream)
            stream.close()

    async def _stream(self, leader: bool) -> SharedStream:
        async with self._lock:
            stream = self.streams.get(leader)
            if stream is not None and not stream.retired:
                return stream
            metadata = await self.upstream.own_metadata(refresh=stream is not None)
            if leader:
                metadata = (*metadata, ("hasleader", "true"))
            stream = SharedStream(self, self.open_stream(None, metadata=metadata))
            self.streams[leader] = stream
            return stream

    async def join(
        self,
        outlet: Outlet,
        shape: Shape,
        create: rpc_pb2.WatchCreateRequest,
        header: rpc_pb2.ResponseHeader,
    ) -> bool:
        """Put the create on a broadcast: True once its created response is
        queued; False: it gets a backend watch of its own."""
        start = int(create.start_revision)
        broadcast = self.broadcasts.get(shape)
        if broadcast is None:
            if start:
                return False  # only a watch from now opens a broadcast
            try:
                stream = await self._stream(shape.leader)
            except aio.AioRpcError:
                return False  # the front's own token: the client's stream does without
            broadcast = self.broadcasts.get(shape)  # another create may have opened it meanwhile
            if broadcast is None:
                broadcast = Broadcast(self, shape, stream)
                self.broadcasts[shape] = broadcast
                stream.create(broadcast)
        if broadcast.live:
            if broadcast.passed(start):
                return False
            broadcast.attach(outlet, int(create.watch_id), start, header)
            return True
        joined: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        broadcast.waiting.append(Joining(outlet, int(create.watch_id), start, header, joined))
        return await joined

    async def handler(self, requests: AsyncIterator[Any], call: Call) -> None:
        """The Watch method of a front."""
        client = ClientStream(self, call)
        await client.serve(requests)


# -- the client side --------------------------------------------------------------------


@dataclass(slots=True)
class OwnCreate:
    """A create sent on the client's own backend stream, not answered yet."""

    wanted: int
    answered: asyncio.Future[None]


@dataclass(slots=True)
class OwnIds:
    """The ids of the client's own backend stream, and the client's for them."""

    to_backend: dict[int, int] = field(default_factory=dict)
    to_client: dict[int, int] = field(default_factory=dict)
    cancelling: dict[int, int] = field(default_factory=dict)
    """Backend id -> client id of the watches whose cancel was sent."""


class ClientStream(Outlet):
    """One client's Watch stream through the front."""

    def __init__(self, hub: WatchHub, call: Call) -> None:
        self.hub = hub
        self.call = call
        self.metadata = tuple(call.invocation_metadata())
        self.leader = ("hasleader", "true") in self.metadata
        self.tap = hub.tap() if hub.tap is not None else None
        self.ids = IdSpace()
        self.shared = {}
        self.own = OwnIds()
        self.own_creating: deque[OwnCreate] = deque()
        self.backend: Any = None
        """The client's own backend stream, opened when first needed."""
        self.backend_progress: asyncio.Future[rpc_pb2.WatchResponse] | None = None
        self.outbox: deque[bytes] = deque()
        self.outbox_bytes = 0
        self.failure: Failure | None = None
        self.ended = False
        """The client's own backend stream ended: so does the call, once its outbox is sent."""
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._send_lock = asyncio.Lock()
        self._progress_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- what the client is sent --------------------------------------------------------

    def push(self, data: bytes) -> None:
        if self.failure is not None:
            return
        self.outbox.append(data)
        self.outbox_bytes += len(data)
        if self.outbox_bytes >= OUTBOX_LIMIT:
            self._room.clear()
        self._wake.set()

    def offer(self, data: bytes) -> None:
        self.push(data)
        if self.outbox_bytes > OUTBOX_LIMIT:
            self.fail((Status.UNAVAILABLE, "watch client too slow: its events outgrew the front"))

    def fail(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure
            self._wake.set()

    def _canceled(self, watch_id: int) -> bytes:
        response = rpc_pb2.WatchResponse(watch_id=watch_id, canceled=True)
        response.header.CopyFrom(self.hub.header)
        return bytes(response.SerializeToString())

    async def serve(self, requests: AsyncIterator[Any]) -> None:
        pumping = self._spawn(self._pump(requests))
        try:
            while True:
                await self._wake.wait()  # as long as the client wants: a watch
                self._wake.clear()
                if self.failure is not None:
                    await self.call.abort(*self.failure)
                if self.outbox:
                    batch = list(self.outbox)
                    self.outbox.clear()
                    self.outbox_bytes = 0
                    self._room.set()
                    await self.call.write_many(batch)
                if self.ended and not self.outbox:
                    return
        finally:
            pumping.cancel()
            self._close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for sharer in list(self.shared.values()):
            sharer.broadcast.leave(sharer)
        self.shared.clear()
        if self.backend is not None:
            self.backend.cancel()
        if self.tap is not None:
            self.tap.end()

    # -- what the client asks -----------------------------------------------------------

    async def _pump(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for request in requests:
                await self._request(_bytes(request))
        except aio.AioRpcError as e:  # what the tap asked of etcd failed
            self.fail(failure_of(e))
        except asyncio.InvalidStateError:
            pass  # a write to a backend stream that ended: its reader reports why

    async def _request(self, data: bytes) -> None:
        try:
            request = rpc_pb2.WatchRequest.FromString(data)
        except Exception:  # not ours to judge: etcd answers what it makes of it
            await self._forward(data)
            return
        which = request.WhichOneof("request_union")
        if which == "create_request":
            await self._create(request)
        elif which == "cancel_request":
            await self._cancel(int(request.cancel_request.watch_id), request)
        elif which == "progress_request":
            self._spawn(self._progress(data))
        else:
            await self._forward(data)

    async def _create(self, request: rpc_pb2.WatchRequest) -> None:
        create = request.create_request
        if create.watch_id != AUTO_WATCH_ID and create.watch_id in self.ids.used:
            refused = rpc_pb2.WatchResponse(
                watch_id=NO_WATCH_ID, created=True, canceled=True, cancel_reason=DUPLICATE_ID_REASON
            )
            refused.header.CopyFrom(self.hub.header)
            self.push(bytes(refused.SerializeToString()))
            return
        shape = None
        if self.hub.shares is None or self.hub.shares(create):
            shape = shape_of(create, self.leader)
        if shape is not None:
            header = await self._may_read(create)
            if header is not None and await self.hub.join(self, shape, create, header):
                return
        await self._create_own(request)

    async def _may_read(self, create: rpc_pb2.WatchCreateRequest) -> rpc_pb2.ResponseHeader | None:
        """The header of a serializable Range of the watched range, read with the
        client's credentials; None if the backend refuses it (or does not answer)."""
        check = rpc_pb2.RangeRequest(
            key=create.key, range_end=create.range_end, count_only=True, serializable=True
        )
        try:
            reply = await self.hub.upstream.unary.call(
                RANGE_PATH, check.SerializeToString(), self.metadata, CHECK_TIMEOUT
            )
        except CallError:
            return None
        header = rpc_pb2.RangeResponse.FromString(reply).header
        self.hub.saw(header)
        return header

    async def _create_own(self, request: rpc_pb2.WatchRequest) -> None:
        """The create on the client's own backend stream (the ids there are the front's)."""
        wanted = int(request.create_request.watch_id)
        request.create_request.watch_id = AUTO_WATCH_ID
        data = bytes(request.SerializeToString())
        if self.tap is not None:
            try:
                data = await self.tap.request(data)
            except Refused as refused:
                self.push(refused.response)
                return
        answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.own_creating.append(OwnCreate(wanted, answered))
        await self._send(data)
        await answered

    async def _cancel(self, watch_id: int, request: rpc_pb2.WatchRequest) -> None:
        sharer = self.shared.pop(watch_id, None)
        if sharer is not None:
            sharer.broadcast.leave(sharer)
            self.ids.free(watch_id)
            self.push(self._canceled(watch_id))
            return
        backend_id = self.own.to_backend.pop(watch_id, None)
        if backend_id is None:
            return  # etcd says nothing to a cancel of a watch it does not have
        self.ids.free(watch_id)
        del self.own.to_client[backend_id]
        self.own.cancelling[backend_id] = watch_id
        request.cancel_request.watch_id = backend_id
        await self._forward(bytes(request.SerializeToString()))

    async def _progress(self, data: bytes) -> None:
        async with self._progress_lock:
            streams = {sharer.broadcast.stream for sharer in self.shared.values()}
            if not streams:
                await self._forward(data)  # the backend's answer goes to the client as it is
                return
            answers = []
            if self.own.to_client or self.own.cancelling:
                asked: asyncio.Future[rpc_pb2.WatchResponse]
                asked = asyncio.get_running_loop().create_future()
                self.backend_progress = asked
                await self._forward(data)
                answers.append(await asked)
            for stream in streams:
                answers.append(await stream.progress())
            answer = min(answers, key=lambda a: a.header.revision)
            self.push(bytes(answer.SerializeToString()))

    # -- the client's own backend stream ------------------------------------------------

    async def _forward(self, data: bytes) -> None:
        if self.tap is not None:
            try:
                data = await self.tap.request(data)
            except Refused as refused:
                self.push(refused.response)
                return
        await self._send(data)

    async def _send(self, data: bytes) -> None:
        async with self._send_lock:
            if self.backend is None:
                self.backend = self.hub.open_stream(
                    None, metadata=self.metadata, timeout=self.call.time_remaining()
                )
                self._spawn(self._read_backend())
            await self.backend.write(data)

    async def _read_backend(self) -> None:
        try:
            while True:
                data = await self.backend.read()
                if type(data) is not bytes:  # grpc.aio.EOF: the backend ended the stream
                    self.ended = True
                    self._wake.set()
                    return
                if self.tap is not None:
                    self.tap.response(data)
                await self._room.wait()  # a slow client holds back its own stream only
                self._from_backend(data)
        except aio.AioRpcError as e:
            self.fail(failure_of(e))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the client's stream ends
            self.fail((Status.CANCELLED, "the backend watch stream was cancelled"))

    def _from_backend(self, data: bytes) -> None:
        response = rpc_pb2.WatchResponse.FromString(data)
        backend_id = int(response.watch_id)
        if response.created:
            own = self.own_creating.popleft() if self.own_creating else None
            if response.canceled or own is None:
                self.push(data)  # refused: as etcd said it
            else:
                watch_id = self.ids.take(own.wanted)
                assert watch_id is not None, "a duplicate id is refused before it is sent"
                self.own.to_client[backend_id] = watch_id
                self.own.to_backend[watch_id] = backend_id
                self.push(data if watch_id == backend_id else with_watch_id(data, watch_id))
            if own is not None and not own.answered.done():
                own.answered.set_result(None)
            return
        if backend_id == NO_WATCH_ID:
            asked, self.backend_progress = self.backend_progress, None
            if asked is not None and not asked.done():
                asked.set_result(response)
            else:
                self.push(data)
            return
        watch_id = self.own.to_client.get(backend_id)
        if watch_id is None:
            watch_id = self.own.cancelling.get(backend_id)
            if watch_id is None or not response.canceled:
                return  # a watch the client cancelled: its last events are not its business
            del self.own.cancelling[backend_id]
        elif response.canceled:  # compacted, or ended by the backend
            del self.own.to_client[backend_id]
            del self.own.to_backend[watch_id]
            self.ids.free(watch_id)
        self.push(data if watch_id == backend_id else with_watch_id(data, watch_id))
