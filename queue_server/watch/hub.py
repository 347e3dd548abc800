"""Watchers: registration, fan-out of applied events, catch-up from history.

What belongs here: which watcher sees which event, in which response, and when.
No I/O and no asyncio: the API layer owns the gRPC stream, drains each
`WatchStream.outbox`, and calls back in here (`catch_up`) when a stream has room.

Theory of operation
-------------------
A watcher is *synced* when it has received every event up to the store's revision:
it sits in the fan-out index (`_by_key` for single keys, `_ranges` for ranges), and
each applied write transaction's events go straight into its stream's outbox, one
response per watcher per transaction (so the events of one Txn arrive together).
A watcher created with a start revision ahead of the store is synced too, and
skips the transactions before its `next_revision` (etcd's minRev).

A watcher is *unsynced* when it must first receive older events: it was created
with a past `start_revision`, or its stream's outbox was full when events came
(a slow reader). It is out of the fan-out index and remembers `next_revision`, the
first revision it has not received. When its stream has room, `catch_up` reads the
missed events from the store's history, at most `CATCH_UP_REVISIONS` revisions at a
time, and once it reaches the store's revision it rejoins the fan-out index. All of
this runs on the one event loop with no await in between, so a watcher never sees
a gap or a duplicate between history and live events. A watcher whose
`next_revision` has been compacted away is cancelled with `compact_revision` set,
as etcd does, and, as in etcd, it keeps its id on the stream until the client
cancels it: a `cancel_request` for it is answered `canceled`, a create with its
id is a duplicate, and (etcd 3.5) it holds back progress responses meanwhile.

Memory is bounded per stream: at most `OUTBOX_MAX_EVENTS` events or
`OUTBOX_MAX_BYTES` bytes wait in an outbox; beyond that, watchers fall back to
history instead of buffering.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from etcdserverpb import kv_pb2, rpc_pb2
from queue_server.mvcc.store import ALL_KEYS_END, Event, KeyValue, MVCCStore

OUTBOX_MAX_EVENTS = 8192
OUTBOX_MAX_BYTES = 4 * 1024 * 1024
"""Events (and their key+value bytes) one stream may have waiting to be sent
before its watchers fall back to catching up from history: bounds a slow reader's
memory without slowing writers."""
OUTBOX_RESUME_EVENTS = 1024
OUTBOX_RESUME_BYTES = 512 * 1024
"""A stream catches up from history once its outbox is below both of these."""
EVENT_OVERHEAD_BYTES = 64
"""Rough cost of one event besides its key and value, for outbox accounting."""
CATCH_UP_REVISIONS = 1000
"""Revisions read from history per catch-up step (etcd's watchBatchMaxRevs)."""

OUTBOX_PAUSE_RESPONSES = 1024
"""Responses one stream may have waiting before the API layer stops reading the
client's requests (so HTTP/2 flow control pushes back on it): created, cancel
and progress responses carry no events, so the event and byte bounds above do
not count them, and a client that sends watch creates without reading its
answers would otherwise queue one response per create without bound."""
DEFAULT_MAX_WATCHERS_PER_STREAM = 10_000
"""Watchers one stream may hold (--max-watchers-per-stream; 0: no limit). etcd has
no such limit; each watcher costs about 0.5 KB here (tests/integration/
test_limits.py measures it), so this bounds one stream at about 5 MB, far above
what clients use (etcd's clientv3 puts all of a client's watches with the same
context on one stream; Kubernetes' apiserver has a few hundred)."""

CANCEL_DUPLICATE_ID = "mvcc: duplicate watch ID provided on the WatchStream"
CANCEL_TOO_MANY_WATCHERS = "mvcc: too many watchers on the WatchStream"
CANCEL_EMPTY_RANGE = "mvcc: watcher range is empty"
PROGRESS_WATCH_ID = -1
"""watch_id of a stream-wide progress response (etcd's InvalidWatchID)."""


@dataclass(eq=False, slots=True)
class Watcher:
    """One watch on one stream."""

    watch_id: int
    stream: WatchStream
    key: bytes
    end: bytes | None  # None: the key alone; ALL_KEYS_END: no upper bound
    next_revision: int
    prev_kv: bool = False
    no_put: bool = False
    no_delete: bool = False
    progress_notify: bool = False
    fragment: bool = False
    synced: bool = False
    quiet_since_progress: bool = True
    consumer: bool = False  # a queue consumer: gets deliveries, not events
    compacted: bool = False
    """Cancelled by a compaction: gets nothing more, but keeps its id on the
    stream until the client cancels it (etcd's watcher.compacted: its mvcc
    layer drops it from both watcher groups, its watch stream keeps it)."""

    def covers(self, key: bytes) -> bool:
        if self.end is None:
            return key == self.key
        return self.key <= key and (self.end == ALL_KEYS_END or key < self.end)

    def wants(self, event: Event) -> bool:
        return not (self.no_delete if event.is_delete else self.no_put)


@dataclass(eq=False, slots=True)
class WatchStream:
    """The server side of one Watch gRPC stream: its watchers and its outbox.

    `notify` is called whenever the outbox gains something to send.
    """

    notify: Callable[[], None]
    watchers: dict[int, Watcher] = field(default_factory=dict)
    outbox: deque[tuple[rpc_pb2.WatchResponse, int]] = field(default_factory=deque)
    outbox_events: int = 0
    outbox_bytes: int = 0
    next_auto_id: int = 0
    progress_deferred: bool = False

    def push(self, response: rpc_pb2.WatchResponse, size: int = 0) -> None:
        """Queue a response; `size` is its payload bytes (keys and values)."""
        self.outbox.append((response, size))
        self.outbox_events += len(response.events)
        self.outbox_bytes += size
        self.notify()

    def pop(self) -> rpc_pb2.WatchResponse:
        response, size = self.outbox.popleft()
        self.outbox_events -= len(response.events)
        self.outbox_bytes -= size
        return response

    def clear(self) -> None:
        self.outbox.clear()
        self.outbox_events = self.outbox_bytes = 0

    @property
    def full(self) -> bool:
        return self.outbox_events >= OUTBOX_MAX_EVENTS or self.outbox_bytes >= OUTBOX_MAX_BYTES

    @property
    def backlogged(self) -> bool:
        """So many responses wait that reading more requests should pause."""
        return len(self.outbox) >= OUTBOX_PAUSE_RESPONSES

    @property
    def has_room(self) -> bool:
        return self.outbox_events < OUTBOX_RESUME_EVENTS and self.outbox_bytes < OUTBOX_RESUME_BYTES

    def unsynced(self) -> list[Watcher]:
        """The watchers that still have history to catch up on."""
        return [
            w for w in self.watchers.values() if not w.synced and not w.consumer and not w.compacted
        ]

    def progress_held(self) -> bool:
        """A stream-wide progress response must wait: a watcher is behind, or
        cancelled by a compaction and not yet by the client (etcd 3.5's
        progressIfSync wants every watcher of the stream in its synced group,
        and a compacted one is in neither group)."""
        return any(not w.synced and not w.consumer for w in self.watchers.values())


def fill_kv(dst: kv_pb2.KeyValue, kv: KeyValue, keys_only: bool = False) -> None:
    """Copy `kv` into `dst`, a fresh message (the KV responses' and the watch
    events' one filler). Zero fields are left unset: on a fresh proto3 message
    that is the same message, and a tombstone costs three assignments fewer."""
    dst.key = kv.key
    if kv.create_revision:
        dst.create_revision = kv.create_revision
    dst.mod_revision = kv.mod_revision
    if kv.version:
        dst.version = kv.version
    if kv.value and not keys_only:
        dst.value = kv.value
    if kv.lease:
        dst.lease = kv.lease


class ConsumerWatches(Protocol):
    """Who decides which watches are consumers rather than plain watches (the
    node's queue consumer directory)."""

    def take(self, watcher: Watcher) -> bool:
        """A new watch on one exact key: True if it is a consumer, which then
        gets what `take`'s owner pushes to its stream instead of key events."""
        ...

    def release(self, watcher: Watcher) -> None:
        """A consumer watch ended (cancelled, or its stream closed)."""
        ...


class WatchHub:
    """All watchers of one node, fed by the store's committed transactions.

    An exact-key watch is offered to `consumers` first (`ConsumerWatches`): a
    queue consumer key's watch receives deliveries instead of key events.
    """

    def __init__(
        self,
        store_of: Callable[[], MVCCStore],
        max_response_bytes: int,
        max_watchers_per_stream: int = DEFAULT_MAX_WATCHERS_PER_STREAM,
        consumers: ConsumerWatches | None = None,
    ) -> None:
        self.max_watchers_per_stream = max_watchers_per_stream
        self._store_of = store_of
        self.max_response_bytes = max_response_bytes
        self._by_key: dict[bytes, set[Watcher]] = {}
        self._ranges: set[Watcher] = set()
        self.streams: set[WatchStream] = set()
        self.consumers = consumers

    @property
    def store(self) -> MVCCStore:
        """The state machine's current store (it is replaced when a snapshot is
        restored)."""
        return self._store_of()

    # -- streams and watchers -------------------------------------------------

    def open_stream(self, notify: Callable[[], None]) -> WatchStream:
        stream = WatchStream(notify)
        self.streams.add(stream)
        return stream

    def close_stream(self, stream: WatchStream) -> None:
        for watcher in list(stream.watchers.values()):
            self._remove(watcher)
            if watcher.consumer and self.consumers is not None:
                self.consumers.release(watcher)
        stream.watchers.clear()
        stream.clear()
        self.streams.discard(stream)

    def _header(self, response: rpc_pb2.WatchResponse, revision: int) -> None:
        response.header.revision = revision

    def create(self, stream: WatchStream, req: rpc_pb2.WatchCreateRequest) -> None:
        """Register a watcher and queue its `created` response (or a refusal)."""
        current = self.store.revision
        key = req.key or b"\x00"
        if not req.range_end:
            end: bytes | None = None
        elif req.range_end == b"\x00":
            end = ALL_KEYS_END
        else:
            end = req.range_end
        response = rpc_pb2.WatchResponse(created=True)
        self._header(response, current)
        if end is not None and end != ALL_KEYS_END and key >= end:
            response.watch_id = PROGRESS_WATCH_ID
            response.canceled = True
            response.cancel_reason = CANCEL_EMPTY_RANGE
            stream.push(response)
            return
        limit = self.max_watchers_per_stream
        if limit and len(stream.watchers) >= limit:
            response.watch_id = PROGRESS_WATCH_ID
            response.canceled = True
            response.cancel_reason = CANCEL_TOO_MANY_WATCHERS
            stream.push(response)
            return
        watch_id = req.watch_id
        if watch_id == 0:
            while stream.next_auto_id in stream.watchers:
                stream.next_auto_id += 1
            watch_id = stream.next_auto_id
            stream.next_auto_id += 1
        elif watch_id in stream.watchers:
            response.watch_id = PROGRESS_WATCH_ID
            response.canceled = True
            response.cancel_reason = CANCEL_DUPLICATE_ID
            stream.push(response)
            return
        start = req.start_revision
        filters = set(req.filters)
        watcher = Watcher(
            watch_id=watch_id,
            stream=stream,
            key=key,
            end=end,
            next_revision=start if start > 0 else current + 1,
            prev_kv=req.prev_kv,
            no_put=rpc_pb2.WatchCreateRequest.NOPUT in filters,
            no_delete=rpc_pb2.WatchCreateRequest.NODELETE in filters,
            progress_notify=req.progress_notify,
            fragment=req.fragment,
        )
        stream.watchers[watch_id] = watcher
        response.watch_id = watch_id
        stream.push(response)
        if end is None and self.consumers is not None and self.consumers.take(watcher):
            watcher.consumer = True
            return
        if watcher.next_revision > current:
            self._sync(watcher)
        # else: unsynced; the stream's sender calls catch_up when it has room

    def cancel(self, stream: WatchStream, watch_id: int) -> None:
        watcher = stream.watchers.pop(watch_id, None)
        if watcher is None:
            return  # etcd answers nothing for an unknown id
        self._remove(watcher)
        if watcher.consumer and self.consumers is not None:
            self.consumers.release(watcher)
        # etcd's answer, for a watcher a compaction cancelled too: the id,
        # canceled, the current revision; no compact_revision, no reason
        response = rpc_pb2.WatchResponse(watch_id=watch_id, canceled=True)
        self._header(response, self.store.revision)
        stream.push(response)
        if stream.progress_deferred and not stream.progress_held():
            self._push_progress(stream)  # it was the last one holding it back

    def cancel_consumer(self, watcher: Watcher, reason: str) -> None:
        """End a consumer watch from the server's side (a stuck consumer): it
        leaves its stream, `consumers` releases it, and the client gets a
        cancel response with `reason` (no header, as before: the watch saw no
        revision of its own)."""
        stream = watcher.stream
        if stream.watchers.get(watcher.watch_id) is not watcher:
            return  # the client cancelled it, or its stream closed, first
        del stream.watchers[watcher.watch_id]
        if self.consumers is not None:
            self.consumers.release(watcher)
        response = rpc_pb2.WatchResponse(watch_id=watcher.watch_id, canceled=True)
        response.cancel_reason = reason
        stream.push(response)

    def request_progress(self, stream: WatchStream) -> None:
        """A WatchProgressRequest: answer now if every watcher is synced, else as
        soon as they are."""
        if not stream.progress_held():
            self._push_progress(stream)
        else:
            stream.progress_deferred = True

    def _push_progress(self, stream: WatchStream) -> None:
        response = rpc_pb2.WatchResponse(watch_id=PROGRESS_WATCH_ID)
        self._header(response, self.store.revision)
        stream.progress_deferred = False
        stream.push(response)

    def progress_tick(self) -> None:
        """Periodic progress notification for watchers that asked for it and had
        no event since the last tick (etcd's progress_notify)."""
        revision = self.store.revision
        for stream in self.streams:
            for w in stream.watchers.values():
                if not w.progress_notify:
                    continue
                if w.synced and w.quiet_since_progress:
                    response = rpc_pb2.WatchResponse(watch_id=w.watch_id)
                    self._header(response, revision)
                    stream.push(response)
                w.quiet_since_progress = True

    def _sync(self, watcher: Watcher) -> None:
        watcher.synced = True
        if watcher.end is None:
            self._by_key.setdefault(watcher.key, set()).add(watcher)
        else:
            self._ranges.add(watcher)

    def _unsync(self, watcher: Watcher, next_revision: int) -> None:
        self._remove(watcher)
        watcher.next_revision = next_revision

    def _remove(self, watcher: Watcher) -> None:
        if not watcher.synced:
            return
        watcher.synced = False
        if watcher.end is None:
            group = self._by_key.get(watcher.key)
            if group is not None:
                group.discard(watcher)
                if not group:
                    del self._by_key[watcher.key]
        else:
            self._ranges.discard(watcher)

    # -- delivery -------------------------------------------------------------

    def on_commit(self, revision: int, events: list[Event]) -> None:
        """Fan out the events of one applied write transaction (store hook)."""
        if len(events) == 1:
            event = events[0]
            targets: dict[Watcher, list[Event]] = {}
            for w in self._by_key.get(event.kv.key, ()):
                if w.wants(event):
                    targets[w] = events
            for w in self._ranges:
                if w.covers(event.kv.key) and w.wants(event):
                    targets[w] = events
        else:
            targets = {}
            by_key = self._by_key
            for event in events:
                key = event.kv.key
                for w in by_key.get(key, ()):
                    if w.wants(event):
                        targets.setdefault(w, []).append(event)
                for w in self._ranges:
                    if w.covers(key) and w.wants(event):
                        targets.setdefault(w, []).append(event)
        built: dict[tuple[object, ...], tuple[rpc_pb2.WatchResponse, int]] = {}
        for watcher, evs in targets.items():
            if revision < watcher.next_revision:
                continue  # created with a start revision still ahead
            if watcher.stream.full:
                self._unsync(watcher, revision)
                continue
            self._deliver(watcher, revision, evs, built)

    def _deliver(
        self,
        watcher: Watcher,
        revision: int,
        events: Iterable[Event],
        built: dict[tuple[object, ...], tuple[rpc_pb2.WatchResponse, int]] | None = None,
    ) -> None:
        """Queue `events` for `watcher`. Within one commit, watchers that get the
        same events (many watchers of one key) share the first one's response:
        the very object when the watch id is the same too (watchers on other
        streams: nothing changes a response once queued but the member identity
        in its header, the same for all), else a copy made in one call instead of
        built field by field again."""
        watcher.quiet_since_progress = False
        key: tuple[object, ...] = ()
        if built is not None and not watcher.fragment:
            assert isinstance(events, list)
            key = (watcher.prev_kv, *map(id, events))
            own = (watcher.watch_id, *key)
            same = built.get(own)
            if same is not None:
                watcher.stream.push(*same)
                return
            same = built.get(key)
            if same is not None:
                response = rpc_pb2.WatchResponse()
                response.CopyFrom(same[0])
                response.watch_id = watcher.watch_id
                built[own] = (response, same[1])
                watcher.stream.push(response, same[1])
                return
        response = rpc_pb2.WatchResponse(watch_id=watcher.watch_id)
        self._header(response, revision)
        add = response.events.add
        want_prev = watcher.prev_kv
        size = 0
        for e in events:
            pe = add()
            if e.is_delete:
                pe.type = kv_pb2.Event.DELETE
            fill_kv(pe.kv, e.kv)
            size += len(e.kv.key) + len(e.kv.value) + EVENT_OVERHEAD_BYTES
            if want_prev and e.prev_kv is not None:
                fill_kv(pe.prev_kv, e.prev_kv)
                size += len(e.prev_kv.key) + len(e.prev_kv.value)
        if watcher.fragment and len(response.events) > 1:
            parts = self._fragments(response)
            for part in parts:
                watcher.stream.push(part, size // len(parts))
        else:
            if key:
                assert built is not None
                built[key] = built[(watcher.watch_id, *key)] = (response, size)
            watcher.stream.push(response, size)

    def _fragments(self, response: rpc_pb2.WatchResponse) -> list[rpc_pb2.WatchResponse]:
        """Split a response over the size limit into fragments (etcd's
        sendFragments): each but the last has `fragment` set."""
        if response.ByteSize() < self.max_response_bytes:
            return [response]
        parts: list[rpc_pb2.WatchResponse] = []
        current = rpc_pb2.WatchResponse(watch_id=response.watch_id, header=response.header)
        for event in response.events:
            current.events.append(event)
            if len(current.events) > 1 and current.ByteSize() >= self.max_response_bytes:
                del current.events[-1]
                current.fragment = True
                parts.append(current)
                current = rpc_pb2.WatchResponse(watch_id=response.watch_id, header=response.header)
                current.events.append(event)
        parts.append(current)
        return parts

    def catch_up(self, stream: WatchStream) -> None:
        """Deliver history to the stream's unsynced watchers while it has room;
        watchers that reach the store's revision rejoin the live fan-out."""
        store = self.store
        for watcher in stream.unsynced():
            if not stream.has_room:
                return
            if watcher.next_revision < store.compact_revision:
                watcher.compacted = True  # its id stays taken until the client cancels it
                # etcd sends this one with no header revision (its mvcc layer
                # leaves WatchResponse.Revision unset for it)
                response = rpc_pb2.WatchResponse(
                    watch_id=watcher.watch_id,
                    canceled=True,
                    compact_revision=store.compact_revision,
                )
                stream.push(response)
                continue
            while stream.has_room and not watcher.synced:
                after = watcher.next_revision - 1
                upto = min(store.revision, after + CATCH_UP_REVISIONS)
                events = [
                    e
                    for e in store.events_between(watcher.key, watcher.end, after, upto)
                    if watcher.wants(e)
                ]
                if events:
                    self._deliver(watcher, store.revision, events)
                watcher.next_revision = upto + 1
                if upto >= store.revision:
                    self._sync(watcher)
        if stream.progress_deferred and not stream.progress_held():
            self._push_progress(stream)
