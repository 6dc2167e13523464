"""A paged KV-block cache with vLLM's prefix-caching semantics, plus an optional CPU tier.

* A block is cached once it is full; its hash chains the parent's hash and its tokens.
* Blocks held by a running request (reference count > 0) are never evicted.
* Free blocks wait in an LRU queue; a request frees its blocks tail first, so the tail of a
  prompt is evicted before its head. A hit on a free cached block takes it off the queue.
* Allocation takes the least recently freed block; if it held a hash, that hash is evicted
  (``BlockRemoved``). Like vLLM, a hash may be held by two blocks (a fully cached prompt
  recomputes its last block); the sim emits ``BlockRemoved`` only when the last copy goes,
  so the event stream always describes exactly the set of cached hashes.
* With a CPU tier, a hash evicted from GPU moves to CPU (``BlockStored`` medium CPU) unless
  already there; the CPU tier is an LRU of ``cpu_blocks`` hashes. Hits there are loaded back
  into fresh GPU blocks (at a cost charged by the engine).
* Blocks of a LoRA adapter's requests carry the adapter in their events as vLLM publishes
  them: ``lora_id`` (the adapter's integer id), ``lora_name``, and the name in every block's
  ``extra_keys`` (before the cache salt on the first block).

Every state change appends its event to ``events`` in order; the engine publishes them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from kvgate.backends.sim.lora import Adapter
from kvgate.index.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
)
from kvgate.index.types import EngineBlockHash


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a cached hash stands for: its parent hash and its tokens."""

    parent: int | None
    token_ids: tuple[int, ...]
    cache_salt: str | None = None
    lora: Adapter | None = None


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """The cached hashes of each tier, with what they stand for."""

    gpu: dict[int, BlockMeta]
    cpu: dict[int, BlockMeta]


def _extra_keys(
    salt: str | None, lora: Adapter | None, first_block: bool, blocks: int
) -> list[object] | None:
    """vLLM's ``extra_keys``: one entry per block, untagged as vLLM publishes them: the
    adapter's name on every block of an adapter's request, then the bare salt string on the
    first block of a salted chain."""
    salted = salt is not None and first_block
    if lora is None:
        return [[salt], *([None] * (blocks - 1))] if salted else None
    first = [lora.name, salt] if salted else [lora.name]
    return [first, *([[lora.name]] * (blocks - 1))]


def _stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    *,
    block_size: int,
    medium: str,
    salt: str | None,
    lora: Adapter | None,
) -> BlockStored:
    return BlockStored(
        block_hashes=cast("list[EngineBlockHash]", hashes),  # the sim is the engine: its hashes
        parent_block_hash=None if parent is None else EngineBlockHash(parent),
        token_ids=tokens,
        block_size=block_size,
        lora_id=None if lora is None else lora.lora_id,
        medium=medium,
        lora_name=None if lora is None else lora.name,
        extra_keys=_extra_keys(salt, lora, parent is None, len(hashes)),
    )


