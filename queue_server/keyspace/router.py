"""One router for the queue keyspace: every KV write under `/q/` or `/queue/`.

The KV executor knows nothing of queues. It calls one hook object, this router,
at four points of a request: before a request's writes are checked
(`begin_request`), to check a put before anything changes (`check_put`), to name
the key a put or a single-key delete really touches (`route_put`,
`route_delete`), and to add keys that live outside the store to a Range
(`range_view`). After each committed write transaction the state machine hands
the events to `follow`, and at the end of each command calls `after_apply`.

The router parses a key once and hands the parsed `QueueKey` to the product that
owns the queue: the first `QueuePlugin` whose `claims` says so (CQS claims its
own queues and publication points; the etcd-key queue takes the rest). The
shared `/q/{name}/config` is parsed once and shown to every product.

Everything here runs inside apply: deterministic, no clock (a command's time,
`now_ms`, comes in the command), no I/O. The one exception is `check_write`,
which the KV service calls before it proposes a put (the stateless checks: a
malformed queue key, a config outside the schema), and which reads no state.
Node-local code never asks the router who owns a queue (its answers are
cached for one command): it asks the products' state (`CqsState.owns_consumer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from queue_server.keyspace import grammar
from queue_server.keyspace.config import QueueConfig, parse_config
from queue_server.keyspace.grammar import QueueKey
from queue_server.mvcc.store import Event, KeyValue, MVCCStore


class QueuePlugin(Protocol):
    """A product that owns queues of the keyspace (the etcd-key queue, CQS)."""

    config_fields: frozenset[str]
    """The fields of `/q/{name}/config` this product reads."""

    def claims(self, qk: QueueKey) -> bool:
        """Whether the queue `qk` names is this product's."""
        ...

    def begin_command(self, now_ms: int) -> None:
        """A log command starts; `now_ms` is its proposer's clock (0: none)."""
        ...

    def begin_request(self) -> None:
        """A new request's writes are about to be checked."""
        ...

    def check_produce(self, qk: QueueKey, value: bytes) -> None:
        """Refuse a produce before anything changes (raise an EtcdError)."""
        ...

    def produce(self, qk: QueueKey, value: bytes) -> bytes | None:
        """Apply a produce: the key to write, or None when nothing is written."""
        ...

    def check_config(self, key: bytes, config: QueueConfig, *, strict: bool) -> None:
        """Refuse this product's fields of the config at `key`: by the schema
        (`strict`, before a put is proposed) or as apply reads them, before
        anything changes (keyspace/config.py)."""
        ...

    def configure(self, qk: QueueKey, config: QueueConfig | None) -> None:
        """A queue's config was written (None: deleted)."""
        ...

    def delete(self, qk: QueueKey, key: bytes, now_ms: int) -> bytes | int:
        """A single-key delete of a message or delivery key: the key it really
        deletes, or how many deliveries it settled when no key is deleted."""
        ...

    def follow(self, qk: QueueKey, event: Event) -> None:
        """A committed change of one of this product's keys."""
        ...

    def view_range(
        self, key: bytes, end: bytes | None, revision: int, limit: int
    ) -> tuple[list[KeyValue], int]:
        """Keys of this product that live outside the store, inside [key, end):
        the first `limit` in key order (0: all; -1: none) and their count."""
        ...

    def after_apply(self, store: MVCCStore) -> None:
        """The end of a command."""
        ...


