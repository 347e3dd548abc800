"""`Frames` (queue_server/api/cqs.py), the ReEnqueue stream's reader: a partial
batch taken when its flush is due never overtakes a full batch already queued.

The race it guards: the reader waits for the next batch with a timeout (the
partial batch's flush time). When the loop runs late, the timeout and a full
batch arrive in the same loop turn; the wait is then cancelled with the batch
left in the queue, and the partial batch behind it must not be flushed first.
uvloop, the server's loop, runs the expired timer before the reading task, which
is the order that showed it (items 1000-1999 of a split dequeued before 0-999).
A busy loop is modelled by blocking it past the timeout; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from etcdserverpb import cqs_pb2
from queue_server.api.cqs import FLUSH_ITEMS, FLUSH_SECONDS, Frames

pytestmark = pytest.mark.unit

WAIT = 5.0
BURST = FLUSH_ITEMS + 5
"""One full batch, and a partial batch begun behind it."""


def item(n: int) -> cqs_pb2.ReEnqueueRequest:
    return cqs_pb2.ReEnqueueRequest(item=cqs_pb2.SplitItem(dto_type="t.v1", dto_id=f"d/{n}"))


FOOTER = cqs_pb2.ReEnqueueRequest(footer=cqs_pb2.ReEnqueueRequest.Footer())


async def items_in_the_order_read() -> list[str]:
    go = asyncio.Event()

    async def client() -> AsyncIterator[cqs_pb2.ReEnqueueRequest]:
        yield item(0)  # a partial batch begins: its flush is due in FLUSH_SECONDS
        await go.wait()
        for n in range(1, BURST):  # read in one go, as buffered frames are
            yield item(n)
        await asyncio.sleep(FLUSH_SECONDS)  # the client pauses, a partial batch begun
        yield FOOTER

    def loop_runs_late() -> None:
        go.set()
        time.sleep(FLUSH_SECONDS * 1.5)  # past the reader's timeout, the client's frames ready

    stream = Frames(client())
    loop = asyncio.get_running_loop()
    # from a ready callback, so the client's wakeup waits for the next loop turn,
    # whose timers run first
    loop.call_later(FLUSH_SECONDS / 4, loop.call_soon, loop_runs_late)
    try:

        async def read() -> list[str]:
            return [f.item.dto_id or "footer" async for f in stream.rest()]

        return await asyncio.wait_for(read(), WAIT)
    finally:
        stream.close()


def new_uvloop() -> asyncio.AbstractEventLoop:
    uvloop = pytest.importorskip("uvloop", reason="uvloop is the server's loop on Linux")
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


@pytest.mark.parametrize(
    "loop_factory", [new_uvloop, asyncio.new_event_loop], ids=["uvloop", "asyncio"]
)
def test_a_due_partial_batch_never_overtakes_a_queued_full_one(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        got = runner.run(items_in_the_order_read())
    assert got == [f"d/{n}" for n in range(BURST)] + ["footer"]
