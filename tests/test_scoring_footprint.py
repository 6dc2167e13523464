"""The cache-footprint term of the ``kv`` cost and the registry's decayed footprints."""

from __future__ import annotations

import random

import pytest
from test_scoring_cost import cand, req

from backends.config import WorkerConfig
from backends.registry import WorkerRegistry
from index.types import WorkerId
from scoring.api import DEFAULT_TTFT
from scoring.config import KvPolicyConfig
from scoring.cost_blocks import worker_cost
from scoring.cost_parts import footprint_ratios, request_size
from scoring.cost_seconds import worker_cost as seconds_cost
from scoring.kv import KvPolicy

ON = KvPolicyConfig(footprint_weight=0.5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def registry(clock: Clock, *names: str, half_life_s: float = 10.0) -> WorkerRegistry:
    reg = WorkerRegistry(footprint_half_life_s=half_life_s, clock=clock)
    for name in names:
        reg.add(WorkerConfig(url=f"http://{name}", models=["m"]))
    return reg


def test_ratios_are_relative_to_the_mean() -> None:
    loads = [cand("a", footprint=30.0), cand("b", footprint=10.0), cand("c", footprint=20.0)]
    assert footprint_ratios(loads) == pytest.approx([1.5, 0.5, 1.0])
    assert footprint_ratios([cand("a"), cand("b")]) == [1.0, 1.0]  # nothing routed yet


def test_off_at_weight_zero_and_visible_when_on() -> None:
    size = request_size(req(10))
    heavy = cand("a", footprint=3.0)
    off = KvPolicyConfig(footprint_weight=0.0)
    assert worker_cost(size, heavy, off, 2.0).cost == worker_cost(size, heavy, off).cost
    cost = worker_cost(size, heavy, ON, 2.0)
    assert cost.terms()["footprint_ratio"] == 2.0
    # every one of the 10 blocks to prefill is priced 1 + 0.5 * (2 - 1)
    assert cost.terms()["footprint_cost"] == pytest.approx(0.5 * 10 * (2.0 - 1.0))
    assert cost.cost == pytest.approx(10 * 1.5)


def test_seconds_cost_counts_the_prefill_seconds_again_above_the_floor() -> None:
    size = request_size(req(10))
    heavy = cand("a", footprint=3.0)
    on = KvPolicyConfig(cost_model="seconds", footprint_weight=0.5)
    cost = seconds_cost(size, heavy, on, 2.0)
    assert heavy.ttft == DEFAULT_TTFT
    # the 160 tokens to prefill (8 ms at the prior's 20,000 tokens/s) count 0.5 x (2 - 1) more
    assert cost.ttft.prefill_s == pytest.approx(0.008)
    assert cost.terms()["cache_s"] == pytest.approx(0.5 * (2.0 - 1.0) * 0.008)
    assert cost.cost == pytest.approx(0.02 + 0.008 * 1.5)
    # a session keeps its home with the seconds cost too: cached blocks write nothing
    alone = [cand("a", gpu=100, footprint=500.0)] + [cand(f"w{i}") for i in range(7)]
    policy = KvPolicy(on, random.Random(0))
    assert policy.rank(req(104), alone).ranked[0] == WorkerId("a")


def test_a_new_session_goes_where_the_footprint_is_smallest() -> None:
    """Same instantaneous load everywhere: only the footprint tells the workers apart."""
    policy = KvPolicy(ON, random.Random(0))
    workers = [cand("a", footprint=90.0), cand("b", footprint=10.0), cand("c", footprint=50.0)]
    assert policy.rank(req(10), workers).ranked == [WorkerId("b"), WorkerId("c"), WorkerId("a")]


def test_a_session_keeps_its_home_whatever_the_footprints() -> None:
    """Cached blocks are not priced: a lone session on an otherwise idle fleet (its home's
    ratio at the maximum, n) does not hop to an empty worker."""
    policy = KvPolicy(ON, random.Random(0))
    alone = [cand("a", gpu=100, footprint=500.0)] + [cand(f"w{i}") for i in range(7)]
    assert footprint_ratios(alone)[0] == pytest.approx(8.0)
    assert policy.rank(req(104), alone).ranked[0] == WorkerId("a")
    # its terms: ratio 8 counts as 2 (clipped), the empty workers' 0 as 0.5
    scores = {s.worker: s.terms for s in policy.rank(req(104), alone).scores}
    assert scores[WorkerId("a")]["footprint_cost"] == pytest.approx(0.5 * 4 * 1.0)
    assert scores[WorkerId("w0")]["footprint_cost"] == pytest.approx(0.5 * 104 * -0.5)


def test_a_shared_prefix_does_not_outweigh_a_crowded_cache() -> None:
    """A new session whose only cached part is a shared prefix (a sub-agent's prompt) pays
    for its own blocks at the crowded replica's price, the prefix at none."""
    policy = KvPolicy(ON, random.Random(0))
    workers = [cand("a", gpu=4, footprint=300.0), cand("b", footprint=10.0)]
    # a: 96 blocks at 1 + 0.5 * (1.94 - 1) = 1.47; b: 100 blocks at 1 + 0.5 * -0.5 = 0.75
    assert policy.rank(req(100), workers).ranked[0] == WorkerId("b")


def test_registry_footprint_decays_with_the_half_life() -> None:
    clock = Clock()
    reg = registry(clock, "a", "b")
    a, b = reg.get(WorkerId("http://a")), reg.get(WorkerId("http://b"))
    reg.begin(a.id, 0, 100).finish()
    clock.now += 10.0  # one half-life later
    reg.begin(b.id, 0, 100).finish()
    ratios = footprint_ratios([a.candidate(), b.candidate()])
    assert ratios == pytest.approx([2 * 50 / 150, 2 * 100 / 150])


def test_registry_footprint_survives_rebasing() -> None:
    """Hours of uptime: values are rescaled, ratios are unchanged, nothing overflows."""
    clock = Clock()
    reg = registry(clock, "a", "b", half_life_s=1.0)
    a, b = reg.get(WorkerId("http://a")), reg.get(WorkerId("http://b"))
    for step in range(2000):  # 2000 half-lives: 2**2000 would overflow a float
        clock.now += 1.0
        reg.begin((a if step % 4 else b).id, 0, 8).finish()
    assert a.footprint < 2.0**300 and b.footprint < 2.0**300
    ratio_a, ratio_b = footprint_ratios([a.candidate(), b.candidate()])
    assert ratio_a > ratio_b > 0.0
