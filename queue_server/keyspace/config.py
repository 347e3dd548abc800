"""The settings document of a queue, `/q/{name}/config`: one JSON object.

Every product reads its own fields of it (the etcd-key queue its limits, CQS its
`cqs` object); the router parses the JSON once per write and hands each product
the same mapping, and refuses fields no product knows.

Theory of operation
-------------------
A product reads its fields through `ConfigFields`, which checks each field's
type and range and names the field and the value when it refuses one:

    etcdserver: queue config /q/jobs/config: "prefetch": "16" is not an integer

It reads in one of two modes:

- *strict*, the schema: what the KV service checks before it proposes a put of
  a config, so a bad config is refused before anything reaches the log. An
  integer is a JSON integer (not "16", 1.5 or true); a duration is Go's text
  ("30s", "1m30s", "500ms") or a JSON number of seconds (not true).
- *lenient*, what apply accepts. It is the schema plus what apply has always
  coerced ("16" -> 16, 1.5 -> 1, true -> 1), so a config entry an older version
  wrote and applied replays to the same settings, and a snapshot holding one
  still loads. Ranges (negative, zero prefetch, non-finite) are checked the same
  in both modes. Nothing new reaches apply unchecked, since the KV service
  refuses anything outside the schema first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from queue_server.durations import parse_go_duration
from queue_server.errors import EtcdError
from queue_server.keyspace.grammar import show

QueueConfig = Mapping[str, object]

INT64_MAX = 2**63 - 1
"""The largest integer setting the schema takes: what an int64 holds (a Go
client's int, the metrics' figures); no setting needs more."""


class InvalidQueueConfig(EtcdError):
    code = "INVALID_ARGUMENT"
    message = "etcdserver: invalid queue config"


def invalid(key: bytes, why: str) -> InvalidQueueConfig:
    """The error for the config at `key` refused because of `why`."""
    return InvalidQueueConfig(f"etcdserver: queue config {show(key)}: {why}")


def shown(value: object) -> str:
    """A JSON value as the user wrote it, for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # pragma: no cover - parsed JSON always dumps
        text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def parse_config(key: bytes, value: bytes, known: Iterable[str] | None = None) -> QueueConfig:
    """The JSON object of the config `value` at `key` (empty: no settings);
    refuses anything else, and fields outside `known` (None: any field)."""
    try:
        raw = json.loads(value or b"{}")
    except ValueError as e:
        raise invalid(key, f"not JSON: {e}") from e
    if not isinstance(raw, dict):
        raise invalid(key, f"{shown(raw)} is not a JSON object")
    if known is not None:
        ConfigFields(key, raw, strict=True).only(known)
    return raw


@dataclass(frozen=True, slots=True)
class ConfigFields:
    """Typed, range-checked reads of the fields of one config object.

    `key` is the config's key (for messages), `prefix` names a nested object
    ("cqs." for the fields of the `cqs` object), `strict` picks the schema or
    apply's reading (see the module docstring)."""

    key: bytes
    raw: Mapping[str, object]
    strict: bool
    prefix: str = ""

    def refuse(self, name: str, value: object, why: str) -> InvalidQueueConfig:
        """The error for field `name` holding `value`."""
        return invalid(self.key, f'"{self.prefix}{name}": {shown(value)} {why}')

    def nested(self, name: str) -> ConfigFields | None:
        """The fields of the object in field `name` (None when absent)."""
        if name not in self.raw:
            return None
        value = self.raw[name]
        if not isinstance(value, dict):
            raise self.refuse(name, value, "is not a JSON object")
        return ConfigFields(self.key, value, self.strict, f"{self.prefix}{name}.")

    def only(self, names: Iterable[str]) -> None:
        """Refuse fields outside `names`."""
        unknown = sorted(set(self.raw) - set(names))
        if unknown:
            name = unknown[0]
            raise invalid(
                self.key,
                f"unknown field {shown(self.prefix + name)} (value {shown(self.raw[name])})",
            )

    def integer(
        self,
        name: str,
        default: int,
        minimum: int,
        maximum: int | None = None,
        coerced: bool = True,
    ) -> int:
        """An integer field in [minimum, maximum] (no maximum: INT64_MAX by the
        schema, none leniently). Leniently, also true/false and, if `coerced`,
        whatever int() takes ("16", 1.5): what apply took before the schema."""
        if name not in self.raw:
            return default
        value = self.raw[name]
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif self.strict:
            raise self.refuse(name, value, "is not an integer")
        elif isinstance(value, bool) or coerced:
            try:
                number = int(value)  # type: ignore[call-overload]
            except (TypeError, ValueError, OverflowError) as e:
                # OverflowError: JSON's Infinity. Uncaught it would escape apply.
                raise self.refuse(name, value, "is not an integer") from e
        else:
            raise self.refuse(name, value, "is not an integer")
        if maximum is None:
            maximum = INT64_MAX if self.strict else max(INT64_MAX, number)
        self._check_range(name, value, number, minimum, maximum)
        return number

    def duration(self, name: str, default: float, maximum: float) -> float:
        """A duration field in seconds, in [0, maximum]: Go's text ("30s",
        "1m30s", "500ms") or a JSON number of seconds."""
        if name not in self.raw:
            return default
        value = self.raw[name]
        seconds: float | None
        if isinstance(value, str):
            seconds = parse_go_duration(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        else:
            seconds = None
        if seconds is None and not self.strict:
            try:
                seconds = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError, OverflowError):
                seconds = None
        if seconds is None:
            raise self.refuse(
                name, value, 'is not a duration ("30s", "1m30s", "500ms") or a number of seconds'
            )
        if not math.isfinite(seconds):
            raise self.refuse(name, value, "is not a finite number of seconds")
        self._check_range(name, value, seconds, 0, maximum, unit=" seconds")
        return seconds

    def segment(self, name: str, default: str) -> str:
        """A string field that is one key segment (no "/"); "" means the default."""
        if name not in self.raw:
            return default
        value = self.raw[name]
        if isinstance(value, str):
            text = value
        elif self.strict:
            raise self.refuse(name, value, "is not a string")
        else:
            text = str(value)
        if "/" in text:
            raise self.refuse(name, value, 'has a "/" (a queue name is one key segment)')
        return text or default

    def _check_range(
        self,
        name: str,
        value: object,
        number: float,
        minimum: float,
        maximum: float,
        unit: str = "",
    ) -> None:
        if number < minimum:
            why = "is negative" if minimum == 0 else f"is less than {_number(minimum)}{unit}"
            raise self.refuse(name, value, why)
        if number > maximum:
            raise self.refuse(name, value, f"is more than {_number(maximum)}{unit}")


def _number(x: float) -> str:
    """An int as an int, a float as short as it reads back."""
    if isinstance(x, int) or x.is_integer():
        return str(int(x))
    return repr(x)
