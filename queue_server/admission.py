"""What every log checks before it appends a proposal: etcd's --max-request-bytes
on the entry as etcd would log it, and the gap between appended and applied
entries past which a proposal is refused. The local log and the cluster log
both use these, so the two refuse alike.
"""

from __future__ import annotations

from etcdserverpb import internal_pb2

MAX_UNAPPLIED = 5000
"""Proposals appended but not yet applied beyond which a new one is refused with
etcd's `too many requests` (etcd's maxGapBetweenApplyAndCommitIndex): bounds the
memory a flood of writers can pin, and they retry once the log catches up."""


ENTRY_HEADER_BYTES = 14
"""etcd measures a request against --max-request-bytes as its whole raft entry,
which carries a request header our log entry has not (field 100 holding a 64-bit
request id: 13 or 14 bytes, depending on the id's top bit); counting it keeps our
limit within a byte of etcd's, never above it."""


def too_large(command: internal_pb2.Command, payload: bytes, max_request_bytes: int) -> bool:
    """etcd's --max-request-bytes check on a log entry: the request as etcd would
    log it (ENTRY_HEADER_BYTES more), without the proposer's clock stamp, which
    etcd's entries do not carry (a request at etcd's limit fits ours)."""
    size = len(payload) + ENTRY_HEADER_BYTES
    if size <= max_request_bytes:
        return False  # what the stamp takes off only makes it smaller
    if command.now_ms:
        size -= 1 + _varint_len(command.now_ms)  # field 14's tag is one byte
    return size > max_request_bytes


def _varint_len(value: int) -> int:
    value &= (1 << 64) - 1  # an int64 is encoded as its 64-bit two's complement
    return max(1, (value.bit_length() + 6) // 7)
