"""The one door to "compute each worker's cost" for a request: pure arithmetic, no choice.

``KvPolicyConfig.cost_model`` picks the cost that decides (docs/scoring.md):

* ``blocks`` (default, ``scoring.cost_blocks``): the uncached blocks to prefill against the
  worker's weighted load, in KV blocks;
* ``seconds`` (``scoring.cost_seconds``): the predicted TTFT there plus what the choice
  costs the requests behind it and the fleet's caches, in seconds.

Either way each quote's ``full()`` carries the worker's predicted TTFT and its parts (the
learned model's), so ``/debug/route`` shows them whichever cost decides. Choosing among the
quotes is ``scoring.choice``'s job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from scoring.api import Candidate
from scoring.choice import Costed
from scoring.config import KvPolicyConfig
from scoring.cost_blocks import BlockQuote
from scoring.cost_parts import (
    RequestSize,
    fleet_factor,
    footprint_ratios,
    kv_fit_shares,
    kv_shortfall,
)
from scoring.cost_seconds import FleetView, SecondsQuote


class CostDetail(Protocol):
    """A worker's full cost: every term behind it, by name."""

    def terms(self) -> dict[str, float]: ...


class Quote(Costed, Protocol):
    """One worker's cost as ranking reads it (``scoring.choice.Costed``), its temperature
    unit, and its terms built on demand."""

    @property
    def scale(self) -> float: ...

    def full(self) -> CostDetail: ...


def quote_workers(
    size: RequestSize,
    candidates: Sequence[Candidate],
    config: KvPolicyConfig,
    shortfalls: Sequence[float],
) -> list[Quote]:
    """Every candidate's cost for a request of ``size``, in candidate order (``shortfalls``:
    ``kv_shortfalls`` of the same candidates)."""
    fits = kv_fit_shares(shortfalls, config)
    if config.cost_model == "seconds":
        ratios = footprint_ratios(candidates)
        fleet = FleetView.of(size, candidates, ratios, config, fits)
        return [
            SecondsQuote(size, c, config, r, fleet, fit=f)
            for c, r, f in zip(candidates, ratios, fits, strict=True)
        ]
    if config.footprint_weight > 0.0:
        ratios = footprint_ratios(candidates)
    else:
        ratios = [1.0] * len(candidates)
    waiters = fleet_factor(candidates, config) if config.fleet_prefill_weight > 0.0 else 0.0
    return [
        BlockQuote(size, c, config, r, fit=f, fleet=waiters)
        for c, r, f in zip(candidates, ratios, fits, strict=True)
    ]


def kv_shortfalls(
    size: RequestSize, candidates: Sequence[Candidate], config: KvPolicyConfig
) -> list[float]:
    """The KV blocks the request lacks on each candidate (``kv_shortfall``; 0: it fits)."""
    return [kv_shortfall(c, size, config) for c in candidates]
