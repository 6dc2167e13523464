"""The ``kv`` policy: cache overlap versus load, costed in blocks (default) or in seconds of
predicted TTFT (``cost_model``); lowest cost wins (docs/scoring.md)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence

from scoring.api import Candidate, Decision, RouteRequest, WorkerScore
from scoring.choice import order_lowest_cost, rank_lowest_cost, rank_sampled, split_busy
from scoring.config import KvPolicyConfig
from scoring.cost import Quote, kv_shortfalls, quote_workers
from scoring.cost_parts import request_size
from scoring.tiebreak import session_hash_key


class CostTerms(Mapping[str, float]):
    """A worker's named cost terms (``Quote.full().terms()``, plus ``probability`` when
    sampled), built on first access: routing itself never reads them, only ``/debug/route``
    and the decision log line do."""

    __slots__ = ("_probability", "_quote", "_terms")

    def __init__(self, quote: Quote, probability: float | None) -> None:
        self._quote = quote
        self._probability = probability
        self._terms: dict[str, float] | None = None

    def _built(self) -> dict[str, float]:
        terms = self._terms
        if terms is None:
            terms = self._quote.full().terms()
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


def _score(quote: Quote, reason: str, probability: float | None = None) -> WorkerScore:
    return WorkerScore(quote.worker, quote.cost, CostTerms(quote, probability), reason)


class KvPolicy:
    """Cost every candidate (``scoring.cost``: blocks or seconds); rank them all.

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
        size = request_size(request)
        shortfalls = kv_shortfalls(size, candidates, config)
        quotes = quote_workers(size, candidates, config, shortfalls)
        session = session_hash_key(request)
        set_aside = frozenset(quote.worker for quote in split_busy(quotes)[1])
        room = frozenset(c.worker for c, s in zip(candidates, shortfalls, strict=True) if s <= 0)
        if config.temperature > 0:
            scale = max(sum(q.scale for q in quotes) / len(quotes), 1e-6)
            by_cost = rank_lowest_cost(quotes, session, config.tie_tolerance)
            ranked = rank_sampled(by_cost, config.temperature, scale, self._rng)
            return Decision(
                ranked=[r.cost.worker for r in ranked],
                scores=[_score(r.cost, r.reason, r.probability) for r in ranked],
                set_aside=set_aside,
                room=room,
            )
        ordered = order_lowest_cost(quotes, session, config.tie_tolerance)
        return Decision(
            ranked=[quote.worker for quote, _ in ordered],
            scores=[_score(quote, reason) for quote, reason in ordered],
            set_aside=set_aside,
            room=room,
        )
