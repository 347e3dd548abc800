"""The bookkeeping of shared watches (queue_server/front/watch_coalesce.py), in
this process: ids handed out as etcd's mvcc does, the shapes that may share,
a watch id set on serialized responses, and what a broadcast hands each sharer
(a joiner nothing before its revision, every sharer its own id, a backend
cancel to all). The broadcasts here have no backend stream: their responses
are handed to them as the stream's reader does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from etcdserverpb import kv_pb2, rpc_pb2
from queue_server.front import forward
from queue_server.front.watch_coalesce import (
    UNAVAILABLE_TEXT,
    Broadcast,
    Failure,
    IdSpace,
    Joining,
    Outlet,
    Sharer,
    shape_of,
    with_watch_id,
)

pytestmark = pytest.mark.unit


def test_ids_are_handed_out_as_etcds_watch_stream_does() -> None:
    ids = IdSpace()
    assert [ids.take(0), ids.take(0)] == [0, 1]
    assert ids.take(3) == 3  # the id a create asks for
    assert ids.take(3) is None  # a duplicate
    assert ids.take(0) == 2
    assert ids.take(0) == 4  # the next one skips an id in use
    ids.free(3)
    assert ids.take(3) == 3  # free again
    ids.free(0)
    assert ids.take(0) == 5  # the counter never goes back


def test_the_shapes_that_share() -> None:
    def create(**fields: Any) -> rpc_pb2.WatchCreateRequest:
        return rpc_pb2.WatchCreateRequest(**fields)

    plain = shape_of(create(key=b"k"), leader=False)
    assert plain is not None
    assert shape_of(create(key=b"k", start_revision=9, watch_id=3), leader=False) == plain
    assert shape_of(create(key=b"k"), leader=True) != plain
    assert shape_of(create(key=b"k", prev_kv=True), leader=False) != plain
    assert shape_of(create(key=b"k", progress_notify=True), leader=False) != plain
    no_put = rpc_pb2.WatchCreateRequest.NOPUT
    no_delete = rpc_pb2.WatchCreateRequest.NODELETE
    assert shape_of(create(key=b"k", filters=[no_put, no_delete]), leader=False) == shape_of(
        create(key=b"k", filters=[no_delete, no_put, no_put]), leader=False
    )
    assert shape_of(create(key=b"k", fragment=True), leader=False) is None
    assert shape_of(create(key=b""), leader=False) is None
    assert shape_of(create(key=b"b", range_end=b"a"), leader=False) is None  # etcd refuses it
    assert shape_of(create(key=b"b", range_end=b"\x00"), leader=False) is not None  # from key


@pytest.mark.parametrize("watch_id", [0, 1, 300, 2**40, -1])
def test_a_watch_id_set_on_a_serialized_response(watch_id: int) -> None:
    response = rpc_pb2.WatchResponse(watch_id=12, events=[kv_pb2.Event()])
    response.header.revision = 5
    got = rpc_pb2.WatchResponse.FromString(with_watch_id(response.SerializeToString(), watch_id))
    response.watch_id = watch_id
    assert got == response


def test_the_front_says_unavailable_as_forward_does() -> None:
    assert UNAVAILABLE_TEXT == forward.UNAVAILABLE_TEXT


class Client(Outlet):
    """A client stream as a broadcast sees it: what it was offered."""

    def __init__(self) -> None:
        self.ids = IdSpace()
        self.shared: dict[int, Sharer] = {}
        self.got: list[rpc_pb2.WatchResponse] = []
        self.failure: Failure | None = None

    def offer(self, data: bytes) -> None:
        self.got.append(rpc_pb2.WatchResponse.FromString(data))

    def fail(self, failure: Failure) -> None:
        self.failure = failure


class Hub:
    """What a broadcast asks of its hub: to be forgotten."""

    def __init__(self) -> None:
        self.forgotten: list[Broadcast] = []

    def forget(self, broadcast: Broadcast) -> None:
        self.forgotten.append(broadcast)


class Stream:
    """What a broadcast asks of its backend stream: ids, and requests to send."""

    def __init__(self) -> None:
        self.by_id: dict[int, Broadcast] = {}
        self.retired = False
        self.sent: list[rpc_pb2.WatchRequest] = []

    def send(self, data: bytes) -> None:
        self.sent.append(rpc_pb2.WatchRequest.FromString(data))


def _broadcast() -> tuple[Broadcast, Hub, Stream]:
    hub, stream = Hub(), Stream()
    shape = shape_of(rpc_pb2.WatchCreateRequest(key=b"k"), leader=False)
    assert shape is not None
    broadcast = Broadcast(hub, shape, stream)  # type: ignore[arg-type]
    return broadcast, hub, stream


def _header(revision: int) -> rpc_pb2.ResponseHeader:
    return rpc_pb2.ResponseHeader(cluster_id=1, member_id=2, revision=revision, raft_term=3)


def _events(backend_id: int, *revisions: int) -> tuple[rpc_pb2.WatchResponse, bytes]:
    response = rpc_pb2.WatchResponse(watch_id=backend_id)
    response.header.CopyFrom(_header(max(revisions)))
    for r in revisions:
        response.events.append(kv_pb2.Event(kv=kv_pb2.KeyValue(key=b"k", mod_revision=r)))
    return response, bytes(response.SerializeToString())


async def _created(broadcast: Broadcast, backend_id: int, revision: int, *clients: Client) -> None:
    """The backend's created response, with `clients` waiting for it (the first
    of them opened the broadcast)."""
    loop = asyncio.get_running_loop()
    joins = [Joining(c, 0, 0, _header(revision), loop.create_future()) for c in clients]
    broadcast.waiting.extend(joins)
    created = rpc_pb2.WatchResponse(watch_id=backend_id, created=True)
    created.header.CopyFrom(_header(revision))
    broadcast.created(created)
    assert [j.joined.result() for j in joins] == [True] * len(clients)


def _revisions(response: rpc_pb2.WatchResponse) -> list[int]:
    return [e.kv.mod_revision for e in response.events]


async def test_each_sharer_gets_every_event_with_its_own_id_and_a_joiner_nothing_older() -> None:
    broadcast, _, stream = _broadcast()
    first, second = Client(), Client()
    first.ids.take(0)  # the first client has a watch of its own already: this one is 1
    await _created(broadcast, 4, 10, first)
    assert broadcast.live and stream.by_id == {4: broadcast}
    assert [(r.watch_id, r.created, r.header.revision) for r in first.got] == [(1, True, 10)]

    broadcast.deliver(*_events(4, 11))
    # the second joins having read revision 13 elsewhere: 12 and 13 are not its
    broadcast.attach(second, 0, 0, _header(13))
    assert [(r.watch_id, r.created, r.header.revision) for r in second.got] == [(0, True, 13)]
    broadcast.deliver(*_events(4, 12, 13, 14))
    broadcast.deliver(*_events(4, 15))

    assert [(r.watch_id, _revisions(r)) for r in first.got[1:]] == [
        (1, [11]),
        (1, [12, 13, 14]),
        (1, [15]),
    ]
    assert [(r.watch_id, _revisions(r)) for r in second.got[1:]] == [(0, [14]), (0, [15])]


async def test_a_start_revision_joins_only_a_broadcast_that_has_not_passed_it() -> None:
    broadcast, _, _ = _broadcast()
    await _created(broadcast, 0, 10, Client())
    assert broadcast.passed(10) and broadcast.passed(3)
    assert not broadcast.passed(11) and not broadcast.passed(0)

    future = Client()
    broadcast.attach(future, 0, 13, _header(10))
    progress = rpc_pb2.WatchResponse(watch_id=0)
    progress.header.CopyFrom(_header(11))
    broadcast.deliver(progress, progress.SerializeToString())  # before its start: not its
    broadcast.deliver(*_events(0, 12, 13))
    assert [(r.created, _revisions(r)) for r in future.got] == [(True, []), (False, [13])]
    assert broadcast.passed(13)


async def test_a_backend_cancel_goes_to_every_sharer_and_the_last_to_leave_cancels() -> None:
    broadcast, hub, stream = _broadcast()
    a, b, c = Client(), Client(), Client()
    await _created(broadcast, 2, 10, a, b)
    broadcast.attach(c, 0, 0, _header(10))  # joins the live broadcast

    broadcast.leave(a.shared.pop(0))  # a cancels: the others keep the backend watch
    assert stream.sent == []
    compacted = rpc_pb2.WatchResponse(watch_id=2, canceled=True, compact_revision=8)
    broadcast.deliver(compacted, compacted.SerializeToString())
    for client in (b, c):
        assert [(r.watch_id, r.canceled, r.compact_revision) for r in client.got[1:]] == [
            (0, True, 8)
        ]
        assert client.shared == {} and client.ids.used == set()
    assert hub.forgotten == [broadcast]

    again, hub, stream = _broadcast()
    d = Client()
    await _created(again, 2, 10, d)
    again.leave(d.shared.pop(0))
    assert [r.cancel_request.watch_id for r in stream.sent] == [2]
    assert stream.by_id == {} and hub.forgotten == [again]


async def test_a_refused_broadcast_sends_its_creates_to_their_own_watches() -> None:
    broadcast, hub, stream = _broadcast()
    waiting = Joining(Client(), 0, 0, _header(10), asyncio.get_running_loop().create_future())
    broadcast.waiting.append(waiting)
    refused = rpc_pb2.WatchResponse(
        watch_id=-1, created=True, canceled=True, cancel_reason="etcdserver: invalid auth token"
    )
    broadcast.created(refused)
    assert not broadcast.live and hub.forgotten == [broadcast]
    assert waiting.joined.result() is False  # its create goes to the client's own stream
    assert stream.retired  # the front's token is stale: the next broadcast gets a new stream
