"""HTTP/2 frames as a test client writes and reads them: building one, parsing
a run of them, and the fields the tests look at."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from queue_server.transport.h2 import GOAWAY

_HEADER = struct.Struct(">IBI")


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload) << 8 | ftype, flags, sid) + payload


@dataclass
class Frame:
    """One frame received."""

    type: int
    flags: int
    stream_id: int
    payload: bytes

    @property
    def error_code(self) -> int:
        """RST_STREAM's or GOAWAY's error code."""
        offset = 4 if self.type == GOAWAY else 0
        return int.from_bytes(self.payload[offset : offset + 4], "big")

    @property
    def last_stream_id(self) -> int:
        """GOAWAY's last stream id."""
        return int.from_bytes(self.payload[:4], "big") & 0x7FFFFFFF


def parse(out: bytes | bytearray) -> list[Frame]:
    """The whole frames in `out`, in order."""
    frames = []
    pos = 0
    while pos + 9 <= len(out):
        first, flags, sid = _HEADER.unpack_from(out, pos)
        length = first >> 8
        frames.append(
            Frame(first & 0xFF, flags, sid & 0x7FFFFFFF, bytes(out[pos + 9 : pos + 9 + length]))
        )
        pos += 9 + length
    return frames
