"""Routing: prompt -> block keys -> index matches -> the policy's ranking -> the capacity rule.

``Router.decide`` keys and matches a request, asks the policy to rank the ready workers by
price and the capacity rule which of them may take it now (``scheduling.capacity``). The
result, ``Routed``, keeps the policy's ranking and the order the request is tried in: the
admitted workers first, in the policy's order, then the refused ones (failover only). The
block index is optional: without one, keys and matches are empty and the cache-unaware
baselines still work.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from kvgate.backends.registry import Worker, WorkerRegistry
from kvgate.index.api import BlockIndex, PromptInput, PromptKeys
from kvgate.index.types import NO_MATCH, PrefixMatch, WorkerId
from kvgate.scheduling.capacity import (
    Limits,
    PartsTable,
    Refusal,
    capacity_of,
    judge,
    kv_shortfall,
)
from kvgate.scheduling.dp_ranks import choose_rank
from kvgate.scheduling.errors import ModelNotFound, NoHealthyWorker
from kvgate.scheduling.ledger import Ledger
from kvgate.scheduling.tokenize_on import TokenizeOn, TokenizePlanner
from kvgate.scheduling.ttft import TtftEstimate, TtftParams, ttft_features, ttft_terms
from kvgate.scoring.api import Candidate, Decision, Policy, RouteRequest, WorkerScore
from kvgate.scoring.cost import RequestSize, overlap_tokens, request_size

log = logging.getLogger("kvgate.routing")
DEFAULT_BLOCK_SIZE = 16  # without an index nothing is keyed; the size only scales zeros

Leg = Literal["prefill", "decode"]
"""A leg of a disaggregated request: ranked among the workers of that role (``LEG_ROLES``)."""
LEG_ROLES: Mapping[Leg, frozenset[str]] = {
    "prefill": frozenset({"prefill"}),
    "decode": frozenset({"decode", "both"}),  # a whole-request worker can decode too
}


class Phases(Protocol):
    """Where a request's routing phases are reported (a trace's spans)."""

    def phase(self, name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class _Domain:
    """What a retry's ranking keeps of the first: the cache domain, the pinned worker and the
    conversation whose prompt an engine tokenized."""

    base_model: str
    adapter: str | None
    only: WorkerId | None
    conversation: bytes | None = None
    allowed: frozenset[WorkerId] | None = None
    leg: Leg | None = None


@dataclass(frozen=True, slots=True)
class Routed:
    """One routing decision and the facts it was made on."""

    request: RouteRequest
    keys: PromptKeys | None
    candidates: Mapping[WorkerId, Candidate]  # with their matches
    decision: Decision  # the policy's ranking, by price
    order: Sequence[WorkerId]  # the order to try: admitted workers first, by the ranking
    refused: Mapping[WorkerId, Refusal]  # the workers the capacity rule refused, and why
    policy: str
    base_model: str = ""  # the model whose tokenizer, template and block size keyed it
    adapter: str | None = None  # the LoRA adapter named by the request (its cache domain)
    only: WorkerId | None = None  # the one worker allowed (a conversation it holds)
    allowed: frozenset[WorkerId] | None = None  # the workers it may go to (None: any)
    room_waived: bool = False  # KV-room refusals were lifted for it
    # the key of its conversation when an engine tokenized its prompt (tokenize_on.py)
    conversation: bytes | None = field(default=None, repr=False)
    leg: Leg | None = None  # ranked for one leg of a disaggregated request (its role's workers)
    _size: RequestSize | None = field(default=None, repr=False, compare=False)

    @property
    def chosen(self) -> WorkerId:
        """The worker to try first."""
        return self.order[0]

    @property
    def admitted(self) -> bool:
        """May the first worker take it now (by the capacity rule)?"""
        return self.order[0] not in self.refused

    @property
    def size(self) -> RequestSize:
        """``scoring.cost.request_size(self.request)``, computed once."""
        size = self._size
        if size is None:
            size = request_size(self.request)
            object.__setattr__(self, "_size", size)  # a cache of a pure function of a field
        return size

    def match(self, worker: WorkerId) -> PrefixMatch:
        candidate = self.candidates.get(worker)
        return candidate.match if candidate is not None else NO_MATCH

    def dp_rank(self, worker: WorkerId) -> int | None:
        """The data-parallel rank to send it to on ``worker`` (None: it has one)."""
        candidate = self.candidates.get(worker)
        return candidate.dp_rank if candidate is not None else None

    def finish_keys(self) -> None:
        """Start the keying work left for after the request's first token
        (``PromptKeys.finish``: the background tokenization of a long prompt keyed in part)."""
        keys = self.keys
        if keys is not None and keys.finish is not None:
            keys.finish()

    def predicted_cached_tokens(self, worker: WorkerId) -> int:
        """Tokens the worker should report cached: its matched whole blocks, never the last
        prompt token (an engine always computes that one)."""
        return overlap_tokens(self.match(worker).blocks, self.size)

    def predicted_uncached_tokens(self, worker: WorkerId) -> int:
        """Prompt tokens the worker still has to prefill (its pending prefill work)."""
        return max(self.request.prompt_tokens - self.predicted_cached_tokens(worker), 0)

    @property
    def best_available_cached_tokens(self) -> int:
        """The best overlap any eligible worker had (what a pure cache policy would get)."""
        best = max((c.match.blocks for c in self.candidates.values()), default=0)
        return overlap_tokens(best, self.size)

    @property
    def best_matched(self) -> WorkerId | None:
        """The candidate holding most of the prompt (None when none holds any); among
        equals, the one ranked first."""
        best, most = None, 0
        for worker in self.decision.ranked:
            candidate = self.candidates.get(worker)
            if candidate is not None and candidate.match.blocks > most:
                best, most = worker, candidate.match.blocks
        return best

    @property
    def load_blocks(self) -> int:
        """The request's blocks, counted as held while it runs."""
        return math.ceil(self.request.prompt_tokens / self.request.block_size)


