"""Event ingestion end to end: a real ZMQ publisher + replay socket → KvIndexService."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from fakes.wait import free_port, wait_until
from kv_publisher import KvPublisher
from prometheus_client import CollectorRegistry

from kvgate.index.api import Endpoints, EngineWorker, PromptInput
from kvgate.index.config import IndexConfig
from kvgate.index.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.service import KvIndexService
from kvgate.index.types import PrefixMatch, WorkerId

pytestmark = pytest.mark.anyio

BS = 4
MODEL = "m"
WORKER = WorkerId("http://127.0.0.1:1")
TOKENS = list(range(1000, 1000 + 64))  # 16 blocks


def stored(start: int, end: int, *, medium: str = "GPU", block_size: int = BS) -> BlockStored:
    """Blocks [start, end) of TOKENS with engine hashes 1000+i."""
    parent = None if start == 0 else 1000 + start - 1
    return BlockStored(
        block_hashes=[1000 + i for i in range(start, end)],
        parent_block_hash=parent,
        token_ids=TOKENS[start * BS : end * BS],
        block_size=block_size,
        lora_id=None,
        medium=medium,
    )


def removed(*blocks: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved([1000 + i for i in blocks], medium)


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def service(
    registry: CollectorRegistry, http: httpx.AsyncClient
) -> AsyncIterator[KvIndexService]:
    config = IndexConfig(block_size=BS, replay_timeout_s=2.0, reconnect_backoff_s=0.05)
    svc = KvIndexService(config, registry, http)
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture(params=["map", "array"])
async def publisher(
    request: pytest.FixtureRequest, zmq_context: zmq.asyncio.Context
) -> AsyncIterator[KvPublisher]:
    pub = KvPublisher(zmq_context, array_tagged=request.param == "array")
    yield pub
    await pub.close()


async def connect(service: KvIndexService, pub: KvPublisher, *, replay: bool = True) -> None:
    endpoints = Endpoints(pub.events_endpoint, pub.replay_endpoint if replay else None)
    service.worker_added(EngineWorker(WORKER, str(WORKER), endpoints=(endpoints,)))
    async with asyncio.timeout(5):
        await pub.subscribed.wait()


def request_keys(blocks: int = 16) -> list[int]:
    return block_keys(TOKENS[: blocks * BS], BS, cache_seed(None, None))


def matched(service: KvIndexService) -> PrefixMatch | None:
    return service.match(request_keys()).get(WORKER)  # type: ignore[arg-type]


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_store_extend_remove(service: KvIndexService, publisher: KvPublisher) -> None:
    await connect(service, publisher)
    await publisher.publish(stored(0, 6))
    seq = await publisher.publish(stored(6, 10))
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=10)
    # The event-derived keys are the request's keys (token-id prompt through keys_for).
    keys = await service.keys_for(MODEL, PromptInput("completion", prompt=TOKENS[:40]))
    assert keys.mode == "token_ids"
    assert list(keys.block_keys) == request_keys(10)
    seq = await publisher.publish(removed(9), removed(8))
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=8)
    seq = await publisher.publish(stored(8, 10, medium="CPU"))
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=8, cpu=2)


async def test_seq_gap_is_replayed(
    service: KvIndexService, publisher: KvPublisher, registry: CollectorRegistry
) -> None:
    await connect(service, publisher)
    await service.wait_applied(WORKER, await publisher.publish(stored(0, 4)))
    await publisher.publish(stored(4, 8), drop=True)
    await publisher.publish(removed(7), drop=True)
    seq = await publisher.publish(stored(0, 2, medium="CPU"))
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=7)
    assert metric(registry, "kvgate_index_gaps_total", worker=WORKER, kind="seq") == 1
    # one replay when it connected (history), one for the gap
    assert metric(registry, "kvgate_index_replays_total", worker=WORKER, outcome="covered") == 2
    assert publisher.replay_requests == [0, 1]


async def test_gap_replay_cannot_cover_clears(
    service: KvIndexService, zmq_context: zmq.asyncio.Context, registry: CollectorRegistry
) -> None:
    pub = KvPublisher(zmq_context, ring=2)
    try:
        await connect(service, pub)
        await service.wait_applied(WORKER, await pub.publish(stored(0, 4)))
        assert matched(service) == PrefixMatch(gpu=4)
        for _ in range(3):
            await pub.publish(removed(3), drop=True)  # lost, and out of the ring soon
        seq = await pub.publish(BlockStored([5000], None, list(range(BS)), BS, None, "GPU"))
        await service.wait_applied(WORKER, seq)
        assert matched(service) is None  # never a phantom hit
        assert metric(registry, "kvgate_index_resets_total", worker=WORKER, reason="gap") == 1
        assert metric(registry, "kvgate_index_replays_total", worker=WORKER, outcome="partial") == 1
    finally:
        await pub.close()


async def test_gap_without_replay_socket_clears(
    service: KvIndexService, publisher: KvPublisher, registry: CollectorRegistry
) -> None:
    await connect(service, publisher, replay=False)
    await service.wait_applied(WORKER, await publisher.publish(stored(0, 4)))
    await publisher.publish(stored(4, 8), drop=True)
    seq = await publisher.publish(stored(0, 2))
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=2)
    assert metric(registry, "kvgate_index_resets_total", worker=WORKER, reason="gap") == 1


async def test_restart_clears(
    service: KvIndexService, publisher: KvPublisher, registry: CollectorRegistry
) -> None:
    await connect(service, publisher)
    await publisher.publish(stored(0, 8))
    await service.wait_applied(WORKER, await publisher.publish(stored(8, 10)))
    publisher.restart()
    seq = await publisher.publish(stored(0, 3))
    assert seq == 0
    await wait_until(lambda: service.applied_seq(WORKER) == 0)
    assert matched(service) == PrefixMatch(gpu=3)
    assert metric(registry, "kvgate_index_resets_total", worker=WORKER, reason="restart") == 1


async def test_all_blocks_cleared(service: KvIndexService, publisher: KvPublisher) -> None:
    await connect(service, publisher)
    seq = await publisher.publish(stored(0, 8), AllBlocksCleared(), stored(0, 1))
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=1)


async def test_garbage_is_counted_and_skipped(
    service: KvIndexService, publisher: KvPublisher, registry: CollectorRegistry
) -> None:
    await connect(service, publisher)
    await publisher.send_raw(b"\xc1\xc1 not msgpack")
    await publisher.send_raw(msgspec.msgpack.encode({"no": "batch"}))
    await publisher.pub.send_multipart([b"kv-events", b"not a seq and no payload"])
    seq = await publisher.publish(stored(0, 5))
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=5)
    # the batch may have come through the join replay, before the live bad frames
    await wait_until(
        lambda: metric(registry, "kvgate_index_decode_errors_total", worker=WORKER) == 3
    )


async def test_block_size_mismatch_is_not_indexed(
    service: KvIndexService, publisher: KvPublisher, registry: CollectorRegistry
) -> None:
    await connect(service, publisher)
    event = BlockStored([1], None, list(range(32)), 32, None, "GPU")
    await publisher.publish(event)
    seq = await publisher.publish(stored(0, 4))
    await service.wait_applied(WORKER, seq)
    assert matched(service) is None
    assert metric(registry, "kvgate_index_block_size_mismatch_total", worker=WORKER) == 2


async def test_unknown_parent_is_a_gap(
    service: KvIndexService, publisher: KvPublisher, registry: CollectorRegistry
) -> None:
    await connect(service, publisher)
    await publisher.publish(stored(0, 4))
    seq = await publisher.publish(stored(10, 12))  # parent 1009 never stored
    await service.wait_applied(WORKER, seq)
    assert matched(service) is None
    assert metric(registry, "kvgate_index_gaps_total", worker=WORKER, kind="unknown_parent") == 1
    reason = "unknown_parent"
    assert metric(registry, "kvgate_index_resets_total", worker=WORKER, reason=reason) == 1
    seq = await publisher.publish(stored(0, 3))
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=3)


async def test_late_join_replays_history(service: KvIndexService, publisher: KvPublisher) -> None:
    await publisher.publish(stored(0, 4))  # nobody listening yet
    await publisher.publish(stored(4, 6))
    await connect(service, publisher)
    seq = await publisher.publish(stored(6, 7))
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=7)
    assert publisher.replay_requests == [0]


async def test_history_is_known_before_the_next_batch(
    service: KvIndexService, publisher: KvPublisher
) -> None:
    """An idle engine's cache is learnt on connect, not when it next publishes."""
    await publisher.publish(stored(0, 4))
    seq = await publisher.publish(stored(4, 6))
    await connect(service, publisher)
    await service.wait_applied(WORKER, seq)
    assert matched(service) == PrefixMatch(gpu=6)
    assert publisher.replay_requests == [0]


