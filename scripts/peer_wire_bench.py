"""CPU cost per raft message (and per request) of the peer wire, against the old gRPC path.

    PYTHONPATH=$PWD python scripts/peer_wire_bench.py [--messages N] [--size B] [--loop uvloop|asyncio]

Two members in one process, one event loop: member 1 sends N raft messages of
`--size` bytes to member 2, in windows of W messages (send W, wait until all W
arrived, repeat). W=1 is a lightly loaded leader (every message its own frame),
larger W a busy one (messages coalesce into batches). Then member 1 sends
sequential requests and waits for each answer. The figure is the process's CPU
time (all threads: grpc's included) divided by the messages or requests, for
`queue_server.replication.peer_wire.PeerTransport` and for the old
`queue_server.replication.peer_transport.PeerClients` on a grpc.aio server.
Not run in CI: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from grpc import aio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from etcdserverpb import peer_pb2
from queue_server.replication.peer_transport import PeerClients, peer_handler
from queue_server.replication.peer_wire import PeerTransport

WINDOWS = (1, 16, 256)
WARMUP = 500


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Counter:
    """Counts delivered messages and wakes the bench when a target is reached."""

    def __init__(self) -> None:
        self.count = 0
        self.target = 0
        self.reached: asyncio.Future[None] | None = None

    def deliver(self, messages: list[bytes]) -> None:
        self.count += len(messages)
        if self.reached is not None and self.count >= self.target and not self.reached.done():
            self.reached.set_result(None)

    async def until(self, target: int) -> None:
        if self.count >= target:
            return
        self.target = target
        self.reached = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(self.reached, 30)

    async def answer(self, request: peer_pb2.Request) -> peer_pb2.Answer:
        return peer_pb2.Answer(placed=peer_pb2.Placed(index=1, term=1))


Send = Callable[[bytes], None]
Ask = Callable[[], Awaitable[object]]


async def run_messages(send: Send, counter: Counter, n: int, window: int, size: int) -> float:
    """CPU µs per message for n messages sent in windows of `window`."""
    message = bytes(size)
    for _ in range(WARMUP // window + 1):
        for _ in range(window):
            send(message)
        await counter.until(counter.count + window)
    start = time.process_time()
    base = counter.count
    sent = 0
    while sent < n:
        for _ in range(window):
            send(message)
        sent += window
        await counter.until(base + sent)
    return (time.process_time() - start) / sent * 1e6


async def run_requests(ask: Ask, n: int) -> float:
    for _ in range(WARMUP // 10):
        await ask()
    start = time.process_time()
    for _ in range(n):
        await ask()
    return (time.process_time() - start) / n * 1e6


async def bench_wire(n: int, size: int, requests: int) -> dict[str, float]:
    counter = Counter()
    receiver = PeerTransport(2, counter)
    sender = PeerTransport(1, Counter())
    port = free_port()
    await receiver.serve([f"http://127.0.0.1:{port}"], None)
    sender.set_peer(2, f"http://127.0.0.1:{port}")
    try:
        out = {
            f"W={w}": await run_messages(lambda m: sender.send(2, m), counter, n, w, size)
            for w in WINDOWS
        }

        def ask() -> Awaitable[peer_pb2.Answer]:
            request = peer_pb2.Request(propose=peer_pb2.Proposal(command=b"x" * 100))
            return sender.request(2, request, 10.0)

        out["request"] = await run_requests(ask, requests)
        assert sender.dropped == 0
        return out
    finally:
        await sender.close()
        await receiver.close()


async def bench_grpc(n: int, size: int, requests: int) -> dict[str, float]:
    counter = Counter()
    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def forward(command: bytes) -> bytes:
        return b"P" + bytes(16)

    port = free_port()
    server = aio.server()
    server.add_generic_rpc_handlers((peer_handler(counter.deliver, forward),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    clients = PeerClients(spawn)
    clients.set_peer(2, f"http://127.0.0.1:{port}")
    try:
        out = {
            f"W={w}": await run_messages(lambda m: clients.send(2, m), counter, n, w, size)
            for w in WINDOWS
        }
        out["request"] = await run_requests(lambda: clients.forward(2, b"P" + b"x" * 100), requests)
        return out
    finally:
        await clients.close()
        await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--size", type=int, default=200, help="bytes per raft message")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args()
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if args.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    results = {}
    for name, bench in (("peer_wire", bench_wire), ("grpc", bench_grpc)):
        with asyncio.Runner(loop_factory=factory) as runner:
            results[name] = runner.run(bench(args.messages, args.size, args.requests))
    print(f"loop={args.loop} messages={args.messages} size={args.size} requests={args.requests}")
    print("CPU µs per raft message (window W) and per request round trip")
    columns = list(results["peer_wire"])
    print(f"{'':>10}" + "".join(f"{c:>10}" for c in columns))
    for name, row in results.items():
        print(f"{name:>10}" + "".join(f"{row[c]:>10.1f}" for c in columns))
    print(
        f"{'ratio':>10}"
        + "".join(f"{results['grpc'][c] / results['peer_wire'][c]:>9.1f}x" for c in columns)
    )


if __name__ == "__main__":
    main()
