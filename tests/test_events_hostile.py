"""A hostile KV-event publisher (issue 12): nothing it sends may freeze, kill or poison kvgate.

At worst it gets wrong predictions for its own worker. Each test here failed on the code before
the issue was fixed: crafted chains froze the table walks (run in a child process with a
deadline, tests/hostile_cases.py), a deeply nested payload killed the subscriber for good, a
replay socket that never ended held live events forever, and nothing bounded ranks, blocks
per event, message size or the engine-hash map.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from fakes.wait import wait_until
from hostile_cases import CASES, tokens_of
from kv_publisher import KvPublisher
from prometheus_client import CollectorRegistry

from kvgate.bench.hostile import BLOCK, payload, removed, stored
from kvgate.index.api import Endpoints, EngineWorker
from kvgate.index.config import IndexConfig
from kvgate.index.events import EventFeed, Subscriber
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.metrics import IndexMetrics
from kvgate.index.service import KvIndexService
from kvgate.index.table import EventIndex, TableKind, new_table
from kvgate.index.types import PrefixMatch, WorkerId, WorkerKey

HERE = Path(__file__).resolve().parent
WORKER = WorkerId("http://127.0.0.1:1")
SEED = cache_seed(None, None)
CASE_DEADLINE_S = 60.0  # each case takes about a second; before issue 12 none finished
TABLES: tuple[TableKind, ...] = ("native", "python")


# ------------------------------------------------------------------ crafted chains (cases 1, 3)
@pytest.mark.parametrize("kind", TABLES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_streams_run_to_completion(case: str, kind: TableKind) -> None:
    """Cycles through forged keys (case 1), root-first removal of a long chain (case 3) and
    engine hashes chosen to collide in the native maps: each finishes, its checks hold."""
    try:
        run = subprocess.run(
            [sys.executable, str(HERE / "hostile_cases.py"), case, kind],
            capture_output=True,
            text=True,
            timeout=CASE_DEADLINE_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case} ({kind} table) still running after {CASE_DEADLINE_S:.0f} s")
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-3000:]


# ------------------------------------------------------------------ one feed, both paths
def make_feed(
    native: bool, max_entries: int = 1_000_000, **config: Any
) -> tuple[EventFeed, EventIndex, CollectorRegistry]:
    index = EventIndex(max_entries, new_table("native"))
    registry = CollectorRegistry()
    feed = EventFeed(
        WORKER,
        0,
        index,
        IndexConfig(block_size=BLOCK, **config),
        block_size=BLOCK,
        metrics=IndexMetrics(registry),
        native=native,
    )
    return feed, index, registry


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def chain_keys(tokens: list[int]) -> list[int]:
    return block_keys(tokens, BLOCK, SEED)


def held(index: EventIndex, tokens: list[int]) -> int:
    found = index.find_matches(chain_keys(tokens)).get(WorkerKey(WORKER, 0))  # type: ignore[arg-type]
    return 0 if found is None else found.blocks


@pytest.mark.parametrize("native", [True, False])
def test_a_child_of_a_pruned_block_is_skipped(native: bool) -> None:
    """The engine-hash map still knows a block the cap pruned: a child stored under it is
    skipped and counted, never chained from a block the domain does not hold."""
    feed, index, registry = make_feed(native, max_entries=2)
    first = tokens_of(BLOCK, 100)
    feed.apply_payload(payload([stored([1], None, first)]))
    feed.apply_payload(payload([stored([2], None, tokens_of(BLOCK, 200))]))
    feed.apply_payload(payload([stored([3], None, tokens_of(BLOCK, 300))]))  # prunes block 1
    assert held(index, first) == 0
    result = feed.apply_payload(payload([stored([4], 1, tokens_of(BLOCK, 400))]))
    assert result.refused is None and not result.unknown_parent  # applied
    assert held(index, first + tokens_of(BLOCK, 400)) == 0
    assert index.entry_count() == 2
    skipped = "kvgate_index_skipped_events_total"
    assert metric(registry, skipped, worker=WORKER, reason="pruned_parent") == 1


@pytest.mark.parametrize("native", [True, False])
def test_ranks_per_endpoint_are_bounded(native: bool) -> None:
    """Every data-parallel rank a payload names becomes a cache domain: a publisher naming
    thousands of ranks gets a few, the rest of its batches are dropped and counted."""
    feed, index, registry = make_feed(native, max_ranks_per_endpoint=4)
    for rank in range(1000):
        body = [1.0, [stored([rank + 1], None, tokens_of(BLOCK, rank))], rank]
        feed.apply_payload(msgspec.msgpack.encode(body))
    assert len(feed.ranks()) == 4
    assert index.entry_count() == 4
    assert metric(registry, "kvgate_index_limits_total", worker=WORKER, limit="ranks") == 996


@pytest.mark.parametrize("native", [True, False])
def test_an_event_with_too_many_blocks_clears_the_domain(native: bool) -> None:
    feed, index, registry = make_feed(native, max_event_blocks=8)
    feed.apply_payload(payload([stored([1, 2], None, tokens_of(2 * BLOCK))]))
    assert index.entry_count() == 2
    hashes = list(range(10, 19))
    feed.apply_payload(payload([stored(hashes, 2, tokens_of(9 * BLOCK, 2 * BLOCK))]))
    assert index.entry_count() == 0
    assert feed.mapped_blocks() == 0
    limit = "kvgate_index_limits_total"
    assert metric(registry, limit, worker=WORKER, limit="event_blocks") == 1
    feed.apply_payload(payload([removed(list(range(100, 109)))]))
    assert metric(registry, limit, worker=WORKER, limit="event_blocks") == 2


@pytest.mark.parametrize("native", [True, False])
def test_the_engine_hash_map_shrinks_with_the_table(native: bool) -> None:
    """Blocks the cap prunes leave their engine hashes behind: the map is compacted as the
    domain shrinks, never left to grow to the global cap."""
    feed, index, _ = make_feed(native, max_entries=100)
    for i in range(6000):
        feed.apply_payload(payload([stored([i + 1], None, tokens_of(BLOCK, 16 * i))]))
    assert index.entry_count() == 100
    assert feed.mapped_blocks() <= 2 * 100 + 1024


DUPLICATES = {
    "type twice, two values": [("type", "BlockStored"), ("type", "BlockRemoved")],
    "type twice, one value": [("type", "BlockStored"), ("type", "BlockStored")],
    "a field twice": [("type", "BlockStored"), ("block_size", BLOCK)],
    "a field twice, first invalid": [("block_size", "x"), ("type", "BlockStored")],
}


def map_with(pairs: list[tuple[str, Any]], raw: tuple[tuple[str, bytes], ...] = ()) -> bytes:
    """A msgpack map with these pairs in this order (duplicates kept: no dict on the way),
    then the ``raw`` pairs, whose values are given already encoded."""
    count = len(pairs) + len(raw)
    out = bytearray([0x80 | count]) if count < 16 else bytearray([0xDE, 0, count])
    for name, value in pairs:
        out += msgspec.msgpack.encode(name) + msgspec.msgpack.encode(value)
    for name, encoded in raw:
        out += msgspec.msgpack.encode(name) + encoded
    return bytes(out)


def nested(event: dict[str, Any], depth: int) -> bytes:
    """``event`` with an ``extra_keys`` nested ``depth`` arrays deep."""
    return map_with(list(event.items()), (("extra_keys", b"\x91" * depth + b"\xc0"),))


@pytest.mark.parametrize("extra", sorted(DUPLICATES))
def test_duplicate_keys_get_one_answer_on_both_paths(extra: str) -> None:
    """An event map with a key twice makes its batch undecodable, on either path."""
    event = stored([1], None, tokens_of(BLOCK))
    pairs = list(event.items()) + DUPLICATES[extra]
    raw = b"\x93" + msgspec.msgpack.encode(1.0) + b"\x91" + map_with(pairs) + b"\x00"
    results = []
    for native in (True, False):
        feed, index, registry = make_feed(native)
        results.append((feed.apply_payload(raw).refused, index.entry_count()))
        assert metric(registry, "kvgate_index_decode_errors_total", worker=WORKER) == 1
    assert results == [("undecodable", 0)] * 2


@pytest.mark.parametrize("native", [True, False])
def test_deep_nesting_is_undecodable_not_fatal(native: bool) -> None:
    feed, index, registry = make_feed(native)
    event = nested(stored([1], None, tokens_of(BLOCK)), 5000)
    raw = b"\x93" + msgspec.msgpack.encode(1.0) + b"\x91" + event + b"\x00"
    assert feed.apply_payload(raw).refused == "undecodable"
    assert index.entry_count() == 0
    assert metric(registry, "kvgate_index_decode_errors_total", worker=WORKER) == 1
    feed.apply_payload(payload([stored([1], None, tokens_of(BLOCK))]))
    assert index.entry_count() == 1


# ------------------------------------------------------------------ the subscriber (cases 2, 4)
BS = 4
TOKENS = list(range(1000, 1000 + 64))


def event_stored(start: int, end: int) -> dict[str, Any]:
    parent = None if start == 0 else 1000 + start - 1
    return {
        "type": "BlockStored",
        "block_hashes": [1000 + i for i in range(start, end)],
        "parent_block_hash": parent,
        "token_ids": TOKENS[start * BS : end * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
    }


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events)])


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


@contextlib.asynccontextmanager
async def service_with(registry: CollectorRegistry, **config: Any) -> AsyncIterator[KvIndexService]:
    options: dict[str, Any] = {"block_size": BS, "replay_timeout_s": 2.0}
    options["reconnect_backoff_s"] = 0.05
    options.update(config)
    async with httpx.AsyncClient() as http:
        service = KvIndexService(IndexConfig(**options), registry, http)
        await service.start()
        try:
            yield service
        finally:
            await service.stop()


def matched(service: KvIndexService) -> PrefixMatch | None:
    keys = block_keys(TOKENS, BS, SEED)
    return service.match(keys).get(WORKER)  # type: ignore[arg-type]


async def connect(service: KvIndexService, events: str, replay: str | None) -> None:
    service.worker_added(EngineWorker(WORKER, str(WORKER), endpoints=(Endpoints(events, replay),)))


@pytest.mark.anyio
async def test_a_deeply_nested_payload_costs_one_payload(
    zmq_context: zmq.asyncio.Context,
) -> None:
    """It used to raise RecursionError in the subscriber task, which then ended for good."""
    registry = CollectorRegistry()
    pub = KvPublisher(zmq_context)
    try:
        async with service_with(registry) as service:
            await connect(service, pub.events_endpoint, pub.replay_endpoint)
            async with asyncio.timeout(5):
                await pub.subscribed.wait()
            await service.wait_applied(WORKER, await pub.send_raw(batch(event_stored(0, 4))))
            event = nested(event_stored(4, 6), 5000)
            deep_payload = b"\x92" + msgspec.msgpack.encode(1.0) + b"\x91" + event
            await pub.send_raw(deep_payload)
            seq = await pub.send_raw(batch(event_stored(0, 8)))
            await service.wait_applied(WORKER, seq)
            assert matched(service) == PrefixMatch(gpu=8)
            seq = await pub.send_raw(batch({"type": "AllBlocksCleared"}))
            await service.wait_applied(WORKER, seq)
            assert matched(service) is None
            decode_errors = "kvgate_index_decode_errors_total"
            assert metric(registry, decode_errors, worker=WORKER) == 1
            service.worker_removed(WORKER)
            await service.settled()
    finally:
        await pub.close()


@pytest.mark.anyio
async def test_a_subscriber_that_dies_is_restarted_and_its_entries_cleared(
    zmq_context: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever kills a subscriber task (here a fault injected into its frame handling), a
    supervisor restarts it with backoff; meanwhile its worker's entries are cleared, and
    removing the worker and stopping the service still complete."""
    handle = Subscriber.on_frames

    async def faulty(self: Subscriber, frames: list[bytes]) -> None:
        if frames[-1] == b"boom":
            raise RuntimeError("injected fault")
        await handle(self, frames)

    monkeypatch.setattr(Subscriber, "on_frames", faulty)
    registry = CollectorRegistry()
    pub = KvPublisher(zmq_context)
    try:
        async with service_with(registry, reconnect_backoff_s=1.0) as service:
            await connect(service, pub.events_endpoint, pub.replay_endpoint)
            async with asyncio.timeout(5):
                await pub.subscribed.wait()
            await service.wait_applied(WORKER, await pub.send_raw(batch(event_stored(0, 4))))
            assert matched(service) == PrefixMatch(gpu=4)
            pub.subscribed.clear()
            await pub.pub.send_multipart([pub.topic, (999).to_bytes(8, "big"), b"boom"])
            restarts = "kvgate_index_subscriber_restarts_total"
            await wait_until(lambda: metric(registry, restarts, worker=WORKER) == 1)
            assert matched(service) is None  # cleared until it is back
            async with asyncio.timeout(10):
                await pub.subscribed.wait()  # back: subscribed again, history replayed
            seq = await pub.send_raw(batch(event_stored(4, 6)))
            await service.wait_applied(WORKER, seq)
            assert matched(service) == PrefixMatch(gpu=6)
            service.worker_removed(WORKER)
            assert service.events.entry_count() == 0
            await service.settled()
    finally:
        await pub.close()


