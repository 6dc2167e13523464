"""Table-driven tests of the ``kv`` cost in seconds (``cost_model="seconds"``): tiers, load
blend, the predicted TTFT and its parts, the fleet and cache terms, the choices they make,
explain terms."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from pydantic import ValidationError

from index.types import BlockKey, PrefixMatch, WorkerId
from scoring.api import DEFAULT_TTFT, Candidate, RouteRequest, WorkerLoad
from scoring.calibration import TtftParams
from scoring.config import KvPolicyConfig
from scoring.cost_parts import request_size
from scoring.cost_seconds import FleetView, fleet_factor, worker_cost
from scoring.kv import KvPolicy

BS = 16


def req(blocks: int = 10, prompt_tokens: int | None = None, **kw: object) -> RouteRequest:
    tokens = blocks * BS if prompt_tokens is None else prompt_tokens
    keys = [BlockKey(1000 + i) for i in range(blocks)]
    return RouteRequest(model="m", block_keys=keys, block_size=BS, prompt_tokens=tokens, **kw)  # type: ignore[arg-type]


# A worker that prefills 1,000 tokens per second, queued work delaying a newcomer fully, no
# base time and no interference: a predicted TTFT is (uncached + queued tokens) / 1000 s.
UNIT = TtftParams(base_s=0.0, prefill_s=1.0, queued_s=1.0, interference_s=0.0)


def cand(
    name: str,
    *,
    gpu: int = 0,
    cpu: int = 0,
    disk: int = 0,
    ttft: TtftParams = UNIT,
    **load: Any,
) -> Candidate:
    return Candidate(
        worker=WorkerId(name),
        url=f"http://{name}",
        load=WorkerLoad(**load),
        match=PrefixMatch(gpu=gpu, cpu=cpu, disk=disk),
        ttft=ttft,
    )


def seconds(**knobs: Any) -> KvPolicyConfig:
    """The kv policy's config with the cost in seconds deciding."""
    return KvPolicyConfig(cost_model="seconds", **knobs)


DEFAULT = seconds()
# isolate the TTFT: no cache-spend term (and, with no busy share, no fleet term)
PLAIN = seconds(footprint_weight=0.0)


def policy(**knobs: Any) -> KvPolicy:
    return KvPolicy(seconds(**knobs), rng=random.Random(0))


@pytest.mark.parametrize(
    ("gpu", "cpu", "disk", "credited"),
    [
        (0, 0, 0, 0.0),
        (2, 4, 4, 2 + 3.0 + 1.0),  # the tier weights (the table: test_scoring_cost.py)
        (12, 0, 0, 10.0),  # more than the request: clipped
    ],
)
def test_tier_credit_saves_prefill_seconds(gpu: int, cpu: int, disk: int, credited: float) -> None:
    size = request_size(req(10, prompt_tokens=170))  # 10 whole blocks and a 10-token tail
    cost = worker_cost(size, cand("a", gpu=gpu, cpu=cpu, disk=disk), PLAIN)
    assert cost.credited == pytest.approx(credited)
    assert cost.prefill_blocks == pytest.approx(11 - credited)
    # every credited block saves its 16 tokens of prefill, at 1,000 tokens per second
    assert cost.ttft.prefill_s == pytest.approx((170 - credited * BS) / 1000)
    assert cost.cost == pytest.approx(cost.ttft.total_s)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    aligned = worker_cost(request_size(req(10)), cand("a", gpu=10), PLAIN)
    assert aligned.ttft.prefill_s == pytest.approx(BS / 1000)  # vLLM recomputes the last block
    tail = worker_cost(request_size(req(10, prompt_tokens=161)), cand("a", gpu=10), PLAIN)
    assert tail.ttft.prefill_s == pytest.approx(1 / 1000)


