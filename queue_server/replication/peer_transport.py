"""Peer-to-peer traffic of a cluster member, over gRPC on `--listen-peer-urls`.

Two methods on the service `queue_server.cluster.Peer`, with raw bytes on the
wire (no generated code):

- `Stream`: one long-lived client stream per peer; each stream message is a batch
  of raft messages, each already encoded by the raft core (`u32 length | bytes`,
  repeated). Fire and forget: Raft tolerates lost, duplicated and reordered
  messages, so a batch that fails to go is dropped, never retried, and the next
  batch opens a new stream. One stream instead of a unary call per batch saves
  gRPC's per-call work, which dominated a busy leader's profile.
- `Forward`: one serialized log command proposed on behalf of a follower; the
  answer says where it landed in the leader's log (or why not), and the follower
  then waits for its own state machine to apply that entry.

An `https://` peer URL is dialled over TLS with the credentials the server
passes in (`queue_server.tls` makes them from the --peer-* flags); the stream and
the forwarding call are the same either way.

What belongs here: framing, channels, and one sender per peer that coalesces
messages queued while a write is in flight (so a slow peer costs one pending
write at a time, and at most MAX_QUEUED messages of memory). Nothing about Raft
itself.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from etcdserverpb import peer_pb2
from queue_server.replication.peers import PeerHandler, PeerUnavailable

log = logging.getLogger(__name__)

SERVICE = "queue_server.cluster.Peer"
STREAM = f"/{SERVICE}/Stream"
FORWARD = f"/{SERVICE}/Forward"
MAX_QUEUED = 4096
"""Raft messages waiting for one peer; older ones are dropped beyond this (a
peer that far behind is caught up by the leader's probes or a snapshot)."""
SEND_TIMEOUT = 5.0
CHANNEL_OPTIONS = [
    # A peer that was down must be reached again within about a second of its
    # return: gRPC's default reconnect backoff grows to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
]
_LEN = struct.Struct("<I")


def frame(messages: Iterable[bytes]) -> bytes:
    return b"".join(_LEN.pack(len(m)) + m for m in messages)


def unframe(data: bytes) -> list[bytes]:
    out: list[bytes] = []
    pos = 0
    while pos + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if pos + n > len(data):
            raise ValueError("truncated raft message batch")
        out.append(data[pos : pos + n])
        pos += n
    if pos != len(data):
        raise ValueError("trailing bytes in raft message batch")
    return out


def _identity(b: bytes) -> bytes:
    return b


def peer_handler(handler: PeerHandler) -> grpc.GenericRpcHandler[bytes, bytes]:
    """The server side: raft batches to `handler.deliver`, requests to `handler.answer`."""
    deliver = handler.deliver

    async def on_stream(
        requests: AsyncIterator[bytes], context: aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        async for request in requests:
            try:
                messages = unframe(request)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            deliver(messages)
        return b""

    async def on_forward(request: bytes, context: aio.ServicerContext[bytes, bytes]) -> bytes:
        try:
            parsed = peer_pb2.Request.FromString(request)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        answer = await handler.answer(parsed)
        answer.id = parsed.id
        return answer.SerializeToString()

    handlers = {
        "Stream": grpc.stream_unary_rpc_method_handler(
            on_stream, request_deserializer=_identity, response_serializer=_identity
        ),
        "Forward": grpc.unary_unary_rpc_method_handler(
            on_forward, request_deserializer=_identity, response_serializer=_identity
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def url_to_target(url: str) -> str:
    """host:port of a peer URL (http://host:port or https://host:port)."""
    rest = url.split("://", 1)[-1]
    return rest.rstrip("/")


def is_tls_url(url: str) -> bool:
    """An https:// peer URL is dialled with TLS, anything else in the clear."""
    return url.lower().startswith("https://")


@dataclass(eq=False)
class _Peer:
    """One peer: its channel, its message stream and the messages waiting for it."""

    target: str
    tls: bool
    channel: aio.Channel
    stream: aio.StreamUnaryCall[bytes, bytes] | None = None
    queue: list[bytes] = field(default_factory=list)
    sending: bool = False
    dropped: int = 0


class PeerClients:
    """Channels to the other members, by member id.

    `credentials` are used for https:// peer URLs (the peer CA and this member's
    peer certificate); without them such URLs are dialled verifying against the
    system roots and presenting no certificate."""

    def __init__(
        self,
        spawn: Callable[[Coroutine[Any, Any, None]], object],
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._spawn = spawn
        self._credentials = credentials
        self._peers: dict[int, _Peer] = {}

    def set_peer(self, member_id: int, url: str) -> None:
        target, tls = url_to_target(url), is_tls_url(url)
        old = self._peers.get(member_id)
        if old is not None and (old.target, old.tls) == (target, tls):
            return
        if old is not None:
            self._spawn(old.channel.close(None))
        if tls:
            credentials = self._credentials or grpc.ssl_channel_credentials()
            channel = aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        else:
            channel = aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._peers[member_id] = _Peer(target, tls, channel)

    def remove_peer(self, member_id: int) -> None:
        old = self._peers.pop(member_id, None)
        if old is not None:
            self._spawn(old.channel.close(None))

    def send(self, member_id: int, message: bytes) -> None:
        """Queue a raft message for a peer; it goes out with the next batch."""
        peer = self._peers.get(member_id)
        if peer is None:
            return
        peer.queue.append(message)
        if len(peer.queue) > MAX_QUEUED:
            drop = len(peer.queue) - MAX_QUEUED
            del peer.queue[:drop]
            peer.dropped += drop
        if not peer.sending:
            peer.sending = True
            self._spawn(self._drain(peer))

    async def _drain(self, peer: _Peer) -> None:
        try:
            while peer.queue:
                batch, peer.queue = peer.queue, []
                try:
                    stream = peer.stream
                    if stream is None or stream.done():
                        stream = peer.stream = peer.channel.stream_unary(
                            STREAM, request_serializer=_identity, response_deserializer=_identity
                        )()  # type: ignore[call-arg]  # no iterator: written below
                    await asyncio.wait_for(stream.write(frame(batch)), SEND_TIMEOUT)
                except Exception as e:  # the peer is down, slow or gone: drop, reopen later
                    log.debug("raft send failed target=%s error=%r", peer.target, e)
                    peer.dropped += len(batch)
                    if peer.stream is not None:
                        peer.stream.cancel()
                        peer.stream = None
        finally:
            peer.sending = False

    async def request(
        self, member_id: int, request: peer_pb2.Request, timeout: float
    ) -> peer_pb2.Answer:
        """Ask a peer (the leader) to act on `request`; PeerUnavailable when it
        does not answer."""
        peer = self._peers.get(member_id)
        if peer is None:
            raise PeerUnavailable(f"no peer {member_id:x}")
        call = peer.channel.unary_unary(
            FORWARD, request_serializer=_identity, response_deserializer=_identity
        )
        try:
            result: bytes = await call(request.SerializeToString(), timeout=timeout)
        except grpc.RpcError as e:
            sent = e.code() is not grpc.StatusCode.UNAVAILABLE
            raise PeerUnavailable(str(e), sent=sent) from None
        return peer_pb2.Answer.FromString(result)

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.channel.close(None)
        self._peers.clear()
