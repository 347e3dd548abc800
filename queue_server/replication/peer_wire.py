"""The wire between members of one cluster: framed `PeerFrame`s over TCP or TLS.

What belongs here: connections to and from the other members, framing, one
sender per peer, matching answers to requests, and refusing a peer that is not
who the connection was meant for. Nothing about Raft (raft messages are opaque
bytes, `raft/messages.py` owns their encoding) and nothing about what a request
means (the `PeerHandler` answers it). Imports `etcdserverpb.peer_pb2` and
nothing of queue_server; TLS contexts are passed in (`queue_server/tls.py`
makes them from the --peer-* flags).

Theory of operation
-------------------
The schema is `etcdserverpb/peer.proto`. On a connection every frame is a
4-byte big-endian length and then that many bytes of one `PeerFrame`. A member
dials each peer once and keeps that connection; the dialling side sends `Hello`
first, then `RaftBatch` and `Request` frames, and reads `Answer` frames back on
the same connection. So each pair of members has two connections, one dialled
by each side, and each carries traffic one way plus the answers back.

Sending: each peer has a queue of encoded raft messages and one writer task.
`send` appends to the queue and wakes the writer; it never waits and never
fails. The writer connects when it has no connection, then takes everything
queued and writes it as one `RaftBatch` frame (plus any queued requests), and
waits for the socket to take it (`drain`, the back pressure of a slow peer).
Messages queued meanwhile go together in the next frame, so a busy leader
writes a few large frames rather than many small ones. Raft tolerates lost,
duplicated and reordered messages, so nothing is retried: a failed write drops
its batch, closes the connection, and the next message reconnects after a
backoff. A peer that is down costs at most MAX_QUEUED messages of memory.

Snapshots: `send_snapshot` queues a raft snapshot message whose data is the
snapshot file at a path. The writer sends what was queued before it, then a
`SnapshotStart` (the message, the file's size) and the file in SNAPSHOT_CHUNK
pieces, waiting for the socket after each; the receiver writes each piece to a
file of its own in `snapshot_dir` and, once all have come, hands the message and
that file's path to `handler.deliver_snapshot`. Neither side holds a whole
snapshot in memory. A snapshot that cannot be read or sent is dropped, like any
raft message: the leader sends it again.

Requests: `request` gives the request an id unique on this transport, queues
it for the writer and waits for the `Answer` with that id, which the
connection's reader task hands over. Losing the connection fails every pending
request with `PeerUnavailable`; so does a timeout (the late answer is ignored).

Serving: one listener per --listen-peer-urls URL. An accepted connection must
start with a small `Hello` naming this member and speaking WIRE_VERSION, else it
is closed with a (rate-limited) warning. Then `RaftBatch` frames go to
`handler.deliver` in order, and each `Request` is answered in a task of its own
(answers may go back out of order; the id matches them up). A malformed frame
closes that connection only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import ssl
import struct
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError

from etcdserverpb import peer_pb2
from queue_server.replication.peers import PeerHandler, PeerUnavailable

log = logging.getLogger(__name__)

WIRE_VERSION = 1
"""The `Hello.wire_version` this module speaks; a connection with another is refused."""

MAX_QUEUED = 4096
"""Raft messages waiting for one peer; the oldest are dropped beyond this. A
peer that far behind is caught up by the leader's probes or a snapshot, and a
dead peer must not cost unbounded memory."""

MAX_FRAME = 64 << 20
"""Largest frame accepted (64 MiB): a batch of raft appends is at most the
leader's entries per message times --max-request-bytes (1.5 MiB by default);
snapshots, the only larger thing, come in SNAPSHOT_CHUNK pieces. A frame is
held whole before it is decoded, so this bounds a connection's memory."""

SNAPSHOT_CHUNK = 1 << 20
"""Bytes of a snapshot file per SnapshotChunk frame."""

MAX_SNAPSHOT = 1 << 40
"""Largest snapshot a peer may announce (1 TiB): it is written to disk as it
comes, so this only refuses an absurd size before any byte is written."""

