"""Per cache domain: engine events (engine hashes) → index operations (kvgate keys).

kvgate recomputes its own key for every stored block from the event's ``token_ids``, chained
from the key of the parent block (looked up by the parent's engine hash), and remembers
engine hash → key so that later ``BlockRemoved`` events (which carry only engine hashes) can be
applied. The map shrinks with removals and clears, and with the table: once it maps more
hashes than twice what the domain holds (the cap pruned them), the hashes of blocks the domain
no longer holds are forgotten.

Two ways in, one result: ``ingest`` hands a whole payload to the index's native path while the
domain holds nothing off GPU; ``apply`` takes one decoded event. Either counts what happened
into a ``BatchResult``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import msgspec

from kvgate.index import _native
from kvgate.index.api import BatchResult, RemoveBlocks, StoreBlocks
from kvgate.index.config import IndexConfig
from kvgate.index.errors import EventDecodeError
from kvgate.index.events._wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.memo import BoundedMemo
from kvgate.index.table import EventIndex
from kvgate.index.types import BlockKey, EngineBlockHash, Tier, WorkerKey

log = logging.getLogger(__name__)

_GPU_ONLY = 1 << Tier.GPU
_MAPPED_SLACK = 1024  # hashes mapped beyond twice the domain's blocks before it is compacted
_SEEDS = 1024  # (LoRA name, cache salt) -> chain seed; salts can be per user


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


class Translator:
    """Applies one cache domain's events to the ``EventIndex``."""

    def __init__(
        self, worker: WorkerKey, index: EventIndex, config: IndexConfig, block_size: int
    ) -> None:
        self.worker = worker
        self._index = index
        self._config = config
        self.block_size = block_size
        self._keys = _native.KeyMap()
        self._tiers: dict[EngineBlockHash, int] = {}  # only hashes held in tiers other than GPU
        self._seeds = BoundedMemo[tuple[str | None, str | None], int](_SEEDS)
        self._root_seed = cache_seed(None, None)
        self.mismatched = False
        self.seen_block_size: int | None = None  # of mismatched events, until reported
        self.trimmed = False  # hashes of pruned blocks were forgotten since the last clear
        self._max_blocks = config.max_event_blocks
        self._holds = index.holds

    def __len__(self) -> int:
        return len(self._keys)

    def ingest(self, payload: bytes) -> BatchResult | None:
        """A whole payload applied by the index's native path, if this domain's state allows
        (every known block on GPU only, the block size matched so far) and the payload has the
        shape it takes; None: nothing was applied (decode it and ``apply`` its events)."""
        if self._tiers or self.mismatched:
            return None
        result = self._index.ingest(
            self.worker,
            payload,
            self._keys,
            block_size=self.block_size,
            root_seed=self._root_seed,
            max_blocks=self._max_blocks,
        )
        if result is not None and self.trimmed:  # as _stored: an unknown parent may be pruned
            result.pruned_parent += result.unknown_parent
            result.unknown_parent = 0
        return result

    def apply(self, event: KvEvent, result: BatchResult) -> None:
        """Apply one decoded event, counted into ``result``."""
        if self.mismatched and not isinstance(event, AllBlocksCleared):
            result.mismatched += 1
        elif isinstance(event, BlockStored):
            self._stored(event, result)
        elif isinstance(event, BlockRemoved):
            self._removed(event, result)
        else:
            self.clear()
            result.cleared += 1

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

    def _over_limit(self, result: BatchResult) -> None:
        """An event past ``max_event_blocks``: the domain is cleared (the caller counts it)."""
        self.clear()
        result.over_limit += 1

    def _stored(self, event: BlockStored, result: BatchResult) -> None:
        if len(event.block_hashes) > self._max_blocks:
            self._over_limit(result)
            return
        if event.block_size != self.block_size:
            self._mismatch(event.block_size)
            result.mismatched += 1
            return
        hashes = event.block_hashes
        parent_hash = event.parent_block_hash
        parent: BlockKey | None = None
        if parent_hash is not None:
            parent = cast("BlockKey | None", self._keys.get(parent_hash))
            if parent is None:  # once trimmed, it may be a pruned one
                if self.trimmed:
                    result.pruned_parent += 1
                else:
                    result.unknown_parent += 1
                return
            if not self._holds(self.worker, parent):  # the cap pruned it
                result.pruned_parent += 1
                return
        seed = self._seed(lora_name_of(event), cache_salt_of(event))
        try:
            keys = self._keys_of(event, len(hashes), seed, parent)
        except (ValueError, OverflowError):  # ids that are not uint32, or do not fill the blocks
            result.malformed += 1
            return
        tier = self._config.tier_of(event.medium)
        self._map(hashes, keys, tier)
        self._index.apply(self.worker, StoreBlocks(keys, tier, parent))
        result.stored_events += 1
        result.stored_blocks += len(keys)

    def _mismatch(self, block_size: int) -> None:
        """Events of another block size: this worker's events are not indexed (until a
        restart); logged once."""
        if not self.mismatched:
            log.warning(
                "%s: events have block_size %d but kvgate reads them with %d; this worker's "
                "events are not indexed (the engine's size is adopted unless the index's block "
                "size is set: see /ready and /debug/index)",
                self.worker,
                block_size,
                self.block_size,
            )
            self.mismatched = True
            self.seen_block_size = block_size
            self.clear()

    def _map(self, hashes: Sequence[EngineBlockHash], keys: Sequence[BlockKey], tier: Tier) -> None:
        """Remember engine hash → key for the stored blocks, and their tiers off GPU."""
        known = self._keys
        if tier == Tier.GPU:
            known.put_many(hashes, keys)
            if self._tiers:
                for engine_hash in hashes:
                    if engine_hash in self._tiers:
                        self._tiers[engine_hash] |= _GPU_ONLY
            return
        for engine_hash, key in zip(hashes, keys, strict=True):
            held = self._tiers.get(engine_hash, _GPU_ONLY if engine_hash in known else 0)
            known[engine_hash] = key
            self._tiers[engine_hash] = held | (1 << tier)

    def _seed(self, lora_name: str | None, cache_salt: str | None) -> int:
        domain = (lora_name, cache_salt)
        seed = self._seeds.get(domain)
        return self._seeds.put(domain, cache_seed(*domain)) if seed is None else seed

    def _keys_of(
        self, event: BlockStored, blocks: int, seed: int, parent: BlockKey | None
    ) -> Sequence[BlockKey]:
        """Keys of the event's blocks; ``ValueError`` unless its ids fill exactly ``blocks``.

        From the wire, the native core keys the raw msgpack ids and returns ``array('Q')``:
        neither tokens nor keys become Python ints on their way into the index."""
        tokens = event.token_ids
        if isinstance(tokens, msgspec.Raw):
            prev = seed if parent is None else parent
            keys = _native.chain_keys_msgpack(tokens, self.block_size, prev, blocks)
            return cast("Sequence[BlockKey]", keys)
        ids = event.tokens()
        if len(ids) != blocks * self.block_size:
            raise EventDecodeError("token_ids do not fill block_hashes")
        return block_keys(ids, self.block_size, seed, parent)

    def _removed(self, event: BlockRemoved, result: BatchResult) -> None:
        if len(event.block_hashes) > self._max_blocks:
            self._over_limit(result)
            return
        result.removed_events += 1
        tier = self._config.tier_of(event.medium)
        if self._tiers:
            result.removed_blocks += self._removed_tiered(event, tier)
        elif tier == Tier.GPU:  # every known block is held on GPU only: one native call
            gone = cast("Sequence[BlockKey]", self._keys.take_many(event.block_hashes))
            if gone:
                self._index.apply(self.worker, RemoveBlocks(gone, tier))
            result.removed_blocks += len(gone)

    def _removed_tiered(self, event: BlockRemoved, tier: Tier) -> int:
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
        return len(keys)
