"""The peer wire (`queue_server/replication/peer_wire.py`) over real loopback sockets.

Two PeerTransports talk to each other; a hand-driven socket (`RawPeer`) plays a
peer that stalls, or a dialler that sends what a member would not. Every wait is
bounded and waits on an event, never on a sleep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import struct
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from benchmarks.servers import free_port
from etcdserverpb import peer_pb2
from queue_server.config import TLSFiles
from queue_server.replication import peer_wire
from queue_server.replication.peer_wire import MAX_QUEUED, WIRE_VERSION, PeerTransport
from queue_server.replication.peers import PeerUnavailable
from queue_server.tls import peer_client_ssl_context, peer_server_ssl_context
from tests.support.tls import Pki, make_pki

pytestmark = pytest.mark.unit

WAIT = 5.0
"""Upper bound on any wait in these tests; they take milliseconds when all is well."""

A, B = 0xA1, 0xB2
LENGTH = struct.Struct(">I")


def url(port: int, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{port}"


Answerer = Callable[[peer_pb2.Request], Awaitable[peer_pb2.Answer]]


async def placed(request: peer_pb2.Request) -> peer_pb2.Answer:
    """Answers a proposal with the index its command names."""
    return peer_pb2.Answer(placed=peer_pb2.Placed(index=int(request.propose.command), term=1))


class Recorder:
    """A PeerHandler that keeps what it is given."""

    def __init__(self, answerer: Answerer = placed) -> None:
        self.batches: list[list[bytes]] = []
        self.requests: list[peer_pb2.Request] = []
        self.closed_by: list[int] = []
        self.snapshots: list[tuple[bytes, bytes]] = []
        """(message, the received file's bytes) of each snapshot handed over."""
        self.answerer = answerer
        self._changed = asyncio.Event()

    @property
    def messages(self) -> list[bytes]:
        return [m for batch in self.batches for m in batch]

    def deliver(self, messages: list[bytes]) -> None:
        self.batches.append(messages)
        self._changed.set()

    async def answer(self, request: peer_pb2.Request) -> peer_pb2.Answer:
        self.requests.append(request)
        self._changed.set()
        return await self.answerer(request)

    def peer_closed(self, member_id: int) -> None:
        self.closed_by.append(member_id)
        self._changed.set()

    def deliver_snapshot(self, message: bytes, path: str) -> None:
        with open(path, "rb") as f:
            self.snapshots.append((message, f.read()))
        os.remove(path)  # the handler owns the file
        self._changed.set()

    async def until(self, ready: Callable[[], bool], timeout: float = WAIT) -> None:
        async with asyncio.timeout(timeout):
            while not ready():
                self._changed.clear()
                await self._changed.wait()

    async def changed(self, timeout: float) -> None:
        """Returns when something arrives or `timeout` passes, whichever is first."""
        self._changed.clear()
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            pass


class Member:
    """One transport listening on a port of its own, with its handler."""

    def __init__(
        self,
        member_id: int,
        handler: Recorder | None = None,
        *,
        port: int | None = None,
        client_ssl: ssl.SSLContext | None = None,
        scheme: str = "http",
    ) -> None:
        self.member_id = member_id
        self.handler = handler or Recorder()
        self.port = port or free_port()
        self.url = url(self.port, scheme)
        self.snapshot_dir = tempfile.mkdtemp(prefix="peer-wire-snap-")
        self.transport = PeerTransport(
            member_id, client_ssl=client_ssl, snapshot_dir=self.snapshot_dir
        )

    async def start(self, server_ssl: ssl.SSLContext | None = None) -> Member:
        await self.transport.serve([self.url], server_ssl, self.handler)
        return self


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Member, Member]]:
    a, b = await Member(A).start(), await Member(B).start()
    a.transport.set_peer(B, b.url)
    b.transport.set_peer(A, a.url)
    yield a, b
    await a.transport.close()
    await b.transport.close()


