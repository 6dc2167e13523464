"""The one cost of sending a request to a worker, in KV blocks: pure arithmetic, no choice.

All quantities are in KV blocks of ``RouteRequest.block_size`` unless named ``*_tokens``::

    cost = overlap_credit * prefill_blocks * (1 + footprint_weight * clip(ratio - 1, -0.5, 1)
                                              + fleet_prefill_weight * fleet_factor)
         + queued_prefill_weight * queued_prefill_blocks + decode_weight * decode_blocks

``prefill_blocks`` is the request's blocks less the credit of its cached match there (GPU,
CPU and disk tiers weighted); ``queued_prefill_blocks`` the prompt kvgate sent there and
not yet prefilled, or the engine's waiting queue (``WAITING_REQUEST_PREFILL_TOKENS`` a
request), whichever is larger; ``decode_blocks`` the blocks its running requests hold;
``ratio`` the worker's recent footprint over the candidates' mean; ``fleet_factor`` how
many requests wait behind a new one's prefill (docs/scoring.md).

``price`` computes the number once and keeps every term of it (``Price``); the named terms
are formatted only when asked (``/debug/route``, the decision log line).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.index.types import PrefixMatch
from kvgate.scoring.api import Candidate, RouteRequest
from kvgate.scoring.config import KvPolicyConfig

WAITING_REQUEST_PREFILL_TOKENS = 512
"""Prefill tokens assumed for each request an engine reports waiting: the scraped waiting
count as queued prefill (only traffic kvgate did not route makes it exceed kvgate's own)."""
FOOTPRINT_EXCESS = (-0.5, 1.0)
"""``ratio - 1`` is clipped to this range: a block costs between 0.75 and 1.5 times its
plain price at ``footprint_weight`` 0.5. With few requests routed (one session on an idle
fleet) ratios swing between 0 and the worker count and must not outweigh a session's cache."""
MAX_UTILISATION = 0.8
"""Cap on the fleet's prefill utilisation in ``fleet_factor`` (at most 4 requests are
expected to wait behind a new one's prefill)."""


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


def queued_prefill_tokens(
    pending_prefill_tokens: int, scraped_waiting: int | None
) -> tuple[float, float | None]:
    """Prefill tokens queued ahead of a new request: (kvgate's own, the engine's waiting
    queue as tokens: None before a scrape); the larger counts (never their sum: the engine's
    figure includes kvgate's requests)."""
    scraped = None
    if scraped_waiting is not None:
        scraped = float(scraped_waiting * WAITING_REQUEST_PREFILL_TOKENS)
    return float(pending_prefill_tokens), scraped


def footprint_ratios(candidates: Sequence[Candidate]) -> list[float]:
    """Each candidate's recent footprint over the candidates' mean (all 1.0 when none)."""
    total = sum(c.load.footprint for c in candidates)
    mean = total / len(candidates) if candidates else 0.0
    if not mean > 0.0:  # nothing routed yet (or too little to divide by)
        return [1.0] * len(candidates)
    return [c.load.footprint / mean for c in candidates]


def fleet_factor(candidates: Sequence[Candidate]) -> float:
    """``rho / (1 - rho)``: how many requests are expected to wait behind a new one's
    prefill, with ``rho`` the candidates' mean prefill-busy share (capped at
    ``MAX_UTILISATION``): the mean number in an M/M/1 queue at utilisation rho."""
    if not candidates:
        return 0.0
    rho = sum(min(max(c.load.prefill_busy_share, 0.0), 1.0) for c in candidates) / len(candidates)
    rho = min(rho, MAX_UTILISATION)
    return rho / (1.0 - rho)


class Price:
    """One worker's cost for one request and every term behind it (``terms()``)."""

    __slots__ = (
        "cost",
        "credited",
        "decode",
        "decode_parts",
        "fleet",
        "fleet_cost",
        "footprint_cost",
        "footprint_ratio",
        "in_flight",
        "load_blocks",
        "match",
        "prefill",
        "queued",
        "queued_parts",
        "size",
        "worker",
    )

    def __init__(
        self,
        size: RequestSize,
        candidate: Candidate,
        config: KvPolicyConfig,
        footprint_ratio: float = 1.0,
        *,
        fleet: float = 0.0,
        kv_capacity_blocks: int | None = None,
    ) -> None:
        """``fleet``: the candidates' ``fleet_factor``; ``kv_capacity_blocks``: a configured
        capacity that turns the engine's KV usage into decode blocks (none: kvgate's own
        count only)."""
        load = candidate.load
        block_size = size.block_size
        self.worker = candidate.worker
        self.in_flight = load.in_flight
        self.size = size
        self.match = match = clip_match(candidate.match, size.full_blocks)
        predicted, scraped = queued_prefill_tokens(
            load.pending_prefill_tokens, load.scraped_waiting
        )
        self.queued_parts = queued_parts = (
            predicted / block_size,
            scraped / block_size if scraped is not None else None,
        )
        self.queued = queued = _larger(queued_parts)
        self.decode_parts = decode_parts = (
            float(load.active_decode_blocks),
            load.scraped_kv_usage * kv_capacity_blocks
            if load.scraped_kv_usage is not None and kv_capacity_blocks is not None
            else None,
        )
        self.decode = decode = _larger(decode_parts)
        self.credited = credited = tier_credit(match, config)
        self.prefill = prefill = size.blocks - credited
        self.load_blocks = load_blocks = (
            config.queued_prefill_weight * queued + config.decode_weight * decode
        )
        self.footprint_ratio = footprint_ratio
        low, high = FOOTPRINT_EXCESS
        excess = min(max(footprint_ratio - 1.0, low), high)
        credit = config.overlap_credit
        self.footprint_cost = footprint = credit * config.footprint_weight * prefill * excess
        self.fleet = fleet
        self.fleet_cost = spread = credit * config.fleet_prefill_weight * fleet * prefill
        self.cost = credit * prefill + load_blocks + footprint + spread

    @property
    def scale(self) -> float:
        """The temperature's unit: the request's blocks."""
        return float(max(self.size.blocks, 1))

    def terms(self) -> dict[str, float]:
        """The named terms, for /debug/route and the decision log line."""
        match, size = self.match, self.size
        overlap = overlap_tokens(match.blocks, size)
        terms = {
            "gpu_blocks": float(match.gpu),
            "cpu_blocks": float(match.cpu),
            "disk_blocks": float(match.disk),
            "matched_blocks": float(match.blocks),
            "overlap_tokens": float(overlap),
            "uncached_tokens": float(max(size.prompt_tokens - overlap, 0)),
            "request_blocks": float(size.blocks),
            "credited": self.credited,
            "prefill_blocks": self.prefill,
            "predicted_queued_prefill_blocks": self.queued_parts[0],
            "queued_prefill_blocks": self.queued,
            "predicted_decode_blocks": self.decode_parts[0],
            "decode_blocks": self.decode,
            "load_blocks": self.load_blocks,
            "footprint_ratio": self.footprint_ratio,
            "footprint_cost": self.footprint_cost,
            "fleet_factor": self.fleet,
            "fleet_cost": self.fleet_cost,
            "cost": self.cost,
            "in_flight": float(self.in_flight),
        }
        if self.queued_parts[1] is not None:
            terms["scraped_queued_prefill_blocks"] = self.queued_parts[1]
        if self.decode_parts[1] is not None:
            terms["scraped_decode_blocks"] = self.decode_parts[1]
        return terms


def _larger(parts: tuple[float, float | None]) -> float:
    predicted, scraped = parts
    return predicted if scraped is None or scraped < predicted else scraped


def price_all(
    size: RequestSize,
    candidates: Sequence[Candidate],
    config: KvPolicyConfig,
    kv_capacity_blocks: int | None = None,
) -> list[Price]:
    """Every candidate's ``Price`` for a request of ``size``, in candidate order."""
    if config.footprint_weight > 0.0:
        ratios = footprint_ratios(candidates)
    else:
        ratios = [1.0] * len(candidates)
    fleet = fleet_factor(candidates) if config.fleet_prefill_weight > 0.0 else 0.0
    return [
        Price(size, c, config, r, fleet=fleet, kv_capacity_blocks=kv_capacity_blocks)
        for c, r in zip(candidates, ratios, strict=True)
    ]
