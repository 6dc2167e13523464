"""The live set of workers: configuration, health, served models and load.

Load is accounted per request with a ``LoadTicket``::

    ticket = registry.begin(worker_id, uncached_tokens, blocks, block_size)
    try:
        ...                   # send, wait for the first token
        ticket.first_token()  # the prompt's pending prefill is done (its TTFT measured)
        ...                   # stream the rest
        ticket.complete(prompt_tokens, cached_tokens)  # answered: the engine's usage
    finally:
        ticket.finish()       # in-flight and decode blocks released (idempotent); a
                              # completed, measured request teaches the TTFT model

These counters are kvgate's *predicted* load; the health checker adds what it scrapes from
each engine's /metrics (``Worker.scraped``). Both feed ``scoring.api.WorkerLoad``. The
registry also owns each worker's online TTFT model (``scoring.calibration``): what a ticket
saw at dispatch and its measured time to first token are its observations. Whoever waits for
a worker to free up (the router-side queue) registers with ``watch_load`` and is called when
load is released (a first token, a request's end), a scrape lands or a worker becomes
healthy.

The registry is the one list of workers: whoever needs to follow it (the KV index) subscribes
(``subscribe``) and is told of every worker added, removed or changing health.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from backends.config import HealthConfig, WorkerConfig, normalise_url
from backends.engines import EngineAdapter, EngineFacts, ScrapedLoad, adapter_for
from backends.errors import WorkerExists, WorkerNotFound
from backends.facts import Declared, adapter_parents, agree_block_sizes
from index.api import Endpoints, EngineWorker, WorkerListener
from index.keys import shared_prefix_blocks
from index.types import NO_MATCH, BlockKey, PrefixMatch, WorkerId
from scoring.api import DEFAULT_TTFT, Candidate, WorkerLoad
from scoring.calibration import (
    MAX_TOKENS,
    BusyShare,
    LearningConfig,
    TtftCalibrator,
    TtftFeatures,
    TtftParams,
    attention_pairs,
)
from scoring.config import KvPolicyConfig
from scoring.cost_parts import kv_overcommit, ttft_features

REUSE_REQUESTS = 32.0
"""Requests a worker's reuse (its recent cache hit share) averages over."""
FLIGHTS_COMPARED = 32
"""In-flight requests a new one is compared with for a shared prefix (the most recent): a
bound on the work per request however many are in flight."""

log = logging.getLogger("kvgate.registry")
_FOOTPRINT_REBASE_EXPONENT = 256.0
"""Footprints are rescaled once their common factor reaches 2**256 (floats reach 2**1023)."""
MAX_DECODE_BLOCKS = 1 << 20
"""The most blocks one request's streamed answer counts as holding where its worker reports
no KV capacity and none is configured (16M tokens at 16 a block: more than any engine's
cache)."""


