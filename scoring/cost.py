"""The ``kv`` cost of one worker for one request, in seconds: pure arithmetic, no choice.

    cost = predicted TTFT there                 (base + queue wait + own prefill + interference)
         + fleet_factor x own prefill seconds   (the wait it adds for requests behind it)
         + cache spend                          (its new blocks evict other sessions' history,
                                                 a second copy of history cached elsewhere)

See docs/scoring.md ("The cost"). Block counts use ``RouteRequest.block_size``; token counts
are named ``*_tokens``; times are seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from index.types import PrefixMatch, WorkerId
from scoring.api import Candidate, RouteRequest, WorkerLoad
from scoring.calibration import (
    TtftEstimate,
    TtftFeatures,
    TtftParams,
    attention_pairs,
)
from scoring.config import KvPolicyConfig


@dataclass(frozen=True, slots=True)
class BlendedLoad:
    """One load term: kvgate's prediction, the engine-scraped estimate, and their blend."""

    predicted: float
    scraped: float | None
    blended: float


@dataclass(frozen=True, slots=True)
class WorkerCost:
    """Every term behind one worker's cost (all visible through ``terms()``)."""

    worker: WorkerId
    match: PrefixMatch  # clipped to the request's blocks
    request_blocks: int
    overlap_tokens: int
    uncached_tokens: int
    credited: float  # matched blocks credited (tier weights, eviction risk)
    cache_survival: float  # expected share of the match still cached when the request runs
    prefill_blocks: float
    queued: BlendedLoad  # prefill tokens queued ahead
    context: BlendedLoad  # tokens held by running requests
    params: TtftParams
    ttft: TtftEstimate
    fleet_factor: float  # requests expected to wait behind this one's prefill
    fleet_s: float
    footprint_ratio: float  # the worker's recent footprint / the candidates' mean
    cache_footprint_s: float
    duplicated_tokens: float  # of its prefill, tokens another candidate holds cached
    reuse: float  # the fleet's recent cache reuse (cached / prompt tokens routed)
    cache_duplicate_s: float
    cache_s: float
    cost: float
    in_flight: int
    busy: str | None  # why the worker is busy, or None

    def terms(self) -> dict[str, float]:
        """The named terms, for /debug/route and the decision log line."""
        ttft = self.ttft
        terms: dict[str, float] = {
            "gpu_blocks": float(self.match.gpu),
            "cpu_blocks": float(self.match.cpu),
            "disk_blocks": float(self.match.disk),
            "matched_blocks": float(self.match.blocks),
            "overlap_tokens": float(self.overlap_tokens),
            "uncached_tokens": float(self.uncached_tokens),
            "request_blocks": float(self.request_blocks),
            "credited": self.credited,
            "cache_survival": self.cache_survival,
            "prefill_blocks": self.prefill_blocks,
            "predicted_queued_tokens": self.queued.predicted,
            "queued_tokens": self.queued.blended,
            "predicted_context_tokens": self.context.predicted,
            "context_tokens": self.context.blended,
            "ttft_s": ttft.total_s,
            "ttft_base_s": ttft.base_s,
            "ttft_queue_s": ttft.queue_s,
            "ttft_prefill_s": ttft.prefill_s,
            "ttft_interference_s": ttft.interference_s,
            "prefill_tokens_per_s": self.params.prefill_tokens_per_s,
            "queued_weight": self.params.queued_weight,
            "model_observations": self.params.observations,
            "fleet_factor": self.fleet_factor,
            "fleet_s": self.fleet_s,
            "footprint_ratio": self.footprint_ratio,
            "cache_footprint_s": self.cache_footprint_s,
            "duplicated_tokens": self.duplicated_tokens,
            "reuse": self.reuse,
            "cache_duplicate_s": self.cache_duplicate_s,
            "cache_s": self.cache_s,
            "cost": self.cost,
            "in_flight": float(self.in_flight),
            "busy": 1.0 if self.busy else 0.0,
        }
        if self.queued.scraped is not None:
            terms["scraped_queued_tokens"] = self.queued.scraped
        if self.context.scraped is not None:
            terms["scraped_context_tokens"] = self.context.scraped
        return terms


