"""The cost in seconds of one worker for one request (``cost_model="seconds"``): pure
arithmetic, no choice.

    cost = predicted TTFT there                 (base + queue wait + own prefill + interference)
         + fleet_factor x own prefill seconds   (the wait it adds for requests behind it)
         + cache spend                          (its new blocks evict other sessions' history,
                                                 a second copy of history cached elsewhere)

See docs/scoring.md ("The cost in seconds"). Block counts use ``RouteRequest.block_size``;
token counts are named ``*_tokens``; times are seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from index.types import PrefixMatch
from scoring.api import Candidate, WorkerLoad
from scoring.calibration import TtftEstimate, TtftFeatures, attention_pairs
from scoring.config import KvPolicyConfig
from scoring.cost_parts import (
    BlendedLoad,
    CostRecord,
    QuoteBase,
    RequestSize,
    blend,
    blended,
    blocked_wait_s,
    busy_reason,
    cache_survival,
    clip_match,
    context_token_parts,
    fleet_factor,
    kv_shortfall,
    overlap_tokens,
    prefill_tokens_after,
    queued_token_parts,
    tier_credit,
    ttft_features,
)


@dataclass(frozen=True, slots=True)
class SecondsCost(CostRecord):
    """Every term behind one worker's cost in seconds (all visible through ``terms()``)."""

    queued: BlendedLoad  # prefill tokens queued ahead
    context: BlendedLoad  # tokens held by running requests
    fleet_factor: float  # requests expected to wait behind this one's prefill
    fleet_s: float
    footprint_ratio: float  # the worker's recent footprint / the candidates' mean
    cache_footprint_s: float
    duplicated_tokens: float  # of its prefill, tokens another candidate holds cached
    reuse: float  # the fleet's recent cache reuse (cached / prompt tokens routed)
    cache_duplicate_s: float
    cache_s: float
    blocked_wait_s: float  # in the cost: the blocked time, expected as long again

    def terms(self) -> dict[str, float]:
        """The named terms, for /debug/route and the decision log line."""
        terms = self.common_terms()
        terms |= {
            "predicted_queued_tokens": self.queued.predicted,
            "queued_tokens": self.queued.blended,
            "predicted_context_tokens": self.context.predicted,
            "context_tokens": self.context.blended,
            "fleet_factor": self.fleet_factor,
            "fleet_s": self.fleet_s,
            "footprint_ratio": self.footprint_ratio,
            "cache_footprint_s": self.cache_footprint_s,
            "duplicated_tokens": self.duplicated_tokens,
            "reuse": self.reuse,
            "cache_duplicate_s": self.cache_duplicate_s,
            "cache_s": self.cache_s,
            "blocked_wait_s": self.blocked_wait_s,
        }
        if self.queued.scraped is not None:
            terms["scraped_queued_tokens"] = self.queued.scraped
        if self.context.scraped is not None:
            terms["scraped_context_tokens"] = self.context.scraped
        return terms


def credited_blocks(match: PrefixMatch, config: KvPolicyConfig) -> float:
    """``seconds_overlap_credit`` x the tier-weighted match: the blocks whose prefill is saved."""
    return config.seconds_overlap_credit * tier_credit(match, config)


def queued_load(load: WorkerLoad, config: KvPolicyConfig) -> BlendedLoad:
    """Prefill tokens queued ahead of a new request on this worker."""
    return blend(*queued_token_parts(load, config), config)


def context_load(load: WorkerLoad, block_size: int, config: KvPolicyConfig) -> BlendedLoad:
    """Tokens held by the worker's running requests (read by every decode step)."""
    return blend(*context_token_parts(load, block_size, config), config)


FOOTPRINT_EXCESS_MAX = 1.0
"""``ratio - floor`` is clipped to at most this: with few requests routed (one session on an
idle fleet) ratios swing up to the worker count, and must not outweigh a session's cache."""


