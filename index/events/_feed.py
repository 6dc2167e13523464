"""One event endpoint's payloads into the index: the one door of event ingestion.

``EventFeed.apply_payload`` takes a raw payload as it came off the socket and returns what it
did (a ``BatchResult``). A payload in the shape engines send nearly always (GPU-tier stores and
removals for the endpoint's own rank and block size, no LoRA or salt) goes through the native
path: parsed, keyed and applied in C in one call, the table's cap kept as it goes. Anything
else is decoded and applied event by event (one ``Translator`` per data-parallel rank). Both
give the same result and the same index (tests/test_native_ingest.py), and both are counted
into the metrics the same way, here.

A payload costs at most itself: whatever it raises, it is counted and reported ``failed``
(the subscriber clears the worker), and the bounds of ``IndexConfig`` hold (ranks, blocks per
event, mapped hashes).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from kvgate.index.api import BatchResult
from kvgate.index.config import IndexConfig
from kvgate.index.errors import EventDecodeError
from kvgate.index.events._translate import Translator
from kvgate.index.events._wire import EventBatch, EventDecoder
from kvgate.index.metrics import IndexMetrics
from kvgate.index.table import EventIndex
from kvgate.index.types import Tier, WorkerId, WorkerKey

log = logging.getLogger(__name__)

_EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "other")


class EventFeed:
    """Applies one worker endpoint's payloads (``native=False`` keeps them off the native path,
    for tests and comparisons)."""

    def __init__(
        self,
        worker: WorkerId,
        dp_rank: int,
        index: EventIndex,
        config: IndexConfig,
        *,
        block_size: int,
        metrics: IndexMetrics,
        clock: Callable[[], float] = time.time,
        native: bool = True,
        on_block_size: Callable[[WorkerId, int], None] | None = None,
    ) -> None:
        """``on_block_size``: told the block size of events that do not have the expected
        one (once per mismatch: the translator then stops reading them until a restart)."""
        self.worker = worker
        self.dp_rank = dp_rank
        self._index = index
        self._config = config
        self._block_size = block_size
        self._metrics = metrics
        self._clock = clock
        self._on_block_size = on_block_size
        self._native = native and config.tier_of("GPU") == Tier.GPU  # what the C side assumes
        self._decoder = EventDecoder()
        self._translators: dict[int, Translator] = {}
        self._last_error_log = -1e18
        self._errors_since_log = 0
        self._blocks_stored = metrics.blocks_stored.labels(worker)
        self._skipped_pruned = metrics.skipped_events.labels(worker, "pruned_parent")
        self._events_by_type = {name: metrics.events.labels(worker, name) for name in _EVENT_TYPES}
        self.translator(dp_rank)  # its own rank first: never refused by the rank bound

    def ranks(self) -> list[WorkerKey]:
        return [t.worker for t in self._translators.values()]

    def translator(self, rank: int) -> Translator:
        translator = self._translators.get(rank)
        if translator is None:
            key = WorkerKey(self.worker, rank)
            translator = Translator(key, self._index, self._config, self._block_size)
            self._translators[rank] = translator
        return translator

    def mapped_blocks(self) -> int:
        return sum(len(t) for t in self._translators.values())

    def apply_payload(self, payload: bytes) -> BatchResult:
        """Apply one payload (natively when its shape allows), counted in the metrics."""
        try:
            return self._apply_payload(payload)
        except Exception as error:  # noqa: BLE001 - one batch's boundary: counted, logged, failed
            self._metrics.failed_batches.labels(self.worker).inc()
            self._log_skip(error, traceback=True)
            return BatchResult(refused="failed")

    def _apply_payload(self, payload: bytes) -> BatchResult:
        translator = self.translator(self.dp_rank)
        result = translator.ingest(payload) if self._native else None
        if result is None:
            try:
                batch = self._decoder.decode(payload)
            except EventDecodeError as error:
                self._decode_errors(error)
                return BatchResult(refused="undecodable")
            rank = self.dp_rank if batch.data_parallel_rank is None else batch.data_parallel_rank
            if rank not in self._translators and (
                len(self._translators) >= self._config.max_ranks_per_endpoint
            ):
                self._metrics.limits.labels(self.worker, "ranks").inc()
                return BatchResult(refused="dropped")
            translator = self.translator(rank)
            result = self._apply_batch(translator, batch)
        self._count(result)
        self._batch_done(translator, result.ts)
        seen = translator.seen_block_size
        if seen is not None and self._on_block_size is not None:
            translator.seen_block_size = None
            self._on_block_size(self.worker, seen)
        return result

    def _apply_batch(self, translator: Translator, batch: EventBatch) -> BatchResult:
        pruned = self._index.pruned
        result = BatchResult(ts=batch.ts, events=len(batch.events))
        for event in batch.events:
            translator.apply(event, result)
        result.pruned = self._index.pruned - pruned
        return result

    def _count(self, result: BatchResult) -> None:
        """The metrics of an applied payload, whichever path applied it."""
        metrics, worker = self._metrics, self.worker
        seen = result.stored_events + result.unknown_parent + result.pruned_parent
        if seen:
            self._events_by_type["BlockStored"].inc(seen)
        if result.stored_blocks:
            self._blocks_stored.inc(result.stored_blocks)
        if result.pruned_parent:
            self._skipped_pruned.inc(result.pruned_parent)
        if result.removed_events:
            self._events_by_type["BlockRemoved"].inc(result.removed_events)
        if result.cleared:
            self._events_by_type["AllBlocksCleared"].inc(result.cleared)
            metrics.resets.labels(worker, "all_blocks_cleared").inc(result.cleared)
        if result.mismatched:
            metrics.block_size_mismatch.labels(worker).inc(result.mismatched)
        if result.over_limit:
            self._past_bound("event_blocks", result.over_limit)
        if result.malformed:
            error = EventDecodeError("token_ids do not fill block_hashes")
            self._decode_errors(error, result.malformed)

    def _batch_done(self, translator: Translator, ts: float) -> None:
        """What ends every applied batch, on either path: the map's bounds and the lag."""
        if not translator.shrink():
            translator.clear()
            self._past_bound("mapped_hashes")
        if len(translator) > self._config.max_entries:
            log.warning("%s: more mapped blocks than max_entries; clearing", translator.worker)
            self.reset("overflow")
        self._metrics.ingest_lag.observe(max(0.0, self._clock() - ts))

    def _past_bound(self, limit: str, times: int = 1) -> None:
        """A publisher went past a bound (its domain was cleared): counted and logged."""
        self._metrics.limits.labels(self.worker, limit).inc(times)
        self._metrics.resets.labels(self.worker, "limit").inc(times)
        self._log_skip(EventDecodeError(f"past the {limit} bound: domain cleared"), times)

    def reset(self, reason: str, *, restarted: bool = False) -> None:
        """Drop everything known about this endpoint's cache domains."""
        for translator in self._translators.values():
            translator.clear(restarted=restarted)
        self._metrics.resets.labels(self.worker, reason).inc()

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """The worker matches nothing meanwhile (``EventIndex.hide``): a join replay."""
        self._index.hide(self.worker)
        try:
            yield
        finally:
            self._index.unhide(self.worker)

    def close(self) -> None:
        for translator in self._translators.values():
            translator.clear()
        self._translators.clear()

    def malformed(self, reason: str) -> None:
        """A frame that is not ``[topic, seq, payload]``: counted like an undecodable payload."""
        self._decode_errors(EventDecodeError(reason))

    def _decode_errors(self, error: Exception, times: int = 1) -> None:
        self._metrics.decode_errors.labels(self.worker).inc(times)
        self._log_skip(error, times)

    def _log_skip(self, error: Exception, times: int = 1, *, traceback: bool = False) -> None:
        """At most one log line per interval for payloads kvgate could not use (a failure with
        its traceback: a bug, or a crafted input worth looking at)."""
        self._errors_since_log += times
        now = self._clock()
        if now - self._last_error_log >= self._config.decode_error_log_interval_s:
            log.warning(
                "%s: %d event payload(s) not used since the last report; the last: %s: %s",
                self.worker,
                self._errors_since_log,
                type(error).__name__,
                error,
                exc_info=error if traceback else None,
            )
            self._last_error_log = now
            self._errors_since_log = 0
