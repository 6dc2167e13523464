"""One event endpoint's batches applied to the index: decoding, translation and counting."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from index.api import Indexer
from index.config import IndexConfig
from index.events._translate import Outcome, Translator
from index.events._wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    EventDecoder,
)
from index.metrics import IndexMetrics
from index.table._protocol import native_available
from index.types import WorkerId, WorkerKey

if TYPE_CHECKING:
    from index.events._native_ingest import NativeCounts, NativeIngest

log = logging.getLogger(__name__)


def _event_type(event: object) -> str:
    if isinstance(event, BlockStored):
        return "BlockStored"
    if isinstance(event, BlockRemoved):
        return "BlockRemoved"
    return "AllBlocksCleared" if isinstance(event, AllBlocksCleared) else "other"


class BatchStatus(enum.Enum):
    APPLIED = "applied"
    UNDECODABLE = "undecodable"
    UNKNOWN_PARENT = "unknown_parent"
    FAILED = "failed"  # raised while applied: what it did is unknown (the worker is cleared)
    DROPPED = "dropped"  # past a bound before anything was applied (a rank too many)


@dataclass(frozen=True, slots=True)
class BatchResult:
    status: BatchStatus
    events: int = 0


class EventFeed:
    """Applies one worker endpoint's event batches (one translator per data-parallel rank).

    Payloads in the common shape go through the native batch ingestion when the core is built
    (``native=False`` turns it off); the rest through decode → translate → index here. A
    payload costs at most itself: whatever it raises, it is counted and reported ``FAILED``
    (the subscriber clears the worker), and the bounds of ``IndexConfig`` hold (ranks, blocks
    per event, mapped hashes)."""

    def __init__(
        self,
        worker: WorkerId,
        dp_rank: int,
        index: Indexer,
        config: IndexConfig,
        *,
        block_size: int,
        metrics: IndexMetrics,
        clock: Callable[[], float] = time.time,
        native: bool = True,
    ) -> None:
        self.worker = worker
        self.dp_rank = dp_rank
        self._index = index
        self._config = config
        self._block_size = block_size
        self._metrics = metrics
        self._clock = clock
        self._decoder = EventDecoder()
        self._translators: dict[int, Translator] = {}
        self._last_error_log = -1e18
        self._errors_since_log = 0
        self._blocks_stored = metrics.blocks_stored.labels(worker)
        self._skipped_pruned = metrics.skipped_events.labels(worker, "pruned_parent")
        self._events_by_type = {
            name: metrics.events.labels(worker, name)
            for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "other")
        }
        self._native = (
            self._native_path(index, config, WorkerKey(worker, dp_rank), block_size)
            if native
            else None
        )
        self.translator(dp_rank)  # its own rank first: never refused by the rank bound

    @staticmethod
    def _native_path(
        index: Indexer, config: IndexConfig, worker: WorkerKey, block_size: int
    ) -> NativeIngest | None:
        if not native_available():
            return None
        from index.events._native_ingest import NativeIngest  # noqa: PLC0415 - needs the built core

        return NativeIngest.create(index, config, worker, block_size)

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
        try:
            return self._apply_payload(payload)
        except Exception as error:  # noqa: BLE001 - one batch's boundary: counted, logged, FAILED
            self._metrics.failed_batches.labels(self.worker).inc()
            self._log_skip(error, traceback=True)
            return BatchResult(BatchStatus.FAILED)

    def _apply_payload(self, payload: bytes) -> BatchResult:
        if self._native is not None:
            counts = self._native.ingest(payload, self.translator(self.dp_rank))
            if counts is not None:
                return self._applied_natively(counts)
        try:
            batch = self._decoder.decode(payload)
        except EventDecodeError as error:
            self._decode_error(error)
            return BatchResult(BatchStatus.UNDECODABLE)
        return self.apply_batch(batch)

    def apply_batch(self, batch: EventBatch) -> BatchResult:
        rank = self.dp_rank if batch.data_parallel_rank is None else batch.data_parallel_rank
        if rank not in self._translators and (
            len(self._translators) >= self._config.max_ranks_per_endpoint
        ):
            self._metrics.limits.labels(self.worker, "ranks").inc()
            return BatchResult(BatchStatus.DROPPED)
        translator = self.translator(rank)
        worker = self.worker
        status = BatchStatus.APPLIED
        metrics = self._metrics
        for event in batch.events:
            result = translator.apply(event)
            outcome = result.outcome
            if outcome is Outcome.APPLIED:
                if isinstance(event, BlockStored):
                    self._blocks_stored.inc(result.blocks)
            elif outcome is Outcome.UNKNOWN_PARENT:
                status = BatchStatus.UNKNOWN_PARENT
            elif outcome is Outcome.PARENT_PRUNED:
                self._skipped_pruned.inc()
            elif outcome is Outcome.OVER_LIMIT:
                self._over_limit(translator, "event_blocks")
                continue
            elif outcome is Outcome.BLOCK_SIZE_MISMATCH:
                metrics.block_size_mismatch.labels(worker).inc()
                continue
            elif outcome is Outcome.MALFORMED:
                self._malformed()
                continue
            elif outcome is Outcome.CLEARED:
                metrics.resets.labels(worker, "all_blocks_cleared").inc()
            self._events_by_type[_event_type(event)].inc()
        return self._batch_done(translator, batch.ts, status, len(batch.events))

    def _batch_done(
        self, translator: Translator, ts: float, status: BatchStatus, events: int
    ) -> BatchResult:
        """What ends every applied batch, on either path: the map's bounds and the lag."""
        if not translator.shrink():
            self._over_limit(translator, "mapped_hashes")
        if len(translator) > self._config.max_entries:
            log.warning("%s: more mapped blocks than max_entries; clearing", translator.worker)
            self.reset("overflow")
        self._metrics.ingest_lag.observe(max(0.0, self._clock() - ts))
        return BatchResult(status, events)

    def _over_limit(self, translator: Translator, limit: str) -> None:
        """A publisher went past a bound: its domain is cleared and the bound counted."""
        translator.clear()
        self._metrics.limits.labels(self.worker, limit).inc()
        self._metrics.resets.labels(self.worker, "limit").inc()
        self._log_skip(EventDecodeError(f"past the {limit} bound: domain cleared"))

    def _malformed(self) -> None:
        self._decode_error(EventDecodeError("token_ids do not fill block_hashes"))

    def _applied_natively(self, counts: NativeCounts) -> BatchResult:
        """The metrics and checks of ``apply_batch`` for a payload the native path applied."""
        translator = self.translator(self.dp_rank)
        unknown, pruned = counts.unknown_parent, counts.pruned_parent
        if translator.trimmed:  # as Translator._stored: an unknown parent may be a pruned one
            unknown, pruned = 0, pruned + unknown
        seen = counts.stored_events + unknown + pruned  # all count as BlockStored seen
        if seen:
            self._events_by_type["BlockStored"].inc(seen)
            self._blocks_stored.inc(counts.stored_blocks)
        if pruned:
            self._skipped_pruned.inc(pruned)
        if counts.removed_events:
            self._events_by_type["BlockRemoved"].inc(counts.removed_events)
        for _ in range(counts.malformed):
            self._malformed()
        status = BatchStatus.UNKNOWN_PARENT if unknown else BatchStatus.APPLIED
        return self._batch_done(translator, counts.ts, status, counts.events)

    def reset(self, reason: str, *, restarted: bool = False) -> None:
        """Drop everything known about this endpoint's cache domains."""
        for translator in self._translators.values():
            translator.clear(restarted=restarted)
        self._metrics.resets.labels(self.worker, reason).inc()

    def close(self) -> None:
        for translator in self._translators.values():
            translator.clear()
        self._translators.clear()

    def malformed(self, reason: str) -> None:
        """A frame that is not ``[topic, seq, payload]``: counted like an undecodable payload."""
        self._decode_error(EventDecodeError(reason))

    def _decode_error(self, error: Exception) -> None:
        self._metrics.decode_errors.labels(self.worker).inc()
        self._log_skip(error)

    def _log_skip(self, error: Exception, *, traceback: bool = False) -> None:
        """At most one log line per interval for payloads kvgate could not use (a failure with
        its traceback: a bug, or a crafted input worth looking at)."""
        self._errors_since_log += 1
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
