"""What both decision costs share: the request's size, a worker's clipped match, its load
terms, the busy guard, the cache-survival discount, footprint ratios, and the inputs of the
worker's TTFT model. Pure arithmetic, no choice.

Block counts use ``RouteRequest.block_size``; token counts are named ``*_tokens``; times
are seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from index.types import PrefixMatch, WorkerId
from scoring.api import Candidate, RouteRequest, WorkerLoad
from scoring.calibration import TtftEstimate, TtftFeatures, TtftParams, attention_pairs
from scoring.config import KvPolicyConfig


@dataclass(frozen=True, slots=True)
class BlendedLoad:
    """One load term: kvgate's prediction, the engine-scraped estimate, and their blend."""

    predicted: float
    scraped: float | None
    blended: float


@dataclass(frozen=True, slots=True)
class CostRecord:
    """What every cost records of one worker, whichever cost it is: the match and what it
    credits, the predicted TTFT there (shown with either cost), the cost and the guard."""

    worker: WorkerId
    match: PrefixMatch  # clipped to the request's blocks
    request_blocks: int
    overlap_tokens: int
    uncached_tokens: int
    credited: float  # matched blocks credited (tier weights, eviction risk, KV fit)
    cache_survival: float  # expected share of the match still cached when the request runs
    kv_shortfall: float  # KV blocks it lacks there to start beside the running requests
    in_flight_prefix: int  # its leading blocks a request in flight there holds
    kv_fit: float  # share of the match credited for fitting (1: fits, or nothing fits)
    prefill_blocks: float
    params: TtftParams  # the worker's learned TTFT model
    ttft: TtftEstimate  # its prediction for this request there
    cost: float
    in_flight: int
    blocked_requests: int  # sent there lacking KV room, not started yet
    blocked_s: float  # how long the oldest of them has waited
    busy: str | None  # why the worker is busy, or None

    def common_terms(self) -> dict[str, float]:
        """The named terms every cost has (its own follow in its ``terms()``)."""
        return {
            "gpu_blocks": float(self.match.gpu),
            "cpu_blocks": float(self.match.cpu),
            "disk_blocks": float(self.match.disk),
            "matched_blocks": float(self.match.blocks),
            "overlap_tokens": float(self.overlap_tokens),
            "uncached_tokens": float(self.uncached_tokens),
            "request_blocks": float(self.request_blocks),
            "credited": self.credited,
            "cache_survival": self.cache_survival,
            "kv_shortfall_blocks": self.kv_shortfall,
            "in_flight_prefix_blocks": float(self.in_flight_prefix),
            "kv_fit": self.kv_fit,
            "prefill_blocks": self.prefill_blocks,
            **ttft_terms(self.ttft, self.params),
            "cost": self.cost,
            "in_flight": float(self.in_flight),
            "blocked_requests": float(self.blocked_requests),
            "blocked_s": self.blocked_s,
            "busy": 1.0 if self.busy else 0.0,
        }


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


def tier_credit(match: PrefixMatch, config: KvPolicyConfig) -> float:
    """``gpu_prefix + w_cpu * cpu_past_gpu + w_disk * disk_past_those`` (each tier weighted)."""
    return (
        config.gpu_weight * match.gpu
        + config.cpu_weight * match.cpu
        + config.disk_weight * match.disk
    )


def overlap_tokens(matched_blocks: int, size: RequestSize) -> int:
    """Prompt tokens the engine should report cached if the match holds."""
    return min(matched_blocks * size.block_size, size.max_overlap_tokens)


def prefill_tokens_after(size: RequestSize, credited: float) -> float:
    """Tokens left to prefill once ``credited`` blocks are reused: at least the last token
    (an engine always computes it), at most the prompt."""
    reused = min(credited * size.block_size, size.max_overlap_tokens)
    return max(size.prompt_tokens - reused, 1.0)


def blended(predicted: float, scraped: float | None, config: KvPolicyConfig) -> float:
    """max of the weighted prediction and weighted scrape: never their sum (no double count)."""
    weighted = config.predicted_load_weight * predicted
    if scraped is not None:
        weighted = max(weighted, config.scraped_load_weight * scraped)
    return weighted


