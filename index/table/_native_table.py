"""The native block table (index/csrc/table.h) behind the table protocol (the default one).

The C core knows cache domains as small integer slots; this wrapper maps ``WorkerKey`` to
slots (reusing released ones) and builds the ``PrefixMatch``, ``SlotStats`` and
``BatchResult`` results. Beyond the protocol it applies whole KV-event payloads in C
(``ingest``): the event index's fast path.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvgate.index import _native
from kvgate.index.api import BatchResult
from kvgate.index.memo import BoundedMemo
from kvgate.index.table._table import SECOND_CHANCES
from kvgate.index.types import BlockKey, PrefixMatch, SlotStats, Tier, WorkerKey

_MATCH_MEMO_LIMIT = 4096


class NativeBlockTable:
    """Blocks held per cache domain, with LRU order per domain and exact prefix matching."""

    def __init__(self) -> None:
        self._core = _native.Table()
        self._slot_of: dict[WorkerKey, int] = {}
        self._worker_at: dict[int, WorkerKey] = {}
        self._free_slots: list[int] = []
        self._matches = BoundedMemo[tuple[int, int, int], PrefixMatch](_MATCH_MEMO_LIMIT)

    def _slot(self, worker: WorkerKey) -> int:
        slot = self._slot_of.get(worker)
        if slot is None:
            slot = self._next_slot()
            if self._free_slots:
                self._free_slots.pop()
            self._slot_of[worker] = slot
            self._worker_at[slot] = worker
        return slot

    def _next_slot(self) -> int:
        """The slot the next new domain gets: the last released one, else a new one."""
        return self._free_slots[-1] if self._free_slots else len(self._slot_of)

    def workers(self) -> list[WorkerKey]:
        return list(self._slot_of)

    def entry_count(self) -> int:
        return self._core.entry_count()

    def block_count(self) -> int:
        return self._core.block_count()

    def memory_bytes(self) -> int:
        return self._core.memory_bytes()

    def slot_entries(self, worker: WorkerKey) -> int:
        slot = self._slot_of.get(worker)
        return 0 if slot is None else self._core.slot_info(slot)[0]

    def holds(self, worker: WorkerKey, key: BlockKey) -> bool:
        slot = self._slot_of.get(worker)
        return slot is not None and self._core.holds(slot, key)

    def held_keys(self, worker: WorkerKey) -> array[int]:
        slot = self._slot_of.get(worker)
        return array("Q", b"" if slot is None else self._core.held_keys(slot))

    def stats(self) -> list[SlotStats]:
        out = []
        for worker, slot in self._slot_of.items():
            entries, gpu, cpu, disk, orphans = self._core.slot_info(slot)
            by_tier = {Tier.GPU: gpu, Tier.CPU: cpu, Tier.DISK: disk}
            out.append(SlotStats(worker, entries, by_tier, orphans))
        return out

    def store(
        self,
        worker: WorkerKey,
        keys: Sequence[BlockKey],
        tier: Tier,
        parent: BlockKey | None,
        stamp: float = 0.0,
    ) -> None:
        if keys:
            self._core.store(self._slot(worker), keys, tier, parent, stamp)

    def remove(self, worker: WorkerKey, keys: Sequence[BlockKey], tier: Tier) -> None:
        slot = self._slot_of.get(worker)
        if slot is not None:
            self._core.remove(slot, keys, 1 << tier)

    def clear(self, worker: WorkerKey) -> None:
        slot = self._slot_of.pop(worker, None)
        if slot is not None:
            del self._worker_at[slot]
            self._core.clear_slot(slot)
            self._free_slots.append(slot)

    def oldest(self, worker: WorkerKey) -> tuple[int, float] | None:
        slot = self._slot_of.get(worker)
        return None if slot is None else self._core.oldest(slot)

    def evict(self, worker: WorkerKey, key: int) -> None:
        slot = self._slot_of.get(worker)
        if slot is not None:
            self._core.evict(slot, key)

    def prune_leaf(self, worker: WorkerKey, second_chances: int = SECOND_CHANCES) -> bool:
        slot = self._slot_of.get(worker)
        return slot is not None and self._core.prune_leaf(slot, second_chances)

    def prune_to(self, max_entries: int) -> int:
        return self._core.prune_to(max_entries)

    def ingest(
        self,
        worker: WorkerKey,
        payload: bytes,
        keys: _native.KeyMap,
        *,
        block_size: int,
        root_seed: int,
        max_entries: int,
        max_blocks: int,
    ) -> BatchResult | None:
        """A whole KV-event payload applied in C to one domain and its engine-hash map
        (index/csrc/ingest.c), with ``max_entries`` kept by the table's pruning rule after
        every stored event; None (nothing applied) when the payload is not in the shape the C
        side takes. A domain storing its first block gets its slot here."""
        slot = self._slot_of.get(worker)
        new = slot is None
        if slot is None:
            slot = self._next_slot()
        counts = self._core.ingest(
            slot, payload, keys, worker.dp_rank, block_size, root_seed, max_entries, max_blocks
        )
        if counts is None:
            return None
        ts, events, stored, blocks, removed, gone, malformed, unknown, pruned, skipped = counts
        if new and blocks:
            self._slot(worker)
        return BatchResult(
            ts=ts,
            events=events,
            stored_events=stored,
            stored_blocks=blocks,
            removed_events=removed,
            removed_blocks=gone,
            unknown_parent=unknown,
            pruned_parent=skipped,
            malformed=malformed,
            pruned=pruned,
        )

    def find_matches(self, keys: Sequence[BlockKey]) -> dict[WorkerKey, PrefixMatch]:
        """Per cache domain holding ``keys[0]``: its contiguous matched prefix by tier."""
        worker_at, memo = self._worker_at, self._matches
        remembered = memo.get  # once per call: every holder is a lookup
        result: dict[WorkerKey, PrefixMatch] = {}
        for slot, gpu, cpu, any_ in self._core.find_matches(keys):
            worker = worker_at.get(slot)
            if worker is None:  # only if a native ingest failed (out of memory) mid-store
                continue
            runs = (gpu, cpu - gpu, any_ - cpu)
            match = remembered(runs)
            result[worker] = memo.put(runs, PrefixMatch(*runs)) if match is None else match
        return result
