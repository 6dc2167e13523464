"""The one capacity rule (``scheduling.capacity``): a worker's limits (one operator, >=), the
KV room a request needs beside the requests in flight, and the parts that switch each
mechanism off per worker; routing keeps the policy's ranking and puts the refused workers
after the admitted ones (docs/scoring.md, *Capacity*)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvgate.index.types import BlockKey, PrefixMatch, WorkerId
from kvgate.scheduling.capacity import (
    HELD_TEXT,
    KV_FIT,
    ROOM_TEXT,
    Limits,
    Parts,
    Refusal,
    busy,
    judge,
    kv_shortfall,
)
from kvgate.scheduling.config import SchedulingConfig
from kvgate.scheduling.routing import admitted_first
from kvgate.scoring.api import Candidate, RouteRequest, WorkerLoad
from kvgate.scoring.config import KvPolicyConfig
from kvgate.scoring.cost import request_size
from kvgate.scoring.kv import KvPolicy

BS = 16
DEFAULT = SchedulingConfig().limits()
ALL_ON = KV_FIT  # every part on (the KV-room rule is off by default)


def on(**off: bool) -> Parts:
    """Every part on but those named."""
    return replace(KV_FIT, **off)


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


def route(
    blocks: int,
    candidates: list[Candidate],
    limits: Limits = DEFAULT,
    parts: dict[str, Parts] | None = None,
    **judged: Any,
) -> tuple[list[WorkerId], dict[WorkerId, Refusal]]:
    """The policy's ranking, judged by the rule: (the order to try, the refused workers)."""
    request = req(blocks)
    decision = KvPolicy.from_config(KvPolicyConfig()).rank(request, candidates)
    chosen = parts or {}
    verdicts = judge(
        request_size(request),
        candidates,
        limits,
        lambda w: chosen.get(w, ALL_ON),
        **judged,
    )
    return admitted_first(decision.ranked, verdicts.refused), verdicts.refused


# ---- a worker's limits -------------------------------------------------------------------


def test_a_worker_is_busy_at_any_limit_and_never_on_a_limit_that_is_off() -> None:
    limits = Limits(
        max_pending_prefill_tokens=1000, max_in_flight=4, max_waiting_requests=2, max_kv_usage=0.9
    )

    def text(**load: Any) -> str | None:
        refusal = busy(WorkerLoad(**load), limits, ALL_ON)
        return None if refusal is None else refusal.text

    assert text() is None
    assert text(pending_prefill_tokens=999, in_flight=3) is None
    assert text(pending_prefill_tokens=1000) == "pending prefill tokens 1000 >= 1000"
    assert text(in_flight=4) == "in flight 4 >= 4"
    assert text(scraped_waiting=2) == "waiting 2 >= 2"
    assert text(scraped_kv_usage=0.95) == "kv usage 0.95 >= 0.9"
    heavy = WorkerLoad(pending_prefill_tokens=10**9, in_flight=10**6, scraped_waiting=10**6)
    off = Limits(None, None, None, None)
    assert busy(heavy, off, ALL_ON) is None


def test_busy_has_one_operator_for_everyone() -> None:
    """The default limit of 32 waiting requests: at 32 a worker is busy, at 31 it is not."""
    assert busy(WorkerLoad(scraped_waiting=31), DEFAULT, ALL_ON) is None
    at = busy(WorkerLoad(scraped_waiting=32), DEFAULT, ALL_ON)
    assert at is not None and at.text == "waiting 32 >= 32"
    usage = busy(WorkerLoad(scraped_kv_usage=0.98), DEFAULT, ALL_ON)
    assert usage is not None and usage.code == "kv_usage"
    assert busy(WorkerLoad(in_flight=10**6), DEFAULT, ALL_ON) is None  # no in-flight limit


