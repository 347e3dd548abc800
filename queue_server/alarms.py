"""The replicated alarm table (etcd's alarm store): which member raised which alarm.

A NOSPACE alarm puts the state machine in etcd's "capped" mode: Puts, Txns that
write and LeaseGrants fail with `NoSpace` until the alarm is disarmed; reads,
deletes and compaction still work, so an operator can free space.
"""

from __future__ import annotations

from etcdserverpb import rpc_pb2

NOSPACE = rpc_pb2.NOSPACE
NONE = rpc_pb2.NONE


def alarm_name(alarm: int) -> str:
    """The alarm type's name, or its number for a type this version does not
    know (what Go's String() prints). etcd stores any type a client activates,
    so an unknown one must not break Status or /health (found by fuzzing)."""
    try:
        return rpc_pb2.AlarmType.Name(alarm)
    except ValueError:
        return str(alarm)


class AlarmTable:
    """Active alarms as (member_id, alarm type) pairs."""

    def __init__(self) -> None:
        self.active: set[tuple[int, int]] = set()

    @property
    def no_space(self) -> bool:
        # asked on every apply: no generator while no alarm is active at all
        return bool(self.active) and any(alarm == NOSPACE for _, alarm in self.active)

    def get(self, alarm: int = NONE) -> list[tuple[int, int]]:
        return sorted(a for a in self.active if alarm == NONE or a[1] == alarm)

    def apply(self, r: rpc_pb2.AlarmRequest) -> rpc_pb2.AlarmResponse:
        """ACTIVATE and DEACTIVATE answer with the alarm concerned, GET with the
        matching ones, as etcd's applier does."""
        resp = rpc_pb2.AlarmResponse()
        pair = (r.memberID, r.alarm)
        if r.action == rpc_pb2.AlarmRequest.ACTIVATE:
            if r.alarm != NONE:
                self.active.add(pair)
                resp.alarms.add(memberID=r.memberID, alarm=r.alarm)
        elif r.action == rpc_pb2.AlarmRequest.DEACTIVATE:
            if pair in self.active:
                self.active.discard(pair)
                resp.alarms.add(memberID=r.memberID, alarm=r.alarm)
        else:
            for member_id, alarm in self.get(r.alarm):
                resp.alarms.add(memberID=member_id, alarm=alarm)
        return resp

    def export_state(self) -> list[tuple[int, int]]:
        return sorted(self.active)

    def restore_state(self, state: list[tuple[int, int]]) -> None:
        self.active = {(m, a) for m, a in state}
