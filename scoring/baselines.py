"""Baseline routing policies (cache-unaware): the comparison points of every benchmark.

* ``round_robin``: each request to the next worker in turn.
* ``random``: a uniformly random worker (seeded ``random.Random`` injected).
* ``least_loaded``: fewest in-flight requests; ties go round robin so idle fleets spread.
* ``session``: rendezvous (highest-random-weight) hash of the session key over the
  candidates, so a session keeps its worker while that worker lives and only the sessions of
  a removed worker move; requests without a session key fall back to ``least_loaded``.

Each returns every candidate ranked (the failover order) with the term it ranked on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import xxhash

from kvgate.scoring.api import Candidate, Decision, RouteRequest, WorkerScore


def _decision(ranked: list[tuple[Candidate, float, str]], term: str) -> Decision:
    return Decision(
        ranked=[c.worker for c, _, _ in ranked],
        scores=[
            WorkerScore(worker=c.worker, cost=cost, terms={term: cost}, reason=reason)
            for c, cost, reason in ranked
        ],
    )


class RoundRobinPolicy:
    """The next worker in turn (candidates are given in registry order)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        n = len(candidates)
        start = self._turn % n
        self._turn += 1
        order = [candidates[(start + i) % n] for i in range(n)]
        return _decision(
            [(c, float(i), "its turn" if i == 0 else f"turn +{i}") for i, c in enumerate(order)],
            "turn",
        )


class RandomPolicy:
    """A uniformly random order."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        order = list(candidates)
        self._rng.shuffle(order)
        return _decision(
            [(c, float(i), "drawn" if i == 0 else "not drawn") for i, c in enumerate(order)],
            "draw",
        )


class LeastLoadedPolicy:
    """Fewest in-flight requests; equal loads are broken round robin."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = 0

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        n = len(candidates)
        start = self._turn % n
        self._turn += 1
        keyed = sorted(
            ((c.load.in_flight, (i - start) % n, c) for i, c in enumerate(candidates)),
            key=lambda item: (item[0], item[1]),
        )
        least = keyed[0][0]
        return _decision(
            [
                (c, float(load), "least in-flight" if load == least else "more in-flight")
                for load, _, c in keyed
            ],
            "in_flight",
        )


def rendezvous_weight(session: str, worker: str) -> int:
    """The highest-random-weight hash of one (session, worker) pair."""
    return xxhash.xxh3_64_intdigest(f"{session}\x00{worker}".encode())


class SessionPolicy:
    """Consistent (rendezvous) hash of ``x-session-id`` / ``user``; else least loaded."""

    name = "session"

    def __init__(self) -> None:
        self._fallback = LeastLoadedPolicy()

    def rank(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        session = request.session_key
        if session is None:
            return self._fallback.rank(request, candidates)
        weighted = sorted(
            ((rendezvous_weight(session, c.worker), c) for c in candidates),
            key=lambda item: item[0],
            reverse=True,
        )
        return _decision(
            [
                (c, float(i), "session's worker" if i == 0 else "session fallback")
                for i, (_, c) in enumerate(weighted)
            ],
            "hash_rank",
        )
