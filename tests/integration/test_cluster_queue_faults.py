"""The etcd-key queue across three members under faults, with clients that behave
as real ones do: the dispatching member (the leader) SIGKILLed twice while a
stream of messages is produced, and the dispatching member cut off from its
peers, then healed.

The producer puts through one member and, when a put fails with UNAVAILABLE or
DEADLINE_EXCEEDED, retries it on the next live member; a put that committed
anyway then leaves a second message with the same payload. Four consumers watch
through the other two members; a consumer whose stream breaks watches again,
under a new uuid, through the next live member (one watch is a `Session`). Each
consumer works on a delivery a little while before it acknowledges it, so that a
message held by two consumers at once would show.

What every client saw goes in a `Ledger`, which is checked at the end:

- nothing lost: every acknowledged produce was delivered and its delivery
  acknowledged (a delete answering `deleted: 1`, or one whose answer was lost
  when the member died under it), and the queue drains to empty on every member;
- duplicates only from retries: two messages with one payload only where a put
  of that payload failed with an unknown outcome and was retried;
- one holder at a time: a hold runs from a delivery's arrival to its ack's
  answer, or to its stream breaking. Two holds of one message never overlap
  (the server takes a message back only when its holder is gone: its stream
  closed, or its member's session lease expired 4 s after the member died), a
  message never arrives again after its acknowledgement, and an ack sent while
  its consumer's stream was open finds the message (`deleted: 1`) unless an
  earlier attempt of that same ack had an unknown outcome.
"""

from __future__ import annotations

import itertools
import queue
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from tests.support.cluster import Cluster, Member

pytestmark = pytest.mark.integration

