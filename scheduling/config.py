"""The scheduler's settings: when a worker may take one more request (``scheduling:``) and
how long requests wait in kvgate when none may (``queue:``); plus ``Tuning``, the internal
constants benchmarks and tests may vary (never a user option)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from kvgate.scheduling.capacity import Limits, Parts
from kvgate.scheduling.dispatch_order import OrderConfig
from kvgate.scheduling.guard import GuardConfig

ROOM_PATIENCE = 0.1
"""Share of its wait limit a queued request waits for KV room (3 s of the default 30 s);
then it goes as ranked and waits in that engine's queue."""


class SchedulingConfig(BaseModel):
    """The capacity rule (docs/scoring.md, *Capacity*): a worker at or over one of these
    limits takes no more requests while another may (the policy's ranking is kept among the
    workers that may), and requests wait in kvgate's queue while none may."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_waiting_requests: int | None = Field(
        default=32,
        ge=0,
        description="a worker whose engine reports this many waiting requests takes no more. "
        "Lower it to keep requests in kvgate (where they can still go to the first free "
        "worker) rather than in an engine's queue; none: ignore the engines' waiting counts",
    )
    max_pending_prefill_tokens: int | None = Field(
        default=65536,
        ge=1,
        description="a worker with this many prompt tokens sent by kvgate and not yet "
        "prefilled takes no more (eight full steps of vLLM's default prefill budget). Lower "
        "it for slow prefill (CPU replicas, long prompts) to queue in kvgate sooner; none: no "
        "limit",
    )
    max_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="a worker with this many of kvgate's requests in flight takes no more. "
        "Set it for engines that report no waiting count (plain OpenAI-compatible servers), "
        "e.g. to their batch size",
    )
    max_kv_usage: float | None = Field(
        default=0.98,
        gt=0.0,
        le=1.0,
        description="a worker whose engine reports this KV-cache usage (0..1) takes no more. "
        "Lower it if your engines preempt running requests before their cache is full; "
        "none: ignore the engines' usage",
    )
    kv_capacity_blocks: int | None = Field(
        default=None,
        gt=0,
        description="KV-cache blocks of one worker, for engines that do not publish theirs "
        "(vLLM publishes it: leave unset). With it kvgate weighs a worker's decode load by "
        "its engine's KV usage (the KV-room rule, off by default, is a benchmark's only)",
    )

    def limits(self) -> Limits:
        return Limits(
            max_waiting_requests=self.max_waiting_requests,
            max_pending_prefill_tokens=self.max_pending_prefill_tokens,
            max_in_flight=self.max_in_flight,
            max_kv_usage=self.max_kv_usage,
            kv_capacity_blocks=self.kv_capacity_blocks,
        )


class QueueConfig(BaseModel):
    """The router-side queue (docs/scoring.md, *The queue*): a request waits in kvgate while
    no worker it may go to admits it (``scheduling``) or its API key or model is at its
    concurrency limit; it is sent when a worker frees up, to the best worker admitting it
    then."""

    enabled: bool = Field(
        default=True,
        description="hold requests in kvgate while every worker is at its limits. Turn it "
        "off to leave all queueing to the engines (every request is sent at once)",
    )
    max_length: int = Field(
        default=1024,
        ge=0,
        description="requests queued at once; more get 429 (queue_full). Shared between API "
        "keys: when it is full, a key holding fewer queued requests takes the place of the "
        "newest one of the key holding most (that one gets 429 queue_share); a key alone may "
        "use all of it. Size it to the burst you would rather delay than refuse",
    )
    max_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="request body bytes queued at once (a queued request holds its body and "
        "its block keys: two to three times the body in memory); more get 429 "
        "(queue_bytes_full), shared between keys as max_length is. Raise it with kvgate's "
        "memory limit",
    )
    max_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="longest a request waits queued (503 queue_timeout past it); a client's "
        "own shorter timeout (X-Request-Timeout or X-Stainless-Timeout, seconds) wins. Set "
        "it below your clients' timeouts",
    )
    max_in_flight_per_key: int | None = Field(
        default=None,
        ge=1,
        description="requests one API key may have in flight; more wait. Set it to keep one "
        "tenant from taking the whole fleet",
    )
    max_queued_per_key: int | None = Field(
        default=None,
        ge=0,
        description="requests one API key may have queued; more get 429. Set it so one "
        "tenant's burst cannot fill the queue",
    )
    max_in_flight_per_model: int | None = Field(
        default=None,
        ge=1,
        description="requests one model may have in flight; more wait. Set it to share "
        "replicas serving several models",
    )
    max_queued_per_model: int | None = Field(
        default=None,
        ge=0,
        description="requests one model may have queued; more get 429",
    )


@dataclass(frozen=True, slots=True)
class Tuning:
    """Internal constants of the scheduler: which mechanisms are on (``Parts``, the default
    for every worker), the queue's dispatch order, its patience for KV room and the guard
    that turns a mechanism off where it does harm. Benchmarks and tests build a scheduler
    with other values; users do not."""

    parts: Parts = field(default_factory=Parts)
    order: OrderConfig = field(default_factory=OrderConfig)
    room_patience: float = ROOM_PATIENCE
    guard: GuardConfig = field(default_factory=GuardConfig)
