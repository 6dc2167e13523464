"""Choosing among priced workers: lowest cost, tie-breaks, temperature sampling.

Input: one ``Costed`` (``scoring.cost.Price``) per candidate. Output: every candidate once,
best first, each with the reason it landed where it did. No I/O; the only randomness is the
injected ``rng``. Nothing here filters: a worker that may not take the request now is the
scheduler's capacity rule's to set aside (``scheduling.capacity``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvgate.index.types import WorkerId
from kvgate.scoring.tiebreak import rendezvous_weight


class Costed(Protocol):
    """What the choice reads of a priced worker (``scoring.cost.Price``)."""

    @property
    def worker(self) -> WorkerId: ...

    @property
    def cost(self) -> float: ...

    @property
    def in_flight(self) -> int: ...


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


def order_lowest_cost(
    costs: Sequence[C], session: bytes, tie_tolerance: float
) -> list[tuple[C, str]]:
    """``rank_lowest_cost`` as (cost, reason) pairs."""
    lowest = min(c.cost for c in costs)
    limit = lowest + tie_tolerance
    weight = _weights(costs, session)
    tied = sorted(
        (c for c in costs if c.cost <= limit), key=lambda c: (c.in_flight, weight[c.worker])
    )
    ranked = list(zip(tied, _tied_reasons(tied), strict=True))
    if len(tied) < len(costs):
        higher = sorted(
            (c for c in costs if c.cost > limit),
            key=lambda c: (c.cost, c.in_flight, weight[c.worker]),
        )
        ranked += [(c, "higher cost") for c in higher]
    return ranked


def rank_lowest_cost(costs: Sequence[C], session: bytes, tie_tolerance: float) -> list[Ranked[C]]:
    """Temperature 0: lowest cost first; ties by lower in-flight, then rendezvous hash."""
    return [Ranked(c, reason) for c, reason in order_lowest_cost(costs, session, tie_tolerance)]


def sampling_weights(costs: Sequence[Costed], temperature: float, scale: float) -> list[float]:
    """Softmax weights of ``-(cost - lowest) / (temperature * scale)``; the lowest gets 1."""
    lowest = min(c.cost for c in costs)
    return [math.exp(-(c.cost - lowest) / (temperature * scale)) for c in costs]


def rank_sampled(
    by_cost: Sequence[Ranked[C]], temperature: float, scale: float, rng: random.Random
) -> list[Ranked[C]]:
    """Temperature > 0: sample one worker; the rest keep their cost order (``by_cost``, the
    temperature-0 ranking) after it."""
    weights = sampling_weights([r.cost for r in by_cost], temperature, scale)
    total = sum(weights)
    (picked,) = rng.choices(range(len(by_cost)), weights=weights, k=1)
    label = f"temperature {temperature:g}"
    chosen = by_cost[picked]
    ranked = [Ranked(chosen.cost, f"sampled ({label})", weights[picked] / total)]
    for i, r in enumerate(by_cost):
        if i != picked:
            ranked.append(Ranked(r.cost, f"not sampled ({label})", weights[i] / total))
    return ranked
