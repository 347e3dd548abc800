"""Focused tests of the Raft core (raft/core.py): elections, votes, log
repair, commit rules, ReadIndex, CheckQuorum, PreVote, snapshots, membership,
restarts, leadership transfer and flow control.

Two styles: single cores stepped with hand-made messages (to pin one rule down),
and `SimCluster` in its synchronous mode (a perfect network without delay:
`stabilize()` delivers everything, `tick_stable(n)` advances time), whose checker
also verifies Raft's safety invariants on every step of every test.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from raft import (
    ConfChange,
    ConfChangeOp,
    ConfChangePending,
    Entry,
    EntryKind,
    HardState,
    Message,
    MessageType,
    NotLeader,
    ProgressState,
    ProposalDropped,
    RaftCore,
    ReadState,
    Ready,
    Role,
)
from tests.support.raft_sim import SimCluster, SimStorage

pytestmark = pytest.mark.unit

MT = MessageType


# -- helpers -------------------------------------------------------------------------


def boot(
    node_id: int = 1, voters: tuple[int, ...] = (1, 2, 3), seed: int = 0, **kw: object
) -> RaftCore:
    """A founding member whose driver has handled its first Readies (INIT applied)."""
    core = RaftCore(node_id, voters, rng=random.Random(seed), **kw)  # type: ignore[arg-type]
    drain(core)
    return core


def drain(core: RaftCore, storage: SimStorage | None = None) -> list[Ready]:
    """Handle every Ready like a driver (persisting into `storage` if given)."""
    out = []
    while core.has_ready():
        rd = core.ready()
        if storage is not None:
            storage.save(rd)
        out.append(rd)
        core.advance(rd)
    return out


def sent(readies: list[Ready]) -> list[Message]:
    return [m for rd in readies for m in rd.messages]


def cluster(n: int = 3, seed: int = 1, **opts: Any) -> SimCluster:
    sim = SimCluster(range(1, n + 1), seed=seed, **opts)
    sim.stabilize()
    return sim


def elect(sim: SimCluster, node: int = 1) -> int:
    sim.core(node).campaign()
    sim.stabilize()
    assert sim.leader() == node
    return node


def commit(sim: SimCluster, data: bytes) -> int:
    """Propose on the leader, stabilize, and check every running voter it reaches applied it."""
    leader = sim.leader()
    assert leader is not None
    index = sim.core(leader).propose(data)
    sim.stabilize()
    for i in sim.core(leader).voters:
        if sim.nodes[i].alive and sim.can_reach(leader, i):
            assert data in sim.applied_items(i), f"{data!r} not applied on {i}"
    return index


def record_sends(sim: SimCluster) -> list[Message]:
    """Every message the nodes hand to the network from now on."""
    log: list[Message] = []
    original = sim.send

    def send(m: Message) -> None:
        log.append(m)
        original(m)

    sim.send = send  # type: ignore[method-assign]
    return log


def init_entry(voters: tuple[int, ...] = (1, 2, 3)) -> Entry:
    return Entry(
        1, 1, EntryKind.CONF_CHANGE, ConfChange(ConfChangeOp.INIT, voters=voters).to_bytes()
    )


def crafted_log(terms: list[int], voters: tuple[int, ...] = (1, 2, 3)) -> list[Entry]:
    """The INIT entry, then one entry per term in `terms` (data names index and term)."""
    return [init_entry(voters)] + [
        Entry(t, i, EntryKind.NORMAL, b"%d/%d" % (i, t)) for i, t in enumerate(terms, start=2)
    ]


def craft(sim: SimCluster, node: int, hs: HardState, entries: list[Entry]) -> None:
    """Replace a node's persisted state and restart it from there."""
    sim.crash(node, "crafting its storage")
    st = sim.nodes[node].storage
    st.hard_state, st.snapshot, st.entries = hs, None, list(entries)
    sim.restart(node)


def role_of(core: RaftCore) -> Role:
    return core.role


