"""The ``kv`` cost of one worker for one request: pure arithmetic, no choice.

All quantities are in KV blocks of ``RouteRequest.block_size`` unless named ``*_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from index.types import PrefixMatch, WorkerId
from scoring.api import Candidate, RouteRequest, WorkerLoad
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
    credited: float
    cache_survival: float  # expected share of the match still cached when the request runs
    prefill_blocks: float
    queued_prefill: BlendedLoad
    decode: BlendedLoad
    load_blocks: float
    footprint_ratio: float  # the worker's recent footprint / the candidates' mean
    footprint_cost: float
    cost: float
    in_flight: int
    busy: str | None  # why the worker is busy, or None

    def terms(self) -> dict[str, float]:
        """The named terms, for /debug/route and the decision log line."""
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
            "predicted_queued_prefill_blocks": self.queued_prefill.predicted,
            "queued_prefill_blocks": self.queued_prefill.blended,
            "predicted_decode_blocks": self.decode.predicted,
            "decode_blocks": self.decode.blended,
            "load_blocks": self.load_blocks,
            "footprint_ratio": self.footprint_ratio,
            "footprint_cost": self.footprint_cost,
            "cost": self.cost,
            "in_flight": float(self.in_flight),
            "busy": 1.0 if self.busy else 0.0,
        }
        if self.queued_prefill.scraped is not None:
            terms["scraped_queued_prefill_blocks"] = self.queued_prefill.scraped
        if self.decode.scraped is not None:
            terms["scraped_decode_blocks"] = self.decode.scraped
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
    """``gpu_prefix + w_cpu * cpu_past_gpu + w_disk * disk_past_those`` (each tier weighted)."""
    return (
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


def _blend(predicted: float, scraped: float | None, config: KvPolicyConfig) -> BlendedLoad:
    return BlendedLoad(predicted, scraped, _blended(predicted, scraped, config))


def _queued_parts(
    load: WorkerLoad, block_size: int, config: KvPolicyConfig
) -> tuple[float, float | None]:
    predicted = load.pending_prefill_tokens / block_size
    scraped = None
    if load.scraped_waiting is not None:
        scraped = load.scraped_waiting * config.waiting_request_prefill_tokens / block_size
    return predicted, scraped


def _decode_parts(load: WorkerLoad, config: KvPolicyConfig) -> tuple[float, float | None]:
    scraped = None
    if load.scraped_kv_usage is not None and config.kv_capacity_blocks is not None:
        scraped = load.scraped_kv_usage * config.kv_capacity_blocks
    return float(load.active_decode_blocks), scraped


def queued_prefill_load(load: WorkerLoad, block_size: int, config: KvPolicyConfig) -> BlendedLoad:
    """Prefill work queued ahead of a new request on this worker, in blocks (``block_size`` > 0)."""
    predicted, scraped = _queued_parts(load, block_size, config)
    return _blend(predicted, scraped, config)


def decode_load(load: WorkerLoad, config: KvPolicyConfig) -> BlendedLoad:
    """KV blocks held by the worker's running requests."""
    predicted, scraped = _decode_parts(load, config)
    return _blend(predicted, scraped, config)


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


def _cost(prefill: float, load_blocks: float, config: KvPolicyConfig) -> float:
    return config.overlap_credit * prefill + load_blocks


def _load_blocks(queued: float, decode: float, config: KvPolicyConfig) -> float:
    return config.queued_prefill_weight * queued + config.decode_weight * decode


FOOTPRINT_EXCESS_MIN = -0.5
FOOTPRINT_EXCESS_MAX = 1.0
"""``ratio - 1`` is clipped to these bounds: with few requests routed (one session on an idle
fleet) ratios swing between 0 and the worker count, and must not outweigh a session's cache."""


def footprint_cost(prefill: float, ratio: float, config: KvPolicyConfig) -> float:
    """``overlap_credit * footprint_weight * prefill_blocks * clip(ratio - 1)``.

    The blocks a request writes into a cache in more demand than the fleet's mean evict more
    of other sessions' hot blocks (fewer below the mean): each prefill block is priced
    ``overlap_credit * (1 + footprint_weight * clip(ratio - 1))``, between 0.5 and 2 times the
    plain price. Cached blocks write nothing, so a session's home barely pays it.
    """
    excess = min(max(ratio - 1.0, FOOTPRINT_EXCESS_MIN), FOOTPRINT_EXCESS_MAX)
    return config.overlap_credit * config.footprint_weight * prefill * excess


def footprint_ratios(candidates: Sequence[Candidate]) -> list[float]:
    """Each candidate's recent footprint over the candidates' mean (all 1.0 when none)."""
    total = sum(c.load.footprint for c in candidates)
    if total <= 0.0:
        return [1.0] * len(candidates)
    mean = total / len(candidates)
    return [c.load.footprint / mean for c in candidates]


def worker_cost(
    size: RequestSize,
    candidate: Candidate,
    config: KvPolicyConfig,
    footprint_ratio: float = 1.0,
) -> WorkerCost:
    """The full cost of sending a request of ``size`` to ``candidate`` (lower is better)."""
    match = clip_match(candidate.match, size.full_blocks)
    queued = queued_prefill_load(candidate.load, size.block_size, config)
    survival = cache_survival(candidate.load, queued.blended, config)
    credited = credited_blocks(match, config) * survival
    prefill = size.blocks - credited
    overlap = overlap_tokens(match.blocks, size)
    decode = decode_load(candidate.load, config)
    load_blocks = _load_blocks(queued.blended, decode.blended, config)
    return WorkerCost(
        worker=candidate.worker,
        match=match,
        request_blocks=size.blocks,
        overlap_tokens=overlap,
        uncached_tokens=max(size.prompt_tokens - overlap, 0),
        credited=credited,
        cache_survival=survival,
        prefill_blocks=prefill,
        queued_prefill=queued,
        decode=decode,
        load_blocks=load_blocks,
        footprint_ratio=footprint_ratio,
        footprint_cost=(footprint := footprint_cost(prefill, footprint_ratio, config)),
        cost=_cost(prefill, load_blocks, config) + footprint,
        in_flight=candidate.load.in_flight,
        busy=busy_reason(candidate.load, config),
    )


class CostQuote:
    """One worker's cost and what ranking needs, without the terms: the routing hot path.

    ``cost`` is computed by the same steps as ``worker_cost(...).cost`` (so it is equal to
    the last bit); ``full()`` builds that ``WorkerCost`` on demand (``/debug/route``, logs).
    """

    __slots__ = (
        "_config",
        "_footprint_ratio",
        "_size",
        "busy",
        "candidate",
        "cost",
        "in_flight",
        "worker",
    )

    def __init__(
        self,
        size: RequestSize,
        candidate: Candidate,
        config: KvPolicyConfig,
        footprint_ratio: float = 1.0,
    ) -> None:
        load = candidate.load
        match = clip_match(candidate.match, size.full_blocks)
        queued = _blended(*_queued_parts(load, size.block_size, config), config)
        survival = cache_survival(load, queued, config)
        prefill = size.blocks - credited_blocks(match, config) * survival
        decode = _blended(*_decode_parts(load, config), config)
        self.cost = _cost(prefill, _load_blocks(queued, decode, config), config) + footprint_cost(
            prefill, footprint_ratio, config
        )
        self.worker = candidate.worker
        self.in_flight = load.in_flight
        self.busy = busy_reason(load, config)
        self.candidate = candidate
        self._size = size
        self._config = config
        self._footprint_ratio = footprint_ratio

    def full(self) -> WorkerCost:
        return worker_cost(self._size, self.candidate, self._config, self._footprint_ratio)
