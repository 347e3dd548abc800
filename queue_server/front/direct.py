"""Produces and acks handed to the queue's dispatching front, which writes them
in its own batched Txns instead of each costing etcd a revision.

What belongs here: `DirectWrites`, which the forwarding of Put and DeleteRange
asks first (`front/forward.py`). For a plain produce (a put of
`/q/{name}/p/{key}`) or an ack (the delete of one delivery key
`/q/{name}/c/{uuid}/{idx}/{key}`):

- on the front that dispatches the queue, the dispatcher takes it
  (`Dispatcher.produce`, `Dispatcher.acknowledge`): the produce becomes the put
  of its message key `/q/{name}/{idx}/{key}`, as the embedded server writes it
  in the produce's own revision; the ack the delete of its delivery and message
  keys. Many callers share one Txn, and each is answered with its header;
- on another front, the call goes to the dispatching front (named by the
  registry key `/q/{name}`, read at most once a `HOLDER_TTL`) over HTTP/2, with
  a `queue-server-direct` header so it goes no further;
- otherwise, and whenever the dispatcher cannot take it without a doubt that
  nothing was written (it was deposed, it is rebuilding, it does not know the
  delivery, the dispatching front could not be reached), it is forwarded to
  etcd, and the dispatcher sees it on its watch as before: a produce as it
  came, an ack as the dispatcher would write it (`dispatcher.ack_txn`: the
  delivery and the message key in one Txn), so that a dispatcher rebuilt from
  etcd later cannot take an acknowledged message for one never handed out. An
  ack goes to etcd even when the dispatching front may have written it (it
  died with the call in flight), as the second one deletes nothing; a produce
  in that state fails UNAVAILABLE, since a second one would be a duplicate.

Order: a producer key this front writes (a produce not taken directly, or one
in a Txn) is remembered by its revision, and a
later direct produce of the same queue waits until the dispatcher has followed
its watch past it (`after`), so the produces of one front keep their order
whichever way each one went.

Not taken directly, and forwarded as they came: a produce with a lease or with
prev_kv, ignore_value or ignore_lease; publications of CQS types and produces
into CQS queues; deletes of ranges or with prev_kv; and every produce when the
backend has auth (`--backend-user`) or the call carries a token, since the
dispatcher writes with the front's own credentials, not the caller's. An ack in
that case is the ack Txn sent to etcd with the caller's token; where the caller
may not write the message key (PERMISSION_DENIED), its delete goes as it came.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from etcdserverpb import rpc_pb2
from queue_server.cqs.state import DTO_QUEUE_PREFIX
from queue_server.front.dispatcher import Dispatcher, ack_txn
from queue_server.front.h2_client import CallError
from queue_server.keyspace import grammar
from queue_server.transport.methods import Call
from queue_server.transport.status import Status

if TYPE_CHECKING:
    from queue_server.front.queues import QueueFronts

HOP = "queue-server-direct"
"""On a call one front hands to another: its value is the `after` revision."""
HOLDER_TTL = 1.0
"""Seconds a front trusts what it read of a queue's dispatching front."""
PUT_PATH = "/etcdserverpb.KV/Put"
TXN_PATH = "/etcdserverpb.KV/Txn"
DELETE_PATH = "/etcdserverpb.KV/DeleteRange"

Plain = Callable[[], Awaitable[bytes]]
"""The call forwarded to etcd as it came: its response bytes."""


def _hop(metadata: Sequence[tuple[str, str]]) -> int | None:
    """The `after` of a call another front handed here (None: a client's)."""
    for key, value in metadata:
        if key == HOP:
            return int(value) if value.isdigit() else 0
    return None


