"""Unit tests of the CQS priority structure, with the seed's example and a model
check against a naive list across random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queue_server.cqs.tree import RowJournal, SlaQueue

pytestmark = pytest.mark.unit


def test_seed_example_groups_by_store() -> None:
    q = SlaQueue()
    q.enqueue("storeesl.v1", "t/farmersmarket/s/oslo-main/esls/7318690123456", 1)
    q.enqueue("storeesl.v1", "t/farmersmarket/s/bergen-west/esls/9876543210987", 2)
    q.enqueue("storeesl.v1", "t/farmersmarket/s/oslo-main/esls/7318690999001", 5)
    got = q.dequeue(2, 4, visible_at=60)
    assert [r.dto_id for r in got] == [
        "t/farmersmarket/s/oslo-main/esls/7318690123456",
        "t/farmersmarket/s/oslo-main/esls/7318690999001",
    ]
    assert len(q) == 1 and q.in_flight == 2
    assert len({r.token for r in got}) == 2


def test_equal_sla_longer_id_first_then_fifo() -> None:
    q = SlaQueue()
    q.enqueue("d", "t/a/s/b", 10)
    q.enqueue("d", "t/a/s/b/esls/1", 10)
    q.enqueue("d", "t/a/s/b/esls/2", 10)
    assert [r.dto_id for r in q.pending()] == ["t/a/s/b/esls/1", "t/a/s/b/esls/2", "t/a/s/b"]


def test_dedup_merges_pending_keeping_the_more_urgent_sla() -> None:
    q = SlaQueue()
    a = q.enqueue("d", "t/a/s/b/x", 50, tracking_id="late")
    b = q.enqueue("d", "t/a/s/b/x", 20, tracking_id="early")
    # enqueue returns the pending record as it is now (a copy: the queue keeps
    # packed entries, not these objects), equal to the first by identity
    assert a == b and len(q) == 1 and (b.sla_us, b.tracking_id) == (20, "early")
    c = q.enqueue("d", "t/a/s/b/x", 90, tracking_id="later")
    assert (c.sla_us, c.tracking_id) == (20, "early") and q.seq_of(c) == q.seq_of(a)
    assert [(r.sla_us, r.tracking_id) for r in q.pending()] == [(20, "early")]
    # dto_id and parent_id with the same text, and another alias, are different
    q.enqueue("d", "t/a/s/b/x", 20, is_parent=True)
    q.enqueue("d", "t/a/s/b/x", 20, alias="by_storeesl")
    assert len(q) == 3


def test_in_flight_duplicate_is_a_new_pending_copy_and_expiry_merges() -> None:
    q = SlaQueue()
    q.enqueue("d", "t/a/s/b/x", 30)
    (held,) = q.dequeue(1, 4, visible_at=10)
    copy = q.enqueue("d", "t/a/s/b/x", 40)
    assert copy is not held and len(q) == 1
    assert q.expire(now=10) == 1
    # the expired one merged into the pending copy, keeping the earlier SLA
    assert len(q) == 1 and next(q.pending()).sla_us == 30
    assert q.ack([held.token]) == 0  # its token died


def test_ack_unknown_and_repeated_tokens_are_ignored() -> None:
    q = SlaQueue()
    q.enqueue("d", "t/a/s/b/x", 1)
    (r,) = q.dequeue(5, 4, visible_at=10)
    assert q.ack(["nope", r.token, r.token]) == 1
    assert q.in_flight == 0 and len(q) == 0
    assert q.expire(now=100) == 0


def test_depth_deeper_than_the_id_groups_by_the_whole_id() -> None:
    q = SlaQueue(depth=2)
    q.enqueue("d", "t/a/s/b", 1)
    q.enqueue("d", "t/a/s/b/esls/1", 2)
    q.enqueue("d", "t/a/s/c/esls/2", 3)
    # the most urgent id has 4 segments: depth 9 groups by that whole id, which
    # takes its children too, and not the other store
    got = q.dequeue(10, 9, visible_at=1)
    assert [r.dto_id for r in got] == ["t/a/s/b", "t/a/s/b/esls/1"]


IDS = [f"t/{t}/s/{s}/esls/{e}" for t in "ab" for s in "xy" for e in "12"] + ["t/a/s/x", "t/b"]
ops = st.one_of(
    st.tuples(st.just("enq"), st.sampled_from(IDS), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("deq"), st.integers(1, 4), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("ack"), st.integers(0, 10), st.none(), st.booleans()),
    st.tuples(st.just("expire"), st.none(), st.none(), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=60))
def test_queue_agrees_with_a_naive_model(operations: list[tuple[object, ...]]) -> None:
    q = SlaQueue(depth=4)
    pending: list[dict[str, object]] = []  # the model: plain dicts, sorted on demand
    held: dict[str, dict[str, object]] = {}
    seq = 0

    def order(m: dict[str, object]) -> tuple[int, int, int]:
        return (int(m["sla"]), -(str(m["id"]).count("/") + 1), int(m["seq"]))  # type: ignore[call-overload]

    for op, a, b, c in operations:
        if op == "enq":
            assert isinstance(a, str) and isinstance(b, int) and isinstance(c, bool)
            q.enqueue("d", a, b, is_parent=c)
            same = [m for m in pending if m["id"] == a and m["parent"] == c]
            if same:
                if b < int(same[0]["sla"]):  # type: ignore[call-overload]
                    same[0]["sla"] = b
            else:
                seq += 1
                pending.append({"id": a, "parent": c, "sla": b, "seq": seq})
        elif op == "deq":
            assert isinstance(a, int) and isinstance(b, int)
            got = q.dequeue(a, b, visible_at=1.0)
            if not pending:
                assert got == []
                continue
            ordered = sorted(pending, key=order)
            first = ordered[0]
            depth = b if b > 0 else 4
            segs = str(first["id"]).split("/")
            want = "/".join(segs[: min(depth, len(segs))])
            group = [m for m in ordered if m["id"] == want or str(m["id"]).startswith(want + "/")][
                :a
            ]
            assert [(r.dto_id, r.is_parent) for r in got] == [(m["id"], m["parent"]) for m in group]
            for r, m in zip(got, group, strict=True):
                pending.remove(m)
                held[r.token] = m
        elif op == "ack":
            assert isinstance(a, int)
            tokens = list(held)[:a]
            assert q.ack(tokens) == len(tokens)
            for t in tokens:
                del held[t]
        else:
            assert q.expire(now=2.0) == len(held)
            # all became visible at once: they come back in token order, and a
            # copy already pending keeps its place
            for _token, m in sorted(held.items()):
                same = [p for p in pending if p["id"] == m["id"] and p["parent"] == m["parent"]]
                if same:
                    if int(m["sla"]) < int(same[0]["sla"]):  # type: ignore[call-overload]
                        same[0]["sla"] = m["sla"]
                else:
                    pending.append(m)
            held.clear()
        assert len(q) == len(pending) and q.in_flight == len(held)
        assert [(r.dto_id, r.is_parent, r.sla_us) for r in q.pending()] == [
            (m["id"], m["parent"], m["sla"]) for m in sorted(pending, key=order)
        ]


# -- rows (the backend's `cqs` table) ------------------------------------------------


def reloaded(q: SlaQueue, rows: dict[bytes, bytes | None]) -> SlaQueue:
    """A queue rebuilt from `rows` (a journal since the queue was empty), as
    a restart reads them: in key order, after the queue's 4-byte part."""
    again = SlaQueue(depth=q.depth)
    again._seq = q._seq
    again.load_rows((key[4:], rows[key]) for key in sorted(rows) if rows[key] is not None)  # type: ignore[misc]
    return again


