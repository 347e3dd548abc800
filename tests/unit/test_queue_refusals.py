"""The queue keyspace's refusals, in-process: which keys have a queue's shape
but a broken part (issue 17, "Clear refusals"), the schema of `/q/{name}/config`
("Queue settings with a schema"), and Go's duration text.

Table-driven: each row is a key (or a config) and the exact message, or None
for what stays an ordinary key or a valid setting. The real-server side is
tests/integration/test_queue_refusals.py.
"""

from __future__ import annotations

import json
import uuid

import pytest

from queue_server.apply import StateMachine
from queue_server.cqs.state import parse_cqs_config
from queue_server.durations import parse_go_duration
from queue_server.errors import EtcdError
from queue_server.keyspace import grammar
from queue_server.keyspace.config import ConfigFields, InvalidQueueConfig, parse_config
from queue_server.mq.state import DEFAULT_PREFETCH, MAX_ACK_DEADLINE, QueueSettings

pytestmark = pytest.mark.unit

U = str(uuid.UUID(int=0x6F1C2A4E0C1D4A579D433F0B1F4F2F10))
"""A valid consumer id."""


# -- keys ---------------------------------------------------------------------------

PUTS: list[tuple[str, str | None]] = [
    # producer typos: refused
    ("/q/x/p/", "empty message key"),
    ("/q/x/p", "producer key with no message key"),
    ("/q//p/k", "empty queue name"),
    ("/q//p/", "empty queue name"),
    ("/q/x/p//k", "empty message key"),
    ("/queue/x/producer/", "empty message key"),
    ("/queue/x/producer", "producer key with no message key"),
    ("/queue//producer/k", "empty queue name"),
    (
        "/q/x/producer/k",
        '"producer" is the /queue/ spelling: a /q/ producer key is /q/{name}/p/...',
    ),
    (
        "/queue/x/p/k",
        '"p" is the /q/ spelling: a /queue/ producer key is /queue/{name}/producer/...',
    ),
    ("/q//config", "empty queue name"),
    ("/queue//config", "empty queue name"),
    # well-formed queue keys and ordinary keys: not refused
    ("/q/x/p/k", None),
    ("/q/x/p/k/more", None),  # documented: anything after the key segment is dropped
    ("/queue/x/producer/k", None),
    ("/q/x/config", None),
    ("/q/x", None),
    ("/q", None),
    ("/q/", None),
    ("/q//", None),
    ("/q/x/", None),
    ("/queue-stats/x", None),
    ("/qx/p/", None),
    ("/q/x/other/y", None),
    ("/q/x/c/" + U, None),  # a consumer's registry key (the server writes it)
    ("/q/x/c/", None),  # only a watch of a consumer key is checked
    ("/q/x/0000000000000001/k", None),
    ("/q/x/pp/k", None),
    ("p/", None),
]


@pytest.mark.parametrize(("key", "why"), PUTS)
def test_put_shapes(key: str, why: str | None) -> None:
    assert grammar.put_problem(key.encode()) == why
    if why is None:
        grammar.check_put(key.encode())
        return
    with pytest.raises(grammar.MalformedQueueKey) as err:
        grammar.check_put(key.encode())
    assert err.value.code == "INVALID_ARGUMENT"
    assert err.value.text == f"etcdserver: queue key {key}: {why}"


RANGE = "a consumer watch has no range_end (a prefix or range watch here consumes nothing; "

