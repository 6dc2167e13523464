"""The queue's pure parts: the busy predicate and the dispatch order (scoring layer)."""

from __future__ import annotations

from dataclasses import dataclass

from index.types import WorkerId
from router.config import QueueConfig
from scoring.api import Candidate, WorkerLoad
from scoring.busy import BusyLimits, ThresholdGauge, kv_held_share, over_limits
from scoring.dispatch_order import OrderConfig, dispatch_priority, next_to_dispatch


@dataclass(frozen=True)
class Entry:
    seq: int
    enqueued_at: float
    work_tokens: int
    session: str | None = None


def _all(entry: Entry) -> int:
    return entry.work_tokens


def test_busy_at_any_limit_and_never_on_a_limit_that_is_off() -> None:
    limits = BusyLimits(pending_prefill_tokens=1000, in_flight=4, waiting_requests=2, kv_usage=0.9)
    assert over_limits(WorkerLoad(), limits) is None
    assert over_limits(WorkerLoad(pending_prefill_tokens=999, in_flight=3), limits) is None
    assert over_limits(WorkerLoad(pending_prefill_tokens=1000), limits) == (
        "pending prefill tokens 1000 >= 1000"
    )
    assert over_limits(WorkerLoad(in_flight=4), limits) == "in flight 4 >= 4"
    assert over_limits(WorkerLoad(scraped_waiting=2), limits) == "waiting 2 >= 2"
    assert over_limits(WorkerLoad(scraped_kv_usage=0.95), limits) == "kv usage 0.95 >= 0.9"
    busy = WorkerLoad(pending_prefill_tokens=10**9, in_flight=10**6, scraped_waiting=10**6)
    assert over_limits(busy, BusyLimits()) is None
    gauge = ThresholdGauge(limits)
    assert gauge.busy(Candidate(WorkerId("w"), "http://w", WorkerLoad(in_flight=5))) is not None


def test_kv_held_is_the_larger_of_prediction_and_scrape_over_the_capacity() -> None:
    """Requests queued in the engine count (the prediction may pass 1); no capacity, no
    limit."""
    limits = BusyLimits(kv_held=1.0)
    queued = WorkerLoad(active_decode_blocks=1200, scraped_kv_usage=0.7, kv_capacity_blocks=1000)
    assert kv_held_share(queued) == 1.2
    assert over_limits(queued, limits) == "kv held 1.2 >= 1"
    scraped = WorkerLoad(active_decode_blocks=100, scraped_kv_usage=1.0, kv_capacity_blocks=1000)
    assert over_limits(scraped, limits) == "kv held 1 >= 1"
    room = WorkerLoad(active_decode_blocks=999, scraped_kv_usage=0.5, kv_capacity_blocks=1000)
    assert over_limits(room, limits) is None
    unknown = WorkerLoad(active_decode_blocks=10**6, scraped_kv_usage=1.0)
    assert kv_held_share(unknown) is None
    assert over_limits(unknown, limits) is None
    assert over_limits(queued, BusyLimits()) is None


def test_cheapest_work_first_ties_by_arrival() -> None:
    config = OrderConfig(aging_tokens_per_s=100.0, base_tokens=0)
    entries = [Entry(0, 0.0, 5000), Entry(1, 0.0, 100), Entry(2, 0.0, 100)]
    chosen = next_to_dispatch(entries, 0.0, config, _all)
    assert chosen is entries[1]


def test_aging_bounds_how_long_large_work_is_passed() -> None:
    """Work W waits at most W / aging_tokens_per_s longer than a fresh request of no work."""
    config = OrderConfig(aging_tokens_per_s=100.0, base_tokens=0)
    big = Entry(0, 0.0, 5000)
    for now in (10.0, 49.0, 50.0, 51.0):
        fresh = Entry(1, now, 0)
        chosen = next_to_dispatch([big, fresh], now, config, _all)
        assert chosen is (big if now >= 50.0 else fresh), now
    assert dispatch_priority(big, big.work_tokens, 50.0, config) == 0.0


def test_by_default_a_large_prompt_is_passed_for_about_half_a_second_per_32k_tokens() -> None:
    """The defaults (QueueConfig's too) keep near arrival order: cheap work goes first only
    among requests that arrived within about W / 65,536 s of each other."""
    config = OrderConfig()
    big = Entry(0, 0.0, 32768)
    assert next_to_dispatch([big, Entry(1, 0.25, 0)], 0.25, config, _all) is not big
    assert next_to_dispatch([big, Entry(1, 0.75, 0)], 0.75, config, _all) is big
    order = QueueConfig()
    assert (order.aging_tokens_per_s, order.base_tokens) == (
        config.aging_tokens_per_s,
        config.base_tokens,
    )


def test_only_a_sessions_oldest_turn_and_entries_that_may_go_are_taken() -> None:
    config = OrderConfig(aging_tokens_per_s=1.0, base_tokens=0)
    first = Entry(0, 0.0, 9000, session="s")
    second = Entry(1, 0.0, 10, session="s")
    other = Entry(2, 0.0, 500)
    entries = [second, first, other]
    assert next_to_dispatch(entries, 0.0, config, _all) is other
    but_other = next_to_dispatch(entries, 0.0, config, lambda e: None if e is other else 1)
    assert but_other is first
    only_second = next_to_dispatch(entries, 0.0, config, lambda e: 1 if e is second else None)
    assert only_second is None  # a session's later turn never passes its first
    assert next_to_dispatch([], 0.0, config, _all) is None