def make_leader(core: RaftCore, peer: int = 2) -> None:
    """Win an election on a single core by stepping the peer's (pre-)vote grants."""
    core.campaign()
    if core.role is Role.PRE_CANDIDATE:
        core.step(Message(MT.PRE_VOTE_RESP, peer, core.id, term=core.term + 1))
    core.step(Message(MT.VOTE_RESP, peer, core.id, term=core.term))
    assert core.role is Role.LEADER


# -- elections -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 5])
def test_one_leader_is_elected_and_everyone_follows_it(n: int) -> None:
    for seed in range(5):
        sim = cluster(n, seed=seed)
        assert sim.run_until(lambda: sim.leader() is not None, 100)  # noqa: B023
        sim.tick_stable(30)
        leaders = sim.leaders()
        assert len(leaders) == 1
        (leader,) = leaders
        term = sim.core(leader).term
        for i in sim.live_ids():
            assert sim.core(i).leader_id == leader and sim.core(i).term == term


def test_single_node_cluster_leads_commits_and_reads_alone() -> None:
    sim = cluster(1)
    assert sim.run_until(lambda: sim.leader() == 1, 30)
    commit(sim, b"solo")
    ctx = sim.read(1)
    sim.stabilize()
    assert sim.read_results == [(1, ReadState(ctx or b"", sim.core(1).commit_index))]


def test_election_timeout_is_randomized_in_one_to_two_election_timeouts() -> None:
    waits = set()
    for seed in range(60):
        core = boot(seed=seed, election_ticks=10)
        ticks = 0
        while not core.has_ready():
            core.tick()
            ticks += 1
        assert {m.type for m in sent(drain(core))} == {MT.PRE_VOTE}
        waits.add(ticks)
    assert min(waits) >= 10 and max(waits) <= 19
    assert len(waits) >= 6


def test_vote_is_granted_at_most_once_per_term_and_persisted_with_the_grant() -> None:
    core = boot()
    core.step(Message(MT.VOTE, 2, 1, term=5, index=1, log_term=1))
    core.step(Message(MT.VOTE, 3, 1, term=5, index=1, log_term=1))
    core.step(Message(MT.VOTE, 2, 1, term=5, index=1, log_term=1))  # a retransmission
    (rd,) = drain(core)
    assert [(m.dst, m.type, m.reject) for m in rd.messages] == [
        (2, MT.VOTE_RESP, False),
        (3, MT.VOTE_RESP, True),
        (2, MT.VOTE_RESP, False),
    ]
    assert rd.hard_state == HardState(5, 2, 1) and rd.must_sync
    core.step(Message(MT.VOTE, 3, 1, term=6, index=1, log_term=1))  # a new term: free again
    assert [m.reject for m in sent(drain(core))] == [False]
    assert (core.term, core.vote) == (6, 3)


def test_vote_is_refused_to_a_candidate_with_an_older_log() -> None:
    core = RaftCore.restore(1, HardState(3, 0, 1), None, crafted_log([2, 3]), rng=random.Random(0))
    drain(core)
    core.step(Message(MT.VOTE, 2, 1, term=4, index=5, log_term=2))  # longer but older term
    core.step(Message(MT.VOTE, 3, 1, term=4, index=2, log_term=3))  # same term, shorter
    assert [m.reject for m in sent(drain(core))] == [True, True]
    assert core.vote == 0
    core.step(Message(MT.VOTE, 3, 1, term=4, index=3, log_term=3))
    assert [m.reject for m in sent(drain(core))] == [False]


def test_follower_hearing_from_its_leader_ignores_vote_requests() -> None:
    sim = cluster(3)
    elect(sim, 1)
    follower = sim.core(2)
    term = follower.term
    follower.step(Message(MT.VOTE, 3, 2, term=term + 1, index=99, log_term=term))
    follower.step(Message(MT.PRE_VOTE, 3, 2, term=term + 1, index=99, log_term=term))
    assert follower.term == term and follower.leader_id == 1
    assert not [m for m in sent(drain(follower)) if m.dst == 3]


def test_leader_appends_an_empty_entry_of_its_term() -> None:
    sim = cluster(3)
    elect(sim, 2)
    core = sim.core(2)
    last = core.log.entry(core.last_index)
    assert (last.term, last.kind, last.data) == (core.term, EntryKind.NORMAL, b"")
    assert core.commit_index == core.last_index  # committing it committed everything before


