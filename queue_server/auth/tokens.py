"""Simple tokens (etcd's `--auth-token simple`): a node-local table token -> user.

A token is random (16 letters, as etcd's, then `.` and a counter) and lives
`ttl` seconds after its last use; each use renews it, as etcd's simple tokens
do. It is only valid on the member that issued it (etcd replicates simple
tokens through its log; we do not: see docs/auth.md).

A token also remembers the user's credential revision and the store's enable
revision when it was issued, so deleting the user, changing its password, or
disabling auth voids it without this table being told.

Time is injected (`clock`, the node's `Timers.clock`; required), so expiry is
tested without sleeping. The table is swept of expired tokens every
`SWEEP_EVERY` issues, which bounds it by the number of logins within one TTL.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass

from queue_server.auth.store import AuthStore

DEFAULT_TTL = 300.0
"""etcd's default --auth-token-ttl (5 minutes)."""
TOKEN_LETTERS = string.ascii_letters
TOKEN_LENGTH = 16
"""etcd's simple token: 16 random letters."""
SWEEP_EVERY = 256
"""Expired tokens are dropped every this many issues (amortized O(1) each)."""


@dataclass(slots=True)
class _Entry:
    user: str
    credential_revision: int
    enable_revision: int
    deadline: float


class SimpleTokens:
    def __init__(
        self,
        store: AuthStore,
        clock: Callable[[], float],
        ttl: float = DEFAULT_TTL,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.clock = clock
        self._tokens: dict[str, _Entry] = {}
        self._issued = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def assign(self, user: str) -> str:
        """A new token for `user` (who must exist)."""
        u = self.store.users[user]
        self._issued += 1
        if self._issued % SWEEP_EVERY == 0:
            self._sweep()
        token = "".join(secrets.choice(TOKEN_LETTERS) for _ in range(TOKEN_LENGTH))
        token = f"{token}.{self._issued}"
        self._tokens[token] = _Entry(
            user, u.credential_revision, self.store.enable_revision, self.clock() + self.ttl
        )
        return token

    def user_of(self, token: str) -> str | None:
        """The user `token` stands for, renewing it; None if it is unknown,
        expired or void."""
        entry = self._tokens.get(token)
        if entry is None:
            return None
        now = self.clock()
        u = self.store.users.get(entry.user)
        if (
            entry.deadline <= now
            or not self.store.enabled
            or entry.enable_revision != self.store.enable_revision
            or u is None
            or u.credential_revision != entry.credential_revision
        ):
            del self._tokens[token]
            return None
        entry.deadline = now + self.ttl
        return entry.user

    def _sweep(self) -> None:
        now = self.clock()
        for token in [t for t, e in self._tokens.items() if e.deadline <= now]:
            del self._tokens[token]
