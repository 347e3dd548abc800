"""What an operator sees of each queue, read from the state at one moment.

One reading serves both views: the dashboard's JSON (`dashboard.py`) and the
Prometheus collector (`metrics.py`), so the two always agree on what a queue's
depth, in-flight count or SLA lag is.
"""

from __future__ import annotations

from typing import Any

from queue_server.apply import StateMachine

COUNTERS = ("produced", "delivered", "acked", "redelivered", "dead_lettered")
"""The per-queue counters (since this process started) each etcd-key queue row has."""


def etcd_queue_stats(state: StateMachine, wall: float) -> list[dict[str, Any]]:
    """One row per etcd-key queue (CQS queues left out), by name; `wall` is Unix
    seconds. The oldest pending message's age is `wall` minus when it was
    produced, a replicated stamp (`QueueInfo.produced_ms`), so every member
    shows the same age and a restart does not reset it; 0 when nothing is
    pending (or a message from before produce times were kept is oldest)."""
    cqs = state.cqs
    rows = []
    for q in sorted(state.queues.queues.values(), key=lambda q: q.name):
        if cqs.is_cqs(q.name):
            continue
        row: dict[str, Any] = {
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
            "oldest_pending_age_s": _age_s(q.oldest_pending_ms(), wall),
        }
        row.update((name, getattr(q, name)) for name in COUNTERS)
        rows.append(row)
    return rows


def _age_s(produced_ms: int, wall: float) -> float:
    """Seconds since `produced_ms` (0: unknown, or nothing pending); never
    negative (the proposer's clock may be a little ahead of this member's)."""
    if not produced_ms:
        return 0.0
    return max(0.0, round(wall - produced_ms / 1000, 3))


def cqs_queue_stats(state: StateMachine, wall: float) -> list[dict[str, Any]]:
    """One row per CQS queue, by name; `sla_lag_s` is `wall` (Unix seconds) minus
    the most urgent pending SLA, None when nothing is pending."""
    rows = []
    for q in sorted(state.cqs.queues.values(), key=lambda q: q.name):
        sla = q.tree.most_urgent_sla_us()
        rows.append(
            {
                "name": q.name,
                "pending": len(q.tree),
                "in_flight": q.tree.in_flight,
                "subscriptions": [{"dto_type": t, "alias_name": a} for t, a in q.subscriptions],
                "sla_lag_s": None if sla is None else round(wall - sla / 1e6, 3),
            }
        )
    return rows


def etcd_queue_details(state: StateMachine) -> dict[str, dict[str, Any]]:
    """What the dashboard shows of each etcd-key queue beyond its figures, by name:
    its settings (`/q/{name}/config`, defaults filled in), its dead-letter queue
    and how many messages wait there, and which queues it is the dead-letter
    queue of."""
    queues = state.queues.queues
    dead_of: dict[bytes, list[str]] = {}
    for q in queues.values():
        dead_of.setdefault(q.dead_letter_name(), []).append(q.name.decode(errors="replace"))
    details: dict[str, dict[str, Any]] = {}
    for q in queues.values():
        if state.cqs.is_cqs(q.name):
            continue
        settings: dict[str, Any] = {}
        for name in sorted(q.settings.FIELDS):
            value = getattr(q.settings, name)
            settings[name] = value.decode(errors="replace") if isinstance(value, bytes) else value
        dead_name = q.dead_letter_name()
        settings["dead_letter"] = dead_name.decode(errors="replace")  # the default filled in
        dead = queues.get(dead_name)
        details[q.name.decode(errors="replace")] = {
            "settings": settings,
            "dead_letter": dead_name.decode(errors="replace"),
            "dead_letters": dead.depth if dead is not None else 0,
            "dead_letter_of": sorted(n for n in dead_of.get(q.name, []) if n.encode() != q.name),
        }
    return details
