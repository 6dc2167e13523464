"""Keeping the index's picture of a worker from outliving the worker's cache.

The KV-event stream tells kvgate about every block an engine stores or evicts, and its
subscriber clears a worker on a seq gap it cannot replay, on a restart (seq going back) and
on a dropped connection. Two cases it does not see in time, watched here:

* **A worker marked down** (refused or reset connections, failed probes) may have crashed
  and may come back empty while its event connection survived (a supervisor restarting the
  engine process behind the same sockets); seq going back shows that only at the new
  engine's first batch, after requests were already routed on the old picture. So when a
  worker goes down, its index entries are dropped and its subscription starts over
  (``resync``): it rejoins with what the engine's replay ring holds, the blocks it still has
  after a blip, or its new history after a restart.
* **A worker whose events stopped while it keeps serving** (a wedged publisher: batches lost
  without a seq gap, so no replay is asked for): blocks it evicts stay in the index as
  phantom hits. Requests that made it compute new full blocks (engine usage: prompt tokens
  beyond the cached ones) must be followed by events; when at least ``silent_requests`` such
  requests, sent after the worker's last event batch, finished over ``silence_s`` seconds and
  still no batch arrived, its entries are dropped and it is subscribed again *without*
  replay: the replay ring would bring back the history the silence made stale. It then
  learns from live events only, until its next resync after it goes down.

Only single-source workers are watched for silence (one data-parallel rank: requests to a
multi-rank engine go to one rank, whose silence another rank's batches would hide).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from kvgate.backends.registry import Worker
from kvgate.index.api import EngineWorker
from kvgate.index.types import WorkerId
from kvgate.router.config import IndexWatchConfig
from kvgate.router.usage import Usage

log = logging.getLogger("kvgate.index_watch")

Resync = Callable[[WorkerId, bool], bool]
"""Drop a worker's entries and subscribe again (``True``: with replay); False when it has no
event subscription (``index.service.KvIndexService.resync``)."""
EventProgress = Callable[[WorkerId], int | None]
"""The seq of the last event batch applied for a worker (None before the first);
``LookupError`` when it has not exactly one connected event source (nothing to watch)."""


RESYNC_REASONS = ("worker_down", "events_silent")


class IndexWatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.resyncs = Counter(
            "kvgate_index_resyncs",
            "Workers whose index entries were dropped and subscription started over, by "
            "worker and reason (worker_down, events_silent)",
            ["worker", "reason"],
            registry=registry,
        )


@dataclass(slots=True)
class _Silence:
    """What the watch knows of one worker's event progress."""

    seq: int | None  # the last applied batch seen
    since: float  # when it was first seen
    silent: int = 0  # requests sent after it that stored blocks, finished, no batch since
    first_silent_at: float = 0.0  # when the first of them was sent
    fired: bool = False  # resubscribed for this silence; waiting for a batch


class IndexWatch:
    """Resyncs a worker's index entries when it goes down or its events fall silent; a
    ``WorkerListener`` of the registry (subscribed after the index, so it resyncs workers the
    index already follows)."""

    def __init__(
        self,
        config: IndexWatchConfig,
        progress: EventProgress,
        resync: Resync,
        metrics: IndexWatchMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._progress = progress
        self._resync_index = resync
        self._metrics = metrics
        self._clock = clock
        self._silences: dict[WorkerId, _Silence] = {}

    # -- the registry's changes (WorkerListener) ----------------------------------------
    def worker_added(self, worker: EngineWorker) -> None:
        self._silences.pop(worker.id, None)
        for reason in RESYNC_REASONS:  # its series at zero from the start
            self._metrics.resyncs.labels(worker.url, reason)

    def worker_removed(self, worker: WorkerId) -> None:
        self._silences.pop(worker, None)

    def worker_health_changed(self, worker: EngineWorker) -> None:
        """A worker that went down is resynced (with replay)."""
        if not worker.healthy and self._config.resync_on_down:
            self._resync(worker.id, worker.url, "worker_down", replay=True)

    # -- the proxy's answers ------------------------------------------------------------

    def on_served(self, worker: Worker, usage: Usage, block_size: int, sent_at: float) -> None:
        """A proxy listener: a request answered by ``worker`` with engine usage."""
        if self._config.silence_s <= 0:
            return
        try:
            seq = self._progress(worker.id)
        except LookupError:
            self._silences.pop(worker.id, None)
            return
        state = self._silences.get(worker.id)
        now = self._clock()
        if state is None or (seq is not None and seq != state.seq):
            self._silences[worker.id] = _Silence(seq, now)  # a batch arrived: not silent
            return
        if state.fired or sent_at < state.since or not _stored_blocks(usage, block_size):
            return
        if state.silent == 0:
            state.first_silent_at = sent_at
        state.silent += 1
        silent_for = now - state.first_silent_at
        if state.silent >= self._config.silent_requests and silent_for >= self._config.silence_s:
            state.fired = True  # until a batch other than the last one seen arrives
            log.warning(
                "%s: %d requests stored blocks over %.1f s and no KV event arrived: "
                "dropping its entries, learning from live events only",
                worker.url,
                state.silent,
                silent_for,
            )
            self._resync(worker.id, worker.url, "events_silent", replay=False)

    # -- resyncs ------------------------------------------------------------------------
    def _resync(self, worker: WorkerId, url: str, reason: str, *, replay: bool) -> None:
        if self._resync_index(worker, replay):
            self._metrics.resyncs.labels(url, reason).inc()


def _stored_blocks(usage: Usage, block_size: int) -> bool:
    """Did the engine compute at least one new full prompt block (so it sent events)?"""
    if usage.prompt_tokens is None or usage.cached_tokens is None or block_size <= 0:
        return False
    return usage.prompt_tokens // block_size > usage.cached_tokens // block_size