def test_the_journal_holds_every_row_as_it_is_and_reloads_to_the_same_queue() -> None:
    q = SlaQueue(depth=4)
    journal = RowJournal()
    q.keep_rows(journal, table_id=7)
    long_id = "t/a/s/b/" + "x" * 300  # lengths past one byte
    for i in range(300):  # kinds and groups past one byte
        q.enqueue(f"type{i}", f"t/{i}/s/{i % 280}/e/{i}", 1000 + i, tracking_id=f"r{i}")
    q.enqueue("d", long_id, 5, tracking_id="t" * 300, alias="by_store")
    q.enqueue("d", "t/ø/s/\ud800/é", 6, is_parent=True)  # not ASCII, a lone surrogate
    q.enqueue("d", "t/a", 4)  # an id shorter than the depth
    q.enqueue("type3", "t/3/s/3/e/3", 2, tracking_id="sooner")  # a merge, a new key
    taken = q.dequeue(3, -1, visible_at=90_000, token_base="tok-" + "k" * 300)
    assert len(taken) == 3 and len(q.dequeue(2, 0, visible_at=80_000, token_base="b-")) == 1
    assert q.ack([taken[0].token]) == 1
    assert q.release([taken[1].token]) == 1
    assert q.extend(taken[2].token, 95_000)
    q.enqueue("d", "t/a", 1)  # pending again while a copy of it may be in flight
    assert all(key.startswith((7).to_bytes(4, "big")) for key in journal.rows)
    live = {k[4:]: v for k, v in journal.rows.items() if v is not None}
    assert live == dict(q.rows())
    assert reloaded(q, journal.rows).export_state() == q.export_state()
    assert q.in_flight == 2 and len(q) == 300

    # expiry, and rows written since a checkpoint took the journal
    journal.rows = {}
    q.journal_swapped()
    before = dict(q.rows())
    assert q.expire(now=100_000) == 2
    changed = journal.rows
    after = dict(q.rows())
    assert {k[4:] for k in changed} == set(before) ^ set(after) | {
        k for k in before.keys() & after.keys() if before[k] != after[k]
    }
    merged = {**{(7).to_bytes(4, "big") + k: v for k, v in before.items()}, **changed}
    assert reloaded(q, merged).export_state() == q.export_state()


def test_a_queue_that_does_not_keep_rows_journals_nothing() -> None:
    q = SlaQueue()
    q.enqueue("d", "t/a/s/b/x", 1)
    assert q._journal is None
    assert list(q.rows())  # its rows can still be listed (a queue made to keep them)