def test_each_limit_is_a_part_that_can_be_switched_off() -> None:
    load = WorkerLoad(scraped_waiting=40, pending_prefill_tokens=10**6, scraped_kv_usage=1.0)
    refusal = busy(load, DEFAULT, ALL_ON)
    assert refusal is not None and refusal.code == "waiting"
    no_waiting = on(waiting=False)
    refusal = busy(load, DEFAULT, no_waiting)
    assert refusal is not None and refusal.code == "pending_prefill"
    only_usage = on(waiting=False, pending_prefill=False)
    refusal = busy(load, DEFAULT, only_usage)
    assert refusal is not None and refusal.code == "kv_usage"
    none = on(waiting=False, pending_prefill=False, kv_usage=False)
    assert busy(load, DEFAULT, none) is None
    assert "waiting" not in none.active() and "kv_room" in none.active()


@pytest.mark.parametrize(
    ("loads", "chosen", "last"),
    [
        # a is best on cost but busy: refused, tried last as failover
        ({"a": {"scraped_waiting": 40}}, "b", "a"),
        ({"a": {"scraped_kv_usage": 0.99}}, "b", "a"),
        ({"a": {"pending_prefill_tokens": 70_000}}, "b", "a"),
        # every worker busy: the ranking stands (the queue waits; failover in cost order)
        ({"a": {"scraped_waiting": 40}, "b": {"scraped_waiting": 50}}, "a", "b"),
    ],
)
def test_routing_keeps_the_ranking_among_admitted_workers(
    loads: dict[str, dict[str, Any]], chosen: str, last: str
) -> None:
    candidates = [cand("a", gpu=10, **loads.get("a", {})), cand("b", **loads.get("b", {}))]
    order, _ = route(10, candidates)
    assert order[0] == chosen
    assert order[-1] == last
    assert len(order) == 2


def test_refused_workers_follow_in_the_policys_order() -> None:
    candidates = [
        cand("a", gpu=10, scraped_kv_usage=0.995),
        cand("b", gpu=5),
        cand("c", gpu=9, scraped_waiting=33),
        cand("d", gpu=1),
    ]
    order, refused = route(10, candidates)
    assert order == ["b", "d", "a", "c"]  # refused ones after, in cost order
    assert refused[WorkerId("a")].text == "kv usage 0.995 >= 0.98"
    assert refused[WorkerId("c")].text == "waiting 33 >= 32"


# ---- KV room -----------------------------------------------------------------------------


def shortfall(
    blocks: int, gpu: int, limits: Limits = DEFAULT, in_flight_prefix: int = 0, **load: Any
) -> float:
    candidate = cand("w", gpu, in_flight_prefix, **load)
    return kv_shortfall(candidate, request_size(req(blocks)), limits)


def test_no_shortfall_without_a_known_capacity() -> None:
    assert shortfall(100, 0, active_decode_blocks=10**6) == 0.0
    capped = Limits(kv_capacity_blocks=500)
    assert shortfall(100, 0, capped, active_decode_blocks=450) == 50.0


def test_the_cached_match_needs_room_too() -> None:
    """300 blocks, 200 cached: beside 800 held blocks of 1,000 the 100 new ones would fit,
    but the 200 cached ones are evicted for the running requests before it runs."""
    held = {"kv_capacity_blocks": 1_000}
    assert shortfall(300, 200, active_decode_blocks=800, **held) == pytest.approx(100.0)
    assert shortfall(300, 200, active_decode_blocks=700, **held) == 0.0
    full = shortfall(300, 200, active_decode_blocks=5_000, **held)
    assert full == pytest.approx(300.0)  # at most the request's blocks
    scraped = shortfall(300, 200, active_decode_blocks=100, scraped_kv_usage=0.95, **held)
    assert scraped == pytest.approx(250.0)  # the larger of kvgate's count and the engine's


def test_a_prefix_held_by_a_request_in_flight_counts_once() -> None:
    """A sibling in flight holds the first 150 of the 200 cached blocks: they are among the
    800 held ones already (pinned, not evictable), so only 150 of the 300 need room."""
    held = {"kv_capacity_blocks": 1_000, "active_decode_blocks": 800}
    assert shortfall(300, 200, **held) == pytest.approx(100.0)
    assert shortfall(300, 200, in_flight_prefix=150, **held) == 0.0
    assert shortfall(
        300, 200, in_flight_prefix=150, kv_capacity_blocks=1_000, active_decode_blocks=900
    ) == pytest.approx(50.0)
    assert shortfall(300, 300, in_flight_prefix=10**6, **held) == 0.0


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
            in_flight=1,
        ),
        cand("other", active_decode_blocks=other_held, kv_capacity_blocks=4_000),
    ]