def admitted_first(
    ranked: Sequence[WorkerId], refused: Mapping[WorkerId, Refusal]
) -> list[WorkerId]:
    """``ranked`` with the admitted workers first, each group in its ranked order."""
    if not refused:
        return list(ranked)
    return [w for w in ranked if w not in refused] + [w for w in ranked if w in refused]


class Router:
    """Turns a request into a ranked, capacity-checked choice of workers."""

    def __init__(
        self,
        registry: WorkerRegistry,
        ledger: Ledger,
        policy: Policy,
        block_index: BlockIndex | None = None,
        *,
        limits: Limits | None = None,
        parts: PartsTable | None = None,
    ) -> None:
        self.registry = registry
        self.ledger = ledger
        self.policy = policy
        self.block_index = block_index
        self.limits = limits or Limits()
        self.parts = parts or PartsTable()
        self.tokenize_planner = TokenizePlanner(registry)

    async def decide(
        self,
        model: str,
        prompt: PromptInput | None,
        *,
        session_key: str | None = None,
        max_tokens: int | None = None,
        spans: Phases | None = None,
        only: WorkerId | None = None,
        allowed: frozenset[WorkerId] | None = None,
        held: frozenset[WorkerId] = frozenset(),
        leg: Leg | None = None,
    ) -> Routed:
        """Rank the ready workers serving ``model`` (``ModelNotFound`` / ``NoHealthyWorker``;
        ``leg``: those of its role only).

        A ``model`` that names a LoRA adapter is keyed as its base model's prompt (tokenizer,
        chat template, block size) in the adapter's cache domain; only workers listing the
        adapter are candidates, and a worker whose own relation for the name puts its blocks
        in another domain gets no match. ``only``: that worker or none (a conversation it
        holds); ``allowed``: only these workers (a gateway's subset of endpoints); ``held``:
        workers the queue holds for other requests (refused). ``spans``
        (tracing) gets the ``tokenize``, ``index match`` and ``score`` phases."""
        self.require_servable(model)
        base, adapter = self.registry.base_model(model)
        index = self.block_index
        keys = None
        matches = None
        tokenize_on = None
        if index is not None and prompt is not None:
            keyed = prompt if adapter is None else replace(prompt, lora_name=adapter)
            tokenize_on = TokenizeOn(self.tokenize_planner, model, prompt, session_key, only)
            keys = await index.keys_for(base, keyed, tokenize_on=tokenize_on)
            if spans is not None:
                spans.phase("tokenize")
            matches = self._match(keys)
            if matches is not None and spans is not None:
                spans.phase("index match")
        request = RouteRequest(
            model=model,
            block_keys=keys.block_keys if keys is not None else (),
            block_size=keys.block_size if keys is not None else DEFAULT_BLOCK_SIZE,
            prompt_tokens=keys.prompt_tokens if keys is not None else 0,
            session_key=session_key,
            max_tokens=max_tokens,
        )
        conversation = tokenize_on.key if tokenize_on is not None else None
        domain = _Domain(base, adapter, only, conversation, allowed=allowed, leg=leg)
        routed = self._rank(request, keys, matches, domain, held=held)  # after the await
        if spans is not None:
            spans.phase("score")
        return routed

    def reroute(
        self,
        routed: Routed,
        exclude: Collection[WorkerId] = (),
        *,
        held: frozenset[WorkerId] = frozenset(),
        waive_room: bool = False,
    ) -> Routed:
        """Rank again on fresh index matches and load: the same request and keys, the
        workers in ``exclude`` left out (``NoHealthyWorker`` when nobody is left). For a
        retry after failed attempts (a prefix cached on a failed worker counts for nothing)
        and for a queued request at dispatch (``held``: workers the queue holds for others;
        ``waive_room``: its wait for KV room is over)."""
        matches = self._match(routed.keys)
        domain = _Domain(
            routed.base_model,
            routed.adapter,
            routed.only,
            routed.conversation,
            allowed=routed.allowed,
            leg=routed.leg,
        )
        return self._rank(
            routed.request, routed.keys, matches, domain, exclude, held=held, waive_room=waive_room
        )

    def for_leg(self, routed: Routed, leg: Leg) -> Routed:
        """The same request (its keys, not keyed again) ranked for ``leg`` of a
        disaggregated exchange: among the workers of that role, on fresh matches and load
        (``NoHealthyWorker`` when the role has no ready worker)."""
        matches = self._match(routed.keys)
        domain = _Domain(
            routed.base_model,
            routed.adapter,
            routed.only,
            routed.conversation,
            allowed=routed.allowed,
            leg=leg,
        )
        return self._rank(routed.request, routed.keys, matches, domain)

    def _match(self, keys: PromptKeys | None) -> Mapping[WorkerId, PrefixMatch] | None:
        """Each worker's matched prefix of the prompt's keys as its own engine kind keys it
        (``PromptKeys.keys_of``: engines that tokenize a prompt differently are never
        credited with each other's blocks); None: nothing to match."""
        index = self.block_index
        if index is None or keys is None or not (keys.block_keys or keys.other_engines):
            return None
        matches = index.match(keys.block_keys) if keys.block_keys else {}
        if not keys.other_engines:
            return matches
        merged = dict(matches)
        for engine, theirs in keys.other_engines.items():
            found = index.match(theirs) if theirs else {}
            for worker in self.registry:
                if worker.config.engine == engine:
                    merged.pop(worker.id, None)
                    if worker.id in found:
                        merged[worker.id] = found[worker.id]
        return merged

    def _rank(
        self,
        request: RouteRequest,
        keys: PromptKeys | None,
        matches: Mapping[WorkerId, PrefixMatch] | None,
        domain: _Domain,
        exclude: Collection[WorkerId] = (),
        *,
        held: frozenset[WorkerId] = frozenset(),
        waive_room: bool = False,
    ) -> Routed:
        workers = self.registry.serving(request.model)
        if domain.only is not None:
            workers = [w for w in workers if w.id == domain.only]
        if domain.allowed is not None:
            workers = [w for w in workers if w.id in domain.allowed]
        if domain.leg is not None:
            roles = LEG_ROLES[domain.leg]
            workers = [w for w in workers if w.config.role in roles]
        if exclude:
            workers = [w for w in workers if w.id not in exclude]
        if not workers:
            raise NoHealthyWorker(request.model)
        if matches:  # a worker keying the model in another cache domain matches nothing
            matches = self.registry.in_domain(
                workers, request.model, matches, (domain.base_model, domain.adapter)
            )
        candidates = self._with_ranks(
            self.ledger.candidates(workers, matches, request.block_keys), keys, request
        )
        decision = self.policy.rank(request, candidates)
        size = request_size(request)
        verdicts = judge(
            size, candidates, self.limits, self.parts.of, held=held, waive_room=waive_room
        )
        routed = Routed(
            request=request,
            keys=keys,
            candidates={c.worker: c for c in candidates},
            decision=decision,
            order=admitted_first(decision.ranked, verdicts.refused),
            refused=verdicts.refused,
            policy=self.policy.name,
            base_model=domain.base_model,
            adapter=domain.adapter,
            only=domain.only,
            allowed=domain.allowed,
            room_waived=verdicts.room_waived,
            conversation=domain.conversation,
            leg=domain.leg,
            _size=size,
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s", _log_line(routed))
        return routed

    def _rank_matches(
        self, keys: PromptKeys | None
    ) -> Mapping[WorkerId, Mapping[int, PrefixMatch]]:
        """Each data-parallel worker's matched prefix per rank, on the keys of its engine."""
        index = self.block_index
        if index is None:
            return {}
        found = index.rank_matches(keys.block_keys if keys is not None else ())
        if not found or keys is None or not keys.other_engines:
            return found
        merged = dict(found)
        for engine, theirs in keys.other_engines.items():
            others = index.rank_matches(theirs)
            for worker in self.registry:
                if worker.config.engine == engine and worker.id in merged:
                    merged[worker.id] = others.get(worker.id, {})
        return merged

    def _with_ranks(
        self, candidates: list[Candidate], keys: PromptKeys | None, request: RouteRequest
    ) -> list[Candidate]:
        """Each data-parallel worker's candidate sent to its cheapest rank (``dp_ranks``)."""
        ranked = self._rank_matches(keys)
        if not ranked:
            return candidates
        out = []
        for candidate in candidates:
            ranks = ranked.get(candidate.worker)
            worker = self.registry.find(candidate.worker)
            if not ranks or worker is None or not worker.adapter.targets_dp_rank:
                out.append(candidate)
                continue
            entry = self.ledger.entry(candidate.worker)
            loads = entry.ranks if entry is not None else {}
            blocks = len(request.block_keys)
            size = request.block_size
            scraped = worker.scraped.rank_queue
            out.append(choose_rank(candidate, ranks, loads, blocks, size, scraped=scraped))
        return out

    def require_servable(self, model: str) -> None:
        if not self.registry.serves(model):
            raise ModelNotFound(model)

    def record_sent(self, routed: Routed, worker: WorkerId) -> None:
        """The request went to ``worker``: tell the index (approximate mode learns from it)
        and, for a prompt an engine tokenized, the tokenize planner (its next turn is
        tokenized there first)."""
        if routed.conversation is not None:
            self.tokenize_planner.sent(routed.conversation, worker)
        keys = routed.keys
        if self.block_index is None or keys is None:
            return
        if keys.other_engines:  # the worker's cache holds the prompt as its engine keys it
            found = self.registry.find(worker)
            own = keys.keys_of(found.config.engine) if found is not None else ()
        else:
            own = keys.block_keys
        if own:
            self.block_index.record_routed(worker, own)

    def predicted_ttft_s(self, routed: Routed, worker: WorkerId) -> float:
        """The worker's predicted TTFT for the request (its learned model on its load in
        ``routed``); 0 for a worker that was no candidate."""
        candidate = routed.candidates.get(worker)
        if candidate is None:
            return 0.0
        estimate, _ = self._ttft(routed, candidate)
        return estimate.total_s

    def _ttft(self, routed: Routed, candidate: Candidate) -> tuple[TtftEstimate, TtftParams]:
        """The candidate's predicted TTFT for the request, and the learned model behind it."""
        size = routed.size
        capacity = capacity_of(candidate.load, self.limits)
        uncached = float(routed.predicted_uncached_tokens(candidate.worker))
        features = ttft_features(
            candidate.load, uncached, size.prompt_tokens, size.block_size, capacity
        )
        params = self.ledger.calibrator.params(candidate.worker)
        return params.predict(features), params

    def explain(self, routed: Routed) -> dict[str, Any]:
        """The ``/debug/route`` answer: every worker, its terms, and why (not) chosen."""
        scores = {s.worker: s for s in routed.decision.scores}
        rank = {w: i for i, w in enumerate(routed.order)}
        request = routed.request
        workers = []
        for worker in self.registry:
            entry: dict[str, Any] = {
                "worker": worker.url,
                "role": worker.config.role,
                "healthy": worker.healthy,
            }
            score = scores.get(worker.id)
            if score is not None:
                entry |= self._scored_entry(routed, worker, rank[worker.id], score)
            else:
                reason = _ineligible_reason(request.model, worker, routed.leg)
                entry |= {"eligible": False, "reason": reason}
            workers.append(entry)
        keys = routed.keys
        return {
            "chosen": routed.chosen,
            "leg": routed.leg,
            "policy": routed.policy,
            "model": request.model,
            "cache_domain": {"base_model": routed.base_model, "adapter": routed.adapter},
            "tokenize_mode": keys.mode if keys is not None else None,
            "tokenize_engine": keys.engine if keys is not None else None,
            "engines_tokenizing_otherwise": sorted(keys.other_engines) if keys is not None else [],
            "block_size": request.block_size,
            "prompt_tokens": request.prompt_tokens,
            "request_blocks": len(request.block_keys),
            "session_key": request.session_key,
            "ranked": list(routed.order),
            "policy_ranked": list(routed.decision.ranked),
            "workers": workers,
        }

    def _scored_entry(
        self, routed: Routed, worker: Worker, rank: int, score: WorkerScore
    ) -> dict[str, Any]:
        candidate = routed.candidates[worker.id]
        match = candidate.match
        load = candidate.load
        terms = dict(score.terms) | self._scheduling_terms(routed, candidate)
        refusal = routed.refused.get(worker.id)
        return {
            "eligible": True,
            "rank": rank,
            "dp_rank": candidate.dp_rank,
            "chosen": rank == 0,
            "matched_blocks": {"gpu": match.gpu, "cpu": match.cpu, "disk": match.disk},
            "overlap_tokens": match.blocks * routed.request.block_size,
            "prefill_blocks": terms.get(
                "prefill_blocks", len(routed.request.block_keys) - match.blocks
            ),
            "decode_blocks": terms.get("decode_blocks", load.active_decode_blocks),
            "in_flight": load.in_flight,
            "predicted_ttft_s": terms["ttft_s"],
            "cost": score.cost,
            "terms": terms,
            "reason": score.reason if refusal is None else f"{score.reason}; {refusal.text}",
            "admitted": refusal is None,
            "refused": None if refusal is None else refusal.text,
            "parts": self.parts.of(worker.id).active(),
        } | self._dp_entry(routed, candidate)

    def _dp_entry(self, routed: Routed, candidate: Candidate) -> dict[str, Any]:
        """A data-parallel worker's ranks: each one's matched prefix and kvgate's load."""
        if candidate.dp_rank is None:
            return {}
        ranks = self._rank_matches(routed.keys).get(candidate.worker, {})
        entry = self.ledger.entry(candidate.worker)
        worker = self.registry.find(candidate.worker)
        out = {}
        for dp_rank, match in sorted(ranks.items()):
            load = entry.rank_load(dp_rank) if entry is not None else None
            out[str(dp_rank)] = {
                "engine_queue": worker.scraped.rank_queue(dp_rank) if worker else None,
                "matched_blocks": match.blocks,
                "in_flight": load.in_flight if load is not None else 0,
                "pending_prefill_tokens": load.pending_prefill_tokens if load is not None else 0,
            }
        return {"dp_ranks": out}

    def _scheduling_terms(self, routed: Routed, candidate: Candidate) -> dict[str, float]:
        """What the scheduler knows of a worker for this request: its KV shortfall, the
        prefix a request in flight there holds, its requests blocked for room, its
        predicted TTFT and the learned model behind it."""
        entry = self.ledger.entry(candidate.worker)
        estimate, params = self._ttft(routed, candidate)
        now = self.ledger.now()
        return {
            "kv_shortfall_blocks": kv_shortfall(candidate, routed.size, self.limits),
            "in_flight_prefix_blocks": float(candidate.in_flight_prefix),
            "blocked_requests": float(entry.blocked_requests if entry is not None else 0),
            "blocked_s": entry.blocked_s(now) if entry is not None else 0.0,
            "reuse": entry.reuse if entry is not None else 0.0,
            "busy": 0.0 if candidate.worker not in routed.refused else 1.0,
            **ttft_terms(estimate, params),
        }


def _ineligible_reason(model: str, worker: Worker, leg: Leg | None) -> str:
    if leg is not None and worker.config.role not in LEG_ROLES[leg]:
        return f"role {worker.config.role}: not a {leg} worker"
    if model not in worker.models:
        return f"does not serve model {model!r}"
    if not worker.healthy:
        return "unhealthy"
    if worker.problems:
        return "not ready: " + "; ".join(worker.problems.values())
    if not worker.ready_for(model):
        return "not used for this model: " + "; ".join(worker.model_problems.values())
    return "not ranked by the policy"


def _log_line(routed: Routed) -> str:
    parts = [
        f"model={routed.request.model}",
        f"policy={routed.policy}",
        f"blocks={len(routed.request.block_keys)}",
        f"chosen={routed.chosen}",
    ]
    for score in _top(routed.decision.scores):
        match = routed.match(score.worker)
        terms = " ".join(f"{k}={v:g}" for k, v in score.terms.items())
        refusal = routed.refused.get(score.worker)
        refused = f" refused={refusal.text!r}" if refusal is not None else ""
        parts.append(
            f"[{score.worker} gpu={match.gpu} cpu={match.cpu} disk={match.disk} "
            f"cost={score.cost:g} {terms} reason={score.reason!r}{refused}]"
        )
    return " ".join(parts)


def _top(scores: Sequence[WorkerScore], limit: int = 8) -> Sequence[WorkerScore]:
    return scores[:limit]
