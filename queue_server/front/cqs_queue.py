"""One CQS queue's dispatcher on a front: the queue's SLA tree rebuilt from etcd,
and every change to it written back to etcd before a caller hears of it.

What belongs here (docs/front-queue-design.md, "CQS over etcd"): `CqsDispatcher`,
which holds the queue's registry key `/q/{name}` (`election.py`) and, while it
holds it, is the one place the queue's BatchDequeue, BatchAcknowledge and
ReEnqueue are served (other fronts forward them here: `front/cqs.py`).

The queue in etcd, under `/q/{name}/`:

| key | value | written by |
|---|---|---|
| `config` | `{"cqs": {...}}` | CreateOrConfigureQueue (any front) |
| `n/{26 hex digits}` | one notification: the `cqs` table's row (cqs/state.py) | this dispatcher |
| `in/{revision:016x}/{dto_type}/{key}` | a publication fanned out to this queue | the `dto:{type}` fan-out (`cqs_fanout.py`) |
| `p/{key}` | a direct enqueue, as embedded | producers |

A row's key is the hex of its 13-byte priority (SLA, id segments, seq), so etcd
keeps the rows in the queue's order and a rebuild is one range, read into the
tree (`SlaQueue.load_rows`) as a backend's rows are. The tree journals every row
it changes (`RowJournal`); `_commit` turns the journal into puts and deletes of
rows, with the deletes of the publications and enqueues just taken in, in Txns
guarded by the registry key. A dequeue's tokens, an ack and a ReEnqueue batch are
answered only once their Txn has succeeded, so what a client was told is in etcd
whoever dispatches next. A Txn that fails (deposed, or the backend did not
answer) ends the dispatching: the next holder, this front again or another,
rebuilds from etcd.

Visibility is judged by the fronts' wall clocks (`visible_at` in Unix ms, as in
the row), so fronts should keep their clocks in step as etcd members do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from etcdserverpb import cqs_pb2, kv_pb2, rpc_pb2
from queue_server.cqs.state import (
    InvalidNotification,
    TokenNotHeld,
    check_split_item,
    notification_of,
    parse_cqs_config,
    parse_publication,
)
from queue_server.cqs.tree import DamagedRow, RowJournal, SlaQueue, table_key
from queue_server.errors import EtcdError
from queue_server.front.dispatcher import txn_chunks
from queue_server.front.election import RegistryHolder
from queue_server.front.figures import WRITE_SECONDS, figures_key
from queue_server.front.session import (
    FrontSession,
    delete_op,
    prefix_end,
    prefix_op,
    put_op,
    range_op,
)
from queue_server.keyspace import grammar
from queue_server.keyspace.config import ConfigFields, parse_config

log = logging.getLogger(__name__)

SPELLING = b"/q/"
"""CQS queues over etcd live under the short spelling, as embedded."""
ROWS = b"n/"
INBOX = b"in/"
INDEX_PREFIX = b"/queue-server/cqs/"
"""`/queue-server/cqs/{name}`: every CQS queue over etcd, read and watched by
every front to know which queues to campaign for (`front/cqs.py`)."""
_TABLE = len(table_key(0))


def wall_ms() -> int:
    """The fronts' clock for visibility: Unix milliseconds."""
    return time.time_ns() // 1_000_000


class NotDispatching(EtcdError):
    """The queue's dispatching moved while the call was served: the client retries."""

    code = "UNAVAILABLE"
    message = "cqs: the queue's dispatcher changed, try again"


def subscriptions_of(name: str, value: bytes) -> tuple[list[tuple[str, str]], int] | None:
    """(subscriptions, depth) of a config document, None when it is not a CQS
    queue's (or does not parse: written past the fronts' checks)."""
    key = grammar.config_key(SPELLING, name.encode())
    try:
        parsed = parse_cqs_config(ConfigFields(key, parse_config(key, value), strict=False))
    except EtcdError as e:
        log.warning("cqs queue %s: config ignored: %s", name, e)
        return None
    return None if parsed is None else (parsed[0], parsed[1])