WATCHES: list[tuple[str, str, str | None]] = [
    # exact consumer watches with a broken part: refused
    ("/q/x/c/", "", "empty consumer uuid"),
    ("/q/x/c", "", "consumer key with no uuid"),
    ("/q//c/" + U, "", "empty queue name"),
    ("/q/x/c/worker-1", "", 'consumer id "worker-1" is not a UUID'),
    ("/queue/x/consumer/", "", "empty consumer uuid"),
    ("/queue/x/consumer/nope", "", 'consumer id "nope" is not a UUID'),
    (
        "/queue/x/c/" + U,
        "",
        '"c" is the /q/ spelling: a /queue/ consumer key is /queue/{name}/consumer/...',
    ),
    (
        "/q/x/consumer/" + U,
        "",
        '"consumer" is the /queue/ spelling: a /q/ consumer key is /q/{name}/c/...',
    ),
    # a range on a consumer key: refused (--prefix, --from-key, any range_end)
    ("/q/x/c/" + U, "/q/x/c/" + U[:-1] + "1", RANGE + "watch /q/x/c/ with a prefix to see "),
    ("/q/x/c/" + U, "\0", RANGE + "watch /q/x/c/ with a prefix to see "),
    ("/q/x/c/" + U, "/q/x/c/" + U + "\0", RANGE + "watch /q/x/c/ with a prefix to see "),
    ("/queue/x/consumer/" + U, "/r", RANGE + "watch /queue/x/consumer/ with a prefix to see "),
    ("/q/x/c/worker-1", "/q/x/c/worker-2", RANGE + "watch /q/x/c/ with a prefix to see "),
    # consumers and ordinary watches: not refused
    ("/q/x/c/" + U, "", None),
    ("/q/x/c/" + U.upper(), "", None),
    ("/queue/x/consumer/" + U, "", None),
    ("/q/x/", "/q/x0", None),  # the whole queue: an operator's view
    ("/q/x/c/", "/q/x/c0", None),  # every consumer of the queue
    ("/q/", "/q0", None),
    ("/q/x", "", None),  # the registry key
    ("/q/x/config", "", None),
    ("/q/x/c/" + U + "/0000000000000001/k", "", None),  # a handed-over delivery key
    ("/q/x/c/" + U + "/marker", "/q/x/c/" + U + "/markes", None),
    ("/q/x/other/y", "", None),
    ("/queue-stats/x", "", None),
    ("/q", "", None),
]


@pytest.mark.parametrize(("key", "range_end", "why"), WATCHES)
def test_watch_shapes(key: str, range_end: str, why: str | None) -> None:
    got = grammar.watch_problem(key.encode(), range_end.encode())
    if why is not None and why.startswith(RANGE):
        assert got is not None and got.startswith(why), got
        assert got.endswith("the consumers)")
    else:
        assert got == why


def test_messages_show_keys_that_are_not_utf8() -> None:
    key = b"/q/\xff/p/"
    err = grammar.malformed(key, grammar.put_problem(key) or "")
    assert err.text == "etcdserver: queue key /q/\\xff/p/: empty message key"


# -- durations --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("1m30s", 90.0),
        ("500ms", 0.5),
        ("2h", 7200.0),
        ("1.5h", 5400.0),
        (".5s", 0.5),
        ("5.s", 5.0),
        ("1h2m3s4ms", 3723.004),
        ("10us", 1e-5),
        ("10µs", 1e-5),
        ("10μs", 1e-5),
        ("7ns", 7e-9),
        ("0", 0.0),
        ("-1s", -1.0),
        ("+2m", 120.0),
        ("", None),
        ("30", None),  # Go wants a unit
        ("s", None),
        (".s", None),
        ("1x", None),
        ("1s ", None),
        (" 1s", None),
        ("1s2", None),
        ("1..5s", None),
        ("soon", None),
        ("--1s", None),
    ],
)
def test_go_durations(text: str, seconds: float | None) -> None:
    got = parse_go_duration(text)
    if seconds is None:
        assert got is None
    else:
        assert got == pytest.approx(seconds)


# -- the config schema ------------------------------------------------------------

KEY = b"/q/jobs/config"
PREFIX = "etcdserver: queue config /q/jobs/config: "


def strict_check(config: dict[str, object]) -> None:
    """What the KV service runs before it proposes a put of `config`."""
    StateMachine().router.check_write(KEY, json.dumps(config).encode())


