"""The checks a front makes of a write before it forwards it: the queue keys and
queue configs the embedded server refuses before proposing, refused the same
way here, so a broken one never reaches etcd.

What belongs here: `check_put` and `check_txn`, on a request's bytes as they
came. A request that names no queue key is never parsed (a bytes search for
the queue prefixes decides), so plain KV traffic pays for a scan and nothing
more. etcd's own checks of a request (an empty key, too many ops, overlapping
puts) stay etcd's: a Txn that etcd would refuse anyway is forwarded, so its
error comes from etcd, as it would embedded, where etcd's checks come first.
"""

from __future__ import annotations

from etcdserverpb import rpc_pb2
from queue_server.errors import EtcdError
from queue_server.keyspace import grammar
from queue_server.keyspace.config import ConfigFields, invalid, parse_config
from queue_server.kv import validation
from queue_server.mq.state import QueueSettings

UNCHECKED_TXN_OPS = 1 << 30
"""The op limit of our reading of etcd's Txn checks: the limit is etcd's own
(its --max-txn-ops), and it answers a Txn over it itself."""


def _names_a_queue(data: bytes) -> bool:
    return any(prefix in data for prefix in grammar.PREFIXES)


def check_queue_write(key: bytes, value: bytes) -> None:
    """Refuse a put of a malformed queue key or of a config outside the schema
    (the embedded router's `check_write`, with the etcd-key queue's settings
    alone: CQS is not served over etcd)."""
    if not key.startswith(grammar.PREFIXES):
        return
    grammar.check_put(key)
    if not key.endswith(b"/config"):
        return
    parsed = grammar.parse(key)
    if parsed is None or parsed.kind != "config":
        return
    config = parse_config(key, value)
    if "cqs" in config:
        raise invalid(key, '"cqs": CQS queues are not served by fronts over etcd')
    fields = ConfigFields(key, config, strict=True)
    fields.only(QueueSettings.FIELDS)
    QueueSettings.of(fields)


def check_put(data: bytes) -> None:
    """Refuse a serialized PutRequest as the embedded server would (an EtcdError)."""
    if not _names_a_queue(data):
        return
    request = rpc_pb2.PutRequest.FromString(data)
    check_queue_write(request.key, request.value)


def check_txn(data: bytes) -> None:
    """Refuse a serialized TxnRequest whose puts (in either branch, nested ones
    too) the embedded server would refuse, unless etcd refuses it first."""
    if not _names_a_queue(data):
        return
    request = rpc_pb2.TxnRequest.FromString(data)
    try:
        validation.check_txn(request, UNCHECKED_TXN_OPS)
    except EtcdError:
        return  # etcd's own refusal: etcd answers it
    validation.check_txn(request, UNCHECKED_TXN_OPS, check_queue_write)