MAX_HELLO_FRAME = 256
"""Largest first frame: a Hello is three integers (under 40 bytes). An
unauthenticated dialler must not make the member buffer a 2 GiB frame."""

CONNECT_TIMEOUT = 2.0
"""Seconds to open a connection (TCP and TLS handshake) before giving up on it;
the messages queued meanwhile are dropped and the next one tries again."""

HELLO_TIMEOUT = 5.0
"""Seconds an accepted connection has to send its Hello: a dialler that says
nothing must not hold a connection (and its buffers) forever."""

WRITE_TIMEOUT = 5.0
"""Seconds a peer may leave a write unread (the socket's buffers full) before the
connection is given up: a stuck peer must not hold the queue forever."""

BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0
"""Reconnect delays in seconds: after a failed connect or a lost connection the
next attempt waits, doubling from BACKOFF_MIN to BACKOFF_MAX, so a peer that
comes back is reached within about a second and a dead one costs a connect
attempt a second. A connection that lived BACKOFF_MAX or longer restarts the
backoff from BACKOFF_MIN."""

STREAM_LIMIT = 1 << 20
"""Bytes a connection's reader buffers before it stops reading the socket: large
enough that a batch of appends is read without pausing the transport."""

WARNING_INTERVAL = 10.0
"""Seconds between two warnings of one kind about refused connections: a
misconfigured member redials every second and would flood the log."""

HELLO_HINT = "the members' --initial-cluster or --initial-cluster-token may differ"

_LENGTH = struct.Struct(">I")


class _FrameError(Exception):
    """A frame this side cannot take: over its size limit, or not expected here."""


@dataclass(eq=False, slots=True)
class _Connection:
    """A connection this member dialled, and the task reading answers from it."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    opened: float
    reader_task: asyncio.Task[None] | None = None


@dataclass(eq=False, slots=True)
class _Peer:
    """One peer: where it is, what waits for it, and its writer's state."""

    member_id: int
    url: str
    host: str
    port: int
    tls: bool
    queue: list[bytes] = field(default_factory=list)
    """Encoded raft messages not yet taken by the writer."""
    snapshots: list[tuple[bytes, str]] = field(default_factory=list)
    """Snapshot messages (without their data) and their files, not yet sent."""
    requests: list[bytes] = field(default_factory=list)
    """Framed Request frames not yet written."""
    unsent: set[int] = field(default_factory=set)
    """Ids of the requests in `requests`: failing one of them is safe to retry."""
    pending: dict[int, asyncio.Future[peer_pb2.Answer]] = field(default_factory=dict)
    """Requests without an answer yet, by id."""
    writer_task: asyncio.Task[None] | None = None
    idle: asyncio.Future[None] | None = None
    """Set while the writer waits for work; `_wake` resolves it."""
    connection: _Connection | None = None
    backoff: float = BACKOFF_MIN
    retry_at: float = 0.0


