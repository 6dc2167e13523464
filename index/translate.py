"""Per cache domain: engine events (engine hashes) → index operations (kvgate keys).

kvgate recomputes its own key for every stored block from the event's ``token_ids``, chained
from the key of the parent block (looked up by the parent's engine hash), and remembers
engine hash → key so that later ``BlockRemoved`` events (which carry only engine hashes) can be
applied. The map shrinks with removals and clears.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from index.api import Indexer, RemoveBlocks, StoreBlocks
from index.blocks import block_keys, cache_seed
from index.config import IndexConfig
from index.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from index.types import BlockKey, EngineBlockHash, Tier, WorkerKey

log = logging.getLogger(__name__)

_GPU_ONLY = 1 << Tier.GPU


class Outcome(enum.Enum):
    APPLIED = "applied"
    CLEARED = "cleared"
    UNKNOWN_PARENT = "unknown_parent"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    MALFORMED = "malformed"
    IGNORED = "ignored"


def cache_salt_of(event: BlockStored) -> str | None:
    """The cache salt vLLM folds into a root block's extra keys (strings besides the LoRA name)."""
    if event.parent_block_hash is not None or not event.extra_keys:
        return None
    first = event.extra_keys[0]
    if not isinstance(first, list | tuple):
        return None
    salts = [x for x in first if isinstance(x, str) and x != event.lora_name]
    return salts[-1] if salts else None


def lora_name_of(event: BlockStored) -> str | None:
    if event.lora_name is not None:
        return event.lora_name
    return None if event.lora_id is None else f"lora-id:{event.lora_id}"


@dataclass(frozen=True, slots=True)
class Translated:
    outcome: Outcome
    blocks: int = 0


class Translator:
    """Applies one cache domain's events to an ``Indexer``."""

    def __init__(
        self, worker: WorkerKey, index: Indexer, config: IndexConfig, block_size: int
    ) -> None:
        self.worker = worker
        self._index = index
        self._config = config
        self.block_size = block_size
        self._keys: dict[EngineBlockHash, BlockKey] = {}
        self._tiers: dict[EngineBlockHash, int] = {}  # only hashes held in tiers other than GPU
        self.mismatched = False

    def __len__(self) -> int:
        return len(self._keys)

    def apply(self, event: KvEvent) -> Translated:
        if self.mismatched and not isinstance(event, AllBlocksCleared):
            return Translated(Outcome.BLOCK_SIZE_MISMATCH)
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            return self._removed(event)
        if isinstance(event, AllBlocksCleared):
            self.clear()
            return Translated(Outcome.CLEARED)
        return Translated(Outcome.IGNORED)  # pragma: no cover - KvEvent is exhaustive

    def clear(self, *, restarted: bool = False) -> None:
        """Forget the domain (engine reset/restart, unrecoverable gap, worker removed).

        After an engine restart a block-size mismatch is checked afresh."""
        if restarted:
            self.mismatched = False
        self._keys.clear()
        self._tiers.clear()
        self._index.clear_worker(self.worker)

    def _stored(self, event: BlockStored) -> Translated:
        if event.block_size != self.block_size:
            if not self.mismatched:
                log.warning(
                    "%s: events have block_size %d but kvgate is configured with %d; "
                    "this worker's events are not indexed",
                    self.worker,
                    event.block_size,
                    self.block_size,
                )
                self.mismatched = True
                self.clear()
            return Translated(Outcome.BLOCK_SIZE_MISMATCH)
        hashes = event.block_hashes
        if len(event.token_ids) != len(hashes) * event.block_size:
            return Translated(Outcome.MALFORMED)
        parent_hash = event.parent_block_hash
        parent: BlockKey | None = None
        if parent_hash is not None:
            parent = self._keys.get(parent_hash)
            if parent is None:
                return Translated(Outcome.UNKNOWN_PARENT)
        seed = cache_seed(lora_name_of(event), cache_salt_of(event))
        keys = block_keys(event.token_ids, self.block_size, seed, parent)
        tier = self._config.tier_of(event.medium)
        known = self._keys
        if tier == Tier.GPU:
            known.update(zip(hashes, keys, strict=True))
            if self._tiers:
                for engine_hash in hashes:
                    if engine_hash in self._tiers:
                        self._tiers[engine_hash] |= _GPU_ONLY
        else:
            for engine_hash, key in zip(hashes, keys, strict=True):
                held = self._tiers.get(engine_hash, _GPU_ONLY if engine_hash in known else 0)
                known[engine_hash] = key
                self._tiers[engine_hash] = held | (1 << tier)
        self._index.apply(self.worker, StoreBlocks(keys, tier, parent))
        return Translated(Outcome.APPLIED, len(keys))

    def _removed(self, event: BlockRemoved) -> Translated:
        tier = self._config.tier_of(event.medium)
        tier_bit = 1 << tier
        keys: list[BlockKey] = []
        known = self._keys
        tiers = self._tiers
        for engine_hash in event.block_hashes:
            key = known.get(engine_hash)
            if key is None:
                continue
            held = tiers.get(engine_hash, _GPU_ONLY)
            if not held & tier_bit:
                continue
            keys.append(key)
            left = held & ~tier_bit
            if not left:
                del known[engine_hash]
                tiers.pop(engine_hash, None)
            elif left == _GPU_ONLY:
                tiers.pop(engine_hash, None)
            else:
                tiers[engine_hash] = left
        if keys:
            self._index.apply(self.worker, RemoveBlocks(keys, tier))
        return Translated(Outcome.APPLIED, len(keys))
