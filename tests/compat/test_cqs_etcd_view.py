"""The etcd view of CQS queues, through real clients against a real server process.

A CQS queue is also `/q/{name}`: producers publish with a plain etcd put on
`/q/dto:{type}/p/{key}`, a plain etcd watch on `/q/{name}/c/{uuid}` consumes the
queue's notifications in SLA order as PUT events of `/q/{name}/{seq}/{ack_token}`
(the notification as JSON, proto field names), deleting that key acknowledges it,
and a plain get shows what is pending (`/q/{name}/{seq}/pending`) and in flight.
The clients are etcdctl 3.4 and the PyPI `etcd3` package (run in a child process,
as in test_queue_clients.py); the CQS gRPC stubs create queues and dequeue where a
test needs to see what is left.

The server's visibility timeout is its default (60 s), far longer than any wait
here: a delivery that comes back within a test came back because its consumer
went away, not because it expired. Background etcdctl watches are read line by
line by a thread with a deadline and ended by their own pid.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from etcdserverpb import cqs_pb2, cqs_pb2_grpc
from tests.compat.test_etcdctl import Ctl
from tests.compat.test_etcdctl import pytestmark as etcdctl_marks
from tests.compat.test_etcdctl_watch_lease import Background
from tests.support.processes import ServerProcess

pytestmark = etcdctl_marks

LINE_TIMEOUT = 10.0
"""How long a background etcdctl may take to print a line it owes."""
RPC_TIMEOUT = 10.0
SCRIPT_TIMEOUT = 60.0
RELEASE_WAIT_MS = 5000
"""BatchDequeue's long-poll when waiting for deliveries a consumer gave back."""
DTO = "storeesl.v1"
STORE = "t/farmersmarket/s/oslo-main/esls"  # one prefix group at depth 4
DELIVERY = re.compile(r"^/q/(?P<queue>[^/]+)/(?P<seq>\d{16})/(?P<token>[^/]+)$")


def sla(second: int) -> str:
    return f"2026-01-01T10:00:{second:02d}Z"


@pytest.fixture(scope="module")
def ctl(server: ServerProcess) -> Ctl:
    return Ctl(server.endpoint, "queue-server")


@pytest.fixture(scope="module")
def cqs(channel: grpc.Channel) -> cqs_pb2_grpc.DtoChangeQueueServiceStub:
    return cqs_pb2_grpc.DtoChangeQueueServiceStub(channel)


def fresh(prefix: str) -> str:
    """A queue name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def create(stub: cqs_pb2_grpc.DtoChangeQueueServiceStub, name: str) -> None:
    stub.CreateOrConfigureQueue(
        cqs_pb2.CreateOrConfigureQueueRequest(
            queue_name=name, subscriptions=[cqs_pb2.DtoTypeSubscription(dto_type=DTO)]
        ),
        timeout=RPC_TIMEOUT,
    )


def publish(ctl: Ctl, key: str, dto_id: str, second: int, **extra: str) -> None:
    value = json.dumps({"dto_id": dto_id, "sla_timestamp": sla(second), **extra})
    assert ctl.ok("put", f"/q/dto:{DTO}/p/{key}", value) == "OK\n"


def dequeue(
    stub: cqs_pb2_grpc.DtoChangeQueueServiceStub, name: str, wait_ms: int = 0
) -> tuple[list[Any], float]:
    """BatchDequeue of everything visible (one prefix group); and how long it took."""
    start = time.monotonic()
    resp = stub.BatchDequeue(
        cqs_pb2.BatchDequeueRequest(
            queue_name=name, max_notifications=100, wait_time_milliseconds=wait_ms
        ),
        timeout=RPC_TIMEOUT + wait_ms / 1000,
    )
    return list(resp.notifications), time.monotonic() - start


def pairs(output: str) -> list[tuple[str, str]]:
    """etcdctl get's output (key line, value line, ...) as (key, value) pairs."""
    lines = output.splitlines()
    assert len(lines) % 2 == 0, output
    return list(zip(lines[::2], lines[1::2], strict=True))


class Watch(Background):
    """`etcdctl watch KEY` left running, read as events."""

    def __init__(self, ctl: Ctl, key: str) -> None:
        super().__init__(ctl, "watch", key)
        self.key = key

    def events(self, count: int) -> list[tuple[str, str, dict[str, Any]]]:
        """The next `count` events as (type, key, JSON value)."""
        lines = self.read(3 * count, LINE_TIMEOUT)
        return [(lines[i], lines[i + 1], json.loads(lines[i + 2])) for i in range(0, len(lines), 3)]


