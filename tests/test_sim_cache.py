"""The block cache's vLLM prefix-caching semantics, event by event."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvgate.backends.sim.cache import BlockCache
from kvgate.backends.sim.lora import Adapter
from kvgate.index.config import IndexConfig
from kvgate.index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventEncoder,
    EventFeed,
)
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.metrics import IndexMetrics
from kvgate.index.table import EventIndex
from kvgate.index.types import PrefixMatch, WorkerId, WorkerKey


def _stored(
    cache: BlockCache, hashes: list[int], parent: int | None = None, salt: str | None = None
) -> list[int]:
    """Allocate and cache a chain of full blocks (4 tokens each) for one holder."""
    blocks = cache.allocate(len(hashes))
    assert blocks is not None
    tokens = [t for h in hashes for t in (h, h, h, h)]
    cache.register(blocks, hashes, parent, tokens, salt)
    return blocks


def _drain(cache: BlockCache) -> list[object]:
    events, cache.events = cache.events, []
    return list(events)


def test_a_chain_is_one_block_stored_event() -> None:
    cache = BlockCache(num_blocks=8, block_size=4)
    _stored(cache, [11, 12, 13])
    [event] = _drain(cache)
    assert event == BlockStored(
        block_hashes=[11, 12, 13], parent_block_hash=None, token_ids=[11] * 4 + [12] * 4 + [13] * 4,
        block_size=4, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    snap = cache.snapshot()
    assert snap.gpu[12].parent == 11 and snap.gpu[12].token_ids == (12, 12, 12, 12)
    assert cache.usage == 3 / 8


def test_blocks_in_use_are_never_evicted() -> None:
    cache = BlockCache(num_blocks=3, block_size=4)
    _stored(cache, [1, 2, 3])
    assert cache.allocate(1) is None
    assert _drain(cache)[1:] == []
    assert set(cache.snapshot().gpu) == {1, 2, 3}


def test_free_blocks_are_evicted_lru_and_tail_first() -> None:
    cache = BlockCache(num_blocks=4, block_size=4)
    first = _stored(cache, [1, 2])
    cache.free(first[::-1])  # a request frees its blocks tail first
    second = _stored(cache, [3, 4], parent=None)
    cache.free(second[::-1])
    _drain(cache)
    cache.allocate(3)
    removed = [e.block_hashes[0] for e in _drain(cache) if isinstance(e, BlockRemoved)]
    assert removed == [2, 1, 4]  # oldest request first, its tail before its head
    assert set(cache.snapshot().gpu) == {3}


def test_a_hit_takes_a_free_block_off_the_queue() -> None:
    cache = BlockCache(num_blocks=2, block_size=4)
    blocks = _stored(cache, [1, 2])
    cache.free(blocks[::-1])
    hit = cache.gpu_prefix([1, 2, 99], limit=3)
    assert hit == blocks
    assert cache.evictable(hit[:1]) == 1
    cache.touch(hit[:1])
    assert cache.free_blocks == 1
    cache.allocate(1)
    assert [e.block_hashes for e in _drain(cache) if isinstance(e, BlockRemoved)] == [[2]]
    assert cache.allocate(1) is None


def test_a_hash_held_twice_is_removed_with_its_last_copy() -> None:
    cache = BlockCache(num_blocks=2, block_size=4)
    a = _stored(cache, [7])
    b = _stored(cache, [7])  # vLLM recomputes a fully cached prompt's last block
    assert [type(e) for e in _drain(cache)] == [BlockStored, BlockStored]
    cache.free(a)
    cache.free(b)
    cache.allocate(1)
    assert _drain(cache) == []
    assert 7 in cache.snapshot().gpu
    cache.allocate(1)
    assert _drain(cache) == [BlockRemoved(block_hashes=[7], medium="GPU")]


def test_evicted_blocks_move_to_the_cpu_tier() -> None:
    cache = BlockCache(num_blocks=2, block_size=4, cpu_blocks=1)
    blocks = _stored(cache, [1, 2], salt="s")
    cache.free(blocks[::-1])
    _drain(cache)
    cache.allocate(2)
    events = _drain(cache)
    assert events == [
        BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=[2] * 4, block_size=4,
                    lora_id=None, medium="CPU", lora_name=None),
        BlockRemoved(block_hashes=[2], medium="GPU"),
        BlockRemoved(block_hashes=[2], medium="CPU"),
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * 4, block_size=4,
                    lora_id=None, medium="CPU", lora_name=None,
                    extra_keys=[["s"]]),
        BlockRemoved(block_hashes=[1], medium="GPU"),
    ]  # fmt: skip
    snap = cache.snapshot()
    assert snap.gpu == {} and list(snap.cpu) == [1]
    assert cache.cpu_prefix([1, 2], start=0, limit=2) == 1


def test_reset_needs_an_idle_cache_and_clears_every_tier() -> None:
    cache = BlockCache(num_blocks=2, block_size=4, cpu_blocks=2)
    blocks = _stored(cache, [1])
    assert not cache.reset()
    cache.free(blocks)
    _drain(cache)
    assert cache.reset()
    assert _drain(cache) == [AllBlocksCleared()]
    assert cache.snapshot().gpu == {} and cache.snapshot().cpu == {}


def test_salted_blocks_are_keyed_with_the_salt_by_kvgate() -> None:
    """The salt travels as vLLM publishes it, so kvgate keys the blocks in the salt's own
    chain: a salted repeat matches, the same tokens without the salt do not."""
    cache = BlockCache(num_blocks=4, block_size=4)
    _stored(cache, [1, 2], salt="tenant-a")
    encoder = EventEncoder()
    feed_index = EventIndex()
    feed = EventFeed(
        WorkerId("http://sim"),
        0,
        feed_index,
        IndexConfig(block_size=4),
        block_size=4,
        metrics=IndexMetrics(CollectorRegistry()),
    )
    feed.apply_payload(encoder.encode(EventBatch(0.0, list(_drain(cache)), 0)))
    tokens = [1] * 4 + [2] * 4
    salted = block_keys(tokens, 4, cache_seed(None, "tenant-a"))
    plain = block_keys(tokens, 4, cache_seed(None, None))
    worker = WorkerKey(WorkerId("http://sim"), 0)
    assert feed_index.find_matches(salted) == {worker: PrefixMatch(gpu=2)}
    assert feed_index.find_matches(plain) == {}


def test_adapter_blocks_keep_their_adapter_on_the_cpu_tier() -> None:
    """vLLM's BlockStored for an adapter's request: ``lora_id``, ``lora_name`` and the name in
    every block's extra keys (before the salt on the first block), on every tier."""
    sql = Adapter("sql", 7, "/adapters/sql")
    cache = BlockCache(num_blocks=2, block_size=4, cpu_blocks=4)
    blocks = cache.allocate(2)
    assert blocks is not None
    cache.register(blocks, [1, 2], None, [1] * 4 + [2] * 4, "s", lora=sql)
    [gpu] = _drain(cache)
    assert isinstance(gpu, BlockStored)
    assert (gpu.lora_id, gpu.lora_name, gpu.extra_keys) == (7, "sql", [["sql", "s"], ["sql"]])
    cache.free(blocks[::-1])
    assert cache.allocate(2) is not None  # both evicted to the CPU tier
    offloaded = [e for e in _drain(cache) if isinstance(e, BlockStored)]
    assert [(e.block_hashes, e.lora_id, e.lora_name, e.extra_keys) for e in offloaded] == [
        ([2], 7, "sql", [["sql"]]),
        ([1], 7, "sql", [["sql", "s"]]),
    ]
