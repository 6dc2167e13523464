"""Property test of event translation: a simulated engine cache (reference) emits vLLM-style
events; the translator + index must report exactly the engine's cached prefix for every path,
in both wire encodings, across evictions, re-stores and cache resets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvgate.index.config import IndexConfig
from kvgate.index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventEncoder,
    EventFeed,
    KvEvent,
)
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.metrics import IndexMetrics
from kvgate.index.table import EventIndex
from kvgate.index.types import BlockKey, PrefixMatch, WorkerId, WorkerKey

BS = 2
PATHS = [
    list(range(20)),
    list(range(8)) + [50 + i for i in range(12)],
    [90 + i for i in range(20)],
]
WORKER = WorkerId("http://engine")


def engine_hash(tokens: tuple[int, ...]) -> int:
    """An engine's own hash of a block (opaque to kvgate): here, of the whole prefix."""
    return (hash(tokens) * 0x9E3779B97F4A7C15) & (2**64 - 1)


class Engine:
    """Prefix cache of one engine: cached blocks by prefix, emitting vLLM's events."""

    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()

    def request(self, path: int, blocks: int) -> list[KvEvent]:
        tokens = PATHS[path][: blocks * BS]
        prefixes = [tuple(tokens[: (i + 1) * BS]) for i in range(blocks)]
        first_miss = next((i for i, p in enumerate(prefixes) if p not in self.cached), blocks)
        if first_miss == blocks:
            return []
        new = prefixes[first_miss:]
        self.cached.update(new)
        parent = engine_hash(prefixes[first_miss - 1]) if first_miss else None
        return [
            BlockStored(
                [engine_hash(p) for p in new],
                parent,
                tokens[first_miss * BS : blocks * BS],
                BS,
                None,
                "GPU",
            )
        ]

    def evict(self, path: int, block: int) -> list[KvEvent]:
        prefix = tuple(PATHS[path][: (block + 1) * BS])
        if prefix not in self.cached:
            return []
        self.cached.discard(prefix)
        return [BlockRemoved([engine_hash(prefix)], "GPU")]

    def reset(self) -> list[KvEvent]:
        self.cached.clear()
        return [AllBlocksCleared()]

    def held(self, path: int) -> int:
        n = 0
        while n < len(PATHS[path]) // BS and tuple(PATHS[path][: (n + 1) * BS]) in self.cached:
            n += 1
        return n


op_st = st.one_of(
    st.tuples(st.just("request"), st.integers(0, 2), st.integers(1, 10)),
    st.tuples(st.just("evict"), st.integers(0, 2), st.integers(0, 9)),
    st.tuples(st.just("reset"), st.just(0), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op_st, max_size=40), array_tagged=st.booleans())
def test_translated_index_equals_engine_cache(
    ops: list[tuple[str, int, int]], array_tagged: bool
) -> None:
    engine = Engine()
    index = EventIndex()
    feed = EventFeed(
        WORKER,
        0,
        index,
        IndexConfig(block_size=BS),
        block_size=BS,
        metrics=IndexMetrics(CollectorRegistry()),
    )
    seed = cache_seed(None, None)
    queries = [[BlockKey(k) for k in block_keys(p, BS, seed)] for p in PATHS]
    for kind, path, n in ops:
        if kind == "request":
            events = engine.request(path, n)
        elif kind == "evict":
            events = engine.evict(path, n)
        else:
            events = engine.reset()
        payload = EventEncoder(array_tagged=array_tagged).encode(EventBatch(0.0, events))
        feed.apply_payload(payload)
        for p, query in enumerate(queries):
            expected = engine.held(p)
            got = index.find_matches(query).get(WorkerKey(WORKER, 0))
            assert (got or PrefixMatch()).gpu == expected