def test_propose_on_a_follower_names_the_leader() -> None:
    sim = cluster(3)
    with pytest.raises(NotLeader) as no_leader:
        sim.core(2).propose(b"x")
    assert no_leader.value.leader_id == 0
    elect(sim, 3)
    with pytest.raises(NotLeader) as err:
        sim.core(2).propose(b"x")
    assert err.value.leader_id == 3


# -- log replication -------------------------------------------------------------------


def test_follower_overwrites_a_conflicting_suffix_and_says_so_in_ready() -> None:
    core = RaftCore.restore(
        1, HardState(2, 0, 1), None, crafted_log([2, 2, 2]), rng=random.Random(0)
    )
    drain(core)
    new = Entry(3, 2, EntryKind.NORMAL, b"new")
    core.step(Message(MT.APP, 2, 1, term=3, index=1, log_term=1, entries=(new,), commit=1))
    (rd,) = drain(core)
    assert rd.entries == [new]  # first index 2 <= stored last 4: overwrite from 2 on
    assert core.last_index == 2 and core.log.entry(2) == new
    (resp,) = rd.messages
    assert (resp.type, resp.reject, resp.index) == (MT.APP_RESP, False, 2)


def test_uncommitted_entries_of_a_deposed_leader_are_replaced_cluster_wide() -> None:
    sim = cluster(3)
    elect(sim, 1)
    commit(sim, b"kept")
    sim.isolate(1)
    lost = [sim.core(1).propose(b"lost%d" % i) for i in range(3)]
    sim.stabilize()
    assert sim.core(1).commit_index < lost[0]
    assert sim.run_until(lambda: sim.leader() in (2, 3), 100)
    new = sim.leader()
    assert new is not None
    commit(sim, b"won1")
    commit(sim, b"won2")
    sim.heal()
    sim.tick_stable(3)
    assert sim.leader() == new
    for i in (1, 2, 3):
        assert sim.applied_items(i) == [b"kept", b"won1", b"won2"]
        st = sim.nodes[i].storage
        assert st.term(lost[0]) == sim.core(new).term
    sim.check.full_log_matching()


def test_commit_needs_a_majority() -> None:
    sim = cluster(5)
    elect(sim, 1)
    before = sim.core(1).commit_index
    sim.partition([1, 2], [3, 4, 5])
    index = sim.core(1).propose(b"x")
    sim.stabilize()
    assert sim.core(1).commit_index == before and sim.core(2).last_index == index
    sim.partition([1, 2, 3], [4, 5])
    sim.tick_stable(2)
    assert sim.core(1).commit_index >= index
    assert b"x" in sim.applied_items(3)


def test_entries_of_an_older_term_are_not_committed_by_counting_replicas() -> None:
    # Raft paper, figure 8: node 1 holds entry 2 of term 2 (uncommitted) and becomes
    # leader of term 4. A majority holding entry 2 does not commit it; a majority
    # holding the leader's own entry 3 (term 4) commits both.
    core = RaftCore.restore(1, HardState(3, 0, 1), None, crafted_log([2]), rng=random.Random(0))
    drain(core)
    make_leader(core)
    drain(core)
    assert core.term == 4 and core.last_index == 3
    core.step(Message(MT.APP_RESP, 2, 1, term=4, index=2))
    drain(core)
    assert core.commit_index == 1
    core.step(Message(MT.APP_RESP, 2, 1, term=4, index=3))
    drain(core)
    assert core.commit_index == 3


def test_probing_backtracks_over_a_divergent_term_in_one_round_trip() -> None:
    sim = cluster(3)
    long_stale = crafted_log([2] * 9 + [3] * 50)  # 11..60: a deposed leader's entries
    leader_log = crafted_log([2] * 9 + [4] * 20)  # 11..30 of term 4
    craft(sim, 1, HardState(4, 0, 10), leader_log)
    craft(sim, 2, HardState(4, 0, 10), long_stale)
    craft(sim, 3, HardState(4, 0, 10), crafted_log([2] * 9))
    sim.stabilize()
    sends = record_sends(sim)
    elect(sim, 1)
    rejects = [m for m in sends if m.type is MT.APP_RESP and m.src == 2 and m.reject]
    assert len(rejects) == 1
    assert (rejects[0].reject_hint, rejects[0].log_term) == (30, 3)
    assert sim.nodes[2].storage.entries == sim.nodes[1].storage.entries
    assert sim.core(2).last_index == 31