def encode(frame: peer_pb2.PeerFrame) -> bytes:
    body = frame.SerializeToString()
    return LENGTH.pack(len(body)) + body


def hello(to_member: int, wire_version: int = WIRE_VERSION) -> bytes:
    return encode(
        peer_pb2.PeerFrame(
            hello=peer_pb2.Hello(wire_version=wire_version, from_member=A, to_member=to_member)
        )
    )


async def read_frame(reader: asyncio.StreamReader) -> peer_pb2.PeerFrame:
    (size,) = LENGTH.unpack(await reader.readexactly(4))
    return peer_pb2.PeerFrame.FromString(await reader.readexactly(size))


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """True once the other side closes (EOF or reset) within WAIT."""
    async with asyncio.timeout(WAIT):
        try:
            return await reader.read() == b""
        except ConnectionError:
            return True


class StalledPeer:
    """A listener that reads a dialler's Hello and the length of its first frame,
    then reads nothing more until `release()`; then it records every RaftBatch."""

    def __init__(self) -> None:
        self.port = free_port()
        self.writing = asyncio.Event()
        self._gate = asyncio.Event()
        self.batches: list[list[bytes]] = []
        self._changed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> StalledPeer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    def release(self) -> None:
        self._gate.set()

    async def until(self, count: int) -> None:
        async with asyncio.timeout(WAIT):
            while sum(map(len, self.batches)) < count:
                self._changed.clear()
                await self._changed.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks[task] = writer
        try:
            assert (await read_frame(reader)).WhichOneof("body") == "hello"
            (size,) = LENGTH.unpack(await reader.readexactly(4))
            self.writing.set()
            await self._gate.wait()
            while True:
                frame = peer_pb2.PeerFrame.FromString(await reader.readexactly(size))
                self.batches.append(list(frame.raft.messages))
                self._changed.set()
                (size,) = LENGTH.unpack(await reader.readexactly(4))
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()
            self._tasks.pop(task, None)

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        self._gate.set()
        tasks = list(self._tasks)
        for writer in self._tasks.values():
            writer.close()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)


@pytest.fixture
async def stalled() -> AsyncIterator[tuple[PeerTransport, StalledPeer]]:
    peer = await StalledPeer().start()
    transport = PeerTransport(A)
    transport.set_peer(B, url(peer.port))
    yield transport, peer
    await transport.close()
    await peer.close()


BIG = bytes(32 << 20)
"""A message large enough to fill the loopback socket's buffers: its write stalls."""


# -- raft batches --------------------------------------------------------------


async def test_batches_flow_both_ways_in_order(pair: tuple[Member, Member]) -> None:
    a, b = pair
    sent_ab = [b"ab%d" % i for i in range(1000)]
    sent_ba = [b"ba%d" % i for i in range(1000)]
    for m in sent_ab:
        a.transport.send(B, m)
    for m in sent_ba:
        b.transport.send(A, m)
    await b.handler.until(lambda: len(b.handler.messages) >= len(sent_ab))
    await a.handler.until(lambda: len(a.handler.messages) >= len(sent_ba))
    assert b.handler.messages == sent_ab
    assert a.handler.messages == sent_ba
    # queued in one go, they went as one frame each way
    assert len(b.handler.batches) == 1
    assert len(a.handler.batches) == 1
    assert a.transport.dropped == b.transport.dropped == 0


async def test_a_peer_that_closes_its_connection_is_reported(
    pair: tuple[Member, Member],
) -> None:
    a, b = pair
    a.transport.send(B, b"hello")
    await b.handler.until(lambda: b.handler.messages == [b"hello"])
    assert b.handler.closed_by == []
    await a.transport.close()  # as a killed process's sockets are closed
    await b.handler.until(lambda: b.handler.closed_by == [A])


