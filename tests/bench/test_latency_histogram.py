"""The harness's latency histogram, percentiles and result shape (no servers)."""

from __future__ import annotations

import math
import pickle
import random

import pytest

from benchmarks.loadgen import LatencyHistogram, split
from benchmarks.results import NOT_IMPLEMENTED, Measurement, Row, Unavailable

pytestmark = [pytest.mark.unit, pytest.mark.bench]


def exact_percentile(values: list[int], q: float) -> int:
    """Nearest rank, the definition the histogram uses."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def test_small_values_are_exact() -> None:
    h = LatencyHistogram()
    for v in range(256):
        h.record(v)
    assert h.count == 256
    assert h.percentile(0.5) == exact_percentile(list(range(256)), 0.5)
    assert h.percentile(1.0) == 255
    assert h.percentile(0.0) == 0


def test_buckets_cover_values_with_bounded_relative_width() -> None:
    rng = random.Random(1)
    values = [rng.randrange(0, 10**11) for _ in range(5000)] + [255, 256, 511, 512, 2**40]
    for v in values:
        low, high = LatencyHistogram.bucket_bounds(LatencyHistogram.bucket_of(v))
        assert low <= v <= high
        assert (high - low + 1) / max(low, 1) <= 1 / 128


def test_buckets_are_ordered_like_values() -> None:
    keys = [LatencyHistogram.bucket_of(v) for v in range(0, 200_000, 7)]
    assert keys == sorted(keys)


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.99, 0.999, 1.0])
def test_percentiles_match_exact_within_one_percent(q: float) -> None:
    rng = random.Random(42)
    # Latencies from 50 us to seconds, log-normal like real ones.
    values = [int(rng.lognormvariate(math.log(2e6), 1.2)) + 50_000 for _ in range(20_000)]
    h = LatencyHistogram()
    for v in values:
        h.record(v)
    got = h.percentile(q)
    want = exact_percentile(values, q)
    assert got is not None
    assert abs(got - want) / want < 0.01
    assert h.min_ns == min(values)
    assert h.max_ns == max(values)


def test_merge_equals_recording_everything_in_one() -> None:
    rng = random.Random(7)
    a, b, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for i in range(3000):
        v = rng.randrange(1000, 10**9)
        (a if i % 3 else b).record(v)
        both.record(v)
    merged = LatencyHistogram()
    merged.merge(a)
    merged.merge(b)
    merged.merge(LatencyHistogram())  # merging an empty one changes nothing
    assert merged.counts == both.counts
    assert (merged.count, merged.min_ns, merged.max_ns) == (both.count, both.min_ns, both.max_ns)
    for q in (0.5, 0.99, 0.999):
        assert merged.percentile(q) == both.percentile(q)


def test_survives_pickling_between_processes() -> None:
    h = LatencyHistogram()
    for v in (100, 5_000, 70_000_000):
        h.record(v)
    copy = pickle.loads(pickle.dumps(h))
    assert copy.counts == h.counts and copy.percentile(0.99) == h.percentile(0.99)


def test_empty_and_invalid() -> None:
    h = LatencyHistogram()
    assert h.percentile(0.99) is None
    assert h.percentile_ms(0.5) is None
    assert h.mean_ns is None
    with pytest.raises(ValueError):
        h.percentile(1.5)


def test_percentile_ms_converts() -> None:
    h = LatencyHistogram()
    h.record(2_000_000)
    assert h.percentile_ms(0.5) == pytest.approx(2.0, rel=0.01)


def test_split_spreads_evenly() -> None:
    assert split(10, 3) == [4, 3, 3]
    assert split(2, 4) == [1, 1, 0, 0]
    assert sum(split(12345, 7)) == 12345


def _measurement(ops: int) -> Measurement:
    return Measurement(
        ops=ops,
        seconds=2.0,
        errors=0,
        p50_ms=1.0,
        p99_ms=2.0,
        p999_ms=3.0,
        cpu_s=1.0,
        rss_mb=50.0,
        client_cpu_s=0.5,
        client_procs=1,
        concurrency=1,
    )


def test_row_json_shape_and_ratio() -> None:
    row = Row("put", "w", _measurement(300), _measurement(600)).to_json()
    assert row["ratio_ops"] == 0.5
    assert row["ours"]["ops_s"] == 150.0
    for key in ("ops_s", "p50_ms", "p99_ms", "p999_ms", "cpu_s", "rss_mb", "client_cpu_s"):
        assert key in row["ours"] and key in row["etcd"]
    assert "note" not in row


def test_row_with_unimplemented_side_is_null_with_note() -> None:
    row = Row("watch", "w", Unavailable(NOT_IMPLEMENTED), _measurement(10)).to_json()
    assert row["ours"] is None
    assert row["ratio_ops"] is None
    assert row["note"] == "ours: not implemented"


def test_row_notes_receivers_left_behind() -> None:
    behind = _measurement(10)
    behind.extra["timed_out_streams"] = 3.0
    note = Row("watch", "w", behind, Unavailable("etcd not installed")).to_json()["note"]
    assert note == "ours: 3 receivers still behind at the drain deadline; etcd: etcd not installed"
