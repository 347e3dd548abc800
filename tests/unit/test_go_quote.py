"""`go_quote`, Go's strconv.Quote, with which grpc-go names the method it
refuses: the expected strings are what Go 1.19's fmt %q prints for the same
bytes."""

from __future__ import annotations

import pytest

from queue_server.transport.grpc_protocol import go_quote

pytestmark = pytest.mark.unit


def test_go_quote_is_gos_strconv_quote() -> None:
    assert go_quote(b"GET") == '"GET"'
    assert go_quote(b'a"b\\c\n\t\x00\x7f') == '"a\\"b\\\\c\\n\\t\\x00\\x7f"'
    assert go_quote("\u00e9\u200b\U0001f600".encode()) == '"\u00e9\\u200b\U0001f600"'
    assert go_quote(b"\xff") == '"\\xff"'  # not UTF-8