async def test_messages_queued_during_a_stalled_write_go_in_one_frame(
    stalled: tuple[PeerTransport, StalledPeer],
) -> None:
    transport, peer = stalled
    transport.send(B, BIG)
    async with asyncio.timeout(WAIT):
        await peer.writing.wait()  # the big frame is on its way and cannot finish
    small = [b"m%d" % i for i in range(100)]
    for m in small:
        transport.send(B, m)
    peer.release()
    await peer.until(1 + len(small))
    assert [len(batch) for batch in peer.batches] == [1, len(small)]
    assert peer.batches[1] == small


async def test_the_queue_is_bounded_and_drops_the_oldest(
    stalled: tuple[PeerTransport, StalledPeer],
) -> None:
    transport, peer = stalled
    transport.send(B, BIG)
    async with asyncio.timeout(WAIT):
        await peer.writing.wait()
    small = [b"m%d" % i for i in range(MAX_QUEUED + 10)]
    for m in small:
        transport.send(B, m)
    assert transport.dropped == 10
    peer.release()
    await peer.until(1 + MAX_QUEUED)
    assert peer.batches[1] == small[10:]


async def test_messages_to_an_unknown_member_are_dropped(pair: tuple[Member, Member]) -> None:
    a, _ = pair
    a.transport.send(0xDEAD, b"nobody")  # neither raises nor blocks
    with pytest.raises(PeerUnavailable):
        await a.transport.request(0xDEAD, peer_pb2.Request(), timeout=1.0)


async def test_messages_to_a_dead_peer_are_dropped_and_counted() -> None:
    transport = PeerTransport(A)
    transport.set_peer(B, url(free_port()))
    try:
        transport.send(B, b"lost")
        async with asyncio.timeout(WAIT):
            while transport.dropped < 1:
                # a request fails once the connect did, and that connect dropped the message
                with pytest.raises(PeerUnavailable):
                    await transport.request(B, peer_pb2.Request(), timeout=WAIT)
        assert transport.dropped == 1
    finally:
        await transport.close()


async def test_a_restarted_peer_is_reached_again(pair: tuple[Member, Member]) -> None:
    a, b = pair
    a.transport.send(B, b"before")
    await b.handler.until(lambda: b.handler.messages == [b"before"])
    await b.transport.close()
    b2 = await Member(B, port=b.port).start()
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        # as raft does, keep sending (one heartbeat per 50 ms) until one arrives
        while not b2.handler.messages and loop.time() - started < 2.0:
            a.transport.send(B, b"heartbeat")
            await b2.handler.changed(0.05)
        assert b2.handler.messages, "the restarted peer was not reached within 2 s"
        a.transport.send(B, b"after")
        await b2.handler.until(lambda: b"after" in b2.handler.messages)
    finally:
        await b2.transport.close()


async def test_a_new_url_replaces_the_connection(pair: tuple[Member, Member]) -> None:
    a, b = pair
    c = await Member(B).start()  # the same member id, moved to another port
    try:
        a.transport.send(B, b"to b")
        await b.handler.until(lambda: b.handler.messages == [b"to b"])
        a.transport.set_peer(B, b.url)  # the same URL: nothing changes
        a.transport.set_peer(B, c.url)
        a.transport.send(B, b"to c")
        await c.handler.until(lambda: c.handler.messages == [b"to c"])
        assert b.handler.messages == [b"to b"]
    finally:
        await c.transport.close()


# -- requests ------------------------------------------------------------------


def propose(command: bytes) -> peer_pb2.Request:
    return peer_pb2.Request(propose=peer_pb2.Proposal(command=command))


async def test_a_snapshot_streams_from_a_file_to_a_file(
    pair: tuple[Member, Member], tmp_path: Path
) -> None:
    a, b = pair
    size = 3 * peer_wire.SNAPSHOT_CHUNK + 12_345
    source = tmp_path / "00000000000000000042.snap"
    source.write_bytes(os.urandom(size))
    a.transport.send(B, b"before")
    a.transport.send_snapshot(B, b"snap-message", str(source))
    a.transport.send(B, b"after")
    await b.handler.until(lambda: len(b.handler.snapshots) == 1)
    assert b.handler.snapshots == [(b"snap-message", source.read_bytes())]
    assert b.handler.messages == [b"before", b"after"]  # queued together, sent first
    assert os.listdir(b.snapshot_dir) == []


