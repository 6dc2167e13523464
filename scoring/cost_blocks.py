"""The block-unit cost of one worker for one request (``cost_model="blocks"``, the default):
pure arithmetic, no choice. All quantities are in KV blocks of ``RouteRequest.block_size``
unless named ``*_tokens``::

    cost = overlap_credit * prefill_blocks * (1 + footprint_weight * clip(ratio - 1)
                                              + fleet_prefill_weight * fleet_factor)
         + queued_prefill_weight * queued_prefill_blocks + decode_weight * decode_blocks
         + blocked_wait_weight * blocked_s * prefill_tokens_per_s / block_size

The worker's predicted TTFT (its learned model, ``scoring.calibration``) is computed for the
terms only: shown in ``/debug/route``, it does not decide.
"""

from __future__ import annotations

from dataclasses import dataclass

from scoring.api import Candidate, WorkerLoad
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
    kv_shortfall,
    overlap_tokens,
    prefill_tokens_after,
    queued_token_parts,
    tier_credit,
    ttft_features,
)


@dataclass(frozen=True, slots=True)
class BlockCost(CostRecord):
    """Every term behind one worker's block-unit cost (all visible through ``terms()``); its
    predicted TTFT is shown, not deciding."""

    queued_prefill: BlendedLoad
    decode: BlendedLoad
    load_blocks: float
    blocked_wait_blocks: float  # the blocked time, as prefill queued ahead (in load_blocks)
    footprint_ratio: float  # the worker's recent footprint / the candidates' mean
    footprint_cost: float
    fleet_factor: float  # requests expected to wait behind this one's prefill
    fleet_cost: float

    def terms(self) -> dict[str, float]:
        """The named terms, for /debug/route and the decision log line."""
        terms = self.common_terms()
        terms |= {
            "predicted_queued_prefill_blocks": self.queued_prefill.predicted,
            "queued_prefill_blocks": self.queued_prefill.blended,
            "predicted_decode_blocks": self.decode.predicted,
            "decode_blocks": self.decode.blended,
            "load_blocks": self.load_blocks,
            "blocked_wait_blocks": self.blocked_wait_blocks,
            "footprint_ratio": self.footprint_ratio,
            "footprint_cost": self.footprint_cost,
            "fleet_factor": self.fleet_factor,
            "fleet_cost": self.fleet_cost,
        }
        if self.queued_prefill.scraped is not None:
            terms["scraped_queued_prefill_blocks"] = self.queued_prefill.scraped
        if self.decode.scraped is not None:
            terms["scraped_decode_blocks"] = self.decode.scraped
        return terms


def _queued_parts(
    load: WorkerLoad, block_size: int, config: KvPolicyConfig
) -> tuple[float, float | None]:
    predicted, scraped = queued_token_parts(load, config)
    return predicted / block_size, (scraped / block_size if scraped is not None else None)


def _decode_parts(load: WorkerLoad, config: KvPolicyConfig) -> tuple[float, float | None]:
    scraped = None
    if load.scraped_kv_usage is not None and config.kv_capacity_blocks is not None:
        scraped = load.scraped_kv_usage * config.kv_capacity_blocks
    return float(load.active_decode_blocks), scraped


def queued_prefill_load(load: WorkerLoad, block_size: int, config: KvPolicyConfig) -> BlendedLoad:
    """Prefill work queued ahead of a new request on this worker, in blocks (``block_size`` > 0)."""
    return blend(*_queued_parts(load, block_size, config), config)


def decode_load(load: WorkerLoad, config: KvPolicyConfig) -> BlendedLoad:
    """KV blocks held by the worker's running requests."""
    return blend(*_decode_parts(load, config), config)


def _cost(prefill: float, load_blocks: float, config: KvPolicyConfig) -> float:
    return config.overlap_credit * prefill + load_blocks


def _load_blocks(queued: float, decode: float, config: KvPolicyConfig) -> float:
    return config.queued_prefill_weight * queued + config.decode_weight * decode


def blocked_wait_blocks(candidate: Candidate, block_size: int, config: KvPolicyConfig) -> float:
    """``blocked_wait_s`` (``blocked_wait_weight * blocked_s``) as prefill queued ahead: times
    the worker's learned ``prefill_tokens_per_s``, over ``block_size``."""
    waited = blocked_wait_s(candidate.load, config)
    if waited <= 0.0:
        return 0.0
    return waited * candidate.ttft.prefill_tokens_per_s / max(block_size, 1)


FOOTPRINT_EXCESS_MAX = 1.0
"""``ratio - 1`` is clipped to at most this (and at least ``footprint_min_excess``): with few
requests routed (one session on an idle fleet) ratios swing between 0 and the worker count,
and must not outweigh a session's cache."""


