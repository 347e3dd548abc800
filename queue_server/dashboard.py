"""The live queue dashboard's data: the JSON that the page at `/` polls, `/api/state`,
the last ten minutes of each queue's figures, and the redrive behind its button.

What belongs here: turning the state machine and the member table into what the page shows (every queue, etcd-key and CQS, with depth, in
flight, consumers and their members, counters, oldest pending age, SLA lag,
settings, dead letters; members and leader; alarms and quota use). The page is a
static file of the package (`queue_server/static/dashboard.html`, served by
`metrics_listener.py`): plain HTML, CSS and JavaScript with no build step and nothing
from a CDN. It polls every second and computes rates from the counters' deltas
itself.

Theory of operation:

- `QueueHistory` is a policy of the node's clock (`node/timers.py`): every
  `SAMPLE_INTERVAL` seconds it records each queue's figures in a ring of its
  own, so a page opened now draws the last `HISTORY_SECONDS` at once. It also
  remembers when each queue was last active (anything pending, in flight or
  consuming, or a counter that moved), which the page uses to fold idle queues.
- `Redriver` answers POST /api/redrive: it plans the Txns of `mq/redrive.py` and
  proposes them one by one through the same path as a KV Txn, so the move is
  replicated in a cluster and checked (quota, alarms) like any write. It refuses
  while auth is enabled: the metrics listener has no credentials to check.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.alarms import alarm_name
from queue_server.apply import StateMachine
from queue_server.errors import EtcdError
from queue_server.mq.redrive import MAX_REDRIVE, RedriveRefused, plan_redrive
from queue_server.mq.state import QueueInfo
from queue_server.proposals import Propose
from queue_server.queue_stats import cqs_queue_stats, etcd_queue_details, etcd_queue_stats

HISTORY_SECONDS = 600.0
"""How far back the page's charts reach on first load (ten minutes)."""
SAMPLE_INTERVAL = 2.0
"""Seconds between two samples: 300 per queue over HISTORY_SECONDS, fine enough
for a rate chart; the page adds its own one-second points while it is open."""
HISTORY_SAMPLES = int(HISTORY_SECONDS / SAMPLE_INTERVAL)
MAX_SAMPLED_QUEUES = 256
"""Queues with a ring at once. A ring is about 30 KB; a queue quiet for the whole
window loses its ring, so this bounds only many busy queues at once (more are
shown without history). Request/reply setups make a queue per client."""
SAMPLE_FIELDS = ("pending", "in_flight", "consumers", "produced", "acked", "dead_letters")
"""What a sample holds, after its time: the page's chart series and rates."""


@dataclass(slots=True)
class _Ring:
    samples: deque[tuple[float, ...]] = field(default_factory=lambda: deque(maxlen=HISTORY_SAMPLES))


class QueueHistory:
    """The last HISTORY_SECONDS of every etcd-key queue's figures, one sample
    every `interval` seconds of the node's clock, in a bounded ring per queue."""

    interval = SAMPLE_INTERVAL

    def __init__(self, state: StateMachine, started: float) -> None:
        self.state = state
        self.started = started
        self.rings: dict[bytes, _Ring] = {}
        self.last_active: dict[bytes, float] = {}
        # each queue's figures at the last sample; at start, what recovery left
        # (counters of replayed entries are no traffic of this node's)
        self.last_figures: dict[bytes, tuple[int, ...]] = {
            q.name: self._figures(q) for q in self._queues()
        }
        self.last_sample_at = started

    def _queues(self) -> list[QueueInfo]:
        cqs = self.state.cqs
        return [q for q in self.state.queues.queues.values() if not cqs.is_cqs(q.name)]

    def _figures(self, q: QueueInfo) -> tuple[int, ...]:
        """A sample's figures (SAMPLE_FIELDS) of queue `q`."""
        dead = self.state.queues.queues.get(q.dead_letter_name())
        return (
            len(q.pending),
            len(q.holder),
            len(q.consumers),
            q.produced,
            q.acked,
            dead.depth if dead is not None else 0,
        )

    def due(self, now: float) -> None:
        queues = self.state.queues.queues
        for name in [n for n in self.rings if n not in queues]:  # gone (snapshot restore)
            del self.rings[name]
        for name in [n for n in self.last_figures if n not in queues]:
            del self.last_figures[name]
            self.last_active.pop(name, None)
        for q in self._queues():
            figures = self._figures(q)
            # a queue first seen now was created since the last sample: its
            # counters were all 0 then
            before = self.last_figures.get(q.name, (0,) * len(figures))
            self.last_figures[q.name] = figures
            active = any(figures[:3]) or figures[3:] != before[3:]
            if active:
                self.last_active[q.name] = now
            ring = self.rings.get(q.name)
            if ring is None:
                if not active or len(self.rings) >= MAX_SAMPLED_QUEUES:
                    continue
                ring = self.rings[q.name] = _Ring()
                # where the line starts: the last sample's figures, so the
                # traffic that woke the queue is drawn
                ring.samples.append((self.last_sample_at, *before))
            ring.samples.append((now, *figures))
            if now - self.last_active.get(q.name, self.started) > HISTORY_SECONDS:
                del self.rings[q.name]  # quiet for the whole window: nothing to draw
        self.last_sample_at = now

    def idle_seconds(self, name: bytes, now: float) -> float:
        """Seconds since the queue was last seen active (since the node started
        when it has not been)."""
        return max(0.0, now - self.last_active.get(name, self.started))

    def series(self, name: bytes, now: float, wall: float) -> dict[str, list[float]]:
        """The queue's samples as columns; `t` in Unix seconds."""
        ring = self.rings.get(name)
        samples = list(ring.samples) if ring is not None else []
        columns: dict[str, list[float]] = {"t": [round(wall - (now - s[0]), 3) for s in samples]}
        for i, column in enumerate(SAMPLE_FIELDS, start=1):
            columns[column] = [s[i] for s in samples]
        return columns


