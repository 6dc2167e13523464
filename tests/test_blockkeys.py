"""kvgate block keys: chaining, seeds, full blocks only, and the event translator."""

from __future__ import annotations

from array import array

import pytest
import xxhash

from kvgate.index.api import BatchResult, ClearAll, RemoveBlocks, StoreBlocks
from kvgate.index.config import IndexConfig
from kvgate.index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    Translator,
    cache_salt_of,
)
from kvgate.index.keys import block_keys, cache_seed, text_block_keys
from kvgate.index.table import EventIndex
from kvgate.index.types import PrefixMatch, WorkerId, WorkerKey

SEED = cache_seed(None, None)
W = WorkerKey(WorkerId("http://w"), 0)


def test_keys_are_chained_xxh3_of_le_uint32_tokens() -> None:
    tokens = list(range(10))
    keys = block_keys(tokens, 4, SEED)
    assert len(keys) == 2  # the trailing partial block has no key
    first = xxhash.xxh3_64_intdigest(array("I", tokens[:4]).tobytes(), SEED)
    assert keys[0] == first
    assert keys[1] == xxhash.xxh3_64_intdigest(array("I", tokens[4:8]).tobytes(), first)
    assert block_keys(tokens[4:8], 4, 123, parent=keys[0]) == keys[1:]
    assert block_keys(array("I", tokens), 4, SEED) == keys
    assert block_keys([1, 2, 3], 4, SEED) == []


def test_seed_separates_lora_and_salt() -> None:
    seeds = {
        cache_seed(None, None),
        cache_seed("a", None),
        cache_seed(None, "a"),
        cache_seed("a", "a"),
        cache_seed("ab", None),
        cache_seed("a", "b"),
    }
    assert len(seeds) == 6
    tokens = list(range(8))
    assert block_keys(tokens, 4, cache_seed("x", None)) != block_keys(tokens, 4, SEED)


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1], 0, SEED)
    with pytest.raises(OverflowError):
        block_keys([-1, 2], 1, SEED)
    assert len(text_block_keys("x" * 100, 32, SEED)) == 3


def apply(translator: Translator, event: KvEvent) -> BatchResult:
    """What one event did (its counts in a batch of its own)."""
    result = BatchResult()
    translator.apply(event, result)
    return result


def make_translator(block_size: int = 4) -> tuple[Translator, EventIndex]:
    index = EventIndex()
    return Translator(W, index, IndexConfig(block_size=block_size), block_size), index


def test_translator_recomputes_keys_and_maps_removals() -> None:
    translator, index = make_translator()
    tokens = list(range(16))
    keys = block_keys(tokens, 4, SEED)
    assert apply(translator, BlockStored([11, 12], None, tokens[:8], 4)).stored_events == 1
    assert apply(translator, BlockStored([13, 14], 12, tokens[8:], 4)).stored_events == 1
    assert index.find_matches(keys) == {W: PrefixMatch(gpu=4)}
    apply(translator, BlockRemoved([14, 999]))
    assert index.find_matches(keys) == {W: PrefixMatch(gpu=3)}
    assert len(translator) == 3
    apply(translator, AllBlocksCleared())
    assert len(translator) == 0 and index.entry_count() == 0


def test_translator_tiers_keep_the_mapping_until_last_tier_goes() -> None:
    translator, index = make_translator()
    tokens = list(range(8))
    keys = block_keys(tokens, 4, SEED)
    apply(translator, BlockStored([1, 2], None, tokens, 4, None, "GPU"))
    apply(translator, BlockStored([1, 2], None, tokens, 4, None, "cpu"))
    apply(translator, BlockRemoved([2], "GPU"))
    assert index.find_matches(keys) == {W: PrefixMatch(gpu=1, cpu=1)}
    apply(translator, BlockRemoved([2], "CPU"))
    assert len(translator) == 1
    assert index.find_matches(keys) == {W: PrefixMatch(gpu=1)}
    apply(translator, BlockStored([3], None, list(range(100, 104)), 4, None, "NVME"))
    assert index.find_matches(block_keys(list(range(100, 104)), 4, SEED)) == {
        W: PrefixMatch(disk=1)
    }


def test_translator_unknown_parent_mismatch_malformed() -> None:
    translator, index = make_translator()
    assert apply(translator, BlockStored([5], 4, [0] * 4, 4)).unknown_parent == 1
    assert apply(translator, BlockStored([5], None, [0] * 5, 4)).malformed == 1
    assert apply(translator, BlockStored([5], None, [0] * 8, 8)).mismatched == 1
    # Once mismatched, the worker's events are not indexed (until an engine restart).
    assert apply(translator, BlockStored([5], None, [0] * 4, 4)).mismatched == 1
    assert index.entry_count() == 0
    translator.clear(restarted=True)
    assert apply(translator, BlockStored([5], None, [0] * 4, 4)).stored_events == 1


def test_lora_and_salt_from_events_match_request_seeds() -> None:
    translator, index = make_translator()
    tokens = list(range(4))
    event = BlockStored([1], None, tokens, 4, 7, "GPU", "adapter", [["adapter", "salty"]])
    assert cache_salt_of(event) == "salty"
    apply(translator, event)
    assert index.find_matches(block_keys(tokens, 4, cache_seed("adapter", "salty")))
    assert not index.find_matches(block_keys(tokens, 4, SEED))


def test_indexer_ops_are_the_api() -> None:
    index = EventIndex()
    keys = block_keys(list(range(8)), 4, SEED)
    index.apply(W, StoreBlocks(keys))
    index.apply(W, RemoveBlocks(keys[1:]))
    assert index.find_matches(keys) == {W: PrefixMatch(gpu=1)}
    index.apply(W, ClearAll())
    assert index.find_matches(keys) == {}
