"""One node's core in-process: state machine, applier, node driver and its parts,
over an in-memory log and a fake clock.

The parts are the server's own (`Delivery`, `ConsumerDirectory`, `WatchHub`,
`CqsWatchConsumers`, `AckPolicy`, `ExpiryPolicy`, `VisibilityTimer`, `Timers`);
only the log (a list, applied at once) and the clock (`FakeClock`, advanced by
the test; both the monotonic and the wall face of `Timers`) stand in for the
disk and time. Proposals run as asyncio tasks, so they interleave
as they do in the server; `settle()` runs the loop until nothing is left to do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import Applier, Effects, StateMachine
from queue_server.cqs.visibility import VisibilityTimer
from queue_server.cqs.watch_view import CqsWatchConsumers
from queue_server.lease.expiry import ExpiryClock, ExpiryPolicy
from queue_server.mq.ack_policy import AckPolicy
from queue_server.mq.delivery import Delivery
from queue_server.mvcc.store import MVCCStore
from queue_server.node.consumers import ConsumerDirectory
from queue_server.node.driver import NodeDriver, NodeParts
from queue_server.node.timers import Timers
from queue_server.proposals import ApplyResult
from queue_server.watch.hub import WatchHub, WatchStream

Command = internal_pb2.Command
NODE = b"node-a"


class FakeClock:
    """Seconds, moved only by `advance`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class MemoryLog:
    """A log that keeps every command's bytes and applies it when proposed."""

    def __init__(self, applier: Applier) -> None:
        self.applier = applier
        self.entries: list[bytes] = []

    async def propose(self, command: Command) -> ApplyResult:
        await asyncio.sleep(0)  # as a real log: other proposals may come first
        self.entries.append(command.SerializeToString())
        result = self.applier.apply(len(self.entries), command)
        self.applier.batch_applied()  # a batch of one
        return result

    def apply_batch(self, commands: list[Command]) -> list[ApplyResult]:
        """Append and apply several commands as one batch (one group commit)."""
        results = []
        for command in commands:
            self.entries.append(command.SerializeToString())
            results.append(self.applier.apply(len(self.entries), command))
        self.applier.batch_applied()
        return results

    @property
    def last_index(self) -> int:
        return len(self.entries)

    async def linearize(self) -> None:
        return None


class Node:
    """A node with its parts wired as `Server.start` wires them."""

    def __init__(self, clock: FakeClock | None = None, lease_ids: int = 0x1000) -> None:
        self.clock = clock or FakeClock()
        self.state = StateMachine()
        self.timers = Timers(self.clock, self.clock)
        self.driver = NodeDriver(self.timers)
        self.effects: list[Effects] = []
        self.applier = Applier(self.state, self)
        self.log = MemoryLog(self.applier)
        self.tasks: set[asyncio.Task[None]] = set()
        self.expiry = ExpiryClock(self.clock)
        self._next_lease = lease_ids
        self.delivery = Delivery(
            self.store_of,
            self.state.queues,
            NODE,
            self.log.propose,
            self.spawn,
            self.clock,
            new_lease_id=self.new_lease_id,
        )
        self.cqs_view = CqsWatchConsumers(
            self.state.cqs,
            self.store_of,
            self.log.propose,
            self.spawn,
            60.0,
            self.clock,
            self.timers.wall_ms,
        )
        self.consumers = ConsumerDirectory(
            self.state.queues,
            self.state.cqs,
            self.delivery,
            self.cqs_view,
            self.store_of,
            self.log.propose,
            self.spawn,
        )
        self.hub = WatchHub(self.store_of, 1 << 20, consumers=self.consumers)
        self.driver.start(
            NodeParts(
                self.hub, self.consumers, self.delivery, (self.cqs_view.on_change,), self.expiry
            )
        )
        self.revoked: list[int] = []
        self.timers.add("queue-acks", AckPolicy(self.delivery, self.hub))
        self.timers.add("lease-expiry", ExpiryPolicy(self.expiry, self._revoke, self.spawn))
        self.timers.add("cqs-visibility", self.cqs_view)
        self.cqs_expiry = VisibilityTimer(
            self.state.cqs, self.log.propose, self.spawn, self.timers.wall_ms
        )
        self.timers.add("cqs-expiry", self.cqs_expiry)

    def applied(self, effects: Effects) -> None:
        """The applier's sink: recorded, then the driver's."""
        self.effects.append(effects)
        self.driver.applied(effects)

    def batch_applied(self) -> None:
        self.driver.batch_applied()

    def store_of(self) -> MVCCStore:
        return self.state.store

    def new_lease_id(self) -> int:
        self._next_lease += 1
        return self._next_lease

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _revoke(self, lease_id: int) -> None:
        self.revoked.append(lease_id)
        await self.log.propose(Command(lease_revoke=rpc_pb2.LeaseRevokeRequest(ID=lease_id)))

    async def settle(self, rounds: int = 200) -> None:
        """Run the loop until no proposal is pending (bounded)."""
        for _ in range(rounds):
            await asyncio.sleep(0)
            if not self.tasks:
                return
        raise AssertionError(f"still busy after {rounds} loop turns: {self.tasks}")

    async def tick(self, seconds: float) -> None:
        """Move the clock, run the timer policies that are due, settle."""
        self.timers.run_due(self.clock.advance(seconds))
        await self.settle()

    async def put(self, key: bytes, value: bytes = b"v", lease: int = 0) -> ApplyResult:
        """A client's Put, stamped with the clock as the KV service stamps it."""
        return await self.log.propose(
            Command(
                put=rpc_pb2.PutRequest(key=key, value=value, lease=lease),
                now_ms=self.timers.wall_ms(),
            )
        )

    async def delete(self, key: bytes) -> ApplyResult:
        """A client's DeleteRange, stamped as the KV service stamps it."""
        return await self.log.propose(
            Command(delete_range=rpc_pb2.DeleteRangeRequest(key=key), now_ms=self.timers.wall_ms())
        )

    def watch(self, key: bytes) -> WatchStream:
        """A watch stream with one watch on exactly `key` (its outbox is what a
        client would read)."""
        stream = self.hub.open_stream(lambda: None)
        self.hub.create(stream, rpc_pb2.WatchCreateRequest(key=key))
        return stream


def drain(stream: WatchStream) -> list[rpc_pb2.WatchResponse]:
    """Everything the stream would send now (its client reads it all)."""
    out = []
    while stream.outbox:
        out.append(stream.pop())
    return out


def delivered_keys(stream: WatchStream) -> list[bytes]:
    return [e.kv.key for r in drain(stream) for e in r.events]


def replay(
    entries: list[bytes], state: StateMachine | None = None, start: int = 0
) -> tuple[StateMachine, list[Effects]]:
    """A fresh state machine (or `state`) fed entries[start:] at their indexes,
    and the effects of those that had any."""
    sm = state if state is not None else StateMachine()
    effects = []
    for i, data in enumerate(entries[start:], start + 1):
        _result, e = sm.apply(i, Command.FromString(data))
        if e:
            effects.append(e)
    return sm, effects


def describe(effects: list[Effects]) -> list[tuple[Any, ...]]:
    """Effects as plain values, to compare two runs."""
    return [
        (
            [
                (rev, [(e.is_delete, e.kv.key, e.kv.value, e.kv.lease) for e in events])
                for rev, events in fx.commits
            ],
            [(a.queue, a.consumer, a.node, a.items) for a in fx.assignments],
            fx.released,
            sorted(fx.cqs_changed),
            fx.leases_granted,
            fx.leases_revoked,
            fx.members_changed,
        )
        for fx in effects
    ]
