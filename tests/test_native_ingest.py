"""The native batch ingestion against the general path: the same payloads, the same result.

Random streams of vLLM/SGLang-shaped payloads (both encodings) mix what the native path takes
(GPU stores and removals, known and unknown parents, malformed token ids, salt-free extra keys,
bytes and signed hashes) with what it must hand back (CPU tier, LoRA, cache salts,
AllBlocksCleared, another rank or block size, garbage) and what a hostile publisher sends
(a key twice in an event map, deep nesting, many and huge ranks, events past the block bound).
After every payload the two feeds must agree on the batch result, every chain's match, the
entry counts and every metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvgate.index.api import BatchResult
from kvgate.index.config import IndexConfig
from kvgate.index.events import EventFeed
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.metrics import IndexMetrics
from kvgate.index.table import EventIndex, TableKind, new_table
from kvgate.index.types import BlockKey, WorkerId, WorkerKey

BS = 4
WORKER = WorkerId("http://engine")
PATHS = [
    list(range(40)),
    list(range(16)) + [500 + i for i in range(24)],
    [900 + i for i in range(40)],
]
BLOCKS = len(PATHS[0]) // BS


def engine_hash(path: int, block: int) -> int:
    """An engine's opaque hash of a prefix (paths 0 and 1 share their first 4 blocks)."""
    if path == 1 and block < 4:
        path = 0
    return (path * 1_000_003 + block * 7919 + 1) * 0x9E3779B97F4A7C15 % 2**64


def wire_hash(value: int, form: str) -> Any:
    if form == "bytes":  # vLLM with int hashes off: 32 raw bytes, the int is the low 8
        return bytes(24) + value.to_bytes(8, "big")
    if form == "signed" and value >= 2**63:  # SGLang: signed 64-bit
        return value - 2**64
    return value


@st.composite
def stored_st(draw: st.DrawFn, common: bool) -> dict[str, Any]:
    """``common``: only what the native path takes (flaws and unknown parents included)."""
    path = draw(st.integers(0, 2))
    start = draw(st.sampled_from([0, 0, draw(st.integers(0, BLOCKS - 1))]))
    end = draw(st.integers(start + 1, BLOCKS))
    form = draw(st.sampled_from(["int", "int", "bytes", "signed"]))
    tokens: Any = PATHS[path][start * BS : end * BS]
    flaw = draw(st.sampled_from([None] * 8 + ["short", "negative", "huge", "text"]))
    if flaw == "short":
        tokens = tokens[:-1]
    elif flaw == "negative":
        tokens = [-1, *tokens[1:]]
    elif flaw == "huge":
        tokens = [2**40, *tokens[1:]]
    elif flaw == "text":
        tokens = "not tokens"
    parent = None
    if start:
        parent_block = start - 1 if draw(st.integers(0, 9)) else BLOCKS + 5  # never stored
        parent = wire_hash(engine_hash(path, parent_block), form)
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [wire_hash(engine_hash(path, b), form) for b in range(start, end)],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS if common else draw(st.sampled_from([BS] * 6 + [BS * 2])),
        "lora_id": None,
        "medium": draw(st.sampled_from(["GPU", "GPU", None] if common else ["GPU", "CPU"])),
    }
    kinds = ["none", "nulls", "absent"] + ([] if common else ["salt", "lora"])
    extra = draw(st.sampled_from(kinds))
    if extra == "nulls":
        event["lora_name"] = None
        event["extra_keys"] = [None] * (end - start)
    elif extra == "salt":
        event["lora_name"] = None
        event["extra_keys"] = [["salt-a"], *([None] * (end - start - 1))]
    elif extra == "lora":
        event["lora_name"] = "adapter"
    elif extra == "absent":
        del event["lora_id"], event["medium"]
    return event


@st.composite
def removed_st(draw: st.DrawFn, common: bool) -> dict[str, Any]:
    path = draw(st.integers(0, 2))
    blocks = draw(st.lists(st.integers(0, BLOCKS + 2), min_size=1, max_size=3))
    form = draw(st.sampled_from(["int", "bytes", "signed"]))
    return {
        "type": "BlockRemoved",
        "block_hashes": [wire_hash(engine_hash(path, b), form) for b in blocks],
        "medium": draw(st.sampled_from(["GPU", None] if common else ["GPU", "CPU"])),
    }


common_event_st = st.one_of(stored_st(common=True), stored_st(common=True), removed_st(True))
event_st = st.one_of(
    common_event_st,
    stored_st(common=False),
    removed_st(common=False),
    st.just({"type": "AllBlocksCleared"}),
)


def as_array(event: dict[str, Any]) -> list[Any]:
    fields = {
        "BlockStored": [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
        ],
        "BlockRemoved": ["block_hashes", "medium"],
        "AllBlocksCleared": [],
    }[event["type"]]
    present = [f for f in fields if f in event]
    return [event["type"], *(event[f] for f in fields[: len(present)])]


