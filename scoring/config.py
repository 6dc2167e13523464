"""Knobs of the ``kv`` policy, with defaults and validated ranges (see docs/scoring.md)."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class KvPolicyConfig(BaseModel):
    """Every knob of the ``kv`` policy. Costs are measured in KV blocks of the request's block size.

    ``cost = overlap_credit * prefill_blocks + load_blocks`` where
    ``prefill_blocks = request_blocks - credited`` and
    ``load_blocks = queued_prefill_weight * queued_prefill_blocks + decode_weight * decode_blocks``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    overlap_credit: float = Field(
        default=1.0,
        ge=0.0,
        le=1e6,
        description=(
            "Stickiness: weight of the blocks this request would have to prefill on a worker "
            "(its uncached part) against the worker's load. 0 ignores the cache entirely "
            "(pure load balance); large values follow the cache whatever the load."
        ),
    )
    gpu_weight: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Credit for each matched block resident on GPU (the leading run).",
    )
    cpu_weight: float = Field(
        default=0.75,
        ge=0.0,
        le=1.0,
        description=(
            "Credit for each matched block on CPU past the GPU run (it must be copied back, "
            "which is cheaper than recomputing but not free)."
        ),
    )
    disk_weight: float = Field(
        default=0.25,
        ge=0.0,
        le=1.0,
        description="Credit for each matched block on disk only, past the GPU and CPU runs.",
    )
    queued_prefill_weight: float = Field(
        default=1.0,
        ge=0.0,
        description=(
            "Weight of the prefill work already queued on a worker (blocks of prompt not yet "
            "prefilled), against overlap_credit for this request's own blocks. A new request "
            "waits for all of it before its first token (first come, first served; chunked "
            "prefill alike once its token budget is full), so a queued block delays it as much "
            "as one of its own: 1. Lower values keep sessions on a busy home longer (0.33 was "
            "the default until measured: docs/scoring.md, Queued prefill weight)."
        ),
    )
    decode_weight: float = Field(
        default=0.02,
        ge=0.0,
        description=(
            "Weight of the KV blocks held by a worker's running requests. Decode load slows a "
            "new request's first token far less than queued prefill does, and one long running "
            "context can hold as many blocks as a whole session prefix, so it weighs little; it "
            "still spreads new sessions and relieves KV memory pressure."
        ),
    )
    footprint_weight: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description=(
            "Cache-footprint balance (0: off). A worker's footprint is the prompt blocks "
            "routed to it recently (decayed with footprint_half_life_s) over the candidates' "
            "mean; each block a request must prefill there is priced overlap_credit * "
            "(1 + footprint_weight * (ratio - 1)). New sessions then go where fewer recent "
            "prompts share the cache, before eviction shows; cached blocks are not priced, so "
            "sessions keep their home."
        ),
    )
    footprint_half_life_s: float = Field(
        default=60.0,
        gt=0.0,
        description="Half-life of the routed prompt blocks counted in a worker's footprint.",
    )
    predicted_load_weight: float = Field(
        default=1.0,
        ge=0.0,
        description=(
            "Weight of the load kvgate predicts from its own routing decisions (pending prefill "
            "tokens, active decode blocks). Fresh on every decision, blind to other traffic."
        ),
    )
    scraped_load_weight: float = Field(
        default=1.0,
        ge=0.0,
        description=(
            "Weight of the load estimated from the engine's scraped /metrics (waiting queue, KV "
            "usage). Sees all traffic, but is stale by up to one scrape interval. Each load term "
            "is max(predicted_load_weight * predicted, scraped_load_weight * scraped): never "
            "the sum, since the engine's figures already include kvgate's own requests."
        ),
    )
    eviction_risk_weight: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description=(
            "Discount on a worker's cached match for the risk that it is evicted before the "
            "request runs: the prefill queued ahead there allocates new blocks, which evict "
            "the least recently used cached ones once the free pool (capacity x (1 - KV "
            "usage)) runs out. The match is credited at 1 - weight * clip((queued - free) / "
            "capacity, 0, 1). "
            "Needs the engine's KV usage and capacity (vLLM's cache_config_info, or "
            "kv_capacity_blocks). Off (0) by default: measured to help only overloaded "
            "fleets (docs/scoring.md, Eviction risk)."
        ),
    )
    waiting_request_prefill_tokens: int = Field(
        default=512,
        ge=0,
        description=(
            "Prefill tokens assumed for each request the engine reports waiting, to turn the "
            "scraped waiting count into queued prefill blocks."
        ),
    )
    kv_capacity_blocks: int | None = Field(
        default=None,
        gt=0,
        description=(
            "KV cache capacity of one worker in blocks (vLLM logs it as '# GPU blocks'), to turn "
            "the scraped KV usage into decode blocks. None: scraped KV usage only feeds the "
            "busy guard."
        ),
    )
    max_waiting_requests: int | None = Field(
        default=32,
        ge=0,
        description=(
            "Busy guard: a worker whose engine reports more waiting requests than this is "
            "skipped unless every worker is busy. None disables this check."
        ),
    )
    max_kv_usage: float | None = Field(
        default=0.98,
        gt=0.0,
        le=1.0,
        description=(
            "Busy guard: a worker whose engine reports KV cache usage (0..1) above this is "
            "skipped unless every worker is busy. None disables this check."
        ),
    )
    temperature: float = Field(
        default=0.0,
        ge=0.0,
        le=100.0,
        description=(
            "0 picks the lowest cost. Above 0, a worker is sampled with probability "
            "proportional to exp(-(cost - lowest) / (temperature * request_blocks))."
        ),
    )
    tie_tolerance: float = Field(
        default=1e-6,
        ge=0.0,
        description=(
            "Costs within this many blocks of the lowest count as tied (then lower in-flight "
            "wins, then the rendezvous hash of the session key)."
        ),
    )
    seed: int | None = Field(
        default=None,
        description="Seed of the random source used when temperature > 0 (None: from the OS).",
    )

    @model_validator(mode="after")
    def _slower_tiers_never_credit_more(self) -> Self:
        if not self.gpu_weight >= self.cpu_weight >= self.disk_weight:
            raise ValueError(
                "tier weights must satisfy gpu_weight >= cpu_weight >= disk_weight, got "
                f"{self.gpu_weight}, {self.cpu_weight}, {self.disk_weight}"
            )
        return self
