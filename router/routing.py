"""Routing decisions: prompt -> block keys -> index matches -> policy ranking.

``Router.decide`` is shared by the proxy path and ``POST /debug/route`` (which only explains).
The block index is optional: without one, keys and matches are empty and the cache-unaware
baselines still work.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from backends.registry import WorkerRegistry
from index.api import BlockIndex, PromptInput, PromptKeys
from index.types import NO_MATCH, PrefixMatch, WorkerId
from router.errors import ModelNotFound, NoHealthyWorker
from router.tokenize_on import TokenizeOn, TokenizePlanner
from scoring.api import Candidate, Decision, Policy, RouteRequest, WorkerScore
from scoring.cost_parts import RequestSize, overlap_tokens, request_size

if TYPE_CHECKING:
    from router.tracing import RequestSpans

log = logging.getLogger("kvgate.routing")
DEFAULT_BLOCK_SIZE = 16  # without an index nothing is keyed; the size only scales zeros


@dataclass(frozen=True, slots=True)
class _Domain:
    """What a retry's ranking keeps of the first: the cache domain, the pinned worker and the
    conversation whose prompt an engine tokenized."""

    base_model: str
    adapter: str | None
    only: WorkerId | None
    conversation: bytes | None = None


@dataclass(frozen=True, slots=True)
class Routed:
    """One routing decision and the facts it was made on."""

    request: RouteRequest
    keys: PromptKeys | None
    candidates: Mapping[WorkerId, Candidate]  # with their matches
    decision: Decision
    policy: str
    base_model: str = ""  # the model whose tokenizer, template and block size keyed it
    adapter: str | None = None  # the LoRA adapter named by the request (its cache domain)
    only: WorkerId | None = None  # the one worker allowed (a conversation it holds)
    # the key of its conversation when an engine tokenized its prompt (router/tokenize_on.py)
    conversation: bytes | None = field(default=None, repr=False)
    _size: RequestSize | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> RequestSize:
        """``scoring.cost_parts.request_size(self.request)``, computed once."""
        size = self._size
        if size is None:
            size = request_size(self.request)
            object.__setattr__(self, "_size", size)  # a cache of a pure function of a field
        return size

    def match(self, worker: WorkerId) -> PrefixMatch:
        candidate = self.candidates.get(worker)
        return candidate.match if candidate is not None else NO_MATCH

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
    def load_blocks(self) -> int:
        """The request's blocks, counted as active decode blocks while it runs."""
        return math.ceil(self.request.prompt_tokens / self.request.block_size)