async def test_a_snapshot_whose_file_is_gone_is_dropped(pair: tuple[Member, Member]) -> None:
    a, b = pair
    a.transport.send_snapshot(B, b"snap-message", "/nonexistent/00000000000000000001.snap")
    a.transport.send(B, b"next")
    await b.handler.until(lambda: b.handler.messages == [b"next"])
    assert b.handler.snapshots == [] and a.transport.dropped == 1


async def test_a_broken_snapshot_stream_leaves_no_file(pair: tuple[Member, Member]) -> None:
    _, b = pair
    reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
    start = peer_pb2.SnapshotStart(message=b"m", size=100)
    chunk = peer_pb2.SnapshotChunk(data=b"x" * 40)
    writer.write(
        hello(B)
        + encode(peer_pb2.PeerFrame(snapshot_start=start))
        + encode(peer_pb2.PeerFrame(snapshot_chunk=chunk))
    )
    await writer.drain()
    writer.close()  # 60 bytes short
    await closed_by_peer(reader)
    await b.handler.until(lambda: b.handler.closed_by == [A])
    assert b.handler.snapshots == [] and os.listdir(b.snapshot_dir) == []


async def test_a_snapshot_longer_than_announced_is_refused(
    pair: tuple[Member, Member], caplog: pytest.LogCaptureFixture
) -> None:
    _, b = pair
    caplog.set_level(logging.WARNING, logger=peer_wire.__name__)
    reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
    start = peer_pb2.SnapshotStart(message=b"m", size=10)
    chunk = peer_pb2.SnapshotChunk(data=b"x" * 40)
    writer.write(
        hello(B)
        + encode(peer_pb2.PeerFrame(snapshot_start=start))
        + encode(peer_pb2.PeerFrame(snapshot_chunk=chunk))
    )
    await writer.drain()
    assert await closed_by_peer(reader)
    writer.close()
    assert b.handler.snapshots == [] and os.listdir(b.snapshot_dir) == []
    assert "longer than the 10 bytes announced" in caplog.text


async def test_request_and_answer(pair: tuple[Member, Member]) -> None:
    a, b = pair
    request = propose(b"7")
    answer = await a.transport.request(B, request, timeout=WAIT)
    assert answer.WhichOneof("body") == "placed"
    assert answer.placed.index == 7
    assert answer.id == request.id != 0
    assert b.handler.requests[0].id == request.id


async def test_concurrent_requests_answered_out_of_order(pair: tuple[Member, Member]) -> None:
    a, b = pair
    release = asyncio.Event()

    async def slow_first(request: peer_pb2.Request) -> peer_pb2.Answer:
        if request.propose.command == b"1":
            await release.wait()
        return await placed(request)

    b.handler.answerer = slow_first
    calls = [
        asyncio.create_task(a.transport.request(B, propose(b"%d" % i), timeout=WAIT))
        for i in (1, 2, 3)
    ]
    done, _ = await asyncio.wait(calls[1:], timeout=WAIT)
    assert len(done) == 2 and not calls[0].done()  # 2 and 3 overtook 1
    release.set()
    answers = await asyncio.wait_for(asyncio.gather(*calls), WAIT)
    assert [answer.placed.index for answer in answers] == [1, 2, 3]


async def test_request_to_a_dead_peer_fails_within_its_timeout() -> None:
    transport = PeerTransport(A)
    transport.set_peer(B, url(free_port()))
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(PeerUnavailable):
            await transport.request(B, propose(b"1"), timeout=1.0)
        assert loop.time() - started < 1.5
    finally:
        await transport.close()


