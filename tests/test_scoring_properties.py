"""Hypothesis properties of the ``kv`` cost and choice."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.index.types import BlockKey, PrefixMatch, WorkerId
from kvgate.scoring.api import Candidate, RouteRequest, WorkerLoad
from kvgate.scoring.config import KvPolicyConfig
from kvgate.scoring.cost import Price, request_size
from kvgate.scoring.kv import TIE_TOLERANCE, KvPolicy

tier_weights = st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=3, max_size=3).map(
    lambda ws: dict(
        zip(("gpu_weight", "cpu_weight", "disk_weight"), sorted(ws, reverse=True), strict=True)
    )
)
configs = st.builds(
    lambda tiers, **knobs: KvPolicyConfig(**tiers, **knobs),
    tier_weights,
    overlap_credit=st.floats(min_value=0.0, max_value=100.0),
    queued_prefill_weight=st.floats(min_value=0.0, max_value=10.0),
    decode_weight=st.floats(min_value=0.0, max_value=10.0),
    footprint_weight=st.floats(min_value=0.0, max_value=1.0),
    fleet_prefill_weight=st.floats(min_value=0.0, max_value=10.0),
    temperature=st.sampled_from([0.0, 0.0, 0.1, 1.0, 5.0]),
)
capacities = st.none() | st.integers(min_value=1, max_value=100_000)
loads = st.builds(
    WorkerLoad,
    in_flight=st.integers(0, 200),
    pending_prefill_tokens=st.integers(0, 500_000),
    active_decode_blocks=st.integers(0, 100_000),
    scraped_running=st.none() | st.integers(0, 200),
    scraped_waiting=st.none() | st.integers(0, 100),
    scraped_kv_usage=st.none() | st.floats(min_value=0.0, max_value=1.0),
    footprint=st.floats(min_value=0.0, max_value=1e6),
    prefill_busy_share=st.floats(min_value=0.0, max_value=1.0),
)
matches = st.builds(
    PrefixMatch, gpu=st.integers(0, 80), cpu=st.integers(0, 80), disk=st.integers(0, 80)
)
requests = st.builds(
    lambda n, extra, bs, session: RouteRequest(
        model="m",
        block_keys=[BlockKey(i + 1) for i in range(n)],
        block_size=bs,
        prompt_tokens=n * bs + extra,
        session_key=session,
    ),
    st.integers(0, 64),
    st.integers(0, 15),
    st.sampled_from([16, 32, 512]),
    st.none() | st.text(max_size=8),
)


@st.composite
def candidate_lists(draw: st.DrawFn) -> list[Candidate]:
    n = draw(st.integers(1, 8))
    return [
        Candidate(
            worker=WorkerId(f"w{i}"),
            url=f"http://w{i}",
            load=draw(loads),
            match=draw(matches),
        )
        for i in range(n)
    ]


@given(
    configs,
    requests,
    loads,
    matches,
    st.sampled_from(["gpu", "cpu", "disk"]),
    st.integers(1, 9),
    capacities,
)
def test_more_overlap_never_raises_cost(
    config: KvPolicyConfig,
    request: RouteRequest,
    load: WorkerLoad,
    match: PrefixMatch,
    tier: str,
    extra: int,
    capacity: int | None,
) -> None:
    before = Candidate(WorkerId("w"), "http://w", load, match)
    grown = PrefixMatch(**{**_tiers(match), tier: getattr(match, tier) + extra})
    after = Candidate(WorkerId("w"), "http://w", load, grown)
    size = request_size(request)
    assert (
        Price(size, after, config, kv_capacity_blocks=capacity).cost
        <= Price(size, before, config, kv_capacity_blocks=capacity).cost + 1e-9
    )


def _tiers(match: PrefixMatch) -> dict[str, int]:
    return {"gpu": match.gpu, "cpu": match.cpu, "disk": match.disk}


@given(configs, requests, matches, loads, loads)
def test_more_load_never_lowers_cost(
    config: KvPolicyConfig,
    request: RouteRequest,
    match: PrefixMatch,
    a: WorkerLoad,
    b: WorkerLoad,
) -> None:
    more = WorkerLoad(
        in_flight=a.in_flight,
        pending_prefill_tokens=a.pending_prefill_tokens + b.pending_prefill_tokens,
        active_decode_blocks=a.active_decode_blocks + b.active_decode_blocks,
        scraped_waiting=a.scraped_waiting,
        scraped_kv_usage=a.scraped_kv_usage,
    )
    size = request_size(request)
    base = Price(size, Candidate(WorkerId("w"), "u", a, match), config).cost
    loaded = Price(size, Candidate(WorkerId("w"), "u", more, match), config).cost
    assert loaded >= base - 1e-9


@given(configs, requests, matches, loads, st.floats(0.0, 1e3), st.floats(0.0, 20.0), capacities)
def test_cost_terms_are_sane(
    config: KvPolicyConfig,
    request: RouteRequest,
    match: PrefixMatch,
    load: WorkerLoad,
    ratio: float,
    fleet: float,
    capacity: int | None,
) -> None:
    candidate = Candidate(WorkerId("w"), "u", load, match)
    size = request_size(request)
    cost = Price(size, candidate, config, ratio, fleet=fleet, kv_capacity_blocks=capacity)
    terms = cost.terms()
    assert 0 <= cost.credited <= size.blocks + 1e-9
    assert 0 <= cost.prefill <= size.blocks + 1e-9
    assert cost.match.blocks <= size.blocks
    assert 0 <= terms["overlap_tokens"] <= max(request.prompt_tokens, 0)
    assert cost.cost >= 0
    assert terms["cost"] == cost.cost
    parts = ("footprint_cost", "fleet_cost", "load_blocks")
    assert cost.cost == pytest.approx(
        config.overlap_credit * cost.prefill + sum(terms[p] for p in parts)
    )


@settings(max_examples=200)
@given(configs, requests, candidate_lists())
def test_ranking_is_a_permutation_and_respects_cost(
    config: KvPolicyConfig, request: RouteRequest, candidates: list[Candidate]
) -> None:
    decision = KvPolicy(config, random.Random(0)).rank(request, candidates)
    ids = [c.worker for c in candidates]
    assert sorted(decision.ranked) == sorted(ids)
    assert [s.worker for s in decision.scores] == list(decision.ranked)
    scores = {s.worker: s for s in decision.scores}
    if config.temperature == 0:
        best = min(scores[w].cost for w in ids)
        assert scores[decision.chosen].cost <= best + TIE_TOLERANCE
        costs = [scores[w].cost for w in decision.ranked]
        assert all(a <= b + TIE_TOLERANCE for a, b in itertools.pairwise(costs))


@given(
    configs.map(lambda c: c.model_copy(update={"temperature": 0.0})), requests, candidate_lists()
)
def test_temperature_zero_ignores_candidate_order(
    config: KvPolicyConfig, request: RouteRequest, candidates: list[Candidate]
) -> None:
    forward = KvPolicy(config, random.Random(0)).rank(request, candidates)
    backward = KvPolicy(config, random.Random(1)).rank(request, candidates[::-1])
    assert list(forward.ranked) == list(backward.ranked)
