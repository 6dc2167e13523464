"""Choosing among costed workers: busy guard, lowest cost, tie-breaks, temperature sampling.

Input: one ``WorkerCost`` (or ``CostQuote``: the cost without its terms) per candidate.
Output: every candidate once, best first, each with the reason it landed where it did. No
I/O; the only randomness is the injected ``rng``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from index.types import WorkerId
from scoring.tiebreak import rendezvous_weight


class Costed(Protocol):
    """What the choice reads of a costed worker (``WorkerCost``, ``CostQuote``)."""

    @property
    def worker(self) -> WorkerId: ...

    @property
    def cost(self) -> float: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def busy(self) -> str | None: ...


C = TypeVar("C", bound=Costed)


@dataclass(frozen=True, slots=True)
class Ranked(Generic[C]):
    """One worker's place in the ranking."""

    cost: C
    reason: str
    probability: float | None = None  # set when sampled with temperature > 0


def _weights(costs: Sequence[Costed], session: bytes) -> dict[WorkerId, int]:
    """Every worker's rendezvous weight for ``session``, negated (sort keys: highest first)."""
    return {c.worker: -rendezvous_weight(session, c.worker) for c in costs}


def split_busy(costs: Sequence[C]) -> tuple[list[C], list[C]]:
    """(eligible, busy); when every worker is busy they are all eligible and none set aside."""
    free = [c for c in costs if c.busy is None]
    if len(free) == len(costs):
        return free, []
    if not free:
        return list(costs), []
    return free, [c for c in costs if c.busy is not None]


def _tied_reasons(tied: Sequence[Costed]) -> list[str]:
    if len(tied) == 1:
        return ["lowest cost"]
    best = tied[0]
    won_on_in_flight = best.in_flight < tied[1].in_flight
    first = "tie broken by in-flight" if won_on_in_flight else "tie broken by session hash"
    rest = [
        "tied cost, more in-flight"
        if c.in_flight > best.in_flight
        else "tied cost, lost session hash"
        for c in tied[1:]
    ]
    return [first, *rest]


def _with_busy_note(reason: str, cost: Costed) -> str:
    return f"{reason}; {cost.busy} (every worker busy)" if cost.busy else reason


def order_lowest_cost(
    costs: Sequence[C], session: bytes, tie_tolerance: float
) -> list[tuple[C, str]]:
    """``rank_lowest_cost`` as (cost, reason) pairs."""
    eligible, busy = split_busy(costs)
    lowest = min(c.cost for c in eligible)
    limit = lowest + tie_tolerance
    weight = _weights(costs, session)
    tied = sorted(
        (c for c in eligible if c.cost <= limit), key=lambda c: (c.in_flight, weight[c.worker])
    )
    ranked = [(c, _with_busy_note(r, c)) for c, r in zip(tied, _tied_reasons(tied), strict=True)]
    if len(tied) < len(eligible):
        higher = sorted(
            (c for c in eligible if c.cost > limit),
            key=lambda c: (c.cost, c.in_flight, weight[c.worker]),
        )
        ranked += [(c, _with_busy_note("higher cost", c)) for c in higher]
    if busy:
        by_cost = sorted(busy, key=lambda c: (c.cost, c.in_flight, weight[c.worker]))
        ranked += [(c, c.busy or "busy") for c in by_cost]
    return ranked


def rank_lowest_cost(costs: Sequence[C], session: bytes, tie_tolerance: float) -> list[Ranked[C]]:
    """Temperature 0: lowest cost first; ties by lower in-flight, then rendezvous hash.

    Busy workers (unless all are busy) follow every eligible worker, as failover only.
    """
    return [Ranked(c, reason) for c, reason in order_lowest_cost(costs, session, tie_tolerance)]


def sampling_weights(costs: Sequence[Costed], temperature: float, scale: float) -> list[float]:
    """Softmax weights of ``-(cost - lowest) / (temperature * scale)``; the lowest gets 1."""
    lowest = min(c.cost for c in costs)
    return [math.exp(-(c.cost - lowest) / (temperature * scale)) for c in costs]


def rank_sampled(
    by_cost: Sequence[Ranked[C]], temperature: float, scale: float, rng: random.Random
) -> list[Ranked[C]]:
    """Temperature > 0: sample one eligible worker; the rest keep their cost order after it.

    ``by_cost`` is the temperature-0 ranking; its eligible workers are the ones not marked
    busy, or all of them when every worker is busy.
    """
    eligible = [r for r in by_cost if r.cost.busy is None] or list(by_cost)
    weights = sampling_weights([r.cost for r in eligible], temperature, scale)
    total = sum(weights)
    (picked,) = rng.choices(range(len(eligible)), weights=weights, k=1)
    probability = {r.cost.worker: w / total for r, w in zip(eligible, weights, strict=True)}
    label = f"temperature {temperature:g}"
    chosen = eligible[picked]
    ranked = [Ranked(chosen.cost, f"sampled ({label})", probability[chosen.cost.worker])]
    for r in by_cost:
        if r.cost.worker == chosen.cost.worker:
            continue
        p = probability.get(r.cost.worker)
        reason = f"not sampled ({label})" if p is not None else r.reason
        ranked.append(Ranked(r.cost, reason, p if p is not None else 0.0))
    return ranked
