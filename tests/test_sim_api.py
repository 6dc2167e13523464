"""A simulated replica's HTTP API: OpenAI endpoints (SDK included), vLLM extras, errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import openai
import pytest
from fakes.wait import wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_sim_support import EventLog, expected, sim_config, sim_fleet

from kvgate.backends.engines import VLLM
from kvgate.backends.sim.fleet import SimFleet
from kvgate.index.events import BlockStored, decode_event_batch

pytestmark = pytest.mark.anyio
MODEL = "kvgate-sim"


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(sim_config(replicas=2, block_size=16, speedup=200.0)) as f:
        yield f


@pytest.fixture
async def client(fleet: SimFleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.replicas[0].url, timeout=30) as c:
        yield c


def _chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def test_chat_completion_reports_cached_tokens_on_repeat(client: httpx.AsyncClient) -> None:
    body = _chat("tell me about prefix caching in one short paragraph " * 8, max_tokens=5)
    first = (await client.post("/v1/chat/completions", json=body)).json()
    second = (await client.post("/v1/chat/completions", json=body)).json()
    prompt = first["usage"]["prompt_tokens"]
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 5
    assert len(first["choices"][0]["message"]["content"].split()) == 5
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # every full block but the one holding the last prompt token is reused
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16
    assert second["usage"]["prompt_tokens"] == prompt


async def test_streaming_chat_with_usage(client: httpx.AsyncClient) -> None:
    body = _chat("stream this please", max_tokens=4, stream=True,
                 stream_options={"include_usage": True})  # fmt: skip
    chunks = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [p["choices"][0]["delta"]["content"] for p in parsed[1:-1]]
    assert len(deltas) == 4
    assert parsed[-2]["choices"][0]["finish_reason"] == "length"
    assert parsed[-1]["choices"] == []
    assert parsed[-1]["usage"]["completion_tokens"] == 4


async def test_completions_text_and_token_ids(client: httpx.AsyncClient) -> None:
    text = await client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 3})
    assert text.status_code == 200
    body = text.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 2
    ids = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert ids.json()["usage"]["completion_tokens"] == 2
    chunks = []
    async with client.stream(
        "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}
    ) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_openai_sdk_against_a_replica(fleet: SimFleet) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{fleet.replicas[1].url}/v1", api_key="unused")
    try:
        models = await sdk.models.list()
        assert [m.id for m in models.data] == [MODEL]
        reply = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=3
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        assert reply.usage.prompt_tokens_details is not None
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
        )
        pieces = [c.choices[0].delta.content async for c in stream if c.choices]
        assert len([p for p in pieces if p]) == 2
    finally:
        await sdk.close()


async def test_tokenize_matches_the_shared_tokenizer(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    tok = fleet.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = (await client.post("/tokenize", json={"model": MODEL, "messages": messages})).json()
    rendered = tok.render_chat(messages, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(rendered)
    assert chat["count"] == len(chat["tokens"])
    assert chat["max_model_len"] > 0
    plain = (await client.post("/tokenize", json={"prompt": "Hello, world"})).json()
    assert plain["tokens"] == tok.encode("Hello, world")
    back = (await client.post("/detokenize", json={"tokens": plain["tokens"]})).json()
    assert back["prompt"].startswith("hello")
    # the render endpoints vllm-router's cache_aware policy calls
    render = (await client.post("/v1/chat/completions/render", json=_chat("Hi!"))).json()
    assert render["token_ids"] == tok.encode(tok.render_chat([{"role": "user", "content": "Hi!"}]))
    render_c = (await client.post("/v1/completions/render", json={"prompt": "Hello"})).json()
    assert render_c[0]["token_ids"] == tok.encode("Hello")


async def test_models_health_version_and_event_sources(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    assert (await client.get("/health")).status_code == 200
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["owned_by"] == "vllm"
    assert "version" in (await client.get("/version")).json()
    sources = (await client.get("/kv_event_sources")).json()
    _, events, replay = fleet.replicas[0]
    assert sources["0"]["endpoint"] == events
    assert sources["0"]["replay_endpoint"] == replay
    assert sources["0"]["publisher"] == "zmq"
    assert sources["0"]["topic"] == "kv-events"


async def test_replicas_can_say_sglang_owns_their_models() -> None:
    """``owned_by: sglang``: how smg tells an SGLang worker (its P/D bootstrap protocol)."""
    config = sim_config()
    config = replace(config, api=replace(config.api, owned_by="sglang"))
    async with sim_fleet(config) as fleet, httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        models = (await c.get("/v1/models")).json()
    assert {card["owned_by"] for card in models["data"]} == {"sglang"}


async def test_kv_event_sources_list_format() -> None:
    config = sim_config()
    config = replace(config, events=replace(config.events, sources_format="list"))
    async with sim_fleet(config) as fleet, httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        sources = (await c.get("/kv_event_sources")).json()
        _, events, replay_endpoint = fleet.replicas[0]
    assert sources == [
        {
            "data_parallel_rank": 0,
            "endpoint": events,
            "replay_endpoint": replay_endpoint,
            "topic": "kv-events",
        }
    ]


async def test_metrics_use_vllm_names(client: httpx.AsyncClient) -> None:
    body = _chat("metrics are scraped by routers " * 10, max_tokens=2)
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    text = (await client.get("/metrics")).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_cached_total",
        "vllm:time_to_first_token_seconds_count",
    ):
        assert name in values, name
    assert values["vllm:prefix_cache_hits_total"] > 0
    assert values["vllm:prefix_cache_queries_total"] > values["vllm:prefix_cache_hits_total"]
    assert values["vllm:time_to_first_token_seconds_count"] == 2


@pytest.mark.parametrize(
    ("path", "payload", "status", "param"),
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
        ("/v1/chat/completions", json.dumps(_chat("x", model="other")).encode(), 404, "model"),
        ("/v1/chat/completions", json.dumps(_chat("x", n=2)).encode(), 400, "n"),
        ("/v1/chat/completions", json.dumps(_chat("x", max_tokens=0)).encode(), 400, "max_tokens"),
        ("/v1/chat/completions", json.dumps(_chat("x", max_tokens=10**7)).encode(), 400,
         "max_tokens"),
        ("/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": [10**9]}).encode(), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    ],
)  # fmt: skip
async def test_bad_requests_get_openai_error_bodies(
    client: httpx.AsyncClient, path: str, payload: bytes, status: int, param: str | None
) -> None:
    reply = await client.post(path, content=payload, headers={"content-type": "application/json"})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["param"] == param


async def test_unknown_path_and_method(client: httpx.AsyncClient) -> None:
    assert (await client.get("/nope")).status_code == 404
    wrong = await client.get("/v1/chat/completions")
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == 405


async def test_client_disconnect_aborts_the_request() -> None:
    config = sim_config(block_size=16, speedup=1.0)
    async with sim_fleet(config) as fleet:
        replica = fleet.replica(0)
        async with httpx.AsyncClient(base_url=fleet.replicas[0].url, timeout=30) as c:
            body = _chat("a long answer", max_tokens=5000, stream=True)
            async with c.stream("POST", "/v1/chat/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if '"content"' in line and '"role"' not in line:
                        break  # one token seen: hang up
            await wait_until(replica.idle, what="the aborted request to leave the engine")
        assert replica.engine.cache.free_blocks == config.engine.capacity_blocks
        generated = replica.registry.get_sample_value(
            "vllm:generation_tokens_total", {"model_name": MODEL, "engine": "0"}
        )
        assert generated == 0  # never finished


async def test_requests_queue_beyond_max_num_seqs() -> None:
    async with sim_fleet(sim_config(max_num_seqs=2, speedup=50.0)) as fleet:
        replica = fleet.replica(0)
        seen_waiting = False

        def watch() -> bool:
            nonlocal seen_waiting
            assert len(replica.engine.running) <= 2
            seen_waiting = seen_waiting or bool(replica.engine.waiting)
            return False

        async with httpx.AsyncClient(base_url=fleet.replicas[0].url, timeout=30) as c:
            calls = [
                c.post("/v1/completions", json={"prompt": [9 + i] * 8, "max_tokens": 20})
                for i in range(6)
            ]
            gathered = asyncio.gather(*calls)
            while not gathered.done():
                watch()
                await asyncio.sleep(0.001)
            replies = gathered.result()
        assert all(r.status_code == 200 for r in replies)
        assert seen_waiting


async def test_block_size_32_in_events_and_cache_config_info() -> None:
    """vLLM's CPU backend runs block size 32: the events carry it and /metrics says it, with
    the capacity, on ``vllm:cache_config_info`` as vLLM labels it (engine index, no model)."""
    async with sim_fleet(sim_config(block_size=32, capacity_blocks=500)) as fleet:
        replica = fleet.replica(0)
        url, events, replay_endpoint = fleet.replicas[0]
        async with EventLog(events, replay_endpoint) as log, httpx.AsyncClient(base_url=url) as c:
            body = {"prompt": list(range(100, 200)), "max_tokens": 1}
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            await wait_until(replica.idle)
            await log.complete(replica.publisher.next_seq)
            text = (await c.get("/metrics")).text
        assert log.rebuild() == expected(replica.snapshot())
    [stored] = [e for p in log.batches.values() for e in decode_event_batch(p).events]
    assert isinstance(stored, BlockStored)
    assert stored.block_size == 32 and len(stored.block_hashes) == 3
    [info] = [f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"]
    assert [(s.labels, s.value) for s in info.samples] == [
        ({"engine": "0", "block_size": "32", "num_gpu_blocks": "500", "num_cpu_blocks": "0",
          "enable_prefix_caching": "True"}, 1.0)
    ]  # fmt: skip
    assert VLLM.parse_load(text).kv_capacity_blocks == 500
