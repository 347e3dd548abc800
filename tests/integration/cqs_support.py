"""A small client for the CQS integration tests, over the real generated stubs.

Publishing is an etcd Put on `/q/dto:{dto_type}/p/{key}` (KV service); everything
else goes through `DtoChangeQueueService`. Every call carries a deadline.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from etcdserverpb import cqs_pb2, cqs_pb2_grpc, rpc_pb2, rpc_pb2_grpc

WAIT = 10.0
"""Seconds any one call may take."""

Notification = cqs_pb2.DtoChangeNotification
SplitItem = cqs_pb2.SplitItem
ReEnqueueRequest = cqs_pb2.ReEnqueueRequest


def unique(stem: str) -> str:
    """A name no other test uses (queues and dto types share the module's server)."""
    return f"{stem}-{uuid.uuid4().hex[:10]}"


def timestamp(text: str) -> Timestamp:
    ts = Timestamp()
    ts.FromJsonString(text)
    return ts


def sla(n: Notification) -> str:
    """A notification's SLA as RFC 3339 (`2026-01-01T10:00:01Z`)."""
    return n.sla_timestamp.ToJsonString()


def urn(n: Notification | SplitItem) -> tuple[str, str]:
    """("dto_id" | "parent_id", the id)."""
    kind = n.WhichOneof("urn")
    assert kind is not None, f"no urn in {n}"
    return kind, str(getattr(n, kind))


def ids(batch: Sequence[Notification]) -> list[str]:
    return [urn(n)[1] for n in batch]


def identity(n: Notification) -> tuple[str, str, str, str]:
    """What dedup compares: (dto_type, urn kind, id, alias)."""
    kind, text = urn(n)
    return n.dto_type, kind, text, n.alias_name


def item(dto_type: str, dto_id: str = "", parent_id: str = "", alias: str = "") -> SplitItem:
    if parent_id:
        return SplitItem(dto_type=dto_type, parent_id=parent_id, alias_name=alias)
    if dto_id:
        return SplitItem(dto_type=dto_type, dto_id=dto_id, alias_name=alias)
    return SplitItem(dto_type=dto_type, alias_name=alias)  # no urn: invalid on purpose


def header(queue: str, token: str) -> ReEnqueueRequest:
    return ReEnqueueRequest(header=ReEnqueueRequest.Header(queue_name=queue, ack_token=token))


def footer() -> ReEnqueueRequest:
    return ReEnqueueRequest(footer=ReEnqueueRequest.Footer())


def frames(
    queue: str, token: str, items: Iterable[SplitItem], with_footer: bool = True
) -> Iterator[ReEnqueueRequest]:
    """Header, items, Footer: generated lazily, so nothing holds the whole list."""
    yield header(queue, token)
    for it in items:
        yield ReEnqueueRequest(item=it)
    if with_footer:
        yield footer()


def status_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The status code `call` fails with (failing the test if it succeeds)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    assert isinstance(err, grpc.Call), err
    return err.code()


def publication(dto_id: str, sla_text: str, *, alias: str = "", tracking_id: str = "") -> bytes:
    """The JSON value of a publish."""
    value: dict[str, str] = {"dto_id": dto_id, "sla_timestamp": sla_text}
    if alias:
        value["alias_name"] = alias
    if tracking_id:
        value["tracking_id"] = tracking_id
    return json.dumps(value).encode()


class Cqs:
    """The CQS stub plus KV for publishing, on one channel."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = cqs_pb2_grpc.DtoChangeQueueServiceStub(channel)
        self.kv = rpc_pb2_grpc.KVStub(channel)

    # -- queues -------------------------------------------------------------------

    def configure(
        self, queue: str, subscriptions: Sequence[str | tuple[str, str]], depth: int = 0
    ) -> None:
        subs = [
            cqs_pb2.DtoTypeSubscription(dto_type=s)
            if isinstance(s, str)
            else cqs_pb2.DtoTypeSubscription(dto_type=s[0], alias_name=s[1])
            for s in subscriptions
        ]
        self.stub.CreateOrConfigureQueue(
            cqs_pb2.CreateOrConfigureQueueRequest(
                queue_name=queue, subscriptions=subs, depth=depth
            ),
            timeout=WAIT,
        )

    def config(self, queue: str) -> tuple[dict[str, object], int]:
        """The queue's config key: (parsed JSON, mod_revision)."""
        resp = self.kv.Range(rpc_pb2.RangeRequest(key=f"/q/{queue}/config".encode()), timeout=WAIT)
        assert len(resp.kvs) == 1, f"no config key for {queue}"
        loaded = json.loads(resp.kvs[0].value)
        assert isinstance(loaded, dict)
        return loaded, int(resp.kvs[0].mod_revision)

    # -- publishing -----------------------------------------------------------------

    def publish_raw(self, dto_type: str, value: bytes, key: str = "") -> int:
        """Put `value` on `/q/dto:{dto_type}/p/{key}`; returns the put's revision."""
        k = f"/q/dto:{dto_type}/p/{key or uuid.uuid4().hex}".encode()
        return int(
            self.kv.Put(rpc_pb2.PutRequest(key=k, value=value), timeout=WAIT).header.revision
        )

    def publish(
        self, dto_type: str, dto_id: str, sla_text: str, *, alias: str = "", tracking_id: str = ""
    ) -> int:
        value = publication(dto_id, sla_text, alias=alias, tracking_id=tracking_id)
        return self.publish_raw(dto_type, value)

    def revision(self) -> int:
        """The store's current revision (a Range of a key nobody writes)."""
        resp = self.kv.Range(rpc_pb2.RangeRequest(key=b"/cqs-test/none"), timeout=WAIT)
        return int(resp.header.revision)

    def published_keys(self, dto_type: str) -> list[bytes]:
        """Whatever is stored under the publication point `/q/dto:{dto_type}/`."""
        start = f"/q/dto:{dto_type}/".encode()
        end = start[:-1] + b"0"  # "/" + 1
        resp = self.kv.Range(rpc_pb2.RangeRequest(key=start, range_end=end), timeout=WAIT)
        return [kv.key for kv in resp.kvs]

    # -- consuming ------------------------------------------------------------------

    def dequeue(
        self,
        queue: str,
        max_notifications: int = 1000,
        prefix_depth: int = 0,
        wait_ms: int = 0,
    ) -> list[Notification]:
        resp = self.stub.BatchDequeue(
            cqs_pb2.BatchDequeueRequest(
                queue_name=queue,
                max_notifications=max_notifications,
                prefix_depth=prefix_depth,
                wait_time_milliseconds=wait_ms,
            ),
            timeout=WAIT + wait_ms / 1000,
        )
        return list(resp.notifications)

    def ack(self, queue: str, tokens: Iterable[str]) -> None:
        self.stub.BatchAcknowledge(
            cqs_pb2.BatchAcknowledgeRequest(queue_name=queue, ack_tokens=list(tokens)),
            timeout=WAIT,
        )

    def drain(self, queue: str) -> list[Notification]:
        """Dequeue and acknowledge every visible notification, in delivery order."""
        out: list[Notification] = []
        deadline = time.monotonic() + 6 * WAIT
        while batch := self.dequeue(queue, max_notifications=1000):
            assert time.monotonic() < deadline, f"{queue} did not drain"
            self.ack(queue, [n.ack_token for n in batch])
            out.extend(batch)
        return out

    def reenqueue(
        self, queue: str, token: str, items: Iterable[SplitItem], timeout: float = 6 * WAIT
    ) -> cqs_pb2.ReEnqueueResponse:
        resp = self.stub.ReEnqueue(frames(queue, token, items), timeout=timeout)
        assert isinstance(resp, cqs_pb2.ReEnqueueResponse)
        return resp

    def reenqueue_frames(self, requests: Iterable[ReEnqueueRequest]) -> cqs_pb2.ReEnqueueResponse:
        resp = self.stub.ReEnqueue(iter(requests), timeout=WAIT)
        assert isinstance(resp, cqs_pb2.ReEnqueueResponse)
        return resp

    def token_status(self, queue: str, token: str) -> grpc.StatusCode:
        """Probe a token without changing anything: a Header-only ReEnqueue that
        half-closes. CANCELLED: the token is held (a stream without Footer acks
        nothing); FAILED_PRECONDITION: unknown, acknowledged or expired."""
        return status_of(lambda: self.reenqueue_frames([header(queue, token)]))

    def dequeue_one(self, queue: str, wait_ms: int = 0) -> Notification:
        batch = self.dequeue(queue, max_notifications=1, wait_ms=wait_ms)
        assert len(batch) == 1, f"expected one notification from {queue}, got {batch}"
        return batch[0]

    def enqueue_split(
        self,
        queue: str,
        dto_type: str,
        sla_text: str,
        items: Iterable[SplitItem],
        tracking_id: str = "",
    ) -> Notification:
        """Put `items` into `queue` the way a consumer does: publish one notification
        of `dto_type` (the queue must subscribe to it), dequeue it and split it with
        ReEnqueue. Returns the acknowledged original."""
        dto_id = f"t/split/{uuid.uuid4().hex}"
        self.publish(dto_type, dto_id, sla_text, tracking_id=tracking_id)
        original = self.dequeue_one(queue)
        assert urn(original) == ("dto_id", dto_id), "the queue was expected to be empty"
        resp = self.reenqueue(queue, original.ack_token, items)
        assert resp.acknowledged
        return original