def cache_factor(ratio: float, floor: float, config: KvPolicyConfig) -> float:
    """``footprint_weight * clip(ratio - floor, 0, 1)``: the share of a worker's new prefill
    that evicts other sessions' history there, measured from the least demanded cache of the
    candidates (``floor``, its ratio). Never negative: writing into the least demanded cache
    is no gain either, and a refund would pay requests to recompute histories cached
    elsewhere."""
    excess = min(max(ratio - floor, 0.0), FOOTPRINT_EXCESS_MAX)
    return config.footprint_weight * excess


@dataclass(frozen=True, slots=True)
class FleetView:
    """What every candidate's cost shares (computed once per request): the fleet factor, the
    lowest footprint ratio and the fewest tokens to prefill of the candidates."""

    fleet_factor: float = 0.0
    footprint_floor: float = 1.0
    least_prefill_tokens: float | None = None  # the best placement's prefill
    reuse: float = 0.0  # the candidates' mean reuse

    @classmethod
    def of(
        cls,
        size: RequestSize,
        candidates: Sequence[Candidate],
        ratios: Sequence[float],
        config: KvPolicyConfig,
        fits: Sequence[float] | None = None,
    ) -> FleetView:
        shares = fits if fits is not None else [1.0] * len(candidates)
        least = min(
            (prefill_tokens(size, c, config, f) for c, f in zip(candidates, shares, strict=True)),
            default=None,
        )
        reuse = sum(c.load.reuse for c in candidates) / len(candidates) if candidates else 0.0
        return cls(fleet_factor(candidates, config), min(ratios, default=1.0), least, reuse)


def prefill_tokens(
    size: RequestSize, candidate: Candidate, config: KvPolicyConfig, fit: float = 1.0
) -> float:
    """Tokens ``candidate`` would prefill: the prompt less its credited match (``fit``: the
    share credited for fitting, ``kv_fit_shares``)."""
    load = candidate.load
    match = clip_match(candidate.match, size.full_blocks)
    queued = blended(*queued_token_parts(load, config), config)
    survival = cache_survival(load, queued / size.block_size, config)
    return prefill_tokens_after(size, credited_blocks(match, config) * survival * fit)


def duplicated_tokens(prefill: float, fleet: FleetView) -> float:
    """Of ``prefill``, the tokens another candidate holds cached (0 for the best placement)."""
    least = fleet.least_prefill_tokens
    return max(prefill - least, 0.0) if least is not None else 0.0


def duplicate_factor(
    prefill: float,
    duplicated: float,
    footprint_ratio: float,
    fleet: FleetView,
    config: KvPolicyConfig,
) -> float:
    """``duplicate_weight * reuse * pressure * duplicated / prefill``: the share of the own
    prefill that writes a second copy of history cached elsewhere, evicting cached blocks
    that this traffic reuses as often as the fleet's recent requests reused theirs
    (``fleet.reuse``: fleet-wide, steadier than one worker's, whose recent requests may all
    have been new sessions whose histories are about to be reused). ``pressure`` is the
    worker's footprint ratio clipped to 0..1: a cache in as much demand as the fleet's
    mean or more evicts for every block written; a cache little used evicts little (a copy
    of a shared prefix to a replica that has none costs nothing)."""
    if duplicated <= 0.0 or prefill <= 0.0:
        return 0.0
    reuse = min(max(fleet.reuse, 0.0), 1.0)
    pressure = min(max(footprint_ratio, 0.0), 1.0)
    return config.duplicate_weight * reuse * pressure * min(duplicated / prefill, 1.0)


