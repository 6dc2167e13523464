"""The KV fit term: a worker whose KV cache cannot hold the request beside its running
requests loses its match's credit while another candidate has room (docs/scoring.md,
*KV fit*), in both costs; and the held blocks it reads, with shared prefixes counted once."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from backends.config import WorkerConfig
from backends.registry import FLIGHTS_COMPARED, WorkerRegistry
from index.keys import shared_prefix_blocks
from index.types import BlockKey, PrefixMatch, WorkerId
from scoring.api import Candidate, RouteRequest, WorkerLoad
from scoring.config import KvPolicyConfig
from scoring.cost_parts import kv_fit_shares, kv_overcommit, kv_shortfall, request_size
from scoring.kv import KvPolicy

BS = 16


def req(blocks: int) -> RouteRequest:
    keys = [BlockKey(7000 + i) for i in range(blocks)]
    return RouteRequest(model="m", block_keys=keys, block_size=BS, prompt_tokens=blocks * BS)


def cand(name: str, gpu: int = 0, in_flight_prefix: int = 0, **load: Any) -> Candidate:
    return Candidate(
        worker=WorkerId(name),
        url=f"http://{name}",
        load=WorkerLoad(**load),
        match=PrefixMatch(gpu=gpu),
        in_flight_prefix=in_flight_prefix,
    )


def shortfall(
    blocks: int,
    gpu: int,
    config: KvPolicyConfig | None = None,
    in_flight_prefix: int = 0,
    **load: Any,
) -> float:
    candidate = cand("w", gpu, in_flight_prefix, **load)
    return kv_shortfall(candidate, request_size(req(blocks)), config or KvPolicyConfig())


def test_no_shortfall_without_a_known_capacity() -> None:
    assert shortfall(100, 0, active_decode_blocks=10**6) == 0.0
    capped = KvPolicyConfig(kv_capacity_blocks=500)
    assert shortfall(100, 0, capped, active_decode_blocks=450) == 50.0


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        ({"active_decode_blocks": 0}, 0.0),
        ({"active_decode_blocks": 900}, 0.0),  # 900 + 100 new = 1,000: fits exactly
        ({"active_decode_blocks": 950}, 50.0),
        ({"active_decode_blocks": 100, "scraped_kv_usage": 0.95}, 50.0),  # the larger one
        ({"active_decode_blocks": 5_000}, 100.0),  # at most the request's new blocks
    ],
)
def test_without_kv_fit_cached_the_shortfall_is_held_plus_new_blocks_past_the_capacity(
    load: dict[str, Any], expected: float
) -> None:
    # 300 blocks, 200 of them cached on the GPU: 100 new
    new_only = KvPolicyConfig(kv_fit_cached=False)
    assert shortfall(300, 200, new_only, kv_capacity_blocks=1_000, **load) == pytest.approx(
        expected
    )


def test_kv_fit_cached_counts_the_cached_match_as_needing_room_too() -> None:
    """300 blocks, 200 cached: beside 800 held blocks of 1,000 the 100 new ones fit, but the
    200 cached ones would be evicted for the running requests before it runs."""
    cached = KvPolicyConfig()  # the default
    new_only = KvPolicyConfig(kv_fit_cached=False)
    assert shortfall(300, 200, new_only, kv_capacity_blocks=1_000, active_decode_blocks=800) == 0.0
    assert shortfall(300, 200, cached, kv_capacity_blocks=1_000, active_decode_blocks=800) == (
        pytest.approx(100.0)
    )
    assert shortfall(300, 200, cached, kv_capacity_blocks=1_000, active_decode_blocks=700) == 0.0
    full = shortfall(300, 200, cached, kv_capacity_blocks=1_000, active_decode_blocks=5_000)
    assert full == pytest.approx(300.0)  # at most the request's blocks


def test_kv_fit_cached_counts_a_prefix_held_by_a_request_in_flight_once() -> None:
    """A sibling in flight holds the first 150 of the 200 cached blocks: they are among the
    800 held ones already (pinned, not evictable), so only 150 of the 300 need room."""
    cached = KvPolicyConfig()  # the default
    held = {"kv_capacity_blocks": 1_000, "active_decode_blocks": 800}
    assert shortfall(300, 200, cached, **held) == pytest.approx(100.0)
    assert shortfall(300, 200, cached, in_flight_prefix=150, **held) == 0.0
    assert shortfall(
        300, 200, cached, in_flight_prefix=150, kv_capacity_blocks=1_000, active_decode_blocks=900
    ) == pytest.approx(50.0)
    whole = shortfall(300, 300, cached, in_flight_prefix=10**6, **held)
    assert whole == 0.0  # at most the request's blocks are held for it
    new_only = KvPolicyConfig(kv_fit_cached=False)
    assert shortfall(300, 200, new_only, in_flight_prefix=150, **held) == 0.0  # the new ones


def test_fit_shares_withdraw_credit_only_while_another_candidate_fits() -> None:
    config = KvPolicyConfig()
    assert kv_fit_shares([0.0, 30.0, 0.0], config) == [1.0, 0.0, 1.0]
    assert kv_fit_shares([10.0, 30.0], config) == [1.0, 1.0]  # nowhere fits: all wait alike
    half = KvPolicyConfig(kv_fit_weight=0.5)
    assert kv_fit_shares([0.0, 30.0], half) == [1.0, 0.5]
    off = KvPolicyConfig(kv_fit_weight=0.0)
    assert kv_fit_shares([0.0, 30.0], off) == [1.0, 1.0]


def _fleet(home_held: int, other_held: int) -> list[Candidate]:
    """A 1,440-block request; ``home`` holds 1,200 of them (the shared prefix of a sibling
    running there), ``other`` nothing; 4,000-block caches."""
    return [
        cand(
            "home",
            gpu=1_200,
            in_flight_prefix=1_200,
            active_decode_blocks=home_held,
            kv_capacity_blocks=4_000,
        ),
        cand("other", active_decode_blocks=other_held, kv_capacity_blocks=4_000),
    ]


@pytest.mark.parametrize("cost_model", ["blocks", "seconds"])
def test_a_request_that_does_not_fit_at_home_goes_where_it_fits(cost_model: str) -> None:
    policy = KvPolicy.from_config(KvPolicyConfig(cost_model=cost_model))  # type: ignore[arg-type]
    roomy = policy.rank(req(1_440), _fleet(home_held=2_900, other_held=0))
    assert roomy.chosen == "home"  # 2,900 + 240 new blocks fit in 4,000
    full = policy.rank(req(1_440), _fleet(home_held=3_900, other_held=0))
    home, other = sorted(full.scores, key=lambda s: s.worker != "home")
    # priced as if it held nothing (the seconds cost's untrained prior then ties them)
    assert home.cost >= other.cost
    assert full.chosen == "other" or home.cost == other.cost
    assert home.terms["kv_shortfall_blocks"] == pytest.approx(140.0)
    assert home.terms["kv_fit"] == 0.0
    assert home.terms["credited"] == 0.0


@pytest.mark.parametrize("cost_model", ["blocks", "seconds"])
def test_a_home_that_cannot_keep_the_history_beside_its_running_requests_is_left(
    cost_model: str,
) -> None:
    """The session's history (1,200 blocks) cached at home, but no request in flight there
    holds it: beside 2,900 held blocks of 4,000 it would be evicted before the turn runs, so
    the turn goes where all of it fits (with the fit off for cached blocks, it stays)."""
    fleet = [
        cand("home", gpu=1_200, active_decode_blocks=2_900, kv_capacity_blocks=4_000),
        cand("other", kv_capacity_blocks=4_000),
    ]
    config = KvPolicyConfig(cost_model=cost_model)  # type: ignore[arg-type]
    decision = KvPolicy.from_config(config).rank(req(1_440), fleet)
    assert decision.chosen == "other"
    home = next(s for s in decision.scores if s.worker == "home")
    assert home.terms["kv_shortfall_blocks"] == pytest.approx(340.0)
    assert home.terms["in_flight_prefix_blocks"] == 0.0
    new_only = config.model_copy(update={"kv_fit_cached": False})
    assert KvPolicy.from_config(new_only).rank(req(1_440), fleet).chosen == "home"


@pytest.mark.parametrize("cost_model", ["blocks", "seconds"])
def test_when_nothing_fits_the_match_keeps_its_credit(cost_model: str) -> None:
    policy = KvPolicy.from_config(KvPolicyConfig(cost_model=cost_model))  # type: ignore[arg-type]
    decision = policy.rank(req(1_440), _fleet(home_held=3_900, other_held=3_900))
    assert decision.chosen == "home"
    home = next(s for s in decision.scores if s.worker == "home")
    assert home.terms["kv_fit"] == 1.0 and home.terms["kv_shortfall_blocks"] > 0


def test_the_fit_term_off_keeps_the_home() -> None:
    policy = KvPolicy.from_config(KvPolicyConfig(kv_fit_weight=0.0))
    decision = policy.rank(req(1_440), _fleet(home_held=3_900, other_held=0))
    assert decision.chosen == "home"
    assert decision.scores[0].terms["kv_shortfall_blocks"] == 0.0  # not computed when off


@pytest.mark.parametrize("cost_model", ["blocks", "seconds"])
def test_the_fit_guard_sets_aside_a_worker_without_room_even_when_it_is_less_loaded(
    cost_model: str,
) -> None:
    """Nothing cached anywhere: the fit term has no credit to withdraw, and the load terms
    prefer the idle-looking worker whose requests in flight fill its cache; the guard sends
    the request where it fits, the other worker kept as failover."""
    config = KvPolicyConfig(cost_model=cost_model)  # type: ignore[arg-type]
    fleet = [
        cand("full", active_decode_blocks=3_900, kv_capacity_blocks=4_000),
        cand(
            "room",
            active_decode_blocks=1_000,
            pending_prefill_tokens=20_000,
            in_flight=2,
            kv_capacity_blocks=4_000,
        ),
    ]
    off = KvPolicyConfig(cost_model=cost_model, kv_fit_guard=False)  # type: ignore[arg-type]
    unguarded = KvPolicy.from_config(off)
    assert unguarded.rank(req(500), fleet).chosen == "full"
    assert unguarded.rank(req(500), fleet).set_aside == frozenset()
    decision = KvPolicy.from_config(config).rank(req(500), fleet)
    assert decision.ranked == ["room", "full"]
    assert decision.set_aside == {"full"}  # for the queue: failover only
    assert decision.room == {"room"}  # where it fits (the queue's busy_kv_room)
    full = decision.scores[1]
    assert full.reason == "busy: lacks KV room (another worker has room)"
    assert full.terms["busy"] == 1.0 and full.terms["kv_shortfall_blocks"] == 400.0
    nowhere = [
        cand("a", active_decode_blocks=3_900, kv_capacity_blocks=4_000),
        cand("b", active_decode_blocks=3_950, kv_capacity_blocks=4_000),
    ]
    anywhere = KvPolicy.from_config(config).rank(req(500), nowhere)
    assert all(s.terms["busy"] == 0.0 for s in anywhere.scores)
    assert anywhere.set_aside == frozenset() == anywhere.room


# ---- held blocks: in-flight requests that share a prefix hold it once ----


def _keys(prefix: int, own: int, tag: int) -> list[BlockKey]:
    """Chained-like keys: ``prefix`` blocks every caller shares, then ``own`` of its own."""
    return [BlockKey(i) for i in range(prefix)] + [BlockKey(10**6 * tag + i) for i in range(own)]


def test_shared_prefix_blocks_bisects_chained_keys() -> None:
    a, b = _keys(1_200, 240, 1), _keys(1_200, 1_700, 2)
    assert shared_prefix_blocks(a, b) == 1_200
    assert shared_prefix_blocks(a, a) == len(a)
    assert shared_prefix_blocks(a, a[:500]) == 500
    assert shared_prefix_blocks(a, []) == 0
    assert shared_prefix_blocks(_keys(0, 5, 1), _keys(0, 5, 2)) == 0


def _registry() -> tuple[WorkerRegistry, WorkerId]:
    reg = WorkerRegistry()
    reg.add(WorkerConfig(url="http://w", models=["m"]))
    (worker,) = list(reg)
    return reg, worker.id


def test_siblings_in_flight_hold_their_shared_prefix_once() -> None:
    reg, wid = _registry()
    worker = reg.get(wid)
    parent = reg.begin(wid, 2_900 * BS, 2_900, BS, keys=_keys(1_200, 1_700, 1))
    child = reg.begin(wid, 240 * BS, 1_440, BS, keys=_keys(1_200, 240, 2))
    assert worker.active_decode_blocks == 2_900 + 240
    unrelated = reg.begin(wid, 100 * BS, 100, BS, keys=_keys(0, 100, 3))
    assert worker.active_decode_blocks == 2_900 + 240 + 100
    parent.finish()
    child.finish()
    unrelated.finish()
    assert worker.active_decode_blocks == 0 and not worker.flights


def test_a_request_without_keys_counts_all_its_blocks() -> None:
    reg, wid = _registry()
    worker = reg.get(wid)
    first = reg.begin(wid, 0, 500, BS, keys=_keys(500, 0, 1))
    second = reg.begin(wid, 0, 500, BS)  # keyed approximately or not at all: no sharing known
    assert worker.active_decode_blocks == 1_000
    first.finish()
    second.finish()
    assert worker.active_decode_blocks == 0


def test_candidates_carry_the_prefix_a_request_in_flight_holds() -> None:
    reg, wid = _registry()
    reg.get(wid).healthy = True  # as after its first health probe
    sibling = reg.begin(wid, 0, 1_700, BS, keys=_keys(1_200, 500, 1))
    (candidate,) = reg.candidates("m", keys=_keys(1_200, 240, 2))
    assert candidate.in_flight_prefix == 1_200
    (unrelated,) = reg.candidates("m", keys=_keys(0, 240, 3))
    assert unrelated.in_flight_prefix == 0
    sibling.finish()
    (alone,) = reg.candidates("m", keys=_keys(1_200, 240, 2))
    assert alone.in_flight_prefix == 0


def test_only_the_most_recent_flights_are_compared() -> None:
    reg, wid = _registry()
    worker = reg.get(wid)
    shared = reg.begin(wid, 0, 300, BS, keys=_keys(300, 0, 1))
    others = [reg.begin(wid, 0, 1, BS, keys=_keys(0, 1, 10 + i)) for i in range(FLIGHTS_COMPARED)]
    late = reg.begin(wid, 0, 300, BS, keys=_keys(300, 0, 2))  # its sibling is too far back
    assert worker.active_decode_blocks == 300 + FLIGHTS_COMPARED + 300
    for ticket in [shared, *others, late]:
        ticket.finish()
    assert worker.active_decode_blocks == 0 and not worker.flights


# ---- answers: the blocks a streamed answer fills count as held ----


def test_a_streamed_answer_holds_a_block_more_every_block_size_tokens() -> None:
    """A prompt of 100 tokens ends 4 tokens into its seventh block: its answer's first 12
    tokens fill that block, the next 16 a new one. All of it is released at the end."""
    reg, wid = _registry()
    worker = reg.get(wid)
    ticket = reg.begin(wid, 100, 7, BS, prompt_tokens=100, keys=_keys(0, 7, 1))
    assert worker.active_decode_blocks == 7
    ticket.first_token()
    ticket.streamed(12)
    assert worker.active_decode_blocks == 7
    ticket.streamed(1)
    assert worker.active_decode_blocks == 8
    ticket.streamed(16 * 10)
    assert worker.active_decode_blocks == 18
    assert worker.load().active_decode_blocks == 18
    ticket.finish()
    assert worker.active_decode_blocks == 0
    assert worker.released_blocks == 18  # the scrape counted them: what it still holds less
    ticket.streamed(1_000)  # a late event changes nothing
    assert worker.active_decode_blocks == 0


def test_an_answer_that_never_ends_counts_at_most_the_worker_capacity() -> None:
    reg, wid = _registry()
    worker = reg.get(wid)
    worker.scraped = replace(worker.scraped, kv_capacity_blocks=1_000)
    ticket = reg.begin(wid, 16, 1, BS, prompt_tokens=16)
    for _ in range(100):
        ticket.streamed(10**9)  # a worker streaming without end, or lying in its events
    assert worker.active_decode_blocks == 1 + 1_000
    ticket.finish()
    assert worker.active_decode_blocks == 0


def test_where_none_is_scraped_the_configured_capacity_caps_an_answer() -> None:
    reg = WorkerRegistry(scoring=KvPolicyConfig(kv_capacity_blocks=500))
    reg.add(WorkerConfig(url="http://w", models=["m"]))
    (worker,) = list(reg)
    assert worker.scraped.kv_capacity_blocks is None
    ticket = reg.begin(worker.id, 16, 1, BS, prompt_tokens=16)
    ticket.streamed(10**9)
    assert worker.active_decode_blocks == 1 + 500
    ticket.finish()
    assert worker.active_decode_blocks == 0


def test_answer_blocks_off_counts_the_prompts_only() -> None:
    reg = WorkerRegistry(scoring=KvPolicyConfig(answer_blocks=False))
    reg.add(WorkerConfig(url="http://w", models=["m"]))
    (worker,) = list(reg)
    ticket = reg.begin(worker.id, 16, 1, BS, prompt_tokens=16)
    ticket.streamed(1_000)
    assert worker.active_decode_blocks == 1
    ticket.finish()
    assert worker.active_decode_blocks == 0


def test_a_long_answer_takes_the_room_a_prompt_needed() -> None:
    """The case measured on the faithful simulator: two long answers decoding where, by
    their prompts, a 500-block prompt fits; by what they hold now, it does not."""
    config = KvPolicyConfig(kv_capacity_blocks=1_000)
    reg = WorkerRegistry(scoring=config)
    reg.add(WorkerConfig(url="http://w", models=["m"]))
    (worker,) = list(reg)
    running = [reg.begin(worker.id, 240 * BS, 240, BS, keys=_keys(0, 240, i)) for i in (1, 2)]
    assert kv_overcommit(worker.load(), 500, config) == -20  # fits, 20 blocks to spare
    for ticket in running:
        ticket.first_token()
        ticket.streamed(20 * BS)  # 20 blocks of answer each
    assert kv_overcommit(worker.load(), 500, config) == 20
    assert reg.begin(worker.id, 0, 500, BS, keys=_keys(0, 500, 3)).blocking


# ---- blocked: a worker whose engine queue holds a request sent lacking room ----


def test_a_request_sent_lacking_room_blocks_its_worker_until_it_starts() -> None:
    """The registry marks a request sent where its blocks do not fit beside the held ones
    (kvgate's prediction then); the worker's load says so until its first token, or its end
    without one. A request that fits marks nothing."""
    reg = WorkerRegistry(scoring=KvPolicyConfig(kv_capacity_blocks=1_000))
    reg.add(WorkerConfig(url="http://w", models=["m"]))
    (worker,) = list(reg)
    running = reg.begin(worker.id, 600 * BS, 600, BS, keys=_keys(0, 600, 1))
    assert not running.blocking and worker.load().blocked_requests == 0
    big = reg.begin(worker.id, 500 * BS, 500, BS, keys=_keys(0, 500, 2))  # 600 + 500 > 1,000
    assert big.blocking and worker.load().blocked_requests == 1
    small = reg.begin(worker.id, 10 * BS, 10, BS, keys=_keys(0, 10, 3))  # behind it: lacks too
    assert small.blocking and worker.load().blocked_requests == 2
    small.finish()  # cancelled before it started
    assert worker.load().blocked_requests == 1
    running.finish()
    big.first_token()  # room released: it started
    assert not big.blocking and worker.load().blocked_requests == 0
    big.finish()
    assert worker.blocked_requests == 0
    reused = reg.begin(worker.id, 0, 900, BS, keys=_keys(0, 900, 4))
    assert not reused.blocking  # 900 fit in 1,000
    reused.finish()


# ---- blocked wait: how long a worker's blocked head has waited so far ----


def test_the_oldest_blocked_request_sets_the_blocked_time() -> None:
    clock = [100.0]
    reg = WorkerRegistry(scoring=KvPolicyConfig(kv_capacity_blocks=1_000), clock=lambda: clock[0])
    reg.add(WorkerConfig(url="http://w", models=["m"]))
    (worker,) = list(reg)
    running = reg.begin(worker.id, 600 * BS, 600, BS, keys=_keys(0, 600, 1))
    clock[0] = 101.0
    first = reg.begin(worker.id, 500 * BS, 500, BS, keys=_keys(0, 500, 2))  # lacks room
    clock[0] = 102.5
    second = reg.begin(worker.id, 10 * BS, 10, BS, keys=_keys(0, 10, 3))  # behind it
    clock[0] = 104.0
    assert worker.load(clock[0]).blocked_s == 3.0 and worker.blocked_requests == 2
    worker.unblock(sent_before=102.0)  # a scrape asked at 102 s saw nothing waiting
    assert not first.blocking and second.blocking
    assert worker.load(clock[0]).blocked_s == 1.5  # the next oldest
    first.first_token()
    second.finish()
    assert worker.load(clock[0]).blocked_s == 0.0 and worker.load(clock[0]).blocked_requests == 0
    for ticket in (running, first):
        ticket.finish()


@pytest.mark.parametrize("cost_model", ["blocks", "seconds"])
def test_a_home_blocked_for_long_loses_a_turn_that_a_short_block_keeps(cost_model: str) -> None:
    """With the blocked wait priced (weight 1): the turn's history is cached at home, where a
    request sent lacking room waits unstarted. Blocked 0.1 s, the home keeps the turn;
    blocked 10 s (a wait that long is expected to last about as long again), recomputing
    elsewhere is cheaper."""
    config = KvPolicyConfig(cost_model=cost_model, blocked_wait_weight=1.0)  # type: ignore[arg-type]
    policy = KvPolicy.from_config(config)

    def home(blocked_s: float) -> Candidate:
        load = WorkerLoad(
            active_decode_blocks=1_000,
            kv_capacity_blocks=4_000,
            blocked_requests=1,
            blocked_s=blocked_s,
        )
        return Candidate(WorkerId("home"), "http://home", load, PrefixMatch(gpu=1_200))

    other = cand("other", active_decode_blocks=1_000, kv_capacity_blocks=4_000)
    assert policy.rank(req(1_440), [home(0.1), other]).chosen == "home"
    decision = policy.rank(req(1_440), [home(10.0), other])
    assert decision.chosen == "other"
    left = next(s for s in decision.scores if s.worker == "home")
    assert left.terms["blocked_s"] == 10.0
    waited = "blocked_wait_blocks" if cost_model == "blocks" else "blocked_wait_s"
    assert left.terms[waited] > 0.0
    default = KvPolicyConfig(cost_model=cost_model)  # type: ignore[arg-type]
    assert default.blocked_wait_weight == 0.0  # off: measured and not adopted
    assert KvPolicy.from_config(default).rank(req(1_440), [home(10.0), other]).chosen == "home"
