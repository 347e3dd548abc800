"""`front.leader.leading`: which answering member the front's calls go to."""

from __future__ import annotations

import pytest

from etcdserverpb import rpc_pb2
from queue_server.front.leader import leading

pytestmark = pytest.mark.unit


def status(member: int, leader: int, term: int = 2) -> rpc_pb2.StatusResponse:
    return rpc_pb2.StatusResponse(
        header=rpc_pb2.ResponseHeader(member_id=member), leader=leader, raftTerm=term
    )


@pytest.mark.parametrize(
    ("answers", "chosen"),
    [
        ({"a": status(1, 2), "b": status(2, 2), "c": status(3, 2)}, "b"),
        # the leader did not answer: its followers' word is not enough to dial it
        ({"a": status(1, 2), "c": status(3, 2)}, None),
        # an election: nobody leads
        ({"a": status(1, 0), "b": status(2, 0)}, None),
        # an old leader cut off from its peers still says it leads: the later term wins
        ({"a": status(1, 1, term=3), "b": status(2, 2, term=4)}, "b"),
        ({"a": status(1, 1, term=5), "b": status(2, 2, term=4)}, "a"),
        ({}, None),
    ],
)
def test_the_member_that_says_it_leads_in_the_latest_term(
    answers: dict[str, rpc_pb2.StatusResponse], chosen: str | None
) -> None:
    assert leading(answers) == chosen
