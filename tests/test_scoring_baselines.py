"""The cache-unaware baseline policies and the policy factory."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvgate.index.types import WorkerId
from kvgate.scoring.api import Candidate, RouteRequest, WorkerLoad
from kvgate.scoring.baselines import (
    LeastLoadedPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    SessionPolicy,
)
from kvgate.scoring.policies import POLICY_NAMES, make_policy


def workers(*in_flight: int) -> list[Candidate]:
    return [
        Candidate(WorkerId(f"http://w{i}"), f"http://w{i}", WorkerLoad(in_flight=n))
        for i, n in enumerate(in_flight)
    ]


REQ = RouteRequest(model="m")


def test_round_robin_cycles_and_ranks_everyone() -> None:
    policy = RoundRobinPolicy()
    cands = workers(0, 0, 0)
    chosen = [policy.rank(REQ, cands).chosen for _ in range(6)]
    assert chosen == ["http://w0", "http://w1", "http://w2"] * 2
    decision = policy.rank(REQ, cands)
    assert sorted(decision.ranked) == sorted(c.worker for c in cands)
    assert [s.worker for s in decision.scores] == list(decision.ranked)


def test_random_is_seeded_and_roughly_uniform() -> None:
    cands = workers(0, 0, 0, 0)
    a = [RandomPolicy(random.Random(7)).rank(REQ, cands).chosen for _ in range(1)]
    b = [RandomPolicy(random.Random(7)).rank(REQ, cands).chosen for _ in range(1)]
    assert a == b
    policy = RandomPolicy(random.Random(1))
    counts = Counter(policy.rank(REQ, cands).chosen for _ in range(4000))
    assert set(counts) == {c.worker for c in cands}
    assert min(counts.values()) > 800  # 1000 expected each


@pytest.mark.parametrize(
    ("loads", "expected"),
    [((3, 1, 2), "http://w1"), ((0, 5, 0), None), ((2, 2, 0), "http://w2")],
)
def test_least_loaded_prefers_fewest_in_flight(
    loads: tuple[int, ...], expected: str | None
) -> None:
    policy = LeastLoadedPolicy()
    decision = policy.rank(REQ, workers(*loads))
    if expected is not None:
        assert decision.chosen == expected
    costs = [s.cost for s in decision.scores]
    assert costs == sorted(costs)


def test_least_loaded_spreads_ties() -> None:
    policy = LeastLoadedPolicy()
    cands = workers(0, 0, 0)
    assert {policy.rank(REQ, cands).chosen for _ in range(3)} == {c.worker for c in cands}


def test_session_sticks_and_only_moves_sessions_of_a_removed_worker() -> None:
    policy = SessionPolicy()
    cands = workers(0, 0, 0, 0)
    sessions = [f"s{i}" for i in range(200)]
    before = {
        s: policy.rank(RouteRequest(model="m", session_key=s), cands).chosen for s in sessions
    }
    again = {s: policy.rank(RouteRequest(model="m", session_key=s), cands).chosen for s in sessions}
    assert before == again
    assert len(set(before.values())) == 4
    survivors = [c for c in cands if c.worker != "http://w3"]
    after = {
        s: policy.rank(RouteRequest(model="m", session_key=s), survivors).chosen for s in sessions
    }
    moved = {s for s in sessions if before[s] != after[s]}
    assert moved == {s for s in sessions if before[s] == "http://w3"}


def test_session_without_key_falls_back_to_least_loaded() -> None:
    assert SessionPolicy().rank(REQ, workers(4, 0, 9)).chosen == "http://w1"


def test_factory_builds_every_named_policy() -> None:
    for name in POLICY_NAMES:
        policy = make_policy(name, seed=3)
        assert policy.name == name
        assert policy.rank(REQ, workers(0, 1)).ranked
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