REFUSED: list[tuple[dict[str, object], str]] = [
    ({"prefetch": "16"}, '"prefetch": "16" is not an integer'),
    ({"prefetch": 1.5}, '"prefetch": 1.5 is not an integer'),
    ({"prefetch": True}, '"prefetch": true is not an integer'),
    ({"prefetch": 16.0}, '"prefetch": 16.0 is not an integer'),
    ({"prefetch": None}, '"prefetch": null is not an integer'),
    ({"prefetch": 0}, '"prefetch": 0 is less than 1'),
    ({"prefetch": 2**63}, f'"prefetch": {2**63} is more than {2**63 - 1}'),
    ({"max_deliveries": -1}, '"max_deliveries": -1 is negative'),
    ({"max_deliveries": "5"}, '"max_deliveries": "5" is not an integer'),
    ({"max_depth": -5}, '"max_depth": -5 is negative'),
    ({"max_depth": [1]}, '"max_depth": [1] is not an integer'),
    ({"ack_deadline": -1}, '"ack_deadline": -1 is negative'),
    ({"ack_deadline": "-5s"}, '"ack_deadline": "-5s" is negative'),
    (
        {"ack_deadline": "soon"},
        '"ack_deadline": "soon" is not a duration ("30s", "1m30s", "500ms") or a number of seconds',
    ),
    (
        {"ack_deadline": "30"},
        '"ack_deadline": "30" is not a duration ("30s", "1m30s", "500ms") or a number of seconds',
    ),
    (
        {"ack_deadline": True},
        '"ack_deadline": true is not a duration ("30s", "1m30s", "500ms") or a number of seconds',
    ),
    (
        {"ack_deadline": 1e308},
        f'"ack_deadline": 1e+308 is more than {MAX_ACK_DEADLINE} seconds',
    ),
    (
        {"ack_deadline": "3000000h"},
        f'"ack_deadline": "3000000h" is more than {MAX_ACK_DEADLINE} seconds',
    ),
    ({"dead_letter": "a/b"}, '"dead_letter": "a/b" has a "/" (a queue name is one key segment)'),
    ({"dead_letter": 5}, '"dead_letter": 5 is not a string'),
    ({"prefetc": 3}, 'unknown field "prefetc" (value 3)'),
    ({"cqs": 1}, '"cqs": 1 is not a JSON object'),
    ({"cqs": None}, '"cqs": null is not a JSON object'),
    ({"cqs": {"prefetch": True}}, '"cqs.prefetch": true is not an integer'),
    ({"cqs": {"prefetch": "8"}}, '"cqs.prefetch": "8" is not an integer'),
    ({"cqs": {"prefetch": 0}}, '"cqs.prefetch": 0 is less than 1'),
    ({"cqs": {"depth": 99}}, '"cqs.depth": 99 is more than 32'),
    ({"cqs": {"depth": -1}}, '"cqs.depth": -1 is negative'),
    ({"cqs": {"depth": 4.0}}, '"cqs.depth": 4.0 is not an integer'),
    ({"cqs": {"dept": 4}}, 'unknown field "cqs.dept" (value 4)'),
    ({"cqs": {"subscriptions": "x"}}, '"cqs.subscriptions": "x" is not a list'),
    (
        {"cqs": {"subscriptions": [{"dto_type": ""}]}},
        '"cqs.subscriptions[0].dto_type": "" is not a non-empty string',
    ),
    (
        {"cqs": {"subscriptions": [{"dto_type": "a", "alias_name": 3}]}},
        '"cqs.subscriptions[0].alias_name": 3 is not a string',
    ),
    (
        {"cqs": {"subscriptions": [{"dto_type": "a"}, {"dto": "b"}]}},
        '"cqs.subscriptions[1]": {"dto": "b"} is not {"dto_type": ..., "alias_name": ...}',
    ),
]


@pytest.mark.parametrize(("config", "why"), REFUSED)
def test_schema_refuses_naming_the_field_and_the_value(config: dict[str, object], why: str) -> None:
    with pytest.raises(InvalidQueueConfig) as err:
        strict_check(config)
    assert err.value.code == "INVALID_ARGUMENT"
    assert err.value.text == PREFIX + why


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (b"not json", "not JSON: Expecting value: line 1 column 1 (char 0)"),
        (b"[1, 2]", "[1, 2] is not a JSON object"),
        (b'"x"', '"x" is not a JSON object'),
    ],
)
def test_a_config_is_a_json_object(value: bytes, why: str) -> None:
    with pytest.raises(InvalidQueueConfig) as err:
        StateMachine().router.check_write(KEY, value)
    assert err.value.text == PREFIX + why


@pytest.mark.parametrize(
    ("config", "seconds"),
    [
        ({"ack_deadline": "30s"}, 30.0),
        ({"ack_deadline": "1m30s"}, 90.0),
        ({"ack_deadline": "500ms"}, 0.5),
        ({"ack_deadline": "2h"}, 7200.0),
        ({"ack_deadline": 30}, 30.0),
        ({"ack_deadline": 2.5}, 2.5),
        ({"ack_deadline": 0}, 0.0),
        ({"ack_deadline": "0"}, 0.0),
        ({"ack_deadline": MAX_ACK_DEADLINE}, float(MAX_ACK_DEADLINE)),
    ],
)
def test_durations_take_go_text_and_seconds(config: dict[str, object], seconds: float) -> None:
    strict_check(config)
    assert QueueSettings.parse(json.dumps(config).encode(), KEY).ack_deadline == seconds


