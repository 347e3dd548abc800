"""bcrypt, kept out of apply: the proposer hashes, Authenticate checks.

Both are slow on purpose (about 50-250 ms at the cost below), so callers on the
event loop run them in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import base64

import bcrypt

BCRYPT_COST = 10
"""etcd's default --bcrypt-cost (bcrypt.DefaultCost)."""


def hash_password(password: str, cost: int = BCRYPT_COST) -> str:
    """The value etcd 3.5 proposes in `hashedPassword`: base64 of the bcrypt hash."""
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=cost))
    return base64.b64encode(hashed).decode()


def check_password(hashed: bytes, password: str) -> bool:
    """Whether `password` matches the stored bcrypt hash (False for no hash)."""
    if not hashed:
        return False
    try:
        return bcrypt.checkpw(password.encode(), hashed)
    except ValueError:  # not a bcrypt hash
        return False
