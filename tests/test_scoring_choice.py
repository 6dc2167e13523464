"""The ``kv`` choice: ties, restarts, temperature sampling (seeded). Which workers may take a
request now is the capacity rule's (tests/test_scheduling_capacity.py)."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from kvgate.index.types import BlockKey, PrefixMatch, WorkerId
from kvgate.scoring.api import Candidate, Decision, Policy, RouteRequest, WorkerLoad
from kvgate.scoring.config import KvPolicyConfig
from kvgate.scoring.kv import KvPolicy
from kvgate.scoring.tiebreak import rendezvous_weight, session_hash_key

BS = 16
WORKERS = [f"http://127.0.0.1:{9001 + i}" for i in range(8)]


def req(blocks: int = 10, session: str | None = None, first_key: int = 1000) -> RouteRequest:
    keys = [BlockKey(first_key + i) for i in range(blocks)]
    return RouteRequest(
        model="m", block_keys=keys, block_size=BS, prompt_tokens=blocks * BS, session_key=session
    )


def cand(name: str, *, gpu: int = 0, **load: Any) -> Candidate:
    return Candidate(
        worker=WorkerId(name),
        url=name,
        load=WorkerLoad(**load),
        match=PrefixMatch(gpu=gpu),
    )


def policy(seed: int | None = None, **knobs: object) -> KvPolicy:
    config = KvPolicyConfig(**knobs)  # type: ignore[arg-type]
    return KvPolicy(config, random.Random(seed))


def reasons(decision: Decision) -> dict[str, str]:
    return {s.worker: s.reason for s in decision.scores}


def test_is_a_policy_named_kv() -> None:
    p: Policy = policy()
    assert p.name == "kv"
    assert KvPolicy.from_config(KvPolicyConfig(), seed=3).name == "kv"


def test_lowest_cost_wins_and_every_candidate_ranked() -> None:
    candidates = [cand("a", gpu=2), cand("b", gpu=8), cand("c", gpu=5)]
    d = policy().rank(req(10), candidates)
    assert list(d.ranked) == ["b", "c", "a"]
    assert [s.worker for s in d.scores] == list(d.ranked)
    assert reasons(d) == {"b": "lowest cost", "c": "higher cost", "a": "higher cost"}


@pytest.mark.parametrize("session", ["alice", "bob", "carol", None])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_tie_break_is_deterministic_across_restarts(session: str | None, n: int) -> None:
    candidates = [cand(w) for w in WORKERS[:n]]
    chosen = {policy().rank(req(10, session), candidates).chosen for _ in range(5)}
    assert len(chosen) == 1  # five fresh policies ("restarts") agree
    key = session_hash_key(req(10, session))
    assert chosen == {max(WORKERS[:n], key=lambda w: rendezvous_weight(key, WorkerId(w)))}
    # candidate order does not matter
    assert policy().rank(req(10, session), candidates[::-1]).chosen in chosen


def test_rendezvous_weight_is_a_fixed_function() -> None:
    # pinned value: xxh3_64 is stable across processes and versions, unlike hash()
    w = rendezvous_weight(b"session\x00alice", WorkerId("http://127.0.0.1:9001"))
    assert w == rendezvous_weight(b"session\x00alice", WorkerId("http://127.0.0.1:9001"))
    assert 0 <= w < 2**64


def test_sessions_spread_over_tied_workers() -> None:
    candidates = [cand(w) for w in WORKERS[:4]]
    counts = Counter(policy().rank(req(10, f"s{i}"), candidates).chosen for i in range(400))
    assert set(counts) == set(WORKERS[:4])
    assert min(counts.values()) > 50  # 100 expected each


def test_session_key_fallbacks() -> None:
    assert session_hash_key(req(3, "x")) == b"session\x00x"
    assert session_hash_key(req(3)) == b"block\x001000"
    assert session_hash_key(RouteRequest(model="llama")) == b"model\x00llama"


def test_in_flight_breaks_ties_before_the_hash() -> None:
    names = WORKERS[:4]
    key = session_hash_key(req(10, "alice"))
    hash_winner = max(names, key=lambda w: rendezvous_weight(key, WorkerId(w)))
    other = next(w for w in names if w != hash_winner)
    candidates = [cand(w, in_flight=0 if w == other else 1) for w in names]
    d = policy().rank(req(10, "alice"), candidates)
    assert d.chosen == other
    assert reasons(d)[other] == "tie broken by in-flight"
    assert reasons(d)[hash_winner] == "tied cost, more in-flight"


def test_hash_reason_when_in_flight_ties() -> None:
    d = policy().rank(req(10, "alice"), [cand(w, in_flight=2) for w in WORKERS[:3]])
    rs = reasons(d)
    assert rs[d.chosen] == "tie broken by session hash"
    assert sorted(rs.values()).count("tied cost, lost session hash") == 2


def test_in_flight_alone_does_not_override_cost() -> None:
    d = policy().rank(req(10), [cand("a", gpu=10, in_flight=5), cand("b", gpu=9, in_flight=0)])
    assert d.chosen == "a"


def test_a_cost_gap_above_the_tie_tolerance_decides() -> None:
    # costs differ by 1 decode block * 0.02 weight: more than the tolerance (1e-6 blocks)
    candidates = [cand("a", active_decode_blocks=1, in_flight=0), cand("b", in_flight=1)]
    assert policy().rank(req(10), candidates).chosen == "b"


def test_queued_prefill_steers_new_sessions_away_from_a_hot_worker() -> None:
    # a new session: only the shared system prompt (2 blocks) is cached, everywhere
    candidates = [
        cand("hot", gpu=2, pending_prefill_tokens=20 * BS),
        cand("cold", gpu=2),
    ]
    assert policy().rank(req(40), candidates).chosen == "cold"


def test_a_long_session_stays_home_while_its_queue_is_shorter_than_a_recompute() -> None:
    # 400 of 410 cached at home; away recomputes 408 blocks on an idle replica.
    # 200 queued at home: 10 + 200 + 0.02 * 5000 = 310 < 408 away: home
    home = {"gpu": 400, "active_decode_blocks": 5000}
    candidates = [cand("home", pending_prefill_tokens=200 * BS, **home), cand("away", gpu=2)]
    assert policy().rank(req(410), candidates).chosen == "home"
    # 400 queued: 10 + 400 + 100 = 510 > 408: its first token comes sooner away
    candidates = [cand("home", pending_prefill_tokens=400 * BS, **home), cand("away", gpu=2)]
    assert policy().rank(req(410), candidates).chosen == "away"


# ---- temperature -------------------------------------------------------------------------


def sampled_counts(temperature: float, seed: int, draws: int) -> Counter[str]:
    """b's 10 queued blocks cost what the request's own 10 blocks do (the temperature's unit:
    the request's blocks)."""
    p = policy(temperature=temperature, seed=seed, queued_prefill_weight=1.0)
    candidates = [cand("a", gpu=10), cand("b", gpu=10, pending_prefill_tokens=10 * BS)]
    return Counter(p.rank(req(10), candidates).chosen for _ in range(draws))


def test_temperature_distribution_matches_softmax() -> None:
    # cost gap one request's prefill, in the temperature's unit; T=1:
    # p(b) = e^-1 / (1 + e^-1) ~= 0.269
    draws = 2000
    counts = sampled_counts(1.0, seed=7, draws=draws)
    p_b = math.exp(-1) / (1 + math.exp(-1))
    sd = math.sqrt(draws * p_b * (1 - p_b))
    assert abs(counts["b"] - draws * p_b) < 6 * sd


def test_temperature_is_deterministic_for_a_seed() -> None:
    assert sampled_counts(0.5, seed=11, draws=300) == sampled_counts(0.5, seed=11, draws=300)
    first = [
        policy(temperature=1.0, seed=5).rank(req(10), [cand("a"), cand("b")]).chosen
        for _ in range(1)
    ]
    again = [
        policy(temperature=1.0, seed=5).rank(req(10), [cand("a"), cand("b")]).chosen
        for _ in range(1)
    ]
    assert first == again


def test_low_temperature_almost_always_picks_the_best() -> None:
    assert sampled_counts(0.01, seed=1, draws=300) == Counter({"a": 300})


def test_sampled_ranking_explains_itself() -> None:
    p = policy(temperature=0.3, seed=2)
    candidates = [
        cand("a", gpu=10),
        cand("b", gpu=8),
        cand("c", gpu=6),
    ]
    seen: set[str] = set()
    for _ in range(200):
        d = p.rank(req(10), candidates)
        seen.add(d.chosen)
        rs = reasons(d)
        assert rs[d.chosen] == "sampled (temperature 0.3)"
        rest = list(d.ranked[1:])
        costs: dict[str, float] = {s.worker: s.cost for s in d.scores}
        assert rest == sorted(rest, key=lambda w: costs[w])  # the rest by cost
        probs: dict[str, float] = {s.worker: s.terms["probability"] for s in d.scores}
        assert sum(probs.values()) == pytest.approx(1.0)
        assert all(rs[w] == "not sampled (temperature 0.3)" for w in rest)
    assert seen == {"a", "b", "c"}
