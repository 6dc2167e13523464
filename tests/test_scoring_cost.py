"""Table-driven tests of the ``kv`` block-unit cost (the default): tiers, load blend, credit
extremes, explain terms."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from pydantic import ValidationError

from index.types import BlockKey, PrefixMatch, WorkerId
from scoring.api import Candidate, RouteRequest, WorkerLoad
from scoring.config import KvPolicyConfig
from scoring.cost_blocks import worker_cost
from scoring.cost_parts import (
    busy_reason,
    clip_match,
    overlap_tokens,
    request_blocks,
    request_size,
)
from scoring.kv import KvPolicy

BS = 16


def req(blocks: int = 10, prompt_tokens: int | None = None, **kw: object) -> RouteRequest:
    tokens = blocks * BS if prompt_tokens is None else prompt_tokens
    keys = [BlockKey(1000 + i) for i in range(blocks)]
    return RouteRequest(model="m", block_keys=keys, block_size=BS, prompt_tokens=tokens, **kw)  # type: ignore[arg-type]


def cand(
    name: str,
    *,
    gpu: int = 0,
    cpu: int = 0,
    disk: int = 0,
    **load: Any,
) -> Candidate:
    return Candidate(
        worker=WorkerId(name),
        url=f"http://{name}",
        load=WorkerLoad(**load),
        match=PrefixMatch(gpu=gpu, cpu=cpu, disk=disk),
    )


DEFAULT = KvPolicyConfig()
# isolate the cache terms: no load weight at all
NO_LOAD = KvPolicyConfig(queued_prefill_weight=0.0, decode_weight=0.0)


@pytest.mark.parametrize(
    ("gpu", "cpu", "disk", "credited"),
    [
        (0, 0, 0, 0.0),
        (10, 0, 0, 10.0),
        (4, 0, 0, 4.0),
        (0, 4, 0, 3.0),  # 4 * 0.75
        (0, 0, 4, 1.0),  # 4 * 0.25
        (2, 4, 4, 2 + 3.0 + 1.0),
        (8, 8, 8, 8 + 2 * 0.75),  # clipped to the request's 10 blocks: 8 gpu, 2 cpu, 0 disk
        (12, 0, 0, 10.0),  # more than the request: clipped
    ],
)
def test_tier_credit(gpu: int, cpu: int, disk: int, credited: float) -> None:
    cost = worker_cost(request_size(req(10)), cand("a", gpu=gpu, cpu=cpu, disk=disk), NO_LOAD)
    assert cost.credited == pytest.approx(credited)
    assert cost.prefill_blocks == pytest.approx(10 - credited)
    assert cost.cost == pytest.approx(10 - credited)


@pytest.mark.parametrize(
    ("weights", "credited"),
    [
        ({"gpu_weight": 1.0, "cpu_weight": 1.0, "disk_weight": 1.0}, 9.0),
        ({"gpu_weight": 1.0, "cpu_weight": 0.0, "disk_weight": 0.0}, 3.0),
        ({"gpu_weight": 0.0, "cpu_weight": 0.0, "disk_weight": 0.0}, 0.0),
        ({"gpu_weight": 0.5, "cpu_weight": 0.5, "disk_weight": 0.5}, 4.5),
        ({"gpu_weight": 1.0, "cpu_weight": 0.5, "disk_weight": 0.1}, 3.0 + 1.5 + 0.3),
    ],
)
def test_tier_weights_are_configurable(weights: dict[str, float], credited: float) -> None:
    config = KvPolicyConfig(**{**NO_LOAD.model_dump(), **weights})
    cost = worker_cost(request_size(req(10)), cand("a", gpu=3, cpu=3, disk=3), config)
    assert cost.credited == pytest.approx(credited)


@pytest.mark.parametrize(
    ("load", "queued", "decode"),
    [
        ({}, 0.0, 0.0),
        ({"pending_prefill_tokens": 160}, 10.0, 0.0),
        ({"active_decode_blocks": 50}, 0.0, 50.0),
        # scraped waiting converted at 512 tokens per request = 32 blocks each; max, not sum
        ({"pending_prefill_tokens": 160, "scraped_waiting": 2}, 64.0, 0.0),
        ({"pending_prefill_tokens": 3200, "scraped_waiting": 2}, 200.0, 0.0),
        # KV usage only counts when the capacity is known (see test below)
        ({"active_decode_blocks": 50, "scraped_kv_usage": 0.9}, 0.0, 50.0),
    ],
)
def test_load_terms(load: dict[str, Any], queued: float, decode: float) -> None:
    cost = worker_cost(request_size(req(10)), cand("a", gpu=10, **load), DEFAULT)
    assert cost.queued_prefill.blended == pytest.approx(queued)
    assert cost.decode.blended == pytest.approx(decode)
    expected = DEFAULT.queued_prefill_weight * queued + DEFAULT.decode_weight * decode
    assert cost.load_blocks == pytest.approx(expected)
    assert cost.cost == pytest.approx(expected)  # fully cached: prefill_blocks is 0


@pytest.mark.parametrize(
    ("predicted", "usage", "capacity", "decode"),
    [
        (100, 0.5, 1000, 500.0),  # engine sees more (traffic kvgate did not route)
        (800, 0.5, 1000, 800.0),  # kvgate knows more (scrape is stale)
        (100, None, 1000, 100.0),  # never scraped
        (100, 0.5, None, 100.0),  # capacity unknown
    ],
)
def test_decode_blend_is_max_of_predicted_and_scraped(
    predicted: int, usage: float | None, capacity: int | None, decode: float
) -> None:
    config = KvPolicyConfig(kv_capacity_blocks=capacity)
    c = cand("a", active_decode_blocks=predicted, scraped_kv_usage=usage)
    assert worker_cost(request_size(req(10)), c, config).decode.blended == pytest.approx(decode)


@pytest.mark.parametrize(
    ("pred_w", "scr_w", "queued"),
    [
        (1.0, 1.0, 64.0),
        (1.0, 0.0, 10.0),  # ignore the scrape
        (0.0, 1.0, 64.0),  # scrape only
        (2.0, 0.5, 32.0),
    ],
)
def test_blend_weights(pred_w: float, scr_w: float, queued: float) -> None:
    config = KvPolicyConfig(predicted_load_weight=pred_w, scraped_load_weight=scr_w)
    c = cand("a", pending_prefill_tokens=160, scraped_waiting=2)
    assert worker_cost(request_size(req(10)), c, config).queued_prefill.blended == pytest.approx(
        queued
    )


@pytest.mark.parametrize(
    ("credit", "winner"),
    [
        (0.0, "idle"),  # the cache is worth nothing: pure balance
        (1.0, "idle"),  # 40 queued blocks outweigh 10 cached blocks
        (5.0, "cached"),  # 5 * 10 = 50 > 40 queued: stick to the cache
        (1e6, "cached"),  # the cache wins whatever the load
    ],
)
def test_credit_extremes(credit: float, winner: str) -> None:
    policy = KvPolicy(KvPolicyConfig(overlap_credit=credit), rng=random.Random(0))
    candidates = [
        cand("cached", gpu=10, pending_prefill_tokens=40 * BS),
        cand("idle"),
    ]
    assert policy.rank(req(10), candidates).chosen == WorkerId(winner)


def test_zero_credit_ignores_cache_entirely() -> None:
    config = KvPolicyConfig(overlap_credit=0.0)
    costs = [worker_cost(request_size(req(10)), cand("a", gpu=g), config).cost for g in range(11)]
    assert costs == [0.0] * 11


def test_large_credit_cost_is_dominated_by_prefill() -> None:
    config = KvPolicyConfig(overlap_credit=1e6)
    heavy = cand("a", gpu=9, pending_prefill_tokens=100_000, active_decode_blocks=100_000)
    light = cand("b", gpu=8)
    assert (
        worker_cost(request_size(req(10)), heavy, config).cost
        < worker_cost(request_size(req(10)), light, config).cost
    )


@pytest.mark.parametrize(
    ("blocks", "prompt_tokens", "matched", "expected_blocks", "overlap"),
    [
        (10, 160, 10, 10, 144),  # aligned prompt: the last block's last token is computed
        (10, 170, 10, 11, 160),  # partial tail block: all full blocks can hit
        (10, 170, 4, 11, 64),
        (0, 0, 0, 0, 0),
        (0, 5, 0, 1, 0),
        (3, 0, 3, 3, 48),  # no token count: every matched block counts
    ],
)
def test_request_blocks_and_overlap_tokens(
    blocks: int, prompt_tokens: int, matched: int, expected_blocks: int, overlap: int
) -> None:
    r = req(blocks, prompt_tokens=prompt_tokens)
    assert request_blocks(r) == expected_blocks
    assert overlap_tokens(matched, request_size(r)) == overlap
    cost = worker_cost(request_size(r), cand("a", gpu=matched), DEFAULT)
    assert cost.overlap_tokens == overlap
    assert cost.uncached_tokens == max(prompt_tokens or blocks * BS, 0) - overlap


def test_clip_match_keeps_tier_order() -> None:
    assert clip_match(PrefixMatch(3, 4, 5), 5) == PrefixMatch(3, 2, 0)
    assert clip_match(PrefixMatch(0, 0, 5), 2) == PrefixMatch(0, 0, 2)


@pytest.mark.parametrize(
    ("load", "reason"),
    [
        ({}, None),
        ({"scraped_waiting": 32}, None),
        ({"scraped_waiting": 40}, "busy: waiting 40 > 32"),
        ({"scraped_kv_usage": 0.98}, None),
        ({"scraped_kv_usage": 0.99}, "busy: kv usage 0.99 > 0.98"),
        ({"in_flight": 10_000, "pending_prefill_tokens": 10**9}, None),  # predicted load: cost
    ],
)
def test_busy_reason(load: dict[str, float], reason: str | None) -> None:
    assert busy_reason(WorkerLoad(**load), DEFAULT) == reason  # type: ignore[arg-type]


def test_busy_checks_can_be_disabled() -> None:
    config = KvPolicyConfig(max_waiting_requests=None, max_kv_usage=None)
    assert busy_reason(WorkerLoad(scraped_waiting=10**6, scraped_kv_usage=1.0), config) is None


REQUIRED_TERMS = {
    "gpu_blocks",
    "cpu_blocks",
    "disk_blocks",
    "overlap_tokens",
    "request_blocks",
    "credited",
    "prefill_blocks",
    "decode_blocks",
    "cost",
    "queued_prefill_blocks",
    "load_blocks",
    "in_flight",
    "uncached_tokens",
}


def test_explain_terms_present_and_consistent() -> None:
    policy = KvPolicy(KvPolicyConfig(kv_capacity_blocks=1000), rng=random.Random(0))
    candidates = [
        cand("a", gpu=6, cpu=2, disk=1, pending_prefill_tokens=320, active_decode_blocks=40),
        cand("b", gpu=2, scraped_waiting=3, scraped_kv_usage=0.5),
    ]
    decision = policy.rank(req(10), candidates)
    assert len(decision.scores) == 2
    for score in decision.scores:
        assert set(score.terms) >= REQUIRED_TERMS
        assert all(math.isfinite(v) for v in score.terms.values())
        assert score.terms["cost"] == score.cost
        assert score.reason
    a = next(s for s in decision.scores if s.worker == "a").terms
    assert (a["gpu_blocks"], a["cpu_blocks"], a["disk_blocks"]) == (6, 2, 1)
    assert a["credited"] == pytest.approx(6 + 1.5 + 0.25)
    assert a["prefill_blocks"] == pytest.approx(10 - a["credited"])
    assert a["overlap_tokens"] == 9 * BS
    assert "scraped_queued_prefill_blocks" not in a
    b = next(s for s in decision.scores if s.worker == "b").terms
    assert b["scraped_queued_prefill_blocks"] == pytest.approx(3 * 32)
    assert b["scraped_decode_blocks"] == pytest.approx(500)


@pytest.mark.parametrize(
    "bad",
    [
        {"overlap_credit": -1},
        {"cpu_weight": 1.5},
        {"disk_weight": -0.1},
        {"temperature": -0.1},
        {"max_kv_usage": 0.0},
        {"max_kv_usage": 1.5},
        {"max_waiting_requests": -1},
        {"kv_capacity_blocks": 0},
        {"decode_weight": -1},
        {"cpu_weight": 0.2, "disk_weight": 0.5},  # a slower tier may not credit more
        {"no_such_knob": 1},
    ],
)
def test_config_rejects_bad_values_naming_the_field(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as info:
        KvPolicyConfig(**bad)  # type: ignore[arg-type]
    assert list(bad)[-1] in str(info.value)


def test_config_defaults_documented() -> None:
    config = KvPolicyConfig()
    assert (config.overlap_credit, config.temperature) == (1.0, 0.0)
    assert (config.gpu_weight, config.cpu_weight, config.disk_weight) == (1.0, 0.75, 0.25)
    for name, field in KvPolicyConfig.model_fields.items():
        assert field.description, f"{name} has no description"


# --- eviction risk: a cached match behind a queue on a full cache ------------------------


@pytest.mark.parametrize(
    ("usage", "capacity", "pending_tokens", "survival"),
    [
        (0.5, 1000, 0, 1.0),  # nothing queued: nothing evicts the match
        (0.5, 1000, 400 * BS, 1.0),  # the queue fits in the 500-block free pool
        (0.5, 1000, 750 * BS, 0.75),  # 250 blocks past the free pool, of 1000
        (0.9, 1000, 600 * BS, 0.5),  # a nearly full cache: 100 free, 600 queued
        (1.0, 1000, 2000 * BS, 0.0),  # the queue is larger than the whole cache
        (None, 1000, 2000 * BS, 1.0),  # usage not scraped: no discount
        (0.5, None, 2000 * BS, 1.0),  # capacity unknown: no discount
    ],
)
def test_queued_prefill_on_a_full_cache_discounts_the_match(
    usage: float | None, capacity: int | None, pending_tokens: int, survival: float
) -> None:
    c = cand(
        "a",
        gpu=10,
        scraped_kv_usage=usage,
        kv_capacity_blocks=capacity,
        pending_prefill_tokens=pending_tokens,
    )
    cost = worker_cost(request_size(req(10)), c, KvPolicyConfig(eviction_risk_weight=1.0))
    assert cost.cache_survival == pytest.approx(survival)
    assert cost.credited == pytest.approx(10 * survival)
    assert cost.terms()["cache_survival"] == pytest.approx(survival)


def test_eviction_risk_weight_scales_the_discount_and_zero_turns_it_off() -> None:
    c = cand("a", gpu=10, scraped_kv_usage=0.5, kv_capacity_blocks=1000,
             pending_prefill_tokens=1000 * BS)  # fmt: skip
    size = request_size(req(10))
    full = KvPolicyConfig(eviction_risk_weight=1.0)
    assert worker_cost(size, c, full).cache_survival == pytest.approx(0.5)
    half = KvPolicyConfig(eviction_risk_weight=0.5)
    assert worker_cost(size, c, half).cache_survival == pytest.approx(0.75)
    off = KvPolicyConfig(eviction_risk_weight=0.0)
    assert worker_cost(size, c, off).cache_survival == 1.0
    # the configured capacity stands in for an engine that does not publish it
    unknown = cand("a", gpu=10, scraped_kv_usage=0.5, pending_prefill_tokens=1000 * BS)
    configured = KvPolicyConfig(eviction_risk_weight=1.0, kv_capacity_blocks=1000)
    assert worker_cost(size, unknown, configured).cache_survival == pytest.approx(0.5)


def test_a_session_leaves_a_home_whose_queue_would_evict_its_history() -> None:
    """The thrashing case of the agentic benchmark at high load: the session's history is
    still cached at home, but the prefill queued there will evict it before the turn runs."""
    home = cand("home", gpu=100, scraped_kv_usage=0.9, kv_capacity_blocks=200,
                pending_prefill_tokens=250 * BS)  # fmt: skip
    idle = cand("idle", scraped_kv_usage=0.3, kv_capacity_blocks=200)
    # 250 queued blocks, 20 free, a 200-block cache: the history is as good as gone (cost
    # 110 + 0.33 * 250 at home against 110 idle); trusted, it would win (10 + 0.33 * 250).
    # A queued block at a third of an own block: a home that holds on to its sessions. The KV
    # fit counts new blocks only (with the cached ones, 180 held + 110 > 200 sets home aside
    # whatever the eviction risk says: tests/test_scoring_fit.py).
    sticky = {"queued_prefill_weight": 0.33, "kv_fit_cached": False}
    risky = KvPolicy(KvPolicyConfig(eviction_risk_weight=1.0, **sticky), rng=random.Random(0))
    chosen = risky.rank(req(110), [home, idle]).chosen
    assert chosen == WorkerId("idle")
    off = KvPolicy(KvPolicyConfig(eviction_risk_weight=0.0, **sticky), rng=random.Random(0))
    assert off.rank(req(110), [home, idle]).chosen == WorkerId("home")


# ---- the fleet term: own prefill counted again for the requests that will wait behind it ----


def _busy_fleet(home_queued_blocks: int) -> list[Candidate]:
    """A 100-block turn whose 80 first blocks are cached at ``home``; every worker prefill-busy
    75% of the time (rho 0.75: the fleet factor 0.75 / 0.25 = 3)."""
    return [
        cand(
            "home", gpu=80, pending_prefill_tokens=home_queued_blocks * BS, prefill_busy_share=0.75
        ),
        cand("other", prefill_busy_share=0.75),
    ]


def test_fleet_term_keeps_a_session_home_while_the_fleet_is_busy() -> None:
    """Without it the turn leaves a home 100 queued blocks deep to recompute its 80 cached
    blocks elsewhere (20 + 100 > 100); with it each recomputed block counts 1 + 3 times
    (80 + 100 < 400), because the fleet's queues are where its recomputation would wait."""
    fleet = _busy_fleet(home_queued_blocks=100)
    off = KvPolicyConfig(fleet_prefill_weight=0.0)
    assert KvPolicy.from_config(off).rank(req(100), fleet).chosen == WorkerId("other")
    on = KvPolicyConfig(fleet_prefill_weight=1.0)
    decision = KvPolicy.from_config(on).rank(req(100), fleet)
    assert decision.chosen == WorkerId("home")
    home, other = sorted(decision.scores, key=lambda s: s.worker != "home")
    assert home.terms["fleet_factor"] == pytest.approx(3.0)
    assert home.terms["fleet_cost"] == pytest.approx(3.0 * 20)
    assert other.terms["fleet_cost"] == pytest.approx(3.0 * 100)
    assert home.cost == pytest.approx(20 + 60 + 100)


