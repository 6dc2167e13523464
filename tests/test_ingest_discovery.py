"""Discovery from vLLM's GET /kv_event_sources and the engine /tokenize fallback, against a real
HTTP server (uvicorn on 127.0.0.1) standing in for vLLM."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
import zmq.asyncio
from fakes.wait import free_port
from kv_publisher import KvPublisher
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvgate.index.api import Endpoints, EngineWorker, PromptInput
from kvgate.index.config import IndexConfig
from kvgate.index.events import BlockStored, _sources, parse_sources, resolve_endpoint
from kvgate.index.events._sources import on_worker_host
from kvgate.index.keys import _engine, block_keys, cache_seed
from kvgate.index.service import KvIndexService
from kvgate.index.types import PrefixMatch, WorkerId

pytestmark = pytest.mark.anyio


class FakeVllm:
    def __init__(
        self, sources: dict[str, Any] | None, port: int = 0, *, raw: bytes | None = None
    ) -> None:
        """``raw``: what to answer both calls with instead (a hostile worker)."""
        self.sources = sources
        self.raw = raw
        self.tokenize_bodies: list[dict[str, Any]] = []
        app = Starlette(
            routes=[
                Route("/kv_event_sources", self.kv_event_sources),
                Route("/tokenize", self.tokenize, methods=["POST"]),
            ]
        )
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        self.task: asyncio.Task[None] | None = None

    async def kv_event_sources(self, request: Request) -> Response:
        if self.raw is not None:
            return Response(self.raw, media_type="application/json")
        if self.sources is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse(self.sources)

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        self.tokenize_bodies.append(body)
        if self.raw is not None:
            return Response(self.raw, media_type="application/json")
        text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        tokens = [len(word) for word in text.split()]
        return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def __aenter__(self) -> str:
        self.task = asyncio.create_task(self.server.serve())
        async with asyncio.timeout(10):
            while not self.server.started:  # noqa: ASYNC110 - uvicorn exposes only a flag
                await asyncio.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        assert self.task is not None
        await self.task


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def test_parse_sources_and_wildcards() -> None:
    body = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "topic": "kv-events",
        },
        "1": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://0.0.0.0:5559",
            "replay_endpoint": None,
        },
        "2": {"enable_kv_cache_events": False, "publisher": "zmq", "endpoint": "tcp://*:1"},
    }
    assert parse_sources(body, "http://10.0.0.7:8000") == [
        Endpoints("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", 0),
        Endpoints("tcp://10.0.0.7:5559", None, 1),
    ]
    assert resolve_endpoint("tcp://10.1.1.1:5", "http://h:1") == "tcp://10.1.1.1:5"
    assert resolve_endpoint("tcp://*:5", "http://[::1]:1") == "tcp://[::1]:5"


async def test_discovered_events_are_ingested(http: httpx.AsyncClient) -> None:
    context = zmq.asyncio.Context()
    publisher = KvPublisher(context)
    events_port = publisher.events_endpoint.rsplit(":", 1)[1]
    replay_port = publisher.replay_endpoint.rsplit(":", 1)[1]
    sources = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": "kv-events",
        }
    }
    service = KvIndexService(IndexConfig(block_size=2), CollectorRegistry(), http)
    await service.start()
    try:
        async with FakeVllm(sources) as url:
            worker = WorkerId(url)
            service.worker_added(EngineWorker(worker, url, healthy=True))
            await service.settled()
            assert service.has_events(worker)
            async with asyncio.timeout(5):
                await publisher.subscribed.wait()
            seq = await publisher.publish(BlockStored([1, 2], None, [5, 6, 7, 8], 2, None, "GPU"))
            await service.wait_applied(worker, seq)
            keys = block_keys([5, 6, 7, 8], 2, cache_seed(None, None))
            assert service.match(keys) == {worker: PrefixMatch(gpu=2)}  # type: ignore[arg-type]
            # Events present: routing decisions do not feed the approximate index.
            service.record_routed(worker, keys)  # type: ignore[arg-type]
            assert service.approx.entry_count() == 0
    finally:
        await service.stop()
        await publisher.close()
        context.term()


async def test_no_events_means_approximate_mode_and_engine_tokenize(
    http: httpx.AsyncClient,
) -> None:
    registry = CollectorRegistry()
    service = KvIndexService(IndexConfig(block_size=2), registry, http)
    await service.start()
    try:
        async with FakeVllm(None) as url:
            worker = WorkerId(url)
            service.worker_added(EngineWorker(worker, url, healthy=True))
            await service.settled()
            assert not service.has_events(worker)
            prompt = PromptInput("chat", messages=[{"role": "user", "content": "a bb ccc dddd"}])
            keys = await service.keys_for("m", prompt)
            assert keys.mode == "engine"
            assert list(keys.block_keys) == block_keys([1, 2, 3, 4], 2, cache_seed(None, None))
            assert keys.prompt_tokens == 4
            service.record_routed(worker, keys.block_keys)
            assert service.match(keys.block_keys) == {worker: PrefixMatch(gpu=2)}
            assert service.stats()["workers"][worker]["mode"] == "approx"
            explained = await service.explain("m", prompt)
            assert explained["mode"] == "engine"
            assert explained["matches"] == {worker: {"gpu": 2, "cpu": 0, "disk": 0}}
        # Engine gone: a new prompt gets approximate keys from the rendered text (one keyed
        # before keeps the engine's tokens, remembered).
        again = await service.keys_for("m", prompt)
        assert again.mode == "engine"
        prompt = PromptInput("chat", messages=[{"role": "user", "content": "eeeee ffffff"}])
        keys = await service.keys_for("m", prompt)
        assert keys.mode == "approx"
    finally:
        await service.stop()
    assert registry.get_sample_value("kvgate_tokenize_total", {"model": "m", "mode": "engine"}) == 3


HOSTILE_ANSWERS = {
    "too large": b'{"tokens": [' + b"1," * 40_000 + b'1], "0": {"endpoint": "tcp://*:1"}}',
    "nested": b'{"tokens": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "not token ids": b'{"tokens": [-1, 4294967296, true], "0": "x"}',
    "not json": b"{tokens",
}


@pytest.mark.parametrize("answer", sorted(HOSTILE_ANSWERS))
async def test_hostile_engine_answers_cost_nothing(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    """Whatever a worker answers to /kv_event_sources and /tokenize (past the byte caps,
    nested too deep, ids that are not uint32, not JSON), the index carries on: approximate
    mode, approximate keys."""
    monkeypatch.setattr(_engine, "_MAX_ANSWER_BYTES", 64 * 1024)
    monkeypatch.setattr(_sources, "_MAX_ANSWER_BYTES", 64 * 1024)
    service = KvIndexService(IndexConfig(block_size=2), CollectorRegistry(), http)
    await service.start()
    try:
        async with FakeVllm(None, raw=HOSTILE_ANSWERS[answer]) as url:
            worker = WorkerId(url)
            service.worker_added(EngineWorker(worker, url, healthy=True))
            await service.settled()
            assert not service.has_events(worker)
            prompt = PromptInput("chat", messages=[{"role": "user", "content": "a bb ccc"}])
            assert (await service.keys_for("m", prompt)).mode == "approx"
    finally:
        await service.stop()


async def test_a_declared_endpoint_elsewhere_needs_the_allowlist(http: httpx.AsyncClient) -> None:
    """An event endpoint a worker declares on another host is subscribed to only if the
    router's check admits it (without one: never); on its own host it always is."""
    asked: list[str] = []

    async def allow_127_0_0_2(endpoint: str) -> bool:
        asked.append(endpoint)
        return endpoint.startswith("tcp://127.0.0.2:")

    declared = {
        "0": {"publisher": "zmq", "endpoint": "tcp://127.0.0.2:5999"},
        "1": {"publisher": "zmq", "endpoint": "tcp://10.1.2.3:5999"},
        "2": {"publisher": "zmq", "endpoint": "tcp://*:5999", "replay_endpoint": "tcp://*:6000"},
    }
    for check, ranks in ((None, [2]), (allow_127_0_0_2, [0, 2])):
        service = KvIndexService(
            IndexConfig(block_size=2), CollectorRegistry(), http, endpoint_allowed=check
        )
        await service.start()
        try:
            async with FakeVllm(declared) as url:
                worker = WorkerId(url)
                service.worker_added(EngineWorker(worker, url))
                await service.settled()
                subscribers = service.stats()["workers"][worker]["subscribers"]
                assert [s["dp_rank"] for s in subscribers] == ranks
        finally:
            await service.stop()
    assert asked == ["tcp://127.0.0.2:5999", "tcp://10.1.2.3:5999"]