async def test_unanswered_request_times_out_and_close_fails_the_pending(
    pair: tuple[Member, Member],
) -> None:
    a, b = pair
    never = asyncio.Event()

    async def silent(request: peer_pb2.Request) -> peer_pb2.Answer:
        await never.wait()
        raise AssertionError("unreachable")

    b.handler.answerer = silent
    with pytest.raises(PeerUnavailable, match=r"within 0\.2s"):
        await a.transport.request(B, propose(b"1"), timeout=0.2)
    pending = asyncio.create_task(a.transport.request(B, propose(b"2"), timeout=WAIT))
    await b.handler.until(lambda: len(b.handler.requests) == 2)
    await a.transport.close()
    with pytest.raises(PeerUnavailable):
        await asyncio.wait_for(pending, WAIT)


async def test_a_lost_connection_fails_its_pending_requests(pair: tuple[Member, Member]) -> None:
    a, b = pair
    never = asyncio.Event()

    async def silent(request: peer_pb2.Request) -> peer_pb2.Answer:
        await never.wait()
        raise AssertionError("unreachable")

    b.handler.answerer = silent
    pending = asyncio.create_task(a.transport.request(B, propose(b"1"), timeout=WAIT))
    await b.handler.until(lambda: len(b.handler.requests) == 1)
    await b.transport.close()
    with pytest.raises(PeerUnavailable, match="connection lost"):
        await asyncio.wait_for(pending, WAIT)


# -- refused connections -------------------------------------------------------


@pytest.mark.parametrize(
    ("to_member", "wire_version"),
    [
        pytest.param(0xC3, WIRE_VERSION, id="another-member"),
        pytest.param(B, WIRE_VERSION + 1, id="another-wire-version"),
    ],
)
async def test_a_wrong_hello_is_refused_with_one_warning(
    pair: tuple[Member, Member],
    caplog: pytest.LogCaptureFixture,
    to_member: int,
    wire_version: int,
) -> None:
    _, b = pair
    batch = encode(peer_pb2.PeerFrame(raft=peer_pb2.RaftBatch(messages=[b"sneaky"])))
    caplog.set_level(logging.WARNING, logger=peer_wire.__name__)
    for _ in range(2):
        reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
        writer.write(hello(to_member, wire_version) + batch)
        assert await closed_by_peer(reader)
        writer.close()
    refusals = [r.getMessage() for r in caplog.records if "peer hello refused" in r.getMessage()]
    assert len(refusals) == 1  # rate-limited
    assert f"member={B:x}" in refusals[0]
    assert f"from_member={A:x}" in refusals[0]
    assert f"to_member={to_member:x}" in refusals[0]
    assert "--initial-cluster-token" in refusals[0]
    assert b.handler.batches == []


async def test_a_dialler_that_sends_no_hello_is_closed(
    pair: tuple[Member, Member], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, b = pair
    monkeypatch.setattr(peer_wire, "HELLO_TIMEOUT", 0.1)
    reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
    assert await closed_by_peer(reader)
    writer.close()


def frame_with_unknown_body() -> bytes:
    body = b"\x4a\x00"  # field 9, an empty message: no PeerFrame body this side knows
    return LENGTH.pack(len(body)) + body


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(hello(B) + LENGTH.pack(5) + b"\xff\xff\xff\xff\xff", id="garbage"),
        pytest.param(hello(B) + LENGTH.pack(0xFFFFFFFF), id="oversize"),
        pytest.param(LENGTH.pack(10_000) + bytes(10_000), id="oversize-hello"),
        pytest.param(
            encode(peer_pb2.PeerFrame(raft=peer_pb2.RaftBatch(messages=[b"x"]))), id="no-hello"
        ),
        pytest.param(hello(B) + frame_with_unknown_body(), id="unknown-body"),
        pytest.param(
            hello(B) + encode(peer_pb2.PeerFrame(answer=peer_pb2.Answer())),
            id="answer-to-the-server",
        ),
    ],
)
async def test_a_malformed_frame_closes_only_its_connection(
    pair: tuple[Member, Member], caplog: pytest.LogCaptureFixture, data: bytes
) -> None:
    a, b = pair
    caplog.set_level(logging.WARNING, logger=peer_wire.__name__)
    reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
    writer.write(data)
    assert await closed_by_peer(reader)
    writer.close()
    assert any("peer frame refused" in r.getMessage() for r in caplog.records)
    assert b.handler.batches == []
    # the member still serves its peers
    a.transport.send(B, b"still here")
    await b.handler.until(lambda: b.handler.messages == [b"still here"])
    assert (await a.transport.request(B, propose(b"3"), timeout=WAIT)).placed.index == 3