async def test_sglang_stream(service: KvIndexService, zmq_context: zmq.asyncio.Context) -> None:
    """Array-tagged events as SGLang sends them: 5-field BlockStored, signed hashes, dp rank."""
    pub = KvPublisher(zmq_context, array_tagged=True, topic=b"")
    try:
        await connect(service, pub)
        tokens = TOKENS[: 3 * BS]
        first = ["BlockStored", [-5, -6], None, tokens[: 2 * BS], BS]
        second = ["BlockStored", [7], -6, tokens[2 * BS :], BS, None]
        await pub.send_raw(msgspec.msgpack.encode([1.0, [first], 0]))
        seq = await pub.send_raw(msgspec.msgpack.encode([1.0, [second], 0]))
        await service.wait_applied(WORKER, seq)
        assert matched(service) == PrefixMatch(gpu=3)
        seq = await pub.send_raw(msgspec.msgpack.encode([1.0, [["BlockRemoved", [-6]]], 0]))
        await service.wait_applied(WORKER, seq)
        assert matched(service) == PrefixMatch(gpu=1)
    finally:
        await pub.close()


async def test_reconnects_when_engine_comes_up_late(
    service: KvIndexService, zmq_context: zmq.asyncio.Context
) -> None:
    port, replay_port = free_port(), free_port()
    events, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    service.worker_added(EngineWorker(WORKER, str(WORKER), endpoints=(Endpoints(events, replay),)))
    pub = KvPublisher(zmq_context, bind=(port, replay_port))
    try:
        async with asyncio.timeout(5):
            await pub.subscribed.wait()
        seq = await pub.publish(stored(0, 2))
        await service.wait_applied(WORKER, seq)
        assert matched(service) == PrefixMatch(gpu=2)
        assert service.connected(WORKER)
    finally:
        await pub.close()
    # The engine goes away: what kvgate knew of it goes too.
    await wait_until(lambda: matched(service) is None)


