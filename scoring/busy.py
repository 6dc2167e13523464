"""Is a worker too busy to take one more request now? The admission predicate of the queue.

``router/admission.py`` holds a request in kvgate when every eligible worker is busy by its
``BusyGauge``. The gauge sees one candidate (its load and match) and answers a reason or
``None``; ``ThresholdGauge`` is the default over the load kvgate measures today (predicted
pending prefill and in-flight requests, the engine's scraped waiting queue and KV usage). A
gauge in seconds (predicted time to first token) fits the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from scoring.api import Candidate, WorkerLoad
from scoring.cost_parts import held_blocks_at


class BusyGauge(Protocol):
    """Says why ``candidate`` should take no more requests now (``None``: it may)."""

    def busy(self, candidate: Candidate) -> str | None: ...


@dataclass(frozen=True, slots=True)
class BusyLimits:
    """Per-worker limits; a worker over any of them is busy. ``None`` turns a limit off."""

    pending_prefill_tokens: int | None = None  # kvgate's prediction: sent, no first token yet
    in_flight: int | None = None  # kvgate's prediction: requests sent and not finished
    waiting_requests: int | None = None  # scraped: the engine's waiting queue
    kv_usage: float | None = None  # scraped: KV-cache usage, 0..1
    kv_held: float | None = None  # both: blocks its requests in flight need, x KV capacity
    kv_capacity_blocks: int | None = None  # for kv_held where the engine publishes none


def kv_held_share(load: WorkerLoad, capacity_blocks: int | None = None) -> float | None:
    """The blocks a worker's requests in flight need, as a share of its KV capacity (the
    engine's, else ``capacity_blocks``): the larger of kvgate's prediction (their prompt
    blocks, shared prefixes once, queued in the engine or running: may pass 1) and the
    scraped usage (the running ones); ``None`` while no capacity is known."""
    capacity = load.kv_capacity_blocks or capacity_blocks
    if not capacity:
        return None
    predicted, scraped = held_blocks_at(load, capacity)
    return max(predicted, scraped or 0.0) / capacity


def over_limits(load: WorkerLoad, limits: BusyLimits) -> str | None:
    """The first limit ``load`` is over, as a reason, or ``None``."""
    held = None if limits.kv_held is None else kv_held_share(load, limits.kv_capacity_blocks)
    checks: tuple[tuple[str, float | None, float | None], ...] = (
        ("pending prefill tokens", load.pending_prefill_tokens, limits.pending_prefill_tokens),
        ("in flight", load.in_flight, limits.in_flight),
        ("waiting", load.scraped_waiting, limits.waiting_requests),
        ("kv usage", load.scraped_kv_usage, limits.kv_usage),
        ("kv held", held, limits.kv_held),
    )
    for name, value, limit in checks:
        if value is not None and limit is not None and value >= limit and value > 0:
            return f"{name} {value:g} >= {limit:g}"
    return None


class ThresholdGauge:
    """``BusyGauge`` over fixed per-worker limits (``BusyLimits``)."""

    def __init__(self, limits: BusyLimits) -> None:
        self.limits = limits

    def busy(self, candidate: Candidate) -> str | None:
        return over_limits(candidate.load, self.limits)