# -- TLS -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def peer_files(pki: Pki, *, cert: bool = True, client_cert_auth: bool = True) -> TLSFiles:
    c, k = (str(pki.server.cert), str(pki.server.key)) if cert else ("", "")
    return TLSFiles(c, k, str(pki.ca), client_cert_auth, "peer-")


async def tls_member(member_id: int, pki: Pki, client_files: TLSFiles) -> Member:
    member = Member(member_id, client_ssl=peer_client_ssl_context(client_files), scheme="https")
    return await member.start(peer_server_ssl_context(peer_files(pki)))


async def test_tls_both_ways_with_client_certificates(pki: Pki) -> None:
    a = await tls_member(A, pki, peer_files(pki))
    b = await tls_member(B, pki, peer_files(pki))
    try:
        a.transport.set_peer(B, b.url)
        b.transport.set_peer(A, a.url)
        a.transport.send(B, b"secret")
        b.transport.send(A, b"terces")
        await b.handler.until(lambda: b.handler.messages == [b"secret"])
        await a.handler.until(lambda: a.handler.messages == [b"terces"])
        assert (await a.transport.request(B, propose(b"5"), timeout=WAIT)).placed.index == 5
    finally:
        await a.transport.close()
        await b.transport.close()


async def test_tls_refuses_a_member_without_a_client_certificate(pki: Pki) -> None:
    a = await tls_member(A, pki, peer_files(pki, cert=False))
    b = await tls_member(B, pki, peer_files(pki))
    try:
        a.transport.set_peer(B, b.url)
        a.transport.send(B, b"let me in")
        with pytest.raises(PeerUnavailable):
            await a.transport.request(B, propose(b"1"), timeout=WAIT)
        assert b.handler.batches == [] and b.handler.requests == []
    finally:
        await a.transport.close()
        await b.transport.close()


async def test_tls_refuses_a_peer_with_an_untrusted_certificate(pki: Pki) -> None:
    a = await tls_member(A, pki, peer_files(pki))
    b = Member(B, scheme="https")
    untrusted = TLSFiles(str(pki.untrusted.cert), str(pki.untrusted.key), "", False, "peer-")
    await b.start(peer_server_ssl_context(untrusted))
    try:
        a.transport.set_peer(B, b.url)
        with pytest.raises(PeerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await a.transport.request(B, propose(b"1"), timeout=WAIT)
    finally:
        await a.transport.close()
        await b.transport.close()


# -- uvloop --------------------------------------------------------------------


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_the_same_on_uvloop(pki: Pki, tls: bool) -> None:
    """The server runs on uvloop when it can: batches and requests work there too."""
    uvloop = pytest.importorskip("uvloop")

    async def exchange() -> None:
        if tls:
            a = await tls_member(A, pki, peer_files(pki))
            b = await tls_member(B, pki, peer_files(pki))
        else:
            a, b = await Member(A).start(), await Member(B).start()
        try:
            a.transport.set_peer(B, b.url)
            sent = [b"u%d" % i for i in range(500)]
            for m in sent:
                a.transport.send(B, m)
            await b.handler.until(lambda: len(b.handler.messages) >= len(sent))
            assert b.handler.messages == sent
            assert (await a.transport.request(B, propose(b"9"), timeout=WAIT)).placed.index == 9
        finally:
            await a.transport.close()
            await b.transport.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(exchange())
