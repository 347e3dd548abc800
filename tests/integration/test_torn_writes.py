"""Damaged data dirs, through a real server process: a torn log tail is cut and
the server serves everything acknowledged before it, saying in its log what it
dropped; a damaged record with good records after it, and a backend whose
state image fails its checksum, stop the server at
startup with exit status 1 and a message naming the file: damaged state is never
served. The record-level cases are in `tests/unit/test_storage.py`.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import STOP_TIMEOUT, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.crash]

KEYS = 40
_RECORD_HEADER = struct.Struct("<IIQ")  # the WAL's record header (storage/wal.py)


def _write_keys(server: ServerProcess, prefix: str) -> dict[bytes, int]:
    with grpc.insecure_channel(server.endpoint) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        return {
            key: kv.Put(rpc_pb2.PutRequest(key=key, value=b"v" * 64), timeout=10).header.revision
            for key in (f"{prefix}{i:03d}".encode() for i in range(KEYS))
        }


def _read_all(server: ServerProcess) -> dict[bytes, int]:
    with grpc.insecure_channel(server.endpoint) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        r = kv.Range(rpc_pb2.RangeRequest(key=b"\0", range_end=b"\0"), timeout=10)
    return {k.key: k.mod_revision for k in r.kvs}


def _refused_start(server: ServerProcess) -> str:
    """Start on a damaged data dir; the server must exit 1. Returns its log."""
    server.start(wait=False)
    assert server.proc is not None
    code = server.proc.wait(timeout=STOP_TIMEOUT)
    assert code == 1, server.log_text()[-2000:]
    return server.log_text()


def _record_offsets(segment: bytes) -> list[int]:
    """Where each record of a segment starts (`length | crc | index | payload`)."""
    offsets, pos = [], 0
    while pos < len(segment):
        offsets.append(pos)
        pos += _RECORD_HEADER.size + _RECORD_HEADER.unpack_from(segment, pos)[0]
    return offsets


def _newest_segment(data_dir: Path) -> Path:
    return sorted((data_dir / "wal").glob("*.log"))[-1]


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_torn_tail_is_cut_and_served(tmp_path: Path, damage: str) -> None:
    server = ServerProcess(tmp_path / "torn.etcd")
    server.start()
    try:
        acknowledged = _write_keys(server, "k")
        server.kill()
        segment = _newest_segment(server.data_dir)
        data = segment.read_bytes()
        if damage == "truncate":  # the last record half written
            segment.write_bytes(data[:-30])
            lost = max(acknowledged, key=lambda k: acknowledged[k])
            del acknowledged[lost]  # as if its write had been torn, never acknowledged
            cut_at = _record_offsets(data)[-1]
            dropped = len(data) - 30 - cut_at
        else:  # a record header and some of its bytes, never completed
            segment.write_bytes(data + data[-60:-10])
            cut_at, dropped = len(data), 50
        server.start()
        assert _read_all(server) == acknowledged
        m = re.search(
            r"wal torn tail dropped segment=\S+ offset=(\d+) dropped_bytes=(\d+)", server.log_text()
        )
        assert m, server.log_text()[-2000:]
        assert (int(m.group(1)), int(m.group(2))) == (cut_at, dropped)
        if damage == "truncate":  # it goes on writing after the last good record
            after = _write_keys(server, "after")
            server.kill()
            server.start()
            assert _read_all(server) == {**acknowledged, **after}
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


def test_damaged_record_in_the_middle_refuses_to_start(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "mid.etcd")
    server.start()
    try:
        _write_keys(server, "k")
        server.kill()  # a stop checkpoints the backend and leaves the log empty
        segment = _newest_segment(server.data_dir)
        data = bytearray(segment.read_bytes())
        middle = len(data) // 2
        data[middle] ^= 0x40
        segment.write_bytes(bytes(data))
        text = _refused_start(server)
        assert "is damaged: wal segment" in text and "refusing to start" in text, text[-2000:]
        assert "not a torn write" in text
        assert segment.read_bytes() == bytes(data)  # nothing was cut
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


def test_damaged_backend_image_is_refused(tmp_path: Path) -> None:
    """The backend's sections image (queues, leases, auth... beside the key
    revisions) carries its own checksum: a flipped bit in it stops the start,
    naming it, and the same file with the bit back serves everything."""
    server = ServerProcess(tmp_path / "db.etcd")
    server.start()
    try:
        acknowledged = _write_keys(server, "k")
        server.stop()  # a stop checkpoints: the state is in member/db
        db = server.data_dir / "member" / "db" / "data.mdb"
        data = bytearray(db.read_bytes())
        images = [m.start() for m in re.finditer(re.escape(b"QSNAP2\n"), data)]
        assert images, "no sections image in the backend"
        for at in images:  # the committed one, and any copy in a freed page
            data[at + 12] ^= 0x01
        db.write_bytes(bytes(data))
        text = _refused_start(server)
        assert re.search(r"sections is not a valid snapshot: it fails its checksum", text), text[
            -2000:
        ]
        assert "refusing to start" in text
        for at in images:
            data[at + 12] ^= 0x01
        db.write_bytes(bytes(data))
        server.start()
        assert _read_all(server) == acknowledged
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()
