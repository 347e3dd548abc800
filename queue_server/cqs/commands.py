"""Building CQS log commands on the proposer's side.

Apply reads no clock and draws no random numbers (`state.py`), so whoever
proposes a CQS command stamps it here: the wall clock in Unix milliseconds and,
for a dequeue, a fresh random token base. The gRPC service, the etcd watch view,
the visibility timer (`visibility.py`) and the KV delete-to-acknowledge path all
build their commands with these.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable

from etcdserverpb import internal_pb2

UNGROUPED = -1
"""A dequeue `depth` that takes the queue's order without prefix grouping."""


def now_ms() -> int:
    """The proposer's clock: Unix time in milliseconds."""
    return int(time.time() * 1000)


def dequeue(queue: str, max_records: int, depth: int, visibility_ms: int) -> internal_pb2.Command:
    """Take up to `max_records` (grouped by `depth`; 0: the queue's own), each
    invisible to others for `visibility_ms` unless acknowledged."""
    command = internal_pb2.Command()
    d = command.cqs_dequeue
    now = now_ms()
    d.queue, d.max, d.depth, d.now_ms = queue, max_records, depth, now
    d.visible_until_ms = now + visibility_ms
    d.token_base = secrets.token_hex(8) + "-"
    return command


def expire(queue: str, now: int) -> internal_pb2.Command:
    """Make the queue's in-flight notifications whose visibility passed `now`
    (Unix ms, the proposer's clock) pending again: a `CqsSettle` of no tokens,
    since every CQS command expires what is due at its `now_ms` first."""
    command = internal_pb2.Command()
    s = command.cqs_settle
    s.queue = queue
    s.now_ms = now
    return command


def settle(queue: str, tokens: Iterable[str], release: bool = False) -> internal_pb2.Command:
    """Acknowledge these tokens, or with `release` make their notifications
    visible again at once."""
    command = internal_pb2.Command()
    s = command.cqs_settle
    s.queue = queue
    s.tokens.extend(tokens)
    s.now_ms = now_ms()
    s.release = release
    return command
