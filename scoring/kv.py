"""The ``kv`` policy: cache overlap versus load, lowest cost wins (docs/scoring.md)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from scoring.api import Candidate, Decision, RouteRequest, WorkerScore
from scoring.choice import Ranked, rank_lowest_cost, rank_sampled
from scoring.config import KvPolicyConfig
from scoring.cost import worker_costs
from scoring.tiebreak import session_hash_key


def _score(ranked: Ranked) -> WorkerScore:
    terms = ranked.cost.terms()
    if ranked.probability is not None:
        terms["probability"] = ranked.probability
    return WorkerScore(
        worker=ranked.cost.worker, cost=ranked.cost.cost, terms=terms, reason=ranked.reason
    )


class KvPolicy:
    """Cost every candidate on what it must prefill versus how loaded it is; rank them all.

    ``rng`` is used only when ``config.temperature > 0``.
    """

    name: str = "kv"

    def __init__(self, config: KvPolicyConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng

    @classmethod
    def from_config(cls, config: KvPolicyConfig) -> KvPolicy:
        """A policy whose random source is seeded from ``config.seed``."""
        return cls(config, random.Random(config.seed))

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        config = self.config
        costs = worker_costs(request, candidates, config)
        ranked = rank_lowest_cost(costs, session_hash_key(request), config.tie_tolerance)
        if config.temperature > 0:
            scale = float(max(costs[0].request_blocks, 1))  # candidates are never empty
            ranked = rank_sampled(ranked, config.temperature, scale, self._rng)
        return Decision(ranked=[r.cost.worker for r in ranked], scores=[_score(r) for r in ranked])
