"""A queue consumer in its own process, for the redelivery test.

    python tests/integration/queue_consumer.py ENDPOINT CONSUMER_KEY ACK_FIRST

Watches CONSUMER_KEY (`/q/{name}/c/{uuid}`), acknowledges the first ACK_FIRST
messages it receives and keeps every later one unacknowledged. Prints one line per
step, flushed at once, so the test can follow it without sleeping:

    ready                    the watch is created (the consumer is registered)
    got KEY                  a delivery (KEY is the message key)
    acked KEY                its delete has been applied

It runs until it is killed, or exits by itself after LIFETIME_SECONDS so that it
can never outlive a failed test.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator

import grpc

from etcdserverpb import rpc_pb2, rpc_pb2_grpc

LIFETIME_SECONDS = 60.0


def say(*words: str) -> None:
    sys.stdout.write(" ".join(words) + "\n")
    sys.stdout.flush()


def main(endpoint: str, consumer_key: bytes, ack_first: int) -> None:
    requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()

    def request_iter() -> Iterator[rpc_pb2.WatchRequest]:
        while (req := requests.get()) is not None:
            yield req

    with grpc.insecure_channel(endpoint) as channel:
        kv = rpc_pb2_grpc.KVStub(channel)
        responses = rpc_pb2_grpc.WatchStub(channel).Watch(request_iter(), timeout=LIFETIME_SECONDS)
        timer = threading.Timer(LIFETIME_SECONDS, responses.cancel)
        timer.daemon = True
        timer.start()
        requests.put(
            rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=consumer_key))
        )
        acked = 0
        try:
            for resp in responses:
                if resp.created:
                    say("ready")
                for ev in resp.events:
                    key = ev.kv.key.decode()
                    say("got", key)
                    if acked < ack_first:
                        kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=ev.kv.key), timeout=10)
                        acked += 1
                        say("acked", key)
        except grpc.RpcError:
            pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]))