@dataclass(eq=False, slots=True)
class Worker:
    """One engine replica and everything kvgate knows about it right now."""

    config: WorkerConfig
    adapter: EngineAdapter
    healthy: bool = False
    models: frozenset[str] = frozenset()
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # /v1/models entries
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    pending_prefill_pairs: float = 0.0  # attention pairs of that pending prefill
    pending_requests: int = 0  # sent and not started (no first token yet)
    # of those, the ones sent lacking KV room (LoadTicket.blocking), oldest first: when sent
    blocked: dict[LoadTicket, float] = field(default_factory=dict)
    # in-flight requests' blocks: their prompts' (shared prefixes counted once) and the
    # blocks their streamed answers have filled so far
    active_decode_blocks: int = 0
    # block keys of the in-flight requests (for the prefixes they share), by ticket
    flights: dict[LoadTicket, Sequence[BlockKey]] = field(default_factory=dict)
    footprint: float = 0.0  # see WorkerRegistry.record_footprint
    reuse: float = 0.0  # see WorkerRegistry.record_reuse
    prefill_busy: BusyShare | None = None  # share of time with a pending request
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)
    # blocks of its requests kvgate saw end (a running count), and that count when the
    # scrape in hand was sent: what ended since, the scrape still counts as held
    released_blocks: int = 0
    scrape_mark: int = 0
    facts: EngineFacts = field(default_factory=EngineFacts)  # as the engine declares them
    events_block_size: int | None = None  # the block size its KV events carry, when seen
    problems: dict[str, str] = field(default_factory=dict)  # engine fact -> why not ready
    # base model -> why it is not used for that model (its block size disagrees: facts.py)
    model_problems: dict[str, str] = field(default_factory=dict)
    models_stale: bool = False  # answered 404 for a model it listed: read its models again
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str | None = None
    removed: bool = False
    # The last snapshots handed out, reused while nothing they hold has changed (immutable).
    _load: WorkerLoad | None = field(default=None, init=False, repr=False)
    _load_scraped: ScrapedLoad | None = field(default=None, init=False, repr=False)
    _candidate: Candidate | None = field(default=None, init=False, repr=False)

    @property
    def id(self) -> WorkerId:
        return self.config.id

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def ready(self) -> bool:
        """Healthy, and nothing it declares contradicts what kvgate keys its prompts with."""
        return self.healthy and not self.problems

    def ready_for(self, model: str) -> bool:
        """Ready, and ``model`` (its base model here, for an adapter) not refused for its
        block size."""
        if not self.model_problems:
            return self.ready
        return self.ready and (self.adapter_base(model) or model) not in self.model_problems

    def base_models(self) -> list[str]:
        """The models it serves that are not adapters of another (``parent`` unset)."""
        return [m for m in self.model_cards if self.adapter_base(m) is None]

    def adapter_base(self, model: str) -> str | None:
        """The base model of adapter ``model`` on this worker (None: not an adapter here)."""
        parent = self.model_cards.get(model, {}).get("parent")
        return parent if isinstance(parent, str) and parent else None

    def relations(self) -> dict[str, str | None]:
        """Each model it lists → its parent (None: a base model), as this worker says."""
        return {m: self.adapter_base(m) for m in self.model_cards}

    def in_domain(self, model: str, base: str, adapter: str | None) -> bool:
        """Whether its blocks for ``model`` are keyed in the cache domain (``base``,
        ``adapter``): its own relation for the name says which domain they are in."""
        parent = self.adapter_base(model)
        return (parent, model) == (base, adapter) if parent else (model, None) == (base, adapter)

    @property
    def blocked_requests(self) -> int:
        """Requests sent here lacking KV room and not started yet."""
        return len(self.blocked)

    def unblock(self, sent_before: float) -> None:
        """The engine reported no request waiting in a scrape asked for at ``sent_before``:
        the blocked requests sent before then have started (a request read whole at its end,
        not streamed, shows no first token until then)."""
        while self.blocked:
            ticket, sent = next(iter(self.blocked.items()))
            if sent > sent_before:
                return
            del self.blocked[ticket]

    def blocked_s(self, now: float | None) -> float:
        """How long the oldest of ``blocked_requests`` has waited at ``now`` (0: none, or no
        ``now``), to the hundredth of a second."""
        if not self.blocked or now is None:
            return 0.0
        return round(max(now - next(iter(self.blocked.values())), 0.0), 2)

    def load(self, now: float | None = None) -> WorkerLoad:
        """The worker's load (an immutable snapshot); its busy share and blocked time at
        ``now`` (to the hundredth, so that snapshots are reused while nothing else changes)."""
        busy = self.prefill_busy
        share = 0.0 if busy is None or now is None else round(busy.at(now), 2)
        blocked_s = self.blocked_s(now)
        usage = self.kv_usage_now()
        last = self._load
        if (
            last is not None
            and self._load_scraped is self.scraped
            and last.scraped_kv_usage == usage
            and last.in_flight == self.in_flight
            and last.pending_prefill_tokens == self.pending_prefill_tokens
            and last.pending_prefill_pairs == self.pending_prefill_pairs
            and last.active_decode_blocks == self.active_decode_blocks
            and last.footprint == self.footprint
            and last.reuse == self.reuse
            and last.prefill_busy_share == share
            and last.blocked_requests == self.blocked_requests
            and last.blocked_s == blocked_s
        ):
            return last
        scraped = self.scraped
        self._load_scraped = scraped
        self._load = WorkerLoad(
            in_flight=self.in_flight,
            pending_prefill_tokens=self.pending_prefill_tokens,
            pending_prefill_pairs=self.pending_prefill_pairs,
            active_decode_blocks=self.active_decode_blocks,
            scraped_running=scraped.running,
            scraped_waiting=scraped.waiting,
            scraped_kv_usage=usage,
            kv_capacity_blocks=scraped.kv_capacity_blocks,
            footprint=self.footprint,
            prefill_busy_share=share,
            reuse=self.reuse,
            blocked_requests=self.blocked_requests,
            blocked_s=blocked_s,
        )
        return self._load

    def kv_usage_now(self) -> float | None:
        """The scraped KV usage less the blocks of kvgate's requests that ended here since
        the scrape was sent (a scrape is up to ``metrics_interval_s`` old, and an agent's
        next turn follows the end of its last one at once: the stale figure would show its
        home full of the blocks that turn just released). The scrape as is without a
        capacity to weigh the blocks against; never below 0."""
        scraped = self.scraped
        usage, capacity = scraped.kv_usage, scraped.kv_capacity_blocks
        released = self.released_blocks - self.scrape_mark
        if usage is None or not capacity or released <= 0:
            return usage
        return max(usage - released / capacity, 0.0)

    def candidate(
        self,
        match: PrefixMatch = NO_MATCH,
        ttft: TtftParams | None = None,
        now: float | None = None,
        keys: Sequence[BlockKey] = (),
    ) -> Candidate:
        """The worker as a routing candidate with its current load, ``match``, TTFT model
        (none given: the default prior) and the leading blocks of ``keys`` (the request's)
        that a request in flight here holds."""
        load = self.load(now)
        shared = self.shared_blocks(keys)
        last = self._candidate
        if (
            last is not None
            and last.load is load
            and last.match is match
            and last.url is self.url
            and last.in_flight_prefix == shared
            and (ttft is None or last.ttft is ttft)
        ):
            return last
        prior = DEFAULT_TTFT if ttft is None else ttft
        self._candidate = Candidate(self.id, self.url, load, match, prior, shared)
        return self._candidate

    def shared_blocks(self, keys: Sequence[BlockKey]) -> int:
        """Leading blocks of ``keys`` that a request in flight here already holds (the most
        shared with any of the last ``FLIGHTS_COMPARED`` sent): a running request's blocks
        are referenced, not copied, by another that shares its prefix."""
        if not keys or not self.flights:
            return 0
        recent = itertools.islice(reversed(self.flights.values()), FLIGHTS_COMPARED)
        return max(shared_prefix_blocks(keys, other) for other in recent)

    def engine_view(self) -> EngineWorker:
        """What the KV index needs of this worker, as it is now."""
        config = self.config
        endpoints = (Endpoints(config.events, config.replay, 0),) if config.events else ()
        bases = self.base_models()
        return EngineWorker(
            id=self.id,
            url=self.url,
            engine=config.engine,
            endpoints=endpoints,
            model=bases[0] if len(bases) == 1 else None,
            authorization=config.authorization(),
            healthy=self.healthy,
            block_size=None if self.problems else self.facts.block_size,
        )

    def set_models(self, cards: Mapping[str, dict[str, Any]]) -> None:
        self.model_cards = dict(cards)
        self.models = frozenset(cards)

    def describe(self) -> dict[str, Any]:
        """The admin view (never includes the API key)."""
        return {
            "id": self.id,
            "url": self.url,
            "engine": self.config.engine,
            "models": sorted(self.models),
            "events": self.config.events,
            "replay": self.config.replay,
            "healthy": self.healthy,
            "ready": self.ready,
            "block_size": self.facts.block_size,
            "problems": dict(self.problems),
            "model_problems": dict(self.model_problems),
            "in_flight": self.in_flight,
            "pending_prefill_tokens": self.pending_prefill_tokens,
            "pending_requests": self.pending_requests,
            "active_decode_blocks": self.active_decode_blocks,
            "scraped": {
                "running": self.scraped.running,
                "waiting": self.scraped.waiting,
                "kv_usage": self.scraped.kv_usage,
                "kv_capacity_blocks": self.scraped.kv_capacity_blocks,
            },
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
        }


