"""A small linearizability checker for a single register (in the spirit of
Knossos/Porcupine): is there an order of the operations, each placed between its
call and its return, in which every read returns the latest write?

Operations are writes of unique values and reads. A write whose outcome is
unknown (the client timed out) may take effect at any point after its call, or
never. The search is Wing & Gong's: repeatedly pick an operation that may come
first (none of the remaining ones returned before it was called), apply it to the
model, and backtrack on a contradiction; (remaining operations, value) pairs seen
before are not searched again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of the history. `kind` is "write" or "read"; `value` is what
    was written, or what the read returned (None: the key did not exist).
    `end` is math.inf for a write whose outcome is unknown."""

    kind: str
    value: str | None
    start: float
    end: float


def linearizable(history: list[Op], initial: str | None = None) -> bool:
    ops = tuple(sorted(history, key=lambda o: o.start))
    seen: set[tuple[frozenset[int], str | None]] = set()

    def search(remaining: frozenset[int], value: str | None) -> bool:
        if not remaining or all(
            ops[i].kind == "write" and ops[i].end == math.inf for i in remaining
        ):
            return True  # what is left are unknown writes, which may never have happened
        key = (remaining, value)
        if key in seen:
            return False
        seen.add(key)
        earliest_end = min(ops[i].end for i in remaining)
        for i in sorted(remaining, key=lambda j: ops[j].start):
            op = ops[i]
            if op.start > earliest_end:
                break  # an operation that returned before this one began must come first
            if op.kind == "read":
                if op.value == value and search(remaining - {i}, value):
                    return True
            elif search(remaining - {i}, op.value):
                return True
        return False

    return search(frozenset(range(len(ops))), initial)
