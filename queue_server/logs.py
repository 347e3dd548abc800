"""How the server logs: one line per record on stderr, as text or JSON.

What belongs here: the two formats (`--log-format console|json`), and the request
id that the gRPC observer (`queue_server/api/observer.py`) sets for the duration of
each call, which every record logged while serving that call carries. Extra
fields passed with `extra={...}` become `key=value` pairs in console lines and
members of the JSON object.

Also what native code writes to stderr: grpc's C-core (the grpcio transport)
logs with absl straight to file descriptor 2, in a format of its own.
`GRPC_VERBOSITY` (set from --log-level before grpc is imported) decides what it
says, and `NativeStderr` turns each of its lines into a record of the `grpc`
logger, at the line's own level, in our format.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any, TextIO

request_id: contextvars.ContextVar[int] = contextvars.ContextVar("request_id", default=0)
"""The number of the gRPC call being served (0 outside calls); records show it in
hex. Kept a number so that a call that logs nothing formats nothing."""

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
        out.setdefault("request_id", f"{rid:x}")
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
    # hpack (HTTP/2 header compression, under the native transport) logs every
    # header it encodes or decodes at DEBUG: the wire, not the server.
    logging.getLogger("hpack").setLevel(max(LEVELS[level], logging.INFO))


GRPC_VERBOSITY = {"debug": "INFO", "info": "ERROR", "warn": "ERROR", "error": "ERROR"}
"""grpc C-core's `GRPC_VERBOSITY` for each --log-level (unless set already). It
has no WARNING setting; its INFO lines are internals (connectivity, transport
setup) worth having when debugging; its ERROR lines (a port it cannot bind, a
failed TLS handshake) are kept at every level. Read once, when grpc is imported."""


def set_grpc_verbosity(level: str) -> None:
    """Choose what grpc's C-core logs; call before grpc is first imported."""
    os.environ.setdefault("GRPC_VERBOSITY", GRPC_VERBOSITY[level])


_ABSL_LINE = re.compile(r"([IWEF])\d{4} [\d:.]+ +\d+ ([^\]]+)\] ?(.*)")
"""absl's prefix, as C-core writes it: `E1202 06:59:44.208791   22210 add_port.cc:83] text`."""
_ABSL_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
NATIVE_LOGGER = logging.getLogger("grpc")
"""The logger of what native code writes to stderr."""


class NativeStderr:
    """Native code's writes to file descriptor 2 (grpc's C-core logs), as records.

    `start` puts a pipe on descriptor 2 and gives Python's own `sys.stderr` the
    real stderr back, so only native writes go through the pipe; a thread reads
    it and logs each line through the `grpc` logger: an absl line at its level
    with its source as `source`, any other line as a warning. `stop` puts the
    real stderr back on descriptor 2 and reads what was left. Start it before
    `configure`, so that the handler writes to the real stderr."""

    def __init__(self) -> None:
        self._saved = -1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        # Python's own writes (tracebacks, the CLI's last words) skip the pipe;
        # the stream lives as long as the process.
        real: TextIO = open(self._saved, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = real
        self._thread = threading.Thread(
            target=self._pump, args=(read_fd,), name="native-stderr", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        os.dup2(self._saved, 2)  # the pipe's last writer goes: the reader sees its end
        self._thread.join(timeout=1.0)
        self._thread = None

    @staticmethod
    def _pump(read_fd: int) -> None:
        with open(read_fd, "rb") as pipe:
            for raw in pipe:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if line.strip():
                    log_native_line(line)


def log_native_line(line: str) -> None:
    """One line native code wrote to stderr, as a record of the `grpc` logger."""
    m = _ABSL_LINE.fullmatch(line)
    if m is None:
        NATIVE_LOGGER.warning("%s", line)
        return
    level, source, text = m.groups()
    NATIVE_LOGGER.log(_ABSL_LEVELS[level], "%s", text, extra={"source": source})
