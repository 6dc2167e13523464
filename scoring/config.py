"""The ``kv`` policy's pricing knobs (docs/scoring.md): what a user tunes to trade cache
stickiness against load. Every other constant of the cost is fixed in ``scoring.cost``."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class KvPolicyConfig(BaseModel):
    """The block-unit cost of sending a request to a worker, in KV blocks::

    cost = overlap_credit * prefill_blocks * (1 + footprint_weight * clip(ratio - 1, -0.5, 1)
                                              + fleet_prefill_weight * fleet_factor)
         + queued_prefill_weight * queued_prefill_blocks + decode_weight * decode_blocks
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    overlap_credit: float = Field(
        default=1.0,
        ge=0.0,
        le=1e6,
        description=(
            "How much a block this request must prefill weighs against the work queued on "
            "a worker. Raise it to keep sessions on their cache under more load (long "
            "shared prefixes, slow prefill); lower it to spread load more evenly (short "
            "prompts); 0 ignores the cache (pure load balance)."
        ),
    )
    queued_prefill_weight: float = Field(
        default=1.0,
        ge=0.0,
        description=(
            "How much a block of prompt already queued on a worker delays this request, "
            "against one of its own. 1 fits first-come-first-served prefill (vLLM, SGLang); "
            "lower it for engines that schedule around their queue, so sessions stay home "
            "longer."
        ),
    )
    decode_weight: float = Field(
        default=0.02,
        ge=0.0,
        description=(
            "Weight of the KV blocks held by a worker's running requests. Raise it when "
            "long decodes slow your engines' prefill (memory-bound replicas); 0 ignores "
            "decode load."
        ),
    )
    gpu_weight: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description=(
            "Credit for each cached block on GPU. Lower it only if your engines recompute "
            "part of a cached prefix anyway."
        ),
    )
    cpu_weight: float = Field(
        default=0.75,
        ge=0.0,
        le=1.0,
        description=(
            "Credit for each cached block offloaded to CPU (copied back, cheaper than "
            "recomputing). Set it from how fast your engines load offloaded blocks."
        ),
    )
    disk_weight: float = Field(
        default=0.25,
        ge=0.0,
        le=1.0,
        description=(
            "Credit for each cached block on disk only. Set it from how fast your engines "
            "load blocks from their disk tier."
        ),
    )
    footprint_weight: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description=(
            "Price of writing new blocks into a cache in more demand than the fleet's mean "
            "(they evict other sessions' histories). Raise it when caches are small for the "
            "working set; 0 turns it off."
        ),
    )
    fleet_prefill_weight: float = Field(
        default=1.0,
        ge=0.0,
        le=10.0,
        description=(
            "Price of the wait a request's own prefill adds for the requests queued behind "
            "it, growing as the fleet fills: recomputing a cached history elsewhere gets "
            "dearer under load. 0 makes each request minimise only its own first token."
        ),
    )
    temperature: float = Field(
        default=0.0,
        ge=0.0,
        le=100.0,
        description=(
            "0 picks the lowest cost. Above 0 a worker is sampled with probability "
            "proportional to exp(-(cost - lowest) / (temperature * request blocks)): set it "
            "to spread identical requests (benchmarks, cache warming) over near-equal workers."
        ),
    )

    @model_validator(mode="after")
    def _slower_tiers_never_credit_more(self) -> Self:
        if not self.gpu_weight >= self.cpu_weight >= self.disk_weight:
            raise ValueError(
                "tier weights must satisfy gpu_weight >= cpu_weight >= disk_weight, got "
                f"{self.gpu_weight}, {self.cpu_weight}, {self.disk_weight}"
            )
        return self
