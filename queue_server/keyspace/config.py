"""The settings document of a queue, `/q/{name}/config`: one JSON object.

Every product reads its own fields of it (the etcd-key queue its limits, CQS its
`cqs` object); the router parses the JSON once per write and hands each product
the same mapping, and refuses fields no product knows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from queue_server.errors import EtcdError

QueueConfig = Mapping[str, object]


class InvalidQueueConfig(EtcdError):
    code = "INVALID_ARGUMENT"
    message = "etcdserver: invalid queue config"


def invalid(why: str) -> InvalidQueueConfig:
    """The error for a config refused because of `why`."""
    return InvalidQueueConfig(f"etcdserver: invalid queue config: {why}")


def parse_config(value: bytes, known: Iterable[str] | None = None) -> QueueConfig:
    """The JSON object of a config value (empty: no settings); refuses anything
    else, and fields outside `known` (None: any field)."""
    try:
        raw = json.loads(value or b"{}")
    except ValueError as e:
        raise invalid(str(e)) from e
    if not isinstance(raw, dict):
        raise invalid("expected a JSON object")
    unknown = set(raw) - set(known) if known is not None else set()
    if unknown:
        raise invalid(f"unknown setting {sorted(unknown)[0]!r}")
    return raw