def blend(predicted: float, scraped: float | None, config: KvPolicyConfig) -> BlendedLoad:
    return BlendedLoad(predicted, scraped, blended(predicted, scraped, config))


def queued_token_parts(load: WorkerLoad, config: KvPolicyConfig) -> tuple[float, float | None]:
    """Prefill tokens queued ahead of a new request: (kvgate's prediction, the scrape's)."""
    scraped = None
    if load.scraped_waiting is not None:
        scraped = float(load.scraped_waiting * config.waiting_request_prefill_tokens)
    return float(load.pending_prefill_tokens), scraped


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


def kv_shortfall(candidate: Candidate, size: RequestSize, config: KvPolicyConfig) -> float:
    """KV blocks the request lacks on the worker to start beside its running requests.

    The blocks held by running requests (kvgate's prediction, the sum of their prompts'
    blocks, or the scraped KV usage x capacity, whichever is larger) plus the request's
    resident blocks, against the capacity (scraped, else ``kv_capacity_blocks``); at most
    the resident blocks; 0 when the capacity is unknown. Resident: with ``kv_fit_cached``
    (the default) all its blocks less the prefix a request in flight there holds (among the
    held blocks already), since a cached match is evictable until the request runs; without
    it, as an engine admits a request, only the blocks outside its GPU match.
    """
    if config.kv_fit_cached:
        resident = float(max(size.blocks - max(candidate.in_flight_prefix, 0), 0))
    else:
        match = clip_match(candidate.match, size.full_blocks)
        resident = float(max(size.blocks - match.gpu, 0))
    return min(max(kv_overcommit(candidate.load, resident, config), 0.0), resident)


def kv_overcommit(load: WorkerLoad, resident_blocks: float, config: KvPolicyConfig) -> float:
    """Held blocks (the larger of kvgate's prediction and the scrape) plus
    ``resident_blocks``, less the capacity (scraped, else ``kv_capacity_blocks``): what
    running requests must release before a request needing ``resident_blocks`` starts
    there (it fits at 0 or below). 0 when the capacity is unknown or the fit is off."""
    capacity = load.kv_capacity_blocks or config.kv_capacity_blocks
    if capacity is None or config.kv_fit_weight <= 0.0:
        return 0.0
    predicted, scraped = held_block_parts(load, config)
    return blended(max(predicted, 0.0), scraped, config) + resident_blocks - capacity


def blocked_wait_s(load: WorkerLoad, config: KvPolicyConfig) -> float:
    """``blocked_wait_weight * blocked_s``: the time the oldest request sent to the worker
    lacking KV room has waited there unstarted, expected about as long again (an engine
    admits in order; a wait for a running request to end that has lasted long is expected to
    last about as long again). Both costs price it: in seconds, and in blocks at the
    worker's learned prefill rate."""
    return config.blocked_wait_weight * max(load.blocked_s, 0.0)


def kv_fit_shares(shortfalls: Sequence[float], config: KvPolicyConfig) -> list[float]:
    """Each candidate's share of its match credited for fitting: ``1 - kv_fit_weight`` where
    the request lacks KV blocks while another candidate has room for it, else 1.

    A request that does not fit waits in the engine until running requests end and release
    their blocks: a decode of unknown length, often longer than recomputing the prompt
    elsewhere, so its cached match there is not worth its prefill. When no candidate fits,
    every one waits alike and the match keeps its full credit."""
    weight = config.kv_fit_weight
    if weight <= 0.0 or all(s > 0.0 for s in shortfalls):
        return [1.0] * len(shortfalls)
    return [1.0 - weight if s > 0.0 else 1.0 for s in shortfalls]


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


def busy_reason(load: WorkerLoad, config: KvPolicyConfig, fit: float = 1.0) -> str | None:
    """Why the busy guard skips this worker, or None when it is not busy. ``fit``: the share
    of its match credited for fitting (``kv_fit_shares``); below 1 (the request lacks KV
    blocks there while another candidate has room) the worker is set aside when
    ``kv_fit_guard`` is on."""
    if fit < 1.0 and config.kv_fit_guard:
        return "busy: lacks KV room (another worker has room)"
    waiting, limit = load.scraped_waiting, config.max_waiting_requests
    if waiting is not None and limit is not None and waiting > limit:
        return f"busy: waiting {waiting} > {limit}"
    usage, max_usage = load.scraped_kv_usage, config.max_kv_usage
    if usage is not None and max_usage is not None and usage > max_usage:
        return f"busy: kv usage {usage:.3g} > {max_usage:g}"
    return None


