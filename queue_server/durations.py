"""Go's duration text ("30s", "1m30s", "500ms", "2h"), as etcd's flags read it.

One reader for every duration a user writes: the server's flags (`config.py`)
and the duration fields of a queue's settings (`keyspace/config.py`). It follows
Go's `time.ParseDuration`: an optional sign, then one or more `{number}{unit}`
with units ns, us (µs, μs), ms, s, m, h; a number may have a fraction (".5s",
"1.5h"); "0" alone needs no unit. Imports nothing of the package.
"""

from __future__ import annotations

import re

UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 MICRO SIGN
    "μs": 1e-6,  # U+03BC GREEK SMALL LETTER MU
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
"""Go's duration units and their length in seconds."""

_COMPONENT = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_WHOLE = re.compile(r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")


def parse_go_duration(text: str) -> float | None:
    """Seconds of a Go duration (negative when it says so), or None when `text`
    is not one. A number without a unit is not a duration, except "0"."""
    if text in ("0", "+0", "-0"):
        return 0.0
    if _WHOLE.fullmatch(text) is None:
        return None
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    return sign * sum(float(n) * UNIT_SECONDS[u] for n, u in _COMPONENT.findall(body))