async def test_remove_worker_drops_entries(
    service: KvIndexService, publisher: KvPublisher, registry: CollectorRegistry
) -> None:
    await connect(service, publisher)
    await service.wait_applied(WORKER, await publisher.publish(stored(0, 5)))
    assert service.events.entry_count() == 5
    service.worker_removed(WORKER)
    await service.settled()
    assert service.events.entry_count() == 0
    assert matched(service) is None
    assert metric(registry, "kvgate_index_resets_total", worker=WORKER, reason="removed") == 1


async def test_data_parallel_ranks_are_separate(
    service: KvIndexService, zmq_context: zmq.asyncio.Context
) -> None:
    pubs = [KvPublisher(zmq_context) for _ in range(2)]
    try:
        sources = [
            Endpoints(p.events_endpoint, p.replay_endpoint, rank) for rank, p in enumerate(pubs)
        ]
        service.worker_added(EngineWorker(WORKER, str(WORKER), endpoints=tuple(sources)))
        for pub in pubs:
            async with asyncio.timeout(5):
                await pub.subscribed.wait()
        await service.wait_applied(WORKER, await pubs[0].publish(stored(0, 2)), dp_rank=0)
        await service.wait_applied(WORKER, await pubs[1].publish(stored(0, 6)), dp_rank=1)
        domains = service.events.find_matches(request_keys())  # type: ignore[arg-type]
        assert sorted((d.dp_rank, m.gpu) for d, m in domains.items()) == [(0, 2), (1, 6)]
        assert matched(service) == PrefixMatch(gpu=6)  # best rank
    finally:
        for pub in pubs:
            await pub.close()