class QuoteBase:
    """What every cost's quote (the routing hot path) holds beside its own arithmetic:
    ``cost`` and ``scale`` (the temperature's unit), the worker as ranking reads it, and what
    ``full()`` rebuilds the terms from."""

    __slots__ = (
        "_config",
        "_fit",
        "_footprint_ratio",
        "_size",
        "busy",
        "candidate",
        "cost",
        "in_flight",
        "scale",
        "worker",
    )

    def __init__(
        self,
        size: RequestSize,
        candidate: Candidate,
        config: KvPolicyConfig,
        footprint_ratio: float,
        *,
        cost: float,
        scale: float,
        fit: float = 1.0,
    ) -> None:
        self.cost = cost
        self.scale = scale
        self.worker = candidate.worker
        self.in_flight = candidate.load.in_flight
        self.busy = busy_reason(candidate.load, config, fit)
        self.candidate = candidate
        self._size = size
        self._config = config
        self._footprint_ratio = footprint_ratio
        self._fit = fit


def footprint_ratios(candidates: Sequence[Candidate]) -> list[float]:
    """Each candidate's recent footprint over the candidates' mean (all 1.0 when none)."""
    total = sum(c.load.footprint for c in candidates)
    mean = total / len(candidates) if candidates else 0.0
    if not mean > 0.0:  # nothing routed yet (or too little to divide by)
        return [1.0] * len(candidates)
    return [c.load.footprint / mean for c in candidates]


# ---- the TTFT model's inputs: one definition for routing, /debug/route and calibration ----


def held_block_parts(load: WorkerLoad, config: KvPolicyConfig) -> tuple[float, float | None]:
    """Blocks held by the worker's running requests: (kvgate's prediction, the scrape's: KV
    usage x capacity, None without either)."""
    return held_blocks_at(load, load.kv_capacity_blocks or config.kv_capacity_blocks)


def held_blocks_at(load: WorkerLoad, capacity: int | None) -> tuple[float, float | None]:
    """``held_block_parts`` against a given KV ``capacity`` (the scrape's part is None
    without it or without a scraped usage)."""
    scraped = None
    if load.scraped_kv_usage is not None and capacity is not None:
        scraped = min(max(load.scraped_kv_usage, 0.0), 1.0) * capacity
    return float(load.active_decode_blocks), scraped


def context_token_parts(
    load: WorkerLoad, block_size: int, config: KvPolicyConfig
) -> tuple[float, float | None]:
    """Tokens held by the worker's running requests: (kvgate's prediction, the scrape's)."""
    predicted, scraped = held_block_parts(load, config)
    return predicted * block_size, (scraped * block_size if scraped is not None else None)


def ttft_features(
    load: WorkerLoad,
    uncached_tokens: float,
    prompt_tokens: float,
    block_size: int,
    config: KvPolicyConfig,
) -> TtftFeatures:
    """The TTFT model's inputs for a request of ``prompt_tokens`` with ``uncached_tokens`` to
    prefill on a worker with ``load``: the one definition shared by routing, ``/debug/route``
    and the calibration at dispatch."""
    predicted, scraped = queued_token_parts(load, config)
    queued = blended(predicted, scraped, config)
    context = blended(*context_token_parts(load, block_size, config), config)
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


def ttft_terms(ttft: TtftEstimate, params: TtftParams) -> dict[str, float]:
    """The predicted TTFT, its parts and the model behind it, as named terms."""
    return {
        "ttft_s": ttft.total_s,
        "ttft_base_s": ttft.base_s,
        "ttft_queue_s": ttft.queue_s,
        "ttft_prefill_s": ttft.prefill_s,
        "ttft_interference_s": ttft.interference_s,
        "prefill_tokens_per_s": params.prefill_tokens_per_s,
        "queued_weight": params.queued_weight,
        "model_observations": params.observations,
    }
