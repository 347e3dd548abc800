"""The checks a front makes of a write before it forwards it: the queue keys and
queue configs the embedded server refuses before proposing, refused the same
way here, so a broken one never reaches etcd.

What belongs here: `Admission`, whose `check_put_request` takes a parsed
PutRequest and `check_txn` a TxnRequest's bytes as they came. A request that
names no queue key is never parsed (a bytes search for the queue prefixes,
`names_a_queue`, decides), so plain KV traffic pays for a scan and nothing more. etcd's own checks of a request (an empty key, too many
ops, overlapping puts) stay etcd's: a Txn that etcd would refuse anyway is
forwarded, so its error comes from etcd, as it would embedded, where etcd's
checks come first.

A produce into a queue whose settings have a `max_depth` is refused with the
embedded server's `QueueFull` when the queue holds that many messages: its
message keys and its producer keys not moved yet, counted in etcd at the
produce. A queue's settings are read from etcd at most once a `SETTINGS_TTL`,
in the same Txn as the counts, so a queue without a limit costs one read a
second per front, and a limited one a read per produce. As embedded, the
produces of one Txn count against the depth before it; and as the count and the
put are two calls, concurrent producers on several fronts can pass the limit by
as many produces as are in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from etcdserverpb import rpc_pb2
from queue_server.cqs.state import DTO_QUEUE_PREFIX, InvalidNotification, parse_publication
from queue_server.errors import EtcdError
from queue_server.front.session import FrontSession, prefix_end, range_op
from queue_server.keyspace import grammar
from queue_server.keyspace.config import ConfigFields, InvalidQueueConfig, invalid, parse_config
from queue_server.keyspace.grammar import MalformedQueueKey
from queue_server.kv import validation
from queue_server.mq.state import QueueFull, QueueSettings

PUBLICATIONS = grammar.SHORT + DTO_QUEUE_PREFIX
CQS_CONFIG_REFUSED = '"cqs": on fronts over etcd a CQS queue is made with CreateOrConfigureQueue'
"""A CQS queue over etcd has keys beside its config (front/cqs.py) that a put of
the config alone would not write."""
SETTINGS_TTL = 1.0
"""Seconds a front trusts what it read of a queue's settings."""
UNCHECKED_TXN_OPS = 1 << 30
"""The op limit of our reading of etcd's Txn checks: the limit is etcd's own
(its --max-txn-ops), and it answers a Txn over it itself."""


_SHORT, _LONG = grammar.PREFIXES


def names_a_queue(data: bytes) -> bool:
    """Whether a request's bytes may name a queue key (a scan, no parse)."""
    return _SHORT in data or _LONG in data


def check_queue_write(key: bytes, value: bytes) -> None:
    """Refuse a put of a malformed queue key or of a config outside the schema
    (the embedded router's `check_write`, with the etcd-key queue's settings
    alone: CQS is not served over etcd)."""
    if not key.startswith(grammar.PREFIXES):
        return
    grammar.check_put(key)
    if key.startswith(PUBLICATIONS):
        parsed = grammar.parse(key)
        if parsed is not None and parsed.kind == "produce" and parsed.spelling == grammar.SHORT:
            parse_publication(parsed.name[len(DTO_QUEUE_PREFIX) :].decode(errors="replace"), value)
        return
    if not key.endswith(b"/config"):
        return
    parsed = grammar.parse(key)
    if parsed is None or parsed.kind != "config":
        return
    config = parse_config(key, value)
    if "cqs" in config:
        raise invalid(key, CQS_CONFIG_REFUSED)
    fields = ConfigFields(key, config, strict=True)
    fields.only(QueueSettings.FIELDS)
    QueueSettings.of(fields)


def _produced(request: rpc_pb2.TxnRequest | rpc_pb2.PutRequest) -> list[grammar.QueueKey]:
    """The produces a request makes (a Txn's in both branches, nested ones too)."""
    if isinstance(request, rpc_pb2.PutRequest):
        parsed = grammar.parse(request.key)
        return [parsed] if parsed is not None and parsed.kind == "produce" else []
    out: list[grammar.QueueKey] = []
    for op in (*request.success, *request.failure):
        if op.HasField("request_put"):
            out.extend(_produced(op.request_put))
        elif op.HasField("request_txn"):
            out.extend(_produced(op.request_txn))
    return out


@dataclass(slots=True)
class _Known:
    max_depth: int
    until: float


class Admission:
    """A front's checks of the writes it forwards (module docstring)."""

    def __init__(self, session: FrontSession) -> None:
        self.session = session
        self.known: dict[bytes, _Known] = {}
        """Registry key -> its max_depth, as last read."""

    async def check_put_request(self, request: rpc_pb2.PutRequest) -> None:
        """Refuse a PutRequest as the embedded server would (an EtcdError)."""
        check_queue_write(request.key, request.value)
        await self._check_depths(_produced(request))

    async def check_txn(self, data: bytes) -> list[grammar.QueueKey]:
        """Refuse a serialized TxnRequest whose puts (in either branch, nested ones
        too) the embedded server would refuse, unless etcd refuses it first;
        returns the produces it may make."""
        if not names_a_queue(data):
            return []
        request = rpc_pb2.TxnRequest.FromString(data)
        try:
            # one walk: a queue refusal is raised only when etcd's checks pass
            validation.check_txn(request, UNCHECKED_TXN_OPS, check_queue_write)
        except (MalformedQueueKey, InvalidQueueConfig, InvalidNotification):
            raise
        except EtcdError:
            return []  # etcd's own refusal: etcd answers it
        produced = _produced(request)
        await self._check_depths(produced)
        return produced

    async def _check_depths(self, produces: list[grammar.QueueKey]) -> None:
        counted: dict[bytes, tuple[grammar.QueueKey, int]] = {}
        for qk in produces:
            registry = grammar.registry_key(qk.spelling, qk.name)
            counted[registry] = (qk, counted[registry][1] + 1 if registry in counted else 1)
        for registry, (qk, produced) in counted.items():
            known = self.known.get(registry)
            if known is not None and known.until > time.monotonic() and not known.max_depth:
                continue  # no limit, as read a moment ago
            depth, max_depth = await self._read(qk)
            if max_depth and depth + produced > max_depth:
                raise QueueFull(
                    f"etcdserver: queue {grammar.show(qk.name)} is full (max_depth {max_depth})"
                )

    async def _read(self, qk: grammar.QueueKey) -> tuple[int, int]:
        """The queue's depth in etcd and its max_depth, in one read Txn."""
        registry = grammar.registry_key(qk.spelling, qk.name)
        config_key = grammar.config_key(qk.spelling, qk.name)
        producers = grammar.producer_key(qk.spelling, qk.name, b"")
        reply = await self.session.read(
            range_op(config_key),
            range_op(registry + b"/0", registry + b"/:", count_only=True),
            range_op(producers, prefix_end(producers), count_only=True),
        )
        config = reply.responses[0].response_range.kvs
        max_depth = 0
        if config:
            try:
                max_depth = QueueSettings.parse(config[0].value, config_key).max_depth
            except EtcdError:
                max_depth = 0  # a config written past the fronts' checks: no limit
        self.known[registry] = _Known(max_depth, time.monotonic() + SETTINGS_TTL)
        depth = sum(int(r.response_range.count) for r in reply.responses[1:])
        return depth, max_depth
