"""Request/reply over linked etcd-key queues, with the PyPI `etcd3` client.

    PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python \\
        python examples/request_reply.py 127.0.0.1:2379 [--requests N] [--workers N]

(etcd3 0.12 ships protobuf modules generated for the old runtime, hence the
environment variable.)

Two roles share one queue server:

- **workers** consume the request queue `/q/requests`. A request's key segment is
  `{client_id}.{correlation_id}`: who asked and which question. A worker computes
  the answer and, in one Txn, produces it on the asking client's reply queue as
  `/q/reply-{client_id}/p/{correlation_id}` and acknowledges the request (deletes
  its delivery key). The Txn is guarded by the request still being there, so a
  request delivered twice (its first worker died after replying) is answered once.
- **the client** consumes its own reply queue `/q/reply-{client_id}` (its consumer
  id is its client id), puts its requests, and matches each reply to its request by
  the correlation id, the last segment of the reply's key.

Prints `reply {correlation_id} {answer}` per reply and a summary line; exits 0 when
every request got its answer in time.
"""

from __future__ import annotations

import argparse
import queue
import sys
import uuid
from collections.abc import Callable
from typing import Any

import etcd3  # type: ignore[import-untyped]

REQUESTS = "requests"


def start_worker(client: Any) -> Callable[[], None]:
    """Consume the request queue; returns a function that stops this worker."""

    def on_response(response: Any) -> None:
        if isinstance(response, Exception):  # the stream broke: etcd3 says so here
            print(f"worker: watch failed: {response}", file=sys.stderr)
            return
        for event in response.events:
            if not isinstance(event, etcd3.events.PutEvent):
                continue
            key = event.key.decode()  # /q/requests/{idx}/{client_id}.{correlation_id}
            client_id, correlation_id = key.rsplit("/", 1)[1].split(".", 1)
            answer = event.value.decode().upper()
            tx = client.transactions
            client.transaction(
                compare=[tx.version(key) > 0],  # still unacknowledged
                success=[
                    tx.put(f"/q/reply-{client_id}/p/{correlation_id}", answer),
                    tx.delete(key),  # the ack, atomic with the reply
                ],
                failure=[],
            )

    watch_id = client.add_watch_callback(f"/q/{REQUESTS}/c/{uuid.uuid4()}", on_response)
    return lambda: client.cancel_watch(watch_id)


def run_client(client: Any, count: int, timeout: float) -> int:
    """Send `count` requests and wait for their replies; returns how many matched."""
    client_id = str(uuid.uuid4())
    replies: queue.Queue[tuple[str, str]] = queue.Queue()

    def on_reply(response: Any) -> None:
        if isinstance(response, Exception):
            return
        for event in response.events:
            if isinstance(event, etcd3.events.PutEvent):
                key = event.key.decode()  # /q/reply-{client_id}/{idx}/{correlation_id}
                client.delete(key)  # the ack
                replies.put((key.rsplit("/", 1)[1], event.value.decode()))

    # consume the reply queue before asking, so no reply can wait for a consumer
    watch_id = client.add_watch_callback(f"/q/reply-{client_id}/c/{client_id}", on_reply)
    try:
        asked: dict[str, str] = {}
        for i in range(count):
            correlation_id = uuid.uuid4().hex
            question = f"question {i}"
            asked[correlation_id] = question
            client.put(f"/q/{REQUESTS}/p/{client_id}.{correlation_id}", question)
        matched = 0
        while matched < count:
            try:
                correlation_id, answer = replies.get(timeout=timeout)
            except queue.Empty:
                print(f"no reply within {timeout}s", file=sys.stderr)
                break
            question = asked.pop(correlation_id, "")
            if not question or answer != question.upper():
                print(f"unexpected reply {correlation_id} {answer!r}", file=sys.stderr)
                continue
            matched += 1
            print(f"reply {correlation_id} {answer}")
        return matched
    finally:
        client.cancel_watch(watch_id)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("endpoint", nargs="?", default="127.0.0.1:2379")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    host, port = args.endpoint.rsplit(":", 1)

    workers = [etcd3.client(host=host, port=int(port), timeout=10) for _ in range(args.workers)]
    stops = [start_worker(w) for w in workers]
    client = etcd3.client(host=host, port=int(port), timeout=10)
    try:
        matched = run_client(client, args.requests, args.timeout)
    finally:
        for stop in stops:
            stop()
        # no client.close(): etcd3 0.12's watch thread would reopen its stream on
        # the closed channel and print a traceback; the process ends here anyway
    ok = matched == args.requests
    print(
        f"{args.requests} requests, {matched} replies, " + ("all matched" if ok else "some missing")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