@pytest.fixture
def watches(ctl: Ctl) -> Iterator[list[Watch]]:
    """Background watches a test starts; stopped (by pid) when it ends."""
    started: list[Watch] = []
    yield started
    for w in started:
        w.stop()


def watch(ctl: Ctl, watches: list[Watch], key: str) -> Watch:
    w = Watch(ctl, key)
    watches.append(w)
    return w


# -- etcdctl -------------------------------------------------------------------------


def test_watch_consumer_gets_notifications_in_sla_order_and_del_acknowledges(
    ctl: Ctl,
    cqs: cqs_pb2_grpc.DtoChangeQueueServiceStub,
    watches: list[Watch],
    server: ServerProcess,
) -> None:
    name = fresh("order")
    create(cqs, name)
    seconds = [7, 2, 9, 1, 5, 3]
    random.Random(5).shuffle(seconds)
    for i, second in enumerate(seconds):  # published (seq i + 1) in shuffled SLA order
        publish(ctl, f"k{i}", f"{STORE}/{i}", second, tracking_id=f"trk-{i}")

    consumer = str(uuid.uuid4())
    w = watch(ctl, watches, f"/q/{name}/c/{consumer}")
    events = w.events(len(seconds))

    assert {kind for kind, _, _ in events} == {"PUT"}
    order = sorted(range(len(seconds)), key=lambda i: seconds[i])
    assert [v["sla_timestamp"] for _, _, v in events] == [sla(seconds[i]) for i in order]
    tokens = []
    for (_, key, value), i in zip(events, order, strict=True):
        m = DELIVERY.match(key)
        assert m is not None, key
        assert (m["queue"], int(m["seq"])) == (name, i + 1)
        assert value == {
            "ack_token": m["token"],
            "dto_type": DTO,
            "dto_id": f"{STORE}/{i}",
            "sla_timestamp": sla(seconds[i]),
            "tracking_id": f"trk-{i}",
        }
        tokens.append(m["token"])
    assert len(set(tokens)) == len(tokens)

    # deleting a delivery key acknowledges it, once
    acked_key = events[0][1]
    assert ctl.ok("del", acked_key) == "1\n"
    assert ctl.ok("del", acked_key) == "0\n"
    assert ctl.ok("get", acked_key) == ""

    # a plain get shows the rest in flight with their tokens, the config and the
    # registry keys (the queue's and the consumer's, naming the node)
    node = server.data_dir.name
    listed = pairs(ctl.ok("get", "--prefix", f"/q/{name}"))
    assert [k for k, _ in listed] == [
        f"/q/{name}",
        *sorted(key for _, key, _ in events[1:]),
        f"/q/{name}/c/{consumer}",
        f"/q/{name}/config",
    ]
    shown = dict(listed)
    assert shown[f"/q/{name}"] == node and shown[f"/q/{name}/c/{consumer}"] == node
    for _, key, value in events[1:]:
        assert json.loads(shown[key]) == value
    assert json.loads(shown[f"/q/{name}/config"])["cqs"]["subscriptions"] == [{"dto_type": DTO}]

    # the consumer goes away: what it held comes back, the acknowledged one does not
    w.kill()
    got, _ = dequeue(cqs, name, wait_ms=RELEASE_WAIT_MS)
    assert [n.dto_id for n in got] == [v["dto_id"] for _, _, v in events[1:]]
    assert not {n.ack_token for n in got} & set(tokens)  # fresh tokens


def test_deletes_inside_a_txn_acknowledge_too(
    ctl: Ctl, cqs: cqs_pb2_grpc.DtoChangeQueueServiceStub, watches: list[Watch]
) -> None:
    """Acknowledging is part of apply, so a Txn's deletes acknowledge as a plain
    delete does (each counts one deleted), together with its other writes."""
    name = fresh("txn-ack")
    create(cqs, name)
    for i in range(3):
        publish(ctl, f"k{i}", f"{STORE}/{i}", i + 1)
    w = watch(ctl, watches, f"/q/{name}/c/{uuid.uuid4()}")
    keys = [key for _, key, _ in w.events(3)]
    marker = f"/txn-ack/{name}"
    txn = f"\ndel {keys[0]}\ndel {keys[1]}\nput {marker} done\n\n\n"
    assert ctl.ok("txn", stdin=txn) == "SUCCESS\n\n1\n\n1\n\nOK\n"
    assert ctl.ok("get", marker, "--print-value-only") == "done\n"
    # the two are gone from the view; the third is still in flight
    listed = [k for k, _ in pairs(ctl.ok("get", "--prefix", f"/q/{name}/0"))]
    assert listed == [keys[2]]
    w.kill()
    got, _ = dequeue(cqs, name, wait_ms=RELEASE_WAIT_MS)
    assert [n.dto_id for n in got] == [f"{STORE}/2"]  # only the unacknowledged one comes back


