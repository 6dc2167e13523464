"""The live set of workers: configuration, health, served models and load.

Load is accounted per request with a ``LoadTicket``::

    ticket = registry.begin(worker_id, prompt_tokens, blocks)
    try:
        ...                   # send, wait for the first token
        ticket.first_token()  # the prompt's pending prefill is done
        ...                   # stream the rest
    finally:
        ticket.finish()       # in-flight and decode blocks released (idempotent)

These counters are kvgate's *predicted* load; the health checker adds what it scrapes from
each engine's /metrics (``Worker.scraped``). Both feed ``scoring.api.WorkerLoad``. Whoever
waits for a worker to free up (the router-side queue) registers with ``watch_load`` and is
called when load is released (a first token, a request's end), a scrape lands or a worker
becomes healthy.

The registry is the one list of workers: whoever needs to follow it (the KV index) subscribes
(``subscribe``) and is told of every worker added, removed or changing health.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from backends.config import HealthConfig, WorkerConfig, normalise_url
from backends.engines import EngineAdapter, ScrapedLoad, adapter_for
from backends.errors import WorkerExists, WorkerNotFound
from index.api import Endpoints, EngineWorker, WorkerListener
from index.types import NO_MATCH, PrefixMatch, WorkerId
from scoring.api import Candidate, WorkerLoad

_FOOTPRINT_REBASE_EXPONENT = 256.0
"""Footprints are rescaled once their common factor reaches 2**256 (floats reach 2**1023)."""


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
    active_decode_blocks: int = 0
    footprint: float = 0.0  # see WorkerRegistry.record_footprint
    scraped: ScrapedLoad = field(default_factory=ScrapedLoad)
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

    def load(self) -> WorkerLoad:
        """The worker's load now (an immutable snapshot)."""
        last = self._load
        if (
            last is not None
            and self._load_scraped is self.scraped
            and last.in_flight == self.in_flight
            and last.pending_prefill_tokens == self.pending_prefill_tokens
            and last.active_decode_blocks == self.active_decode_blocks
            and last.footprint == self.footprint
        ):
            return last
        scraped = self.scraped
        self._load_scraped = scraped
        self._load = WorkerLoad(
            in_flight=self.in_flight,
            pending_prefill_tokens=self.pending_prefill_tokens,
            active_decode_blocks=self.active_decode_blocks,
            scraped_running=scraped.running,
            scraped_waiting=scraped.waiting,
            scraped_kv_usage=scraped.kv_usage,
            kv_capacity_blocks=scraped.kv_capacity_blocks,
            footprint=self.footprint,
        )
        return self._load

    def candidate(self, match: PrefixMatch = NO_MATCH) -> Candidate:
        """The worker as a routing candidate with its current load and ``match``."""
        load = self.load()
        last = self._candidate
        if last is not None and last.load is load and last.match is match and last.url is self.url:
            return last
        self._candidate = Candidate(worker=self.id, url=self.url, load=load, match=match)
        return self._candidate

    def engine_view(self) -> EngineWorker:
        """What the KV index needs of this worker, as it is now."""
        config = self.config
        endpoints = (Endpoints(config.events, config.replay, 0),) if config.events else ()
        return EngineWorker(
            id=self.id,
            url=self.url,
            engine=config.engine,
            endpoints=endpoints,
            model=next(iter(self.models)) if len(self.models) == 1 else None,
            authorization=config.authorization(),
            healthy=self.healthy,
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
            "in_flight": self.in_flight,
            "pending_prefill_tokens": self.pending_prefill_tokens,
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


class LoadTicket:
    """One request's share of a worker's predicted load; every release is idempotent."""

    __slots__ = ("_blocks", "_finished", "_on_release", "_prefill_done", "_prompt_tokens", "worker")

    def __init__(
        self,
        worker: Worker,
        prompt_tokens: int,
        blocks: int,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.worker = worker
        self._on_release = on_release
        self._prompt_tokens = prompt_tokens
        self._blocks = blocks
        self._prefill_done = False
        self._finished = False
        worker.in_flight += 1
        worker.pending_prefill_tokens += prompt_tokens
        worker.active_decode_blocks += blocks

    @property
    def finished(self) -> bool:
        return self._finished

    def first_token(self) -> None:
        """The first token came back: the prompt is no longer pending prefill."""
        if not self._prefill_done:
            self._prefill_done = True
            self.worker.pending_prefill_tokens -= self._prompt_tokens
            if self._on_release is not None and not self._finished:
                self._on_release()

    def finish(self) -> None:
        """The request is over (done, failed or cancelled): release everything."""
        if self._finished:
            return
        self._finished = True  # before first_token: one release call, below
        if not self._prefill_done:
            self._prefill_done = True
            self.worker.pending_prefill_tokens -= self._prompt_tokens
        self.worker.in_flight -= 1
        self.worker.active_decode_blocks -= self._blocks
        if self._on_release is not None:
            self._on_release()


class WorkerRegistry:
    """Workers by id (their normalised URL), in the order they were added."""

    def __init__(
        self,
        health: HealthConfig | None = None,
        *,
        footprint_half_life_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._health = health or HealthConfig()
        self._footprint_half_life_s = footprint_half_life_s
        self._clock = clock
        self._footprint_epoch = clock()
        self._workers: dict[WorkerId, Worker] = {}
        self._listeners: list[WorkerListener] = []
        self._load_watchers: list[Callable[[], None]] = []

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
        worker.removed = True
        worker.healthy = False
        for listener in list(self._listeners):
            listener.worker_removed(worker.id)
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
        self, model: str, matches: Mapping[WorkerId, PrefixMatch] | None = None
    ) -> list[Candidate]:
        """Healthy workers serving ``model``, each with its entry of ``matches`` (the index's
        prefix matches; none given: ``NO_MATCH``)."""
        if not matches:
            return [
                w.candidate() for w in self._workers.values() if w.healthy and model in w.models
            ]
        return [
            w.candidate(matches.get(w.id, NO_MATCH))
            for w in self._workers.values()
            if w.healthy and model in w.models
        ]

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of healthy workers' models (first worker's card wins), sorted by id."""
        cards: dict[str, dict[str, Any]] = {}
        for worker in self._workers.values():
            if worker.healthy:
                for model, card in worker.model_cards.items():
                    cards.setdefault(model, card)
        return [cards[m] for m in sorted(cards)]

    def healthy_count(self) -> int:
        return sum(1 for w in self._workers.values() if w.healthy)

    # -- load -------------------------------------------------------------------------
    def begin(self, worker_id: WorkerId, prefill_tokens: int, blocks: int) -> LoadTicket:
        """Count a request sent: ``prefill_tokens`` (its uncached prompt tokens) are pending
        prefill until its first token; ``blocks`` are active decode blocks until it ends."""
        worker = self.get(worker_id)
        self.record_footprint(worker, blocks)
        return LoadTicket(worker, prefill_tokens, blocks, self.load_changed)

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