@dataclass(frozen=True, slots=True)
class TtftObservation:
    """One finished request's predicted and measured time to first token (seconds)."""

    worker: Worker
    predicted_s: float
    measured_s: float
    learned: bool  # False when the calibrator refused it (implausible, or no room)


class LoadTicket:
    """One request's share of a worker's predicted load; every release is idempotent."""

    __slots__ = (
        "_block_size",
        "_blocks",
        "_completed",
        "_decoded",
        "_features",
        "_finished",
        "_grown",
        "_pairs",
        "_predicted_s",
        "_prefill_done",
        "_prompt",
        "_prompt_tokens",
        "_registry",
        "_reserved",
        "_sent_at",
        "_ttft_s",
        "worker",
    )

    def __init__(
        self,
        registry: WorkerRegistry,
        worker: Worker,
        *,
        prompt_tokens: int,
        own_blocks: int,
        features: TtftFeatures,
        predicted_s: float,
        keys: Sequence[BlockKey] = (),
        reserved: bool = False,
        blocking: bool = False,
        prompt: int = 0,
        block_size: int = 16,
    ) -> None:
        """``prompt_tokens``: its tokens to prefill, of ``prompt`` (the whole prompt, where
        its answer's first block starts: ``block_size`` tokens a block)."""
        self.worker = worker
        self._registry = registry
        self._reserved = reserved  # a queue's hold, handed over: its end releases nothing
        self._prompt_tokens = prompt_tokens
        # its own blocks: those past the prefix it shares with a request in flight there
        self._blocks = own_blocks
        self._prompt = max(prompt, 0)
        self._block_size = max(block_size, 1)
        self._decoded = 0  # answer tokens streamed so far
        self._grown = 0  # the blocks they filled past the prompt's (in active_decode_blocks)
        if keys:
            worker.flights[self] = keys
        self._features = features
        self._pairs = features.own_pairs
        self._predicted_s = predicted_s
        self._sent_at = registry.now()
        self._ttft_s: float | None = None
        self._completed = False
        self._prefill_done = False
        self._finished = False
        worker.in_flight += 1
        worker.pending_prefill_tokens += prompt_tokens
        worker.pending_prefill_pairs += features.own_pairs
        worker.active_decode_blocks += self._blocks
        worker.pending_requests += 1
        # sent lacking KV room: until it starts, the engine starts nothing sent after it
        if blocking:
            worker.blocked[self] = self._sent_at
        if worker.pending_requests == 1 and worker.prefill_busy is not None:
            worker.prefill_busy.set(self._sent_at, busy=True)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def predicted_ttft_s(self) -> float:
        return self._predicted_s

    @property
    def blocking(self) -> bool:
        """Sent lacking KV room (kvgate's prediction then), and not known to have started."""
        return self in self.worker.blocked

    def first_token(self, *, measured: bool = True) -> None:
        """The first token came back: the prompt is no longer pending prefill.

        ``measured``: this is the moment the first token arrived (a stream's first chunk),
        so the time since dispatch is the request's TTFT; not for a whole body read at once.
        """
        if self._prefill_done:
            return
        self._prefill_done = True
        worker = self.worker
        worker.pending_prefill_tokens -= self._prompt_tokens
        worker.pending_requests -= 1
        worker.blocked.pop(self, None)
        worker.pending_prefill_pairs = (
            max(worker.pending_prefill_pairs - self._pairs, 0.0) if worker.pending_requests else 0.0
        )
        now = self._registry.now()
        if measured:
            self._ttft_s = now - self._sent_at
        if worker.pending_requests == 0 and worker.prefill_busy is not None:
            worker.prefill_busy.set(now, busy=False)
        if not self._finished:  # (finish tells the watchers once, itself)
            self._registry.load_changed()

    def streamed(self, tokens: int) -> None:
        """``tokens`` more of its answer came back (a stream's events): the engine holds
        the blocks they fill, as long as the request runs. A long answer grows a block
        every ``block_size`` tokens, and two of them decoding for a minute hold hundreds
        more than their prompts did. Counted from the stream, at most the worker's capacity
        (``WorkerRegistry.answer_cap``): a worker that streams without end makes only itself
        look full, and only until the request ends."""
        if self._finished or tokens <= 0 or not self._registry.counts_answer_blocks:
            return
        self._decoded += tokens
        size = self._block_size
        grown = -(-(self._prompt + self._decoded) // size) - -(-self._prompt // size)
        grown = min(grown, self._registry.answer_cap(self.worker))
        if grown > self._grown:
            self.worker.active_decode_blocks += grown - self._grown
            self._grown = grown

    def complete(self, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """The request was answered in full; the engine's usage, when it reported it, says
        what was really prefilled (the TTFT model learns from that, not the prediction)."""
        self._completed = True
        if prompt_tokens is not None and cached_tokens is not None:
            uncached = float(max(min(prompt_tokens - cached_tokens, MAX_TOKENS), 0))
            pairs = attention_pairs(uncached, float(min(max(prompt_tokens, 0), MAX_TOKENS)))
            self._features = replace(self._features, uncached_tokens=uncached, own_pairs=pairs)

    def finish(self) -> TtftObservation | None:
        """The request is over (done, failed or cancelled): release everything. Returns the
        TTFT observation when the request was answered and its first token timed."""
        if self._finished:
            return None
        self._finished = True
        self.first_token(measured=False)
        self.worker.in_flight -= 1
        held = self._blocks + self._grown
        self.worker.active_decode_blocks -= held
        if not self._reserved:
            self.worker.released_blocks += held
        self.worker.flights.pop(self, None)
        self._registry.load_changed()
        if not self._completed or self._ttft_s is None or self.worker.removed:
            return None
        return self._registry.observe_ttft(
            self.worker, self._features, self._predicted_s, self._ttft_s
        )


class WorkerRegistry:
    """Workers by id (their normalised URL), in the order they were added."""

    def __init__(
        self,
        health: HealthConfig | None = None,
        *,
        scoring: KvPolicyConfig | None = None,
        footprint_half_life_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        explicit_block_size: Callable[[str], int | None] | None = None,
    ) -> None:
        """``explicit_block_size``: the block size kvgate was told to use for a model (None:
        not set; the engines' own is adopted)."""
        self._health = health or HealthConfig()
        self._explicit_block_size = explicit_block_size or (lambda model: None)
        self._scoring = scoring = scoring or KvPolicyConfig()
        self._footprint_half_life_s = footprint_half_life_s or scoring.footprint_half_life_s
        self._clock = clock
        self._footprint_epoch = clock()
        self._workers: dict[WorkerId, Worker] = {}
        self._listeners: list[WorkerListener] = []
        self.stale_models = asyncio.Event()  # set: some worker's model list is to be re-read
        self._adapter_bases: dict[str, str] = {}
        self._unresolved: dict[str, str] = {}  # models without an agreed block size, why
        self._load_watchers: list[Callable[[], None]] = []
        self.calibrator = TtftCalibrator(
            TtftParams.prior(scoring.prior_prefill_tokens_per_s, scoring.prior_base_s),
            prior_weight=scoring.calibration_prior_weight,
            learning=LearningConfig(window=scoring.calibration_window),
        )

    def now(self) -> float:
        return self._clock()

    @property
    def counts_answer_blocks(self) -> bool:
        """Streamed answers' blocks count as held (``KvPolicyConfig.answer_blocks``)."""
        return self._scoring.answer_blocks

    def answer_cap(self, worker: Worker) -> int:
        """The most blocks one streamed answer counts as holding on ``worker``: its KV
        capacity as the fit takes it (scraped, else ``kv_capacity_blocks``), else
        ``MAX_DECODE_BLOCKS``."""
        capacity = worker.scraped.kv_capacity_blocks or self._scoring.kv_capacity_blocks
        return capacity or MAX_DECODE_BLOCKS

    # -- membership -------------------------------------------------------------------
    def add(self, config: WorkerConfig) -> Worker:
        if config.id in self._workers:
            raise WorkerExists(config.id)
        worker = Worker(config=config, adapter=adapter_for(config.engine))
        worker.prefill_busy = BusyShare(self._scoring.utilisation_half_life_s, self._clock())
        if config.models is not None:
            worker.set_models(
                {m: {"id": m, "object": "model", "owned_by": "kvgate"} for m in config.models}
            )
        self._workers[config.id] = worker
        for listener in list(self._listeners):
            listener.worker_added(worker.engine_view())
        return worker

    def remove(self, worker_id: str) -> Worker:
        worker = self.get(worker_id)
        del self._workers[worker.id]
        self._index_adapters()
        self.calibrator.forget(worker.id)
        worker.removed = True
        worker.healthy = False
        for listener in list(self._listeners):
            listener.worker_removed(worker.id)
        self.check_facts()  # its vote on its models' block size is gone
        return worker

    def subscribe(self, listener: WorkerListener) -> None:
        """Tell ``listener`` of every worker added, removed or changing health from now on;
        the workers already here are told to it as added, first."""
        self._listeners.append(listener)
        for worker in list(self._workers.values()):
            listener.worker_added(worker.engine_view())

    def unsubscribe(self, listener: WorkerListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def watch_load(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (synchronously, cheap) whenever a worker may have freed up."""
        self._load_watchers.append(callback)

    def unwatch_load(self, callback: Callable[[], None]) -> None:
        if callback in self._load_watchers:
            self._load_watchers.remove(callback)

    def load_changed(self) -> None:
        """Load was released or re-measured somewhere: tell the watchers."""
        for callback in self._load_watchers:
            callback()

    def get(self, worker_id: str) -> Worker:
        worker = self.find(worker_id)
        if worker is None:
            raise WorkerNotFound(worker_id)
        return worker

    def find(self, worker_id: str) -> Worker | None:
        worker = self._workers.get(WorkerId(worker_id))
        if worker is None:
            try:
                worker = self._workers.get(WorkerId(normalise_url(worker_id)))
            except ValueError:
                return None
        return worker

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    # -- routing view -----------------------------------------------------------------
    def serves(self, model: str) -> bool:
        """Does any worker (healthy or not) serve ``model``?"""
        return any(model in w.models for w in self._workers.values())

    def candidates(
        self,
        model: str,
        matches: Mapping[WorkerId, PrefixMatch] | None = None,
        keys: Sequence[BlockKey] = (),
        domain: tuple[str, str | None] | None = None,
    ) -> list[Candidate]:
        """Workers serving ``model`` and ready for it, each with its entry of ``matches`` (the
        index's prefix matches; none given: ``NO_MATCH``; none either for a worker whose
        blocks for ``model`` are in another cache domain than ``domain``, the request's
        (base model, adapter)), its learned TTFT model and the leading blocks of ``keys``
        (the request's block keys) a request in flight there holds."""
        now = self._clock()
        params = self.calibrator.params
        matches = matches or {}
        return [
            w.candidate(self._match(w, model, matches, domain), params(w.id), now, keys)
            for w in self._workers.values()
            if model in w.models and w.ready_for(model)
        ]

    @staticmethod
    def _match(
        worker: Worker,
        model: str,
        matches: Mapping[WorkerId, PrefixMatch],
        domain: tuple[str, str | None] | None,
    ) -> PrefixMatch:
        """The worker's index match, when its blocks for ``model`` are in ``domain`` (the
        request's keys'); none otherwise (they are keyed in another cache domain)."""
        match = matches.get(worker.id, NO_MATCH)
        if match is NO_MATCH or domain is None or worker.in_domain(model, *domain):
            return match
        return NO_MATCH

    def base_model(self, model: str) -> tuple[str, str | None]:
        """``model`` as (base model, adapter): a name is an adapter (of the parent most of
        the workers listing it give) only where no worker serves it as a base model
        (backends/facts.py); any other name is a base."""
        base = self._adapter_bases.get(model)
        return (model, None) if base is None else (base, model)

    def _index_adapters(self) -> None:
        """adapter → base model by agreement over every worker, kept at hand: ``base_model``
        is asked once per request."""
        self._adapter_bases = adapter_parents(w.relations() for w in self._workers.values())

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of healthy workers' models, sorted by id: of a name some list as a base
        model and others as an adapter, a base model's card; else the first worker's."""
        cards: dict[str, dict[str, Any]] = {}
        for worker in self._workers.values():
            if worker.healthy:
                for model, card in worker.model_cards.items():
                    known = cards.get(model)
                    if known is None or (known.get("parent") and not card.get("parent")):
                        cards[model] = card
        return [cards[m] for m in sorted(cards)]

    def healthy_count(self) -> int:
        return sum(1 for w in self._workers.values() if w.healthy)

    def ready_count(self) -> int:
        return sum(1 for w in self._workers.values() if w.ready)

    def problems(self) -> dict[str, dict[str, str]]:
        """Per worker URL, the engine facts that keep it from being ready, and why."""
        return {w.url: dict(w.problems) for w in self._workers.values() if w.problems}

    def unresolved_models(self) -> dict[str, str]:
        """The models without an agreed block size (not ready on any worker), and why."""
        return dict(self._unresolved)

    # -- what the engines declare -------------------------------------------------------
    def update_models(
        self, worker: Worker, cards: Mapping[str, dict[str, Any]] | None, facts: EngineFacts
    ) -> None:
        """A worker's model list (None: unchanged) and engine facts as just read from it;
        whoever follows the fleet hears of it when what it sees of the worker changed."""
        if worker.removed:
            return
        before = worker.engine_view()
        worker.models_stale = False
        if cards is not None:
            _log_model_changes(worker, cards)
            worker.set_models(cards)
            self._index_adapters()
        if facts.block_size is not None:
            worker.facts = facts
        self.check_facts(changed={worker.id: before})

    def models_stale(self, worker: Worker) -> None:
        """The worker answered 404 for a model it listed: its list is read again soon."""
        if not worker.removed and not worker.models_stale:
            worker.models_stale = True
            self.stale_models.set()

    def observe_block_size(self, worker_id: WorkerId, block_size: int) -> None:
        """A worker's KV events carry ``block_size``: adopted when it declared none, else
        checked against what it declared."""
        worker = self._workers.get(worker_id)
        if worker is None or block_size <= 0:
            return
        before = worker.engine_view()
        worker.events_block_size = block_size
        if worker.facts.block_size is None:
            log.info("%s: block size %d adopted from its KV events", worker.url, block_size)
            worker.facts = EngineFacts(block_size=block_size)
        self.check_facts(changed={worker.id: before})

    def check_facts(self, changed: Mapping[WorkerId, EngineWorker] | None = None) -> None:
        """Recompute every worker's problems (a block size that contradicts the configured
        one, the one its model's workers agree on, or its own events: backends/facts.py);
        listeners hear of every worker whose view changed (``changed``: views from before a
        change made here)."""
        before = {w.id: w.engine_view() for w in self._workers.values()} | dict(changed or {})
        found = agree_block_sizes(
            (_declared(w) for w in self._workers.values()), self._explicit_block_size
        )
        self._unresolved = found.unresolved
        for worker in self._workers.values():
            per_model = found.per_model.get(worker.id, {})
            problems = _worker_problems(worker, found.own.get(worker.id), per_model)
            if problems != worker.problems or per_model != worker.model_problems:
                _log_problems(worker, problems, per_model)
                worker.problems, worker.model_problems = problems, per_model
            view = worker.engine_view()
            if view != before.get(worker.id):
                for listener in list(self._listeners):
                    listener.worker_health_changed(view)

    # -- load -------------------------------------------------------------------------
    def begin(
        self,
        worker_id: WorkerId,
        prefill_tokens: int,
        blocks: int,
        block_size: int = 16,
        prompt_tokens: int | None = None,
        *,
        keys: Sequence[BlockKey] = (),
    ) -> LoadTicket:
        """Count a request sent: ``prefill_tokens`` (its uncached prompt tokens, of
        ``prompt_tokens``) are pending prefill until its first token; ``blocks`` (of
        ``block_size`` tokens) are active decode blocks until it ends, less the leading
        ones its block ``keys`` share with a request in flight there. Its TTFT is predicted
        from the load it finds."""
        worker = self.get(worker_id)
        self.record_footprint(worker, blocks)
        prompt = prompt_tokens if prompt_tokens is not None else prefill_tokens
        self.record_reuse(worker, prefill_tokens, prompt)
        return self._ticket(worker, prefill_tokens, blocks, block_size, prompt, keys=keys)

    def reserve(
        self,
        worker_id: WorkerId,
        prefill_tokens: int,
        blocks: int,
        block_size: int = 16,
        prompt_tokens: int | None = None,
        *,
        keys: Sequence[BlockKey] = (),
    ) -> LoadTicket:
        """Count the load of a request about to be sent (the router-side queue's hold on
        the worker it dispatched to) as ``begin`` does, without its footprint and reuse:
        ``begin`` records those when the request is sent. Never completed: it teaches
        nothing."""
        prompt = prompt_tokens if prompt_tokens is not None else prefill_tokens
        worker = self.get(worker_id)
        return self._ticket(
            worker, prefill_tokens, blocks, block_size, prompt, keys=keys, reserved=True
        )

    def _ticket(
        self,
        worker: Worker,
        prefill_tokens: int,
        blocks: int,
        block_size: int,
        prompt: int,
        *,
        keys: Sequence[BlockKey],
        reserved: bool = False,
    ) -> LoadTicket:
        load = worker.load(self._clock())
        features = ttft_features(load, prefill_tokens, prompt, block_size, self._scoring)
        predicted = self.calibrator.params(worker.id).predict(features).total_s
        own = max(blocks - worker.shared_blocks(keys), 0)  # past a prefix one in flight holds
        if self._scoring.kv_fit_cached:
            resident = own
        else:
            resident = -(-max(prefill_tokens, 0) // max(block_size, 1))
        return LoadTicket(
            self,
            worker,
            prompt_tokens=prefill_tokens,
            own_blocks=own,
            features=features,
            predicted_s=predicted,
            keys=keys,
            reserved=reserved,
            blocking=kv_overcommit(load, resident, self._scoring) > 0.0,
            prompt=prompt,
            block_size=block_size,
        )

    def observe_ttft(
        self, worker: Worker, features: TtftFeatures, predicted_s: float, measured_s: float
    ) -> TtftObservation:
        """A finished request's measured TTFT: the worker's model learns from it."""
        learned = self.calibrator.observe(worker.id, features, measured_s)
        self.calibrator.record_error(worker.id, predicted_s, measured_s)
        return TtftObservation(worker, predicted_s, measured_s, learned)

    @staticmethod
    def record_reuse(worker: Worker, prefill_tokens: int, prompt_tokens: int) -> None:
        """Fold one routed request's predicted hit (its cached share) into the worker's
        reuse, an exponentially weighted mean over about ``REUSE_REQUESTS`` requests."""
        if prompt_tokens <= 0:
            return
        hit = min(max(1.0 - prefill_tokens / prompt_tokens, 0.0), 1.0)
        worker.reuse += (hit - worker.reuse) / REUSE_REQUESTS

    def record_footprint(self, worker: Worker, blocks: int) -> None:
        """Add a routed prompt's ``blocks`` to the worker's decayed footprint.

        Instead of decaying every worker's value all the time, each addition is scaled up by
        ``2 ** (age of the epoch / half-life)``: every worker's value is then the decayed sum
        times one common factor, so ratios between workers are exact without any clock at
        read time. The epoch moves (all values scaled down) before the factor gets large."""
        exponent = (self._clock() - self._footprint_epoch) / self._footprint_half_life_s
        if exponent > _FOOTPRINT_REBASE_EXPONENT:
            scale = 2.0**-exponent
            for each in self._workers.values():
                each.footprint *= scale
            self._footprint_epoch += exponent * self._footprint_half_life_s
            exponent = 0.0
        worker.footprint += blocks * 2.0**exponent

    # -- health -----------------------------------------------------------------------
    def record_success(self, worker: Worker) -> None:
        """A health probe succeeded."""
        worker.consecutive_failures = 0
        worker.consecutive_successes += 1
        worker.last_error = None
        if not worker.healthy and worker.consecutive_successes >= self._health.recovery_threshold:
            self._set_health(worker, healthy=True)

    def record_ok_response(self, worker: Worker) -> None:
        """A request was answered without a server error (passive signal)."""
        worker.consecutive_failures = 0

    def record_failure(self, worker: Worker, reason: str, *, immediate: bool = False) -> None:
        """A probe failed, or (passively) a request hit a connect error or a 5xx.

        ``immediate`` (connection refused) marks the worker unhealthy at once; other
        failures count towards ``failure_threshold``.
        """
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        worker.last_error = reason
        threshold = self._health.failure_threshold
        if worker.healthy and (immediate or worker.consecutive_failures >= threshold):
            self._set_health(worker, healthy=False)

    def _set_health(self, worker: Worker, *, healthy: bool) -> None:
        worker.healthy = healthy
        if healthy:
            worker.consecutive_failures = 0
        for listener in list(self._listeners):
            listener.worker_health_changed(worker.engine_view())
        if healthy:
            self.load_changed()


def _declared(worker: Worker) -> Declared:
    facts = worker.facts
    return Declared(
        worker.id, tuple(worker.base_models()), facts.block_size, worker.events_block_size
    )


def _worker_problems(
    worker: Worker, own: str | None, per_model: Mapping[str, str]
) -> dict[str, str]:
    """The worker's block size cannot be used at all: its events contradict it (``own``), or
    every model it serves refuses it."""
    if own is not None:
        return {"block_size": own}
    bases = worker.base_models()
    if bases and all(model in per_model for model in bases):
        return {"block_size": "; ".join(dict.fromkeys(per_model[m] for m in bases))}
    return {}


def _log_problems(
    worker: Worker, problems: Mapping[str, str], per_model: Mapping[str, str]
) -> None:
    if problems:
        for fact, reason in problems.items():
            log.error("%s is not ready (%s): %s", worker.url, fact, reason)
    elif per_model:
        for model, reason in per_model.items():
            log.error("%s is not used for model %r: %s", worker.url, model, reason)
    else:
        log.info(
            "%s: its engine facts agree again: %s resolved",
            worker.url,
            sorted(worker.problems) or sorted(worker.model_problems),
        )


def _log_model_changes(worker: Worker, cards: Mapping[str, dict[str, Any]]) -> None:
    if not worker.models:
        return
    added, gone = sorted(cards.keys() - worker.models), sorted(worker.models - cards.keys())
    if added or gone:
        log.info("%s: models added %s, gone %s", worker.url, added, gone)
