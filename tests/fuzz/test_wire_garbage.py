"""Malformed bytes on the wire: the server answers as etcd (grpc-go) does and stays up.

- Random bytes, and truncated or bit-flipped encodings of well-typed requests, as
  the payload of every method (a generic call with identity serializers). Bytes
  that do not parse get INTERNAL "grpc: error unmarshalling request: ..." (on a
  stream, "grpc: failed to unmarshal the received message ..."), which is what
  etcd's grpc-go sends; grpcio's own default would be UNKNOWN plus a logged
  traceback per request (see queue_server/api/registry.py). Bytes that happen to
  parse are requests like any other and must get an etcd status.
- Raw garbage on the TCP port (not HTTP/2, or a valid preface then junk frames)
  and connections that open and say nothing: the server drops them and serves on.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz import harness
from tests.fuzz.strategies import message_strategy
from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

CI_EXAMPLES = 12
RAW_CONNECTIONS = 40
"""Garbage TCP connections per test (CI); each costs a connect and a close."""
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

RPCS = harness.all_rpcs()
CASES: dict[str, int] = {}


def _identity(b: bytes) -> bytes:
    return b


@pytest.fixture(scope="module")
def garbage_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("garbage") / "garbage.etcd").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def raw_channel(garbage_server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(garbage_server.endpoint) as ch:
        yield ch


def _payloads(rpc: harness.Rpc) -> st.SearchStrategy[bytes]:
    """Random bytes, or a real request's encoding truncated or with a byte flipped."""
    encoded = message_strategy(rpc.request_class.DESCRIPTOR).map(lambda m: m.SerializeToString())

    def damage(data: bytes, cut: int, flip: int) -> bytes:
        if not data:
            return b"\xff"
        if flip % 2:
            i = flip % len(data)
            return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
        return data[: cut % len(data)] or b"\x0a"

    damaged = st.builds(damage, encoded, st.integers(0, 255), st.integers(0, 255))
    return st.one_of(st.binary(min_size=1, max_size=64), damaged)


def _send(channel: grpc.Channel, rpc: harness.Rpc, payloads: list[bytes]) -> harness.Outcome:
    timeout = rpc.timeout
    try:
        if rpc.kind == "unary_unary":
            call = channel.unary_unary(
                rpc.path, request_serializer=_identity, response_deserializer=_identity
            )
            call(payloads[0], timeout=timeout)
        elif rpc.kind == "unary_stream":
            stream = channel.unary_stream(
                rpc.path, request_serializer=_identity, response_deserializer=_identity
            )
            for _ in stream(payloads[0], timeout=timeout):
                pass
        elif rpc.kind == "stream_unary":
            many = channel.stream_unary(
                rpc.path, request_serializer=_identity, response_deserializer=_identity
            )
            many(iter(payloads), timeout=timeout)
        else:
            bidi = channel.stream_stream(
                rpc.path, request_serializer=_identity, response_deserializer=_identity
            )
            for _ in bidi(iter(payloads), timeout=timeout):
                pass
    except grpc.RpcError as e:
        return harness.Outcome(e.code(), e.details() or "", [])
    return harness.Outcome(grpc.StatusCode.OK, "", [])


def _problem(rpc: harness.Rpc, outcome: harness.Outcome) -> str | None:
    if outcome.code == grpc.StatusCode.INTERNAL:
        prefix = (
            "grpc: failed to unmarshal the received message "
            if rpc.method.client_streaming
            else "grpc: error unmarshalling request: "
        )
        if outcome.details.startswith(prefix):
            return None
    return harness.status_problem(rpc, outcome)


@pytest.mark.parametrize("rpc", RPCS, ids=[r.path.lstrip("/") for r in RPCS])
def test_undecodable_payloads_get_etcds_status(
    rpc: harness.Rpc, garbage_server: ServerProcess, raw_channel: grpc.Channel
) -> None:
    n = harness.examples(CI_EXAMPLES if rpc.name not in harness.LONG_POLLS else 4)

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(payloads=st.lists(_payloads(rpc), min_size=1, max_size=3))
    def run(payloads: list[bytes]) -> None:
        outcome = _send(raw_channel, rpc, payloads)
        CASES[rpc.path] = CASES.get(rpc.path, 0) + 1
        problem = _problem(rpc, outcome)
        assert problem is None, f"{problem}\npayloads: {payloads!r}"
        assert garbage_server.proc is not None and garbage_server.proc.poll() is None

    run()


def _raw_garbage(rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    junk = rng.randbytes(rng.randrange(1, 2048))
    if kind == 0:
        return junk  # not HTTP/2 at all
    if kind == 1:
        return b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"  # HTTP/1.1 on a gRPC port
    if kind == 2:
        return HTTP2_PREFACE + junk  # a preface, then frames that make no sense
    return HTTP2_PREFACE[: rng.randrange(1, len(HTTP2_PREFACE))]  # a cut preface


def test_raw_tcp_garbage_does_not_hurt_the_server(
    garbage_server: ServerProcess, raw_channel: grpc.Channel
) -> None:
    rng = random.Random(8)
    host, port = "127.0.0.1", garbage_server.port
    count = harness.examples(RAW_CONNECTIONS)
    silent = [socket.create_connection((host, port), timeout=2) for _ in range(10)]
    try:
        for _ in range(count):
            with socket.create_connection((host, port), timeout=2) as s:
                try:
                    s.sendall(_raw_garbage(rng))
                    s.settimeout(0.2)
                    s.recv(4096)  # whatever the server says (a GOAWAY) or a close
                except OSError:
                    pass  # reset by the server: fine
    finally:
        for s in silent:
            s.close()
    assert garbage_server.proc is not None and garbage_server.proc.poll() is None
    assert harness.status_revision(raw_channel) >= 1
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # a fresh channel works too
        with grpc.insecure_channel(garbage_server.endpoint) as ch:
            assert harness.status_revision(ch) >= 1
            break


def test_no_decode_tracebacks_in_the_log(garbage_server: ServerProcess) -> None:
    """Undecodable requests are answered, not logged as unhandled exceptions."""
    text = garbage_server.log_text()
    assert "Traceback" not in text, text[-3000:]
    print(f"\nmalformed payload cases run: {sum(CASES.values())}")