async def test_health_changes_follow_the_worker_and_keep_its_entries(
    http: httpx.AsyncClient, publisher: KvPublisher
) -> None:
    """A worker's health as the registry reports it changes nothing it indexed; learning its
    model (the registry reads it from /v1/models) subscribes it again with that model's block
    size, and its history is replayed under it."""
    config = IndexConfig(block_size=BS, model_block_sizes={"big": 2 * BS}, replay_timeout_s=2.0)
    registry = CollectorRegistry()
    service = KvIndexService(config, registry, http)
    await service.start()
    endpoints = (Endpoints(publisher.events_endpoint, publisher.replay_endpoint),)
    try:
        service.worker_added(EngineWorker(WORKER, str(WORKER), endpoints=endpoints))
        async with asyncio.timeout(5):
            await publisher.subscribed.wait()
        big_block = BlockStored([1000], None, TOKENS[: 2 * BS], 2 * BS, None, "GPU")
        seq = await publisher.publish(big_block)
        await service.wait_applied(WORKER, seq)
        mismatched = "kvgate_index_block_size_mismatch_total"
        assert metric(registry, mismatched, worker=WORKER) == 1  # checked against BS
        unhealthy = EngineWorker(WORKER, str(WORKER), endpoints=endpoints, healthy=False)
        service.worker_health_changed(unhealthy)
        assert service.stats()["workers"][WORKER]["healthy"] is False
        big = EngineWorker(WORKER, str(WORKER), endpoints=endpoints, model="big", healthy=True)
        service.worker_health_changed(big)
        big_keys = block_keys(TOKENS[: 2 * BS], 2 * BS, cache_seed(None, None))
        await wait_until(lambda: service.match(big_keys).get(WORKER) == PrefixMatch(gpu=1))
        service.worker_health_changed(EngineWorker(WORKER, str(WORKER), endpoints, model="big"))
        assert service.match(big_keys).get(WORKER) == PrefixMatch(gpu=1)  # nothing dropped
    finally:
        await service.stop()


async def test_entries_metric_by_worker_and_tier(
    service: KvIndexService, publisher: KvPublisher, registry: CollectorRegistry
) -> None:
    await connect(service, publisher)
    await publisher.publish(stored(0, 3))
    seq = await publisher.publish(stored(3, 5, medium="CPU"))
    await service.wait_applied(WORKER, seq)
    labels = {"source": "events", "worker": WORKER, "dp_rank": "0"}
    assert metric(registry, "kvgate_index_entries", **labels, tier="GPU") == 3
    assert metric(registry, "kvgate_index_entries", **labels, tier="CPU") == 2
    assert metric(registry, "kvgate_index_events_total", worker=WORKER, type="BlockStored") == 2


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_ipv6_endpoints(service: KvIndexService, zmq_context: zmq.asyncio.Context) -> None:
    """An engine publishing on an IPv6 address (an IPv6-only pod) is subscribed and replayed."""
    pub = KvPublisher(zmq_context, host="::1")
    try:
        assert pub.events_endpoint.startswith("tcp://[::1]:")
        await pub.publish(stored(0, 3))  # before kvgate connects: learnt through the replay
        await connect(service, pub)
        seq = await pub.publish(stored(3, 5))
        await service.wait_applied(WORKER, seq)
        assert matched(service) == PrefixMatch(gpu=5)
    finally:
        await pub.close()
