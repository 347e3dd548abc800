"""The replicated lease table: which leases exist, their TTLs, the keys attached.

Part of the state machine, so deterministic: it never reads the clock. When a lease
*expires* is decided by `queue_server.lease.expiry` on the node that reads the
clock, which then proposes a revoke like a client would.

Keys are attached and detached by following the store's committed events: a put
with a lease attaches its key, and any change of a key detaches it from the lease
its previous version had. So every path that changes keys (Put, Txn, DeleteRange,
a revoke's own deletes) keeps the table right without knowing about leases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from queue_server.errors import LeaseExists, LeaseNotFound, LeaseTTLTooLarge
from queue_server.mvcc.store import Event, MVCCStore

MAX_LEASE_TTL = 9_000_000_000
"""etcd's MaxLeaseTTL, in seconds."""
MIN_LEASE_TTL = 2
"""etcd's minimum TTL with default timing: 1.5 election timeouts, rounded up."""


@dataclass(slots=True)
class Lease:
    lease_id: int
    ttl: int
    keys: set[bytes] = field(default_factory=set)


class Lessor:
    """Leases of the state machine. `take_changes()` gives the grants and
    revokes since it was last called (effects of a command, for the node's
    expiry clock)."""

    def __init__(self) -> None:
        self.leases: dict[int, Lease] = {}
        self._granted: list[tuple[int, int]] = []
        self._revoked: list[int] = []

    def take_changes(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(lease id, TTL) granted and lease ids revoked, since the last call."""
        if not self._granted and not self._revoked:
            return [], []
        out = self._granted, self._revoked
        self._granted, self._revoked = [], []
        return out

    def exists(self, lease_id: int) -> bool:
        return lease_id in self.leases

    def grant(self, lease_id: int, ttl: int) -> Lease:
        if lease_id in self.leases:
            raise LeaseExists()
        if ttl > MAX_LEASE_TTL:
            raise LeaseTTLTooLarge()
        lease = Lease(lease_id, max(ttl, MIN_LEASE_TTL))
        self.leases[lease_id] = lease
        self._granted.append((lease_id, lease.ttl))
        return lease

    def revoke(self, lease_id: int, store: MVCCStore) -> int:
        """Delete the lease's keys in one revision, then the lease; returns the
        store's revision afterwards."""
        lease = self.leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound()
        with store.write() as txn:
            for key in sorted(lease.keys):
                txn.delete_range(key, None)
        del self.leases[lease_id]
        self._revoked.append(lease_id)
        return store.revision

    def follow(self, revision: int, events: list[Event]) -> None:
        """Store hook: keep attached keys in step with committed changes."""
        leases = self.leases
        for e in events:
            prev = e.prev_kv
            if prev is not None and prev.lease:
                lease = leases.get(prev.lease)
                if lease is not None:
                    lease.keys.discard(prev.key)
            if not e.is_delete and e.kv.lease:
                lease = leases.get(e.kv.lease)
                if lease is not None:
                    lease.keys.add(e.kv.key)

    # -- snapshots ------------------------------------------------------------

    def export_state(self) -> list[tuple[int, int]]:
        return [(lease.lease_id, lease.ttl) for lease in self.leases.values()]

    def restore_state(self, state: list[tuple[int, int]], store: MVCCStore) -> None:
        """Rebuild the table; attached keys come from the store's current keys."""
        self.leases = {lease_id: Lease(lease_id, ttl) for lease_id, ttl in state}
        for key, lease_id in store.leased_keys():
            lease = self.leases.get(lease_id)
            if lease is not None:
                lease.keys.add(key)