class CqsDispatcher(RegistryHolder):
    """One CQS queue, while this front holds its registry key."""

    def __init__(self, session: FrontSession, name: str) -> None:
        registry = grammar.registry_key(SPELLING, name.encode())
        super().__init__(session, registry)
        self.name = name
        self.prefix = registry + b"/"
        self.rows = self.prefix + ROWS
        self.inbox = self.prefix + INBOX
        self.producers = grammar.producer_key(SPELLING, name.encode(), b"")
        self.config_key = grammar.config_key(SPELLING, name.encode())
        self.index_key = INDEX_PREFIX + name.encode()
        self.tree: SlaQueue | None = None
        """The queue, while dispatching and rebuilt; None otherwise."""
        self.subscriptions: list[tuple[str, str]] = []
        self.journal = RowJournal()
        self.taken: list[bytes] = []
        """Publication and enqueue keys taken into the tree, to delete with its rows."""
        self.ours: set[int] = set()
        self.ready = asyncio.Event()
        self.figures_dirty = True
        self.figures_written = float("-inf")
        self._lock = asyncio.Lock()
        self._broken = asyncio.Event()
        self._changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- what the front's CQS service calls ----------------------------------------------

    def _serving(self) -> SlaQueue:
        if self.tree is None or self._broken.is_set():
            raise NotDispatching()
        return self.tree

    def visible(self, now: int) -> tuple[bool, float | None]:
        """(whether a dequeue at `now` finds something, when an in-flight one
        becomes visible again)."""
        tree = self._serving()
        next_visible = tree.earliest_visible()
        return bool(len(tree)) or (next_visible is not None and next_visible <= now), next_visible

    async def changed(self, timeout: float) -> None:
        """Until the queue may have gained a visible notification, or `timeout`."""
        waiter = self._changed
        if not waiter.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiter), timeout)

    def _notify(self) -> None:
        if not self._changed.done():
            self._changed.set_result(None)
        self._changed = asyncio.get_running_loop().create_future()

    async def dequeue(
        self, max_records: int, depth: int, visibility_ms: int
    ) -> list[cqs_pb2.DtoChangeNotification]:
        tree = self._serving()
        now = wall_ms()
        tree.expire(now)
        taken = tree.dequeue(max_records, depth, now + visibility_ms)
        await self._commit()
        return [notification_of(r) for r in taken]

    async def acknowledge(self, tokens: list[str]) -> None:
        tree = self._serving()
        tree.expire(wall_ms())
        tree.ack(tokens)
        await self._commit()

    def holds(self, token: str) -> bool:
        return self._serving().held(token, wall_ms()) is not None

    async def enqueue(
        self,
        original: str,
        items: list[cqs_pb2.SplitItem],
        visible_until_ms: int,
        commit: bool,
    ) -> int:
        """A ReEnqueue batch (the embedded `CqsState.enqueue`): every item
        checked first, then queued with the original's SLA and tracking id."""
        tree = self._serving()
        now = wall_ms()
        tree.expire(now)
        held = tree.held(original, now)
        if held is None:
            raise TokenNotHeld()
        for item in items:
            check_split_item(item)
        for item in items:
            urn = item.WhichOneof("urn")
            tree.insert(
                item.dto_type,
                getattr(item, urn or "dto_id"),
                held.sla_us,
                urn == "parent_id",
                item.alias_name,
                held.tracking_id,
            )
        if visible_until_ms:
            tree.extend(original, visible_until_ms)
        if commit:
            tree.ack([original])
        await self._commit()
        if items:
            self._notify()
        return len(items)

    # -- writing back -----------------------------------------------------------------------

    async def _commit(self) -> None:
        """Write what the tree journaled, and delete what it took in; concurrent
        callers share a Txn (the first takes every change made so far)."""
        async with self._lock:
            tree = self._serving()
            rows, self.journal.rows = self.journal.rows, {}
            tree.journal_swapped()
            taken, self.taken = self.taken, []
            ops = [
                put_op(self._row_key(key), value)
                if value is not None
                else delete_op(self._row_key(key))
                for key, value in rows.items()
            ]
            ops.extend(delete_op(key) for key in taken)  # after the rows that hold them
            self.figures_dirty = self.figures_dirty or bool(ops)
            if self._figures_due():
                ops.append(put_op(figures_key(self.registry), self.figures()))
                self.figures_dirty = False
                self.figures_written = time.monotonic()
            if not ops:
                return
            try:
                for chunk in txn_chunks(ops):
                    reply = await self.session.txn(
                        rpc_pb2.TxnRequest(compare=[self.guard()], success=chunk)
                    )
                    if not reply.succeeded:
                        log.warning("cqs queue %s: no longer dispatching", self.name)
                        raise NotDispatching()
                    self.ours.add(reply.header.revision)
            except BaseException:
                self._broken.set()  # what etcd holds is unknown now: rebuild
                raise
            if len(self.ours) > 4096:
                self.ours = set(sorted(self.ours)[-2048:])

    def _figures_due(self) -> bool:
        return self.figures_dirty and time.monotonic() - self.figures_written >= WRITE_SECONDS

    def figures(self) -> bytes:
        """The queue's record for every front's /metrics and dashboard (figures.py)."""
        assert self.tree is not None
        record = {
            "kind": "cqs",
            "name": self.name,
            "dispatcher": self.session.front_id.decode(errors="replace"),
            "pending": len(self.tree),
            "in_flight": self.tree.in_flight,
            "subscriptions": [{"dto_type": t, "alias_name": a} for t, a in self.subscriptions],
            "most_urgent_sla_us": self.tree.most_urgent_sla_us(),
        }
        return json.dumps(record, separators=(",", ":")).encode()

    def _row_key(self, journal_key: bytes) -> bytes:
        return self.rows + journal_key[_TABLE:].hex().encode()

    def _take_in(self, kv: kv_pb2.KeyValue) -> None:
        """A publication fanned out to the queue, or a direct enqueue: into the tree."""
        assert self.tree is not None
        self.taken.append(bytes(kv.key))
        try:
            p = parse_publication(None, kv.value)
        except InvalidNotification as e:  # written past the fronts' checks
            log.warning("cqs queue %s: %s dropped: %s", self.name, grammar.show(kv.key), e)
            return
        self.tree.insert(p.dto_type, p.dto_id, p.sla_us, p.is_parent, p.alias, p.tracking_id)

    def _is_input(self, key: bytes) -> bool:
        return key.startswith(self.inbox) or key.startswith(self.producers)

    # -- dispatching ------------------------------------------------------------------------

    async def dispatch(self) -> None:
        """Rebuild from one range, then follow the watch until deposed."""
        self.tree = None
        self._broken.clear()
        self.figures_dirty = True
        self.journal.rows = {}
        self.taken = []
        reply = await self.session.read(prefix_op(self.prefix), range_op(self.index_key))
        revision = reply.header.revision
        kvs = reply.responses[0].response_range.kvs
        config = next((kv.value for kv in kvs if kv.key == self.config_key), None)
        known = None if config is None else subscriptions_of(self.name, config)
        if known is None:  # deleted, or not a CQS queue: nothing to dispatch
            if config is None:  # deleted while nobody dispatched: clear up after it
                for kv in reply.responses[1].response_range.kvs:
                    self.subscriptions = (subscriptions_of(self.name, kv.value) or ([], 0))[0]
                    await self.delete_queue()
            await asyncio.sleep(1.0)
            return
        self.subscriptions, depth = known
        tree = SlaQueue(depth)
        rows = [
            (bytes.fromhex(kv.key[len(self.rows) :].decode()), kv.value)
            for kv in kvs
            if kv.key.startswith(self.rows)
        ]
        try:
            tree.load_rows(rows)
        except (DamagedRow, ValueError) as e:
            log.error("cqs queue %s: rows in etcd do not read back: %s", self.name, e)
            raise
        tree.keep_rows(self.journal, 0)
        self.tree = tree
        for kv in sorted(
            (kv for kv in kvs if self._is_input(kv.key)), key=lambda kv: (kv.mod_revision, kv.key)
        ):
            self._take_in(kv)
        await self._commit()
        log.info(
            "cqs queue %s rebuilt: %d pending, %d in flight", self.name, len(tree), tree.in_flight
        )
        self.ready.set()
        self._notify()
        try:
            await self._follow(revision + 1)
        finally:
            self.ready.clear()
            self.tree = None
            self._notify()

    async def _follow(self, start: int) -> None:
        responses: asyncio.Queue[list[kv_pb2.Event] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for events in self.watch(self.prefix, prefix_end(self.prefix), start):
                    responses.put_nowait(events)
            finally:
                responses.put_nowait(None)

        broken = asyncio.ensure_future(self._broken.wait())
        watching = asyncio.ensure_future(read())
        try:
            while True:
                tree = self.tree
                assert tree is not None
                next_visible = tree.earliest_visible()
                timeout = None if next_visible is None else max(0, next_visible - wall_ms()) / 1000
                if self.figures_dirty:  # the record is due within a second
                    timeout = min(timeout if timeout is not None else WRITE_SECONDS, WRITE_SECONDS)
                got = asyncio.ensure_future(responses.get())
                done, _ = await asyncio.wait(
                    {got, broken}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if broken in done:
                    got.cancel()
                    return
                if got not in done:  # an in-flight one is visible again, or the figures are due
                    got.cancel()
                    expired = tree.expire(wall_ms())
                    await self._commit()
                    if expired:
                        self._notify()
                    continue
                events = got.result()
                while True:
                    if events is None:
                        return
                    if not self._on_events(events):
                        await self.delete_queue()
                        return
                    if responses.empty():
                        break
                    events = responses.get_nowait()
                if self.taken:
                    await self._commit()
                    self._notify()
        finally:
            broken.cancel()
            watching.cancel()

    def _on_events(self, events: list[kv_pb2.Event]) -> bool:
        """One watch response; False when the queue was deleted."""
        for event in events:
            kv = event.kv
            if kv.mod_revision in self.ours:
                continue
            if kv.key == self.config_key:
                if event.type == kv_pb2.Event.DELETE:
                    return False
                known = subscriptions_of(self.name, kv.value)
                if known is not None:
                    self.subscriptions = known[0]  # the depth stays what it was
            elif event.type == kv_pb2.Event.PUT and self._is_input(kv.key):
                self._take_in(kv)
        return True

    async def delete_queue(self) -> None:
        """The config is gone: so is the queue, its rows, its index entry and
        its subscriptions at the fan-outs."""
        ops = [
            rpc_pb2.RequestOp(
                request_delete_range=rpc_pb2.DeleteRangeRequest(
                    key=self.prefix, range_end=prefix_end(self.prefix)
                )
            ),
            delete_op(self.index_key),
            delete_op(figures_key(self.registry)),
        ]
        ops.extend(delete_op(subscription_key(t, self.name)) for t, _ in self.subscriptions)
        try:
            await self.session.txn(rpc_pb2.TxnRequest(compare=[self.guard()], success=ops))
            log.info("cqs queue %s deleted", self.name)
        except Exception as e:  # the next holder finds no config and does it again
            log.warning("cqs queue %s: not deleted yet: %s", self.name, e)


def subscription_key(dto_type: str, queue: str) -> bytes:
    """`/q/dto:{type}/sub/{queue}`: the queue's aliases of the type, beside the
    type's publications, so the fan-out reads both at one revision."""
    return b"/q/dto:%s/sub/%s" % (dto_type.encode(), queue.encode())
