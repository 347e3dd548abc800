"""The etcd-key queue from the client side: `Consumer`, `Message`, `Producer`,
queue settings and `redrive` (docs/queue.md is the contract; docs/client.md the guide).

Theory of operation:

- A consumer is one watch on exactly `/q/{name}/c/{uuid}`. A task reads its
  stream without pause (a stream that does not take a delivery for 5 s is
  dropped by the server) into a local buffer that the iterator empties. The
  server bounds what one consumer holds by the queue's `prefetch` setting, so
  the buffer is bounded too.
- When the stream ends (the member stopped or died, the connection broke, the
  server dropped the watch), the task opens a new watch on the same key, on the
  next endpoint, after a backoff. The server gives back everything the
  consumer held when its watch goes away, so deliveries still in the buffer are
  dropped: they come again on the new watch (or to another consumer).
- A delivery is a PUT event. Its key is deleted to acknowledge; under an ack
  deadline its `lease` is a delivery lease, known only to the member that
  hosts the watch: LeaseKeepAlive on it extends the deadline, LeaseRevoke
  gives the message back. Without an ack deadline `lease` is the message's own
  lease (if any), which must never be revoked (that would delete the message):
  `nack()` and `extend()` tell the two apart by reading the stored message key.
- A message is identified by `create_revision` (the revision of its produce).
  `mod_revision` is the revision the delivery was handed out at, and the
  key's `version` counts the times the message came back (`delivery_count`).

Imports nothing of the server: the few key shapes it needs are spelled here
(the server's grammar is `queue_server.keyspace.grammar`; the unit tests hold
the two to the same answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
import grpc.aio

from etcdserverpb import kv_pb2, rpc_pb2
from queue_server.client.connection import BACKOFF_FIRST, BACKOFF_MAX, EOF, Connection, Stubs
from queue_server.client.errors import (
    FATAL_WATCH_CODES,
    ClientError,
    ConsumerClosed,
    DeliveryLost,
    NoDeliveryLease,
)

log = logging.getLogger(__name__)

MAX_TXN_OPS = 128
"""The server's --max-txn-ops default: operations in one Txn branch."""
MAX_TXN_BYTES = 1024 * 1024
"""Keys and values one produce Txn carries at most: under --max-request-bytes'
default of 1.5 MiB with room for framing. One larger message goes alone."""
REDRIVE_PAGE = 100
"""Dead letters read per Range while redriving."""
CONFIG_ATTEMPTS = 10
"""Read-modify-write rounds of `configure` before a lost race is reported."""


def _segment(what: str, text: str | bytes) -> bytes:
    """One path segment of a queue key, refused if empty or holding '/'."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    if not raw or b"/" in raw:
        raise ValueError(f"{what} must be one non-empty path segment, not {text!r}")
    return raw


def consumer_key(name: str, consumer_id: str) -> bytes:
    """`/q/{name}/c/{uuid}`: the key a consumer watches."""
    return b"/q/%s/c/%s" % (_segment("queue name", name), _segment("consumer id", consumer_id))


def producer_key(name: str, key: str | bytes) -> bytes:
    """`/q/{name}/p/{key}`: a put here enqueues."""
    return b"/q/%s/p/%s" % (_segment("queue name", name), _segment("message key", key))


def config_key(name: str) -> bytes:
    """`/q/{name}/config`: the queue's settings, a JSON object."""
    return b"/q/%s/config" % _segment("queue name", name)


IDX_DIGITS = 16
"""Digits of `{idx}` in a stored message key (zero-padded: key order is enqueue order)."""
_SPELLINGS = ((b"/q/", b"c"), (b"/queue/", b"consumer"))
"""Each spelling's prefix and consumer word."""


def stored_message(key: bytes) -> tuple[bytes, int, bytes] | None:
    """A delivered key's message: (the stored key `/q/{name}/{idx}/{key}`, `idx`,
    `{key}`), from that key itself or from a handed-over delivery key
    `/q/{name}/c/{uuid}/{idx}/{key}` (either spelling); None for another shape."""
    spelling = next((sp for sp in _SPELLINGS if key.startswith(sp[0])), None)
    if spelling is None:
        return None
    prefix, consume = spelling
    parts = key[len(prefix) :].split(b"/")
    if len(parts) == 5 and parts[1] == consume and parts[2]:
        parts = [parts[0], parts[3], parts[4]]
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2]:
        return None
    name, digits, suffix = parts
    idx = int(digits)
    return b"%s%s/%0*d/%s" % (prefix, name, IDX_DIGITS, idx, suffix), idx, suffix