@pytest.mark.parametrize(("credit", "credited"), [(1.0, 9.0), (0.5, 4.5), (0.0, 0.0)])
def test_overlap_credit_scales_the_tier_credited_match(credit: float, credited: float) -> None:
    config = seconds(footprint_weight=0.0, seconds_overlap_credit=credit)
    size = request_size(req(10, prompt_tokens=170))
    cost = worker_cost(size, cand("a", gpu=6, cpu=4), config)  # 6 + 4 x 0.75 = 9 blocks
    assert cost.credited == pytest.approx(credited)
    assert cost.ttft.prefill_s == pytest.approx((170 - credited * BS) / 1000)
    assert cost.overlap_tokens == 160  # what is cached does not change, only its weight


@pytest.mark.parametrize(
    ("load", "queued", "context"),
    [
        ({}, 0.0, 0.0),
        ({"pending_prefill_tokens": 160}, 160.0, 0.0),
        ({"active_decode_blocks": 50}, 0.0, 800.0),
        # scraped waiting converted at 512 tokens per request; max, not sum
        ({"pending_prefill_tokens": 160, "scraped_waiting": 2}, 1024.0, 0.0),
        ({"pending_prefill_tokens": 3200, "scraped_waiting": 2}, 3200.0, 0.0),
        # KV usage only counts when the capacity is known (see test below)
        ({"active_decode_blocks": 50, "scraped_kv_usage": 0.9}, 0.0, 800.0),
    ],
)
def test_load_terms(load: dict[str, Any], queued: float, context: float) -> None:
    cost = worker_cost(request_size(req(10, prompt_tokens=161)), cand("a", gpu=10, **load), PLAIN)
    assert cost.queued.blended == pytest.approx(queued)
    assert cost.context.blended == pytest.approx(context)
    assert cost.ttft.queue_s == pytest.approx(queued / 1000)
    assert cost.cost == pytest.approx((queued + 1) / 1000)  # one token left to prefill


@pytest.mark.parametrize(
    ("predicted", "usage", "capacity", "context"),
    [
        (100, 0.5, 1000, 500.0 * BS),  # engine sees more (traffic kvgate did not route)
        (800, 0.5, 1000, 800.0 * BS),  # kvgate knows more (scrape is stale)
        (100, None, 1000, 100.0 * BS),  # never scraped
        (100, 0.5, None, 100.0 * BS),  # capacity unknown
    ],
)
def test_context_blend_is_max_of_predicted_and_scraped(
    predicted: int, usage: float | None, capacity: int | None, context: float
) -> None:
    config = seconds(kv_capacity_blocks=capacity)
    c = cand("a", active_decode_blocks=predicted, scraped_kv_usage=usage)
    assert worker_cost(request_size(req(10)), c, config).context.blended == pytest.approx(context)


def test_predicted_ttft_parts() -> None:
    """base + queued work + own prefill + decode interference, each from its coefficient."""
    params = TtftParams(base_s=0.05, prefill_s=0.1, queued_s=0.05, interference_s=0.2)
    c = cand("a", gpu=4, ttft=params, pending_prefill_tokens=2000, active_decode_blocks=6250)
    cost = worker_cost(request_size(req(10, prompt_tokens=1064)), c, PLAIN)
    own = 1064 - 4 * BS  # 1,000 tokens
    assert cost.ttft.base_s == 0.05
    assert cost.ttft.prefill_s == pytest.approx(0.1 * own / 1000)
    assert cost.ttft.queue_s == pytest.approx(0.05 * 2000 / 1000)
    # (own + queued) thousand tokens x context in hundreds of thousands (100,000 tokens)
    assert cost.ttft.interference_s == pytest.approx(0.2 * 3.0 * 1.0)
    assert cost.ttft.wait_s == pytest.approx(0.1 + 0.1)
    assert cost.cost == pytest.approx(0.05 + 0.1 + 0.1 + 0.6)


@pytest.mark.parametrize(
    ("shares", "factor"),
    [
        ([0.0, 0.0], 0.0),  # idle fleet: each request minimises its own TTFT
        ([0.5, 0.5], 1.0),  # half busy: one request expected behind a new one
        ([0.25, 0.75], 1.0),  # the fleet's mean
        ([1.0, 1.0], 4.0),  # capped at max_utilisation 0.8: 0.8 / 0.2
        ([2.0, -1.0], 1.0),  # garbage shares are clipped into 0..1 first
    ],
)
def test_fleet_factor(shares: list[float], factor: float) -> None:
    candidates = [cand(f"w{i}", prefill_busy_share=s) for i, s in enumerate(shares)]
    assert fleet_factor(candidates, DEFAULT) == pytest.approx(factor)
    assert fleet_factor(candidates, seconds(max_utilisation=0.0)) == 0.0


