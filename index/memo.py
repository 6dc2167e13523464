"""``BoundedMemo``: remembered results whose keys come from outside, bounded by forgetting.

For memos keyed by what requests or publishers send (metric label sets, chain seeds per
LoRA name and cache salt, interned masks, shared result objects): a hit is one ``dict.get``;
an insertion into a full memo first empties it. Cheaper than LRU bookkeeping on every hit,
and a memo refills at once with what is in use. Public so that every layer can use it (the
index is the lowest one).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedMemo(Generic[K, V]):
    """At most ``limit`` remembered values; ``get`` then, on a miss, ``put``."""

    __slots__ = ("_items", "_limit", "get")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        self._items: dict[K, V] = {}
        self._limit = limit
        self.get: Callable[[K], V | None] = self._items.get
        """The remembered value of a key, or None (the bound ``dict.get``: no extra call)."""

    def put(self, key: K, value: V) -> V:
        """Remember ``value`` for ``key`` (after a miss) and return it; a full memo is emptied
        first."""
        items = self._items
        if len(items) >= self._limit:
            items.clear()
        items[key] = value
        return value

    def __len__(self) -> int:
        return len(self._items)