QUEUE = "faults"
MESSAGES = 400
CONSUMERS = 4
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
WAIT = 30.0
"""Longest any one wait of a test (a leader, a drain, a stuck client) may take."""
RPC_TIMEOUT = 2.0
"""Deadline of one put or delete attempt: a cut-off member is given up on in 2 s."""
WORK_SECONDS = 0.05
"""A consumer's work on one message before its ack: the width of the window in
which a second holder of the message would be seen. Four consumers take about
70 messages a second, fewer than the producer makes, so they hold messages (up to
the prefetch of 64 each) when a fault comes."""
PRODUCE_PACE = 0.003
"""Pause between produces: a steady stream (over 100 a second), not a flood."""
RECONNECT_PAUSE = 0.1
"""Pause before a consumer watches again after its stream broke (client backoff)."""
CUT_SECONDS = 6.0
"""Shortest time the dispatching member stays cut off: longer than the 4 s
session TTL of the members' consumers, which must outlive the cut."""
SLOW_PRODUCE_PACE = 1.5 * CUT_SECONDS / (MESSAGES * 3 // 4)
"""Pause between produces when the stream must outlast a fault of CUT_SECONDS: the
three quarters produced after the cut take at least half as long again as the cut,
however fast each put is (at 0.015 s a fast run once finished inside the cut)."""
LIFETIME = 120.0
"""Longest a consumer stream stays open if the test never closes it."""


def name_of(member: Member) -> bytes:
    return member.data_dir.name.encode()


def message_key(delivery_key: bytes) -> bytes:
    """The message a delivery key stands for: `/q/{name}/{idx}/{key}`, whether it
    came as that or handed over as `/q/{name}/c/{uuid}/{idx}/{key}`."""
    parts = delivery_key.split(b"/")
    if len(parts) == 7 and parts[3] == b"c":
        return b"/".join(parts[:3] + parts[5:])
    return delivery_key


def handed_to(delivery_key: bytes) -> bytes | None:
    """The consumer uuid a handed-over delivery key names (None: a message key)."""
    parts = delivery_key.split(b"/")
    return parts[4] if len(parts) == 7 and parts[3] == b"c" else None


# -- what the clients saw ---------------------------------------------------------


@dataclass(eq=False)
class Session:
    """One consumer watch: a uuid on one member, until its stream breaks."""

    member: Member
    consumer_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    channel: grpc.Channel | None = None
    broken_at: float | None = None  # when the client saw its stream end
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def key(self) -> bytes:
        return f"/q/{QUEUE}/c/{self.consumer_id}".encode()


@dataclass(eq=False)
class Hold:
    """One delivery, from its arrival to its ack's answer or its stream breaking."""

    session: Session
    delivery_key: bytes
    value: bytes
    received: float
    outcome: str = ""  # "acked", "abandoned" (stream broke first), "failed"
    deleted: int = -1  # the ack's answer
    ambiguous: bool = False  # an attempt of the ack failed with an unknown outcome
    answered: float | None = None  # when the ack was answered

    @property
    def message(self) -> bytes:
        return message_key(self.delivery_key)

    @property
    def ended(self) -> float:
        """When the consumer stopped holding the message (inf: never, yet)."""
        if self.outcome == "acked" and self.answered is not None:
            return self.answered
        broken = self.session.broken_at
        ends = [t for t in (broken, self.answered) if t is not None]
        return min(ends) if ends else float("inf")


class Ledger:
    """Produces, deliveries and acks as the clients saw them (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.produced: dict[bytes, bool] = {}  # payload -> acknowledged
        self.unknown_puts: dict[bytes, int] = {}  # payload -> attempts with unknown outcome
        self.holds: list[Hold] = []
        self.sessions: list[Session] = []
        self.errors: list[str] = []

    def put_answered(self, payload: bytes, ok: bool) -> None:
        with self.lock:
            self.produced[payload] = self.produced.get(payload, False) or ok
            if not ok:
                self.unknown_puts[payload] = self.unknown_puts.get(payload, 0) + 1

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)

    def received(self, session: Session, key: bytes, value: bytes, now: float) -> Hold:
        hold = Hold(session, key, value, now)
        with self.lock:
            self.holds.append(hold)
        return hold

    def acknowledged_produces(self) -> set[bytes]:
        with self.lock:
            return {p for p, ok in self.produced.items() if ok}

    def done_payloads(self) -> set[bytes]:
        """Payloads some consumer acknowledged: its delete answered `deleted: 1`,
        or an attempt of it had an unknown outcome (it committed, if a retry found
        nothing to delete or nothing was delivered again)."""
        with self.lock:
            return {
                h.value
                for h in self.holds
                if (h.outcome == "acked" and (h.deleted == 1 or h.ambiguous))
                or (h.outcome == "abandoned" and h.ambiguous)
            }

    def violations(self) -> list[str]:
        """Every broken invariant of the module docstring, as readable lines."""
        with self.lock:
            holds = list(self.holds)
        out: list[str] = []
        by_message: dict[bytes, list[Hold]] = {}
        for h in holds:
            by_message.setdefault(h.message, []).append(h)
            owner = handed_to(h.delivery_key)
            if owner is not None and owner != h.session.consumer_id.encode():
                out.append(f"{h.delivery_key!r} names another consumer than {h.session.key!r}")
        for message, hs in by_message.items():
            hs.sort(key=lambda h: h.received)
            for a, b in itertools.pairwise(hs):
                if b.received < a.ended:
                    out.append(
                        f"double hold of {message!r}: {a.session.consumer_id} "
                        f"[{a.received:.3f}, {a.ended:.3f}] {a.outcome}, "
                        f"{b.session.consumer_id} from {b.received:.3f}"
                    )
            acks = [h for h in hs if h.outcome == "acked" and h.deleted == 1]
            if len(acks) > 1:
                out.append(f"{message!r} acknowledged {len(acks)} times")
            if acks and any(h.received > acks[0].ended for h in hs):
                out.append(f"{message!r} delivered again after its ack")
            for h in hs:
                live = h.session.broken_at is None or (
                    h.answered is not None and h.session.broken_at > h.answered
                )
                if h.outcome == "acked" and h.deleted == 0 and not h.ambiguous and live:
                    out.append(
                        f"{message!r}: the ack of live holder {h.session.consumer_id} "
                        f"found it gone (another consumer acknowledged it)"
                    )
        by_payload: dict[bytes, set[bytes]] = {}
        for h in holds:
            by_payload.setdefault(h.value, set()).add(h.message)
        for payload, messages in by_payload.items():
            if len(messages) > 1 + self.unknown_puts.get(payload, 0):
                out.append(
                    f"payload {payload!r} is {len(messages)} messages, from "
                    f"{self.unknown_puts.get(payload, 0)} retried puts: {sorted(messages)}"
                )
        return out

    def describe(self, payloads: set[bytes]) -> str:
        """The holds of some payloads, one line each, for a failure message."""
        with self.lock:
            holds = [h for h in self.holds if h.value in payloads]
        return "\n".join(
            f"  {h.delivery_key!r} on {name_of(h.session.member)!r} received={h.received:.3f} "
            f"outcome={h.outcome or 'none'} deleted={h.deleted} ambiguous={h.ambiguous} "
            f"answered={h.answered} broken_at={h.session.broken_at}"
            for h in holds
        )

    def summary(self) -> str:
        with self.lock:
            holds = list(self.holds)
            retried = sum(self.unknown_puts.values())
        messages = {h.message for h in holds}
        payloads = {h.value for h in holds}
        again = len(holds) - len(messages)
        return (
            f"produced={len(self.produced)} retried_puts={retried} "
            f"messages={len(messages)} duplicates={len(messages) - len(payloads)} "
            f"deliveries={len(holds)} redeliveries={again} "
            f"abandoned={sum(h.outcome == 'abandoned' for h in holds)} "
            f"sessions={len(self.sessions)}"
        )


# -- clients ------------------------------------------------------------------------


def put(member: Member, key: bytes, value: bytes) -> None:
    with grpc.insecure_channel(member.endpoint) as ch:
        rpc_pb2_grpc.KVStub(ch).Put(rpc_pb2.PutRequest(key=key, value=value), timeout=RPC_TIMEOUT)


def next_live(cluster: Cluster, after: Member) -> Member:
    """The next live member after `after`, in the cluster's order (itself last)."""
    members = cluster.members
    start = members.index(after)
    for step in range(1, len(members) + 1):
        m = members[(start + step) % len(members)]
        if m.alive:
            return m
    raise AssertionError("no live member")


class Producer:
    """Produces MESSAGES unique payloads through `home`, retrying a put that
    failed with an unknown outcome on the next live member until it is answered."""

    def __init__(
        self, cluster: Cluster, home: Member, ledger: Ledger, run: str, pace: float = PRODUCE_PACE
    ) -> None:
        self.cluster = cluster
        self.pace = pace
        self.home = home
        self.ledger = ledger
        self.run = run
        self.acked = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join(timeout=WAIT * 2)
        assert not self._thread.is_alive(), f"the producer is stuck at {self.acked}"

    def wait_acked(self, count: int) -> None:
        deadline = time.monotonic() + WAIT
        while self.acked < count:
            assert self._thread.is_alive(), f"the producer ended at {self.acked}"
            assert time.monotonic() < deadline, f"the producer is stuck at {self.acked}"
            time.sleep(0.02)  # poll a counter the producer thread advances

    def _run(self) -> None:
        member = self.home
        deadline = time.monotonic() + WAIT * 2
        for i in range(MESSAGES):
            payload = f"{self.run}-{i:04d}".encode()
            key = f"/q/{QUEUE}/p/m{i:04d}".encode()
            while True:
                if time.monotonic() > deadline:
                    self.ledger.error(f"produce {i} not answered in time")
                    return
                if not member.alive:
                    member = next_live(self.cluster, member)
                try:
                    put(member, key, payload)
                except grpc.RpcError as e:
                    if e.code() not in RETRYABLE:
                        self.ledger.error(f"put {payload!r}: {e.code()}: {e.details()}")
                        return
                    self.ledger.put_answered(payload, ok=False)
                    member = next_live(self.cluster, member)
                    continue
                self.ledger.put_answered(payload, ok=True)
                self.acked += 1
                break
            time.sleep(self.pace)  # pacing, not synchronisation


class Consumer:
    """A client consuming the queue through one member at a time: a watch thread
    that records deliveries and moves to the next live member when its stream
    breaks, and a worker thread that works on each delivery and acknowledges it
    through the member it came from, while its stream lasts."""

    def __init__(self, cluster: Cluster, first: Member, ledger: Ledger) -> None:
        self.cluster = cluster
        self.ledger = ledger
        self.session = Session(first)
        self.sessions: list[Session] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _stop against a new stream
        self._stream: grpc.Future[rpc_pb2.WatchResponse] | None = None
        self._work: queue.Queue[Hold | None] = queue.Queue()
        self._watcher = threading.Thread(target=self._watch_loop, daemon=True)
        self._worker = threading.Thread(target=self._work_loop, daemon=True)

    def start(self) -> Consumer:
        self._watcher.start()
        self._worker.start()
        return self

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            if self._stream is not None:
                self._stream.cancel()
        self.session.done.set()
        self._watcher.join(timeout=WAIT)
        self._work.put(None)
        self._worker.join(timeout=WAIT)
        for s in self.sessions:
            if s.channel is not None:
                s.channel.close()

    def _requests(self, session: Session) -> Iterator[rpc_pb2.WatchRequest]:
        key = session.key
        yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=key))
        session.done.wait(LIFETIME)

    def _watch_loop(self) -> None:
        session = self.session
        while True:
            self._watch(session)
            if self._stop.is_set():
                return
            time.sleep(RECONNECT_PAUSE)  # a client's backoff before it watches again
            session = Session(next_live(self.cluster, session.member))
            self.session = session

    def _watch(self, session: Session) -> None:
        session.channel = grpc.insecure_channel(session.member.endpoint)
        self.sessions.append(session)
        with self.ledger.lock:
            self.ledger.sessions.append(session)
        with self._lock:
            if self._stop.is_set():
                return
            stream = rpc_pb2_grpc.WatchStub(session.channel).Watch(
                self._requests(session), timeout=LIFETIME
            )
            self._stream = stream
        try:
            for resp in stream:
                now = time.monotonic()
                if resp.canceled:
                    break
                for ev in resp.events:
                    if ev.type == kv_pb2.Event.PUT:
                        self._work.put(self.ledger.received(session, ev.kv.key, ev.kv.value, now))
        except grpc.RpcError:
            pass  # the member died, or the test closed the consumer
        finally:
            session.broken_at = time.monotonic()
            session.done.set()

    def _work_loop(self) -> None:
        while (hold := self._work.get()) is not None:
            time.sleep(WORK_SECONDS)  # the consumer's work on the message
            self._ack(hold)

    def _ack(self, hold: Hold) -> None:
        """Delete the delivery key through the member it came from, retried while
        the stream is open; a consumer whose stream broke gives the work up."""
        session = hold.session
        assert session.channel is not None
        kv = rpc_pb2_grpc.KVStub(session.channel)
        deadline = time.monotonic() + WAIT
        while True:
            if session.broken_at is not None:
                hold.outcome, hold.answered = "abandoned", time.monotonic()
                return
            try:
                resp = kv.DeleteRange(
                    rpc_pb2.DeleteRangeRequest(key=hold.delivery_key), timeout=RPC_TIMEOUT
                )
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE or time.monotonic() > deadline:
                    hold.outcome, hold.answered = "failed", time.monotonic()
                    self.ledger.error(f"ack {hold.delivery_key!r}: {e.code()}: {e.details()}")
                    return
                hold.ambiguous = True
                continue
            hold.deleted, hold.answered = resp.deleted, time.monotonic()
            hold.outcome = "acked"
            return


