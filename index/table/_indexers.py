"""The two ``Indexer`` implementations.

* ``EventIndex``: fed by the engines' KV events (translated to kvgate keys, or whole payloads
  applied in C over the native table); bounded by a cap on entries, kept by the table's
  pruning rule (least recently stored leaves of the largest cache domain first) on both paths.
* ``ApproxIndex``: for engines without events; kvgate's own routing decisions, each assumed
  cached for ``ttl_s`` and at most ``capacity`` blocks per cache domain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvgate.index import _native
from kvgate.index.api import BatchResult, ClearAll, IndexOp, RemoveBlocks, StoreBlocks
from kvgate.index.table._native_table import NativeBlockTable
from kvgate.index.table._protocol import BlockTableApi, new_table
from kvgate.index.types import BlockKey, PrefixMatch, SlotStats, WorkerId, WorkerKey

Clock = Callable[[], float]


class _OverTable:
    """What both indexers answer straight from their table."""

    def __init__(self, table: BlockTableApi | None) -> None:
        self._table = new_table() if table is None else table

    @property
    def table(self) -> BlockTableApi:
        return self._table

    def clear_worker(self, worker: WorkerKey) -> None:
        self._table.clear(worker)

    def remove_worker(self, worker: WorkerId) -> None:
        for key in self._table.workers():
            if key.worker == worker:
                self._table.clear(key)

    def holds(self, worker: WorkerKey, key: BlockKey) -> bool:
        return self._table.holds(worker, key)

    def domain_entries(self, worker: WorkerKey) -> int:
        return self._table.slot_entries(worker)

    def held_keys(self, worker: WorkerKey) -> Sequence[int]:
        return self._table.held_keys(worker)


class EventIndex(_OverTable):
    """Exact block → cache-domain index fed by engine events, capped at ``max_entries``."""

    def __init__(self, max_entries: int = 2_000_000, table: BlockTableApi | None = None) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        super().__init__(table)
        self._max_entries = max_entries
        self.pruned = 0
        self._hidden: dict[WorkerId, int] = {}  # workers learning their history (see hide)
        # the table's own method: asked for every stored event on the general path
        self.holds = self._table.holds  # type: ignore[method-assign]

    @property
    def max_entries(self) -> int:
        return self._max_entries

    def hide(self, worker: WorkerId) -> None:
        """Match nothing on ``worker`` until ``unhide`` (as often as hidden): while a replay
        of its history is applied, the index holds a past state of its cache (blocks stored,
        their later removal not applied yet), which would predict hits it no longer has."""
        self._hidden[worker] = self._hidden.get(worker, 0) + 1

    def unhide(self, worker: WorkerId) -> None:
        left = self._hidden.get(worker, 0) - 1
        if left > 0:
            self._hidden[worker] = left
        else:
            self._hidden.pop(worker, None)

    def find_matches(self, keys: Sequence[BlockKey]) -> Mapping[WorkerKey, PrefixMatch]:
        found = self._table.find_matches(keys)
        if not self._hidden:
            return found
        return {domain: m for domain, m in found.items() if domain.worker not in self._hidden}

    def apply(self, worker: WorkerKey, op: IndexOp) -> None:
        if isinstance(op, StoreBlocks):
            self._table.store(worker, op.keys, op.tier, op.parent)
            if self._table.entry_count() > self._max_entries:
                self.pruned += self._table.prune_to(self._max_entries)
        elif isinstance(op, RemoveBlocks):
            self._table.remove(worker, op.keys, op.tier)
        elif isinstance(op, ClearAll):
            self._table.clear(worker)

    def ingest(
        self,
        worker: WorkerKey,
        payload: bytes,
        keys: _native.KeyMap,
        *,
        block_size: int,
        root_seed: int,
        max_blocks: int,
    ) -> BatchResult | None:
        """A whole payload of ``worker``'s events applied in C, the cap kept as ``apply`` keeps
        it; None (nothing applied) over the Python table or when the payload is not in the
        shape the C side takes (the caller then decodes it and applies its events)."""
        table = self._table
        if not isinstance(table, NativeBlockTable):
            return None
        result = table.ingest(
            worker,
            payload,
            keys,
            block_size=block_size,
            root_seed=root_seed,
            max_entries=self._max_entries,
            max_blocks=max_blocks,
        )
        if result is not None:
            self.pruned += result.pruned
        return result

    def entry_count(self) -> int:
        return self._table.entry_count()

    def block_count(self) -> int:
        return self._table.block_count()

    def stats(self) -> list[SlotStats]:
        return self._table.stats()


class ApproxIndex(_OverTable):
    """Index of kvgate's own routing decisions: TTL-bounded and capacity-bounded per domain."""

    def __init__(
        self,
        ttl_s: float = 120.0,
        capacity: int = 200_000,
        clock: Clock = time.monotonic,
        table: BlockTableApi | None = None,
    ) -> None:
        if ttl_s <= 0 or capacity <= 0:
            raise ValueError("ttl_s and capacity must be positive")
        super().__init__(table)
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._clock = clock

    def record(self, worker: WorkerKey, keys: Sequence[BlockKey]) -> None:
        """A request with these keys was routed to ``worker``: assume its prefix is cached."""
        self.apply(worker, StoreBlocks(keys))

    def apply(self, worker: WorkerKey, op: IndexOp) -> None:
        if isinstance(op, StoreBlocks):
            now = self._clock()
            self._expire(worker, now)
            self._table.store(worker, op.keys, op.tier, op.parent, stamp=now)
            while self._table.slot_entries(worker) > self._capacity:
                if not self._table.prune_leaf(worker, second_chances=0):
                    break
        elif isinstance(op, RemoveBlocks):
            self._table.remove(worker, op.keys, op.tier)
        elif isinstance(op, ClearAll):
            self._table.clear(worker)

    def _expire(self, worker: WorkerKey, now: float) -> None:
        table = self._table
        deadline = now - self._ttl_s
        while True:
            oldest = table.oldest(worker)
            if oldest is None or oldest[1] > deadline:
                return
            table.evict(worker, oldest[0])

    def expire(self) -> None:
        """Drop every entry older than the TTL (also done lazily on store and match)."""
        now = self._clock()
        for worker in self._table.workers():
            self._expire(worker, now)

    def find_matches(self, keys: Sequence[BlockKey]) -> Mapping[WorkerKey, PrefixMatch]:
        self.expire()
        return self._table.find_matches(keys)

    def entry_count(self) -> int:
        self.expire()
        return self._table.entry_count()

    def stats(self) -> list[SlotStats]:
        self.expire()
        return self._table.stats()