class EndlessReplay:
    """A replay ROUTER that answers with valid batches and never sends the end marker
    (``interval_s`` between batches: 0 for a flood, more for a slow drip)."""

    def __init__(self, context: zmq.asyncio.Context, interval_s: float) -> None:
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.interval_s = interval_s
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        identity, _, start = await self.router.recv_multipart()
        seq = int.from_bytes(start, "big")
        body = batch(event_stored(0, 1))
        while True:  # bounded by the test: closed when it ends
            await self.router.send_multipart([identity, b"", b"", seq.to_bytes(8, "big"), body])
            seq += 1
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.router.close(linger=0)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("interval_s", "limit", "max_batches", "max_s"),
    # Each case leaves the other bound far off, so that a slow run (sanitizers, a busy
    # box) still meets the bound under test first.
    [(0.0, "replay_batches", 500, 20.0), (0.05, "replay_seconds", 5_000, 1.0)],
)
async def test_a_replay_that_never_ends_is_bounded(
    zmq_context: zmq.asyncio.Context, interval_s: float, limit: str, max_batches: int, max_s: float
) -> None:
    """Flooded or dripped, a replay stops at its bounds (batches, bytes, seconds): live
    events flow again and the worker's entries are cleared, counted."""
    registry = CollectorRegistry()
    pub = KvPublisher(zmq_context)
    replay = EndlessReplay(zmq_context, interval_s)
    try:
        bounds = {"replay_max_batches": max_batches, "replay_max_s": max_s}
        async with service_with(registry, **bounds) as service:
            await connect(service, pub.events_endpoint, replay.endpoint)
            async with asyncio.timeout(5):
                await pub.subscribed.wait()
            await wait_until(
                lambda: (
                    metric(registry, "kvgate_index_limits_total", worker=WORKER, limit=limit) == 1
                ),
                limit_s=max_s + 10.0,
            )
            other = "replay_seconds" if limit == "replay_batches" else "replay_batches"
            assert metric(registry, "kvgate_index_limits_total", worker=WORKER, limit=other) == 0
            seq = await pub.send_raw(batch(event_stored(0, 3)))
            await service.wait_applied(WORKER, seq, timeout_s=5)
            assert matched(service) == PrefixMatch(gpu=3)
    finally:
        await replay.close()
        await pub.close()


