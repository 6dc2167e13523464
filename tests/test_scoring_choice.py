"""The ``kv`` choice: ties, restarts, busy guard, temperature sampling (seeded)."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from index.types import BlockKey, PrefixMatch, WorkerId
from scoring.api import Candidate, Decision, Policy, RouteRequest, WorkerLoad
from scoring.config import KvPolicyConfig
from scoring.kv import KvPolicy
from scoring.tiebreak import rendezvous_weight, session_hash_key

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


def policy(**knobs: object) -> KvPolicy:
    config = KvPolicyConfig(**knobs)  # type: ignore[arg-type]
    return KvPolicy(config, random.Random(config.seed))


def reasons(decision: Decision) -> dict[str, str]:
    return {s.worker: s.reason for s in decision.scores}


def test_is_a_policy_named_kv() -> None:
    p: Policy = policy()
    assert p.name == "kv"
    assert KvPolicy.from_config(KvPolicyConfig(seed=3)).name == "kv"


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


def test_tie_tolerance() -> None:
    # costs differ by 1 decode block * 0.02 weight
    candidates = [cand("a", active_decode_blocks=1, in_flight=0), cand("b", in_flight=1)]
    assert policy().rank(req(10), candidates).chosen == "b"
    assert policy(tie_tolerance=0.5).rank(req(10), candidates).chosen == "a"


@pytest.mark.parametrize(
    ("loads", "chosen", "last"),
    [
        # a is best on cost but busy: skipped, ranked last as failover
        ({"a": {"scraped_waiting": 40}}, "b", "a"),
        ({"a": {"scraped_kv_usage": 0.99}}, "b", "a"),
        # every worker busy: the guard steps aside, cost decides again
        ({"a": {"scraped_waiting": 40}, "b": {"scraped_waiting": 50}}, "a", "b"),
    ],
)
def test_busy_guard(loads: dict[str, dict[str, Any]], chosen: str, last: str) -> None:
    candidates = [cand("a", gpu=10, **loads.get("a", {})), cand("b", **loads.get("b", {}))]
    d = policy().rank(req(10), candidates)
    assert d.chosen == chosen
    assert d.ranked[-1] == last
    assert len(d.ranked) == 2


def test_busy_reason_text_and_order() -> None:
    candidates = [
        cand("a", gpu=10, scraped_kv_usage=0.995),
        cand("b", gpu=5),
        cand("c", gpu=9, scraped_waiting=33),  # waiting also adds queued prefill cost
        cand("d", gpu=1),
    ]
    d = policy().rank(req(10), candidates)
    assert list(d.ranked) == ["b", "d", "a", "c"]  # busy ones after, in cost order
    rs = reasons(d)
    assert rs["a"] == "busy: kv usage 0.995 > 0.98"
    assert rs["c"] == "busy: waiting 33 > 32"
    assert rs["b"] == "lowest cost"


def test_all_busy_reason_mentions_it() -> None:
    d = policy().rank(
        req(10), [cand("a", gpu=10, scraped_waiting=40), cand("b", scraped_kv_usage=0.99)]
    )
    rs = reasons(d)
    assert rs["b"] == "lowest cost; busy: kv usage 0.99 > 0.98 (every worker busy)"
    assert rs["a"] == "higher cost; busy: waiting 40 > 32 (every worker busy)"


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


def test_seconds_tie_tolerance_is_in_seconds() -> None:
    # costs differ by one queued token: 50 microseconds at the prior's 20,000 tokens/s
    candidates = [cand("a", pending_prefill_tokens=1, in_flight=0), cand("b", in_flight=1)]
    assert policy(cost_model="seconds").rank(req(10), candidates).chosen == "b"
    tolerant = policy(cost_model="seconds", tie_tolerance=1e-4)
    assert tolerant.rank(req(10), candidates).chosen == "a"


def test_seconds_cost_keeps_a_session_home_only_while_the_fleet_is_busy() -> None:
    # 400 of 410 blocks cached at home, 400 blocks queued there; the fleet half busy (one
    # request expected behind a new one): home waits 6,400 queued tokens and prefills 160,
    # away prefills 6,528 and delays the next request as long again
    busy = [
        cand(
            "home",
            gpu=400,
            pending_prefill_tokens=400 * BS,
            active_decode_blocks=5000,
            prefill_busy_share=0.5,
        ),
        cand("away", gpu=2, prefill_busy_share=0.5),
    ]
    seconds = policy(cost_model="seconds")
    assert seconds.rank(req(410), busy).chosen == "home"
    # an idle fleet: nobody waits behind the recomputation, and it is the shorter wait
    idle = [cand("home", gpu=400, pending_prefill_tokens=400 * BS), cand("away", gpu=2)]
    assert seconds.rank(req(410), idle).chosen == "away"
    # the block-unit cost, a queued block as one of its own: 10 + 400 = 410 > 408 away;
    # a queued block at a third of its own (the old default) kept it home: 142 < 408
    assert policy().rank(req(410), idle).chosen == "away"
    assert policy(queued_prefill_weight=0.33).rank(req(410), idle).chosen == "home"


# ---- temperature -------------------------------------------------------------------------


# b's 10 queued blocks cost what the request's own 10 blocks do: in blocks at weight 1.0; in
# seconds, as long to wait for as the request's own prefill (the temperature's unit in each)
GAP_OF_ONE_REQUEST = {
    "blocks": {"queued_prefill_weight": 1.0},
    "seconds": {"cost_model": "seconds"},
}


def sampled_counts(
    temperature: float, seed: int, draws: int, cost_model: str = "blocks"
) -> Counter[str]:
    p = policy(temperature=temperature, seed=seed, **GAP_OF_ONE_REQUEST[cost_model])
    candidates = [cand("a", gpu=10), cand("b", gpu=10, pending_prefill_tokens=10 * BS)]
    return Counter(p.rank(req(10), candidates).chosen for _ in range(draws))


@pytest.mark.parametrize("cost_model", ["blocks", "seconds"])
def test_temperature_distribution_matches_softmax(cost_model: str) -> None:
    # cost gap one request's prefill, in the temperature's unit; T=1:
    # p(b) = e^-1 / (1 + e^-1) ~= 0.269
    draws = 2000
    counts = sampled_counts(1.0, seed=7, draws=draws, cost_model=cost_model)
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
        cand("z", gpu=10, scraped_waiting=99),
    ]
    seen: set[str] = set()
    for _ in range(200):
        d = p.rank(req(10), candidates)
        seen.add(d.chosen)
        rs = reasons(d)
        assert rs[d.chosen] == "sampled (temperature 0.3)"
        assert d.ranked[-1] == "z"  # busy: never sampled, still a failover choice
        assert rs["z"] == "busy: waiting 99 > 32"
        rest = list(d.ranked[1:-1])
        costs: dict[str, float] = {s.worker: s.cost for s in d.scores}
        assert rest == sorted(rest, key=lambda w: costs[w])  # the rest by cost
        probs: dict[str, float] = {s.worker: s.terms["probability"] for s in d.scores}
        assert sum(probs.values()) == pytest.approx(1.0)
        assert probs["z"] == 0.0
        assert all(rs[w] == "not sampled (temperature 0.3)" for w in rest)
    assert seen == {"a", "b", "c"}