def worker_cost(
    size: RequestSize,
    candidate: Candidate,
    config: KvPolicyConfig,
    footprint_ratio: float = 1.0,
    fleet: FleetView = FleetView(),
    *,
    fit: float = 1.0,
) -> SecondsCost:
    """The full cost of sending a request of ``size`` to ``candidate`` (lower is better);
    ``fit``: the share of its match credited for fitting (``kv_fit_shares``)."""
    load = candidate.load
    match = clip_match(candidate.match, size.full_blocks)
    queued = queued_load(load, config)
    survival = cache_survival(load, queued.blended / size.block_size, config)
    credited = credited_blocks(match, config) * survival * fit
    prefill = prefill_tokens_after(size, credited)
    context = context_load(load, size.block_size, config)
    features = ttft_features(load, prefill, size.prompt_tokens, size.block_size, config)
    ttft = candidate.ttft.predict(features)
    k = fleet.fleet_factor
    footprint = cache_factor(footprint_ratio, fleet.footprint_floor, config)
    duplicated = duplicated_tokens(prefill, fleet)
    duplicate = duplicate_factor(prefill, duplicated, footprint_ratio, fleet, config)
    overlap = overlap_tokens(match.blocks, size)
    return SecondsCost(
        worker=candidate.worker,
        match=match,
        request_blocks=size.blocks,
        overlap_tokens=overlap,
        uncached_tokens=max(size.prompt_tokens - overlap, 0),
        credited=credited,
        cache_survival=survival,
        kv_shortfall=kv_shortfall(candidate, size, config),
        in_flight_prefix=candidate.in_flight_prefix,
        kv_fit=fit,
        prefill_blocks=size.blocks - credited,
        queued=queued,
        context=context,
        params=candidate.ttft,
        ttft=ttft,
        fleet_factor=k,
        fleet_s=k * ttft.prefill_s,
        footprint_ratio=footprint_ratio,
        cache_footprint_s=footprint * ttft.prefill_s,
        duplicated_tokens=duplicated,
        reuse=fleet.reuse,
        cache_duplicate_s=duplicate * ttft.prefill_s,
        cache_s=(footprint + duplicate) * ttft.prefill_s,
        blocked_wait_s=(waited := blocked_wait_s(load, config)),
        cost=_total(ttft, k, footprint + duplicate) + waited,
        in_flight=load.in_flight,
        blocked_requests=load.blocked_requests,
        blocked_s=load.blocked_s,
        busy=busy_reason(load, config, fit),
    )


def _whole(size: RequestSize) -> TtftFeatures:
    """The whole prompt prefilled, nothing queued."""
    tokens = float(size.prompt_tokens)
    return TtftFeatures(tokens, attention_pairs(tokens, tokens))


def _total(ttft: TtftEstimate, fleet_factor: float, cache_factor: float) -> float:
    """``ttft + (fleet_factor + cache_factor) * own prefill`` (both factors >= 0, so more
    uncached tokens never cost less)."""
    return ttft.total_s + (fleet_factor + cache_factor) * ttft.prefill_s


class SecondsQuote(QuoteBase):
    """One worker's cost in seconds and what ranking needs, without the terms: the routing hot path.

    ``cost`` is computed by the same steps as ``worker_cost(...).cost`` (so it is equal to
    the last bit); ``full()`` builds that ``SecondsCost`` on demand (``/debug/route``, logs).
    ``scale`` is the temperature's unit: the whole prompt's predicted prefill seconds there.
    """

    __slots__ = ("_fleet",)

    def __init__(
        self,
        size: RequestSize,
        candidate: Candidate,
        config: KvPolicyConfig,
        footprint_ratio: float = 1.0,
        fleet: FleetView = FleetView(),
        *,
        fit: float = 1.0,
    ) -> None:
        load = candidate.load
        prefill = prefill_tokens(size, candidate, config, fit)
        features = ttft_features(load, prefill, size.prompt_tokens, size.block_size, config)
        ttft = candidate.ttft.predict(features)
        spend = cache_factor(footprint_ratio, fleet.footprint_floor, config)
        duplicated = duplicated_tokens(prefill, fleet)
        spend += duplicate_factor(prefill, duplicated, footprint_ratio, fleet, config)
        cost = _total(ttft, fleet.fleet_factor, spend) + blocked_wait_s(load, config)
        # the whole prompt's prefill there: the temperature's unit
        scale = candidate.ttft.predict(_whole(size)).prefill_s
        super().__init__(size, candidate, config, footprint_ratio, cost=cost, scale=scale, fit=fit)
        self._fleet = fleet

    def full(self) -> SecondsCost:
        return worker_cost(
            self._size,
            self.candidate,
            self._config,
            self._footprint_ratio,
            self._fleet,
            fit=self._fit,
        )