def test_fleet_and_cache_terms_count_own_prefill_seconds_again() -> None:
    size = request_size(req(10, prompt_tokens=1000))
    cost = worker_cost(size, cand("a"), DEFAULT, footprint_ratio=2.0, fleet=FleetView(1.5, 1.0))
    own = cost.ttft.prefill_s
    assert own == pytest.approx(1.0)
    assert cost.fleet_s == pytest.approx(1.5 * own)
    assert cost.cache_s == pytest.approx(0.5 * (2.0 - 1.0) * own)
    assert cost.cost == pytest.approx(cost.ttft.total_s + cost.fleet_s + cost.cache_s)


# --- the choices the cost makes ------------------------------------------------------------


def test_a_session_stays_home_while_its_queue_is_shorter_than_recomputing() -> None:
    home = cand("home", gpu=100, pending_prefill_tokens=1000)  # 1 s of queue, all cached
    idle = cand("idle")  # 1.6 s to recompute the 100-block history
    assert policy().rank(req(100, prompt_tokens=1610), [home, idle]).chosen == "home"


def test_a_session_leaves_a_home_queued_longer_than_recomputing_elsewhere() -> None:
    """The issue's light-load example: a fully cached 33k-token turn would wait 1.9 s at home,
    an idle replica recomputes it in 0.93 s. At low utilisation the cost is the TTFT."""
    rate = TtftParams(base_s=0.0, prefill_s=1 / 35.5, queued_s=1 / 35.5, interference_s=0.0)
    home = cand("home", gpu=2062, ttft=rate, pending_prefill_tokens=67_000)
    idle = cand("idle", ttft=rate)
    chosen = policy().rank(req(2062, prompt_tokens=33_000), [home, idle]).chosen
    assert chosen == WorkerId("idle")


def test_a_busy_fleet_keeps_sessions_on_their_cache() -> None:
    """Same two replicas when the fleet is 60% busy: recomputing 0.93 s delays about 1.5
    requests behind it (fleet factor 0.6 / 0.4): 0.93 x 2.5 > 1.9 s of queue at home."""
    rate = TtftParams(base_s=0.0, prefill_s=1 / 35.5, queued_s=1 / 35.5, interference_s=0.0)
    home = cand("home", gpu=2062, ttft=rate, pending_prefill_tokens=67_000, prefill_busy_share=0.6)
    idle = cand("idle", ttft=rate, prefill_busy_share=0.6)
    chosen = policy().rank(req(2062, prompt_tokens=33_000), [home, idle]).chosen
    assert chosen == WorkerId("home")


def test_a_faster_worker_wins_a_cold_request() -> None:
    fast = cand("fast", ttft=TtftParams(0.0, 0.1, 0.1, 0.0))
    slow = cand("slow", ttft=TtftParams(0.0, 1.0, 1.0, 0.0))
    assert policy().rank(req(100), [slow, fast]).chosen == WorkerId("fast")
    # unless its queue is longer than the difference: 1.6 s of prefill on the slow one
    busy = cand("fast", ttft=TtftParams(0.0, 0.1, 0.1, 0.0), pending_prefill_tokens=20_000)
    assert policy().rank(req(100), [slow, busy]).chosen == WorkerId("slow")


def test_a_learned_queued_weight_below_one_makes_queues_weigh_less() -> None:
    """Where chunks interleave, queued work delays a newcomer less than its own prefill: a
    worker whose model learned that keeps a session whose home queue is longer."""
    home_params = TtftParams(0.0, 1.0, 0.25, 0.0)
    home = cand("home", gpu=100, ttft=home_params, pending_prefill_tokens=4000)
    idle = cand("idle", ttft=home_params)
    assert policy().rank(req(100, prompt_tokens=1610), [home, idle]).chosen == "home"
    serial = cand("home", gpu=100, pending_prefill_tokens=4000)
    assert policy().rank(req(100, prompt_tokens=1610), [serial, idle]).chosen == "idle"