def test_fleet_term_is_capped_and_weighted() -> None:
    fleet = [cand("a", prefill_busy_share=1.0), cand("b", prefill_busy_share=1.0)]
    capped = KvPolicy.from_config(KvPolicyConfig(fleet_prefill_weight=1.0)).rank(req(10), fleet)
    assert capped.scores[0].terms["fleet_factor"] == pytest.approx(4.0)  # rho capped at 0.8
    assert capped.scores[0].terms["fleet_cost"] == pytest.approx(40.0)
    half = KvPolicy.from_config(KvPolicyConfig(fleet_prefill_weight=0.5)).rank(req(10), fleet)
    assert half.scores[0].terms["fleet_cost"] == pytest.approx(20.0)
    plain = KvPolicy.from_config(KvPolicyConfig(fleet_prefill_weight=0.0)).rank(req(10), fleet)
    assert plain.scores[0].terms["fleet_cost"] == 0.0
    assert plain.scores[0].cost == pytest.approx(10.0)


def test_fleet_term_leaves_a_turn_with_nothing_cached_to_the_load() -> None:
    """Every candidate prefills the whole prompt: the term adds the same to each."""
    fleet = [
        cand("loaded", pending_prefill_tokens=50 * BS, prefill_busy_share=0.75),
        cand("idle", prefill_busy_share=0.75),
    ]
    on = KvPolicyConfig(fleet_prefill_weight=1.0)
    assert KvPolicy.from_config(on).rank(req(100), fleet).chosen == WorkerId("idle")
