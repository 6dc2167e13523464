"""The queue's dispatch order (pure): cheapest work first, aging, a session's turns in order."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.scheduling.dispatch_order import OrderConfig, dispatch_priority, next_to_dispatch


@dataclass(frozen=True)
class Entry:
    seq: int
    enqueued_at: float
    work_tokens: int
    session: str | None = None


def _all(entry: Entry) -> int:
    return entry.work_tokens


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
    """The defaults (the queue's) keep near arrival order: cheap work goes first only among
    requests that arrived within about W / 65,536 s of each other."""
    config = OrderConfig()
    big = Entry(0, 0.0, 32768)
    assert next_to_dispatch([big, Entry(1, 0.25, 0)], 0.25, config, _all) is not big
    assert next_to_dispatch([big, Entry(1, 0.75, 0)], 0.75, config, _all) is big


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
