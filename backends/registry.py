"""The live set of workers: configuration, health, served models, engine facts and the load
each engine reports (raw, as scraped).

The registry is the one list of workers: whoever needs to follow it (the KV index, the
scheduler's ledger) subscribes (``subscribe``) and is told of every worker added, removed or
changing health. Whoever keeps load beside the engines' own figures (the ledger) hears of
each scrape (``watch_scrapes``); whoever waits for a worker to free up registers with
``watch_load`` and is called when a worker becomes healthy or a round of scrapes lands.
What kvgate itself has sent where is the scheduler's (``scheduling.ledger``), not the
registry's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvgate.backends.config import HealthConfig, WorkerConfig, normalise_url
from kvgate.backends.engines import EngineAdapter, EngineFacts, ScrapedLoad, adapter_for
from kvgate.backends.errors import WorkerExists, WorkerNotFound
from kvgate.backends.facts import Declared, adapter_parents, agree_block_sizes
from kvgate.index.api import Endpoints, EngineWorker, WorkerListener
from kvgate.index.types import PrefixMatch, WorkerId

log = logging.getLogger("kvgate.registry")


class ScrapeListener(Protocol):
    """Told of each scrape of an engine's load (``WorkerRegistry.watch_scrapes``)."""

    def scrape_begins(self, worker: WorkerId) -> None:
        """A scrape of ``worker`` is being asked for now."""
        ...

    def scraped(self, worker: WorkerId, load: ScrapedLoad, asked_at: float) -> None:
        """The scrape asked for at ``asked_at`` answered ``load`` (empty: it failed)."""
        ...


@dataclass(eq=False, slots=True)
class Worker:
    """One engine replica and everything kvgate knows about it right now."""

    config: WorkerConfig
    adapter: EngineAdapter
    healthy: bool = False
    models: frozenset[str] = frozenset()
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # /v1/models entries
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)  # the engine's load, last read
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

    def engine_view(self) -> EngineWorker:
        """What the KV index needs of this worker, as it is now."""
        config = self.config
        endpoints = tuple(
            Endpoints(
                config.rank_endpoint(config.events, rank),
                None if config.replay is None else config.rank_endpoint(config.replay, rank),
                rank,
            )
            for rank in range(config.dp_size)
            if config.events
        )
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
            "role": self.config.role,
            "bootstrap_port": self.config.bootstrap_port,
            "models": sorted(self.models),
            "events": self.config.events,
            "replay": self.config.replay,
            "healthy": self.healthy,
            "ready": self.ready,
            "block_size": self.facts.block_size,
            "problems": dict(self.problems),
            "model_problems": dict(self.model_problems),
            "scraped": {
                "running": self.scraped.running,
                "waiting": self.scraped.waiting,
                "kv_usage": self.scraped.kv_usage,
                "kv_capacity_blocks": self.scraped.kv_capacity_blocks,
            },
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
        }


class WorkerRegistry:
    """Workers by id (their normalised URL), in the order they were added."""

    def __init__(
        self,
        health: HealthConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        explicit_block_size: Callable[[str], int | None] | None = None,
    ) -> None:
        """``explicit_block_size``: the block size kvgate was told to use for a model (None:
        not set; the engines' own is adopted)."""
        self._health = health or HealthConfig()
        self._explicit_block_size = explicit_block_size or (lambda model: None)
        self._clock = clock
        self._workers: dict[WorkerId, Worker] = {}
        self._listeners: list[WorkerListener] = []
        self._scrape_listeners: list[ScrapeListener] = []
        self.stale_models = asyncio.Event()  # set: some worker's model list is to be re-read
        self._adapter_bases: dict[str, str] = {}
        self._unresolved: dict[str, str] = {}  # models without an agreed block size, why
        self._load_watchers: list[Callable[[], None]] = []

    def now(self) -> float:
        return self._clock()

    # -- membership -------------------------------------------------------------------
    def add(self, config: WorkerConfig) -> Worker:
        if config.id in self._workers:
            raise WorkerExists(config.id)
        worker = Worker(config=config, adapter=adapter_for(config.engine))
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

    def watch_scrapes(self, listener: ScrapeListener) -> None:
        """Tell ``listener`` of every scrape of an engine's load from now on."""
        self._scrape_listeners.append(listener)

    def scrape_begins(self, worker: Worker) -> float:
        """A scrape of ``worker``'s load is asked for now; returns the time (monotonic)."""
        for listener in list(self._scrape_listeners):
            listener.scrape_begins(worker.id)
        return self._clock()

    def scraped(self, worker: Worker, load: ScrapedLoad, asked_at: float) -> None:
        """The engine's load as just read (empty: the scrape failed), asked at ``asked_at``."""
        worker.scraped = load
        for listener in list(self._scrape_listeners):
            listener.scraped(worker.id, load, asked_at)

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

    def serving(self, model: str) -> list[Worker]:
        """The workers serving ``model`` and ready for it, in the order they were added."""
        return [w for w in self._workers.values() if model in w.models and w.ready_for(model)]

    @staticmethod
    def in_domain(
        workers: Sequence[Worker],
        model: str,
        matches: Mapping[WorkerId, PrefixMatch],
        domain: tuple[str, str | None],
    ) -> Mapping[WorkerId, PrefixMatch]:
        """``matches`` (the index's, for the request's keys in ``domain``: its (base model,
        adapter)) without those of workers whose blocks for ``model`` are keyed in another
        cache domain (their own relation for the name says which)."""
        outside = [w.id for w in workers if w.id in matches and not w.in_domain(model, *domain)]
        if not outside:
            return matches
        return {w: m for w, m in matches.items() if w not in outside}

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
