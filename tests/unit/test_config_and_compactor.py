"""Unit tests of flag/ETCD_* parsing and of the auto-compaction policy (time injected)."""

from __future__ import annotations

import pytest

from queue_server.compactor import CompactionPlanner, parse_retention
from queue_server.config import ConfigError, parse_config, parse_duration

pytestmark = pytest.mark.unit


def test_defaults_follow_etcd() -> None:
    c = parse_config([], environ={})
    assert c.name == "default" and c.data_dir == "default.etcd"
    assert c.listen_client_urls == ("http://localhost:2379",)
    assert c.max_request_bytes == 1536 * 1024 and c.max_txn_ops == 128
    assert c.listen_addresses() == ["localhost:2379"]
    assert c.max_concurrent_streams == 2**32 - 1  # etcd's math.MaxUint32: no limit
    assert c.max_watchers_per_stream == 10_000


def test_stream_limits_from_flags() -> None:
    c = parse_config(
        ["--max-concurrent-streams", "100", "--max-watchers-per-stream", "0"], environ={}
    )
    assert (c.max_concurrent_streams, c.max_watchers_per_stream) == (100, 0)


def test_raft_timing_flags_follow_etcd() -> None:
    c = parse_config([], environ={})
    assert (c.heartbeat_interval_ms, c.election_timeout_ms) == (100, 1000)
    c = parse_config([], environ={"ETCD_HEARTBEAT_INTERVAL": "50", "ETCD_ELECTION_TIMEOUT": "500"})
    assert (c.heartbeat_interval_ms, c.election_timeout_ms) == (50, 500)
    with pytest.raises(ConfigError) as e:
        parse_config(["--heartbeat-interval", "100", "--election-timeout", "400"], environ={})
    assert str(e.value) == (
        "--election-timeout[400ms] should be at least as 5 times as --heartbeat-interval[100ms]"
    )
    with pytest.raises(ConfigError, match="is too long"):
        parse_config(["--election-timeout", "60000"], environ={})


def test_environment_variables_set_flags_and_flags_win() -> None:
    env = {"ETCD_NAME": "n1", "ETCD_MAX_REQUEST_BYTES": "1000", "ETCD_UNSAFE_NO_FSYNC": "true"}
    c = parse_config([], environ=env)
    assert (c.name, c.data_dir, c.max_request_bytes, c.unsafe_no_fsync) == (
        "n1",
        "n1.etcd",
        1000,
        True,
    )
    c = parse_config(["--name", "n2", "--max-request-bytes", "2000"], environ=env)
    assert (c.name, c.max_request_bytes) == ("n2", 2000)


@pytest.mark.parametrize(
    "argv",
    [
        ["--listen-client-urls", "127.0.0.1:2379"],
        ["--listen-client-urls", "http://127.0.0.1"],
        ["--max-request-bytes", "0"],
        ["--max-concurrent-streams", "0"],
        ["--max-watchers-per-stream", "-1"],
        ["--auto-compaction-retention", "abc"],
        ["--auto-compaction-mode", "revision", "--auto-compaction-retention", "1h"],
        ["--grpc-keepalive-min-time", "5x"],
    ],
)
def test_bad_values_are_refused(argv: list[str]) -> None:
    with pytest.raises((ConfigError, ValueError)):
        parse_config(argv, environ={})


def test_durations() -> None:
    assert parse_duration("5s") == 5.0
    assert parse_duration("1m30s") == 90.0
    assert parse_duration("100ms") == pytest.approx(0.1)
    assert parse_retention("periodic", "1") == 3600.0
    assert parse_retention("periodic", "30m") == 1800.0
    assert parse_retention("revision", "1000") == 1000.0


def test_revision_mode_compacts_to_current_minus_retention() -> None:
    p = CompactionPlanner("revision", 100)
    assert p.tick(0, 50) is None  # not enough history yet
    assert p.tick(300, 250) == 150
    assert p.tick(600, 250) is None  # nothing new
    assert p.tick(900, 400) == 300


def test_periodic_mode_keeps_the_retention_window() -> None:
    p = CompactionPlanner("periodic", 60.0)
    assert p.interval == 6.0
    targets = []
    revision = 1
    for step in range(30):  # a tick every 6 s, 10 new revisions per tick
        now = step * 6.0
        targets.append((now, p.tick(now, revision)))
        revision += 10
    # nothing until a sample is a full retention old, then the revision of 60 s ago
    assert all(t is None for now, t in targets if now < 60)
    for now, t in targets:
        if now >= 60:
            assert t == 1 + 10 * int((now - 60) / 6)