def _split_url(url: str) -> tuple[str, int, bool]:
    """(host, port, tls) of http://host:port or https://host:port."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"peer URL {url!r} is not http(s)://host:port")
    return parts.hostname, parts.port, parts.scheme == "https"


def _frame(frame: peer_pb2.PeerFrame) -> list[bytes]:
    """The length header and the bytes of one frame, for `writelines`."""
    body = frame.SerializeToString()
    return [_LENGTH.pack(len(body)), body]


def _address(writer: asyncio.StreamWriter) -> str:
    """host:port of the other end of a connection, for log lines."""
    peername = writer.get_extra_info("peername")
    if isinstance(peername, tuple) and len(peername) >= 2:
        return f"{peername[0]}:{peername[1]}"
    return str(peername)


async def _drain(writer: asyncio.StreamWriter) -> None:
    """Wait until the socket takes what was written, at most WRITE_TIMEOUT.

    `drain` only waits when the transport's buffer is over its high-water mark;
    below it the timeout is skipped, as arming one costs more than the rest of a
    small write."""
    transport = writer.transport
    if transport.get_write_buffer_size() <= transport.get_write_buffer_limits()[1]:
        await writer.drain()
        return
    async with asyncio.timeout(WRITE_TIMEOUT):
        await writer.drain()


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> peer_pb2.PeerFrame:
    """The next frame; IncompleteReadError at the end of the stream, _FrameError
    for a frame over `limit` bytes, DecodeError for bytes that are no PeerFrame."""
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > limit:
        raise _FrameError(f"frame of {size} bytes over the limit of {limit}")
    return peer_pb2.PeerFrame.FromString(await reader.readexactly(size))


class PeerTransport:
    """This member's connections to and from its peers, by member id."""

    def __init__(
        self,
        member_id: int,
        *,
        client_ssl: ssl.SSLContext | None = None,
        snapshot_dir: str | None = None,
    ) -> None:
        """`snapshot_dir` is where snapshots peers send are written as they
        arrive (files named `*.incoming.tmp`); without it they are refused."""
        self.member_id = member_id
        self._snapshot_dir = snapshot_dir
        self._received_snapshots = itertools.count(1)
        self._handler: PeerHandler | None = None
        self._client_ssl = client_ssl
        self._peers: dict[int, _Peer] = {}
        self._servers: list[asyncio.Server] = []
        self._inbound: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._request_ids = itertools.count(1)
        self._dropped = 0
        self._closed = False
        self._warned_at: dict[str, float] = {}

    @property
    def dropped(self) -> int:
        """Raft messages dropped so far: queue overflow, failed connects and writes."""
        return self._dropped

    # -- peers --------------------------------------------------------------

    def set_peer(self, member_id: int, url: str) -> None:
        """Where a peer is; a new URL drops the old connection (and fails its requests)."""
        old = self._peers.get(member_id)
        if self._closed or (old is not None and old.url == url):
            return
        host, port, tls = _split_url(url)
        if old is not None:
            self._shut(old, "peer URL changed")
        self._peers[member_id] = _Peer(member_id, url, host, port, tls)

    def remove_peer(self, member_id: int) -> None:
        old = self._peers.pop(member_id, None)
        if old is not None:
            self._shut(old, "peer removed")

    def _shut(self, peer: _Peer, reason: str) -> None:
        """Stop everything of a peer that is no longer in the table."""
        if peer.writer_task is not None:
            peer.writer_task.cancel()
        if peer.connection is not None:
            self._disconnect(peer, peer.connection, reason)
        self._dropped += len(peer.queue)
        peer.queue.clear()
        self._fail_requests(peer, reason)

    # -- sending ------------------------------------------------------------

    def send(self, member_id: int, message: bytes) -> None:
        """Queue one encoded raft message for a peer (dropped for an unknown one)."""
        peer = self._peers.get(member_id)
        if peer is None:
            return
        queue = peer.queue
        queue.append(message)
        if len(queue) > MAX_QUEUED:
            del queue[0]
            self._dropped += 1
        self._wake(peer)

    def send_snapshot(self, member_id: int, message: bytes, path: str) -> None:
        """Queue a raft snapshot message (its snapshot data empty) whose
        snapshot is the file at `path`; streamed after the raft messages queued
        when the writer takes it."""
        peer = self._peers.get(member_id)
        if peer is None:
            return
        if peer.snapshots:  # a newer snapshot replaces one not yet sent
            self._dropped += len(peer.snapshots)
        peer.snapshots = [(message, path)]
        self._wake(peer)

    async def request(
        self, member_id: int, request: peer_pb2.Request, timeout: float
    ) -> peer_pb2.Answer:
        """Send a request (its id is set here) and wait for its answer."""
        peer = self._peers.get(member_id)
        if peer is None:
            raise PeerUnavailable(f"no peer member={member_id:x}")
        request_id = request.id = next(self._request_ids)
        future: asyncio.Future[peer_pb2.Answer] = asyncio.get_running_loop().create_future()
        peer.pending[request_id] = future
        peer.requests.extend(_frame(peer_pb2.PeerFrame(request=request)))
        peer.unsent.add(request_id)
        self._wake(peer)
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise PeerUnavailable(
                f"no answer from member={member_id:x} within {timeout}s",
                sent=request_id not in peer.unsent,
            ) from None
        finally:
            peer.pending.pop(request_id, None)
            peer.unsent.discard(request_id)

    def _wake(self, peer: _Peer) -> None:
        idle = peer.idle
        if idle is not None:
            peer.idle = None
            if not idle.done():
                idle.set_result(None)
        elif peer.writer_task is None:
            peer.writer_task = asyncio.get_running_loop().create_task(self._write_loop(peer))

    async def _write_loop(self, peer: _Peer) -> None:
        """The peer's one writer: connect when needed, write what is queued, repeat.
        Should it ever fail, the next message starts a new one."""
        try:
            await self._write_queued(peer)
        finally:
            peer.writer_task = peer.idle = None

    async def _write_queued(self, peer: _Peer) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not peer.queue and not peer.requests and not peer.snapshots:
                peer.idle = loop.create_future()
                await peer.idle
                continue
            connection = peer.connection or await self._connect(peer)
            if connection is None:
                continue
            chunks, peer.requests = peer.requests, []
            peer.unsent.clear()
            batch, peer.queue = peer.queue, []
            if batch:
                raft = peer_pb2.PeerFrame()
                raft.raft.messages.extend(batch)
                chunks.extend(_frame(raft))
            writer = connection.writer
            try:
                writer.writelines(chunks)
                await _drain(writer)
            except (OSError, TimeoutError) as e:
                self._dropped += len(batch)
                self._disconnect(peer, connection, repr(e))
                continue
            if peer.snapshots:
                message, path = peer.snapshots.pop(0)
                await self._stream_snapshot(peer, connection, message, path)

    async def _stream_snapshot(
        self, peer: _Peer, connection: _Connection, message: bytes, path: str
    ) -> None:
        """Send one snapshot file in pieces; a failure drops it (Raft sends again)."""
        writer = connection.writer
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                start = peer_pb2.PeerFrame(
                    snapshot_start=peer_pb2.SnapshotStart(message=message, size=size)
                )
                writer.writelines(_frame(start))
                while piece := f.read(SNAPSHOT_CHUNK):
                    chunk = peer_pb2.PeerFrame(snapshot_chunk=peer_pb2.SnapshotChunk(data=piece))
                    writer.writelines(_frame(chunk))
                    await _drain(writer)
        except FileNotFoundError as e:  # not written yet, or replaced by a newer one
            log.debug("snapshot not sent member=%x path=%s error=%r", peer.member_id, path, e)
            self._dropped += 1
        except (OSError, TimeoutError) as e:  # half sent: the receiver must not wait on
            self._dropped += 1
            self._disconnect(peer, connection, repr(e))
        else:
            log.info("snapshot sent member=%x path=%s bytes=%d", peer.member_id, path, size)

    async def _connect(self, peer: _Peer) -> _Connection | None:
        """Dial the peer (after the backoff) and send Hello; on failure drop what
        is queued for it, fail its requests, and return None."""
        loop = asyncio.get_running_loop()
        delay = peer.retry_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        context = None
        if peer.tls:
            context = self._client_ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                reader, writer = await asyncio.open_connection(
                    peer.host, peer.port, ssl=context, limit=STREAM_LIMIT
                )
        except (OSError, TimeoutError) as e:
            log.debug("peer connect failed member=%x url=%s error=%r", peer.member_id, peer.url, e)
            self._dropped += len(peer.queue)
            peer.queue.clear()
            self._fail_requests(peer, f"cannot connect: {e!r}")
            self._back_off(peer)
            return None
        connection = _Connection(reader, writer, loop.time())
        hello = peer_pb2.Hello(
            wire_version=WIRE_VERSION, from_member=self.member_id, to_member=peer.member_id
        )
        writer.writelines(_frame(peer_pb2.PeerFrame(hello=hello)))
        connection.reader_task = loop.create_task(self._read_answers(peer, connection))
        peer.connection = connection
        return connection

    async def _read_answers(self, peer: _Peer, connection: _Connection) -> None:
        """Hand each Answer on a connection this member dialled to its request."""
        try:
            while True:
                frame = await _read_frame(connection.reader, MAX_FRAME)
                kind = frame.WhichOneof("body")
                if kind != "answer":
                    raise _FrameError(f"unexpected {kind or 'unknown'} frame")
                future = peer.pending.pop(frame.answer.id, None)
                if future is not None and not future.done():
                    future.set_result(frame.answer)
        except (asyncio.IncompleteReadError, OSError) as e:
            self._disconnect(peer, connection, repr(e))
        except (DecodeError, _FrameError) as e:
            self._warn(
                "answer",
                "peer answer refused member=%x peer=%x error=%r",
                self.member_id,
                peer.member_id,
                e,
            )
            self._disconnect(peer, connection, repr(e))

    def _disconnect(self, peer: _Peer, connection: _Connection, reason: str) -> None:
        """Close a dialled connection once: fail the requests sent on it and back off."""
        if peer.connection is not connection:
            return
        peer.connection = None
        connection.writer.close()
        task = connection.reader_task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        log.debug(
            "peer connection lost member=%x url=%s reason=%s", peer.member_id, peer.url, reason
        )
        self._fail_requests(peer, f"connection lost: {reason}")
        if asyncio.get_running_loop().time() - connection.opened >= BACKOFF_MAX:
            peer.backoff = BACKOFF_MIN
        self._back_off(peer)

    def _fail_requests(self, peer: _Peer, reason: str) -> None:
        """Fail every request without an answer; those never written say so."""
        unsent, peer.unsent = peer.unsent, set()
        peer.requests.clear()
        pending, peer.pending = peer.pending, {}
        for request_id, future in pending.items():
            if not future.done():
                future.set_exception(
                    PeerUnavailable(
                        f"member={peer.member_id:x} unavailable: {reason}",
                        sent=request_id not in unsent,
                    )
                )

    def _back_off(self, peer: _Peer) -> None:
        peer.retry_at = asyncio.get_running_loop().time() + peer.backoff
        peer.backoff = min(peer.backoff * 2, BACKOFF_MAX)

    # -- serving ------------------------------------------------------------

    async def serve(
        self, urls: list[str], server_ssl: ssl.SSLContext | None, handler: PeerHandler
    ) -> None:
        """Listen on each peer URL (https ones with `server_ssl`) and hand what
        peers send to `handler`; returns once bound."""
        self._handler = handler
        for url in urls:
            host, port, tls = _split_url(url)
            if tls and server_ssl is None:
                raise ValueError(f"peer URL {url} needs a TLS context (--peer-cert-file)")
            server = await asyncio.start_server(
                self._serve_connection,
                host,
                port,
                ssl=server_ssl if tls else None,
                limit=STREAM_LIMIT,
            )
            self._servers.append(server)

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One connection a peer dialled: Hello, then raft batches and requests."""
        task = asyncio.current_task()
        assert task is not None
        self._inbound[task] = writer
        answering: set[asyncio.Task[None]] = set()
        remote = _address(writer)
        from_member = 0
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                first = await _read_frame(reader, MAX_HELLO_FRAME)
            if first.WhichOneof("body") != "hello":
                raise _FrameError(
                    f"first frame is {first.WhichOneof('body') or 'unknown'}, not hello"
                )
            hello = first.hello
            from_member = hello.from_member
            if hello.wire_version != WIRE_VERSION or hello.to_member != self.member_id:
                self._warn(
                    "hello",
                    "peer hello refused member=%x from_member=%x to_member=%x "
                    'wire_version=%d want_wire_version=%d remote=%s hint="%s"',
                    self.member_id,
                    hello.from_member,
                    hello.to_member,
                    hello.wire_version,
                    WIRE_VERSION,
                    remote,
                    HELLO_HINT,
                )
                return
            assert self._handler is not None  # serving implies a handler
            deliver = self._handler.deliver
            while True:
                frame = await _read_frame(reader, MAX_FRAME)
                kind = frame.WhichOneof("body")
                if kind == "raft":
                    deliver(list(frame.raft.messages))
                elif kind == "request":
                    answer = asyncio.get_running_loop().create_task(
                        self._answer(frame.request, writer)
                    )
                    answering.add(answer)
                    answer.add_done_callback(answering.discard)
                elif kind == "snapshot_start":
                    await self._receive_snapshot(frame.snapshot_start, reader, from_member)
                else:
                    raise _FrameError(f"unexpected {kind or 'unknown'} frame")
        except (asyncio.IncompleteReadError, ConnectionError):
            # The peer closed or reset the connection: its process may be gone.
            if from_member and self._handler is not None and not self._closed:
                self._handler.peer_closed(from_member)
        except (OSError, TimeoutError):
            pass  # the connection broke, or no Hello came: the peer redials
        except (DecodeError, _FrameError) as e:
            self._warn(
                "frame",
                "peer frame refused member=%x from_member=%x remote=%s error=%r",
                self.member_id,
                from_member,
                remote,
                e,
            )
        finally:
            for answer in answering:
                answer.cancel()
            writer.close()
            self._inbound.pop(task, None)

    async def _receive_snapshot(
        self, start: peer_pb2.SnapshotStart, reader: asyncio.StreamReader, from_member: int
    ) -> None:
        """Write a streamed snapshot to a file of its own as its pieces come, then
        hand it over; a stream that breaks or lies about its size leaves no file."""
        if self._snapshot_dir is None:
            raise _FrameError("this member takes no snapshots")
        if start.size > MAX_SNAPSHOT:
            raise _FrameError(f"snapshot of {start.size} bytes over the limit of {MAX_SNAPSHOT}")
        name = f"{from_member:016x}-{next(self._received_snapshots)}.incoming.tmp"
        path = os.path.join(self._snapshot_dir, name)
        received = 0
        try:
            with open(path, "wb") as f:
                while received < start.size:
                    frame = await _read_frame(reader, MAX_FRAME)
                    if frame.WhichOneof("body") != "snapshot_chunk":
                        raise _FrameError("a snapshot stream was interrupted by another frame")
                    data = frame.snapshot_chunk.data
                    received += len(data)
                    if received > start.size:
                        raise _FrameError(f"snapshot longer than the {start.size} bytes announced")
                    f.write(data)
        except BaseException:
            os.remove(path)
            raise
        assert self._handler is not None
        log.info("snapshot received from_member=%x bytes=%d", from_member, received)
        self._handler.deliver_snapshot(start.message, path)

    async def _answer(self, request: peer_pb2.Request, writer: asyncio.StreamWriter) -> None:
        """Answer one request on the connection it came on. A handler that fails
        leaves the request unanswered: the requester times out, as for a lost one."""
        try:
            assert self._handler is not None
            answer = await self._handler.answer(request)
        except Exception:
            log.exception("peer request failed member=%x request_id=%d", self.member_id, request.id)
            return
        answer.id = request.id
        if writer.is_closing():
            return
        try:
            writer.writelines(_frame(peer_pb2.PeerFrame(answer=answer)))
            await _drain(writer)
        except (OSError, TimeoutError):
            writer.close()  # the reader sees the end and the requester redials

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """A warning about a refused peer, at most one of each kind per WARNING_INTERVAL."""
        now = asyncio.get_running_loop().time()
        last = self._warned_at.get(kind)
        if last is not None and now - last < WARNING_INTERVAL:
            return
        self._warned_at[kind] = now
        log.warning(message, *args)

    # -- shutdown -----------------------------------------------------------

    async def close(self) -> None:
        """Stop listening, close every connection, fail pending requests."""
        self._closed = True
        for server in self._servers:
            server.close()
        tasks: list[asyncio.Task[None]] = []
        for peer in self._peers.values():
            if peer.writer_task is not None:
                tasks.append(peer.writer_task)
            if peer.connection is not None and peer.connection.reader_task is not None:
                tasks.append(peer.connection.reader_task)
            self._shut(peer, "transport closed")
        self._peers.clear()
        for task, writer in self._inbound.items():
            writer.close()  # its reader sees the end: cancelling the task instead
            tasks.append(task)  # makes asyncio's stream callback log an error
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
