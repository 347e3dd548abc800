"""Building CQS log commands on the proposer's side.

Apply reads no clock and draws no random numbers (`state.py`), so whoever
proposes a CQS command stamps it here: with `now`, its wall clock in Unix
milliseconds (the node's one clock, `node/timers.py`'s `Timers.wall_ms`, which
each caller is given), and for a dequeue a fresh random token base. The gRPC
service, the etcd watch view and the visibility timer (`visibility.py`) build
their commands with these.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from etcdserverpb import internal_pb2

UNGROUPED = -1
"""A dequeue `depth` that takes the queue's order without prefix grouping."""


def dequeue(
    queue: str, max_records: int, depth: int, visibility_ms: int, now: int
) -> internal_pb2.Command:
    """Take up to `max_records` (grouped by `depth`; 0: the queue's own), each
    invisible to others for `visibility_ms` after `now` (Unix ms) unless
    acknowledged."""
    command = internal_pb2.Command()
    d = command.cqs_dequeue
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


def settle(
    queue: str, tokens: Iterable[str], now: int, release: bool = False
) -> internal_pb2.Command:
    """Acknowledge these tokens, or with `release` make their notifications
    visible again at once (`now`: Unix ms, the proposer's clock)."""
    command = internal_pb2.Command()
    s = command.cqs_settle
    s.queue = queue
    s.tokens.extend(tokens)
    s.now_ms = now
    s.release = release
    return command
