"""A consumer of an etcd-key queue for tests: a watch on `/q/{queue}/c/{uuid}` in
a thread of its own, whose deliveries (the delivered keys) land in a queue."""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Iterator

import grpc

from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc

LIFETIME = 120.0
"""Longest a consumer's stream stays open if the test never closes it."""


class WatchConsumer:
    """Opens the watch at once; `deliveries` fills as messages arrive."""

    def __init__(self, channel: grpc.Channel, name: str) -> None:
        self.key = f"/q/{name}/c/{uuid.uuid4()}".encode()
        self.deliveries: queue.Queue[bytes] = queue.Queue()
        self._stop = threading.Event()
        self._stream = rpc_pb2_grpc.WatchStub(channel).Watch(self._requests())
        threading.Thread(target=self._run, daemon=True).start()

    def _requests(self) -> Iterator[rpc_pb2.WatchRequest]:
        yield rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=self.key))
        self._stop.wait(LIFETIME)

    def _run(self) -> None:
        try:
            for resp in self._stream:
                for ev in resp.events:
                    if ev.type == kv_pb2.Event.PUT:
                        self.deliveries.put(ev.kv.key)
        except grpc.RpcError:
            pass  # closed by the test, or the server went away

    def close(self) -> None:
        self._stop.set()
        self._stream.cancel()
