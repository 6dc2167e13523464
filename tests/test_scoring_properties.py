"""Hypothesis properties of the ``kv`` cost (blocks and seconds) and choice."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.types import BlockKey, PrefixMatch, WorkerId
from scoring.api import Candidate, RouteRequest, WorkerLoad
from scoring.calibration import TtftParams
from scoring.config import KvPolicyConfig
from scoring.cost_blocks import BlockCost
from scoring.cost_blocks import worker_cost as blocks_cost
from scoring.cost_parts import RequestSize, request_size
from scoring.cost_seconds import FleetView, SecondsCost
from scoring.cost_seconds import worker_cost as seconds_cost
from scoring.kv import KvPolicy

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
    cost_model=st.sampled_from(["blocks", "seconds"]),
    seconds_overlap_credit=st.floats(min_value=0.0, max_value=1.0),
    footprint_weight=st.floats(min_value=0.0, max_value=1.0),
    max_utilisation=st.floats(min_value=0.0, max_value=0.95),
    eviction_risk_weight=st.floats(min_value=0.0, max_value=1.0),
    blocked_wait_weight=st.floats(min_value=0.0, max_value=4.0),
    kv_capacity_blocks=st.none() | st.integers(min_value=1, max_value=100_000),
    temperature=st.sampled_from([0.0, 0.0, 0.1, 1.0, 5.0]),
    seed=st.integers(min_value=0, max_value=2**32),
)
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
    reuse=st.floats(min_value=0.0, max_value=1.0),
    blocked_requests=st.integers(0, 5),
    blocked_s=st.floats(min_value=0.0, max_value=60.0),
)
ttft_models = st.builds(
    TtftParams,
    base_s=st.floats(min_value=0.0, max_value=5.0),
    prefill_s=st.floats(min_value=1e-4, max_value=100.0),
    queued_s=st.floats(min_value=0.0, max_value=100.0),
    interference_s=st.floats(min_value=0.0, max_value=10.0),
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
            ttft=draw(ttft_models),
        )
        for i in range(n)
    ]


def worker_cost(
    size: RequestSize,
    candidate: Candidate,
    config: KvPolicyConfig,
    ratio: float = 1.0,
    fleet_factor: float = 0.0,
) -> BlockCost | SecondsCost:
    """The cost ``config.cost_model`` decides on, with every term."""
    if config.cost_model == "seconds":
        return seconds_cost(size, candidate, config, ratio, FleetView(fleet_factor))
    return blocks_cost(size, candidate, config, ratio)


@given(
    configs,
    requests,
    loads,
    matches,
    st.sampled_from(["gpu", "cpu", "disk"]),
    st.integers(1, 9),
    ttft_models,
)
def test_more_overlap_never_raises_cost(
    config: KvPolicyConfig,
    request: RouteRequest,
    load: WorkerLoad,
    match: PrefixMatch,
    tier: str,
    extra: int,
    model: TtftParams,
) -> None:
    before = Candidate(WorkerId("w"), "http://w", load, match, model)
    grown = PrefixMatch(**{**_tiers(match), tier: getattr(match, tier) + extra})
    after = Candidate(WorkerId("w"), "http://w", load, grown, model)
    assert (
        worker_cost(request_size(request), after, config).cost
        <= worker_cost(request_size(request), before, config).cost + 1e-9
    )


def _tiers(match: PrefixMatch) -> dict[str, int]:
    return {"gpu": match.gpu, "cpu": match.cpu, "disk": match.disk}


@given(configs, requests, matches, loads, loads, ttft_models)
def test_more_load_never_lowers_cost(
    config: KvPolicyConfig,
    request: RouteRequest,
    match: PrefixMatch,
    a: WorkerLoad,
    b: WorkerLoad,
    model: TtftParams,
) -> None:
    more = WorkerLoad(
        in_flight=a.in_flight,
        pending_prefill_tokens=a.pending_prefill_tokens + b.pending_prefill_tokens,
        active_decode_blocks=a.active_decode_blocks + b.active_decode_blocks,
        scraped_waiting=a.scraped_waiting,
        scraped_kv_usage=a.scraped_kv_usage,
        blocked_requests=a.blocked_requests + b.blocked_requests,
        blocked_s=a.blocked_s + b.blocked_s,
    )
    size = request_size(request)
    base = worker_cost(size, Candidate(WorkerId("w"), "u", a, match, model), config).cost
    loaded = worker_cost(size, Candidate(WorkerId("w"), "u", more, match, model), config).cost
    assert loaded >= base - 1e-9


@given(configs, requests, matches, loads, ttft_models, st.floats(0.0, 1e3), st.floats(0.0, 20.0))
def test_cost_terms_are_sane(
    config: KvPolicyConfig,
    request: RouteRequest,
    match: PrefixMatch,
    load: WorkerLoad,
    model: TtftParams,
    ratio: float,
    fleet: float,
) -> None:
    candidate = Candidate(WorkerId("w"), "u", load, match, model)
    cost = worker_cost(request_size(request), candidate, config, ratio, fleet)
    assert 0 <= cost.credited <= cost.request_blocks + 1e-9
    assert 0 <= cost.prefill_blocks <= cost.request_blocks + 1e-9
    assert cost.match.blocks <= cost.request_blocks
    assert 0 <= cost.overlap_tokens <= max(request.prompt_tokens, 0)
    assert cost.cost >= 0
    # whichever cost decides, the predicted TTFT and its parts are among the terms
    terms = cost.terms()
    parts = ("ttft_base_s", "ttft_queue_s", "ttft_prefill_s", "ttft_interference_s")
    assert terms["ttft_s"] == pytest.approx(sum(terms[p] for p in parts))
    assert terms["ttft_s"] >= 0
    if isinstance(cost, SecondsCost):
        assert cost.cost >= cost.ttft.total_s  # the fleet, cache and blocked terms only add
        added = cost.fleet_s + cost.cache_s + cost.blocked_wait_s
        assert cost.cost == pytest.approx(cost.ttft.total_s + added)


@settings(max_examples=200)
@given(configs, requests, candidate_lists())
def test_ranking_is_a_permutation_and_respects_cost(
    config: KvPolicyConfig, request: RouteRequest, candidates: list[Candidate]
) -> None:
    decision = KvPolicy(config, random.Random(config.seed)).rank(request, candidates)
    ids = [c.worker for c in candidates]
    assert sorted(decision.ranked) == sorted(ids)
    assert [s.worker for s in decision.scores] == list(decision.ranked)
    scores = {s.worker: s for s in decision.scores}
    free = [w for w in ids if scores[w].terms["busy"] == 0.0]
    if free:
        assert decision.chosen in free  # busy workers only when all are busy
        busy_tail = decision.ranked[len(free) :]
        assert all(scores[w].terms["busy"] == 1.0 for w in busy_tail)
    if config.temperature == 0:
        eligible = free or ids
        best = min(scores[w].cost for w in eligible)
        assert scores[decision.chosen].cost <= best + config.tie_tolerance


@given(
    configs.map(lambda c: c.model_copy(update={"temperature": 0.0})), requests, candidate_lists()
)
def test_temperature_zero_ignores_candidate_order(
    config: KvPolicyConfig, request: RouteRequest, candidates: list[Candidate]
) -> None:
    forward = KvPolicy(config, random.Random(0)).rank(request, candidates)
    backward = KvPolicy(config, random.Random(1)).rank(request, candidates[::-1])
    assert list(forward.ranked) == list(backward.ranked)