@pytest.mark.anyio
async def test_an_oversized_message_is_never_applied(zmq_context: zmq.asyncio.Context) -> None:
    """Past ``max_message_bytes`` ZMQ drops the connection before kvgate reads the message:
    the worker is cleared as on any disconnect, and events flow again once reconnected."""
    registry = CollectorRegistry()
    pub = KvPublisher(zmq_context)
    try:
        limits = {"max_message_bytes": 64 * 1024, "replay_timeout_s": 0.5}
        async with service_with(registry, **limits) as service:
            await connect(service, pub.events_endpoint, pub.replay_endpoint)
            async with asyncio.timeout(5):
                await pub.subscribed.wait()
            await service.wait_applied(WORKER, await pub.send_raw(batch(event_stored(0, 2))))
            big_tokens = [70_000 + i for i in range(40_000)]  # 5 bytes each: 200 KB
            big = {**event_stored(0, 1), "block_hashes": list(range(10_000))}
            big["token_ids"] = big_tokens
            pub.subscribed.clear()
            await pub.send_raw(batch(big))
            async with asyncio.timeout(10):
                await pub.subscribed.wait()  # dropped and reconnected
            seq = await pub.send_raw(batch(event_stored(0, 5)))
            await service.wait_applied(WORKER, seq, timeout_s=10)
            assert matched(service) == PrefixMatch(gpu=5)
            assert service.events.entry_count() == 5
    finally:
        await pub.close()


@pytest.mark.anyio
async def test_a_worker_is_not_matched_while_its_history_is_replayed(
    zmq_context: zmq.asyncio.Context,
) -> None:
    """Half applied, a join replay is a past state of the engine's cache (blocks stored, their
    eviction not applied yet): the worker matches nothing until the replay ended, then again."""
    registry = CollectorRegistry()
    pub = KvPublisher(zmq_context)
    replay = EndlessReplay(zmq_context, 0.05)  # drips the first block until its time bound
    try:
        async with service_with(registry, replay_max_s=1.5) as service:
            await connect(service, pub.events_endpoint, replay.endpoint)
            await wait_until(lambda: service.events.entry_count() > 0)  # replayed, applied
            assert matched(service) is None
            limit = {"worker": WORKER, "limit": "replay_seconds"}
            await wait_until(lambda: metric(registry, "kvgate_index_limits_total", **limit) == 1)
            seq = await pub.send_raw(batch(event_stored(0, 3)))
            await service.wait_applied(WORKER, seq, timeout_s=5)
            assert matched(service) == PrefixMatch(gpu=3)  # matched again after the replay
    finally:
        await replay.close()
        await pub.close()
