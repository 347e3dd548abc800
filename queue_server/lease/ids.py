"""Server-chosen lease ids. The server makes one generator and hands it to
everything that picks lease ids (the Lease service, Lock/Election for requests
without a lease, the queue's delivery leases), so no two ever pick
the same id. It reads no clock: the node's wall clock (`Timers.wall_ms`) is
handed in and read once, to seed the ids."""

from __future__ import annotations

from collections.abc import Callable, Container


class LeaseIdGenerator:
    """Server-chosen lease ids in etcd's shape: the member id's low 16 bits, then
    a millisecond timestamp and a counter, kept positive and unique.
    `wall_ms` is the node's wall clock in Unix milliseconds: the timestamp is
    its reading when the generator is made."""

    def __init__(self, member_id: int, wall_ms: Callable[[], int]) -> None:
        self._prefix = (member_id & 0xFFFF) << 48
        self._suffix = (wall_ms() << 8) & ((1 << 48) - 1)

    def next(self, taken: Container[int]) -> int:
        while True:
            self._suffix = (self._suffix + 1) & ((1 << 48) - 1)
            lease_id = (self._prefix | self._suffix) & ((1 << 63) - 1)
            if lease_id and lease_id not in taken:
                return lease_id
