"""The cache-footprint term of the ``kv`` cost and the ledger's decayed footprints."""

from __future__ import annotations

import random

import pytest
from test_scoring_cost import cand, req

from kvgate.backends.config import WorkerConfig
from kvgate.backends.registry import WorkerRegistry
from kvgate.index.types import WorkerId
from kvgate.scheduling.ledger import FOOTPRINT_HALF_LIFE_S, Ledger
from kvgate.scoring.config import KvPolicyConfig
from kvgate.scoring.cost import Price, footprint_ratios, request_size
from kvgate.scoring.kv import KvPolicy

ON = KvPolicyConfig(footprint_weight=0.5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ledger(clock: Clock, *names: str) -> Ledger:
    reg = WorkerRegistry(clock=clock)
    for name in names:
        reg.add(WorkerConfig(url=f"http://{name}", models=["m"]))
    return Ledger(reg, clock=clock)


def test_ratios_are_relative_to_the_mean() -> None:
    loads = [cand("a", footprint=30.0), cand("b", footprint=10.0), cand("c", footprint=20.0)]
    assert footprint_ratios(loads) == pytest.approx([1.5, 0.5, 1.0])
    assert footprint_ratios([cand("a"), cand("b")]) == [1.0, 1.0]  # nothing routed yet


def test_off_at_weight_zero_and_visible_when_on() -> None:
    size = request_size(req(10))
    heavy = cand("a", footprint=3.0)
    off = KvPolicyConfig(footprint_weight=0.0)
    assert Price(size, heavy, off, 2.0).cost == Price(size, heavy, off).cost
    cost = Price(size, heavy, ON, 2.0)
    assert cost.terms()["footprint_ratio"] == 2.0
    # every one of the 10 blocks to prefill is priced 1 + 0.5 * (2 - 1)
    assert cost.terms()["footprint_cost"] == pytest.approx(0.5 * 10 * (2.0 - 1.0))
    assert cost.cost == pytest.approx(10 * 1.5)


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


def test_ledger_footprint_decays_with_the_half_life() -> None:
    clock = Clock()
    sent = ledger(clock, "a", "b")
    a, b = (WorkerId(f"http://{n}") for n in "ab")
    sent.begin(a, 0, 100).finish()
    clock.now += FOOTPRINT_HALF_LIFE_S  # one half-life later
    sent.begin(b, 0, 100).finish()
    ratios = footprint_ratios([e.candidate() for e in sent])
    assert ratios == pytest.approx([2 * 50 / 150, 2 * 100 / 150])


def test_ledger_footprint_survives_rebasing() -> None:
    """Hours of uptime: values are rescaled, ratios are unchanged, nothing overflows."""
    clock = Clock()
    sent = ledger(clock, "a", "b")
    a, b = (WorkerId(f"http://{n}") for n in "ab")
    for step in range(2000):  # 2000 half-lives: 2**2000 would overflow a float
        clock.now += FOOTPRINT_HALF_LIFE_S
        sent.begin(a if step % 4 else b, 0, 8).finish()
    entry_a, entry_b = list(sent)
    assert entry_a.footprint < 2.0**300 and entry_b.footprint < 2.0**300
    ratio_a, ratio_b = footprint_ratios([entry_a.candidate(), entry_b.candidate()])
    assert ratio_a > ratio_b > 0.0