# -- the checks -------------------------------------------------------------------


def get(member: Member, key: bytes) -> bytes | None:
    with grpc.insecure_channel(member.endpoint) as ch:
        resp = rpc_pb2_grpc.KVStub(ch).Range(rpc_pb2.RangeRequest(key=key), timeout=5)
    return resp.kvs[0].value if resp.kvs else None


def wait_value(member: Member, key: bytes, want: bytes | None) -> None:
    deadline = time.monotonic() + WAIT
    while True:
        try:
            got = get(member, key)
        except grpc.RpcError as e:
            got = f"<{e.code().name}>".encode()
        if got == want:
            return
        assert time.monotonic() < deadline, f"{key!r} is {got!r}, not {want!r}"
        time.sleep(0.05)  # poll replicated state, bounded


def pending(member: Member) -> int:
    """Messages of the queue left (pending or delivered), by a linearizable count."""
    with grpc.insecure_channel(member.endpoint) as ch:
        resp = rpc_pb2_grpc.KVStub(ch).Range(
            rpc_pb2.RangeRequest(
                key=f"/q/{QUEUE}/0".encode(), range_end=f"/q/{QUEUE}/:".encode(), count_only=True
            ),
            timeout=5,
        )
    return int(resp.count)


def start_consumers(cluster: Cluster, members: list[Member], ledger: Ledger) -> list[Consumer]:
    """CONSUMERS consumers spread over `members`, each registered before return."""
    consumers = [
        Consumer(cluster, members[i % len(members)], ledger).start() for i in range(CONSUMERS)
    ]
    for c in consumers:
        wait_value(members[0], c.session.key, name_of(c.session.member))
    return consumers


