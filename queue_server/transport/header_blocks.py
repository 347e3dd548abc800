"""HPACK encoding of the header blocks this server sends (RFC 7541).

What belongs here: turning response headers and trailers into HPACK bytes. Every
field is a literal without indexing (or a static-table index), so we never keep
an encoder dynamic table: nothing the peer's SETTINGS_HEADER_TABLE_SIZE says can
put our blocks out of step, and the common blocks (the response headers, the OK
trailers) are constants built once. The first block of a connection opens with a
dynamic table size update to 0, which declares that for good. Decoding what
clients send is the `hpack` package's job, not this module's.
"""

from __future__ import annotations

from collections.abc import Iterable

TABLE_SIZE_ZERO = b"\x20"
"""A dynamic table size update to 0 (RFC 7541 6.3)."""

_STATIC_NAMES = {b":status": 8, b"content-type": 31}
"""Static-table indexes of the names we send with an indexed name."""


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """RFC 7541 5.1: `value` with an N-bit prefix; `first` holds the high bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(raw: bytes) -> bytes:
    """A string literal without Huffman coding."""
    return _integer(len(raw), 7, 0) + raw


def literal(name: bytes, value: bytes) -> bytes:
    """One field as a literal without indexing (RFC 7541 6.2.2)."""
    index = _STATIC_NAMES.get(name)
    if index is not None:
        return _integer(index, 4, 0) + _string(value)
    return b"\x00" + _string(name) + _string(value)


def block(fields: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A header block of literal fields (`:status 200` as its static index)."""
    out = []
    for name, value in fields:
        out.append(b"\x88" if (name, value) == (b":status", b"200") else literal(name, value))
    return b"".join(out)


GRPC_CONTENT_TYPE = b"application/grpc"
RESPONSE_HEADERS = block([(b":status", b"200"), (b"content-type", GRPC_CONTENT_TYPE)])
"""The headers of every gRPC response."""
TRAILERS_OK = block([(b"grpc-status", b"0")])
"""The trailers of a call that succeeded."""


def trailers(code: int, message: bytes) -> bytes:
    """Trailers ending a call with status `code` (`message` already percent-encoded)."""
    fields = [(b"grpc-status", str(code).encode())]
    if message:
        fields.append((b"grpc-message", message))
    return block(fields)


def trailers_only(code: int, message: bytes) -> bytes:
    """A response that is only trailers (an error before any message)."""
    return RESPONSE_HEADERS + trailers(code, message)
