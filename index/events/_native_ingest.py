"""A feed's native fast path: whole payloads applied in C (index/csrc/native.c, "batch
ingestion") when they have the shape engines send nearly always.

That shape: GPU-tier ``BlockStored`` / ``BlockRemoved`` events without LoRA or cache salt, for
the feed's own data-parallel rank and block size, into an ``EventIndex`` over the native table
while the domain holds nothing off GPU. Anything else (and any payload the C side does not
take) goes through the general path in index/ingest.py, which gives the same result.
"""

from __future__ import annotations

from dataclasses import dataclass

from index import _native
from index.config import IndexConfig
from index.events._translate import Translator
from index.keys._blocks import cache_seed
from index.table import EventIndex, NativeBlockTable
from index.types import Tier, WorkerKey


@dataclass(frozen=True, slots=True)
class NativeCounts:
    """What one payload did, as the general path would have counted it."""

    ts: float
    events: int
    stored_events: int
    stored_blocks: int
    removed_events: int
    removed_blocks: int
    malformed: int
    unknown_parent: int
    pruned: int
    pruned_parent: int


class NativeIngest:
    """Applies one cache domain's payloads in C (``ingest`` returns None when it cannot)."""

    def __init__(
        self,
        index: EventIndex,
        table: NativeBlockTable,
        worker: WorkerKey,
        block_size: int,
        max_event_blocks: int,
    ) -> None:
        self._index = index
        self._table = table
        self._worker = worker
        self._block_size = block_size
        self._max_event_blocks = max_event_blocks
        self._root_seed = cache_seed(None, None)

    @classmethod
    def create(
        cls, index: object, config: IndexConfig, worker: WorkerKey, block_size: int
    ) -> NativeIngest | None:
        """The fast path for a feed, if its index and configuration allow one."""
        if not isinstance(index, EventIndex) or not isinstance(index.table, NativeBlockTable):
            return None
        if config.tier_of("GPU") != Tier.GPU:
            return None
        return cls(index, index.table, worker, block_size, config.max_event_blocks)

    def ingest(self, payload: bytes, translator: Translator) -> NativeCounts | None:
        keys = translator.key_map
        if not translator.gpu_only() or not isinstance(keys, _native.KeyMap):
            return None
        core, slot = self._table.native_slot(self._worker)
        counts = _native.ingest_batch(
            payload,
            core,
            slot,
            keys,
            self._worker.dp_rank,
            self._block_size,
            self._root_seed,
            self._index.max_entries,
            self._max_event_blocks,
        )
        if counts is None:
            return None
        result = NativeCounts(*counts)
        if result.stored_blocks:
            self._table.claim_slot(self._worker)
        self._index.pruned += result.pruned
        return result