class DirectWrites:
    """The direct path of one front's produces and acks (module docstring)."""

    def __init__(self, queues: QueueFronts, own_credentials: bool) -> None:
        self.queues = queues
        self.enabled = not own_credentials
        self.holders: dict[bytes, tuple[bytes | None, float]] = {}
        """Registry key -> (the dispatching front's id, or None: vacant; until)."""
        self.plain_after: dict[bytes, int] = {}
        """Registry key -> revision of the last producer key this front wrote."""

    def _eligible(self, call: Call) -> bool:
        return self.enabled and not any(k == "token" for k, _ in call.invocation_metadata())

    async def put(self, data: bytes, call: Call, plain: Plain) -> bytes:
        """A Put: checked as admission.py checks it, then taken directly if it
        is a plain produce, else forwarded."""
        request = rpc_pb2.PutRequest.FromString(data)
        hop = _hop(call.invocation_metadata())
        if hop is None:  # a call handed here was checked where it came in
            await self.queues.admission.check_put_request(request)
        parsed = grammar.parse(request.key)
        if parsed is None or parsed.kind != "produce":
            return await plain()
        registry = grammar.registry_key(parsed.spelling, parsed.name)
        if self._direct_produce(request, parsed, call):
            after = max(self.plain_after.get(registry, 0), hop or 0)

            async def take(dispatcher: Dispatcher) -> bytes | None:
                return await dispatcher.produce(request, after)

            answer = await self._direct(registry, PUT_PATH, data, call, hop, after, take)
            if answer is not None:
                return answer
        answer = await plain()
        self._wrote_plain([registry], rpc_pb2.PutResponse.FromString(answer).header.revision)
        return answer

    async def txn(self, data: bytes, call: Call, plain: Plain) -> bytes:
        """A Txn: checked as admission.py checks it, and forwarded; the
        produces it made are remembered as plain ones."""
        produced = await self.queues.admission.check_txn(data)
        answer = await plain()
        if produced:
            self._wrote_plain(
                [grammar.registry_key(qk.spelling, qk.name) for qk in produced],
                rpc_pb2.TxnResponse.FromString(answer).header.revision,
            )
        return answer

    def _direct_produce(
        self, request: rpc_pb2.PutRequest, parsed: grammar.QueueKey, call: Call
    ) -> bool:
        """Whether a produce may be written by the dispatcher (module docstring)."""
        if request.lease or request.prev_kv or request.ignore_value or request.ignore_lease:
            return False
        if parsed.spelling == grammar.SHORT and (
            parsed.name.startswith(DTO_QUEUE_PREFIX)
            or parsed.name.decode(errors="replace") in self.queues.cqs_queues
        ):
            return False
        return self._eligible(call)

    def _wrote_plain(self, registries: list[bytes], revision: int) -> None:
        """Producer keys this front wrote at `revision`: its later direct produces
        into those queues wait for the dispatcher's watch to pass it."""
        for registry in registries:
            self.plain_after[registry] = max(self.plain_after.get(registry, 0), revision)

    async def delete(self, data: bytes, call: Call, plain: Plain) -> bytes:
        """A DeleteRange: taken directly if it acknowledges one delivery, else
        written as the dispatcher's ack Txn, with the caller's token where it
        has one."""
        request = rpc_pb2.DeleteRangeRequest.FromString(data)
        parsed = grammar.parse(request.key)
        if parsed is None or parsed.kind != "delivery" or request.range_end or request.prev_kv:
            return await plain()
        message = grammar.message_key(parsed.spelling, parsed.name, parsed.idx, parsed.key)
        if not self._eligible(call):
            try:
                return await self._ack_through_etcd(request.key, message, call)
            except CallError as e:
                if e.code is not Status.PERMISSION_DENIED:
                    raise
                return await plain()  # the caller may delete the delivery, not the message
        registry = grammar.registry_key(parsed.spelling, parsed.name)

        async def take(dispatcher: Dispatcher) -> bytes | None:
            return await dispatcher.acknowledge(parsed)

        hop = _hop(call.invocation_metadata())
        try:
            answer = await self._direct(registry, DELETE_PATH, data, call, hop, 0, take)
        except CallError:
            # The dispatching front may or may not have written the ack (it died
            # with the call in flight), and an ack may be written twice: the
            # second deletes nothing.
            answer = None
        if answer is not None:
            return answer
        return await self._ack_through_etcd(request.key, message, call)

    async def _ack_through_etcd(self, delivery: bytes, message: bytes, call: Call) -> bytes:
        """The dispatcher's ack Txn (delivery and message key in one revision),
        sent to etcd with the caller's metadata, answered as a DeleteRange."""
        reply = rpc_pb2.TxnResponse.FromString(
            await self.queues.session.upstream.unary.call(
                TXN_PATH,
                ack_txn(delivery, message).SerializeToString(),
                call.invocation_metadata(),
                call.time_remaining(),
            )
        )
        deleted = rpc_pb2.DeleteRangeResponse(header=reply.header, deleted=int(reply.succeeded))
        return bytes(deleted.SerializeToString())

    async def _direct(
        self,
        registry: bytes,
        path: str,
        data: bytes,
        call: Call,
        hop: int | None,
        after: int,
        take: Callable[[Dispatcher], Awaitable[bytes | None]],
    ) -> bytes | None:
        """The answer of the dispatching front, or None: nothing was written,
        forward it to etcd. Raises CallError when it may have been written."""
        local = self.queues.dispatchers.get(registry)
        if local is not None and local.accepting:
            return await take(local)
        if hop is not None:
            return None  # handed here, and this front no longer dispatches it
        holder = await self._holder(registry)
        if holder is None or holder == self.queues.session.front_id:
            return None
        peer = self.queues.session.peers.pool(holder)
        try:
            return await peer.call(path, data, ((HOP, str(after)),), call.time_remaining())
        except CallError as e:
            if not e.retry:
                raise
            self.holders.pop(registry, None)  # not reached: nothing was written
            return None

    async def _holder(self, registry: bytes) -> bytes | None:
        cached = self.holders.get(registry)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            reply = await self.queues.session.read(
                rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=registry))
            )
        except CallError:
            return None  # the backend does not answer: the forwarded call says so
        kvs = reply.responses[0].response_range.kvs
        holder = bytes(kvs[0].value) if kvs else None
        self.holders[registry] = (holder, now + HOLDER_TTL)
        return holder
