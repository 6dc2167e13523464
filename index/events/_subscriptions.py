"""Every worker's KV-event subscriptions: joined when the worker joins, left when it leaves.

A worker's endpoints are the configured ones (one per data-parallel rank), or, for a vLLM
worker without any, what it declares at ``GET /kv_event_sources`` (asked once when it joins;
asked again with backoff while it cannot be reached); a worker with neither is indexed in
approximate mode. Each endpoint has one ``Subscriber`` feeding one ``EventFeed``, run by a
supervisor that restarts it with backoff whatever ends it (its worker's entries are cleared
meanwhile). Leaving is immediate (tasks cancelled, entries dropped) and always completes; the
cancelled tasks are awaited in the background (``settled``, ``stop``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq.asyncio

from kvgate.index.api import Endpoints, EngineWorker
from kvgate.index.config import IndexConfig
from kvgate.index.errors import DiscoveryError, DiscoveryUnreachable
from kvgate.index.events._feed import EventFeed
from kvgate.index.events._sources import Discovery
from kvgate.index.events._subscriber import Subscriber
from kvgate.index.metrics import IndexMetrics
from kvgate.index.table import EventIndex
from kvgate.index.types import WorkerId

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Joined:
    """One worker's subscriptions and the tasks that keep them."""

    worker: EngineWorker
    subscribers: list[Subscriber] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class Subscriptions:
    """The event side of the fleet: per worker, its subscribers and their supervisors."""

    def __init__(
        self,
        config: IndexConfig,
        index: EventIndex,
        metrics: IndexMetrics,
        discovery: Discovery,
        *,
        on_discovered: Callable[[WorkerId], None],
        on_block_size: Callable[[WorkerId, int], None] | None = None,
    ) -> None:
        """``on_discovered``: a worker that was in approximate mode publishes after all;
        ``on_block_size``: a worker's events carry another block size than expected."""
        self._config = config
        self._index = index
        self._metrics = metrics
        self._discovery = discovery
        self._on_discovered = on_discovered
        self._on_block_size = on_block_size
        self._joined: dict[WorkerId, _Joined] = {}
        # the data-parallel ranks of each worker with several (one endpoint each), in order
        self._ranked: dict[WorkerId, tuple[int, ...]] = {}
        self._pending: set[asyncio.Task[None]] = set()  # first discoveries and reapers
        self._context: zmq.asyncio.Context | None = None

    def start(self) -> None:
        if self._context is None:
            self._context = zmq.asyncio.Context()

    async def stop(self) -> None:
        try:
            for worker in list(self._joined):
                self.leave(worker)
            await self.settled()
        finally:
            if self._context is not None:
                self._context.term()
                self._context = None

    async def settled(self) -> None:
        """Until every first discovery started and every task of a worker that left is done."""
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    # ------------------------------------------------------------------ joining
    def join(self, worker: EngineWorker) -> None:
        """Subscribe to a worker's configured endpoints, or discover them (vLLM)."""
        if worker.id in self._joined:
            self.leave(worker.id)
        joined = self._joined[worker.id] = _Joined(worker)
        if worker.endpoints:
            for endpoints in worker.endpoints:
                self._subscribe(joined, endpoints)
        elif worker.engine == "vllm":
            joined.tasks.append(self._background(self._discover(joined), f"discover {worker.url}"))

    async def _discover(self, joined: _Joined) -> None:
        """Ask once; while the worker cannot be reached, ask again with backoff."""
        worker = joined.worker
        try:
            endpoints = await self._discovery.discover(worker)
        except DiscoveryUnreachable as error:
            log.info("%s: %s: approximate mode until it answers", worker.id, error)
            if self._joined.get(worker.id) is joined:  # it may have left meanwhile
                task = asyncio.create_task(self._rediscover(joined), name=f"discover {worker.url}")
                task.add_done_callback(_log_failure)
                joined.tasks.append(task)
        except DiscoveryError as error:
            log.info("%s: no KV events (%s): approximate mode", worker.id, error)
        else:
            self._subscribe_all(joined, endpoints)

    async def _rediscover(self, joined: _Joined) -> None:
        delay = self._config.reconnect_backoff_s
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._config.reconnect_backoff_max_s)
            try:
                endpoints = await self._discovery.discover(joined.worker)
            except DiscoveryUnreachable:
                continue
            except DiscoveryError as error:
                log.info("%s: no KV events (%s): approximate mode", joined.worker.id, error)
                return
            except Exception:  # the loop's supervisor: this ask is lost, asked again later
                log.exception("%s: discovering its KV events failed", joined.worker.id)
                continue
            log.info("%s: KV events discovered: leaving approximate mode", joined.worker.id)
            self._on_discovered(joined.worker.id)
            self._subscribe_all(joined, endpoints)
            return

    def _subscribe_all(self, joined: _Joined, endpoints: list[Endpoints]) -> None:
        if self._joined.get(joined.worker.id) is joined:  # it may have left meanwhile
            for each in endpoints:
                self._subscribe(joined, each)

    def _subscribe(self, joined: _Joined, endpoints: Endpoints) -> None:
        if self._context is None:
            raise RuntimeError("KvIndexService.start() must be awaited first")
        worker = joined.worker
        feed = EventFeed(
            worker.id,
            endpoints.dp_rank,
            self._index,
            self._config,
            block_size=self.block_size_of(worker),
            metrics=self._metrics,
            on_block_size=self._on_block_size,
        )
        self._metrics.declare_feed(worker.id)
        subscriber = Subscriber(feed, endpoints, self._config, self._context, self._metrics)
        joined.subscribers.append(subscriber)
        ranks = tuple(sorted({s.endpoints.dp_rank for s in joined.subscribers}))
        if len(ranks) > 1:
            self._ranked[worker.id] = ranks
        task = asyncio.create_task(
            self._supervise(worker.id, subscriber), name=f"kv-events {worker.id} {endpoints}"
        )
        task.add_done_callback(_log_failure)
        joined.tasks.append(task)

    async def _supervise(self, worker: WorkerId, subscriber: Subscriber) -> None:
        """Keep a subscriber running: whatever ends its task, its worker's entries are cleared
        and it starts over after a backoff (``reconnect_backoff_s`` doubling up to
        ``reconnect_backoff_max_s``, back to the start once it ran that long)."""
        loop = asyncio.get_running_loop()
        delay = self._config.reconnect_backoff_s
        while True:
            started = loop.time()
            try:
                await subscriber.run()
                reason: BaseException = RuntimeError("the subscriber returned")
            except Exception as error:  # noqa: BLE001 - the supervisor: logged, counted, restarted
                reason = error
            subscriber.forget("subscriber_failed")
            self._metrics.subscriber_restarts.labels(worker).inc()
            log.error(
                "%s: event subscriber of %s failed; entries cleared, restarting in %.1f s",
                worker,
                subscriber.endpoints.events,
                delay,
                exc_info=reason,
            )
            if loop.time() - started >= self._config.reconnect_backoff_max_s:
                delay = self._config.reconnect_backoff_s
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._config.reconnect_backoff_max_s)

    def resync(self, worker: WorkerId, *, replay: bool) -> bool:
        """Drop a worker's event entries and subscribe to it again: as it joined (``replay``:
        its configured or rediscovered endpoints, replay included), or to the endpoints it is
        subscribed to now without replay (it learns from live events only, until its next
        resync with replay). False when it is not subscribed to (unknown, approximate mode,
        still being discovered) and nothing was done."""
        joined = self._joined.get(worker)
        if joined is None or not joined.subscribers:
            return False
        if replay:
            self.join(joined.worker)
            return True
        endpoints = [replace(s.endpoints, replay=None) for s in joined.subscribers]
        self.leave(worker)
        again = self._joined[worker] = _Joined(joined.worker)  # as it joined, for later resyncs
        for each in endpoints:
            self._subscribe(again, each)
        return True

    # ------------------------------------------------------------------ leaving
    def leave(self, worker: WorkerId) -> None:
        """Stop a worker's subscriptions and drop its event entries, at once."""
        joined = self._joined.pop(worker, None)
        self._ranked.pop(worker, None)
        if joined is None:
            return
        for task in joined.tasks:
            task.cancel()
        for subscriber in joined.subscribers:
            subscriber.feed.close()
        self._index.remove_worker(worker)
        if joined.tasks:
            self._background(_reap(worker, joined.tasks), f"leave {worker}")

    def _background(self, work: Any, name: str) -> asyncio.Task[None]:
        """A task ``settled`` waits for."""
        task: asyncio.Task[None] = asyncio.create_task(work, name=name)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        task.add_done_callback(_log_failure)
        return task

    # ------------------------------------------------------------------ reading
    def block_size_of(self, worker: EngineWorker) -> int:
        """The block size a worker's events are read with: what its engine declares, else
        its model's configured one (or the default)."""
        if worker.block_size is not None:
            return worker.block_size
        return self._config.block_size_for(worker.model)

    def has_events(self, worker: WorkerId) -> bool:
        joined = self._joined.get(worker)
        return joined is not None and bool(joined.subscribers)

    @property
    def ranked(self) -> dict[WorkerId, tuple[int, ...]]:
        """The workers publishing for several data-parallel ranks: their ranks, in order."""
        return self._ranked

    def subscriber(self, worker: WorkerId, dp_rank: int) -> Subscriber:
        joined = self._joined.get(worker)
        if joined is not None:
            for subscriber in joined.subscribers:
                if subscriber.endpoints.dp_rank == dp_rank:
                    return subscriber
        raise KeyError(f"{worker} rank {dp_rank} has no event subscriber")

    def describe(self, worker: WorkerId) -> list[dict[str, Any]]:
        joined = self._joined.get(worker)
        return [
            {
                "events": s.endpoints.events,
                "replay": s.endpoints.replay,
                "dp_rank": s.endpoints.dp_rank,
                "connected": s.connected,
                "applied_seq": s.applied_seq,
                "history_complete": s.history_complete,
                "mapped_blocks": s.feed.mapped_blocks(),
            }
            for s in (joined.subscribers if joined is not None else [])
        ]


async def _reap(worker: WorkerId, tasks: list[asyncio.Task[None]]) -> None:
    """The cancelled tasks of a worker that left, awaited: a failure among them is logged."""
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for task, outcome in zip(tasks, outcomes, strict=True):
        if isinstance(outcome, Exception):
            log.error("%s: task %s had failed", worker, task.get_name(), exc_info=outcome)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("event task %s stopped", task.get_name(), exc_info=task.exception())
