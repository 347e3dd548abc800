"""What the member driver needs of the peer transport, and what it offers it.

`Peers` is the sending side (raft messages, fire and forget; requests to the
leader, answered), `PeerHandler` the receiving side. The real transport is
`peer_wire.PeerTransport` (framed streams over TCP or TLS); the whole-member
simulation in the tests puts a simulated network behind the same two
protocols. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Protocol

from etcdserverpb import peer_pb2


class PeerUnavailable(Exception):
    """A request could not be sent to a peer or was not answered in time: the
    peer is unknown, down, or slow. `sent` says whether the request may have
    reached the peer: one that did may have been acted on, so it must not be
    sent again blindly."""

    def __init__(self, message: str, *, sent: bool = False) -> None:
        super().__init__(message)
        self.sent = sent


class Peers(Protocol):
    """The member's channels to the other members, by member id."""

    def set_peer(self, member_id: int, url: str) -> None:
        """Where a member is (again): `http://host:port` or `https://host:port`."""

    def remove_peer(self, member_id: int) -> None:
        """Forget a member that left the cluster."""

    def send(self, member_id: int, message: bytes) -> None:
        """Queue one encoded raft message for a peer; never blocks, never raises.
        Raft tolerates loss: a message that cannot go is dropped."""

    def send_snapshot(self, member_id: int, message: bytes, path: str) -> None:
        """Queue a raft snapshot message whose snapshot data is left empty: the
        snapshot is the file at `path`, streamed to the peer after the message
        (and after the raft messages queued for that peer by then)."""

    async def request(
        self, member_id: int, request: peer_pb2.Request, timeout: float
    ) -> peer_pb2.Answer:
        """Send `request` to a peer and wait for its answer; `PeerUnavailable`
        when that cannot happen within `timeout` seconds."""
        ...


class PeerHandler(Protocol):
    """What the transport hands a member: raft messages and peers' requests."""

    def deliver(self, messages: list[bytes]) -> None:
        """Encoded raft messages from one peer, in the order it sent them."""

    async def answer(self, request: peer_pb2.Request) -> peer_pb2.Answer:
        """The answer to a peer's request (the transport sets its id)."""
        ...

    def deliver_snapshot(self, message: bytes, path: str) -> None:
        """A raft snapshot message from a peer (its snapshot data empty) and the
        file its snapshot was written to; the handler owns the file from now on."""

    def peer_closed(self, member_id: int) -> None:
        """A connection that peer dialled was closed by it: a hint (never proof)
        that its process is gone, as when it is killed."""
