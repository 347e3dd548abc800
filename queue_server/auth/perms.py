"""The permission checker: may this user do this request?

Every service asks here; none decides alone. Each check returns None when the
request is allowed and raises the etcd error otherwise:

- auth disabled: everything is allowed (the checks return at once);
- no user (no token, no client certificate): `etcdserver: user name is empty`;
- a user holding the root role: everything is allowed;
- otherwise the request's key range must lie inside the union of the user's
  roles' READ (or WRITE) ranges, else `etcdserver: permission denied`.

Ranges follow etcd's conventions (server/auth/range_perm_cache.go): an empty
range_end is the key alone, range_end b"\\0" is every key from `key` on, else
[key, range_end). A request is allowed only if its whole range is covered, by one
permission or by several adjacent ones.

What each RPC needs (see docs/auth.md for the table): Range READ; Put WRITE (and
READ with prev_kv, and WRITE on every key already attached to its lease);
DeleteRange WRITE (and READ with prev_kv); Txn READ on every compare and the
union of its ops' needs, nested txns included; Watch READ on its range; LeaseRevoke
WRITE on every attached key; Lock and Election READ+WRITE on the `name/` prefix;
CQS READ+WRITE on the queue's `/q/{queue_name}/` prefix; admin operations the root
role.

No I/O, no grpc; the per-user merged ranges are cached until the store changes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from etcdserverpb import rpc_pb2
from queue_server.auth import errors
from queue_server.auth.store import READ, READWRITE, WRITE, AuthStore
from queue_server.errors import EtcdError

Interval = tuple[bytes, bytes | None]
"""[start, end); end None is unbounded."""
LeaseKeys = Callable[[int], Iterable[bytes]]
"""The keys attached to a lease id (none for 0 or an unknown lease)."""


def request_interval(key: bytes, range_end: bytes) -> Interval:
    """The keys a request (or permission) with `key`/`range_end` names."""
    if not range_end:
        return key, key + b"\x00"
    if range_end == b"\x00":
        return key, None
    if range_end <= key:  # an empty range: check the key itself, conservatively
        return key, key + b"\x00"
    return key, range_end


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint, non-adjacent intervals with the same union."""
    out: list[Interval] = []
    for start, end in sorted(intervals, key=lambda i: i[0]):
        if out:
            last_start, last_end = out[-1]
            if last_end is None:
                break
            if start <= last_end:
                if end is None or end > last_end:
                    out[-1] = (last_start, end)
                continue
        out.append((start, end))
    return out


def covers(merged: list[Interval], want: Interval) -> bool:
    """Whether `want` lies inside the union `merged` (as `merge` returns it)."""
    start, end = want
    i = bisect.bisect_right([s for s, _ in merged], start) - 1
    if i < 0:
        return False
    have_end = merged[i][1]
    if have_end is None:
        return True
    return end is not None and end <= have_end and start < have_end


@dataclass(slots=True)
class _Merged:
    read: list[Interval]
    write: list[Interval]


class Checker:
    """Permission checks against one `AuthStore` (the replica's current state)."""

    def __init__(self, store: AuthStore) -> None:
        self.store = store
        self._cache: dict[str, _Merged] = {}
        self._cache_generation = -1

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    def _merged(self, user: str) -> _Merged:
        if self._cache_generation != self.store.generation:
            self._cache.clear()
            self._cache_generation = self.store.generation
        merged = self._cache.get(user)
        if merged is None:
            read: list[Interval] = []
            write: list[Interval] = []
            u = self.store.users.get(user)
            for role in u.roles if u is not None else ():
                for p in self.store.roles.get(role, ()):
                    ivl = request_interval(p.key, p.range_end)
                    if p.perm_type in (READ, READWRITE):
                        read.append(ivl)
                    if p.perm_type in (WRITE, READWRITE):
                        write.append(ivl)
            merged = _Merged(merge(read), merge(write))
            self._cache[user] = merged
        return merged

    # -- the primitive checks -------------------------------------------------

    def _is_root(self, user: str | None) -> bool:
        """After the enabled and empty-user checks: does `user` hold root?"""
        if user is None:
            raise errors.UserEmpty()
        u = self.store.users.get(user)
        if u is None:
            raise errors.PermissionDenied()
        return u.is_root

    def check_admin(self, user: str | None) -> None:
        """etcd's IsAdminPermitted: the root role is needed."""
        if not self.enabled:
            return
        if user is None:
            raise errors.UserEmpty()
        u = self.store.users.get(user)
        if u is None:
            raise errors.UserNotFound()
        if not u.is_root:
            raise errors.PermissionDenied()

    def check(self, user: str | None, key: bytes, range_end: bytes, perm: int) -> None:
        """READ or WRITE (`perm`) on [key, range_end), etcd's conventions."""
        if not self.enabled or self._is_root(user):
            return
        assert user is not None
        merged = self._merged(user)
        allowed = merged.read if perm == READ else merged.write
        if not covers(allowed, request_interval(key, range_end)):
            raise errors.PermissionDenied()

    def check_prefix(self, user: str | None, prefix: bytes, perms: Iterable[int]) -> None:
        """`perms` on every key starting with `prefix`."""
        end = prefix_end(prefix)
        for perm in perms:
            self.check(user, prefix, end, perm)

    # -- per request ----------------------------------------------------------

    def check_range(self, user: str | None, r: rpc_pb2.RangeRequest) -> None:
        self.check(user, r.key, r.range_end, READ)

    def check_put(
        self, user: str | None, r: rpc_pb2.PutRequest, lease_keys: Iterable[bytes]
    ) -> None:
        """WRITE on the key; READ for prev_kv; WRITE on the keys already on the
        lease (a user who could not revoke them must not attach to it)."""
        self.check(user, r.key, b"", WRITE)
        for key in lease_keys:
            self.check(user, key, b"", WRITE)
        if r.prev_kv:
            self.check(user, r.key, b"", READ)

    def check_delete(self, user: str | None, r: rpc_pb2.DeleteRangeRequest) -> None:
        self.check(user, r.key, r.range_end, WRITE)
        if r.prev_kv:
            self.check(user, r.key, r.range_end, READ)

    def check_txn(self, user: str | None, r: rpc_pb2.TxnRequest, lease_keys: LeaseKeys) -> None:
        """READ on every compare, and every op of both branches, nested txns too."""
        if not self.enabled:
            return
        for c in r.compare:
            self.check(user, c.key, c.range_end, READ)
        for op in (*r.success, *r.failure):
            kind = op.WhichOneof("request")
            if kind == "request_range":
                self.check_range(user, op.request_range)
            elif kind == "request_put":
                self.check_put(user, op.request_put, lease_keys(op.request_put.lease))
            elif kind == "request_delete_range":
                self.check_delete(user, op.request_delete_range)
            elif kind == "request_txn":
                self.check_txn(user, op.request_txn, lease_keys)

    def watch_permitted(self, user: str | None, r: rpc_pb2.WatchCreateRequest) -> bool:
        """READ on the watched key or range (a refusal cancels the watch, it does
        not end the stream)."""
        try:
            self.check(user, r.key or b"\x00", r.range_end, READ)
        except EtcdError:
            return False
        return True

    def check_lease_revoke(self, user: str | None, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.check(user, key, b"", WRITE)


def prefix_end(prefix: bytes) -> bytes:
    """The range_end selecting every key that starts with `prefix` (b"\\0" for
    a prefix of only 0xff bytes, meaning every key from it on)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\x00"
