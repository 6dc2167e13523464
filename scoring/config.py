"""Knobs of the ``kv`` policy, with defaults and validated ranges (see docs/scoring.md)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class KvPolicyConfig(BaseModel):
    """Every knob of the ``kv`` policy (docs/scoring.md). Two decision costs, by ``cost_model``:

    ``blocks`` (the default), in KV blocks of the request's block size::

        cost = overlap_credit * prefill_blocks * (1 + footprint term + fleet term)
             + queued_prefill_weight * queued_prefill_blocks + decode_weight * decode_blocks

    ``seconds``::

        cost = predicted TTFT + (fleet_factor + cache_factor) * own prefill seconds

    Whichever decides, each worker's TTFT model is learned online (``scoring.calibration``)
    and every candidate's predicted TTFT is shown; its priors and window are knobs here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cost_model: Literal["blocks", "seconds"] = Field(
        default="blocks",
        description=(
            "The decision cost. blocks: the uncached blocks this request must prefill against "
            "the worker's weighted load, in KV blocks (measured best on the project's matrix). "
            "seconds: the worker's predicted TTFT plus what the choice costs the requests "
            "behind it and the fleet's caches, from the online-calibrated TTFT model. The "
            "predicted TTFT is learned and shown in /debug/route with either."
        ),
    )
    overlap_credit: float = Field(
        default=1.0,
        ge=0.0,
        le=1e6,
        description=(
            "blocks cost. Stickiness: weight of the blocks this request would have to prefill "
            "on a worker (its uncached part) against the worker's load. 0 ignores the cache "
            "entirely (pure load balance); large values follow the cache whatever the load."
        ),
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
            "blocks cost. Weight of the KV blocks held by a worker's running requests. Decode "
            "load slows a new request's first token far less than queued prefill does, and one "
            "long running context can hold as many blocks as a whole session prefix, so it "
            "weighs little; it still spreads new sessions and relieves KV memory pressure."
        ),
    )
    seconds_overlap_credit: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description=(
            "seconds cost. How much a worker's cached prefix discounts its predicted prefill: "
            "the credited blocks (after the tier weights) are scaled by it. 1: the calibrated "
            "model as is (a cached token costs nothing to prefill); lower values give cache "
            "hits less weight against load; 0: every worker is predicted to prefill the whole "
            "prompt (load only). The TTFT model still learns from what was really prefilled."
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
    footprint_weight: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description=(
            "Cache-footprint balance (0: off). A worker's footprint is the prompt blocks "
            "routed to it recently (decayed with footprint_half_life_s) over the candidates' "
            "mean (ratio). blocks cost: each block a request must prefill there is priced "
            "overlap_credit * (1 + footprint_weight * clip(ratio - 1, -0.5, 1)). seconds cost: "
            "its prefill seconds are counted again, times footprint_weight * clip(ratio - "
            "lowest ratio, 0, 1). New blocks written into a cache in more demand than the "
            "fleet's evict other sessions' histories; cached blocks write nothing, so sessions "
            "keep their home."
        ),
    )
    footprint_min_excess: float = Field(
        default=-0.5,
        ge=-1.0,
        le=0.0,
        description=(
            "blocks cost: the lower clip of a footprint ratio's excess (ratio - 1): how much "
            "cheaper a block is to prefill on a worker in less demand than the fleet's mean "
            "(-0.5 with footprint_weight 0.5: at most 25% off; 0: no discount, only the "
            "surcharge above the mean)."
        ),
    )
    duplicate_weight: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description=(
            "seconds cost. Cache spend of a second copy (0: off). Of the tokens a worker "
            "would prefill, "
            "those another candidate holds cached are written twice in the fleet: the new "
            "copy evicts cached blocks that are reused about as often as the fleet's recent "
            "requests reused theirs (reuse). Their prefill seconds are counted again, times "
            "duplicate_weight * reuse. 1: the displaced blocks are worth what the fleet's "
            "caches are measured to be worth."
        ),
    )
    footprint_half_life_s: float = Field(
        default=60.0,
        gt=0.0,
        description="Half-life of the routed prompt blocks counted in a worker's footprint.",
    )
    prior_prefill_tokens_per_s: float = Field(
        default=20_000.0,
        gt=0.0,
        description=(
            "Prefill rate assumed for a fleet nothing was learned about yet (a worker joining "
            "a fleet starts from the fleet's learned model instead). Only the first few "
            "requests use it: the rate is learned from every streamed request's TTFT."
        ),
    )
    prior_base_s: float = Field(
        default=0.02,
        ge=0.0,
        description="TTFT of an empty prompt on an idle worker, before anything is learned.",
    )
    calibration_window: float = Field(
        default=200.0,
        ge=10.0,
        le=100_000.0,
        description=(
            "Observations the online TTFT model remembers (forgetting factor 1 - 1/window): "
            "long enough to average out one request's noise, short enough to follow a "
            "replica that slows down or a workload that changes within minutes."
        ),
    )
    calibration_prior_weight: float = Field(
        default=10.0,
        ge=0.0,
        description=(
            "Pseudo-observations of the fleet's pooled model in each worker's prediction: a "
            "worker with n observations is predicted with n / (n + weight) of its own model."
        ),
    )
    fleet_prefill_weight: float = Field(
        default=1.0,
        ge=0.0,
        le=10.0,
        description=(
            "blocks cost. The wait a request's own prefill adds for the requests queued behind "
            "it: its prefill blocks are counted 1 + fleet_prefill_weight * rho / (1 - rho) "
            "times, rho the candidates' mean prefill-busy share capped at max_utilisation (the "
            "M/M/1 mean queue, as the seconds cost's fleet factor). Makes recomputing a cached "
            "history elsewhere dearer as the fleet fills. 0: off."
        ),
    )
    max_utilisation: float = Field(
        default=0.8,
        ge=0.0,
        le=0.95,
        description=(
            "Cap on the fleet's prefill utilisation rho in the fleet factor "
            "rho / (1 - rho) "
            "(0.8: at most 4 requests are expected to wait behind a new one's prefill). "
            "0 turns the fleet term off: each request then minimises its own TTFT."
        ),
    )
    utilisation_half_life_s: float = Field(
        default=30.0,
        gt=0.0,
        description="Half-life of each worker's prefill-busy share (its utilisation).",
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
    kv_fit_weight: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description=(
            "Share of a worker's cached match withdrawn when the request does not fit in its "
            "KV cache beside the running requests (held blocks + the request's new blocks > "
            "capacity) while another candidate has room: the request would wait there for a "
            "running request to end. Needs the capacity (vLLM's cache_config_info, or "
            "kv_capacity_blocks); 0: off (docs/scoring.md, KV fit)."
        ),
    )
    kv_fit_cached: bool = Field(
        default=True,
        description=(
            "Count the request's cached blocks in its KV fit as well as its new ones (held "
            "blocks + the request's blocks, less the prefix a request in flight there holds, "
            "> capacity): a cached match is free, evictable memory until the request runs, so "
            "where the running and engine-queued requests need the room, it is evicted before "
            "the request is scheduled. Off: only the blocks outside its GPU match count."
        ),
    )
    answer_blocks: bool = Field(
        default=True,
        description=(
            "Count the blocks a streamed answer has filled so far (one token an event) in its "
            "worker's held blocks, beside its prompt's: a long answer holds a block more every "
            "block_size tokens, and the scraped KV usage sees them a scrape late. Off: the "
            "prompts' blocks only (docs/scoring.md, KV fit)."
        ),
    )
    kv_fit_guard: bool = Field(
        default=True,
        description=(
            "Set aside (as the busy guard does) a worker where the request lacks KV room while "
            "another candidate has room (where kv_fit_weight withdraws its match): it goes "
            "there only as failover (docs/scoring.md, KV fit)."
        ),
    )
    blocked_wait_weight: float = Field(
        default=0.0,
        ge=0.0,
        description=(
            "Price the time the oldest request kvgate sent to a worker lacking KV room has "
            "waited there unstarted (blocked_s) as that much more wait ahead of a new request: "
            "an engine admits in order, and a wait for a running request to end that has lasted "
            "long is expected to last about as long again. Block cost: blocked_s x the worker's "
            "learned prefill rate / block size, x this weight; seconds cost: blocked_s x this "
            "weight. 0 (the default): off; 1 was measured and not adopted (docs/scoring.md, "
            "KV fit)."
        ),
    )
    waiting_request_prefill_tokens: int = Field(
        default=512,
        ge=0,
        description=(
            "Prefill tokens assumed for each request the engine reports waiting, to turn the "
            "scraped waiting count into queued prefill tokens (only traffic kvgate did not "
            "route makes the scrape exceed kvgate's own prediction)."
        ),
    )
    kv_capacity_blocks: int | None = Field(
        default=None,
        gt=0,
        description=(
            "KV cache capacity of one worker in blocks (vLLM logs it as '# GPU blocks'), to "
            "turn the scraped KV usage into decode blocks (blocks cost) or context tokens "
            "(seconds cost and the TTFT model, where vLLM's published cache_config_info "
            "wins). None: scraped KV usage only feeds the busy guard and the eviction risk."
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
            "proportional to exp(-(cost - lowest) / (temperature * scale)), the scale being "
            "the request's blocks (blocks cost) or the whole prompt's predicted prefill "
            "seconds (seconds cost)."
        ),
    )
    tie_tolerance: float = Field(
        default=1e-6,
        ge=0.0,
        description=(
            "Costs within this much of the lowest (blocks or seconds, by cost_model) count as "
            "tied (then lower in-flight wins, then the rendezvous hash of the session key)."
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
