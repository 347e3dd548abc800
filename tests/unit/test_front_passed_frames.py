"""`PassedFrames` (queue_server/front/cqs.py): a ReEnqueue a front passes on, sent again
whole to a new dispatching front, in order, with nothing lost to the failed attempt's
request iterator that is still waiting for the client's next frame. In-process, over the
real `Frames` reader; every wait is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from etcdserverpb import cqs_pb2
from queue_server.api.cqs import Frames
from queue_server.front import cqs as front_cqs
from queue_server.front.cqs import PassedFrames

pytestmark = pytest.mark.unit

WAIT = 5.0


def item(n: int) -> cqs_pb2.ReEnqueueRequest:
    return cqs_pb2.ReEnqueueRequest(item=cqs_pb2.SplitItem(dto_type="t.v1", dto_id=f"d/{n}"))


FOOTER = cqs_pb2.ReEnqueueRequest(footer=cqs_pb2.ReEnqueueRequest.Footer())


class Client:
    """The client's side of the stream: frames sent when the test says."""

    def __init__(self) -> None:
        self.sent: asyncio.Queue[cqs_pb2.ReEnqueueRequest | None] = asyncio.Queue()

    async def frames(self) -> AsyncIterator[cqs_pb2.ReEnqueueRequest]:
        while (frame := await self.sent.get()) is not None:
            yield frame

    def send(self, *frames: cqs_pb2.ReEnqueueRequest | None) -> None:
        for frame in frames:
            self.sent.put_nowait(frame)


async def take(frames: AsyncIterator[cqs_pb2.ReEnqueueRequest], n: int) -> list[str]:
    got = []
    for _ in range(n):
        frame = await asyncio.wait_for(anext(frames), WAIT)
        got.append(frame.item.dto_id or frame.WhichOneof("payload") or "")
    return got


async def test_a_second_attempt_sends_everything_again_and_then_the_rest_in_order() -> None:
    client = Client()
    stream = Frames(client.frames())
    passed = PassedFrames(stream)
    try:
        client.send(item(0), item(1))
        first = passed.attempt()
        assert await take(first, 2) == ["d/0", "d/1"]
        # the first attempt's call fails while its iterator waits for the next frame
        waiting = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0)
        assert passed.may_send_again()
        second = passed.attempt()
        assert await take(second, 2) == ["d/0", "d/1"]
        client.send(item(2), item(3), FOOTER, None)
        # the frame the old iterator was waiting for goes to the new attempt, in its place
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, WAIT)
        assert await take(second, 3) == ["d/2", "d/3", "footer"]
        assert not passed.may_send_again()  # the Footer went: no third attempt
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(second), WAIT)
    finally:
        passed.close()
        stream.close()


async def test_a_stream_longer_than_the_cap_is_passed_on_but_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(front_cqs, "REPLAY_FRAMES", 3)
    client = Client()
    stream = Frames(client.frames())
    passed = PassedFrames(stream)
    try:
        attempt = passed.attempt()
        client.send(*(item(n) for n in range(5)), None)
        assert await take(attempt, 5) == [f"d/{n}" for n in range(5)]
        assert not passed.may_send_again()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(attempt), WAIT)
    finally:
        passed.close()
        stream.close()