def test_the_default_model_ranks_by_tokens_before_anything_is_learned() -> None:
    """Every worker starts from the same prior: the choice is the tokens' (rate-free)."""
    home = Candidate(WorkerId("home"), "http://home", WorkerLoad(pending_prefill_tokens=500),
                     PrefixMatch(gpu=50))  # fmt: skip
    other = Candidate(WorkerId("other"), "http://other", WorkerLoad())
    assert home.ttft is DEFAULT_TTFT
    assert policy().rank(req(50, prompt_tokens=810), [home, other]).chosen == "home"


@pytest.mark.parametrize(
    ("credit", "chosen"),
    [(1.0, "home"), (0.7, "home"), (0.5, "idle"), (0.0, "idle")],
)
def test_a_lower_seconds_overlap_credit_gives_the_cache_less_weight_against_load(
    credit: float, chosen: str
) -> None:
    """A fully cached session with 1 s of queue at home, 1.6 s to recompute on an idle
    replica: home costs 1 s + (1 - credit) x 1.6 s of prefill, the idle replica 1.6 s."""
    home = cand("home", gpu=100, pending_prefill_tokens=1000)
    idle = cand("idle")
    ranked = policy(seconds_overlap_credit=credit).rank(req(100, prompt_tokens=1610), [home, idle])
    assert ranked.chosen == chosen


def test_no_seconds_overlap_credit_is_load_only() -> None:
    """0: the cache does not count at all, the less loaded replica wins however much the
    other holds; 1: the cached replica wins against a slightly shorter queue."""
    cached = cand("cached", gpu=100, pending_prefill_tokens=100)
    lighter = cand("lighter", pending_prefill_tokens=50)
    request = req(100, prompt_tokens=1610)
    assert policy(seconds_overlap_credit=0.0).rank(request, [cached, lighter]).chosen == "lighter"
    assert policy(seconds_overlap_credit=1.0).rank(request, [cached, lighter]).chosen == "cached"


@pytest.mark.parametrize(
    ("tiers", "chosen"),
    [
        ({}, "cpu_home"),  # 100 x 0.75 credited: 410 tokens + 600 queued < 1,610 tokens
        ({"cpu_weight": 0.25, "disk_weight": 0.25}, "idle"),  # 1,210 + 600 > 1,610
    ],
)
def test_tier_weights_decide_whether_a_cpu_resident_history_is_worth_its_queue(
    tiers: dict[str, float], chosen: str
) -> None:
    cpu_home = cand("cpu_home", cpu=100, pending_prefill_tokens=600)
    idle = cand("idle")
    ranked = policy(**tiers).rank(req(100, prompt_tokens=1610), [cpu_home, idle])
    assert ranked.chosen == chosen


@pytest.mark.parametrize(("cpu_weight", "chosen"), [(0.75, "gpu50"), (1.0, "cpu60")])
def test_a_gpu_match_beats_a_longer_cpu_match_by_its_tier_weight(
    cpu_weight: float, chosen: str
) -> None:
    """50 GPU blocks against 60 CPU blocks: 50 > 60 x 0.75, but not 60 x 1."""
    gpu50 = cand("gpu50", gpu=50)
    cpu60 = cand("cpu60", cpu=60)
    ranked = policy(cpu_weight=cpu_weight).rank(req(100), [gpu50, cpu60])
    assert ranked.chosen == chosen


REQUIRED_TERMS = {
    "gpu_blocks",
    "cpu_blocks",
    "disk_blocks",
    "overlap_tokens",
    "request_blocks",
    "credited",
    "prefill_blocks",
    "queued_tokens",
    "context_tokens",
    "ttft_s",
    "ttft_base_s",
    "ttft_queue_s",
    "ttft_prefill_s",
    "ttft_interference_s",
    "prefill_tokens_per_s",
    "queued_weight",
    "fleet_factor",
    "fleet_s",
    "cache_footprint_s",
    "duplicated_tokens",
    "reuse",
    "cache_duplicate_s",
    "cache_s",
    "cost",
    "in_flight",
    "uncached_tokens",
}