def test_a_consumer_that_disconnects_gives_its_deliveries_back_at_once(
    ctl: Ctl, cqs: cqs_pb2_grpc.DtoChangeQueueServiceStub, watches: list[Watch]
) -> None:
    name = fresh("gone")
    create(cqs, name)
    for i, second in enumerate([4, 1, 3]):
        publish(ctl, f"k{i}", f"{STORE}/{i}", second)
    w = watch(ctl, watches, f"/q/{name}/c/{uuid.uuid4()}")
    held = w.events(3)
    assert [v["dto_id"] for _, _, v in held] == [f"{STORE}/1", f"{STORE}/2", f"{STORE}/0"]
    # while it holds them, nothing is visible
    assert dequeue(cqs, name)[0] == []
    w.kill()
    got, took = dequeue(cqs, name, wait_ms=RELEASE_WAIT_MS)
    assert [n.dto_id for n in got] == [f"{STORE}/1", f"{STORE}/2", f"{STORE}/0"]
    assert [n.sla_timestamp.ToJsonString() for n in got] == [sla(1), sla(3), sla(4)]
    assert took < RELEASE_WAIT_MS / 1000 / 2, f"released only after {took:.1f}s"
    # their old tokens are dead: deleting an old delivery key acknowledges nothing
    assert ctl.ok("del", held[0][1]) == "0\n"


def test_get_prefix_shows_pending_and_in_flight_notifications(
    ctl: Ctl, cqs: cqs_pb2_grpc.DtoChangeQueueServiceStub
) -> None:
    name = fresh("view")
    config = {"cqs": {"subscriptions": [{"dto_type": DTO}], "depth": 4}}
    assert ctl.ok("put", f"/q/{name}/config", json.dumps(config)) == "OK\n"
    publish(ctl, "a", f"{STORE}/a", 30)
    publish(ctl, "b", f"{STORE}/b", 10, tracking_id="trk-b")
    publish(ctl, "c", f"{STORE}/c", 20)
    publish(ctl, "b-again", f"{STORE}/b", 40)  # merges into the pending b

    prefix = f"/q/{name}/"
    pending = [(f"{prefix}{seq:016d}/pending", s) for seq, s in [(1, "a"), (2, "b"), (3, "c")]]
    assert [k for k, _ in pairs(ctl.ok("get", "--prefix", prefix))] == [
        *(k for k, _ in pending),
        f"{prefix}config",
    ]

    taken = cqs.BatchDequeue(
        cqs_pb2.BatchDequeueRequest(queue_name=name, max_notifications=1), timeout=RPC_TIMEOUT
    ).notifications
    assert [n.dto_id for n in taken] == [f"{STORE}/b"]
    token = taken[0].ack_token
    listed = pairs(ctl.ok("get", "--prefix", prefix))
    assert [(k, json.loads(v)) for k, v in listed] == [
        (
            f"{prefix}0000000000000001/pending",
            {"dto_type": DTO, "dto_id": f"{STORE}/a", "sla_timestamp": sla(30)},
        ),
        (
            f"{prefix}0000000000000002/{token}",
            {
                "ack_token": token,
                "dto_type": DTO,
                "dto_id": f"{STORE}/b",
                "sla_timestamp": sla(10),
                "tracking_id": "trk-b",
            },
        ),
        (
            f"{prefix}0000000000000003/pending",
            {"dto_type": DTO, "dto_id": f"{STORE}/c", "sla_timestamp": sla(20)},
        ),
        (f"{prefix}config", config),
    ]
    # count, limit and keys-only see the same keys
    assert ctl.ok("get", "--prefix", prefix, "--keys-only").split() == [k for k, _ in listed]
    limited = ctl.json("get", "--prefix", prefix, "--limit", "2")
    assert limited["count"] == 4 and limited["more"] is True
    assert len(limited["kvs"]) == 2
    assert ctl.ok("get", f"{prefix}0000000000000002/{token}", "--print-value-only") == (
        listed[1][1] + "\n"
    )
    # acknowledged over gRPC: gone from the view too
    cqs.BatchAcknowledge(
        cqs_pb2.BatchAcknowledgeRequest(queue_name=name, ack_tokens=[token]), timeout=RPC_TIMEOUT
    )
    assert [k for k, _ in pairs(ctl.ok("get", "--prefix", prefix))] == [
        f"{prefix}0000000000000001/pending",
        f"{prefix}0000000000000003/pending",
        f"{prefix}config",
    ]


