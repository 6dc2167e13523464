"""Index-layer benchmark: ingestion rate, find-matches latency, prompt → keys time, memory.

    python -m kvgate.bench.index            # full: 1M entries over 8 workers (a few minutes)
    python -m kvgate.bench.index --quick    # smaller sizes, well under a minute

Prints one line per figure (and ``--json PATH`` writes them). Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import platform
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script, this file's folder comes first on sys.path and this very file would shadow
# the ``index`` package: drop the folder before importing it.
if __name__ == "__main__":
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]

import httpx
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvgate.index import _native
from kvgate.index.api import PromptInput, StoreBlocks
from kvgate.index.config import IndexConfig
from kvgate.index.events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventEncoder,
    EventFeed,
    KvEvent,
)
from kvgate.index.keys import block_keys
from kvgate.index.metrics import IndexMetrics
from kvgate.index.service import KvIndexService
from kvgate.index.table import (
    BlockTable,
    EventIndex,
    NativeBlockTable,
    TableKind,
    new_table,
)
from kvgate.index.types import BlockKey, WorkerId, WorkerKey

BLOCK = 16
RESULTS: dict[str, Any] = {}
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = [time.process_time]


def clock() -> float:
    """CPU time of this process by default: on a shared machine, wall time also counts the
    time the OS gave this core to other processes (``--clock wall`` to measure that)."""
    return _clock[0]()


def report(name: str, value: float, unit: str) -> None:
    RESULTS[name] = {"value": round(value, 3), "unit": unit}
    print(f"{name:<58} {value:>14,.2f} {unit}", flush=True)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ------------------------------------------------------------------ the index
def make_chains(entries: int, workers: int, rng: random.Random) -> list[list[BlockKey]]:
    """50k-token chains sharing a 64-block system prompt, enough for every worker to hold
    ``entries / workers`` blocks with each chain held by two neighbouring workers."""
    chain_len = 3125
    system = [rng.getrandbits(64) for _ in range(64)]
    per_worker = entries // workers // chain_len
    return [
        [BlockKey(k) for k in system + [rng.getrandbits(64) for _ in range(chain_len - 64)]]
        for _ in range(per_worker * workers // 2 + 1)
    ]


def build_index(
    entries: int, workers: int, chains: list[list[BlockKey]], table: TableKind
) -> EventIndex:
    index = EventIndex(max_entries=entries * 2, table=new_table(table))
    per_worker = entries // workers // len(chains[0])
    for w in range(workers):
        worker = WorkerKey(WorkerId(f"http://worker-{w}"), 0)
        for j in range(per_worker):
            index.apply(worker, StoreBlocks(chains[(w * per_worker // 2 + j) % len(chains)]))
    return index


def walk_baseline(index: EventIndex, keys: list[BlockKey]) -> None:
    """The sequential walk of every holder (the Python table's own fallback), as a baseline."""
    table = index.table
    assert isinstance(table, BlockTable)
    for slot in table._slots_in(table._mask[keys[0]]):
        table._walk(slot, keys)


def bench_find_matches(
    entries: int, queries: int, rng: random.Random, tables: list[TableKind]
) -> None:
    chains = make_chains(entries, 8, rng)
    for table in tables:
        started = clock()
        index = build_index(entries, 8, chains, table)
        report(
            f"index build, {table} table (StoreBlocks of pre-computed keys)",
            index.entry_count() / (clock() - started),
            "entries/s",
        )
        report(f"index entries, {table} table", index.entry_count(), "entries")
        for tokens in (1_000, 8_000, 50_000):
            blocks = tokens // BLOCK
            samples, walk = [], []
            prompts = [chains[i % len(chains)][:blocks] for i in range(queries)]
            for keys in prompts:
                t0 = clock()
                matches = index.find_matches(keys)
                samples.append(clock() - t0)
                assert len(matches) == 8
            name = f"find_matches {tokens // 1000}k tokens, {table} table"
            report(f"{name}: median", statistics.median(samples) * 1e6, "us")
            report(f"{name}: p99", percentile(samples, 0.99) * 1e6, "us")
            if table == "python":
                for keys in prompts[: max(10, queries // 10)]:  # slow baseline: fewer samples
                    t0 = clock()
                    walk_baseline(index, keys)
                    walk.append(clock() - t0)
                report(f"{name}: sequential walk, median", statistics.median(walk) * 1e6, "us")
        del index
        gc.collect()


def table_bytes(index: EventIndex) -> int:
    """Memory the native core holds (tracemalloc does not see its malloc/mmap)."""
    table = index.table
    return table.memory_bytes() if isinstance(table, NativeBlockTable) else 0


def bench_memory(entries: int, rng: random.Random, tables: list[TableKind]) -> None:
    chains = make_chains(entries, 8, rng)
    for table in tables:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        index = build_index(entries, 8, chains, table)
        used = tracemalloc.get_traced_memory()[0] - before + table_bytes(index)
        tracemalloc.stop()
        report(
            f"memory per (block, worker) entry, index only, {table} table",
            used / index.entry_count(),
            "bytes",
        )
        report(
            f"memory per block (distinct keys), index only, {table} table",
            used / index.block_count(),
            "bytes",
        )
        del index


# ------------------------------------------------------------------ ingestion
def make_payloads(blocks: int, rng: random.Random, capacity: int | None = None) -> list[bytes]:
    """Map-tagged vLLM payloads: 4 BlockStored events of 32 blocks (512 tokens) each.

    With ``capacity``, an engine whose cache holds that many blocks: once full, each payload
    also evicts its 4 oldest chains, leaf first and one block per BlockRemoved event (as vLLM
    sends them: 128 removal events per payload)."""
    payloads, made = [], 0
    cached: collections.deque[list[int]] = collections.deque()
    while made < blocks:
        events: list[KvEvent] = []
        for _ in range(4):
            tokens = [rng.randrange(32_000) for _ in range(32 * BLOCK)]
            hashes = [rng.getrandbits(64) for _ in range(32)]
            events.append(BlockStored(hashes, None, tokens, BLOCK, None, "GPU"))
            cached.append(hashes)
            made += 32
        while capacity is not None and len(cached) * 32 > capacity:
            events.extend(BlockRemoved([h], "GPU") for h in cached.popleft()[::-1])
        payloads.append(EventEncoder(array_tagged=False).encode(EventBatch(time.time(), events)))
    return payloads


def bench_memory_ingested(blocks: int, rng: random.Random, tables: list[TableKind]) -> None:
    """Memory of event-fed entries (one holder per block): index + engine-hash translation."""
    payloads = make_payloads(blocks, rng)
    for table in tables:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        index, feed = new_feed(blocks * 2, table)
        for payload in payloads:
            feed.apply_payload(payload)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before + table_bytes(index)
        tracemalloc.stop()
        keys = feed.translator(0).key_map
        used += keys.memory_bytes() if isinstance(keys, _native.KeyMap) else 0
        report(
            f"memory per entry, event-fed incl. hash->key map (1 holder), {table} table",
            used / index.entry_count(),
            "bytes",
        )
        del index, feed


def new_feed(max_entries: int, table: TableKind) -> tuple[EventIndex, EventFeed]:
    config = IndexConfig(block_size=BLOCK, max_entries=max_entries, table=table)
    index = EventIndex(config.max_entries, new_table(table))
    feed = EventFeed(
        WorkerId("http://w"),
        0,
        index,
        config,
        block_size=BLOCK,
        metrics=IndexMetrics(CollectorRegistry()),
    )
    return index, feed


def make_single_block_payloads(events: int, rng: random.Random) -> list[bytes]:
    """64 one-block BlockStored events per payload: what decode steps produce (a block is
    stored each time 16 generated tokens fill one)."""
    payloads = []
    for _ in range(events // 64):
        batch: list[KvEvent] = [
            BlockStored([rng.getrandbits(64)], None, rng.choices(range(32_000), k=BLOCK), BLOCK)
            for _ in range(64)
        ]
        payloads.append(EventEncoder(array_tagged=False).encode(EventBatch(time.time(), batch)))
    return payloads


def bench_ingest(blocks: int, rng: random.Random, tables: list[TableKind]) -> None:
    """Stored blocks per second through the whole event path, two ways: into an empty index
    (its growth included), and at working size (an engine at its cache capacity: every
    payload evicts as many blocks as it stores; the figure counts stored blocks and the time
    includes the removals). Then events per second when every event stores one block."""
    growing = make_payloads(blocks, rng)
    singles = make_single_block_payloads(blocks // 4, rng)
    capacity = blocks // 2 // 128 * 128  # whole payloads of 4 chains of 32 blocks
    stream = make_payloads(capacity + blocks, rng, capacity)  # 128 stored blocks per payload
    warm_up, steady = stream[: capacity // 128], stream[capacity // 128 :]
    for table in tables:
        index, feed = new_feed(blocks * 2, table)
        t0 = clock()
        for payload in growing:
            feed.apply_payload(payload)
        elapsed = clock() - t0
        report(
            f"ingest into an empty index, {table} table: stored blocks/s",
            index.entry_count() / elapsed,
            "blocks/s",
        )
        index, feed = new_feed(blocks * 2, table)
        for payload in warm_up:
            feed.apply_payload(payload)
        t0 = clock()
        for payload in steady:
            feed.apply_payload(payload)
        elapsed = clock() - t0
        assert index.entry_count() == capacity, "the engine's cache and the index disagree"
        report(
            f"ingest at working size ({capacity // 1000}k), {table} table: stored blocks/s",
            len(steady) * 128 / elapsed,
            "blocks/s",
        )
        index, feed = new_feed(blocks * 2, table)
        t0 = clock()
        for payload in singles:
            feed.apply_payload(payload)
        report(
            f"ingest one-block events, {table} table: events/s",
            len(singles) * 64 / (clock() - t0),
            "events/s",
        )
    tokens = [rng.randrange(32_000) for _ in range(32 * BLOCK)]
    t0 = clock()
    for _ in range(200):
        block_keys(tokens, BLOCK, 1)
    report("  of which block keys (xxh3 per block)", 200 * 32 / (clock() - t0), "blocks/s")


# ------------------------------------------------------------------ tokenize
WORDS = [
    "the",
    "model",
    "returns",
    "a",
    "function",
    "call",
    "with",
    "arguments",
    "file",
    "path",
    "error",
    "line",
    "value",
    "test",
    "agent",
    "tool",
    "result",
    "output",
    "import",
    "class",
    "def",
    "self",
    "return",
    "None",
    "True",
    "if",
    "else",
    "for",
    "in",
    "range",
    "print",
]


def make_tokenizer_dir(directory: Path, rng: random.Random) -> None:

    corpus = [" ".join(rng.choice(WORDS) for _ in range(200)) + "\n" for _ in range(200)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|im_end|>"})
    )


def message(rng: random.Random, role: str, words: int) -> dict[str, str]:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return {"role": role, "content": text}


async def time_keys(service: KvIndexService, prompt: PromptInput) -> tuple[float, int]:
    t0 = clock()
    keys = await service.keys_for("m", prompt)
    return clock() - t0, keys.prompt_tokens


async def bench_tokenize(target_tokens: int, rng: random.Random) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        make_tokenizer_dir(directory, rng)
        async with httpx.AsyncClient() as http:
            results: dict[str, list[float]] = {}
            for label, cache in (("warm", 4_000_000), ("no-cache", 0)):
                config = IndexConfig(
                    block_size=BLOCK, tokenizers={"m": directory}, tokenize_cache_tokens=cache
                )
                service = KvIndexService(config, CollectorRegistry(), http)
                await service.start()
                session_rng = random.Random(42)
                messages = [message(session_rng, "system", 300)]
                tokens = 0
                times: list[float] = []
                cold: float | None = None
                while tokens < target_tokens:
                    messages.append(message(session_rng, "user", 150))
                    elapsed, tokens = await time_keys(
                        service, PromptInput("chat", messages=list(messages))
                    )
                    if cold is None and label == "warm":
                        # First sight of the full history in a fresh cache: a cold turn.
                        cold_msgs = [message(random.Random(7), "system", 300)] + [
                            message(random.Random(i), "user", 150) for i in range(330)
                        ]
                        cold, cold_tokens = await time_keys(
                            service, PromptInput("chat", messages=cold_msgs)
                        )
                        report(
                            f"prompt -> keys, cold {cold_tokens // 1000}k-token chat turn",
                            cold * 1e3,
                            "ms",
                        )
                    if tokens >= target_tokens * 0.9:
                        times.append(elapsed)
                    messages.append(message(session_rng, "assistant", 80))
                results[label] = times
                report(
                    f"prompt -> keys, {label} growing session at ~{tokens // 1000}k tokens",
                    statistics.median(times) * 1e3,
                    "ms",
                )
                await service.stop()
            gain = statistics.median(results["no-cache"]) / statistics.median(results["warm"])
            report("prefix cache gain on growing session (no-cache / warm)", gain, "x")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, Python {sys.version.split()[0]}, {platform.system()} {platform.machine()}"


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, under a minute")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: process CPU time (default); wall: elapsed time",
    )
    parser.add_argument("--only", nargs="*", help="run only these steps")
    args = parser.parse_args(argv)
    _clock[0] = CLOCKS[args.clock]
    rng = random.Random(1)
    entries = 200_000 if args.quick else 1_000_000
    tables: list[TableKind] = ["native", "python"]
    print(f"machine: {machine()}; clock: {args.clock}; load average: {load_average()}")
    steps: list[tuple[str, Callable[[], None]]] = [
        ("ingest", lambda: bench_ingest(50_000 if args.quick else 400_000, rng, tables)),
        ("find", lambda: bench_find_matches(entries, 50 if args.quick else 300, rng, tables)),
        ("memory", lambda: bench_memory(entries // 4 if args.quick else entries // 2, rng, tables)),
        (
            "memory-ingest",
            lambda: bench_memory_ingested(50_000 if args.quick else 200_000, rng, tables),
        ),
        ("tokenize", lambda: asyncio.run(bench_tokenize(50_000, rng))),
    ]
    for name, step in steps:
        if args.only and name not in args.only:
            continue
        step()
        gc.collect()
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "clock": args.clock,
                    "load": load_average(),
                    "results": RESULTS,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
