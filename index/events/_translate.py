"""Per cache domain: engine events (engine hashes) → index operations (kvgate keys).

kvgate recomputes its own key for every stored block from the event's ``token_ids``, chained
from the key of the parent block (looked up by the parent's engine hash), and remembers
engine hash → key so that later ``BlockRemoved`` events (which carry only engine hashes) can be
applied. The map shrinks with removals and clears, and with the table: once it maps more
hashes than twice what the domain holds (the cap pruned them), the hashes of blocks the domain
no longer holds are forgotten.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import msgspec

from index.api import Indexer, RemoveBlocks, StoreBlocks
from index.config import IndexConfig
from index.events._wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KvEvent,
)
from index.keys import block_keys, cache_seed
from index.types import BlockKey, EngineBlockHash, Tier, WorkerKey

log = logging.getLogger(__name__)


class HashKeyMap(Protocol):
    """Engine block hash → kvgate block key (the native ``KeyMap``, or a dict)."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object, /) -> bool: ...
    def __setitem__(self, key: int, value: int, /) -> None: ...
    def __delitem__(self, key: int, /) -> None: ...
    def get(self, key: int, default: None = None, /) -> int | None: ...
    def clear(self) -> None: ...
    def put_many(self, hashes: Sequence[int], keys: Sequence[int], /) -> None: ...
    def take_many(self, hashes: Sequence[int], /) -> Sequence[int]: ...
    def retain(self, keys: Sequence[int], /) -> int: ...


class _DictKeyMap(dict[int, int]):
    def retain(self, keys: Sequence[int], /) -> int:
        wanted = set(keys)
        gone = [h for h, key in self.items() if key not in wanted]
        for engine_hash in gone:
            del self[engine_hash]
        return len(gone)

    def put_many(self, hashes: Sequence[int], keys: Sequence[int], /) -> None:
        self.update(zip(hashes, keys, strict=True))

    def take_many(self, hashes: Sequence[int], /) -> Sequence[int]:
        found = (self.pop(h, None) for h in hashes)
        return [key for key in found if key is not None]


_MsgpackKeys = Callable[[msgspec.Raw, int, int, int], Sequence[int]]
_native_msgpack_keys: _MsgpackKeys | None
_new_key_map: Callable[[], HashKeyMap]
try:
    from index._native import KeyMap as _new_key_map
    from index._native import chain_keys_msgpack as _native_msgpack_keys
except ImportError:  # never built (pip install builds it): Python dict and per-block hashing
    _new_key_map = _DictKeyMap
    _native_msgpack_keys = None

_GPU_ONLY = 1 << Tier.GPU
_MAPPED_SLACK = 1024  # hashes mapped beyond twice the domain's blocks before it is compacted