def test_heartbeats_carry_the_commit_index_capped_by_the_followers_match() -> None:
    sim = cluster(3)
    elect(sim, 1)
    sim.partition([3])
    for i in range(3):
        sim.core(1).propose(b"%d" % i)
    sim.stabilize()
    sends = record_sends(sim)
    sim.tick_stable(1)
    beats = {m.dst: m.commit for m in sends if m.type is MT.HEARTBEAT}
    leader = sim.core(1)
    match3 = leader.progress(3).match  # type: ignore[union-attr]
    assert beats == {2: leader.commit_index, 3: match3} and match3 < leader.commit_index


def test_flow_control_limits_inflight_appends_to_a_silent_follower() -> None:
    sim = cluster(3, max_inflight=2)
    elect(sim, 1)
    commit(sim, b"warm-up")
    leader = sim.core(1)
    assert leader.progress(3).state is ProgressState.REPLICATE  # type: ignore[union-attr]
    sends = record_sends(sim)
    sim.partition([3])  # its answers (and our appends) are lost from now on
    for i in range(10):
        leader.propose(b"%d" % i)
        sim.stabilize()
    to3 = [m for m in sends if m.type is MT.APP and m.dst == 3 and m.entries]
    assert [len(m.entries) for m in to3] == [1, 1]  # then paused: max_inflight reached
    assert leader.progress(3).paused()  # type: ignore[union-attr]
    sim.heal()
    sim.tick_stable(3)
    assert sim.applied_items(3) == sim.applied_items(1)


def test_a_probing_follower_gets_one_append_per_heartbeat() -> None:
    sim = cluster(3, max_entries_per_msg=2)
    elect(sim, 1)
    sim.crash(3)
    for i in range(6):
        commit(sim, b"%d" % i)
    sim.restart(3)
    sends = record_sends(sim)
    sim.stabilize()
    assert not [m for m in sends if m.dst == 3]  # the leader waits for a heartbeat answer
    sim.tick_stable(1)
    sim.tick_stable(1)
    assert sim.applied_items(3) == sim.applied_items(1)
    batches = [len(m.entries) for m in sends if m.type is MT.APP and m.dst == 3 and m.entries]
    assert max(batches) == 2  # replicate state streams batches of max_entries_per_msg


# -- ReadIndex ---------------------------------------------------------------------------


def test_read_index_on_the_leader_needs_a_heartbeat_quorum() -> None:
    sim = cluster(3)
    elect(sim, 1)
    commit(sim, b"w")
    sim.partition([1])
    ctx = sim.read(1)
    sim.stabilize()
    assert sim.read_results == []  # no quorum confirmed leadership yet
    sim.heal()
    sim.tick_stable(1)  # the next heartbeat carries the pending read's context
    assert sim.read_results == [(1, ReadState(ctx or b"", sim.core(1).commit_index))]


def test_read_index_through_a_follower_is_answered_by_the_leader() -> None:
    sim = cluster(3)
    elect(sim, 1)
    commit(sim, b"w")
    sends = record_sends(sim)
    ctx = sim.read(3)
    sim.stabilize()
    assert [m.type for m in sends][:1] == [MT.READ_INDEX]
    assert sim.read_results == [(3, ReadState(ctx or b"", sim.core(1).commit_index))]


def test_read_index_without_a_known_leader_is_refused() -> None:
    sim = cluster(3)
    with pytest.raises(NotLeader):
        sim.core(2).read_index(b"ctx")


