"""Seeded, time-bounded fuzzing of both event ingestion paths (issue 12), run in a child process.

    python tests/fuzz_ingest.py --seed 1 --seconds 20 --deadline 10

Two workers share one index: an honest *victim* whose engine stores and evicts real chains,
and an *attacker* sending everything a hostile publisher can: valid payloads of both
encodings, byte mutations of them, blocks forged to be their own parent or to carry the
victim's keys under other parents, long chains removed root first, engine hashes colliding in
an unkeyed map, deep nesting, keys repeated in an event, huge and many ranks, events past the
block bound. Every payload goes to three index setups (native table + native path, native
table + general path, Python table + general path). After each one:

* no payload takes longer than ``--deadline`` (a faulthandler watchdog aborts the process
  with every thread's stack: a walk that never ends holds the GIL, nothing else can stop it);
* the three setups agree: batch result, every match of both workers, entry and record counts,
  orphans per domain, mapped hashes, ranks and every metric;
* the victim's matches are exactly what its engine holds (nothing the attacker sends changes
  them), and memory stays within the caps (entries, records, mapped hashes, ranks, bytes).

Prints a JSON summary; exits non-zero with the seed, step and payload on the first failure.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import random
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: find the repository (after PYTHONPATH, which
    # the sanitizer test points at its instrumented copy of the package)
    sys.path.append(str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry

from kvgate.bench.hostile import BLOCK, Attacker, engine_hash, payload, removed, stored
from kvgate.index.api import BatchResult
from kvgate.index.config import IndexConfig
from kvgate.index.events import EventFeed
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.metrics import IndexMetrics
from kvgate.index.table import EventIndex, NativeBlockTable, TableKind, new_table
from kvgate.index.types import BlockKey, PrefixMatch, WorkerId, WorkerKey

SEED = cache_seed(None, None)
ATTACKER, VICTIM = WorkerId("http://attacker"), WorkerId("http://victim")
MAX_ENTRIES = 3000
MAX_RANKS = 4
MAX_EVENT_BLOCKS = 256
CONFIG = IndexConfig(
    block_size=BLOCK,
    max_entries=MAX_ENTRIES,
    max_event_blocks=MAX_EVENT_BLOCKS,
    max_ranks_per_endpoint=MAX_RANKS,
    decode_error_log_interval_s=1e9,  # the fuzz is noisy by design: one log line
)
VICTIM_MAX_BLOCKS = 300  # the attacker is then the largest domain whenever the cap prunes
RSS_GROWTH_CAP = 300 * 2**20
TABLE_BYTES_PER_ENTRY_CAP = 1024


def _paths(rng: random.Random) -> list[list[int]]:
    """12 token paths of 64 blocks; each shares a prefix with an earlier one."""
    paths = [[rng.randrange(50_000) for _ in range(64 * BLOCK)]]
    while len(paths) < 12:
        base = rng.choice(paths)
        shared = rng.randrange(0, 48) * BLOCK
        paths.append(base[:shared] + [rng.randrange(50_000) for _ in range(64 * BLOCK - shared)])
    return paths


# ------------------------------------------------------------------ the three setups
@dataclass
class Setup:
    label: str
    index: EventIndex
    registry: CollectorRegistry
    feeds: dict[WorkerId, EventFeed]

    @classmethod
    def make(cls, table: TableKind, native: bool) -> Setup:
        index = EventIndex(MAX_ENTRIES, new_table(table))
        registry = CollectorRegistry()
        metrics = IndexMetrics(registry)
        feeds = {
            worker: EventFeed(
                worker,
                0,
                index,
                CONFIG,
                block_size=BLOCK,
                metrics=metrics,
                clock=lambda: 2.0,
                native=native,
            )
            for worker in (ATTACKER, VICTIM)
        }
        return cls(
            f"{table} table, {'native' if native else 'general'} path", index, registry, feeds
        )

    def state(self, queries: list[list[BlockKey]], everyone: bool) -> tuple[Any, ...]:
        """What the setups must agree on. The attacker's own matches are whatever its forged
        chains make of them: the same for one table on either path, but not defined across
        the two tables (``everyone`` False leaves them out)."""
        index = self.index
        matches = [
            sorted(
                (str(w), m.gpu, m.cpu, m.disk)
                for w, m in index.find_matches(q).items()
                if everyone or w.worker != ATTACKER
            )
            for q in queries
        ]
        domains = sorted((str(s.worker), s.entries, s.orphans) for s in index.stats())
        feeds = sorted(
            (
                str(worker),
                sorted((t.dp_rank, len(feed.translator(t.dp_rank))) for t in feed.ranks()),
            )
            for worker, feed in self.feeds.items()
        )
        return index.entry_count(), index.block_count(), matches, domains, feeds, self.samples()

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for metric in self.registry.collect():
            for sample in metric.samples:
                if not sample.name.endswith("_created"):
                    out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out


# ------------------------------------------------------------------ the honest victim
@dataclass
class Victim:
    """An engine's prefix cache, emitting vLLM's events honestly (GPU tier; evicting any
    block, leaves or not)."""

    paths: list[list[int]]
    keys: list[list[int]]
    held: dict[int, tuple[int, int]] = field(default_factory=dict)  # key -> (path, block)

    def step(self, rng: random.Random) -> bytes:
        if self.held and (len(self.held) > VICTIM_MAX_BLOCKS or rng.random() < 0.4):
            chosen = rng.sample(sorted(self.held), min(len(self.held), rng.randrange(1, 6)))
            events = []
            for key in chosen:
                path, block = self.held.pop(key)
                events.append(removed([engine_hash(self.paths[path], block, b"victim")]))
            return payload(events)
        path = rng.randrange(len(self.paths))
        start = next((b for b in range(64) if self.keys[path][b] not in self.held), 64)
        if start == 64:
            return payload([])
        end = min(64, start + rng.randrange(1, 24))
        tokens = self.paths[path]
        for block in range(start, end):
            self.held[self.keys[path][block]] = (path, block)
        parent = engine_hash(tokens, start - 1, b"victim") if start else None
        hashes = [engine_hash(tokens, b, b"victim") for b in range(start, end)]
        return payload([stored(hashes, parent, tokens[start * BLOCK : end * BLOCK])])

    def expected(self, query: list[BlockKey]) -> PrefixMatch | None:
        n = 0
        while n < len(query) and query[n] in self.held:
            n += 1
        return PrefixMatch(gpu=n) if n else None


# ------------------------------------------------------------------ the run
def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_caps(setup: Setup) -> None:
    index = setup.index
    assert index.entry_count() <= MAX_ENTRIES, "entries over the cap"
    assert index.block_count() <= index.entry_count(), "records nobody holds"
    table = index.table
    if isinstance(table, NativeBlockTable):
        cap = TABLE_BYTES_PER_ENTRY_CAP * MAX_ENTRIES + 2**20
        assert table.memory_bytes() <= cap, f"native table holds {table.memory_bytes()} bytes"
    for feed in setup.feeds.values():
        assert len(feed.ranks()) <= MAX_RANKS, "ranks over the bound"
        for domain in feed.ranks():
            mapped = len(feed.translator(domain.dp_rank))
            held = index.table.slot_entries(domain)
            # compacted after each of its batches; another domain's batch may prune a few
            assert mapped <= 2 * held + 1024 + 64, f"{mapped} hashes for {held} blocks"


def run(seed: int, seconds: float, deadline: float) -> dict[str, Any]:
    rng = random.Random(seed)
    paths = _paths(rng)
    keys = [block_keys(p, BLOCK, SEED) for p in paths]
    queries = [[BlockKey(k) for k in chain[:n]] for chain in keys for n in (1, 7, 64)]
    setups = [Setup.make("native", True), Setup.make("native", False), Setup.make("python", False)]
    victim = Victim(paths, keys)
    attacker = Attacker(paths, keys, rng, root_seed=SEED, max_event_blocks=MAX_EVENT_BLOCKS)
    kinds: Counter[str] = Counter()
    rss_start = rss_bytes()
    stop = time.monotonic() + seconds
    step = 0
    while time.monotonic() < stop:
        if rng.random() < 0.3:
            worker, kind, data = VICTIM, "victim", victim.step(rng)
        else:
            worker, (kind, data) = ATTACKER, attacker.next()
        kinds[kind] += 1
        faulthandler.dump_traceback_later(deadline, exit=True)
        try:
            results: list[BatchResult] = [s.feeds[worker].apply_payload(data) for s in setups]
        finally:
            faulthandler.cancel_dump_traceback_later()
        try:
            check_step(setups, results, victim, queries)
            if step % 25 == 0:
                for setup in setups:
                    check_caps(setup)
                assert rss_bytes() - rss_start <= RSS_GROWTH_CAP, "process memory grew"
        except AssertionError as error:
            raise AssertionError(
                f"seed {seed}, step {step} ({kind}): {error}\npayload: {data[:400].hex()}"
            ) from error
        step += 1
    return {"seed": seed, "payloads": step, "kinds": dict(sorted(kinds.items()))}


def check_step(
    setups: list[Setup], results: list[BatchResult], victim: Victim, queries: list[list[BlockKey]]
) -> None:
    assert results[1:] == results[:-1], f"batch results differ: {results}"
    native, general, python = setups
    pairs = [(general, True), (python, False)]
    for setup, everyone in pairs:
        want, got = native.state(queries, everyone), setup.state(queries, everyone)
        if got != want:
            raise AssertionError(f"{setup.label} differs from {native.label}: {diff(want, got)}")
    domain = WorkerKey(VICTIM, 0)
    for query in queries:
        got = setups[0].index.find_matches(query).get(domain)
        assert got == victim.expected(query), f"the victim's match changed: {got}"


def diff(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    names = ["entries", "records", "matches", "domains", "feeds", "metrics"]
    for name, x, y in zip(names, a, b, strict=True):
        if x != y:
            if isinstance(x, dict):
                keys = {k for k in x.keys() | y.keys() if x.get(k) != y.get(k)}
                return f"{name}: " + ", ".join(
                    f"{k}: {x.get(k)} vs {y.get(k)}" for k in sorted(keys)
                )
            if isinstance(x, list):
                where = [i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v]
                return f"{name} at {where[:3]}: " + "; ".join(
                    f"{x[i]} vs {y[i]}" for i in where[:3]
                )
            return f"{name}: {x} vs {y}"
    return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--deadline", type=float, default=10.0, help="per payload, seconds")
    args = parser.parse_args()
    print(json.dumps(run(args.seed, args.seconds, args.deadline)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