def test_explain_terms_present_and_consistent() -> None:
    policy = KvPolicy(seconds(kv_capacity_blocks=1000), rng=random.Random(0))
    candidates = [
        cand(
            "a",
            gpu=6,
            cpu=2,
            disk=1,
            pending_prefill_tokens=320,
            active_decode_blocks=40,
            prefill_busy_share=0.5,
            footprint=3.0,
        ),
        cand("b", gpu=2, scraped_waiting=3, scraped_kv_usage=0.5, footprint=1.0),
    ]
    decision = policy.rank(req(10), candidates)
    assert len(decision.scores) == 2
    for score in decision.scores:
        t = score.terms
        assert set(t) >= REQUIRED_TERMS
        assert all(math.isfinite(v) for v in t.values())
        assert t["cost"] == score.cost
        parts = t["ttft_base_s"] + t["ttft_queue_s"] + t["ttft_prefill_s"]
        assert t["ttft_s"] == pytest.approx(parts + t["ttft_interference_s"])
        assert t["cost"] == pytest.approx(t["ttft_s"] + t["fleet_s"] + t["cache_s"])
        assert t["fleet_factor"] == pytest.approx(0.25 / 0.75)  # mean busy share 0.25
        assert score.reason
    a = next(s for s in decision.scores if s.worker == "a").terms
    assert (a["gpu_blocks"], a["cpu_blocks"], a["disk_blocks"]) == (6, 2, 1)
    assert a["credited"] == pytest.approx(6 + 1.5 + 0.25)
    assert a["prefill_blocks"] == pytest.approx(10 - a["credited"])
    assert a["overlap_tokens"] == 9 * BS
    assert a["prefill_tokens_per_s"] == pytest.approx(1000) and a["queued_weight"] == 1.0
    assert "scraped_queued_tokens" not in a
    b = next(s for s in decision.scores if s.worker == "b").terms
    assert b["scraped_queued_tokens"] == pytest.approx(3 * 512)
    assert b["scraped_context_tokens"] == pytest.approx(500 * BS)


