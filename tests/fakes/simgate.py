"""kvgate (real uvicorn) in front of simulated vLLM replicas (real HTTP, real ZMQ), for the
end-to-end tests of what kvgate learns from the engines: block size, adapters, model lists,
the Responses API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from test_sim_support import shared_tokenizer

from fakes.gateway import Kvgate, kvgate
from kvgate.backends.sim.config import (
    ApiConfig,
    EngineConfig,
    EventsConfig,
    LoraModule,
    SimConfig,
    TimingConfig,
)
from kvgate.backends.sim.fleet import SimFleet
from kvgate.backends.sim.tokenizer import tokenizer_dir

MODEL = "kvgate-sim"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing"


def fleet_config(
    replicas: int = 1, *, block_size: int = 16, lora: Sequence[str] = (), **engine: Any
) -> SimConfig:
    """Fast simulated replicas on ephemeral loopback ports."""
    return SimConfig(
        replicas=replicas,
        port=0,
        events_port=0,
        engine=replace(
            EngineConfig(),
            block_size=block_size,
            capacity_blocks=4096,
            lora_modules=tuple(LoraModule.parse(spec) for spec in lora),
            **engine,
        ),
        timing=TimingConfig(speedup=1000.0),
        events=EventsConfig(topic="kv-events"),
        api=ApiConfig(),
    )


@asynccontextmanager
async def sim_fleets(*configs: SimConfig) -> AsyncIterator[list[SimFleet]]:
    """Started fleets (one per config), stopped when the block ends."""
    async with AsyncExitStack() as stack:
        fleets = []
        for config in configs:
            fleet = SimFleet(config, tokenizer=shared_tokenizer())
            fleets.append(await stack.enter_async_context(fleet))
        yield fleets


def worker_specs(fleet: SimFleet, **extra: str) -> list[str]:
    """Worker entries of a fleet's replicas, their KV events configured."""
    options = "".join(f",{k}={v}" for k, v in extra.items())
    return [f"{r.url},events={r.events},replay={r.replay}{options}" for r in fleet.replicas]


@asynccontextmanager
async def gate(workers: Sequence[str], **overrides: Any) -> AsyncIterator[Kvgate]:
    """kvgate with the kv policy and the simulator's tokenizer."""
    overrides.setdefault("policy", "kv")
    overrides.setdefault("tokenizers", [f"{MODEL}={tokenizer_dir()}"])
    async with kvgate(workers, **overrides) as gw:
        yield gw


def chat(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        **extra,
    }


def long_text(tag: str, words: int = 120) -> str:
    """A prompt of several blocks, distinct per ``tag``."""
    base = WORDS.split()
    return f"{tag}: " + " ".join(base[i % len(base)] for i in range(words))


def cached_tokens(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return int(details["cached_tokens"])


def predicted(reply: httpx.Response) -> int:
    return int(reply.headers["x-kvgate-predicted-cached-tokens"])


async def until(predicate: Any, limit_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (sync or async) until true; fail after ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def indexed(gw: Kvgate, body: dict[str, Any], worker: str, path: str = "/debug/route") -> int:
    """The overlap kvgate predicts for ``body`` on ``worker`` once its events are indexed."""
    overlap = 0

    async def some() -> bool:
        nonlocal overlap
        explained = (await gw.client.post(path, json=body)).json()
        entry = next(w for w in explained["workers"] if w["worker"] == worker)
        overlap = int(entry.get("overlap_tokens", 0))
        return overlap > 0

    await until(some, what=f"blocks of the prompt indexed for {worker}")
    return overlap


async def replica_counter(url: str, name: str, **labels: str) -> float:
    """The sum of counter ``name`` (without ``_total``) over the series of the replica at
    ``url`` whose labels include ``labels``, read from its /metrics."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        text = (await client.get(f"{url}/metrics")).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_total" and labels.items() <= sample.labels.items():
                total += sample.value
    return total