def message_range(name: str) -> tuple[bytes, bytes]:
    """(key, range_end) covering exactly the queue's message keys `/q/{name}/{idx}/{key}`:
    ':' follows '9'."""
    base = b"/q/%s/" % _segment("queue name", name)
    return base + b"0", base + b":"


def produce_op(
    name: str, key: str | bytes, value: bytes | str, lease: int = 0
) -> rpc_pb2.RequestOp:
    """A Txn operation that enqueues `value` on queue `name` under `key`."""
    data = value.encode() if isinstance(value, str) else value
    put = rpc_pb2.PutRequest(key=producer_key(name, key), value=data, lease=lease)
    return rpc_pb2.RequestOp(request_put=put)


# -- messages -----------------------------------------------------------------


@dataclass(eq=False)
class MessageInfo:
    """What a delivery says about its message."""

    queue: str
    """The queue's name."""
    key: bytes
    """The key as delivered: delete it to acknowledge. `/q/{name}/{idx}/{key}`,
    or `/q/{name}/c/{uuid}/{idx}/{key}` from a member that is not the dispatching one."""
    message_key: bytes
    """The key as stored, `/q/{name}/{idx}/{key}`: the one to compare in a Txn."""
    idx: int
    """The message's place in its queue (0 if the key has no queue shape)."""
    producer_key: bytes
    """The `{key}` segment the producer put it under."""
    value: bytes
    create_revision: int
    """The revision of the produce: what identifies the message."""
    mod_revision: int
    """The revision this delivery was handed out at (not the message's identity)."""
    version: int
    lease: int
    """The delivery lease under an ack deadline; else the message's own lease, or 0."""
    delivery_count: int
    """Which delivery of the message this is (1: the first). The server puts a
    message taken back unacknowledged again, so its key's `version` is one more
    than the times it came back; this is that `version` (a plain put on the
    message key by someone else would count too)."""
    endpoint: str
    """The member whose watch delivered it (delivery leases live there)."""