def encode_map(event: dict[str, Any], repeat: str | None, nesting: int) -> bytes:
    """``event`` as a msgpack map, with ``repeat`` (a key of it) sent twice and an
    ``extra_keys`` nested ``nesting`` arrays deep (0: as it is)."""
    pairs = list(event.items()) + ([(repeat, event[repeat])] if repeat else [])
    raw = b""
    if nesting:
        pairs = [(k, v) for k, v in pairs if k != "extra_keys"]
        raw = msgspec.msgpack.encode("extra_keys") + b"\x91" * nesting + b"\xc0"
    count = len(pairs) + (1 if nesting else 0)
    out = bytes([0x80 | count]) if count < 16 else bytes([0xDE, 0, count])
    for name, value in pairs:
        out += msgspec.msgpack.encode(name) + msgspec.msgpack.encode(value)
    return out + raw


@st.composite
def hostile_payload_st(draw: st.DrawFn) -> bytes:
    """Map-tagged events with a key twice or deep nesting, under any rank."""
    events = draw(st.lists(draw(st.sampled_from([common_event_st, event_st])), max_size=4))
    encoded = []
    for event in events:
        repeat = draw(st.sampled_from([None, None, *sorted(event)]))
        encoded.append(encode_map(event, repeat, draw(st.sampled_from([0, 0, 40, 3000]))))
    rank = draw(st.sampled_from([0, 2, 3, 5, 2**40]))
    head = b"\x93" + msgspec.msgpack.encode(1.5)
    count = len(encoded)
    return head + bytes([0x90 | count]) + b"".join(encoded) + msgspec.msgpack.encode(rank)


@st.composite
def payload_st(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 30)) == 0:
        return draw(st.sampled_from([b"\xc1garbage", b"\x93\x01", msgspec.msgpack.encode([1.0])]))
    if draw(st.integers(0, 5)) == 0:
        return draw(hostile_payload_st())
    events = draw(st.lists(draw(st.sampled_from([common_event_st] * 3 + [event_st])), max_size=6))
    if draw(st.booleans()):
        body: list[Any] = [1.5, [as_array(e) for e in events]]
    else:
        body = [1.5, events]
    rank = draw(st.sampled_from(["absent", "none", 0, 0, 1, 2, 4, 2**40]))
    if rank != "absent":
        body.append(None if rank == "none" else rank)
    return msgspec.msgpack.encode(body)


@dataclass
class Side:
    """One feed under test, with its index and its metrics."""

    feed: EventFeed
    index: EventIndex
    registry: CollectorRegistry


def make_feed(table: TableKind, native: bool, max_entries: int) -> Side:
    index = EventIndex(max_entries, new_table(table))
    registry = CollectorRegistry()
    feed = EventFeed(
        WORKER,
        0,
        index,
        # small bounds, so that random streams cross them
        IndexConfig(
            block_size=BS, max_entries=10_000, max_event_blocks=8, max_ranks_per_endpoint=3
        ),
        block_size=BS,
        metrics=IndexMetrics(registry),
        clock=lambda: 2.0,
        native=native,
    )
    return Side(feed, index, registry)


def samples(side: Side) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for metric in side.registry.collect():
        for sample in metric.samples:
            if not sample.name.endswith("_created"):  # when each registry made its series
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


QUERIES = [
    [BlockKey(k) for k in block_keys(path, BS, seed)]
    for path in PATHS
    for seed in (cache_seed(None, None), cache_seed(None, "salt-a"), cache_seed("adapter", None))
]


def state(side: Side) -> tuple[Any, ...]:
    index, feed = side.index, side.feed
    matches = [
        sorted((str(w), m.gpu, m.cpu, m.disk) for w, m in index.find_matches(q).items())
        for q in QUERIES
    ]
    ranks = sorted((t.dp_rank, len(feed.translator(t.dp_rank))) for t in feed.ranks())
    return index.entry_count(), matches, ranks, index.pruned, samples(side)


def run(payloads: list[bytes], fast: Side, slow: Side) -> None:
    for payload in payloads:
        got: BatchResult = fast.feed.apply_payload(payload)
        want: BatchResult = slow.feed.apply_payload(payload)
        assert got == want
        assert state(fast) == state(slow)


@pytest.mark.parametrize("max_entries", [1_000_000, 12])
@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(payload_st(), max_size=12))
def test_native_ingest_equals_the_general_path(max_entries: int, payloads: list[bytes]) -> None:
    """Both over the native table (so the cap prunes the same way), with a tight cap too."""
    run(payloads, make_feed("native", True, max_entries), make_feed("native", False, max_entries))


@settings(max_examples=100, deadline=None)
@given(payloads=st.lists(payload_st(), max_size=12))
def test_native_ingest_equals_the_python_table(payloads: list[bytes]) -> None:
    run(payloads, make_feed("native", True, 1_000_000), make_feed("python", False, 1_000_000))


def test_the_common_shape_takes_the_native_path() -> None:
    """A plain vLLM payload is applied in C (the general path is never entered)."""
    side = make_feed("native", True, 1_000_000)
    fast, index = side.feed, side.index
    stored = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": PATHS[0][: 2 * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}

    def no_general_path(*_args: object) -> BatchResult:
        raise AssertionError("the general path was used")

    fast._apply_batch = no_general_path  # type: ignore[method-assign,assignment]
    fast._decoder.decode = no_general_path  # type: ignore[method-assign,assignment]
    result = fast.apply_payload(msgspec.msgpack.encode([1.0, [stored, removed], 0]))
    assert result.events == 2
    assert index.entry_count() == 1
    assert index.find_matches(QUERIES[0])[WorkerKey(WORKER, 0)].gpu == 1
