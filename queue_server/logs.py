"""How the server logs: one line per record on stderr, as text or JSON.

What belongs here: the two formats (`--log-format console|json`), and the request
id that the gRPC observer (`queue_server/api/observer.py`) sets for the duration of
each call, which every record logged while serving that call carries. Extra
fields passed with `extra={...}` become `key=value` pairs in console lines and
members of the JSON object.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
"""The id of the gRPC call being served (empty outside calls)."""

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
}

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    out = {k: v for k, v in vars(record).items() if k not in _STANDARD}
    rid = request_id.get()
    if rid:
        out.setdefault("request_id", rid)
    return out


class ConsoleFormatter(logging.Formatter):
    """`time level=... logger=... message key=value...`"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: level, ts (RFC 3339, UTC), logger, msg, extras."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "level": record.levelname.lower(),
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str, fmt: str) -> None:
    """Send every record at `level` or above to stderr in format `fmt`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else ConsoleFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])