@dataclass(eq=False)
class Message(MessageInfo):
    """One delivery to a `Consumer`: acknowledge it with `ack()`, give it back
    with `nack()`, keep it longer with `extend()`."""

    connection: Connection = field(repr=False, kw_only=True)
    _delivery_lease: int | None = field(default=None, repr=False, kw_only=True)

    def info(self) -> dict[str, Any]:
        """The delivery's fields (those of `MessageInfo`)."""
        return {f.name: getattr(self, f.name) for f in fields(MessageInfo)}

    def compare(self) -> rpc_pb2.Compare:
        """`CREATE(message_key) == create_revision`: true while this message is
        unacknowledged, false once any delete of it committed."""
        return rpc_pb2.Compare(
            key=self.message_key,
            target=rpc_pb2.Compare.CREATE,
            result=rpc_pb2.Compare.EQUAL,
            create_revision=self.create_revision,
        )

    def ack_op(self) -> rpc_pb2.RequestOp:
        """The acknowledgement as a Txn operation: a delete of the delivered key."""
        return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=self.key))

    async def ack(self) -> bool:
        """Acknowledge: delete the delivered key. True if this delete removed the
        message; False if it was already gone (acknowledged by someone else after
        its deadline, expired, cancelled). Retried on UNAVAILABLE (deletes are
        idempotent)."""
        conn = self.connection
        request = rpc_pb2.DeleteRangeRequest(key=self.key)
        response = await conn.delete(request, self.endpoint)
        return response.deleted > 0

    async def ack_with(self, *ops: rpc_pb2.RequestOp) -> bool:
        """Acknowledge and apply `ops` (e.g. `produce_op(...)`, puts of your own
        keys) in one Txn guarded by `compare()`: exactly once, even when this is
        a redelivery of a message whose first attempt committed (then nothing
        happens and the result is False)."""
        conn = self.connection
        request = rpc_pb2.TxnRequest(compare=[self.compare()], success=[self.ack_op(), *ops])
        response = await conn.txn(request, self.endpoint)
        return bool(response.succeeded)

    async def delivery_lease(self) -> int:
        """The delivery lease id. Raises NoDeliveryLease when the queue has no
        ack deadline (the `lease` field is then the message's own lease or 0),
        DeliveryLost when the message is no longer stored."""
        if self._delivery_lease is not None:
            return self._delivery_lease
        if not self.lease:
            raise NoDeliveryLease(f"{self.key!r} carries no lease: its queue has no ack deadline")
        conn = self.connection
        request = rpc_pb2.RangeRequest(key=self.message_key, keys_only=True)
        found = await conn.range(request, self.endpoint)
        if not found.kvs or found.kvs[0].create_revision != self.create_revision:
            raise DeliveryLost(f"{self.message_key!r} is no longer in the queue")
        if found.kvs[0].lease == self.lease:
            raise NoDeliveryLease(
                f"{self.key!r} carries the message's own lease: its queue has no ack deadline"
            )
        self._delivery_lease = self.lease
        return self.lease

    async def nack(self) -> bool:
        """Give the message back now (LeaseRevoke of its delivery lease, on the
        member that delivered it): it is delivered again, counted as a failed
        delivery. True if given back; False if the delivery had already ended
        (deadline passed, acknowledged, consumer reconnected). Raises
        NoDeliveryLease if the queue has no ack deadline."""
        lease = await self.delivery_lease()
        stubs = self.connection.stubs(self.endpoint)
        try:
            await stubs.lease_revoke(lease, self.connection.timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def extend(self) -> int:
        """Start the ack deadline over (LeaseKeepAlive of the delivery lease on
        the member that delivered it); returns the deadline in seconds. Raises
        DeliveryLost if the delivery already ended, NoDeliveryLease if the queue
        has no ack deadline."""
        lease = await self.delivery_lease()
        ttl = await self.connection.stubs(self.endpoint).lease_keep_alive(
            lease, self.connection.timeout
        )
        if ttl <= 0:
            raise DeliveryLost(f"the delivery of {self.key!r} has ended")
        return ttl

    async def start_extending(self, every: float | None = None) -> asyncio.Task[None]:
        """Extend now, then every `every` seconds (default: a third of the
        deadline) in a task, until the task is cancelled or the delivery ends.
        Raises at once what `extend()` raises. `extending()` is the usual way."""
        ttl = await self.extend()
        interval = every if every is not None else max(ttl / 3, 0.1)

        async def keep() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.extend()
                except DeliveryLost:
                    return
                except grpc.aio.AioRpcError as e:  # the next round may get through
                    log.warning("queue delivery extend failed key=%r code=%s", self.key, e.code())

        return asyncio.create_task(keep(), name=f"extend {self.key!r}")

    @contextlib.asynccontextmanager
    async def extending(self, every: float | None = None) -> AsyncIterator[None]:
        """Keep the delivery while the block runs: `async with message.extending():
        await long_work()`. Extends on entry, then every `every` seconds
        (default: a third of the deadline)."""
        task = await self.start_extending(every)
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def message_from_event(
    name: str, kv: kv_pb2.KeyValue, connection: Connection, endpoint: str
) -> Message:
    """A delivery PUT event's key-value as a Message."""
    key = bytes(kv.key)
    stored, idx, suffix = stored_message(key) or (key, 0, key.rsplit(b"/", 1)[-1])
    return Message(
        queue=name,
        key=key,
        message_key=stored,
        idx=idx,
        producer_key=suffix,
        value=bytes(kv.value),
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
        delivery_count=kv.version,
        endpoint=endpoint,
        connection=connection,
    )


# -- the consumer ---------------------------------------------------------------


class _End:
    """Put in the buffer when the consumer ends."""


_END = _End()


class WatchRefused(ClientError):
    """The server refused the consumer watch (its reason is the message)."""


class Consumer:
    """A consumer of the etcd-key queue `name`: `async for message in consumer`.

    Call `start()` (or use `async with`), which writes `prefetch` into the
    queue's settings if given and waits until the watch is created. Deliveries
    are yielded as they come; acknowledge each (`ack()`), or give it back
    (`nack()`). The consumer reconnects on its own, across the client's
    endpoints, and ends only on `close()` or a refusal that asking again
    would not change (then the iterator raises it)."""

    def __init__(
        self,
        connection: Connection,
        name: str,
        *,
        consumer_id: str | None = None,
        prefetch: int | None = None,
    ) -> None:
        """`consumer_id` is a UUID (a new one by default; the server needs one to
        know the consumer again after a reconnect); `prefetch`, if given, is
        written to the queue's settings: it is per queue, so it applies to every
        consumer of the queue."""
        if consumer_id is not None:
            try:
                uuid.UUID(consumer_id)
            except ValueError:
                raise ValueError(f"consumer_id must be a UUID, not {consumer_id!r}") from None
        self.connection = connection
        self.name = name
        self.consumer_id = consumer_id or str(uuid.uuid4())
        self.key = consumer_key(name, self.consumer_id)
        self.prefetch = prefetch
        self.endpoint: str | None = None
        """The member the current watch is on (None between watches)."""
        self.watches = 0
        """Watches created so far: 1 after start, more after each reconnect."""
        self._buffer: asyncio.Queue[Message | _End] = asyncio.Queue()
        self._watching = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._call: Any = None
        self._error: BaseException | None = None
        self._closed = False

    # -- lifecycle

    async def start(self, timeout: float | None = None) -> Consumer:
        """Set `prefetch` (if given), open the watch and wait until it is created
        (at most `timeout` s, by default the client's retry time)."""
        if self._task is not None:
            return self
        if self._closed:
            raise ConsumerClosed("the consumer was closed")
        if self.prefetch is not None:
            await configure(self.connection, self.name, prefetch=self.prefetch)
        self._task = asyncio.create_task(self._run(), name=f"consumer {self.key.decode()}")
        await self.wait_watching(timeout)
        return self

    async def wait_watching(self, timeout: float | None = None) -> None:
        """Until a watch is open (at once if one is): after start, or to await a
        reconnect. Raises TimeoutError after `timeout` s (default: the client's
        retry time), or what ended the consumer."""
        assert self._task is not None, "start() first"
        limit = self.connection.retry_for if timeout is None else timeout
        waiter = asyncio.ensure_future(self._watching.wait())
        try:
            await asyncio.wait({waiter, self._task}, timeout=limit, return_when="FIRST_COMPLETED")
        finally:
            waiter.cancel()
        if self._watching.is_set():
            return
        if self._task.done():
            raise self._error or ConsumerClosed("the consumer ended")
        raise TimeoutError(f"no watch on {self.key.decode()} after {limit}s")

    async def close(self) -> None:
        """End the watch: the server gives back what this consumer holds and has
        not acknowledged (deliveries not yet taken from the iterator included)."""
        self._closed = True
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._buffer.put_nowait(_END)

    async def __aenter__(self) -> Consumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- iteration

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        if self._task is None:
            await self.start()
        return self._taken(await self._buffer.get())

    def _taken(self, item: Message | _End) -> Message:
        if isinstance(item, _End):
            self._buffer.put_nowait(item)  # every later call ends too
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        return item

    async def get(self, timeout: float | None = None) -> Message | None:
        """The next delivery, or None if none came within `timeout` seconds (0:
        only one already here). Raises ConsumerClosed once the consumer has
        ended, or what ended it."""
        if self._task is None:
            await self.start()
        try:
            if timeout is not None and timeout <= 0:
                item = self._buffer.get_nowait()
            else:
                item = await asyncio.wait_for(self._buffer.get(), timeout)
            return self._taken(item)
        except (TimeoutError, asyncio.QueueEmpty):
            return None
        except StopAsyncIteration:
            raise ConsumerClosed("the consumer was closed") from None

    # -- the watch

    async def _run(self) -> None:
        delay = BACKOFF_FIRST
        while not self._closed:
            if self.connection.closed:
                self._fail(ConsumerClosed("the client was closed"))
                return
            stubs = self.connection.stubs()
            created = False
            try:
                created = await self._watch(stubs)
            except grpc.aio.AioRpcError as e:
                if e.code() in FATAL_WATCH_CODES:
                    self._fail(e)
                    return
                log.info(
                    "queue consumer watch ended queue=%s endpoint=%s code=%s",
                    self.name,
                    stubs.endpoint,
                    e.code().name,
                )
            except WatchRefused as e:
                self._fail(e)
                return
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed or (task is not None and task.cancelling()):
                    raise
                # grpc cancelled the call, not us: its channel was closed
            except (OSError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
                log.warning(
                    "queue consumer watch failed queue=%s endpoint=%s error=%r",
                    self.name,
                    stubs.endpoint,
                    e,
                )
            finally:
                self._watching.clear()
                self.endpoint = None
                self._call = None
            if self._closed:
                return
            if created:
                delay = BACKOFF_FIRST
            self.connection.failed(stubs.endpoint)
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    def _fail(self, error: BaseException) -> None:
        log.warning("queue consumer ended queue=%s error=%s", self.name, error)
        self._error = error
        self._buffer.put_nowait(_END)

    async def _watch(self, stubs: Stubs) -> bool:
        """One watch, until its stream ends. True if it was created."""
        call = stubs.watch.Watch()
        self._call = call
        created = False
        try:
            create = rpc_pb2.WatchCreateRequest(key=self.key)
            await call.write(rpc_pb2.WatchRequest(create_request=create))
            while True:
                response = await call.read()
                if response is EOF:
                    return created
                assert isinstance(response, rpc_pb2.WatchResponse)
                if response.created:
                    if response.canceled:
                        raise WatchRefused(response.cancel_reason or "watch refused")
                    created = True
                    self._drop_buffered()
                    self.endpoint = stubs.endpoint
                    self.watches += 1
                    self._watching.set()
                for event in response.events:
                    if event.type == kv_pb2.Event.PUT:
                        self._buffer.put_nowait(
                            message_from_event(self.name, event.kv, self.connection, stubs.endpoint)
                        )
                if response.canceled:
                    log.info(
                        "queue consumer watch cancelled queue=%s endpoint=%s reason=%s",
                        self.name,
                        stubs.endpoint,
                        response.cancel_reason,
                    )
                    return created
        finally:
            call.cancel()

    def _drop_buffered(self) -> None:
        """A new watch: what the last one delivered and the iterator has not
        yielded was given back by the server, and comes again."""
        while not self._buffer.empty():
            item = self._buffer.get_nowait()
            if isinstance(item, _End):  # pragma: no cover - only put when ending
                self._buffer.put_nowait(item)
                return


# -- producing ----------------------------------------------------------------

Produce = bytes | str | tuple[str | bytes, bytes | str]
"""One message for `Producer.send_batch`: a value (its key is made up), or (key, value)."""


class Producer:
    """Enqueues on queue `name`: puts on `/q/{name}/p/{key}`, many per Txn."""

    def __init__(
        self,
        connection: Connection,
        name: str,
        *,
        max_txn_ops: int = MAX_TXN_OPS,
        max_txn_bytes: int = MAX_TXN_BYTES,
    ) -> None:
        """`max_txn_ops` must not exceed the server's --max-txn-ops."""
        _segment("queue name", name)
        if max_txn_ops < 1 or max_txn_bytes < 1:
            raise ValueError("max_txn_ops and max_txn_bytes must be positive")
        self.connection = connection
        self.name = name
        self.max_txn_ops = max_txn_ops
        self.max_txn_bytes = max_txn_bytes

    async def send(self, value: bytes | str, key: str | bytes | None = None, lease: int = 0) -> int:
        """Enqueue one message (under `key`, by default a new uuid; with `lease`,
        it disappears when the lease ends). Returns its create_revision."""
        (revision,) = await self.send_batch([(key or uuid.uuid4().hex, value)], lease=lease)
        return revision

    async def send_batch(self, messages: Iterable[Produce], lease: int = 0) -> list[int]:
        """Enqueue many messages, in order, `max_txn_ops` per Txn (fewer when
        they carry over `max_txn_bytes`). Returns each message's create_revision
        (the revision of its Txn). A Txn that fails raises; the Txns before it
        are committed (their messages are enqueued). RESOURCE_EXHAUSTED means the
        queue is at its max_depth: back off and send the rest again."""
        revisions: list[int] = []
        ops: list[rpc_pb2.RequestOp] = []
        size = 0
        for item in messages:
            if isinstance(item, tuple):
                key, value = item
            else:
                key, value = uuid.uuid4().hex, item
            op = produce_op(self.name, key, value, lease)
            entry = len(op.request_put.key) + len(op.request_put.value)
            if ops and (len(ops) >= self.max_txn_ops or size + entry > self.max_txn_bytes):
                revisions.extend(await self._commit(ops))
                ops, size = [], 0
            ops.append(op)
            size += entry
        if ops:
            revisions.extend(await self._commit(ops))
        return revisions

    async def _commit(self, ops: list[rpc_pb2.RequestOp]) -> list[int]:
        conn = self.connection
        request = rpc_pb2.TxnRequest(success=ops)
        response = await conn.txn(request)
        return [response.header.revision] * len(ops)


# -- settings and redrive ----------------------------------------------------------


async def settings(connection: Connection, name: str) -> dict[str, Any]:
    """The queue's settings, `/q/{name}/config` as a dict (empty: all defaults)."""
    key = config_key(name)
    conn = connection
    found = await conn.range(rpc_pb2.RangeRequest(key=key))
    if not found.kvs or not found.kvs[0].value:
        return {}
    loaded = json.loads(found.kvs[0].value)
    if not isinstance(loaded, dict):
        raise ClientError(f"{key.decode()} is not a JSON object")
    return loaded


async def configure(connection: Connection, name: str, **changes: Any) -> dict[str, Any]:
    """Change some of the queue's settings and keep the others (a field set to
    None is removed: back to its default). A read-modify-write Txn guarded by
    the config key's mod_revision, so a concurrent change is not lost. Returns
    the settings written. The server refuses a bad value with INVALID_ARGUMENT."""
    key = config_key(name)
    conn = connection
    for _ in range(CONFIG_ATTEMPTS):
        found = await conn.range(rpc_pb2.RangeRequest(key=key))
        current: dict[str, Any] = {}
        mod = 0
        if found.kvs:
            mod = found.kvs[0].mod_revision
            if found.kvs[0].value:
                loaded = json.loads(found.kvs[0].value)
                current = loaded if isinstance(loaded, dict) else {}
        merged = {**current, **changes}
        merged = {k: v for k, v in merged.items() if v is not None}
        if merged == current and found.kvs:
            return merged
        guard = rpc_pb2.Compare(
            key=key, target=rpc_pb2.Compare.MOD, result=rpc_pb2.Compare.EQUAL, mod_revision=mod
        )
        put = rpc_pb2.PutRequest(key=key, value=json.dumps(merged).encode())
        request = rpc_pb2.TxnRequest(compare=[guard], success=[rpc_pb2.RequestOp(request_put=put)])
        response = await conn.txn(request)
        if response.succeeded:
            return merged
    raise ClientError(f"{key.decode()} kept changing; settings not written")


def dead_letter_name(name: str, queue_settings: Mapping[str, Any]) -> str:
    """The queue that receives `name`'s dead letters: its `dead_letter`
    setting, by default `{name}.dead`."""
    dead = queue_settings.get("dead_letter")
    return dead if isinstance(dead, str) and dead else f"{name}.dead"


def redrive_request(name: str, dead: kv_pb2.KeyValue) -> rpc_pb2.TxnRequest:
    """The Txn that moves one dead letter back into queue `name`:
    if CREATE(dead key) == its create_revision, delete it and produce its value
    (and lease) on `/q/{name}/p/{its key}`; else nothing (it was already moved
    or acknowledged)."""
    suffix = bytes(dead.key).rsplit(b"/", 1)[-1]
    guard = rpc_pb2.Compare(
        key=dead.key,
        target=rpc_pb2.Compare.CREATE,
        result=rpc_pb2.Compare.EQUAL,
        create_revision=dead.create_revision,
    )
    return rpc_pb2.TxnRequest(
        compare=[guard],
        success=[
            rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=dead.key)),
            produce_op(name, suffix, dead.value, dead.lease),
        ],
    )


async def redrive(connection: Connection, name: str, limit: int | None = None) -> int:
    """Move dead letters of queue `name` back into it, oldest first, all of
    them or at most `limit`: one Txn each (`redrive_request`), so each moves
    exactly once even with two redrives at once. Returns how many moved."""
    if limit is not None and limit < 0:
        raise ValueError("limit must not be negative")
    conn = connection
    dead = dead_letter_name(name, await settings(conn, name))
    start, end = message_range(dead)
    moved = 0
    while limit is None or moved < limit:
        page = REDRIVE_PAGE if limit is None else min(REDRIVE_PAGE, limit - moved)
        request = rpc_pb2.RangeRequest(key=start, range_end=end, limit=page)
        found = await conn.range(request)
        for kv in found.kvs:
            response = await conn.txn(redrive_request(name, kv))
            moved += bool(response.succeeded)
        if not found.more or not found.kvs:
            break
        start = bytes(found.kvs[-1].key) + b"\0"
    return moved
