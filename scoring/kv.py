"""The ``kv`` policy: cache overlap versus load, priced in KV blocks (``scoring.cost``);
lowest cost first (docs/scoring.md)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence

from kvgate.scoring.api import Candidate, Decision, RouteRequest, WorkerScore
from kvgate.scoring.choice import order_lowest_cost, rank_lowest_cost, rank_sampled
from kvgate.scoring.config import KvPolicyConfig
from kvgate.scoring.cost import Price, price_all, request_size
from kvgate.scoring.tiebreak import session_hash_key

TIE_TOLERANCE = 1e-6
"""Costs (in blocks) within this much of the lowest count as tied: lower in-flight wins,
then the rendezvous hash of the session key."""


class CostTerms(Mapping[str, float]):
    """A worker's named cost terms (``Price.terms()``, plus ``probability`` when sampled),
    built on first access: routing itself never reads them, only ``/debug/route`` and the
    decision log line do."""

    __slots__ = ("_price", "_probability", "_terms")

    def __init__(self, price: Price, probability: float | None) -> None:
        self._price = price
        self._probability = probability
        self._terms: dict[str, float] | None = None

    def _built(self) -> dict[str, float]:
        terms = self._terms
        if terms is None:
            terms = self._price.terms()
            if self._probability is not None:
                terms["probability"] = self._probability
            self._terms = terms
        return terms

    def __getitem__(self, name: str) -> float:
        return self._built()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())

    def __repr__(self) -> str:
        return repr(self._built())


def _score(price: Price, reason: str, probability: float | None = None) -> WorkerScore:
    return WorkerScore(price.worker, price.cost, CostTerms(price, probability), reason)


class KvPolicy:
    """Price every candidate (``scoring.cost``); rank them all, lowest cost first.

    ``rng`` is used only when ``config.temperature > 0``; ``kv_capacity_blocks``: a
    configured KV capacity that turns engines' scraped KV usage into decode blocks.
    """

    name: str = "kv"

    def __init__(
        self,
        config: KvPolicyConfig,
        rng: random.Random,
        *,
        kv_capacity_blocks: int | None = None,
    ) -> None:
        self.config = config
        self.kv_capacity_blocks = kv_capacity_blocks
        self._rng = rng

    @classmethod
    def from_config(cls, config: KvPolicyConfig, seed: int | None = None) -> KvPolicy:
        """A policy whose random source is seeded from ``seed``."""
        return cls(config, random.Random(seed))

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        config = self.config
        prices = price_all(request_size(request), candidates, config, self.kv_capacity_blocks)
        session = session_hash_key(request)
        if config.temperature > 0:
            scale = prices[0].scale
            by_cost = rank_lowest_cost(prices, session, TIE_TOLERANCE)
            ranked = rank_sampled(by_cost, config.temperature, scale, self._rng)
            return Decision(
                ranked=[r.cost.worker for r in ranked],
                scores=[_score(r.cost, r.reason, r.probability) for r in ranked],
            )
        ordered = order_lowest_cost(prices, session, TIE_TOLERANCE)
        return Decision(
            ranked=[price.worker for price, _ in ordered],
            scores=[_score(price, reason) for price, reason in ordered],
        )
