"""The register linearizability checker used by the cluster tests, on histories
whose answer is known."""

from __future__ import annotations

import math

import pytest

from tests.support.linearizability import Op, linearizable

pytestmark = pytest.mark.unit


def test_sequential_history_is_linearizable() -> None:
    assert linearizable([Op("write", "a", 0, 1), Op("read", "a", 2, 3)])


def test_a_read_after_a_completed_write_must_see_it() -> None:
    assert not linearizable([Op("write", "a", 0, 1), Op("read", None, 2, 3)])


def test_a_read_concurrent_with_a_write_may_see_either() -> None:
    assert linearizable([Op("write", "a", 0, 3), Op("read", None, 1, 2)])
    assert linearizable([Op("write", "a", 0, 3), Op("read", "a", 1, 2)])


def test_reads_cannot_go_back_in_time() -> None:
    history = [
        Op("write", "a", 0, 10),
        Op("read", "a", 1, 2),
        Op("read", None, 3, 4),
    ]
    assert not linearizable(history)


def test_unknown_writes_may_or_may_not_happen_but_only_once() -> None:
    assert linearizable([Op("write", "a", 0, math.inf), Op("read", None, 5, 6)])
    assert linearizable([Op("write", "a", 0, math.inf), Op("read", "a", 5, 6)])
    history = [
        Op("write", "a", 0, math.inf),
        Op("read", "a", 5, 6),
        Op("read", None, 7, 8),
    ]
    assert not linearizable(history)


def test_a_lost_acknowledged_write_is_caught() -> None:
    history = [
        Op("write", "a", 0, 1),
        Op("write", "b", 2, 3),
        Op("read", "a", 4, 5),  # b was acknowledged before this read began
    ]
    assert not linearizable(history)
