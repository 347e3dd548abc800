"""The live queue dashboard's data: the JSON that the page at `/` polls, `/api/state`.

What belongs here: turning the state machine, the node's dispatcher and the member
table into what the page shows (every queue, etcd-key and CQS, with depth, in
flight, consumers and their members, counters, oldest pending age, SLA lag;
members and leader). The page is a static file of the package
(`queue_server/static/dashboard.html`, served by `http_health.py`): plain HTML,
CSS and JavaScript with no build step and nothing from a CDN. It polls every
second and computes rates from the counters' deltas itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from queue_server.apply import StateMachine
from queue_server.mq.dispatcher import Dispatcher


@dataclass
class DashboardSource:
    """What the dashboard reads, handed in by the server."""

    state: StateMachine
    dispatcher: Callable[[], Dispatcher | None]
    member_id: int
    name: str
    leader_id: Callable[[], int]
    members: Callable[[], list[tuple[int, str, tuple[str, ...]]]]
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time

    def snapshot(self) -> dict[str, Any]:
        state = self.state
        leader = self.leader_id()
        names = {mid: name for mid, name, _ in self.members()}
        return {
            "time": self.wall(),
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
            "queues": self._queues(),
            "cqs": self._cqs(),
        }

    def _queues(self) -> list[dict[str, Any]]:
        dispatcher = self.dispatcher()
        now = self.clock()
        cqs = self.state.cqs
        out = []
        for q in sorted(self.state.queues.queues.values(), key=lambda q: q.name):
            if cqs.is_cqs(q.name):
                continue
            out.append(
                {
                    "name": q.name.decode(errors="replace"),
                    "depth": q.depth,
                    "pending": len(q.pending),
                    "in_flight": len(q.holder),
                    "consumers": [
                        {
                            "id": s.consumer_id.decode(errors="replace"),
                            "member": s.node.decode(errors="replace"),
                            "holding": len(s.held),
                        }
                        for s in q.consumers.values()
                    ],
                    "delivered": q.delivered,
                    "acked": q.acked,
                    "redelivered": q.redelivered,
                    "dead_lettered": q.dead_lettered,
                    "oldest_pending_age_s": (
                        round(dispatcher.oldest_pending_age(q, now), 3) if dispatcher else 0.0
                    ),
                }
            )
        return out

    def _cqs(self) -> list[dict[str, Any]]:
        now = self.wall()
        out = []
        for q in sorted(self.state.cqs.queues.values(), key=lambda q: q.name):
            sla = q.tree.most_urgent_sla_us()
            out.append(
                {
                    "name": q.name,
                    "pending": len(q.tree),
                    "in_flight": q.tree.in_flight,
                    "subscriptions": [{"dto_type": t, "alias_name": a} for t, a in q.subscriptions],
                    "sla_lag_s": None if sla is None else round(now - sla / 1e6, 3),
                }
            )
        return out
