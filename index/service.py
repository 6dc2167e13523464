"""``KvIndexService``: the index layer as the layers above see it.

* a ``BlockIndex`` for the gateway: a prompt's keys (index/keys/), matches over the event-fed
  and approximate indexes (index/table/), routed requests for workers without events;
* a ``WorkerListener`` for whoever keeps the list of workers (backends' registry, subscribed
  by the gateway): the index follows the fleet's membership and health, it never keeps a list
  of its own. A joining worker's KV events are subscribed to (index/events/), a leaving
  worker's entries dropped, and only healthy workers are asked to tokenize.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from kvgate.index.api import EngineWorker, PromptInput, PromptKeys, TokenizeOn
from kvgate.index.config import IndexConfig
from kvgate.index.events import Discovery, EndpointCheck, Subscriber, Subscriptions
from kvgate.index.keys import PromptKeyer
from kvgate.index.metrics import IndexMetrics
from kvgate.index.table import ApproxIndex, EventIndex, new_table
from kvgate.index.types import NO_MATCH, BlockKey, PrefixMatch, SlotStats, WorkerId, WorkerKey

log = logging.getLogger(__name__)


_RENDERING = frozenset({"vllm", "sglang"})  # engines the local template is checked against


def _better(a: PrefixMatch, b: PrefixMatch) -> bool:
    return (a.blocks, a.gpu, a.cpu) > (b.blocks, b.gpu, b.cpu)


class KvIndexService:
    """Tokenization, block keys, the event-fed and approximate indexes, and event ingestion."""

    def __init__(
        self,
        config: IndexConfig,
        registry: CollectorRegistry,
        http: httpx.AsyncClient,
        *,
        clock: Callable[[], float] = time.monotonic,
        endpoint_allowed: EndpointCheck | None = None,
        on_block_size: Callable[[WorkerId, int], None] | None = None,
    ) -> None:
        """``endpoint_allowed``: whether a KV-event endpoint a worker declares on another host
        than its own may be subscribed to (the router's allowlist; none: never).
        ``on_block_size``: told (from the event loop, never during ingestion) when a worker's
        KV events carry another block size than the index expected of it."""
        self.config = config
        self.metrics = IndexMetrics(registry)
        kind = config.table_kind()
        self.events = EventIndex(config.max_entries, new_table(kind))
        self.approx = ApproxIndex(
            config.approx_ttl_s, config.approx_worker_capacity, clock, new_table(kind)
        )
        self._workers: dict[WorkerId, EngineWorker] = {}
        self._model_block_sizes: dict[str, int] = {}  # declared by the engines
        self._on_block_size = on_block_size
        discovery = Discovery(
            http, timeout_s=config.discovery_timeout_s, endpoint_allowed=endpoint_allowed
        )
        self._subscriptions = Subscriptions(
            config,
            self.events,
            self.metrics,
            discovery,
            on_discovered=self.approx.remove_worker,
            on_block_size=self._events_block_size,
        )
        self._keyer = PromptKeyer(
            config,
            self.metrics,
            http,
            lambda: list(self._workers.values()),
            block_size_for=self.block_size_for,
            reach=self._reach,
        )

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._subscriptions.start()
        self.metrics.watch_entries(self._entry_sources)

    async def settled(self) -> None:
        """Until what the fleet's changes started is done: the first discovery of every worker
        that joined, the tasks of every worker that left."""
        await self._subscriptions.settled()

    async def stop(self) -> None:
        try:
            self._keyer.close()
            for worker in list(self._workers):
                self.worker_removed(worker)
            await self._subscriptions.stop()
        finally:
            self.metrics.close()

    def _entry_sources(self) -> list[tuple[str, list[SlotStats]]]:
        return [("events", self.events.stats()), ("approx", self.approx.stats())]

    # -------------------------------------------------------- the fleet (listener)
    def worker_added(self, worker: EngineWorker) -> None:
        """Subscribe to the worker's KV events (configured, or discovered from a vLLM
        worker), else index it in approximate mode."""
        if worker.id in self._workers:
            self.worker_removed(worker.id)
        self._workers[worker.id] = worker
        self._learn_block_sizes()
        self._subscriptions.join(worker)
        self._check_template(worker)

    def _check_template(self, worker: EngineWorker) -> None:
        """A healthy vLLM or SGLang worker serving a model: check the model's local template
        against its rendering (once per model, in the background)."""
        if worker.healthy and worker.model is not None and worker.engine in _RENDERING:
            self._keyer.check_template(worker.model, worker)

    def worker_removed(self, worker: WorkerId) -> None:
        """Stop the worker's event tasks and drop everything known of it, at once."""
        if self._workers.pop(worker, None) is None:
            return
        self._learn_block_sizes()
        try:
            self._subscriptions.leave(worker)
        finally:
            self.approx.remove_worker(worker)
            self.metrics.resets.labels(worker, "removed").inc()

    def worker_health_changed(self, worker: EngineWorker) -> None:
        """Health (asked before ``/tokenize``), models and block size: a worker whose events
        are to be read with another block size than before joins again (a replay from the
        start brings back what it holds)."""
        known = self._workers.get(worker.id)
        if known is None:
            return
        self._workers[worker.id] = worker
        self._learn_block_sizes()
        self._check_template(worker)
        if self._subscriptions.block_size_of(worker) != self._subscriptions.block_size_of(known):
            self._subscriptions.join(worker)

    def resync(self, worker: WorkerId, *, replay: bool) -> bool:
        """Drop a worker's event entries and subscribe again, with its replay or live only
        (``Subscriptions.resync``); False when it has no event subscription."""
        done = self._subscriptions.resync(worker, replay=replay)
        if done:
            self.metrics.resets.labels(worker, "resync").inc()
        return done

    def _learn_block_sizes(self) -> None:
        """Per model, the block size its engines declare (the registry has checked that
        they agree: a worker that contradicts declares none here)."""
        learned: dict[str, int] = {}
        for worker in self._workers.values():
            if worker.model is not None and worker.block_size is not None:
                learned.setdefault(worker.model, worker.block_size)
        self._model_block_sizes = learned

    def _events_block_size(self, worker: WorkerId, block_size: int) -> None:
        """A worker's events carry another block size than expected: told to the fleet's
        keeper on the next loop turn (it may make this worker join again)."""
        if self._on_block_size is not None and worker in self._workers:
            asyncio.get_running_loop().call_soon(self._on_block_size, worker, block_size)

    def workers(self) -> list[WorkerId]:
        return list(self._workers)

    def has_events(self, worker: WorkerId) -> bool:
        return self._subscriptions.has_events(worker)

    # --------------------------------------------------------- ingestion waits
    def _subscriber(self, worker: WorkerId, dp_rank: int) -> Subscriber:
        return self._subscriptions.subscriber(worker, dp_rank)

    def applied_seq(self, worker: WorkerId, dp_rank: int = 0) -> int | None:
        """Seq of the last event batch handled for that endpoint (None before the first)."""
        return self._subscriber(worker, dp_rank).applied_seq

    async def wait_applied(
        self, worker: WorkerId, seq: int, *, dp_rank: int = 0, timeout_s: float = 5.0
    ) -> None:
        """Wait until batch ``seq`` of that endpoint has been handled (tests, tooling)."""
        await self._subscriber(worker, dp_rank).wait_for(seq, timeout_s)

    def connected(self, worker: WorkerId, dp_rank: int = 0) -> bool:
        return self._subscriber(worker, dp_rank).connected

    # ------------------------------------------------------------------ keys
    def block_size_for(self, model: str) -> int:
        """The configured block size of ``model``, else the one its engines declare, else
        the default."""
        explicit = self.config.explicit_block_size(model)
        if explicit is not None:
            return explicit
        return self._model_block_sizes.get(model, self.config.block_size)

    async def keys_for(
        self, model: str, prompt: PromptInput, *, tokenize_on: TokenizeOn | None = None
    ) -> PromptKeys:
        return await self._keyer.keys_for(model, prompt, tokenize_on=tokenize_on)

    # ----------------------------------------------------------------- match
    def match(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, PrefixMatch]:
        """Per worker: the best prefix over its data-parallel ranks and both indexes."""
        best: dict[WorkerId, PrefixMatch] = {}
        for source in (self.events.find_matches(keys), self.approx.find_matches(keys)):
            for domain, found in source.items():
                current = best.get(domain.worker)
                if current is None or _better(found, current):
                    best[domain.worker] = found
        return best

    def rank_matches(
        self, keys: Sequence[BlockKey]
    ) -> Mapping[WorkerId, Mapping[int, PrefixMatch]]:
        """For each worker with several data-parallel ranks: every rank's matched prefix (a
        rank without one: ``NO_MATCH``). Workers with one rank are left out."""
        ranked = self._subscriptions.ranked
        if not ranked:
            return {}
        out = {worker: dict.fromkeys(ranks, NO_MATCH) for worker, ranks in ranked.items()}
        if not keys:
            return out
        for domain, found in self.events.find_matches(keys).items():
            ranks_of = out.get(domain.worker)
            if ranks_of is not None and domain.dp_rank in ranks_of:
                ranks_of[domain.dp_rank] = found
        return out

    def _reach(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys`` (a prefix) the worker with the longest match holds."""
        return max((m.blocks for m in self.match(keys).values()), default=0)

    def record_routed(self, worker: WorkerId, keys: Sequence[BlockKey]) -> None:
        """A request was routed: remembered only for workers without KV events."""
        if keys and not self._subscriptions.has_events(worker):
            self.approx.record(WorkerKey(worker, 0), keys)

    # ----------------------------------------------------------------- debug
    def stats(self) -> dict[str, Any]:
        return {
            "entries": {"events": self.events.entry_count(), "approx": self.approx.entry_count()},
            "blocks": self.events.block_count(),
            "block_sizes": {
                "default": self.config.block_size,
                "configured": dict(self.config.model_block_sizes),
                "declared_by_engines": dict(self._model_block_sizes),
            },
            "pruned": self.events.pruned,
            "workers": {worker: self._describe(state) for worker, state in self._workers.items()},
            "domains": [
                {
                    "worker": s.worker.worker,
                    "dp_rank": s.worker.dp_rank,
                    "entries": s.entries,
                    "by_tier": {t.name: n for t, n in s.by_tier.items()},
                    "orphans": s.orphans,
                }
                for s in self.events.stats() + self.approx.stats()
            ],
            "tokenizers": {
                model: None
                if t is None
                else {
                    "dir": str(t.directory),
                    "cache_entries": len(t.cache),
                    "cache_hits": t.cache.hits,
                    "cache_misses": t.cache.misses,
                }
                for model, t in self._keyer.tokenizers.items()
            },
        }

    def _describe(self, worker: EngineWorker) -> dict[str, Any]:
        subscribers = self._subscriptions.describe(worker.id)
        return {
            "url": worker.url,
            "engine": worker.engine,
            "healthy": worker.healthy,
            "model": worker.model,
            "block_size": self._subscriptions.block_size_of(worker),
            "mode": "events" if subscribers else "approx",
            "subscribers": subscribers,
        }

    async def explain(self, model: str, prompt: PromptInput) -> dict[str, Any]:
        """How a prompt is keyed and which workers hold how much of it."""
        keys = await self.keys_for(model, prompt)
        matches = self.match(keys.block_keys)
        return {
            "mode": keys.mode,
            "prompt_tokens": keys.prompt_tokens,
            "block_size": keys.block_size,
            "blocks": len(keys.block_keys),
            "matches": {
                worker: {"gpu": m.gpu, "cpu": m.cpu, "disk": m.disk}
                for worker, m in matches.items()
            },
        }