def check_drained(cluster: Cluster, ledger: Ledger, started: float) -> None:
    """Every acknowledged produce acknowledged by a consumer, the queue empty on
    every member, and no invariant of the ledger broken."""
    assert ledger.errors == [], ledger.errors[:10]
    want = ledger.acknowledged_produces()
    assert len(want) == MESSAGES
    deadline = time.monotonic() + WAIT
    while missing := want - ledger.done_payloads():
        assert time.monotonic() < deadline, (
            f"{len(missing)} acknowledged produces never acknowledged by a consumer, "
            f"e.g. {sorted(missing)[:5]}; {ledger.summary()}\n"
            f"{ledger.describe(set(sorted(missing)[:5]))}"
        )
        time.sleep(0.05)  # poll what the consumer threads record
    drained_after = time.monotonic() - started
    for m in cluster.members:
        deadline = time.monotonic() + WAIT
        while (left := pending(m)) != 0:
            assert time.monotonic() < deadline, f"{name_of(m)!r} still has {left} messages"
            time.sleep(0.05)  # poll replicated state, bounded
    assert ledger.errors == [], ledger.errors[:10]
    assert (bad := ledger.violations()) == [], "\n".join(bad[:20])
    print(f"\ndrained {drained_after:.1f}s after the first produce; {ledger.summary()}")


