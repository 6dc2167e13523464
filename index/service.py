"""``KvIndexService``: the index layer as the layers above see it.

* a ``BlockIndex`` for the gateway: a prompt's keys (index/keys/), matches over the event-fed
  and approximate indexes (index/table/), routed requests for workers without events;
* a ``WorkerListener`` for whoever keeps the list of workers (backends' registry, subscribed
  by the gateway): the index follows the fleet's membership and health, it never keeps a list
  of its own. A joining worker's KV events are subscribed to (index/events/), a leaving
  worker's entries dropped, and only healthy workers are asked to tokenize.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from index.api import EngineWorker, PromptInput, PromptKeys
from index.config import IndexConfig
from index.events import Discovery, EndpointCheck, Subscriber, Subscriptions
from index.keys import PromptKeyer
from index.metrics import IndexMetrics
from index.table import ApproxIndex, EventIndex, new_table
from index.types import BlockKey, PrefixMatch, SlotStats, WorkerId, WorkerKey

log = logging.getLogger(__name__)


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
    ) -> None:
        """``endpoint_allowed``: whether a KV-event endpoint a worker declares on another host
        than its own may be subscribed to (the router's allowlist; none: never)."""
        self.config = config
        self.metrics = IndexMetrics(registry)
        kind = config.table_kind()
        self.events = EventIndex(config.max_entries, new_table(kind))
        self.approx = ApproxIndex(
            config.approx_ttl_s, config.approx_worker_capacity, clock, new_table(kind)
        )
        self._workers: dict[WorkerId, EngineWorker] = {}
        discovery = Discovery(
            http, timeout_s=config.discovery_timeout_s, endpoint_allowed=endpoint_allowed
        )
        self._subscriptions = Subscriptions(
            config, self.events, self.metrics, discovery, on_discovered=self.approx.remove_worker
        )
        self._keyer = PromptKeyer(
            config, self.metrics, http, lambda: list(self._workers.values()), reach=self._reach
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
        self._subscriptions.join(worker)

    def worker_removed(self, worker: WorkerId) -> None:
        """Stop the worker's event tasks and drop everything known of it, at once."""
        if self._workers.pop(worker, None) is None:
            return
        try:
            self._subscriptions.leave(worker)
        finally:
            self.approx.remove_worker(worker)
            self.metrics.resets.labels(worker, "removed").inc()

    def worker_health_changed(self, worker: EngineWorker) -> None:
        """Health (asked before ``/tokenize``) and models: a worker whose one model turns out
        to have another block size than its events were checked against joins again."""
        known = self._workers.get(worker.id)
        if known is None:
            return
        self._workers[worker.id] = worker
        if self.config.block_size_for(worker.model) != self.config.block_size_for(known.model):
            self._subscriptions.join(worker)

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
        return self.config.block_size_for(model)

    async def keys_for(self, model: str, prompt: PromptInput) -> PromptKeys:
        return await self._keyer.keys_for(model, prompt)

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
