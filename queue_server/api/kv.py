"""The etcdserverpb.KV service: Range, Put, DeleteRange, Txn, Compact.

Every handler has etcd's four steps: validate (stateless checks: etcd's, then
the queue keyspace's of what a put writes), call the core (a read on the state
machine, or a proposal through the log), turn a core error into etcd's status,
fill the header.
"""

from __future__ import annotations

from collections.abc import Callable

from etcdserverpb import internal_pb2, rpc_pb2, rpc_pb2_grpc
from queue_server.api.errors import abort, propose_or_abort
from queue_server.api.header import HeaderFiller
from queue_server.apply import Proposer, StateMachine
from queue_server.errors import EtcdError
from queue_server.kv import validation
from queue_server.kv.executor import is_read_only
from queue_server.transport.methods import Call

Command = internal_pb2.Command


class KVService(rpc_pb2_grpc.KVServicer):
    """Serves KV: reads from the state machine, writes through the log."""

    def __init__(
        self,
        state: StateMachine,
        log: Proposer,
        header: HeaderFiller,
        max_txn_ops: int,
        wall_ms: Callable[[], int],
    ) -> None:
        self.state = state
        self.log = log
        self.header = header
        self.max_txn_ops = max_txn_ops
        self.wall_ms = wall_ms
        """The node's wall clock (`Timers.wall_ms`): the stamp of a write."""

    async def Range(self, request: rpc_pb2.RangeRequest, context: Call) -> rpc_pb2.RangeResponse:
        try:
            validation.check_range(request)
            if not request.serializable:
                await self.log.linearize()
            resp = self.state.read_range(request)
        except EtcdError as e:
            await abort(context, e)
        self.header.fill(resp.header)
        return resp

    async def Put(self, request: rpc_pb2.PutRequest, context: Call) -> rpc_pb2.PutResponse:
        try:
            validation.check_put(request)
            self.state.router.check_write(request.key, request.value)
        except EtcdError as e:
            await abort(context, e)
        # Stamped with this member's clock: a put on a producer key is a message
        # produced now, and its produce time is replicated state.
        command = Command(put=request, now_ms=self.wall_ms())
        return await propose_or_abort(self.log, command, context, self.header, rpc_pb2.PutResponse)

    async def DeleteRange(
        self, request: rpc_pb2.DeleteRangeRequest, context: Call
    ) -> rpc_pb2.DeleteRangeResponse:
        try:
            validation.check_delete(request)
        except EtcdError as e:
            await abort(context, e)
        # Stamped with this member's clock: a delete of a CQS delivery key
        # acknowledges it in apply, which times the token out with it.
        command = Command(delete_range=request, now_ms=self.wall_ms())
        return await propose_or_abort(
            self.log, command, context, self.header, rpc_pb2.DeleteRangeResponse
        )

    async def Txn(self, request: rpc_pb2.TxnRequest, context: Call) -> rpc_pb2.TxnResponse:
        try:
            validation.check_txn(request, self.max_txn_ops, self.state.router.check_write)
            if is_read_only(request):
                await self.log.linearize()
                resp = self.state.read_txn(request)
                self.header.fill(resp.header)
                return resp
        except EtcdError as e:
            await abort(context, e)
        # its deletes may acknowledge, and its puts produce, at the Txn's time
        command = Command(txn=request, now_ms=self.wall_ms())
        return await propose_or_abort(self.log, command, context, self.header, rpc_pb2.TxnResponse)

    async def Compact(
        self, request: rpc_pb2.CompactionRequest, context: Call
    ) -> rpc_pb2.CompactionResponse:
        return await propose_or_abort(
            self.log, Command(compaction=request), context, self.header, rpc_pb2.CompactionResponse
        )