def test_read_index_waits_until_the_new_leader_commits_in_its_term() -> None:
    core = boot()
    make_leader(core)
    drain(core)
    core.read_index(b"ctx")
    assert not [m for m in sent(drain(core)) if m.context == b"ctx"]
    core.step(Message(MT.APP_RESP, 2, 1, term=core.term, index=core.last_index))
    beats = [m for m in sent(drain(core)) if m.type is MT.HEARTBEAT and m.context == b"ctx"]
    assert {m.dst for m in beats} == {2, 3}
    core.step(Message(MT.HEARTBEAT_RESP, 3, 1, term=core.term, context=b"ctx"))
    (rd,) = drain(core)
    assert rd.read_states == [ReadState(b"ctx", core.commit_index)]


def test_a_later_read_confirmation_answers_earlier_reads_in_order() -> None:
    core = boot()
    make_leader(core)
    core.step(Message(MT.APP_RESP, 2, 1, term=core.term, index=core.last_index))
    drain(core)
    core.read_index(b"a")
    core.read_index(b"b")
    core.step(Message(MT.HEARTBEAT_RESP, 2, 1, term=core.term, context=b"b"))
    (rd,) = drain(core)
    assert [rs.context for rs in rd.read_states] == [b"a", b"b"]


# -- CheckQuorum and PreVote ---------------------------------------------------------------


def test_check_quorum_makes_an_isolated_leader_step_down() -> None:
    sim = cluster(3)
    elect(sim, 1)
    commit(sim, b"before")
    sim.isolate(1)
    stray = sim.core(1).propose(b"stray")
    sim.tick_stable(2 * sim.core(1).election_ticks)
    assert sim.core(1).role is Role.FOLLOWER
    with pytest.raises(NotLeader):
        sim.core(1).propose(b"refused")
    assert sim.run_until(lambda: sim.leader() in (2, 3), 100)
    new = sim.leader()
    commit(sim, b"after")
    sim.heal()
    sim.tick_stable(3)
    assert sim.leaders() == [new]
    for i in (1, 2, 3):
        assert sim.applied_items(i) == [b"before", b"after"]
        assert sim.nodes[i].storage.term(stray) != 2  # the stray entry was overwritten


def test_pre_vote_keeps_a_rejoining_node_from_raising_the_term() -> None:
    sim = cluster(3)
    elect(sim, 1)
    commit(sim, b"x")
    term = sim.core(1).term
    sim.isolate(3)
    sim.tick_stable(100)
    assert sim.core(3).term == term  # pre-votes never won, so no term was bumped
    sim.heal()
    sim.tick_stable(20)
    assert sim.leader() == 1
    assert {sim.core(i).term for i in (1, 2, 3)} == {term}
    assert sim.core(3).leader_id == 1


def test_without_pre_vote_a_rejoining_node_disrupts_the_leader() -> None:
    sim = cluster(3, pre_vote=False)
    elect(sim, 1)
    term = sim.core(1).term
    sim.isolate(3)
    sim.tick_stable(100)
    assert sim.core(3).term > term + 3
    sim.heal()
    assert sim.run_until(lambda: sim.leader() is not None and sim.core(1).term > term, 100)


def test_a_hint_that_the_leader_is_gone_shortens_the_election() -> None:
    sim = cluster(3)
    elect(sim, 1)
    commit(sim, b"x")
    sim.crash(1, "killed")
    for i in (2, 3):
        sim.core(i).leader_unreachable()
    election = sim.core(2).election_ticks
    # Without the hint a follower waits a whole election timeout of silence,
    # then what is left of its randomized one; with it, only the latter.
    assert sim.run_until(lambda: sim.leader() in (2, 3), election)
    commit(sim, b"after")


def test_a_wrong_hint_does_not_disturb_a_live_leader() -> None:
    sim = cluster(3)
    elect(sim, 1)
    term = sim.core(1).term
    for _ in range(3 * sim.core(2).election_ticks):
        sim.core(2).leader_unreachable()  # wrongly, again and again
        sim.tick_stable()
    # 3 still hears 1 and refuses 2's pre-votes; 1's heartbeats keep 2.
    assert sim.leader() == 1 and sim.core(1).term == term
    assert sim.core(2).leader_id == 1


# -- snapshots ---------------------------------------------------------------------------


