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

A key with a queue's shape but a broken part is refused rather than taken as
an ordinary key that nothing would ever consume (`put_problem`,
`watch_problem`; docs/queue.md, "Refused keys"). The shape is the second
segment: a producer word (`p`, `producer`) for a put, a consumer word (`c`,
`consumer`) for a watch. Broken parts: an empty `{name}`, the other spelling's
word (`/q/x/producer/k`, `/queue/x/c/u`), no or an empty `{key}`, no or an
empty `{uuid}` or one that is not a UUID, and a range on a consumer key. Every
other key under the prefixes (`/q/x/other/y`, `/q/`, a range over `/q/x/c/`)
stays an ordinary key. These checks need no state: the API layer makes them
before anything is proposed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from queue_server.errors import EtcdError

SHORT = b"/q/"
LONG = b"/queue/"
PREFIXES = (SHORT, LONG)
"""Every queue key starts with one of these (`key.startswith(PREFIXES)`)."""
IDX_DIGITS = 16
"""Enough for 10^16 messages per queue; fixed width keeps key order = idx order."""

_PRODUCE = {SHORT: b"p", LONG: b"producer"}
_CONSUME = {SHORT: b"c", LONG: b"consumer"}
_PRODUCE_WORDS = frozenset(_PRODUCE.values())
_CONSUME_WORDS = frozenset(_CONSUME.values())


class MalformedQueueKey(EtcdError):
    """A key shaped like a queue's with a broken part (see `put_problem`)."""

    code = "INVALID_ARGUMENT"
    message = "etcdserver: malformed queue key"


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


def parse_consumer(key: bytes) -> QueueKey | None:
    """The parsed key if a watch on exactly `key` is a queue consumer's (and a
    put of it a consumer's registry key), else None."""
    qk = parse(key) if key.startswith(PREFIXES) else None
    return qk if qk is not None and qk.kind == "consume" else None


def message_key(spelling: bytes, name: bytes, idx: int, key: bytes) -> bytes:
    return b"%s%s/%0*d/%s" % (spelling, name, IDX_DIGITS, idx, key)


def registry_key(spelling: bytes, name: bytes) -> bytes:
    return spelling + name


def consumer_key(spelling: bytes, name: bytes, consumer: bytes) -> bytes:
    return b"%s%s/%s/%s" % (spelling, name, _CONSUME[spelling], consumer)


def producer_key(spelling: bytes, name: bytes, key: bytes) -> bytes:
    return b"%s%s/%s/%s" % (spelling, name, _PRODUCE[spelling], key)


def config_key(spelling: bytes, name: bytes) -> bytes:
    return b"%s%s/config" % (spelling, name)


def valid_consumer_id(text: bytes) -> bool:
    try:
        uuid.UUID(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True


# -- refused shapes ------------------------------------------------------------


def malformed(key: bytes, why: str) -> MalformedQueueKey:
    """The error for `key` refused because of `why`."""
    return MalformedQueueKey(f"etcdserver: queue key {show(key)}: {why}")


def show(text: bytes) -> str:
    """Key bytes for a message (what is not UTF-8 as \\x escapes)."""
    return text.decode("utf-8", "backslashreplace")


def _segments(key: bytes) -> tuple[bytes, list[bytes]] | None:
    sp = spelling_of(key)
    if sp is None:
        return None
    return sp, key[len(sp) :].split(b"/")


def _mixed(spelling: bytes, word: bytes, words: dict[bytes, bytes], what: str) -> str:
    other = LONG if spelling == SHORT else SHORT
    return (
        f'"{show(word)}" is the {show(other)} spelling: a {show(spelling)} {what} key is '
        f"{show(spelling)}{{name}}/{show(words[spelling])}/..."
    )


def put_problem(key: bytes) -> str | None:
    """Why a put on `key` is refused, or None when it is not (a well-formed
    queue key, or an ordinary key)."""
    split = _segments(key)
    if split is None:
        return None
    spelling, parts = split
    if len(parts) < 2:
        return None
    name, word = parts[0], parts[1]
    if word in _PRODUCE_WORDS:
        if not name:
            return "empty queue name"
        if word != _PRODUCE[spelling]:
            return _mixed(spelling, word, _PRODUCE, "producer")
        if len(parts) == 2:
            return "producer key with no message key"
        if not parts[2]:
            return "empty message key"
    elif word == b"config" and len(parts) == 2 and not name:
        return "empty queue name"
    return None


def watch_problem(key: bytes, range_end: bytes) -> str | None:
    """Why a watch of `key` (to `range_end`, empty: the key alone) is refused,
    or None when it is not: a consumer, or an ordinary watch. A range over a
    queue's consumers (`/q/{name}/c/` with a prefix) or over the whole queue is
    an operator's view and stays an ordinary watch."""
    split = _segments(key)
    if split is None:
        return None
    spelling, parts = split
    if len(parts) < 2 or parts[1] not in _CONSUME_WORDS:
        return None
    name, word = parts[0], parts[1]
    if range_end:
        if len(parts) != 3 or not parts[2]:
            return None  # from /q/{name}/c/ or below a consumer key: ordinary
    elif len(parts) > 3:
        return None  # a delivery key, or a key below a consumer key: ordinary
    if not name:
        return "empty queue name"
    if word != _CONSUME[spelling]:
        return _mixed(spelling, word, _CONSUME, "consumer")
    if range_end:
        prefix = show(spelling + name + b"/" + word + b"/")
        return (
            "a consumer watch has no range_end (a prefix or range watch here consumes "
            f"nothing; watch {prefix} with a prefix to see the consumers)"
        )
    if len(parts) == 2:
        return "consumer key with no uuid"
    if not parts[2]:
        return "empty consumer uuid"
    if not valid_consumer_id(parts[2]):
        return f'consumer id "{show(parts[2])}" is not a UUID'
    return None


def check_put(key: bytes) -> None:
    """Refuse a put on a malformed queue key (MalformedQueueKey)."""
    why = put_problem(key)
    if why is not None:
        raise malformed(key, why)
