"""``KvIndexService``: the index layer as the gateway sees it (``index.api.BlockIndex``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Histogram

from index.api import PromptInput, PromptKeys, TokenizeMode
from index.blocks import block_keys, text_block_keys
from index.config import IndexConfig
from index.indexers import ApproxIndex, EventIndex
from index.ingest import EventFeed
from index.metrics import IndexMetrics
from index.sources import DiscoveryError, DiscoveryUnreachable, discover
from index.subscriber import Endpoints, Subscriber
from index.table import SlotStats
from index.tables import new_table
from index.tokenize import ModelTokenizer, TokenizeError, plain_render, prompt_seed
from index.types import BlockKey, PrefixMatch, WorkerId, WorkerKey

log = logging.getLogger(__name__)
_TEXT_OR_NONE = (str, type(None))
_MAX_CACHED_LABELS = 4096  # labelled metric children kept at hand (models x modes)
_MAX_CACHED_SEEDS = 4096  # (LoRA name, cache salt) -> chain seed


@dataclass(slots=True)
class _Worker:
    url: str
    engine: str
    model: str | None
    subscribers: list[Subscriber] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return "events" if self.subscribers else "approx"


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
    ) -> None:
        self.config = config
        self._http = http
        self.metrics = IndexMetrics(registry)
        kind = config.table_kind()
        self.events = EventIndex(config.max_entries, new_table(kind))
        self.approx = ApproxIndex(
            config.approx_ttl_s, config.approx_worker_capacity, clock, new_table(kind)
        )
        self._workers: dict[WorkerId, _Worker] = {}
        self._tokenizers: dict[str, ModelTokenizer | None] = {}
        self._tokenizer_locks: dict[str, asyncio.Lock] = {}
        self._context: zmq.asyncio.Context | None = None
        self._tokenize_counters: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self._tokenize_cache_counters: dict[tuple[str, bool], Counter] = {}
        self._seeds: dict[tuple[str | None, str | None], int] = {}

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._context is None:
            self._context = zmq.asyncio.Context()
        self.metrics.watch_entries(self._entry_sources)

    async def stop(self) -> None:
        for tokenizer in self._tokenizers.values():
            if tokenizer is not None:
                tokenizer.close()
        for worker in list(self._workers):
            await self.remove_worker(worker)
        self.metrics.close()
        if self._context is not None:
            self._context.term()
            self._context = None

    def _entry_sources(self) -> list[tuple[str, list[SlotStats]]]:
        return [("events", self.events.stats()), ("approx", self.approx.stats())]

    # ----------------------------------------------------------------- workers
    async def add_worker(
        self,
        worker: WorkerId,
        url: str,
        *,
        engine: str,
        events: str | None,
        replay: str | None,
        discover: bool = True,
        model: str | None = None,
        sources: Sequence[Endpoints] = (),
    ) -> None:
        """Register a worker; subscribe to its events (``events``/``replay`` for rank 0, or
        ``sources`` with one entry per data-parallel rank, or discovered from vLLM's
        ``GET /kv_event_sources``), else index it in approximate mode. ``model`` selects the
        block size its events are checked against (default: ``IndexConfig.block_size``)."""
        if worker in self._workers:
            await self.remove_worker(worker)
        state = _Worker(url, engine, model)
        self._workers[worker] = state
        endpoints: list[Endpoints] = list(sources)
        if endpoints:
            pass
        elif events is not None:
            endpoints = [Endpoints(events, replay, 0)]
        elif discover and engine == "vllm":
            try:
                endpoints = await self._discover(url)
            except DiscoveryUnreachable as error:
                log.info("%s: %s: approximate mode until it answers", worker, error)
                task = asyncio.create_task(self._rediscover(worker, state), name=f"discover {url}")
                task.add_done_callback(self._subscriber_done)
                state.tasks.append(task)
            except DiscoveryError as error:
                log.info("%s: no KV events (%s): approximate mode", worker, error)
        for endpoint in endpoints:
            self._subscribe(worker, state, endpoint)

    async def _rediscover(self, worker: WorkerId, state: _Worker) -> None:
        """Ask an unreachable vLLM worker for its event sources again, with backoff."""
        delay = self.config.reconnect_backoff_s
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.config.reconnect_backoff_max_s)
            try:
                endpoints = await self._discover(state.url)
            except DiscoveryUnreachable:
                continue
            except DiscoveryError as error:
                log.info("%s: no KV events (%s): approximate mode", worker, error)
                return
            log.info("%s: KV events discovered: leaving approximate mode", worker)
            self.approx.remove_worker(worker)
            for endpoint in endpoints:
                self._subscribe(worker, state, endpoint)
            return

    async def _discover(self, url: str) -> list[Endpoints]:
        return await discover(self._http, url, timeout_s=self.config.discovery_timeout_s)

    def _subscribe(self, worker: WorkerId, state: _Worker, endpoints: Endpoints) -> None:
        if self._context is None:
            raise RuntimeError("KvIndexService.start() must be awaited first")
        block_size = (
            self.config.block_size
            if state.model is None
            else self.config.block_size_for(state.model)
        )
        feed = EventFeed(
            worker,
            endpoints.dp_rank,
            self.events,
            self.config,
            block_size=block_size,
            metrics=self.metrics,
        )
        subscriber = Subscriber(feed, endpoints, self.config, self._context, self.metrics)
        state.subscribers.append(subscriber)
        task = asyncio.create_task(subscriber.run(), name=f"kv-events {worker} {endpoints}")
        task.add_done_callback(self._subscriber_done)
        state.tasks.append(task)

    @staticmethod
    def _subscriber_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("event subscriber %s stopped", task.get_name(), exc_info=task.exception())

    async def remove_worker(self, worker: WorkerId) -> None:
        state = self._workers.pop(worker, None)
        if state is None:
            return
        for task in state.tasks:
            task.cancel()
        for task in state.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for subscriber in state.subscribers:
            subscriber.feed.close()
        self.events.remove_worker(worker)
        self.approx.remove_worker(worker)
        self.metrics.resets.labels(worker, "removed").inc()

    def workers(self) -> list[WorkerId]:
        return list(self._workers)

    def has_events(self, worker: WorkerId) -> bool:
        state = self._workers.get(worker)
        return state is not None and bool(state.subscribers)

    # --------------------------------------------------------- ingestion waits
    def _subscriber(self, worker: WorkerId, dp_rank: int) -> Subscriber:
        state = self._workers.get(worker)
        if state is not None:
            for subscriber in state.subscribers:
                if subscriber.endpoints.dp_rank == dp_rank:
                    return subscriber
        raise KeyError(f"{worker} rank {dp_rank} has no event subscriber")

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

    async def _tokenizer(self, model: str) -> ModelTokenizer | None:
        if model in self._tokenizers:
            return self._tokenizers[model]
        directory = self.config.tokenizer_dir(model)
        if directory is None:
            self._tokenizers[model] = None
            return None
        lock = self._tokenizer_locks.setdefault(model, asyncio.Lock())
        async with lock:
            if model not in self._tokenizers:
                try:
                    loaded: ModelTokenizer | None = await asyncio.to_thread(
                        ModelTokenizer,
                        directory,
                        self.config.tokenize_cache_tokens,
                        self.config.tokenize_inline_chars,
                    )
                except (OSError, ValueError, TokenizeError) as error:
                    log.error("%s: cannot load tokenizer from %s: %s", model, directory, error)
                    loaded = None
                self._tokenizers[model] = loaded
        return self._tokenizers[model]

    async def keys_for(self, model: str, prompt: PromptInput) -> PromptKeys:
        started = time.perf_counter()
        keys = await self._keys_for(model, prompt)
        counters = self._tokenize_counters.get((model, keys.mode))
        if counters is None:
            if len(self._tokenize_counters) >= _MAX_CACHED_LABELS:
                self._tokenize_counters.clear()
            counters = (
                self.metrics.tokenize.labels(model, keys.mode),
                self.metrics.tokenize_seconds.labels(keys.mode),
            )
            self._tokenize_counters[(model, keys.mode)] = counters
        counters[0].inc()
        counters[1].observe(time.perf_counter() - started)
        return keys

    def _seed(self, prompt: PromptInput) -> int:
        """``prompt_seed(prompt)``, remembered per (LoRA name, cache salt)."""
        domain = (prompt.lora_name, prompt.cache_salt)
        seed = self._seeds.get(domain)
        if seed is None:
            if len(self._seeds) >= _MAX_CACHED_SEEDS:
                self._seeds.clear()
            seed = self._seeds[domain] = prompt_seed(prompt)
        return seed

    def _count_cache(self, model: str, hit: bool) -> None:
        counter = self._tokenize_cache_counters.get((model, hit))
        if counter is None:
            if len(self._tokenize_cache_counters) >= _MAX_CACHED_LABELS:
                self._tokenize_cache_counters.clear()
            counter = self.metrics.tokenize_cache.labels(model, "hit" if hit else "miss")
            self._tokenize_cache_counters[(model, hit)] = counter
        counter.inc()

    async def _keys_for(self, model: str, prompt: PromptInput) -> PromptKeys:
        block_size = self.block_size_for(model)
        seed = self._seed(prompt)
        completion = prompt.kind == "completion"
        if completion and not isinstance(prompt.prompt, _TEXT_OR_NONE):
            given = prompt.prompt
            ids = given if isinstance(given, list) else list(given)
            return self._keys(block_keys(ids, block_size, seed), block_size, len(ids), "token_ids")
        tokenizer = self._tokenizers.get(model)
        if tokenizer is None and model not in self._tokenizers:
            tokenizer = await self._tokenizer(model)
        if tokenizer is not None and (completion or tokenizer.template):
            try:
                text = (prompt.prompt or "") if completion else tokenizer.render(prompt)
                result = await tokenizer.tokenize(
                    str(text),
                    add_special_tokens=completion,
                    block_size=block_size,
                    seed=seed,
                    reach=self._reach,
                )
            except TokenizeError as error:
                log.info("%s: tokenizer failed (%s): approximate keys", model, error)
            else:
                self._count_cache(model, result.cache_hit)
                return self._keys(result.keys, block_size, result.token_count, "tokenizer")
        if self.config.engine_tokenize:
            engine_ids = await self._engine_tokens(model, prompt)
            if engine_ids is not None:
                keys = block_keys(engine_ids, block_size, seed)
                return self._keys(keys, block_size, len(engine_ids), "engine")
        text = plain_render(prompt)
        keys = text_block_keys(text, self.config.approx_chars_per_block, seed)
        return self._keys(keys, block_size, len(text) // 4, "approx")

    @staticmethod
    def _keys(
        keys: Sequence[BlockKey], block_size: int, tokens: int, mode: TokenizeMode
    ) -> PromptKeys:
        return PromptKeys(keys, block_size, tokens, mode)

    async def _engine_tokens(self, model: str, prompt: PromptInput) -> list[int] | None:
        body: dict[str, Any] = {"model": model}
        if prompt.kind == "completion":
            body["prompt"] = prompt.prompt or ""
        else:
            body["messages"] = list(prompt.messages or [])
            body["add_generation_prompt"] = prompt.add_generation_prompt
            if prompt.tools:
                body["tools"] = list(prompt.tools)
            if prompt.chat_template_kwargs:
                body["chat_template_kwargs"] = dict(prompt.chat_template_kwargs)
        for state in self._workers.values():
            if state.engine != "vllm" or (state.model is not None and state.model != model):
                continue
            try:
                response = await self._http.post(
                    state.url.rstrip("/") + "/tokenize",
                    json=body,
                    timeout=self.config.engine_tokenize_timeout_s,
                )
            except httpx.HTTPError as error:
                log.debug("%s: /tokenize failed: %s", state.url, error)
                continue
            if response.status_code != 200:
                continue
            try:
                tokens = response.json().get("tokens")
            except ValueError:
                continue
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return tokens
        return None

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
        state = self._workers.get(worker)
        if keys and (state is None or not state.subscribers):
            self.approx.record(WorkerKey(worker, 0), keys)

    # ----------------------------------------------------------------- debug
    def stats(self) -> dict[str, Any]:
        return {
            "entries": {"events": self.events.entry_count(), "approx": self.approx.entry_count()},
            "blocks": self.events.block_count(),
            "pruned": self.events.pruned,
            "workers": {
                worker: {
                    "url": state.url,
                    "engine": state.engine,
                    "mode": state.mode,
                    "subscribers": [
                        {
                            "events": s.endpoints.events,
                            "replay": s.endpoints.replay,
                            "dp_rank": s.endpoints.dp_rank,
                            "connected": s.connected,
                            "applied_seq": s.applied_seq,
                            "history_complete": s.history_complete,
                            "mapped_blocks": s.feed.mapped_blocks(),
                        }
                        for s in state.subscribers
                    ],
                }
                for worker, state in self._workers.items()
            },
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
                for model, t in self._tokenizers.items()
            },
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
