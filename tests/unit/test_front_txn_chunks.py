"""The dispatcher's Txns over etcd (queue_server/front/dispatcher.py `txn_chunks`):
each one, with the guard and the meta key the dispatcher adds, passes etcd's own
checks (`kv/validation.py`, which follows etcd's checkTxnRequest: a nested Txn's
operations count against what the Txn around it leaves) and fits etcd's default
request size, whatever mix of hand-outs, acks and large messages it is cut from."""

from __future__ import annotations

from etcdserverpb import rpc_pb2
from queue_server.config import DEFAULT_MAX_REQUEST_BYTES
from queue_server.front.dispatcher import MAX_TXN_OPS, ack_txn, txn_chunks
from queue_server.front.session import put_op
from queue_server.kv import validation

GUARD = rpc_pb2.Compare(
    key=b"/q/jobs",
    target=rpc_pb2.Compare.VALUE,
    result=rpc_pb2.Compare.EQUAL,
    value=b"front-id@127.0.0.1:2379",
)


def as_sent(chunk: list[rpc_pb2.RequestOp]) -> rpc_pb2.TxnRequest:
    """A chunk as `Dispatcher._flush` sends it."""
    return rpc_pb2.TxnRequest(
        compare=[GUARD], success=[*chunk, put_op(b"/q/jobs/meta", b"%d" % 10**12)]
    )


def hand_out(i: int, value: bytes = b"v") -> rpc_pb2.RequestOp:
    return put_op(b"/q/jobs/c/consumer-1/%016d/k%d" % (i, i), value)


def ack(i: int) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(
        request_txn=ack_txn(
            b"/q/jobs/c/consumer-2/%016d/a%d" % (i, i), b"/q/jobs/%016d/a%d" % (i, i)
        )
    )


def check(ops: list[rpc_pb2.RequestOp]) -> list[list[rpc_pb2.RequestOp]]:
    chunks = txn_chunks(ops)
    assert [op for chunk in chunks for op in chunk] == ops  # all of them, in order
    for chunk in chunks:
        request = as_sent(chunk)
        validation.check_txn(request, MAX_TXN_OPS)  # raises what etcd would answer
        assert request.ByteSize() < DEFAULT_MAX_REQUEST_BYTES
    return chunks


def test_hand_outs_alone_fill_a_txn_up_to_etcds_operation_limit() -> None:
    chunks = check([hand_out(i) for i in range(300)])
    assert [len(c) for c in chunks] == [MAX_TXN_OPS - 1, MAX_TXN_OPS - 1, 46]


def test_a_full_txn_with_an_ack_in_it_leaves_the_ack_its_two_operations() -> None:
    # the case etcd refused: 126 hand-outs, an ack, the meta key (128 at the top
    # level), when the nested Txn may only have 128 - 128 operations
    ops = [hand_out(i) for i in range(126)] + [ack(0)] + [hand_out(i) for i in range(126, 200)]
    chunks = check(ops)
    assert len(chunks[0]) == 126  # the ack starts the next one
    assert chunks[1][0].HasField("request_txn")


def test_acks_and_hand_outs_mixed_in_any_order() -> None:
    ops = [ack(i) if i % 3 == 0 else hand_out(i) for i in range(1000)]
    check(ops)


def test_large_messages_are_spread_over_txns_under_etcds_request_size() -> None:
    big = b"x" * (300 * 1024)
    chunks = check([hand_out(i, big) for i in range(10)])
    assert len(chunks) > 1


def test_one_operation_over_the_byte_budget_goes_alone() -> None:
    huge = b"x" * (1100 * 1024)  # under etcd's 1.5 MiB, over MAX_TXN_BYTES
    chunks = txn_chunks([hand_out(0), hand_out(1, huge), hand_out(2)])
    assert [len(c) for c in chunks] == [1, 1, 1]