def footprint_cost(prefill: float, ratio: float, config: KvPolicyConfig) -> float:
    """``overlap_credit * footprint_weight * prefill_blocks * clip(ratio - 1)``.

    The blocks a request writes into a cache in more demand than the fleet's mean evict more
    of other sessions' hot blocks (fewer below the mean): each prefill block is priced
    ``overlap_credit * (1 + footprint_weight * clip(ratio - 1))``, between 0.5 and 2 times the
    plain price. Cached blocks write nothing, so a session's home barely pays it.
    """
    excess = min(max(ratio - 1.0, config.footprint_min_excess), FOOTPRINT_EXCESS_MAX)
    return config.overlap_credit * config.footprint_weight * prefill * excess


def fleet_cost(prefill: float, fleet: float, config: KvPolicyConfig) -> float:
    """``overlap_credit * fleet_prefill_weight * fleet * prefill_blocks``: the own prefill
    counted again for the ``fleet`` requests (``fleet_factor``) expected to wait behind it."""
    return config.overlap_credit * config.fleet_prefill_weight * fleet * prefill


def worker_cost(
    size: RequestSize,
    candidate: Candidate,
    config: KvPolicyConfig,
    footprint_ratio: float = 1.0,
    *,
    fit: float = 1.0,
    fleet: float = 0.0,
) -> BlockCost:
    """The full cost of sending a request of ``size`` to ``candidate`` (lower is better);
    ``fit``: the share of its match credited for fitting (``kv_fit_shares``); ``fleet``:
    the candidates' fleet factor (``fleet_factor``)."""
    load = candidate.load
    match = clip_match(candidate.match, size.full_blocks)
    queued = queued_prefill_load(load, size.block_size, config)
    survival = cache_survival(load, queued.blended, config)
    credited = tier_credit(match, config) * survival * fit
    prefill = size.blocks - credited
    overlap = overlap_tokens(match.blocks, size)
    decode = decode_load(load, config)
    waited = blocked_wait_blocks(candidate, size.block_size, config)
    load_blocks = _load_blocks(queued.blended, decode.blended, config) + waited
    features = ttft_features(
        load,
        prefill_tokens_after(size, credited),
        size.prompt_tokens,
        size.block_size,
        config,
    )
    return BlockCost(
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
        prefill_blocks=prefill,
        queued_prefill=queued,
        decode=decode,
        load_blocks=load_blocks,
        blocked_wait_blocks=waited,
        footprint_ratio=footprint_ratio,
        footprint_cost=(footprint := footprint_cost(prefill, footprint_ratio, config)),
        fleet_factor=fleet,
        fleet_cost=(spread := fleet_cost(prefill, fleet, config)),
        cost=_cost(prefill, load_blocks, config) + footprint + spread,
        in_flight=load.in_flight,
        blocked_requests=load.blocked_requests,
        blocked_s=load.blocked_s,
        busy=busy_reason(load, config, fit),
        params=candidate.ttft,
        ttft=candidate.ttft.predict(features),
    )


class BlockQuote(QuoteBase):
    """One worker's block-unit cost and what ranking needs, without the terms: the routing
    hot path. ``cost`` is computed by the same steps as ``worker_cost(...).cost`` (so it is
    equal to the last bit); ``full()`` builds that ``BlockCost`` on demand (``/debug/route``,
    logs). ``scale`` is the temperature's unit: the request's blocks.
    """

    __slots__ = ("_fleet",)

    def __init__(
        self,
        size: RequestSize,
        candidate: Candidate,
        config: KvPolicyConfig,
        footprint_ratio: float = 1.0,
        *,
        fit: float = 1.0,
        fleet: float = 0.0,
    ) -> None:
        load = candidate.load
        match = clip_match(candidate.match, size.full_blocks)
        queued = blended(*_queued_parts(load, size.block_size, config), config)
        survival = cache_survival(load, queued, config)
        prefill = size.blocks - tier_credit(match, config) * survival * fit
        decode = blended(*_decode_parts(load, config), config)
        waited = blocked_wait_blocks(candidate, size.block_size, config)
        cost = (
            _cost(prefill, _load_blocks(queued, decode, config) + waited, config)
            + footprint_cost(prefill, footprint_ratio, config)
            + fleet_cost(prefill, fleet, config)
        )
        scale = float(max(size.blocks, 1))
        super().__init__(size, candidate, config, footprint_ratio, cost=cost, scale=scale, fit=fit)
        self._fleet = fleet

    def full(self) -> BlockCost:
        return worker_cost(
            self._size,
            self.candidate,
            self._config,
            self._footprint_ratio,
            fit=self._fit,
            fleet=self._fleet,
        )
