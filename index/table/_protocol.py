"""Which block table backs the indexers: the native core (default) or the pure-Python one.

Both implement ``BlockTableApi`` with the same answers (one test suite and the property tests
run against each). The native table is built from index/csrc/ at install time; a source tree
that was never built uses the Python table.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Literal, Protocol

from index.table._table import BlockTable
from index.types import BlockKey, PrefixMatch, SlotStats, Tier, WorkerKey

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
    def largest(self) -> WorkerKey | None: ...
    def find_matches(self, keys: Sequence[BlockKey]) -> dict[WorkerKey, PrefixMatch]: ...
    def workers(self) -> list[WorkerKey]: ...
    def entry_count(self) -> int: ...
    def block_count(self) -> int: ...
    def slot_entries(self, worker: WorkerKey) -> int: ...
    def holds(self, worker: WorkerKey, key: BlockKey) -> bool: ...
    def held_keys(self, worker: WorkerKey) -> Sequence[int]: ...
    def stats(self) -> list[SlotStats]: ...


def native_available() -> bool:
    """Whether the native core was built (``pip install`` builds it; see setup.py)."""
    return importlib.util.find_spec("index._native") is not None


def default_kind() -> TableKind:
    """Native when built, else python."""
    return "native" if native_available() else "python"


def new_table(kind: TableKind | None = None) -> BlockTableApi:
    """A fresh block table of ``kind`` (default: ``default_kind()``)."""
    if (kind or default_kind()) == "python":
        return BlockTable()
    from index.table._native_table import NativeBlockTable  # noqa: PLC0415 - needs the built core

    return NativeBlockTable()
