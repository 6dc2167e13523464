"""Table-driven tests of the ``kv`` policy's one cost (``scoring.cost``): tiers, load blend,
credit extremes, explain terms, the fleet term."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from pydantic import ValidationError

from kvgate.index.types import BlockKey, PrefixMatch, WorkerId
from kvgate.scoring.api import Candidate, RouteRequest, WorkerLoad
from kvgate.scoring.config import KvPolicyConfig
from kvgate.scoring.cost import Price, clip_match, fleet_factor, overlap_tokens, request_size
from kvgate.scoring.kv import KvPolicy

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
    cost = Price(request_size(req(10)), cand("a", gpu=gpu, cpu=cpu, disk=disk), NO_LOAD)
    assert cost.credited == pytest.approx(credited)
    assert cost.prefill == pytest.approx(10 - credited)
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
    cost = Price(request_size(req(10)), cand("a", gpu=3, cpu=3, disk=3), config)
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
    cost = Price(request_size(req(10)), cand("a", gpu=10, **load), DEFAULT)
    assert cost.queued == pytest.approx(queued)
    assert cost.decode == pytest.approx(decode)
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
    c = cand("a", active_decode_blocks=predicted, scraped_kv_usage=usage)
    price = Price(request_size(req(10)), c, DEFAULT, kv_capacity_blocks=capacity)
    assert price.decode == pytest.approx(decode)


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
    costs = [Price(request_size(req(10)), cand("a", gpu=g), config).cost for g in range(11)]
    assert costs == [0.0] * 11


def test_large_credit_cost_is_dominated_by_prefill() -> None:
    config = KvPolicyConfig(overlap_credit=1e6)
    heavy = cand("a", gpu=9, pending_prefill_tokens=100_000, active_decode_blocks=100_000)
    light = cand("b", gpu=8)
    assert (
        Price(request_size(req(10)), heavy, config).cost
        < Price(request_size(req(10)), light, config).cost
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
    assert request_size(r).blocks == expected_blocks
    assert overlap_tokens(matched, request_size(r)) == overlap
    terms = Price(request_size(r), cand("a", gpu=matched), DEFAULT).terms()
    assert terms["overlap_tokens"] == overlap
    assert terms["uncached_tokens"] == max(prompt_tokens or blocks * BS, 0) - overlap


def test_clip_match_keeps_tier_order() -> None:
    assert clip_match(PrefixMatch(3, 4, 5), 5) == PrefixMatch(3, 2, 0)
    assert clip_match(PrefixMatch(0, 0, 5), 2) == PrefixMatch(0, 0, 2)


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
    policy = KvPolicy(KvPolicyConfig(), rng=random.Random(0), kv_capacity_blocks=1000)
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


@pytest.mark.parametrize(
    ("shares", "factor"),
    [
        ([0.0, 0.0], 0.0),  # idle fleet: each request minimises its own TTFT
        ([0.5, 0.5], 1.0),  # half busy: one request expected behind a new one
        ([0.25, 0.75], 1.0),  # the fleet's mean
        ([1.0, 1.0], 4.0),  # capped at 0.8 utilisation: 0.8 / 0.2
        ([2.0, -1.0], 1.0),  # garbage shares are clipped into 0..1 first
    ],
)
def test_fleet_factor(shares: list[float], factor: float) -> None:
    candidates = [cand(f"w{i}", prefill_busy_share=s) for i, s in enumerate(shares)]
    assert fleet_factor(candidates) == pytest.approx(factor)
