"""The policy interface: what a policy is given, and what it returns.

A policy never performs I/O and never filters. The scheduler (``scheduling``) builds a
``RouteRequest`` (block keys already computed and matched against the index) and one
``Candidate`` per ready worker, then asks the policy for a ``Decision``: every candidate,
ranked best first by price, with the terms that led there. Whether a worker may take the
request now is the capacity rule's question (``scheduling.capacity``), not the policy's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.index.types import NO_MATCH, BlockKey, PrefixMatch, WorkerId


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """Live load of one worker as kvgate sees it.

    ``in_flight``, ``pending_prefill_tokens`` (and their attention pairs) and
    ``active_decode_blocks`` are kvgate's own accounting of what it sent (the scheduler's
    ledger); the ``scraped_*`` fields come from the engine's /metrics (``None`` until the
    first successful scrape) and include traffic kvgate did not route.
    """

    in_flight: int = 0
    pending_prefill_tokens: int = 0
    pending_prefill_pairs: float = 0.0  # attention pairs of that pending prefill
    # blocks held by its requests in flight: their prompts' (shared prefixes once) and what
    # their streamed answers filled so far
    active_decode_blocks: int = 0
    scraped_running: int | None = None
    scraped_waiting: int | None = None
    # 0..1; less the blocks of kvgate's requests that ended there since the scrape was sent
    scraped_kv_usage: float | None = None
    kv_capacity_blocks: int | None = None  # the engine's GPU KV blocks (scraped), if known
    # prompt blocks routed here recently, exponentially decayed, on a scale shared by every
    # worker (only ratios between workers mean anything)
    footprint: float = 0.0
    # share of recent time with at least one request sent here and not yet started (its
    # first token not back): the worker's prefill utilisation, exponentially weighted
    prefill_busy_share: float = 0.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One eligible worker for a request (and its rank, on a data-parallel worker)."""

    worker: WorkerId
    url: str
    load: WorkerLoad = WorkerLoad()
    match: PrefixMatch = NO_MATCH  # the prefix of the rank it would go to (below)
    # leading blocks of the request that a request in flight on the worker holds (they are
    # among its held blocks: referenced, not copied, by a request that shares them)
    in_flight_prefix: int = 0
    # the data-parallel rank the request would be sent to, on a worker with several (each
    # rank its own cache: ``match`` is that rank's); None: the worker has one
    dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing needs to know about one request."""

    model: str
    block_keys: Sequence[BlockKey] = ()
    block_size: int = 16
    prompt_tokens: int = 0
    session_key: str | None = None  # x-session-id header, else the ``user`` field
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerScore:
    """One worker's cost and the visible terms behind it (for /debug/route and logs)."""

    worker: WorkerId
    cost: float
    terms: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    """Candidates best first; ``scores`` in the same order as ``ranked``."""

    ranked: Sequence[WorkerId]
    scores: Sequence[WorkerScore] = ()

    @property
    def chosen(self) -> WorkerId:
        return self.ranked[0]


class Policy(Protocol):
    """A routing policy. ``candidates`` is never empty."""

    name: str

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision: ...
