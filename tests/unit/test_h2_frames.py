"""Frame-level tests of the HTTP/2 core against a scripted peer: bytes in, bytes out.

Each test plays a client: it writes frames into `H2Connection.receive` and
reads back the frames the connection put in `out`. The clock is a fake one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import pytest
from hpack import Decoder, Encoder

from queue_server.transport import header_blocks
from queue_server.transport.h2 import (
    CONTINUATION,
    DATA,
    FLAG_ACK,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    FLAG_PADDED,
    FLAG_PRIORITY,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    WINDOW_UPDATE,
    ErrorCode,
    H2Connection,
    Limits,
)
from tests.support.h2_frames import Frame, frame, parse

pytestmark = pytest.mark.unit

REQUEST = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/etcdserverpb.KV/Range"),
    (":authority", "localhost"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


@dataclass
class Recorder:
    """The H2Events listener: what the connection told its owner."""

    requests: list[tuple[int, list[tuple[bytes, bytes]], bool]] = field(default_factory=list)
    data: list[tuple[int, bytes, bool]] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)
    writable: list[int] = field(default_factory=list)
    pings: list[bytes] = field(default_factory=list)

    def request_headers(self, sid: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        self.requests.append((sid, headers, end))

    def request_data(self, sid: int, data: bytes, end: bool) -> None:
        self.data.append((sid, data, end))

    def stream_reset(self, sid: int) -> None:
        self.resets.append(sid)

    def stream_writable(self, sid: int) -> None:
        self.writable.append(sid)

    def ping_acked(self, payload: bytes) -> None:
        self.pings.append(payload)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(**values: int) -> bytes:
    ids = {"initial_window": SETTINGS_INITIAL_WINDOW_SIZE, "max_frame": SETTINGS_MAX_FRAME_SIZE}
    payload = b"".join(struct.pack(">HI", ids[k], v) for k, v in values.items())
    return frame(SETTINGS, 0, 0, payload)


class Peer:
    """A scripted client of one H2Connection."""

    def __init__(self, limits: Limits | None = None, **initial: int) -> None:
        self.events = Recorder()
        self.clock = FakeClock()
        self.conn = H2Connection(self.events, self.clock, limits)
        self.encoder = Encoder()
        self.server_preamble = self.take()
        self.send(PREFACE + settings(**initial))
        self.take()  # the SETTINGS ACK

    def send(self, data: bytes) -> None:
        self.conn.receive(data)

    def take(self) -> list[Frame]:
        frames = parse(self.conn.out)
        self.conn.out.clear()
        return frames

    def block(self, headers: list[tuple[str, str]] = REQUEST) -> bytes:
        return bytes(self.encoder.encode(headers))

    def open(self, sid: int, end_stream: bool = False) -> None:
        flags = FLAG_END_HEADERS | (FLAG_END_STREAM if end_stream else 0)
        self.send(frame(HEADERS, flags, sid, self.block()))

    def goaway_code(self) -> int:
        frames = [f for f in self.take() if f.type == GOAWAY]
        assert frames, "no GOAWAY"
        assert self.conn.closed
        return frames[-1].error_code


def test_preface_settings_and_window_then_ack_of_theirs() -> None:
    events = Recorder()
    conn = H2Connection(events, FakeClock(), Limits(max_concurrent_streams=100))
    ours = parse(conn.out)
    assert [f.type for f in ours] == [SETTINGS, WINDOW_UPDATE]
    values = dict(struct.iter_unpack(">HI", ours[0].payload))
    assert values[SETTINGS_MAX_CONCURRENT_STREAMS] == 100
    assert values[SETTINGS_INITIAL_WINDOW_SIZE] == Limits().initial_window
    conn.out.clear()
    conn.receive(PREFACE[:10])
    assert not conn.out
    conn.receive(PREFACE[10:] + settings())
    acks = parse(conn.out)
    assert [(f.type, f.flags) for f in acks] == [(SETTINGS, FLAG_ACK)]


@pytest.mark.parametrize(
    "data",
    [b"GET / HTTP/1.1\r\n\r\n", PREFACE + frame(PING, 0, 0, b"12345678")],
    ids=["not-http2", "first-frame-not-settings"],
)
def test_bad_start_is_protocol_error(data: bytes) -> None:
    conn = H2Connection(Recorder(), FakeClock())
    conn.out.clear()
    conn.receive(data)
    goaway = [f for f in parse(conn.out) if f.type == GOAWAY]
    assert goaway and goaway[0].error_code == ErrorCode.PROTOCOL_ERROR
    assert conn.closed


def test_headers_with_continuation_padding_and_priority() -> None:
    peer = Peer()
    block = peer.block()
    padded = bytes([3]) + struct.pack(">IB", 0, 15) + block[:5] + b"\0\0\0"
    peer.send(frame(HEADERS, FLAG_PADDED | FLAG_PRIORITY, 1, padded))
    assert not peer.events.requests  # waiting for the rest of the block
    peer.send(frame(CONTINUATION, 0, 1, block[5:9]))
    peer.send(frame(CONTINUATION, FLAG_END_HEADERS, 1, block[9:]))
    ((sid, headers, end),) = peer.events.requests
    assert sid == 1 and not end
    assert (b":path", b"/etcdserverpb.KV/Range") in headers
    # DATA with padding: the padding is removed and credited back
    peer.send(frame(DATA, FLAG_PADDED | FLAG_END_STREAM, 1, bytes([4]) + b"hello" + b"\0" * 4))
    assert peer.events.data == [(1, b"hello", True)]


def test_continuation_interrupted_is_protocol_error() -> None:
    peer = Peer()
    block = peer.block()
    peer.send(frame(HEADERS, 0, 1, block[:4]))
    peer.send(frame(PING, 0, 0, b"12345678"))
    assert peer.goaway_code() == ErrorCode.PROTOCOL_ERROR


def test_padding_longer_than_frame_is_protocol_error() -> None:
    peer = Peer()
    peer.open(1)
    peer.send(frame(DATA, FLAG_PADDED, 1, bytes([10]) + b"abc"))
    assert peer.goaway_code() == ErrorCode.PROTOCOL_ERROR


def test_stream_depending_on_itself_is_reset() -> None:
    peer = Peer()
    payload = struct.pack(">IB", 1, 15) + peer.block()
    peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_PRIORITY, 1, payload))
    (rst,) = peer.take()
    assert (rst.type, rst.stream_id, rst.error_code) == (RST_STREAM, 1, ErrorCode.PROTOCOL_ERROR)
    peer.send(frame(PRIORITY, 0, 3, struct.pack(">IB", 3, 15)))
    (rst,) = peer.take()
    assert (rst.type, rst.stream_id, rst.error_code) == (RST_STREAM, 3, ErrorCode.PROTOCOL_ERROR)
    assert not peer.events.requests


def test_send_waits_for_window_and_settings_change_applies_to_open_streams() -> None:
    peer = Peer(initial_window=10)
    peer.open(1, end_stream=True)
    peer.conn.send_headers(1, b"\x88")
    peer.conn.send_data(1, b"x" * 25)
    peer.conn.send_trailers(1, b"\x88")
    frames = peer.take()
    assert [f.type for f in frames] == [HEADERS, DATA]
    assert len(frames[1].payload) == 10
    assert peer.conn.backlog(1) == 15
    # a larger INITIAL_WINDOW_SIZE applies to the open stream at once
    peer.send(settings(initial_window=20))
    frames = peer.take()
    data = [f for f in frames if f.type == DATA]
    assert [len(f.payload) for f in data] == [10]
    assert peer.conn.backlog(1) == 5
    # then a stream WINDOW_UPDATE lets out the rest, and the trailers after it
    peer.send(frame(WINDOW_UPDATE, 0, 1, (100).to_bytes(4, "big")))
    frames = [f for f in peer.take() if f.type != SETTINGS]
    assert [(f.type, len(f.payload)) for f in frames] == [(DATA, 5), (HEADERS, 1)]
    assert frames[-1].flags & FLAG_END_STREAM
    assert peer.events.writable == [1]


def test_connection_window_is_shared_by_streams() -> None:
    peer = Peer(initial_window=1_000_000)
    for sid in (1, 3):
        peer.open(sid, end_stream=True)
        peer.conn.send_headers(sid, b"\x88")
    peer.conn.send_data(1, b"a" * 60_000)
    peer.conn.send_data(3, b"b" * 10_000)
    sent = sum(len(f.payload) for f in peer.take() if f.type == DATA)
    assert sent == 65_535  # the default connection window
    peer.send(frame(WINDOW_UPDATE, 0, 0, (10_000).to_bytes(4, "big")))
    sent = sum(len(f.payload) for f in peer.take() if f.type == DATA)
    assert sent == 4_465
    assert peer.conn.backlog(1) + peer.conn.backlog(3) == 0


def test_max_frame_size_is_honoured_when_sending() -> None:
    peer = Peer(initial_window=1_000_000)
    peer.send(frame(WINDOW_UPDATE, 0, 0, (1_000_000).to_bytes(4, "big")))
    peer.open(1, end_stream=True)
    peer.conn.send_headers(1, b"\x88")
    peer.conn.send_data(1, b"z" * 40_000)
    assert [len(f.payload) for f in peer.take() if f.type == DATA] == [16_384, 16_384, 7_232]
    peer.send(settings(max_frame=32_768))
    peer.take()
    peer.open(3, end_stream=True)
    peer.conn.send_headers(3, b"\x88")
    peer.conn.send_data(3, b"z" * 40_000)
    assert [len(f.payload) for f in peer.take() if f.type == DATA] == [32_768, 7_232]


def test_receive_windows_are_enforced_and_credited_in_batches() -> None:
    limits = Limits(initial_window=1000, connection_window=100_000)
    peer = Peer(limits)
    peer.open(1)
    peer.send(frame(DATA, 0, 1, b"a" * 400))
    peer.conn.consumed(1, 400)
    assert not [f for f in peer.take() if f.type == WINDOW_UPDATE]  # under half a window
    peer.send(frame(DATA, 0, 1, b"a" * 400))
    peer.conn.consumed(1, 400)
    (update,) = [f for f in peer.take() if f.type == WINDOW_UPDATE]
    assert update.stream_id == 1 and int.from_bytes(update.payload, "big") == 800
    # beyond the stream's window: that stream is reset, the connection lives
    peer.send(frame(DATA, 0, 1, b"a" * 1001))
    (rst,) = peer.take()
    assert (rst.type, rst.error_code) == (RST_STREAM, ErrorCode.FLOW_CONTROL_ERROR)
    assert peer.events.resets == [1] and not peer.conn.closed


def test_connection_window_overrun_is_flow_control_error() -> None:
    limits = Limits(initial_window=1000, connection_window=70_000)
    peer = Peer(limits)
    for sid in range(1, 160, 2):
        peer.open(sid)
        peer.send(frame(DATA, 0, sid, b"a" * 900))
        if peer.conn.closed:
            break
    assert peer.goaway_code() == ErrorCode.FLOW_CONTROL_ERROR


def test_data_on_closed_and_idle_streams() -> None:
    peer = Peer()
    peer.open(1, end_stream=True)
    peer.send(frame(DATA, 0, 1, b"late"))  # half-closed (remote)
    (rst,) = peer.take()
    assert (rst.type, rst.stream_id, rst.error_code) == (RST_STREAM, 1, ErrorCode.STREAM_CLOSED)
    peer.send(frame(DATA, 0, 7, b"idle"))
    assert peer.goaway_code() == ErrorCode.PROTOCOL_ERROR


def test_frame_larger_than_max_is_frame_size_error() -> None:
    peer = Peer()
    peer.open(1)
    peer.send(frame(DATA, 0, 1, b"a" * 16_385))
    assert peer.goaway_code() == ErrorCode.FRAME_SIZE_ERROR


def test_graceful_goaway_names_last_stream_and_ignores_new_ones() -> None:
    peer = Peer()
    peer.open(1, end_stream=True)
    peer.conn.goaway()
    (goaway,) = peer.take()
    assert goaway.type == GOAWAY
    assert int.from_bytes(goaway.payload[:4], "big") == 1
    assert goaway.error_code == ErrorCode.NO_ERROR
    assert not peer.conn.closed
    peer.open(3, end_stream=True)
    assert [sid for sid, _, _ in peer.events.requests] == [1]
    # the stream in flight still completes
    peer.conn.send_headers(1, b"\x88", end_stream=True)
    assert [f.type for f in peer.take()] == [HEADERS]


def test_ping_is_answered_and_a_ping_flood_is_calmed() -> None:
    peer = Peer(Limits(ping_min_interval=5.0, max_ping_strikes=2))
    peer.send(frame(PING, 0, 0, b"abcdefgh"))
    (ack,) = peer.take()
    assert (ack.type, ack.flags, ack.payload) == (PING, FLAG_ACK, b"abcdefgh")
    for _ in range(3):
        peer.clock.now += 1.0
        peer.send(frame(PING, 0, 0, b"abcdefgh"))
    assert peer.goaway_code() == ErrorCode.ENHANCE_YOUR_CALM


def test_pings_at_the_allowed_interval_are_fine() -> None:
    peer = Peer(Limits(ping_min_interval=5.0))
    for _ in range(20):
        peer.clock.now += 5.0
        peer.send(frame(PING, 0, 0, b"abcdefgh"))
    assert not peer.conn.closed


def test_too_many_concurrent_streams_are_refused() -> None:
    peer = Peer(Limits(max_concurrent_streams=2))
    for sid in (1, 3, 5):
        peer.open(sid)
    (rst,) = peer.take()
    assert (rst.type, rst.stream_id, rst.error_code) == (RST_STREAM, 5, ErrorCode.REFUSED_STREAM)
    assert [sid for sid, _, _ in peer.events.requests] == [1, 3]


def test_rapid_reset_is_calmed() -> None:
    peer = Peer(Limits(reset_burst=50, reset_rate=10))
    sid = 1
    while sid < 2000 and not peer.conn.closed:
        peer.open(sid)
        peer.send(frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big")))
        sid += 2
    assert peer.goaway_code() == ErrorCode.ENHANCE_YOUR_CALM
    assert 50 <= sid // 2 <= 60


def test_resets_at_a_sustainable_rate_are_fine() -> None:
    peer = Peer(Limits(reset_burst=50, reset_rate=10))
    for sid in range(1, 400, 2):
        peer.clock.now += 0.2
        peer.open(sid)
        peer.send(frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big")))
    assert not peer.conn.closed
    assert len(peer.events.resets) == 200


def test_continuation_flood_is_calmed() -> None:
    peer = Peer()
    peer.send(frame(HEADERS, 0, 1, peer.block()[:3]))
    for _ in range(100):
        peer.send(frame(CONTINUATION, 0, 1, b""))
        if peer.conn.closed:
            break
    assert peer.goaway_code() == ErrorCode.ENHANCE_YOUR_CALM
    assert not peer.events.requests


def test_header_block_size_is_capped() -> None:
    peer = Peer(Limits(max_header_block=20_000))
    block = peer.block([*REQUEST, ("x-big", "v" * 30_000)])
    peer.send(frame(HEADERS, 0, 1, block[:16_000]))
    peer.send(frame(CONTINUATION, 0, 1, block[16_000:32_000]))
    assert peer.goaway_code() == ErrorCode.ENHANCE_YOUR_CALM


def test_hpack_bomb_is_calmed() -> None:
    """One 3 KB header put in the dynamic table, then referenced by one byte
    each: a small block that decodes to far more than the header list limit."""
    peer = Peer(Limits(max_header_list_size=16_384))
    value = b"b" * 3000
    length = bytes([0x7F, 0x80 | (3000 - 127) % 128, (3000 - 127) // 128])  # RFC 7541 5.1
    entry = b"\x40" + bytes([6]) + b"x-bomb" + length + value  # literal, incremental indexing
    block = peer.block() + entry + b"\xbe" * 8  # index 62: the newest entry
    assert len(block) < 3200
    peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, block))
    assert peer.goaway_code() == ErrorCode.ENHANCE_YOUR_CALM
    assert not peer.events.requests


def test_settings_flood_is_calmed() -> None:
    peer = Peer(Limits(junk_burst=100, junk_rate=10))
    for _ in range(200):
        peer.send(settings())
        if peer.conn.closed:
            break
    assert peer.goaway_code() == ErrorCode.ENHANCE_YOUR_CALM


def test_malformed_requests_are_reset() -> None:
    peer = Peer()
    bad = [
        [("content-type", "application/grpc"), *REQUEST],  # pseudo after regular
        [*REQUEST, ("Upper", "x")],
        [*REQUEST, ("connection", "keep-alive")],
        [r for r in REQUEST if r[0] != ":path"],
        [*REQUEST, (":status", "200")],
    ]
    for i, headers in enumerate(bad):
        sid = 1 + 2 * i
        peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, sid, peer.block(headers)))
        (rst,) = peer.take()
        assert (rst.type, rst.stream_id, rst.error_code) == (
            RST_STREAM,
            sid,
            ErrorCode.PROTOCOL_ERROR,
        )
    assert not peer.events.requests and not peer.conn.closed


def test_reusing_a_stream_id_is_a_connection_error() -> None:
    peer = Peer()
    peer.open(5, end_stream=True)
    peer.open(3, end_stream=True)
    assert peer.goaway_code() == ErrorCode.STREAM_CLOSED


def test_window_update_errors() -> None:
    peer = Peer()
    peer.open(1)
    peer.send(frame(WINDOW_UPDATE, 0, 1, (0).to_bytes(4, "big")))
    (rst,) = peer.take()
    assert (rst.type, rst.error_code) == (RST_STREAM, ErrorCode.PROTOCOL_ERROR)
    peer.send(frame(WINDOW_UPDATE, 0, 0, (2**31 - 1).to_bytes(4, "big")))
    assert peer.goaway_code() == ErrorCode.FLOW_CONTROL_ERROR


def test_response_after_request_still_open_resets_with_no_error() -> None:
    """A response complete before the request (an early error on a stream):
    trailers, then RST_STREAM(NO_ERROR), and late DATA is ignored."""
    peer = Peer()
    peer.open(1)
    peer.conn.send_headers(1, b"\x88", end_stream=True)
    frames = peer.take()
    assert [(f.type, f.error_code if f.type == RST_STREAM else 0) for f in frames] == [
        (HEADERS, 0),
        (RST_STREAM, ErrorCode.NO_ERROR),
    ]
    peer.send(frame(DATA, 0, 1, b"late"))
    assert not peer.take()


def test_repeated_header_blocks_decode_right_as_the_table_changes() -> None:
    """The same bytes referencing the dynamic table mean other headers once the
    table has changed: the decoded-block memo must not answer stale ones."""
    peer = Peer()
    plain = header_blocks.block([(k.encode(), v.encode()) for k, v in REQUEST])  # no indexing
    add = b"\x40" + bytes([3]) + b"x-a" + bytes([1]) + b"1"  # literal, incremental indexing
    newest = b"\xbe"  # index 62: the newest dynamic entry
    peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, plain + add))
    for sid in (3, 5):  # the same block twice: x-a: 1 both times
        peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, sid, plain + newest))
    add_b = b"\x40" + bytes([3]) + b"x-b" + bytes([1]) + b"2"
    peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 7, plain + add_b))
    peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 9, plain + newest))
    last = [dict(h) for _, h, _ in peer.events.requests]
    assert [d.get(b"x-a") for d in last] == [b"1", b"1", b"1", None, None]
    assert last[4].get(b"x-b") == b"2"


def test_resets_of_answered_streams_are_not_rapid_reset() -> None:
    """A client that cancels each stream once answered (etcd's KeepAliveOnce,
    a closed watch) is not attacking: only unanswered resets count."""
    peer = Peer(Limits(reset_burst=50, reset_rate=10))
    for sid in range(1, 2000, 2):
        peer.open(sid)
        peer.conn.send_headers(sid, b"\x88")
        peer.send(frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big")))
    assert not peer.conn.closed
    assert len(peer.events.resets) == 1000


def test_blocks_of_indexed_fields_only_decode_as_hpack_does() -> None:
    """A block of indexed fields only (read without hpack's general decoder)
    names the same headers as hpack would, also after an insertion moved
    every index by one."""
    peer = Peer()
    reference = Decoder()
    extra = [*REQUEST, ("x-n", "1")]
    blocks = [peer.block(), peer.block(), peer.block(extra), peer.block(), peer.block(extra)]
    assert all(b >= 0x80 for b in blocks[1]) and all(b >= 0x80 for b in blocks[3])
    for i, block in enumerate(blocks):
        peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1 + 2 * i, block))
    expected = [reference.decode(block, raw=True) for block in blocks]
    assert [headers for _, headers, _ in peer.events.requests] == [
        [tuple(h) for h in headers] for headers in expected
    ]
    assert [dict(h).get(b"x-n") for _, h, _ in peer.events.requests] == [
        None,
        None,
        b"1",
        None,
        b"1",
    ]


def test_indexed_fields_over_the_header_list_limit_are_calmed() -> None:
    """The bomb of `test_hpack_bomb_is_calmed` sent as indexed fields only."""
    peer = Peer(Limits(max_header_list_size=16_384))
    bomb = ("x-bomb", "b" * 3000)
    peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 1, peer.block([*REQUEST, bomb])))
    assert len(peer.events.requests) == 1
    block = peer.block([*REQUEST, *[bomb] * 6])
    assert all(b >= 0x80 for b in block) and len(block) < 32
    peer.send(frame(HEADERS, FLAG_END_HEADERS | FLAG_END_STREAM, 3, block))
    assert peer.goaway_code() == ErrorCode.ENHANCE_YOUR_CALM
    assert len(peer.events.requests) == 1