class Outcome(enum.Enum):
    APPLIED = "applied"
    CLEARED = "cleared"
    UNKNOWN_PARENT = "unknown_parent"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    MALFORMED = "malformed"
    IGNORED = "ignored"
    PARENT_PRUNED = "parent_pruned"  # stored under a block the domain no longer holds: skipped
    OVER_LIMIT = "over_limit"  # more blocks than max_event_blocks: the domain is cleared


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
        self._keys: HashKeyMap = _new_key_map()
        self._tiers: dict[EngineBlockHash, int] = {}  # only hashes held in tiers other than GPU
        self._seeds: dict[tuple[str | None, str | None], int] = {}
        self.mismatched = False
        self.trimmed = False  # hashes of pruned blocks were forgotten since the last clear
        self._max_blocks = config.max_event_blocks
        self._holds = index.holds

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def key_map(self) -> HashKeyMap:
        """Engine hash → key of this domain (the native batch ingestion writes it too)."""
        return self._keys

    def gpu_only(self) -> bool:
        """Every known block is held on GPU only and the block size matched so far."""
        return not self._tiers and not self.mismatched

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
        self.trimmed = False
        self._keys.clear()
        self._tiers.clear()
        self._index.clear_worker(self.worker)

    def shrink(self) -> bool:
        """Once the map holds more than twice the domain's blocks plus some slack, forget the
        hashes of blocks the domain no longer holds; False if it still does after that (a
        publisher mapping many hashes to few blocks: the caller clears the domain)."""
        keys = self._keys
        bound = 2 * self._index.domain_entries(self.worker) + _MAPPED_SLACK
        if len(keys) <= bound:
            return True
        if keys.retain(self._index.held_keys(self.worker)):
            self.trimmed = True
        if self._tiers:
            self._tiers = {h: held for h, held in self._tiers.items() if h in keys}
        return len(keys) <= bound

    def _stored(self, event: BlockStored) -> Translated:
        if len(event.block_hashes) > self._max_blocks:
            return Translated(Outcome.OVER_LIMIT)
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
        parent_hash = event.parent_block_hash
        parent: BlockKey | None = None
        if parent_hash is not None:
            parent = cast("BlockKey | None", self._keys.get(parent_hash))
            if parent is None:  # once trimmed, it may be a pruned one
                return Translated(Outcome.PARENT_PRUNED if self.trimmed else Outcome.UNKNOWN_PARENT)
            if not self._holds(self.worker, parent):  # the cap pruned it
                return Translated(Outcome.PARENT_PRUNED)
        seed = self._seed(lora_name_of(event), cache_salt_of(event))
        try:
            keys = self._keys_of(event, len(hashes), seed, parent)
        except (ValueError, OverflowError):  # ids that are not uint32, or do not fill the blocks
            return Translated(Outcome.MALFORMED)
        tier = self._config.tier_of(event.medium)
        known = self._keys
        if tier == Tier.GPU:
            known.put_many(hashes, keys)
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

    def _seed(self, lora_name: str | None, cache_salt: str | None) -> int:
        seeds = self._seeds
        seed = seeds.get((lora_name, cache_salt))
        if seed is None:
            if len(seeds) > 1024:  # salts can be per user: keep the memo bounded
                seeds.clear()
            seed = seeds[(lora_name, cache_salt)] = cache_seed(lora_name, cache_salt)
        return seed

    def _keys_of(
        self, event: BlockStored, blocks: int, seed: int, parent: BlockKey | None
    ) -> Sequence[BlockKey]:
        """Keys of the event's blocks; ``ValueError`` unless its ids fill exactly ``blocks``.

        From the wire, the native core keys the raw msgpack ids and returns ``array('Q')``:
        neither tokens nor keys become Python ints on their way into the index."""
        tokens = event.token_ids
        if isinstance(tokens, msgspec.Raw) and _native_msgpack_keys is not None:
            prev = seed if parent is None else parent
            keys = _native_msgpack_keys(tokens, self.block_size, prev, blocks)
            return cast("Sequence[BlockKey]", keys)
        ids = event.tokens()
        if len(ids) != blocks * self.block_size:
            raise EventDecodeError("token_ids do not fill block_hashes")
        return block_keys(ids, self.block_size, seed, parent)

    def _removed(self, event: BlockRemoved) -> Translated:
        if len(event.block_hashes) > self._max_blocks:
            return Translated(Outcome.OVER_LIMIT)
        tier = self._config.tier_of(event.medium)
        if not self._tiers:  # every known block is held on GPU only: one native call
            if tier != Tier.GPU:
                return Translated(Outcome.APPLIED)
            gone = cast("Sequence[BlockKey]", self._keys.take_many(event.block_hashes))
            if gone:
                self._index.apply(self.worker, RemoveBlocks(gone, tier))
            return Translated(Outcome.APPLIED, len(gone))
        return self._removed_tiered(event, tier)

    def _removed_tiered(self, event: BlockRemoved, tier: Tier) -> Translated:
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
            keys.append(BlockKey(key))
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
