"""The table protocol both block tables implement, and the choice between them.

The native table (index/csrc/, built at install) is the default; ``IndexConfig.table =
"python"`` picks the pure-Python one. Both give the same answers to the same operations:
tests/test_index_suite.py runs one suite and the property tests against each and against a
plain dict-of-sets model, the reference of what the answers are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from kvgate.index.table._native_table import NativeBlockTable
from kvgate.index.table._table import BlockTable
from kvgate.index.types import BlockKey, PrefixMatch, SlotStats, Tier, WorkerKey

TableKind = Literal["native", "python"]


class BlockTableApi(Protocol):
    """Blocks held per cache domain, with LRU order per domain and exact prefix matching."""

    def store(
        self,
        worker: WorkerKey,
        keys: Sequence[BlockKey],
        tier: Tier,
        parent: BlockKey | None,
        stamp: float = 0.0,
    ) -> None: ...
    def remove(self, worker: WorkerKey, keys: Sequence[BlockKey], tier: Tier) -> None: ...
    def clear(self, worker: WorkerKey) -> None: ...
    def oldest(self, worker: WorkerKey) -> tuple[int, float] | None: ...
    def evict(self, worker: WorkerKey, key: int) -> None: ...
    def prune_leaf(self, worker: WorkerKey, second_chances: int = ...) -> bool: ...
    def prune_to(self, max_entries: int) -> int:
        """The cap's pruning rule: evict least recently stored leaves of the largest domain
        (the lowest slot on ties) until at most ``max_entries`` entries are held; how many
        went."""
        ...

    def find_matches(self, keys: Sequence[BlockKey]) -> dict[WorkerKey, PrefixMatch]: ...
    def workers(self) -> list[WorkerKey]: ...
    def entry_count(self) -> int: ...
    def block_count(self) -> int: ...
    def slot_entries(self, worker: WorkerKey) -> int: ...
    def holds(self, worker: WorkerKey, key: BlockKey) -> bool: ...
    def held_keys(self, worker: WorkerKey) -> Sequence[int]: ...
    def stats(self) -> list[SlotStats]: ...


def new_table(kind: TableKind | None = None) -> BlockTableApi:
    """A fresh block table of ``kind`` (default: the native one)."""
    return BlockTable() if kind == "python" else NativeBlockTable()