class KeyspaceRouter:
    """Routes queue keys to the product owning their queue (first claim wins)."""

    def __init__(self, plugins: Sequence[QueuePlugin]) -> None:
        self.plugins = tuple(plugins)
        self.config_fields = frozenset().union(*(p.config_fields for p in self.plugins))
        self.now_ms = 0
        # keys parsed in this request (check then write), and message keys made
        # by produces (their events follow): each key is parsed once
        self._parsed: dict[bytes, QueueKey | None] = {}
        # the product owning each queue, within one command (a config change
        # may move a queue between products: it clears this)
        self._owners: dict[tuple[bytes, bytes], QueuePlugin] = {}

    # -- parsing --------------------------------------------------------------

    def parse(self, key: bytes) -> QueueKey | None:
        """The queue meaning of `key` (None for an ordinary key)."""
        if not key.startswith(grammar.PREFIXES):
            return None
        parsed = self._parsed
        if key in parsed:
            return parsed[key]
        qk = parsed[key] = grammar.parse(key)
        return qk

    def owner(self, qk: QueueKey) -> QueuePlugin:
        ident = (qk.spelling, qk.name)
        found = self._owners.get(ident)
        if found is not None:
            return found
        for plugin in self.plugins:
            if plugin.claims(qk):
                self._owners[ident] = plugin
                return plugin
        raise AssertionError(f"no product claims queue {qk.name!r}")  # the last claims all

    def forget(self) -> None:
        """The products' state was replaced (a snapshot restore): drop what was
        remembered of it."""
        self._owners.clear()
        self._parsed.clear()

    # -- before proposing -----------------------------------------------------

    def check_write(self, key: bytes, value: bytes) -> None:
        """The checks of a put that need no state, made by the KV service before
        it proposes (a Txn's puts in every branch): a malformed queue key, and a
        config outside the products' schemas. Reads nothing of the state, so it
        may run outside apply."""
        if not key.startswith(grammar.PREFIXES):
            return
        grammar.check_put(key)
        if not key.endswith(b"/config"):
            return  # what follows is for config keys; most puts here produce
        qk = grammar.parse(key)  # not self.parse: its cache belongs to apply
        if qk is not None and qk.kind == "config":
            config = parse_config(key, value, self.config_fields)
            for plugin in self.plugins:
                plugin.check_config(key, config, strict=True)

    # -- the KV executor's hooks ----------------------------------------------

    def begin_command(self, now_ms: int) -> None:
        """A log command starts; `now_ms` is its proposer's clock (0: none)."""
        self.now_ms = now_ms
        self._owners.clear()
        for plugin in self.plugins:
            plugin.begin_command(now_ms)

    def begin_request(self) -> None:
        self._parsed.clear()
        for plugin in self.plugins:
            plugin.begin_request()

    def check_put(self, key: bytes, value: bytes) -> None:
        qk = self.parse(key)
        if qk is None:
            return
        if qk.kind == "produce":
            self.owner(qk).check_produce(qk, value)
        elif qk.kind == "config":
            config = parse_config(key, value, self.config_fields)
            for plugin in self.plugins:
                plugin.check_config(key, config, strict=False)

    def route_put(self, key: bytes, value: bytes) -> bytes | None:
        """The key a put writes (None: consumed, nothing written)."""
        qk = self.parse(key)
        if qk is None or qk.kind != "produce":
            return key
        written = self.owner(qk).produce(qk, value)
        if written is not None:
            spelling = grammar.SHORT if written.startswith(grammar.SHORT) else grammar.LONG
            self._parsed[written] = QueueKey(
                "message", spelling, qk.name, key=qk.key, idx=_idx_of(written)
            )
        return written

    def route_delete(self, key: bytes) -> bytes | int:
        """The key a single-key delete removes, or the deliveries it settled."""
        qk = self.parse(key)
        if qk is None or qk.kind not in ("message", "delivery"):
            return key
        return self.owner(qk).delete(qk, key, self.now_ms)

    def range_view(
        self, key: bytes, end: bytes | None, revision: int, limit: int
    ) -> tuple[list[KeyValue], int]:
        out: list[KeyValue] = []
        count = 0
        for plugin in self.plugins:
            shown, n = plugin.view_range(key, end, revision, limit)
            out.extend(shown)
            count += n
        return out, count

    # -- following the store --------------------------------------------------

    def follow(self, revision: int, events: list[Event]) -> None:
        """A committed write transaction: each queue key's event to its owner,
        configs to every product."""
        for e in events:
            qk = self.parse(e.kv.key)
            if qk is None:
                continue
            if qk.kind == "config":
                self._owners.clear()
                config: Mapping[str, object] | None = None
                if not e.is_delete:
                    config = parse_config(e.kv.key, e.kv.value, self.config_fields)
                for plugin in self.plugins:
                    plugin.configure(qk, config)
            else:
                self.owner(qk).follow(qk, e)

    def after_apply(self, store: MVCCStore) -> None:
        self._parsed.clear()
        for plugin in self.plugins:
            plugin.after_apply(store)


def _idx_of(message_key: bytes) -> int:
    """The idx of a message key `{prefix}{name}/{idx}/{key}`."""
    end = message_key.rindex(b"/")
    return int(message_key[message_key.rindex(b"/", 0, end) + 1 : end])
