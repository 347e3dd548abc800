"""Telling that another front has died sooner than its session lease does.

What belongs here: `watch_front`. A front that waits to take a queue over, and
a dispatcher whose consumers sit on other fronts, hold an idle HTTP/2
connection to each such front's client port. When the connection drops, a new
one is tried at once: refused means no process listens there any more (a
SIGKILLed front's port is closed by its kernel at once), and the caller revokes
the dead front's session lease in etcd, which deletes its registry keys and
consumer registrations as the lease's expiry would, two seconds or more later.

Only a refusal counts as death. A timeout or an unreachable host may be a
partition from a live front, so then the lease alone decides, as before. A
wrong call costs no safety either way: a front whose lease is revoked loses its
dispatching (every dispatcher write is guarded by the registry key) and
registers its consumers again on a new lease (`session.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""The HTTP/2 client preface and an empty SETTINGS frame: the connection is an
ordinary idle one to the front's server, which keeps it open."""
RETRY_SECONDS = 1.0
"""Between attempts when the front could not be told alive or dead."""


def split_address(address: bytes) -> tuple[str, int] | None:
    """`host:port` as a front advertises it; None when it is not one."""
    host, colon, port = address.decode("ascii", "replace").rpartition(":")
    if not colon or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


async def watch_front(address: bytes, dead: Callable[[], Awaitable[None]]) -> None:
    """Until the front at `address` is seen dead, then await `dead()` once.
    Runs until cancelled otherwise."""
    where = split_address(address)
    if where is None:
        return  # nothing to watch: its lease decides
    host, port = where
    while True:
        opened = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except ConnectionRefusedError:
            log.warning("front at %s refuses connections: taking its lease back", address.decode())
            await dead()
            return
        except OSError:
            await asyncio.sleep(RETRY_SECONDS)  # unreachable: the lease decides
            continue
        try:
            writer.write(PREFACE)
            while await reader.read(65536):
                pass  # its SETTINGS, pings: nothing to answer on an idle connection
        except OSError:
            pass  # reset: ask again at once
        finally:
            writer.close()
        if time.monotonic() - opened < RETRY_SECONDS:
            await asyncio.sleep(RETRY_SECONDS / 5)  # it closes at once: do not spin