class BlockCache:
    """GPU block pool (``num_blocks`` blocks of ``block_size`` tokens) and CPU tier."""

    def __init__(self, num_blocks: int, block_size: int, cpu_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cpu_capacity = cpu_blocks
        self.events: list[KvEvent] = []
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._gpu: dict[int, list[int]] = {}
        self._cpu: OrderedDict[int, None] = OrderedDict()
        self._meta: dict[int, BlockMeta] = {}

    # --- queries -------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks not held by any request (empty, or cached and evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks held by requests (vLLM's ``kv_cache_usage_perc``, 0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def gpu_cached(self) -> int:
        return len(self._gpu)

    @property
    def cpu_cached(self) -> int:
        return len(self._cpu)

    def in_use(self) -> bool:
        return len(self._free) < self.num_blocks

    def gpu_prefix(self, hashes: Sequence[int], limit: int) -> list[int]:
        """Block ids holding the leading ``hashes`` (at most ``limit``) cached on GPU."""
        found: list[int] = []
        gpu = self._gpu
        for h in hashes[:limit]:
            holders = gpu.get(h)
            if holders is None:
                break
            found.append(holders[0])
        return found

    def cpu_prefix(self, hashes: Sequence[int], start: int, limit: int) -> int:
        """How many of ``hashes[start:limit]`` are, in a row, on the CPU tier."""
        n = 0
        for h in hashes[start:limit]:
            if h not in self._cpu:
                break
            n += 1
        return n

    def evictable(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` sit in the free queue (a hit would take them off)."""
        ref = self._ref
        return sum(1 for b in block_ids if ref[b] == 0)

    def snapshot(self) -> CacheSnapshot:
        meta = self._meta
        return CacheSnapshot(
            gpu={h: meta[h] for h in self._gpu},
            cpu={h: meta[h] for h in self._cpu},
        )

    # --- changes -------------------------------------------------------------------------

    def touch(self, block_ids: Sequence[int]) -> None:
        """A request now holds these cached blocks (off the free queue if they were free)."""
        ref, free = self._ref, self._free
        for b in block_ids:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def touch_cpu(self, hashes: Sequence[int]) -> None:
        """CPU-tier hits, as a chain: the head ends most recent (evicted last)."""
        for h in reversed(hashes):
            self._cpu.move_to_end(h)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks for a request, evicting cached hashes LRU-first; None if short."""
        if n > len(self._free):
            return None
        free, ref, hashes = self._free, self._ref, self._hash
        out: list[int] = []
        for _ in range(n):
            b, _none = free.popitem(last=False)
            h = hashes[b]
            if h is not None:
                hashes[b] = None
                self._drop_copy(h, b)
            ref[b] = 1
            out.append(b)
        return out

    def register(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        *,
        lora: Adapter | None = None,
    ) -> None:
        """Full blocks now cached on GPU: one ``BlockStored`` for the chain."""
        if not block_ids:
            return
        bs = self.block_size
        prev = parent
        for i, (b, h) in enumerate(zip(block_ids, block_hashes, strict=True)):
            self._hash[b] = h
            holders = self._gpu.get(h)
            if holders is None:
                self._gpu[h] = [b]
            else:
                holders.append(b)
            if h not in self._meta:
                salt = cache_salt if prev is None else None
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                self._meta[h] = BlockMeta(prev, tokens, salt, lora)
            prev = h
        self.events.append(
            _stored(
                list(block_hashes),
                parent,
                list(token_ids),
                block_size=bs,
                medium=MEDIUM_GPU,
                salt=cache_salt,
                lora=lora,
            )
        )

    def free(self, block_ids: Sequence[int]) -> None:
        """A request lets go of its blocks; pass them tail first (evicted first)."""
        ref, free = self._ref, self._free
        for b in block_ids:
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def reset(self) -> bool:
        """Drop every cached hash (``AllBlocksCleared``); refused while blocks are in use."""
        if self.in_use():
            return False
        self._hash = [None] * self.num_blocks
        self._gpu.clear()
        self._cpu.clear()
        self._meta.clear()
        self.events.append(AllBlocksCleared())
        return True

    # --- internals -----------------------------------------------------------------------

    def _drop_copy(self, h: int, block: int) -> None:
        holders = self._gpu[h]
        holders.remove(block)
        if holders:
            return
        del self._gpu[h]
        if self.cpu_capacity > 0:
            self._offload(h)
        self.events.append(BlockRemoved(block_hashes=[EngineBlockHash(h)], medium=MEDIUM_GPU))
        if h not in self._cpu:
            del self._meta[h]

    def _offload(self, h: int) -> None:
        cpu = self._cpu
        if h in cpu:
            cpu.move_to_end(h)
            return
        while len(cpu) >= self.cpu_capacity:
            old, _none = cpu.popitem(last=False)
            self.events.append(BlockRemoved(block_hashes=[EngineBlockHash(old)], medium=MEDIUM_CPU))
            if old not in self._gpu:
                del self._meta[old]
        cpu[h] = None
        meta = self._meta[h]
        self.events.append(
            _stored(
                [h],
                meta.parent,
                list(meta.token_ids),
                block_size=self.block_size,
                medium=MEDIUM_CPU,
                salt=meta.cache_salt,
                lora=meta.lora,
            )
        )