@dataclass
class DashboardSource:
    """What the dashboard reads, handed in by the server."""

    state: StateMachine
    member_id: int
    name: str
    leader_id: Callable[[], int]
    members: Callable[[], list[tuple[int, str, tuple[str, ...]]]]
    clock: Callable[[], float]
    """The node's clock (`Timers.clock`)."""
    wall: Callable[[], float]
    """The node's wall clock (`Timers.wall`): what the queues' ages are measured against."""
    history: QueueHistory | None = None
    quota: Callable[[], tuple[int, int]] | None = None
    """(bytes used, --quota-backend-bytes; 0 for no quota)."""

    def snapshot(self, with_history: bool = True) -> dict[str, Any]:
        state = self.state
        leader = self.leader_id()
        names = {mid: name for mid, name, _ in self.members()}
        now, wall = self.clock(), self.wall()
        queues = etcd_queue_stats(state, wall)
        details = etcd_queue_details(state)
        history = self.history
        for row in queues:
            row.update(details.get(row["name"], {}))
            if history is not None:
                key = row["name"].encode()
                row["idle_s"] = round(history.idle_seconds(key, now), 1)
                if with_history:
                    row["history"] = history.series(key, now, wall)
        used, quota = self.quota() if self.quota is not None else (state.store.size_bytes, 0)
        return {
            "time": wall,
            "member": {"id": f"{self.member_id:x}", "name": self.name},
            "leader": {"id": f"{leader:x}" if leader else "", "name": names.get(leader, "")},
            "members": [
                {
                    "id": f"{mid:x}",
                    "name": name,
                    "client_urls": list(urls),
                    "leader": mid == leader,
                }
                for mid, name, urls in self.members()
            ],
            "revision": state.store.revision,
            "keys": state.store.key_count,
            "alarms": [
                {"member": f"{member:x}", "alarm": alarm_name(alarm)}
                for member, alarm in state.alarms.get()
            ],
            "quota": {"used_bytes": used, "quota_bytes": quota},
            "auth_enabled": state.auth.enabled,
            "history_seconds": HISTORY_SECONDS,
            "queues": queues,
            "cqs": cqs_queue_stats(state, wall),
        }


Answer = tuple[HTTPStatus, dict[str, Any]]


class Redriver:
    """POST /api/redrive: `{"queue": NAME}` moves all of the queue's pending dead
    letters back onto it, `{"queue": NAME, "count": N}` the N oldest."""

    def __init__(self, state: StateMachine, propose: Propose, wall_ms: Callable[[], int]) -> None:
        self.state = state
        self.propose = propose
        self.wall_ms = wall_ms
        """The node's wall clock (`Timers.wall_ms`): the stamp of each redrive Txn."""

    async def __call__(self, body: Mapping[str, Any]) -> Answer:
        if self.state.auth.enabled:
            return HTTPStatus.FORBIDDEN, {
                "error": "redrive over HTTP is refused while auth is enabled: the metrics "
                "listener checks no credentials; send the redrive Txns of docs/queue.md "
                "as a user who may write both queues"
            }
        unknown = sorted(set(body) - {"queue", "count"})
        if unknown:
            return HTTPStatus.BAD_REQUEST, {"error": f"unknown field {unknown[0]!r}"}
        queue, count = body.get("queue"), body.get("count")
        if not isinstance(queue, str):
            return HTTPStatus.BAD_REQUEST, {"error": "queue must be a queue name (a string)"}
        if count is not None and (type(count) is not int or not 1 <= count <= MAX_REDRIVE):
            return HTTPStatus.BAD_REQUEST, {
                "error": f"count must be a whole number from 1 to {MAX_REDRIVE}, not {count!r}"
            }
        if self.state.cqs.is_cqs(queue.encode()):
            return HTTPStatus.BAD_REQUEST, {"error": f"{queue!r} is a CQS queue"}
        try:
            plan = plan_redrive(self.state.queues, self.state.store, queue, count)
        except RedriveRefused as e:
            missing = str(e).startswith("no queue")
            return HTTPStatus.NOT_FOUND if missing else HTTPStatus.BAD_REQUEST, {"error": str(e)}
        moved = skipped = 0
        answer: dict[str, Any] = {"queue": plan.queue, "dead_letter": plan.dead_letter}
        for txn in plan.txns:
            try:
                result = await self.propose(internal_pb2.Command(txn=txn, now_ms=self.wall_ms()))
            except EtcdError as e:
                result = e
            if isinstance(result, EtcdError):
                answer.update(moved=moved, skipped=skipped, error=result.text)
                return HTTPStatus.CONFLICT, answer
            assert isinstance(result, rpc_pb2.TxnResponse)
            if result.succeeded:
                moved += 1
            else:
                skipped += 1  # consumed, cancelled or redriven meanwhile
        answer.update(moved=moved, skipped=skipped)
        return HTTPStatus.OK, answer