def test_a_request_that_does_not_fit_at_home_goes_where_it_fits() -> None:
    roomy, refused = route(1_440, _fleet(home_held=2_900, other_held=0))
    assert roomy[0] == "home" and not refused  # 2,900 + 240 new blocks fit in 4,000
    full, refused = route(1_440, _fleet(home_held=3_900, other_held=0))
    assert full == ["other", "home"]  # home still ranked first by price, refused
    assert refused[WorkerId("home")].text == ROOM_TEXT
    assert kv_shortfall(_fleet(3_900, 0)[0], request_size(req(1_440)), DEFAULT) == 140.0


def test_a_home_that_cannot_keep_the_history_beside_its_running_requests_is_left() -> None:
    """The session's history (1,200 blocks) cached at home, but no request in flight there
    holds it: beside 2,900 held blocks of 4,000 it would be evicted before the turn runs, so
    the turn goes where all of it fits."""
    fleet = [
        cand("home", gpu=1_200, active_decode_blocks=2_900, kv_capacity_blocks=4_000),
        cand("other", kv_capacity_blocks=4_000),
    ]
    order, refused = route(1_440, fleet)
    assert order[0] == "other"
    assert refused[WorkerId("home")].code == "kv_room"


def test_when_nothing_fits_the_request_waits_for_room_or_goes_as_ranked() -> None:
    """Nowhere has room: with the queue's wait for room on (the default) every worker
    refuses it for room (the queue waits); with it off, or its patience over, the ranking
    stands and nobody is refused."""
    fleet = _fleet(home_held=3_900, other_held=3_900)
    order, refused = route(1_440, fleet)
    assert order[0] == "home" and set(refused) == {"home", "other"}
    no_wait = {WorkerId("home"): on(room_wait=False), WorkerId("other"): on(room_wait=False)}
    order, refused = route(1_440, fleet, parts=no_wait)
    assert order[0] == "home" and not refused
    order, refused = route(1_440, fleet, waive_room=True)
    assert order[0] == "home" and not refused


def test_a_worker_without_room_is_set_aside_even_when_it_is_less_loaded() -> None:
    """Nothing cached anywhere: the price prefers the idle-looking worker whose requests in
    flight fill its cache; the rule sends the request where it fits, the other kept as
    failover."""
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
    policy = KvPolicy.from_config(KvPolicyConfig())
    assert policy.rank(req(500), fleet).chosen == "full"  # by price alone
    order, refused = route(500, fleet)
    assert order == ["room", "full"]
    assert refused == {"full": Refusal("kv_room")}
    assert kv_shortfall(fleet[0], request_size(req(500)), DEFAULT) == 400.0
    off = {WorkerId("full"): on(kv_room=False)}
    order, refused = route(500, fleet, parts=off)
    assert order[0] == "full" and not refused  # the part off on that worker


def test_a_prompt_larger_than_the_cache_is_never_refused_for_room() -> None:
    fleet = [cand("a", active_decode_blocks=10, kv_capacity_blocks=100)]
    _, refused = route(500, fleet)
    assert not refused


def test_a_worker_held_for_another_request_is_refused_as_held() -> None:
    fleet = [cand("a", gpu=10), cand("b")]
    order, refused = route(10, fleet, held=frozenset({WorkerId("a")}))
    assert order == ["b", "a"]
    assert refused[WorkerId("a")].text == HELD_TEXT


def test_scheduling_config_has_the_rules_limits() -> None:
    config = SchedulingConfig()
    assert (config.max_waiting_requests, config.max_pending_prefill_tokens) == (32, 65536)
    assert (config.max_in_flight, config.max_kv_usage, config.kv_capacity_blocks) == (
        None,
        0.98,
        None,
    )
    for name, field in SchedulingConfig.model_fields.items():
        assert field.description, f"{name} has no description"
    for bad in ({"max_kv_usage": 0.0}, {"max_kv_usage": 1.5}, {"max_waiting_requests": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SchedulingConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_capacity_blocks"):
        SchedulingConfig(kv_capacity_blocks=0)