def test_far_behind_follower_is_caught_up_with_a_snapshot() -> None:
    sim = cluster(3)
    elect(sim, 1)
    commit(sim, b"first")
    sim.crash(3)
    for i in range(20):
        commit(sim, b"%d" % i)
    snap = sim.compact(1)
    sim.compact(2)
    assert snap is not None and sim.core(1).first_index == snap.meta.index + 1
    sim.restart(3)
    sim.tick_stable(3)
    assert sim.delivered[MT.SNAP] == 1
    assert sim.nodes[3].storage.snapshot == snap
    assert sim.applied_items(3) == sim.applied_items(1)
    commit(sim, b"after")
    assert sim.applied_items(3)[-1] == b"after"
    assert sim.core(3).voters == {1, 2, 3}


def test_a_lost_snapshot_is_sent_again() -> None:
    sim = cluster(3)
    elect(sim, 1)
    sim.crash(3)
    for i in range(5):
        commit(sim, b"%d" % i)
    sim.compact(1)
    sim.restart(3)
    original = sim.send

    def lose_snapshots(m: Message) -> None:
        if m.type is not MT.SNAP:
            original(m)

    sim.send = lose_snapshots  # type: ignore[method-assign]
    sim.tick_stable(3)
    assert sim.core(1).progress(3).state is ProgressState.SNAPSHOT  # type: ignore[union-attr]
    sim.send = original  # type: ignore[method-assign]
    sim.tick_stable(2 * sim.core(1).election_ticks)
    assert sim.applied_items(3) == sim.applied_items(1)


def test_compact_refuses_what_is_not_applied() -> None:
    core = boot(1, (1,))
    with pytest.raises(ValueError):
        core.compact(core.applied_index + 1, b"")
    snap = core.compact(1, b"state")
    assert (snap.meta.index, snap.meta.term, snap.meta.voters) == (1, 1, (1,))
    with pytest.raises(ValueError):
        core.compact(1, b"state")


# -- membership ------------------------------------------------------------------------


def test_added_node_catches_up_then_counts_in_the_quorum() -> None:
    sim = cluster(3)
    elect(sim, 1)
    for i in range(5):
        commit(sim, b"%d" % i)
    sim.add_node(4)
    sim.tick_stable(30)
    assert sim.core(4).term == 0 and sim.core(4).role is Role.FOLLOWER  # never campaigns
    index = sim.core(1).propose_conf_change(add=4, context=b"addr-of-4")
    sim.stabilize()
    assert all(sim.core(i).voters == {1, 2, 3, 4} for i in (1, 2, 3, 4))
    assert sim.applied_items(4) == sim.applied_items(1)
    cc = ConfChange.from_bytes(sim.core(4).log.entry(index).data)
    assert (cc.op, cc.node_id, cc.context) == (ConfChangeOp.ADD, 4, b"addr-of-4")
    sim.crash(3)
    commit(sim, b"with 1, 2 and 4")  # 3 of 4
    sim.crash(4)
    before = sim.core(1).commit_index
    sim.core(1).propose(b"with 1 and 2 only")
    sim.tick_stable(3)
    assert sim.core(1).commit_index == before  # 2 of 4 is no quorum any more
    sim.restart(4)
    sim.tick_stable(3)
    assert sim.core(1).commit_index > before


def test_removed_follower_no_longer_counts() -> None:
    sim = cluster(3)
    elect(sim, 1)
    sim.core(1).propose_conf_change(remove=3)
    sim.stabilize()
    assert sim.core(1).voters == {1, 2} == sim.core(2).voters
    sim.crash(3)
    commit(sim, b"two voters")
    sim.crash(2)
    before = sim.core(1).commit_index
    sim.core(1).propose(b"one of two")
    sim.tick_stable(3)
    assert sim.core(1).commit_index == before


