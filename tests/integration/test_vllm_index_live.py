"""kvgate's index layer against a real vLLM replica: tokens, events, discovery, gaps."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from fakes.wait import wait_until
from prometheus_client import CollectorRegistry
from relay import DroppingRelay
from vllm_helpers import (
    BLOCK,
    MODEL,
    ChatSession,
    engine_cached_tokens,
    usage_of,
    wait_subscribed,
)

from kvgate.backends.process import PortAllocator
from kvgate.backends.vllm_cpu.launch import Fleet, ReplicaSpec
from kvgate.index.api import Endpoints, EngineWorker, PromptInput
from kvgate.index.config import IndexConfig
from kvgate.index.keys import block_keys, cache_seed
from kvgate.index.service import KvIndexService
from kvgate.index.types import WorkerId

pytestmark = [pytest.mark.vllm, pytest.mark.anyio]

ROOT_SEED = cache_seed(None, None)


@pytest.fixture
def replica(vllm_fleet: Fleet) -> ReplicaSpec:
    return vllm_fleet.replicas[1].spec


@pytest.fixture
async def engine(replica: ReplicaSpec) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=replica.url, timeout=60.0) as client:
        yield client


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def service(
    tiny_model_dir: Path, registry: CollectorRegistry
) -> AsyncIterator[KvIndexService]:
    config = IndexConfig(block_size=BLOCK, default_tokenizer=tiny_model_dir, engine_tokenize=False)
    async with httpx.AsyncClient() as http:
        index = KvIndexService(config, registry, http)
        await index.start()
        try:
            yield index
        finally:
            await index.stop()


async def engine_tokens(engine: httpx.AsyncClient, body: dict[str, Any]) -> list[int]:
    reply = await engine.post("/tokenize", json={"model": MODEL, **body})
    reply.raise_for_status()
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def chat_input(messages: list[dict[str, str]]) -> PromptInput:
    return PromptInput(kind="chat", messages=messages)


CHAT_CASES = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": 'Tools: {"name": "read_file", "args": ["path"]}\n\tdone'},
        {"role": "user", "content": "Ünïcödé, emoji 😀 and  double  spaces\n\nnew paragraph"},
        {"role": "assistant", "content": "<|im_start|> is literal text here </s>"},
        {"role": "user", "content": "ok " * 100},
    ],
    ChatSession.start("parity", seed=7).ask(120),
]


@pytest.mark.parametrize("messages", CHAT_CASES, ids=["short", "specials", "long"])
async def test_chat_tokens_and_keys_match_vllm(
    service: KvIndexService, engine: httpx.AsyncClient, messages: list[dict[str, str]]
) -> None:
    expected = await engine_tokens(engine, {"messages": messages, "add_generation_prompt": True})
    keys = await service.keys_for(MODEL, chat_input(messages))
    again = await service.keys_for(MODEL, chat_input(messages))  # the prefix-cache path
    assert keys.mode == "tokenizer"
    assert keys.prompt_tokens == len(expected)
    assert list(keys.block_keys) == block_keys(expected, BLOCK, ROOT_SEED)
    assert list(again.block_keys) == list(keys.block_keys)


@pytest.mark.parametrize("prompt", ["Hello world", "x" * 700, "def f(a):\n    return a  # 😀"])
async def test_completion_tokens_and_keys_match_vllm(
    service: KvIndexService, engine: httpx.AsyncClient, prompt: str
) -> None:
    expected = await engine_tokens(engine, {"prompt": prompt})
    keys = await service.keys_for(MODEL, PromptInput(kind="completion", prompt=prompt))
    assert keys.prompt_tokens == len(expected)  # BOS included, as the engine adds it
    assert list(keys.block_keys) == block_keys(expected, BLOCK, ROOT_SEED)


async def _chat(engine: httpx.AsyncClient, messages: list[dict[str, str]]) -> tuple[int, int]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    reply = await engine.post("/v1/chat/completions", json=body)
    reply.raise_for_status()
    return usage_of(reply.json())


async def _blocks_on(service: KvIndexService, worker: WorkerId, messages: Any) -> int:
    keys = await service.keys_for(MODEL, chat_input(messages))
    match = service.match(keys.block_keys).get(worker)
    return match.blocks if match is not None else 0


async def _expect_indexed(
    service: KvIndexService, worker: WorkerId, messages: list[dict[str, str]], blocks: int
) -> None:
    keys = await service.keys_for(MODEL, chat_input(messages))

    def indexed() -> bool:
        match = service.match(keys.block_keys).get(worker)
        return match is not None and match.gpu == blocks

    await wait_until(indexed, 10.0, f"{blocks} blocks of the prompt indexed on {worker}")


async def test_events_make_the_index_predict_the_engine_cache(
    service: KvIndexService, engine: httpx.AsyncClient, replica: ReplicaSpec
) -> None:
    worker = WorkerId(replica.url)
    endpoints = Endpoints(replica.events_endpoint, replica.replay_endpoint)
    service.worker_added(EngineWorker(worker, replica.url, endpoints=(endpoints,), healthy=True))
    await wait_until(lambda: service.connected(worker), 10.0, "the subscriber to connect")
    session = ChatSession.start("index-live", seed=11)
    for turn in range(3):
        messages = session.ask()
        predicted_blocks = await _blocks_on(service, worker, messages)
        prompt_tokens, cached = await _chat(engine, messages)
        assert cached == engine_cached_tokens(prompt_tokens, predicted_blocks), f"turn {turn}"
        await _expect_indexed(service, worker, messages, prompt_tokens // BLOCK)
        session.answer(f"reply {turn}")


async def test_discovery_from_kv_event_sources(
    service: KvIndexService, engine: httpx.AsyncClient, replica: ReplicaSpec
) -> None:
    worker = WorkerId(replica.url)
    service.worker_added(EngineWorker(worker, replica.url, healthy=True))
    await service.settled()
    subscribers = service.stats()["workers"][worker]["subscribers"]
    assert [(s["events"], s["replay"]) for s in subscribers] == [
        (replica.events_endpoint, replica.replay_endpoint)
    ]
    await wait_until(lambda: service.connected(worker), 10.0, "the subscriber to connect")
    messages = ChatSession.start("index-discovery", seed=12).ask(80)
    prompt_tokens, _ = await _chat(engine, messages)
    await _expect_indexed(service, worker, messages, prompt_tokens // BLOCK)


def _replays(registry: CollectorRegistry, worker: WorkerId, outcome: str) -> float:
    value = registry.get_sample_value(
        "kvgate_index_replays_total", {"worker": worker, "outcome": outcome}
    )
    return value or 0.0


async def test_a_dropped_batch_is_replayed_from_the_engine(
    service: KvIndexService,
    registry: CollectorRegistry,
    engine: httpx.AsyncClient,
    replica: ReplicaSpec,
    zmq_context: zmq.Context[zmq.Socket[bytes]],
    ports: PortAllocator,
) -> None:
    upstream = wait_subscribed(zmq_context, replica.events_endpoint)
    relay = DroppingRelay(zmq_context, upstream, ports.one()).start()
    try:
        worker = WorkerId(replica.url)
        endpoints = Endpoints(relay.endpoint, replica.replay_endpoint)
        service.worker_added(EngineWorker(worker, replica.url, endpoints=(endpoints,)))
        await wait_until(lambda: service.connected(worker), 10.0, "the subscriber to connect")
        warm = ChatSession.start("gap-warm", seed=21).ask(40)
        tokens, _ = await _chat(engine, warm)
        await _expect_indexed(service, worker, warm, tokens // BLOCK)
        replays_before = _replays(registry, worker, "covered")

        relay.drop(1)
        lost = ChatSession.start("gap-lost", seed=22).ask(70)
        lost_tokens, _ = await _chat(engine, lost)
        await wait_until(lambda: relay.counts()[1] == 1, 10.0, "the relay to drop one batch")
        assert await _blocks_on(service, worker, lost) == 0  # kvgate has not seen it (yet)

        after = ChatSession.start("gap-after", seed=23).ask(50)
        after_tokens, _ = await _chat(engine, after)  # its seq reveals the gap
        await _expect_indexed(service, worker, after, after_tokens // BLOCK)
        await _expect_indexed(service, worker, lost, lost_tokens // BLOCK)
        assert _replays(registry, worker, "covered") == replays_before + 1
        _, cached = await _chat(engine, lost)
        assert cached == engine_cached_tokens(lost_tokens, lost_tokens // BLOCK)
    finally:
        service.worker_removed(WorkerId(replica.url))
        await service.settled()
        relay.close()
