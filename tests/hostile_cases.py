"""Crafted event streams that froze or slowed kvgate (issue 12), run in a child process.

``python tests/hostile_cases.py CASE TABLE`` prints ``ok`` when the case ran to completion and
its checks held. tests/test_events_hostile.py runs each with a deadline: a walk that never
ends holds the GIL, so only a separate process can be stopped and reported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: find the repository (after PYTHONPATH, which
    # the sanitizer test points at its instrumented copy of the package)
    sys.path.append(str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry

from kvgate.bench.hostile import (
    BLOCK,
    colliding_engine_hashes,
    forge_block,
    payload,
    removed,
    stored,
)
from kvgate.index.api import RemoveBlocks, StoreBlocks
from kvgate.index.config import IndexConfig
from kvgate.index.events import EventFeed
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.metrics import IndexMetrics
from kvgate.index.table import EventIndex, TableKind, new_table
from kvgate.index.types import BlockKey, WorkerId, WorkerKey

WORKER = WorkerId("http://attacker")
DOMAIN = WorkerKey(WORKER, 0)
SEED = cache_seed(None, None)


def make_feed(table: TableKind, max_entries: int, **config: Any) -> tuple[EventFeed, EventIndex]:
    index = EventIndex(max_entries, new_table(table))
    feed = EventFeed(
        WORKER,
        0,
        index,
        IndexConfig(block_size=BLOCK, **config),
        block_size=BLOCK,
        metrics=IndexMetrics(CollectorRegistry()),
        native=table == "native",
    )
    return feed, index


def tokens_of(n: int, start: int = 0) -> list[int]:
    return [start + i for i in range(n)]


def freeze_event_path(table: TableKind) -> None:
    """The six payloads of issue 12: block A is pruned while its engine hash is still mapped;
    a child whose tokens are forged so that its key is key(A), then a grandchild, then the
    removal that walked up a chain whose parent was itself."""
    feed, index = make_feed(table, max_entries=2)
    tokens_a = tokens_of(BLOCK, 100)
    (key_a,) = block_keys(tokens_a, BLOCK, SEED)
    feed.apply_payload(payload([stored([1], None, tokens_a)]))
    feed.apply_payload(payload([stored([2], None, tokens_of(BLOCK, 200))]))
    feed.apply_payload(payload([stored([3], None, tokens_of(BLOCK, 300))]))  # the cap prunes A
    feed.apply_payload(payload([stored([4], 1, forge_block(key_a, key_a))]))  # key(A) under A
    feed.apply_payload(payload([stored([5], 4, tokens_of(BLOCK, 500))]))
    feed.apply_payload(payload([removed([4])]))
    assert index.entry_count() <= 2
    feed.apply_payload(payload([{"type": "AllBlocksCleared"}]))
    assert index.entry_count() == 0
    assert index.block_count() == 0, "records of the forged chain were never freed"


def cycles_through_the_table(table: TableKind) -> None:
    """Links that would close a cycle, given straight to the table: a block stored as its own
    parent, and a record of unknown ancestry given a parent that descends from it."""
    index = EventIndex(1_000_000, new_table(table))
    a, b, c, x, u = (BlockKey(v) for v in (11, 12, 13, 14, 15))
    index.apply(DOMAIN, StoreBlocks([a], parent=a))  # a is its own parent
    index.apply(DOMAIN, StoreBlocks([b, c], parent=a))
    index.apply(DOMAIN, RemoveBlocks([a]))  # walks up from b
    index.apply(DOMAIN, StoreBlocks([x], parent=u))  # u: unknown ancestry, x below it
    index.apply(DOMAIN, StoreBlocks([u], parent=x))  # u below x would close u -> x -> u
    index.apply(DOMAIN, RemoveBlocks([u, x]))
    index.apply(DOMAIN, StoreBlocks([a, b, c, x, u]))
    index.apply(DOMAIN, RemoveBlocks([a, c, u, b, x]))
    assert index.entry_count() == 0
    assert index.block_count() == 0, "records left behind: the links form a cycle"


def root_first_removal(table: TableKind) -> None:
    """A 200,000-block chain stored in events of 10,000 blocks, then removed root first, one
    block per event as vLLM sends removals (64 events per payload). Each removal used to walk
    up to the chain's root: quadratic (40,000 blocks took 60 s)."""
    blocks, per_event = 200_000, 10_000
    feed, index = make_feed(table, max_entries=1_000_000)
    for start in range(0, blocks, per_event):
        parent = start - 1 if start else None
        hashes = list(range(start, start + per_event))
        tokens = [(i * 7) % 50_000 for i in range(start * BLOCK, (start + per_event) * BLOCK)]
        feed.apply_payload(payload([stored(hashes, parent, tokens)]))
    assert index.entry_count() == blocks
    for start in range(0, blocks, 64):
        events = [removed([h]) for h in range(start, min(blocks, start + 64))]
        feed.apply_payload(payload(events))
    assert index.entry_count() == 0
    assert index.block_count() == 0


def hash_flooding(table: TableKind) -> None:
    """400,000 engine hashes chosen to share one home cell of the engine-hash map: without a
    secret seed every insertion probes the whole cluster (quadratic)."""
    feed, index = make_feed(table, max_entries=1_000_000)
    hashes = colliding_engine_hashes(400_000)
    for start in range(0, len(hashes), 10_000):
        chunk = hashes[start : start + 10_000]
        tokens = [start] * BLOCK + [0] * ((len(chunk) - 1) * BLOCK)  # a chain of its own
        feed.apply_payload(payload([stored(chunk, None, tokens)]))
    assert feed.mapped_blocks() == len(hashes)
    assert index.entry_count() == len(hashes)


CASES: dict[str, Callable[[TableKind], None]] = {
    "freeze_event_path": freeze_event_path,
    "cycles_through_the_table": cycles_through_the_table,
    "root_first_removal": root_first_removal,
    "hash_flooding": hash_flooding,
}

if __name__ == "__main__":
    name, kind = sys.argv[1], sys.argv[2]
    assert kind in ("native", "python")
    CASES[name](kind)  # type: ignore[arg-type]
    print("ok")