class Router:
    """Turns a request into a ranked choice of workers."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        block_index: BlockIndex | None = None,
        *,
        retry_after_s: int = 1,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.block_index = block_index
        self.retry_after_s = retry_after_s
        self.tokenize_planner = TokenizePlanner(registry)

    async def decide(
        self,
        model: str,
        prompt: PromptInput | None,
        *,
        session_key: str | None = None,
        max_tokens: int | None = None,
        spans: RequestSpans | None = None,
        only: WorkerId | None = None,
    ) -> Routed:
        """Rank the ready workers serving ``model`` (``ModelNotFound`` / ``NoHealthyWorker``).

        A ``model`` that names a LoRA adapter is keyed as its base model's prompt (tokenizer,
        chat template, block size) in the adapter's cache domain; only workers listing the
        adapter are candidates, and a worker whose own relation for the name puts its blocks
        in another domain gets no match. ``only``: that worker or none (a conversation it
        holds).
        ``spans`` (tracing) gets the ``tokenize``, ``index match`` and ``score`` phases."""
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
        domain = _Domain(base, adapter, only, conversation)
        routed = self._rank(request, keys, matches, domain)  # after the await: fresh load
        if spans is not None:
            spans.phase("score")
        return routed

    def reroute(self, routed: Routed, exclude: Collection[WorkerId]) -> Routed:
        """Rank again for a retry after failed attempts: the same request and keys, fresh
        index matches and load, the workers in ``exclude`` left out (``NoHealthyWorker``
        when nobody is left). A prefix cached on a failed worker counts for nothing."""
        matches = self._match(routed.keys)
        domain = _Domain(routed.base_model, routed.adapter, routed.only, routed.conversation)
        return self._rank(routed.request, routed.keys, matches, domain, exclude)

    def redecide(self, routed: Routed) -> Routed:
        """``routed``'s request ranked again on the index and load as they are now (its keys
        and domain kept: no await), for a queued request at dispatch. ``ModelNotFound`` /
        ``NoHealthyWorker`` as ``decide``."""
        self.require_servable(routed.request.model)
        return self.reroute(routed, ())

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
    ) -> Routed:
        candidates = self.registry.candidates(
            request.model,
            matches,
            request.block_keys,
            domain=(domain.base_model, domain.adapter),
        )
        if domain.only is not None:
            candidates = [c for c in candidates if c.worker == domain.only]
        if exclude:
            candidates = [c for c in candidates if c.worker not in exclude]
        if not candidates:
            raise NoHealthyWorker(request.model, retry_after_s=self.retry_after_s)
        decision = self.policy.rank(request, candidates)
        routed = Routed(
            request=request,
            keys=keys,
            candidates={c.worker: c for c in candidates},
            decision=decision,
            policy=self.policy.name,
            base_model=domain.base_model,
            adapter=domain.adapter,
            only=domain.only,
            conversation=domain.conversation,
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s", _log_line(routed))
        return routed

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

    def explain(self, routed: Routed) -> dict[str, Any]:
        """The ``/debug/route`` answer: every worker, its terms, and why (not) chosen."""
        scores = {s.worker: (rank, s) for rank, s in enumerate(routed.decision.scores)}
        request = routed.request
        workers = []
        for worker in self.registry:
            entry: dict[str, Any] = {"worker": worker.url, "healthy": worker.healthy}
            if worker.id in scores:
                rank, score = scores[worker.id]
                entry |= _scored_entry(routed, worker.id, rank, score)
            else:
                entry |= {"eligible": False, "reason": _ineligible_reason(request.model, worker)}
            workers.append(entry)
        keys = routed.keys
        return {
            "chosen": routed.decision.chosen,
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
            "ranked": list(routed.decision.ranked),
            "workers": workers,
        }


def _scored_entry(
    routed: Routed, worker: WorkerId, rank: int, score: WorkerScore
) -> dict[str, Any]:
    candidate = routed.candidates.get(worker)
    match = candidate.match if candidate is not None else NO_MATCH
    load = candidate.load if candidate is not None else None
    terms = dict(score.terms)
    request_blocks = len(routed.request.block_keys)
    return {
        "eligible": True,
        "rank": rank,
        "chosen": rank == 0,
        "matched_blocks": {"gpu": match.gpu, "cpu": match.cpu, "disk": match.disk},
        "overlap_tokens": match.blocks * routed.request.block_size,
        "prefill_blocks": terms.get("prefill_blocks", request_blocks - match.blocks),
        "decode_blocks": terms.get(
            "decode_blocks", load.active_decode_blocks if load is not None else 0
        ),
        "in_flight": load.in_flight if load is not None else 0,
        "predicted_ttft_s": terms.get("ttft_s"),
        "cost": score.cost,
        "terms": terms,
        "reason": score.reason,
    }


def _ineligible_reason(model: str, worker: Any) -> str:
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
        f"chosen={routed.decision.chosen}",
    ]
    for score in _top(routed.decision.scores):
        match = routed.match(score.worker)
        terms = " ".join(f"{k}={v:g}" for k, v in score.terms.items())
        parts.append(
            f"[{score.worker} gpu={match.gpu} cpu={match.cpu} disk={match.disk} "
            f"cost={score.cost:g} {terms} reason={score.reason!r}]"
        )
    return " ".join(parts)


def _top(scores: Sequence[WorkerScore], limit: int = 8) -> Sequence[WorkerScore]:
    return scores[:limit]
