"""The key grammar of etcd-key queues, in both spellings.

    /q/{name}                      registry: the node dispatching the queue
    /q/{name}/config               settings (JSON), written by users
    /q/{name}/p/{key}              produce (a put here enqueues)
    /q/{name}/c/{uuid}             consume (a watch here), and the consumer's registry key
    /q/{name}/{idx}/{key}          a message: pending or delivered; delete = ack
    /q/{name}/c/{uuid}/{idx}/{key} a delivery handed over between nodes (same message)

`/queue/{name}/producer/{key}` and `/queue/{name}/consumer/{uuid}` are the long
spelling; a queue's message keys use the spelling of its registry key. `{name}` and
`{key}` are one path segment: anything after a further "/" in a producer key is
dropped. `{idx}` is zero-padded to `IDX_DIGITS` so keys sort in enqueue order.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

SHORT = b"/q/"
LONG = b"/queue/"
PREFIXES = (SHORT, LONG)
"""Every queue key starts with one of these (`key.startswith(PREFIXES)`)."""
IDX_DIGITS = 16
"""Enough for 10^16 messages per queue; fixed width keeps key order = idx order."""

_PRODUCE = {SHORT: b"p", LONG: b"producer"}
_CONSUME = {SHORT: b"c", LONG: b"consumer"}


@dataclass(slots=True)
class QueueKey:
    """A parsed queue key. `kind` is produce, consume, message, delivery, config
    or registry; fields not used by a kind are empty/zero."""

    kind: str
    spelling: bytes  # SHORT or LONG
    name: bytes
    key: bytes = b""
    idx: int = 0
    consumer: bytes = b""


def spelling_of(key: bytes) -> bytes | None:
    if key.startswith(SHORT):
        return SHORT
    if key.startswith(LONG):
        return LONG
    return None


def parse(key: bytes) -> QueueKey | None:
    """The queue meaning of `key`, or None for an ordinary key."""
    sp = spelling_of(key)
    if sp is None:
        return None
    parts = key[len(sp) :].split(b"/")
    name = parts[0]
    if not name:
        return None
    if len(parts) == 1:
        return QueueKey("registry", sp, name)
    second = parts[1]
    if second == _PRODUCE[sp] and len(parts) >= 3 and parts[2]:
        return QueueKey("produce", sp, name, key=parts[2])
    if second == _CONSUME[sp] and len(parts) >= 3 and parts[2]:
        if len(parts) == 3:
            return QueueKey("consume", sp, name, consumer=parts[2])
        if len(parts) == 5 and parts[3].isdigit() and parts[4]:
            return QueueKey(
                "delivery", sp, name, key=parts[4], idx=int(parts[3]), consumer=parts[2]
            )
        return None
    if second == b"config" and len(parts) == 2:
        return QueueKey("config", sp, name)
    if len(parts) == 3 and second.isdigit() and parts[2]:
        return QueueKey("message", sp, name, key=parts[2], idx=int(second))
    return None


def message_key(spelling: bytes, name: bytes, idx: int, key: bytes) -> bytes:
    return b"%s%s/%0*d/%s" % (spelling, name, IDX_DIGITS, idx, key)


def registry_key(spelling: bytes, name: bytes) -> bytes:
    return spelling + name


def consumer_key(spelling: bytes, name: bytes, consumer: bytes) -> bytes:
    return b"%s%s/%s/%s" % (spelling, name, _CONSUME[spelling], consumer)


def producer_key(spelling: bytes, name: bytes, key: bytes) -> bytes:
    return b"%s%s/%s/%s" % (spelling, name, _PRODUCE[spelling], key)


def valid_consumer_id(text: bytes) -> bool:
    try:
        uuid.UUID(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True
