"""The live queue dashboard's data: the JSON that the page at `/` polls, `/api/state`.

What belongs here: turning the state machine and the member table into what
the page shows (every queue, etcd-key and CQS, with depth, in flight, consumers
and their members, counters, oldest pending age, SLA lag; members and leader). The page is a static file of the package
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
from queue_server.queue_stats import cqs_queue_stats, etcd_queue_stats


@dataclass
class DashboardSource:
    """What the dashboard reads, handed in by the server."""

    state: StateMachine
    member_id: int
    name: str
    leader_id: Callable[[], int]
    members: Callable[[], list[tuple[int, str, tuple[str, ...]]]]
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
            "queues": etcd_queue_stats(state, self.wall()),
            "cqs": cqs_queue_stats(state, self.wall()),
        }
