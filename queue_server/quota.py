"""The space quota (etcd's --quota-backend-bytes) in front of the log.

`QuotaGuard` wraps the log's `propose`: a write whose cost would take the store's
size estimate over the quota is refused with `NoSpace`, and a NOSPACE alarm is
raised through the log (once), as etcd's quota check in its v3rpc layer does.
Costs are etcd's: a put counts its key and value plus 256 bytes, a txn the larger
of its two branches' puts, a lease grant 64 bytes.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import Proposer, StateMachine
from queue_server.errors import NoSpace
from queue_server.proposals import ApplyResult

DEFAULT_QUOTA_BYTES = 2 * 1024 * 1024 * 1024
"""etcd's default --quota-backend-bytes (2 GiB)."""
KV_OVERHEAD = 256
LEASE_OVERHEAD = 64


def _txn_cost(r: rpc_pb2.TxnRequest) -> int:
    def branch(ops: list[rpc_pb2.RequestOp]) -> int:
        total = 0
        for op in ops:
            kind = op.WhichOneof("request")
            if kind == "request_put":
                total += KV_OVERHEAD + len(op.request_put.key) + len(op.request_put.value)
            elif kind == "request_txn":
                total += _txn_cost(op.request_txn)
        return total

    return max(branch(list(r.success)), branch(list(r.failure)))


def cost(command: internal_pb2.Command) -> int:
    kind = command.WhichOneof("op")
    if kind == "put":
        put = command.put
        return KV_OVERHEAD + len(put.key) + len(put.value)
    if kind == "txn":
        return _txn_cost(command.txn)
    if kind == "lease_grant":
        return LEASE_OVERHEAD
    return 0


class QuotaGuard:
    """A `Proposer` that enforces the quota before proposing to `log`."""

    def __init__(
        self, log: Proposer, state: StateMachine, quota_bytes: int, member_id: int
    ) -> None:
        self.log = log
        self.state = state
        self.quota_bytes = quota_bytes
        self.member_id = member_id

    @property
    def last_index(self) -> int:
        return self.log.last_index

    async def linearize(self) -> None:
        await self.log.linearize()

    def used_bytes(self) -> int:
        return self.state.store.size_bytes + LEASE_OVERHEAD * len(self.state.lessor.leases)

    def propose(self, command: internal_pb2.Command) -> Coroutine[Any, Any, ApplyResult]:
        """The log's proposal of `command`, or the refusal, to await. A plain
        function handing on the log's coroutine: no coroutine of its own per write."""
        if self.quota_bytes > 0:
            c = cost(command)
            if c and self.used_bytes() + c > self.quota_bytes:
                return self._refuse()
        return self.log.propose(command)

    async def _refuse(self) -> ApplyResult:
        if not self.state.alarms.no_space:
            alarm = internal_pb2.Command()
            alarm.alarm.action = rpc_pb2.AlarmRequest.ACTIVATE
            alarm.alarm.memberID = self.member_id
            alarm.alarm.alarm = rpc_pb2.NOSPACE
            await self.log.propose(alarm)
        raise NoSpace()
