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
from index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    EventDecoder,
)
from index.metrics import IndexMetrics
from index.tables import native_available
from index.translate import Outcome, Translator
from index.types import WorkerId, WorkerKey

if TYPE_CHECKING:
    from index.native_ingest import NativeCounts, NativeIngest

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


@dataclass(frozen=True, slots=True)
class BatchResult:
    status: BatchStatus
    events: int = 0


class EventFeed:
    """Applies one worker endpoint's event batches (one translator per data-parallel rank).

    Payloads in the common shape go through the native batch ingestion when the core is built
    (``native=False`` turns it off); the rest through decode → translate → index here."""

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
        self._events_by_type = {
            name: metrics.events.labels(worker, name)
            for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "other")
        }
        self._native = (
            self._native_path(index, config, WorkerKey(worker, dp_rank), block_size)
            if native
            else None
        )

    @staticmethod
    def _native_path(
        index: Indexer, config: IndexConfig, worker: WorkerKey, block_size: int
    ) -> NativeIngest | None:
        if not native_available():
            return None
        from index.native_ingest import NativeIngest  # noqa: PLC0415 - needs the built core

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
        if self._native is not None:
            fresh = self.dp_rank not in self._translators
            counts = self._native.ingest(payload, self.translator(self.dp_rank))
            if counts is not None:
                return self._applied_natively(counts)
            if fresh:  # not taken: leave no trace of the attempt
                del self._translators[self.dp_rank]
        try:
            batch = self._decoder.decode(payload)
        except EventDecodeError as error:
            self._decode_error(error)
            return BatchResult(BatchStatus.UNDECODABLE)
        return self.apply_batch(batch)

    def apply_batch(self, batch: EventBatch) -> BatchResult:
        rank = self.dp_rank if batch.data_parallel_rank is None else batch.data_parallel_rank
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
        """What ends every applied batch, on either path: the map's bound and the lag."""
        if len(translator) > self._config.max_entries:
            log.warning("%s: more mapped blocks than max_entries; clearing", translator.worker)
            self.reset("overflow")
        self._metrics.ingest_lag.observe(max(0.0, self._clock() - ts))
        return BatchResult(status, events)

    def _malformed(self) -> None:
        self._decode_error(EventDecodeError("token_ids do not fill block_hashes"))

    def _applied_natively(self, counts: NativeCounts) -> BatchResult:
        """The metrics and checks of ``apply_batch`` for a payload the native path applied."""
        if counts.stored_events or counts.unknown_parent:  # both count as BlockStored seen
            self._events_by_type["BlockStored"].inc(counts.stored_events + counts.unknown_parent)
            self._blocks_stored.inc(counts.stored_blocks)
        if counts.removed_events:
            self._events_by_type["BlockRemoved"].inc(counts.removed_events)
        for _ in range(counts.malformed):
            self._malformed()
        status = BatchStatus.UNKNOWN_PARENT if counts.unknown_parent else BatchStatus.APPLIED
        return self._batch_done(self.translator(self.dp_rank), counts.ts, status, counts.events)

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
        self._errors_since_log += 1
        now = self._clock()
        if now - self._last_error_log >= self._config.decode_error_log_interval_s:
            log.warning(
                "%s: skipped %d undecodable event payload(s): %s",
                self.worker,
                self._errors_since_log,
                error,
            )
            self._last_error_log = now
            self._errors_since_log = 0