@dataclass(frozen=True, slots=True)
class RequestSize:
    """The request's size, computed once and shared by every candidate's cost."""

    block_size: int
    prompt_tokens: int  # the token count, else the blocks' tokens
    blocks: int  # blocks to prefill without any cache (a partial tail block counts)
    full_blocks: int  # whole blocks: the only ones an engine can have cached
    max_overlap_tokens: int  # cached tokens can never exceed this


def request_size(request: RouteRequest) -> RequestSize:
    """Blocks and token bounds of ``request``.

    An engine always computes the prompt's last token, so at most the whole blocks before it
    can be hits (vLLM's rule); without a token count, every whole block can be.
    """
    block_size = max(request.block_size, 1)
    tokens = request.prompt_tokens
    full = max(len(request.block_keys), tokens // block_size)
    blocks = max(full, -(-tokens // block_size))
    if tokens > 0:
        max_overlap = min(full, (tokens - 1) // block_size) * block_size
    else:
        max_overlap = full * block_size
    return RequestSize(
        block_size=block_size,
        prompt_tokens=tokens if tokens > 0 else blocks * block_size,
        blocks=blocks,
        full_blocks=full,
        max_overlap_tokens=max_overlap,
    )


def request_blocks(request: RouteRequest) -> int:
    """Blocks the prompt occupies: its full-block keys, or its token count rounded up."""
    return request_size(request).blocks


def clip_match(match: PrefixMatch, blocks: int) -> PrefixMatch:
    """The match limited to ``blocks`` (GPU run first, then CPU, then disk)."""
    if match.blocks <= blocks and min(match.gpu, match.cpu, match.disk) >= 0:
        return match
    gpu = min(max(match.gpu, 0), blocks)
    cpu = min(max(match.cpu, 0), blocks - gpu)
    disk = min(max(match.disk, 0), blocks - gpu - cpu)
    return PrefixMatch(gpu=gpu, cpu=cpu, disk=disk)


def credited_blocks(match: PrefixMatch, config: KvPolicyConfig) -> float:
    """``overlap_credit * (w_gpu * gpu_prefix + w_cpu * cpu_past_gpu + w_disk *
    disk_past_those)``: each tier weighted, the whole scaled by the operator's credit."""
    return config.overlap_credit * (
        config.gpu_weight * match.gpu
        + config.cpu_weight * match.cpu
        + config.disk_weight * match.disk
    )


def overlap_tokens(matched_blocks: int, size: RequestSize) -> int:
    """Prompt tokens the engine should report cached if the match holds."""
    return min(matched_blocks * size.block_size, size.max_overlap_tokens)


def _blended(predicted: float, scraped: float | None, config: KvPolicyConfig) -> float:
    """max of the weighted prediction and weighted scrape: never their sum (no double count)."""
    weighted = config.predicted_load_weight * predicted
    if scraped is not None:
        weighted = max(weighted, config.scraped_load_weight * scraped)
    return weighted


def _queued_parts(load: WorkerLoad, config: KvPolicyConfig) -> tuple[float, float | None]:
    scraped = None
    if load.scraped_waiting is not None:
        scraped = float(load.scraped_waiting * config.waiting_request_prefill_tokens)
    return float(load.pending_prefill_tokens), scraped


def _context_parts(
    load: WorkerLoad, block_size: int, config: KvPolicyConfig
) -> tuple[float, float | None]:
    scraped = None
    capacity = load.kv_capacity_blocks or config.kv_capacity_blocks
    if load.scraped_kv_usage is not None and capacity is not None:
        scraped = min(max(load.scraped_kv_usage, 0.0), 1.0) * capacity * block_size
    return float(load.active_decode_blocks * block_size), scraped


def queued_load(load: WorkerLoad, config: KvPolicyConfig) -> BlendedLoad:
    """Prefill tokens queued ahead of a new request on this worker."""
    predicted, scraped = _queued_parts(load, config)
    return BlendedLoad(predicted, scraped, _blended(predicted, scraped, config))


def context_load(load: WorkerLoad, block_size: int, config: KvPolicyConfig) -> BlendedLoad:
    """Tokens held by the worker's running requests (read by every decode step)."""
    predicted, scraped = _context_parts(load, block_size, config)
    return BlendedLoad(predicted, scraped, _blended(predicted, scraped, config))


def ttft_features(
    load: WorkerLoad,
    uncached_tokens: float,
    prompt_tokens: float,
    block_size: int,
    config: KvPolicyConfig,
) -> TtftFeatures:
    """The TTFT model's inputs for a request of ``prompt_tokens`` with ``uncached_tokens`` to
    prefill on a worker with ``load``: the one definition shared by routing and by the
    calibration at dispatch."""
    predicted, scraped = _queued_parts(load, config)
    queued = _blended(predicted, scraped, config)
    context = _blended(*_context_parts(load, block_size, config), config)
    uncached = max(uncached_tokens, 0.0)
    return TtftFeatures(
        uncached,
        attention_pairs(uncached, max(prompt_tokens, uncached)),
        queued,
        _queued_pairs(load, queued, predicted),
        context,
    )


def _queued_pairs(load: WorkerLoad, queued: float, predicted: float) -> float:
    """Attention pairs of the queued prefill: kvgate's own, scaled up when the scrape sees
    more queued tokens than kvgate sent (other traffic, assumed alike)."""
    pairs = max(load.pending_prefill_pairs, 0.0)
    if predicted > 0.0 and queued > predicted:
        return pairs * queued / predicted
    return pairs


def cache_survival(load: WorkerLoad, queued_blocks: float, config: KvPolicyConfig) -> float:
    """The share of a cached match credited, for the risk of its eviction before use.

    A request waits behind ``queued_blocks`` of new prefill allocations. While they fit in
    the free pool (``capacity x (1 - KV usage)``: free and cached-but-unused blocks), the
    engine evicts the least recently used of those first, and a match touched by its
    session's last turn is rarely among them. A queue larger than the free pool must take
    what running requests release as well: the excess, relative to the whole cache, is the
    share of cached blocks expected to go (capped at 1). 1.0 when the engine does not report
    its usage and capacity.
    """
    weight = config.eviction_risk_weight
    usage = load.scraped_kv_usage
    capacity = load.kv_capacity_blocks or config.kv_capacity_blocks
    if weight <= 0.0 or usage is None or capacity is None:
        return 1.0
    free = capacity * (1.0 - min(max(usage, 0.0), 1.0))
    risk = min(1.0, max(0.0, queued_blocks - free) / capacity)
    return 1.0 - weight * risk


def busy_reason(load: WorkerLoad, config: KvPolicyConfig) -> str | None:
    """Why the busy guard skips this worker, or None when it is not busy."""
    waiting, limit = load.scraped_waiting, config.max_waiting_requests
    if waiting is not None and limit is not None and waiting > limit:
        return f"busy: waiting {waiting} > {limit}"
    usage, max_usage = load.scraped_kv_usage, config.max_kv_usage
    if usage is not None and max_usage is not None and usage > max_usage:
        return f"busy: kv usage {usage:.3g} > {max_usage:g}"
    return None


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


def footprint_ratios(candidates: Sequence[Candidate]) -> list[float]:
    """Each candidate's recent footprint over the candidates' mean (all 1.0 when none)."""
    total = sum(c.load.footprint for c in candidates)
    mean = total / len(candidates) if candidates else 0.0
    if not mean > 0.0:  # nothing routed yet (or too little to divide by)
        return [1.0] * len(candidates)
    return [c.load.footprint / mean for c in candidates]


def fleet_factor(candidates: Sequence[Candidate], config: KvPolicyConfig) -> float:
    """``rho / (1 - rho)``: how many requests are expected to wait behind a new one's
    prefill, with ``rho`` the candidates' mean prefill-busy share (capped at
    ``max_utilisation``). In an M/M/1 queue at utilisation rho, rho / (1 - rho) is the mean
    number of requests in the system; each of them would wait the extra seconds too."""
    if not candidates or config.max_utilisation <= 0.0:
        return 0.0
    rho = sum(min(max(c.load.prefill_busy_share, 0.0), 1.0) for c in candidates) / len(candidates)
    rho = min(rho, config.max_utilisation)
    return rho / (1.0 - rho)


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
    ) -> FleetView:
        least = min((prefill_tokens(size, c, config) for c in candidates), default=None)
        reuse = sum(c.load.reuse for c in candidates) / len(candidates) if candidates else 0.0
        return cls(fleet_factor(candidates, config), min(ratios, default=1.0), least, reuse)


def prefill_tokens(size: RequestSize, candidate: Candidate, config: KvPolicyConfig) -> float:
    """Tokens ``candidate`` would prefill: the prompt less its credited match."""
    load = candidate.load
    match = clip_match(candidate.match, size.full_blocks)
    queued = _blended(*_queued_parts(load, config), config)
    survival = cache_survival(load, queued / size.block_size, config)
    return _prefill_tokens(size, credited_blocks(match, config) * survival)


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
) -> WorkerCost:
    """The full cost of sending a request of ``size`` to ``candidate`` (lower is better)."""
    load = candidate.load
    match = clip_match(candidate.match, size.full_blocks)
    queued = queued_load(load, config)
    survival = cache_survival(load, queued.blended / size.block_size, config)
    credited = credited_blocks(match, config) * survival
    prefill = _prefill_tokens(size, credited)
    context = context_load(load, size.block_size, config)
    features = ttft_features(load, prefill, size.prompt_tokens, size.block_size, config)
    ttft = candidate.ttft.predict(features)
    k = fleet.fleet_factor
    footprint = cache_factor(footprint_ratio, fleet.footprint_floor, config)
    duplicated = duplicated_tokens(prefill, fleet)
    duplicate = duplicate_factor(prefill, duplicated, footprint_ratio, fleet, config)
    overlap = overlap_tokens(match.blocks, size)
    return WorkerCost(
        worker=candidate.worker,
        match=match,
        request_blocks=size.blocks,
        overlap_tokens=overlap,
        uncached_tokens=max(size.prompt_tokens - overlap, 0),
        credited=credited,
        cache_survival=survival,
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
        cost=_total(ttft, k, footprint + duplicate),
        in_flight=load.in_flight,
        busy=busy_reason(load, config),
    )


def _whole(size: RequestSize) -> TtftFeatures:
    """The whole prompt prefilled, nothing queued."""
    tokens = float(size.prompt_tokens)
    return TtftFeatures(tokens, attention_pairs(tokens, tokens))


def _prefill_tokens(size: RequestSize, credited: float) -> float:
    """Tokens left to prefill once ``credited`` blocks are reused: at least the last token
    (an engine always computes it), at most the prompt."""
    reused = min(credited * size.block_size, size.max_overlap_tokens)
    return max(size.prompt_tokens - reused, 1.0)


def _total(ttft: TtftEstimate, fleet_factor: float, cache_factor: float) -> float:
    """``ttft + (fleet_factor + cache_factor) * own prefill`` (both factors >= 0, so more
    uncached tokens never cost less)."""
    return ttft.total_s + (fleet_factor + cache_factor) * ttft.prefill_s


class CostQuote:
    """One worker's cost and what ranking needs, without the terms: the routing hot path.

    ``cost`` is computed by the same steps as ``worker_cost(...).cost`` (so it is equal to
    the last bit); ``full()`` builds that ``WorkerCost`` on demand (``/debug/route``, logs).
    """

    __slots__ = (
        "_config",
        "_fleet",
        "_footprint_ratio",
        "_size",
        "busy",
        "candidate",
        "cost",
        "full_prefill_s",
        "in_flight",
        "worker",
    )

    def __init__(
        self,
        size: RequestSize,
        candidate: Candidate,
        config: KvPolicyConfig,
        footprint_ratio: float = 1.0,
        fleet: FleetView = FleetView(),
    ) -> None:
        load = candidate.load
        prefill = prefill_tokens(size, candidate, config)
        features = ttft_features(load, prefill, size.prompt_tokens, size.block_size, config)
        ttft = candidate.ttft.predict(features)
        spend = cache_factor(footprint_ratio, fleet.footprint_floor, config)
        duplicated = duplicated_tokens(prefill, fleet)
        spend += duplicate_factor(prefill, duplicated, footprint_ratio, fleet, config)
        self.cost = _total(ttft, fleet.fleet_factor, spend)
        # the whole prompt's prefill there: the temperature's unit
        self.full_prefill_s = candidate.ttft.predict(_whole(size)).prefill_s
        self.worker = candidate.worker
        self.in_flight = load.in_flight
        self.busy = busy_reason(load, config)
        self.candidate = candidate
        self._size = size
        self._config = config
        self._footprint_ratio = footprint_ratio
        self._fleet = fleet

    def full(self) -> WorkerCost:
        return worker_cost(
            self._size, self.candidate, self._config, self._footprint_ratio, self._fleet
        )
