"""Which backend member leads, so that the front's unary calls go to it.

What belongs here: `LeaderPreference`, one task that asks every member named
by `--backend-endpoints` for its Status each LEADER_POLL_SECONDS, and moves
the front's unary pool (`h2_client.UnaryPool.move_to`) to the member that says
it leads; and `leading`, the choice made from the answers. It must not import
the forwarding or the queues: they only use the pool.

Why. etcd proposes every write on its leader: a follower that receives a Put
forwards the proposal to the leader and waits for it to be applied, and a
linearizable read on a follower first asks the leader for a read index. Over
a 3-member etcd a put behind a front on a follower cost etcd 277-281 µs of CPU,
behind a front on the leader 208-212 µs (docs/benchmarks.md, "Over a 3-member
etcd"). clientv3 and grpc-proxy spread calls over the members instead; a
front has one job, carrying calls to etcd, and does better by taking them to
the member that does the work.

Theory. Each member is asked on a connection of its own (a one-connection
pool per address), so a leader that stopped answering is not asked through the
very connection that hangs: the members that answer name the new leader, and
the pool moves within a poll or two of the election. The pool moves only once
a connection to the leader is open, so a leader the front cannot reach changes
nothing. While no member that answers says it leads (an election, or a leader
outside `--backend-endpoints`), the pool stays where it is. Streams (watches,
keepalives, snapshots) stay on grpcio's channel (`upstream.py`): any member
serves them without a hop to the leader for each message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence

from grpc import aio

from etcdserverpb import rpc_pb2
from queue_server.front.h2_client import CallError, UnaryPool

log = logging.getLogger(__name__)

LEADER_POLL_SECONDS = 1.0
"""How often every member is asked who leads. etcd elects in one to two
election timeouts (1 s by default); a poll a second costs each member one
Status call a second, and finds a new leader about as soon as it exists."""
STATUS_TIMEOUT = 1.0
"""How long one member's Status may take before it counts as no answer."""
STATUS_PATH = "/etcdserverpb.Maintenance/Status"


def leading(answers: dict[str, rpc_pb2.StatusResponse]) -> str | None:
    """The address, of those that answered, whose member says it leads; of two
    that both say so (an old leader cut off from its peers but not from us),
    the one of the later raft term. None: no answering member leads."""
    best: tuple[int, str] | None = None
    for address, status in answers.items():
        if status.leader == 0 or status.leader != status.header.member_id:
            continue
        if best is None or status.raftTerm > best[0]:
            best = (status.raftTerm, address)
    return None if best is None else best[1]


class LeaderPreference:
    """Keeps the front's unary pool on the backend's leader."""

    def __init__(
        self,
        pool: UnaryPool,
        tls: ssl.SSLContext | None,
        server_hostname: str | None,
        metadata: Callable[[], Awaitable[Sequence[tuple[str, str]]]],
    ) -> None:
        self.pool = pool
        self.metadata = metadata
        """The front's own credentials, when the backend has auth."""
        self.probes = {
            address: UnaryPool([address], tls, server_hostname, connections=1)
            for address in pool.addresses
        }
        self.leader: str | None = None
        """The leader's address the pool was last moved to."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Poll, when there is more than one member to choose from."""
        if len(self.probes) > 1 and self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for probe in self.probes.values():
            await probe.close()

    async def _run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(LEADER_POLL_SECONDS)

    async def poll(self) -> str | None:
        """Ask every member once; move the pool to the one that leads. The
        address the pool is on after it, if a leader was found."""
        try:
            metadata = await self.metadata()
        except aio.AioRpcError as e:  # the backend is away: ask again next time
            log.debug("no credentials for the leader poll: %s", e.details())
            return None
        addresses = list(self.probes)
        replies = await asyncio.gather(*(self._status(address, metadata) for address in addresses))
        answers = {a: r for a, r in zip(addresses, replies, strict=True) if r is not None}
        address = leading(answers)
        if address is None or not await self.pool.move_to(address):
            return None
        if address != self.leader:
            log.info("front's unary calls go to the backend's leader address=%s", address)
            self.leader = address
        return address

    async def _status(
        self, address: str, metadata: Sequence[tuple[str, str]]
    ) -> rpc_pb2.StatusResponse | None:
        try:
            raw = await self.probes[address].call(STATUS_PATH, b"", metadata, STATUS_TIMEOUT)
        except CallError:
            return None
        return rpc_pb2.StatusResponse.FromString(raw)