def test_removed_leader_hands_over_and_steps_down_once_the_change_applies() -> None:
    sim = cluster(3)
    elect(sim, 1)
    commit(sim, b"x")
    index = sim.core(1).propose_conf_change(remove=1)
    sim.core(1).propose(b"accepted until the removal applies")
    sim.stabilize()
    old = sim.core(1)
    assert old.applied_index >= index and 1 not in old.voters
    # Until a successor takes over it still leads (without counting itself): the
    # others learn the commit index from it. It takes no more proposals.
    with pytest.raises(ProposalDropped):
        old.propose(b"refused")
    assert sim.run_until(lambda: sim.leader() in (2, 3) and old.role is Role.FOLLOWER, 20)
    new = sim.leader()
    assert new is not None and sim.core(new).voters == {2, 3}
    assert sim.applied_items(new) == [b"x", b"accepted until the removal applies"]
    commit(sim, b"without 1")
    term = sim.core(new).term
    sim.tick_stable(60)  # the removed node's pre-votes do not disturb anyone
    assert old.role is not Role.LEADER and sim.leader() == new and sim.core(new).term == term


def test_a_survivor_of_two_voters_gets_going_after_the_removed_leader_restarts() -> None:
    # Leader 1 of {1, 2} removes itself, applies that and crashes before 2 learnt that
    # the change committed. 2 still counts 1 as a voter and cannot win without 1's
    # vote, which 1 refuses: its log is longer. So a node outside its configuration
    # may campaign: 1 wins, commits its term's entry (spreading the commit index) and
    # hands over; 2 then applies the removal and leads alone.
    sim = cluster(3, max_entries_per_msg=1)
    elect(sim, 1)
    sim.core(1).propose_conf_change(remove=3)
    sim.stabilize()
    sim.crash(3)
    assert sim.core(1).voters == {1, 2}
    removal = sim.core(1).propose_conf_change(remove=1)
    sim.core(1).propose(b"extra")  # never reaches 2
    original = sim.send

    def only_the_removal_reaches_2(m: Message) -> None:
        if m.dst != 2 or (m.type is MT.APP and [e.index for e in m.entries] == [removal]):
            original(m)

    sim.send = only_the_removal_reaches_2  # type: ignore[method-assign]
    sim.stabilize()
    assert sim.core(1).applied_index >= removal and sim.core(2).commit_index < removal
    sim.crash(1)
    sim.send = original  # type: ignore[method-assign]
    sim.restart(1)
    assert sim.run_until(lambda: sim.leader() == 2, 200)
    assert sim.core(2).voters == {2} and b"extra" in sim.applied_items(2)
    commit(sim, b"alone")


def test_conf_changes_are_refused_while_one_is_pending_or_meaningless() -> None:
    core = boot()
    make_leader(core)
    with pytest.raises(ConfChangePending):  # its first entry is not applied yet
        core.propose_conf_change(add=4)
    core.step(Message(MT.APP_RESP, 2, 1, term=core.term, index=core.last_index))
    drain(core)
    core.propose_conf_change(add=4)
    with pytest.raises(ConfChangePending):
        core.propose_conf_change(add=5)
    core.step(Message(MT.APP_RESP, 2, 1, term=core.term, index=core.last_index))
    drain(core)
    assert core.voters == {1, 2, 3, 4}
    with pytest.raises(ValueError):
        core.propose_conf_change(add=4)
    with pytest.raises(ValueError):
        core.propose_conf_change(remove=9)
    with pytest.raises(ValueError):
        core.propose_conf_change(add=5, remove=2)
    with pytest.raises(NotLeader):
        boot(2).propose_conf_change(add=4)


def test_no_campaign_while_a_committed_conf_change_is_unapplied() -> None:
    entries = [
        *crafted_log([2]),
        Entry(2, 3, EntryKind.CONF_CHANGE, ConfChange(ConfChangeOp.ADD, 4).to_bytes()),
    ]
    core = RaftCore.restore(1, HardState(2, 0, 3), None, entries, rng=random.Random(0))
    core.campaign()
    assert role_of(core) is Role.FOLLOWER
    drain(core)  # replays (applies) entries 1..3
    assert core.voters == {1, 2, 3, 4}
    core.campaign()
    assert role_of(core) is Role.PRE_CANDIDATE


# -- restarts ------------------------------------------------------------------------------