# -- the tests --------------------------------------------------------------------


@pytest.mark.crash
def test_every_acknowledged_produce_is_consumed_once_at_a_time_across_leader_kills(
    cluster: Cluster,
) -> None:
    run = f"kill{random.randrange(1 << 30):x}"
    ledger = Ledger()
    leader = cluster.wait_leader()
    others = [m for m in cluster.members if m is not leader]
    consumers = start_consumers(cluster, others, ledger)
    wait_value(others[0], f"/q/{QUEUE}".encode(), name_of(leader))
    producer = Producer(cluster, leader, ledger, run)
    started = time.monotonic()
    try:
        producer.start()
        for kill_at in (MESSAGES // 4, MESSAGES // 2):
            producer.wait_acked(kill_at)
            dispatching = cluster.wait_leader()  # the leader orders the assignments
            killed_at = time.monotonic()
            dispatching.kill()
            new = cluster.wait_leader(exclude=dispatching)
            print(
                f"\n{run}: killed {name_of(dispatching)!r} at {producer.acked} produces, "
                f"{name_of(new)!r} leads {time.monotonic() - killed_at:.2f}s later"
            )
            dispatching.start()  # the cluster keeps its quorum for the next kill
            cluster.wait_leader()  # every member, the restarted one too, names it
        producer.join()
        check_drained(cluster, ledger, started)
        wait_value(cluster.members[0], f"/q/{QUEUE}".encode(), name_of(cluster.wait_leader()))
    finally:
        for c in consumers:
            c.close()


@pytest.fixture
def proxied_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Three members whose peer traffic comes in through proxies (cut/heal)."""
    c = Cluster(tmp_path, proxied=True).start()
    try:
        yield c
    finally:
        c.stop()


def test_every_acknowledged_produce_is_consumed_once_at_a_time_across_a_partition(
    proxied_cluster: Cluster,
) -> None:
    cluster = proxied_cluster
    run = f"cut{random.randrange(1 << 30):x}"
    ledger = Ledger()
    leader = cluster.wait_leader()
    others = [m for m in cluster.members if m is not leader]
    consumers = start_consumers(cluster, others, ledger)
    wait_value(others[0], f"/q/{QUEUE}".encode(), name_of(leader))
    producer = Producer(cluster, leader, ledger, run, pace=SLOW_PRODUCE_PACE)
    started = time.monotonic()
    try:
        producer.start()
        producer.wait_acked(MESSAGES // 4)
        cut_at = time.monotonic()
        cluster.proxy_of(leader).cut()
        new = cluster.wait_leader(exclude=leader)
        print(
            f"\n{run}: cut {name_of(leader)!r} at {producer.acked} produces, "
            f"{name_of(new)!r} leads {time.monotonic() - cut_at:.2f}s later"
        )
        # the stream goes on through the majority, past the session TTL of the
        # members' consumers (which must not go: only the cut member lost touch)
        producer.wait_acked(producer.acked + MESSAGES // 4)
        while time.monotonic() < cut_at + CUT_SECONDS:
            time.sleep(0.05)  # the length of the fault, not a synchronisation
        healed_at = time.monotonic()
        assert producer.acked < MESSAGES, "the cut heals while the stream goes on"
        cluster.proxy_of(leader).heal()
        cluster.wait_leader()  # every member, the healed one too, names it
        print(f"healed at {producer.acked} produces, {healed_at - cut_at:.2f}s after the cut")
        producer.join()
        print(f"produced {time.monotonic() - started:.2f}s after the first")
        check_drained(cluster, ledger, started)
        wait_value(leader, f"/q/{QUEUE}".encode(), name_of(cluster.wait_leader()))
    finally:
        for c in consumers:
            c.close()
