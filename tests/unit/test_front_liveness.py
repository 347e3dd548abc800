"""A front's watch for another front's death (queue_server/front/liveness.py),
against a real listening socket in this process: a port that closes is death,
a live one is not, and an address that is not one is left to the lease."""

from __future__ import annotations

import asyncio

import pytest

from queue_server.front.liveness import PREFACE, split_address, watch_front

pytestmark = pytest.mark.unit

BOUND = 5.0


async def _serve(
    arrived: asyncio.Event,
) -> tuple[asyncio.Server, int, list[bytes], list[asyncio.StreamWriter]]:
    received: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        received.append(await reader.readexactly(len(PREFACE)))
        arrived.set()
        await reader.read()  # hold the connection until either side closes

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, port, received, writers


def test_an_address_is_host_and_port() -> None:
    assert split_address(b"127.0.0.1:2379") == ("127.0.0.1", 2379)
    assert split_address(b"[::1]:2379") == ("::1", 2379)
    assert split_address(b"no-port") is None
    assert split_address(b"host:") is None


async def test_a_front_whose_port_closes_is_dead_and_a_live_one_is_not() -> None:
    arrived = asyncio.Event()
    server, port, received, writers = await _serve(arrived)
    dead = asyncio.Event()

    async def on_dead() -> None:
        dead.set()

    watching = asyncio.ensure_future(watch_front(b"127.0.0.1:%d" % port, on_dead))
    try:
        async with asyncio.timeout(BOUND):
            await arrived.wait()  # the watcher's idle HTTP/2 connection
        assert received == [PREFACE]
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await dead.wait()  # alive: not dead
        server.close()  # the process dies: its port and connections close
        for writer in writers:
            writer.transport.abort()
        await server.wait_closed()
        async with asyncio.timeout(BOUND):
            await dead.wait()
        async with asyncio.timeout(BOUND):
            await watching  # it reports once, and ends
    finally:
        watching.cancel()


async def test_an_address_that_is_not_one_is_left_to_the_lease() -> None:
    async def on_dead() -> None:
        raise AssertionError("not a front's address: nothing to watch")

    async with asyncio.timeout(BOUND):
        await watch_front(b"nowhere", on_dead)