def test_a_restarted_node_remembers_its_vote() -> None:
    storage = SimStorage()
    core = RaftCore(1, (1, 2, 3), rng=random.Random(0))
    drain(core, storage)
    core.step(Message(MT.VOTE, 2, 1, term=5, index=1, log_term=1))
    drain(core, storage)
    again = RaftCore.restore(
        1, storage.hard_state, storage.snapshot, storage.entries, rng=random.Random(1)
    )
    drain(again)
    again.step(Message(MT.VOTE, 3, 1, term=5, index=1, log_term=1))
    again.step(Message(MT.VOTE, 2, 1, term=5, index=1, log_term=1))
    assert [(m.dst, m.reject) for m in sent(drain(again))] == [(3, True), (2, False)]


def test_whole_cluster_restart_keeps_committed_data() -> None:
    sim = cluster(3)
    elect(sim, 1)
    for i in range(10):
        commit(sim, b"%d" % i)
    sim.compact(2)
    want = list(sim.applied_items(1))
    for i in (1, 2, 3):
        sim.crash(i)
    for i in (3, 2, 1):
        sim.restart(i)
    sim.stabilize()  # replays the committed entries after each snapshot
    assert all(sim.applied_items(i) == want for i in (1, 2, 3))
    assert sim.run_until(lambda: sim.leader() is not None, 100)
    commit(sim, b"after restart")
    assert sim.applied_items(2) == [*want, b"after restart"]


def test_restore_rejects_inconsistent_storage() -> None:
    with pytest.raises(ValueError):
        RaftCore.restore(1, HardState(2, 0, 5), None, crafted_log([2]), rng=random.Random(0))
    with pytest.raises(ValueError):
        RaftCore.restore(1, HardState(2, 0, 1), None, crafted_log([2])[1:], rng=random.Random(0))


# -- leadership transfer ----------------------------------------------------------------------


def test_leadership_transfer_to_a_caught_up_voter() -> None:
    sim = cluster(3)
    elect(sim, 1)
    commit(sim, b"x")
    term = sim.core(1).term
    sim.core(1).transfer_leadership(3)
    sim.stabilize()
    assert sim.leader() == 3 and sim.core(3).term == term + 1
    commit(sim, b"y")


def test_transfer_to_an_unreachable_voter_blocks_proposals_then_gives_up() -> None:
    sim = cluster(3)
    elect(sim, 1)
    sim.isolate(3)
    commit(sim, b"x")
    sim.core(1).transfer_leadership(3)
    with pytest.raises(ProposalDropped):
        sim.core(1).propose(b"during transfer")
    sim.partition([1, 2], [3])
    sim.tick_stable(sim.core(1).election_ticks)
    assert sim.core(1).lead_transferee == 0 and sim.leader() == 1
    commit(sim, b"after giving up")


# -- the Ready cycle -----------------------------------------------------------------------


def test_ready_must_be_advanced_before_the_next_one() -> None:
    core = RaftCore(1, (1,), rng=random.Random(0))
    rd = core.ready()
    with pytest.raises(RuntimeError):
        core.ready()
    core.advance(rd)
    with pytest.raises(RuntimeError):
        core.advance(rd)


def test_committed_entries_are_handed_out_only_after_they_were_persisted() -> None:
    core = boot(1, (1,))
    core.campaign()
    readies = drain(core)
    assert core.role is Role.LEADER
    index = core.propose(b"x")
    first = core.ready()
    assert [e.index for e in first.entries] == [index] and first.committed == []
    core.advance(first)
    second = core.ready()
    assert [e.data for e in second.committed] == [b"x"] and second.entries == []
    assert second.hard_state is not None and not second.must_sync  # only commit moved
    core.advance(second)
    assert readies


@pytest.mark.parametrize("make", [lambda: cluster(3, seed=7), lambda: cluster(5, seed=8)])
def test_elections_under_message_loss_still_converge(make: Callable[[], SimCluster]) -> None:
    sim = make()
    sim.net.drop = 0.3
    assert sim.run_until(lambda: sim.leader() is not None, 300)
    sim.net.drop = 0.0
    sim.tick_stable(20)
    assert len(sim.leaders()) == 1