async def test_discovery_is_retried_until_the_worker_answers(http: httpx.AsyncClient) -> None:
    context = zmq.asyncio.Context()
    publisher = KvPublisher(context)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    worker = WorkerId(url)
    sources = {
        "0": {
            "publisher": "zmq",
            "endpoint": publisher.events_endpoint,
            "replay_endpoint": publisher.replay_endpoint,
        }
    }
    config = IndexConfig(block_size=2, reconnect_backoff_s=0.05, reconnect_backoff_max_s=0.2)
    service = KvIndexService(config, CollectorRegistry(), http)
    await service.start()
    try:
        service.worker_added(EngineWorker(worker, url, healthy=True))
        await service.settled()
        assert not service.has_events(worker)  # not up yet: approximate mode meanwhile
        async with FakeVllm(sources, port=port):
            async with asyncio.timeout(10):
                await publisher.subscribed.wait()
            assert service.has_events(worker)
    finally:
        await service.stop()
        await publisher.close()
        context.term()


def test_an_ipc_path_is_on_the_host_of_a_loopback_worker_only() -> None:
    assert on_worker_host("ipc:///tmp/r0.events", "http://127.0.0.1:8000")
    assert on_worker_host("ipc:///tmp/r0.events", "http://localhost:8000")
    assert not on_worker_host("ipc:///tmp/r0.events", "http://10.0.0.5:8000")
    assert not on_worker_host("ipc://", "http://127.0.0.1:8000")
    assert on_worker_host("tcp://10.0.0.5:5557", "http://10.0.0.5:8000")
    assert not on_worker_host("inproc://x", "http://127.0.0.1:8000")