def test_valid_settings_and_the_defaults() -> None:
    good = {
        "prefetch": 16,
        "max_deliveries": 5,
        "ack_deadline": "1m",
        "max_depth": 100000,
        "dead_letter": "jobs.graveyard",
        "cqs": {"subscriptions": [{"dto_type": "a.v1", "alias_name": "x"}], "depth": 0},
    }
    strict_check(good)
    s = QueueSettings.parse(json.dumps(good).encode(), KEY)
    assert (s.prefetch, s.max_deliveries, s.ack_deadline, s.max_depth, s.dead_letter) == (
        16,
        5,
        60.0,
        100000,
        b"jobs.graveyard",
    )
    assert parse_cqs_config(ConfigFields(KEY, good, strict=True)) == ([("a.v1", "x")], 4, 8)
    strict_check({})
    assert QueueSettings.parse(b"", KEY) == QueueSettings()  # absent: the defaults
    assert QueueSettings.parse(b'{"prefetch": 3}', KEY).ack_deadline == QueueSettings().ack_deadline
    assert QueueSettings().prefetch == DEFAULT_PREFETCH
    assert QueueSettings.parse(b'{"dead_letter": ""}', KEY).dead_letter == b""


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        ({"prefetch": "16"}, "prefetch", 16),
        ({"prefetch": 1.5}, "prefetch", 1),
        ({"prefetch": True}, "prefetch", 1),
        ({"max_depth": 10**30}, "max_depth", 10**30),
        ({"max_deliveries": " 5 "}, "max_deliveries", 5),
        ({"ack_deadline": "30"}, "ack_deadline", 30.0),
        ({"ack_deadline": True}, "ack_deadline", 1.0),
        ({"dead_letter": 5}, "dead_letter", b"5"),
    ],
)
def test_apply_still_reads_what_it_accepted_before_the_schema(
    config: dict[str, object], field: str, value: object
) -> None:
    """A config an older version accepted replays (or loads from a snapshot)
    to the same settings: the schema is checked before proposing, apply reads
    leniently. The KV service refuses these now."""
    raw = json.dumps(config).encode()
    with pytest.raises(InvalidQueueConfig):
        StateMachine().router.check_write(KEY, raw)
    assert getattr(QueueSettings.parse(raw, KEY), field) == value


@pytest.mark.parametrize(
    "config",
    [
        {"prefetch": 0},
        {"prefetch": "x"},
        {"prefetch": 1e400},  # Infinity, as Python's json reads it
        {"max_depth": -1},
        {"ack_deadline": -1},
        {"ack_deadline": float("nan")},
        {"ack_deadline": "soon"},
        {"dead_letter": "a/b"},
        {"cqs": {"prefetch": "8"}},
        {"cqs": {"depth": 99}},
        {"cqs": None},
        {"unknown": 1},
    ],
)
def test_apply_refuses_what_it_always_refused(config: dict[str, object]) -> None:
    """The lenient reading still refuses ranges and garbage, with the field named."""
    router = StateMachine().router
    router.begin_request()
    with pytest.raises(InvalidQueueConfig) as err:
        router.check_put(KEY, json.dumps(config).encode())
    assert err.value.text.startswith(PREFIX)


def test_parse_config_without_known_fields_takes_any() -> None:
    assert parse_config(KEY, b'{"anything": 1}') == {"anything": 1}


# -- the router's door ------------------------------------------------------------


def test_check_write_covers_keys_and_configs_only() -> None:
    router = StateMachine().router
    router.check_write(b"/plain", b"not json")  # not the queue keyspace
    router.check_write(b"/q/x/p/k", b"anything")
    router.check_write(b"/q/x/other", b"not json")
    with pytest.raises(grammar.MalformedQueueKey):
        router.check_write(b"/q/x/p/", b"v")
    with pytest.raises(EtcdError) as err:
        router.check_write(b"/queue/y/config", b'{"prefetch": "2"}')
    assert (
        err.value.text
        == 'etcdserver: queue config /queue/y/config: "prefetch": "2" is not an integer'
    )