def test_get_from_key_includes_the_view(
    ctl: Ctl, cqs: cqs_pb2_grpc.DtoChangeQueueServiceStub
) -> None:
    """A range with no upper bound (`--from-key`) covers the queue's keys too."""
    name = fresh("fromkey")
    create(cqs, name)
    publish(ctl, "a", f"{STORE}/a", 1)
    keys = ctl.ok("get", "--from-key", f"/q/{name}/", "--keys-only").split()
    assert f"/q/{name}/0000000000000001/pending" in keys
    keys = ctl.ok("get", "--from-key", "/", "--keys-only").split()
    assert f"/q/{name}/0000000000000001/pending" in keys


def test_invalid_publication_is_refused(
    ctl: Ctl, cqs: cqs_pb2_grpc.DtoChangeQueueServiceStub
) -> None:
    name = fresh("refuse")
    create(cqs, name)
    error = ctl.error("put", f"/q/dto:{DTO}/p/k", json.dumps({"dto_id": f"{STORE}/x"}))
    assert "invalid change notification" in error and "sla_timestamp" in error
    error = ctl.error("put", f"/q/{name}/p/k", json.dumps({"dto_id": "x", "sla_timestamp": sla(1)}))
    assert "dto_type is required" in error
    assert [k for k, _ in pairs(ctl.ok("get", "--prefix", f"/q/{name}/"))] == [f"/q/{name}/config"]


# -- the etcd3 client ------------------------------------------------------------------

ETCD3_CONSUMER = r"""
import json, queue, sys, uuid
import etcd3

endpoint, name, dto = sys.argv[1:4]
host, port = endpoint.rsplit(":", 1)
client = etcd3.client(host=host, port=int(port), timeout=10)
published = [
    client.put(
        f"/q/dto:{dto}/p/{key}",
        json.dumps({"dto_id": dto_id, "sla_timestamp": sla, "tracking_id": key}),
    ).header.revision
    for key, dto_id, sla in [
        ("late", "t/fm/s/a/esls/late", "2026-01-01T10:00:09Z"),
        ("urgent", "t/fm/s/a/esls/urgent", "2026-01-01T10:00:01Z"),
    ]
]
consumer = str(uuid.uuid4())
responses = queue.Queue()
watch_id = client.add_watch_callback(f"/q/{name}/c/{consumer}", responses.put)
response = responses.get(timeout=10)
event = response.events[0]
value = json.loads(event.value)
acked = client.delete(event.key)
acked_again = client.delete(event.key)
left = [m.key.decode() for _, m in client.get_prefix(f"/q/{name}/")]
client.cancel_watch(watch_id)
client.close()
print(json.dumps({
    "published_revisions": published,
    "consumer": consumer,
    "type": type(event).__name__,
    "key": event.key.decode(),
    "value": value,
    "acked": acked,
    "acked_again": acked_again,
    "left": left,
}))
"""


def test_etcd3_client_publishes_consumes_and_acknowledges(
    server: ServerProcess, cqs: cqs_pb2_grpc.DtoChangeQueueServiceStub, tmp_path: Path
) -> None:
    name = fresh("etcd3")
    create(cqs, name)
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    env.pop("PYTHONPATH", None)  # the child must not import our etcdserverpb
    proc = subprocess.run(
        [sys.executable, "-c", ETCD3_CONSUMER, server.endpoint, name, DTO],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    # a publication writes no key: both puts answer with the same revision
    assert out["published_revisions"][0] == out["published_revisions"][1]
    assert out["type"] == "PutEvent"
    m = DELIVERY.match(out["key"])
    assert m is not None and (m["queue"], m["seq"]) == (name, f"{2:016d}"), out["key"]
    assert out["value"] == {
        "ack_token": m["token"],
        "dto_type": DTO,
        "dto_id": "t/fm/s/a/esls/urgent",
        "sla_timestamp": sla(1),
        "tracking_id": "urgent",
    }
    assert (out["acked"], out["acked_again"]) == (True, False)
    assert out["key"] not in out["left"]
    assert f"/q/{name}/config" in out["left"]
    # the child is gone, and with its watch what it still held: the later one
    # comes back, the acknowledged one does not
    got, took = dequeue(cqs, name, wait_ms=RELEASE_WAIT_MS)
    assert [(n.dto_id, n.tracking_id) for n in got] == [("t/fm/s/a/esls/late", "late")]
    assert took < RELEASE_WAIT_MS / 1000 / 2