@pytest.mark.parametrize(
    "bad",
    [
        {"cost_model": "tokens"},
        {"prior_prefill_tokens_per_s": 0},
        {"calibration_window": 1},
        {"max_utilisation": 1.0},
        {"seconds_overlap_credit": 1.5},  # a cached block cannot save more than its prefill
        {"seconds_overlap_credit": -0.1},
        {"duplicate_weight": 2.0},
    ],
)
def test_config_rejects_bad_values_naming_the_field(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as info:
        KvPolicyConfig(**bad)  # type: ignore[arg-type]
    assert list(bad)[-1] in str(info.value)


def test_config_defaults_documented() -> None:
    config = KvPolicyConfig()
    assert config.cost_model == "blocks"  # the seconds cost is chosen, not the default
    assert (config.footprint_weight, config.max_utilisation) == (0.5, 0.8)
    assert config.seconds_overlap_credit == 1.0  # the calibrated model as is
    prior = TtftParams.prior(config.prior_prefill_tokens_per_s, config.prior_base_s)
    assert prior == DEFAULT_TTFT  # the candidates' default is the configured prior


# --- eviction risk: a cached match behind a queue on a full cache ------------------------


# (the discount itself, shared with the block-unit cost, is tested in test_scoring_cost.py)


def test_a_session_leaves_a_home_whose_queue_would_evict_its_history() -> None:
    """The thrashing case of the agentic benchmark at high load: the session's history is
    still cached at home, but the prefill queued there will evict it before the turn runs."""
    home = cand("home", gpu=100, scraped_kv_usage=0.95, kv_capacity_blocks=100,
                pending_prefill_tokens=80 * BS)  # fmt: skip
    idle = cand("idle", scraped_kv_usage=0.3, kv_capacity_blocks=100)
    # 80 queued blocks, 5 free, a 100-block cache: a quarter of the history survives, so
    # home costs 1.28 s of queue + 1.36 s of prefill against 1.76 s idle; trusted, the
    # history would make home cost 1.28 + 0.16 s
    risky = KvPolicy(seconds(eviction_risk_weight=1.0), rng=random.Random(0))
    assert risky.rank(req(110), [home, idle]).chosen == WorkerId("idle")
    off = KvPolicy(seconds(eviction_risk_weight=0.0), rng=random.Random(0))
    assert off.rank(req(110), [home, idle]).chosen == WorkerId("home")


def test_attention_makes_a_long_context_cost_more_than_its_new_tokens() -> None:
    """Prefill attends to every earlier token: 1,000 new tokens after a 40,000-token cached
    history cost more than a fresh 1,000-token prompt, and recomputing the history costs
    quadratically more than its tokens alone (the learned ``attention_s``)."""
    params = TtftParams(base_s=0.0, prefill_s=0.03, queued_s=0.03, interference_s=0.0,
                        attention_s=0.1)  # fmt: skip
    long_turn = req(2562, prompt_tokens=41_000)
    home = worker_cost(request_size(long_turn), cand("h", gpu=2500, ttft=params), PLAIN)
    fresh = worker_cost(request_size(req(63, prompt_tokens=1000)), cand("f", ttft=params), PLAIN)
    assert home.ttft.prefill_s > fresh.ttft.prefill_s
    moved = worker_cost(request_size(long_turn), cand("m", ttft=params), PLAIN)
    linear = 0.03 * 41  # the tokens alone
    assert moved.ttft.prefill_s == pytest.approx(linear + 0.1 * 41_000 * 40_999 / 2 / 1e8)


# --- the cache spend of a second copy --------------------------------------------------------


def test_recomputing_history_cached_elsewhere_spends_the_cache_it_displaces() -> None:
    """An idle replica would recompute the 100 blocks the session's home holds: those 1,600
    tokens are a second copy in the fleet; at a fleet reuse of 0.75 (the candidates' mean),
    their prefill counts another 0.75 times. The home duplicates nothing."""
    home = cand("home", gpu=100, pending_prefill_tokens=1000, reuse=0.9)
    idle = cand("idle", reuse=0.6)
    decision = policy().rank(req(100, prompt_tokens=1610), [home, idle])
    terms = {s.worker: s.terms for s in decision.scores}
    assert terms["idle"]["duplicated_tokens"] == pytest.approx(1600)
    own = terms["idle"]["ttft_prefill_s"]
    assert terms["idle"]["cache_duplicate_s"] == pytest.approx(0.75 * own * 1600 / 1610)
    assert terms["home"]["duplicated_tokens"] == 0 and terms["home"]["cache_duplicate_s"] == 0
    assert terms["idle"]["cache_s"] == pytest.approx(
        terms["idle"]["cache_duplicate_s"] + terms["idle"]["cache_footprint_s"]
    )


def test_a_second_copy_into_a_little_used_cache_costs_little() -> None:
    """The copy evicts in proportion to the destination's cache demand (its footprint ratio,
    up to 1): a replica whose cache nobody uses yet takes a copy of a shared prefix for free
    (new sessions spread instead of piling on the one replica that holds it); one in as
    much demand as the mean pays the whole second-copy spend (a session does not ping-pong
    between homes)."""
    holder = cand("holder", gpu=40, reuse=0.8, footprint=300.0)
    unused = cand("unused", reuse=0.8, footprint=0.0)
    busy = cand("busy", reuse=0.8, footprint=100.0)
    terms = {s.worker: s.terms for s in policy().rank(req(60), [holder, unused, busy]).scores}
    assert terms["unused"]["duplicated_tokens"] == pytest.approx(40 * BS)
    assert terms["unused"]["cache_duplicate_s"] == 0.0  # footprint ratio 0
    own = terms["busy"]["ttft_prefill_s"]
    ratio = terms["busy"]["footprint_ratio"]  # 100 / mean 133
    assert terms["busy"]["cache_duplicate_s"] == pytest.approx(0.8 * ratio * own * 40 / 60)
