"""The gateway proxy end to end: real uvicorn kvgate in front of real fake engines."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate
from fakes.wait import wait_until

from kvgate.scheduling.capacity import KV_FIT
from kvgate.scheduling.config import Tuning

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


def sse_data(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


async def test_chat_non_streaming_forwards_original_bytes_and_headers() -> None:
    async with fleet(FakeEngine("a")) as f, kvgate(f.urls) as gw:
        raw = b'{"model": "fake-model",  "messages": [{"role":"user","content":"hi"}], "knob": 7}'
        r = await gw.client.post(
            "/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json", "x-request-id": "req-1"},
        )
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2"
        assert r.headers["x-kvgate-worker"] == f.urls[0]
        assert r.headers["x-request-id"] == "req-1"
        assert r.headers["x-kvgate-predicted-cached-tokens"] == "0"
        seen = f.engines[0].seen[-1]
        assert seen.path == "/v1/chat/completions"
        assert seen.body["knob"] == 7
        assert seen.headers["x-request-id"] == "req-1"


async def test_completions_with_token_ids_and_batch_prompt() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        r = await gw.client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": [1, 2, 3, 4]}
        )
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens"] == 4
        r = await gw.client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": ["a b", "c"]}
        )
        assert r.status_code == 200
        assert r.json()["object"] == "text_completion"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_streaming_relays_every_chunk(path: str) -> None:
    body = {**CHAT, "stream": True, "fake": {"tokens": 5}}
    if path == "/v1/completions":
        body = {"model": "fake-model", "prompt": "one two", "stream": True, "fake": {"tokens": 5}}
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        async with gw.client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            text = "".join([chunk async for chunk in r.aiter_text()])
        events = sse_data(text)
        assert events[-1] == "[DONE]"
        assert len(events) == 6  # 5 tokens + [DONE], the usage kvgate asked for is hidden
        assert all("usage" not in json.loads(e) for e in events[:-1])
        assert f.engines[0].seen[-1].body["stream_options"] == {"include_usage": True}


async def test_stream_is_relayed_before_the_engine_finishes() -> None:
    """The first chunk reaches the client while the engine still holds the rest."""
    engine = FakeEngine()
    body = {**CHAT, "stream": True, "fake": {"hold": "after_first_chunk"}}
    async with (
        fleet(engine) as f,
        kvgate(f.urls) as gw,
        gw.client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        first = await anext(r.aiter_raw())
        assert b"tok0" in first
        assert engine.holding == 1
        engine.release.set()


async def test_a_streamed_answer_counts_its_blocks_as_held_until_it_ends() -> None:
    """64 tokens streamed (of 65) fill 4 blocks of 16 past the prompt's; the end of the
    stream releases the prompt's and the answer's blocks together."""
    engine = FakeEngine()
    body = {**CHAT, "stream": True, "fake": {"tokens": 65, "hold": "before_last_chunk"}}
    async with fleet(engine) as f, kvgate(f.urls, tuning=Tuning(parts=KV_FIT)) as gw:
        worker = gw.sent(f.urls[0])
        prompt = (await gw.client.post("/debug/route", json=body)).json()["prompt_tokens"]
        prompt_blocks = -(-prompt // 16)
        async with gw.client.stream("POST", "/v1/chat/completions", json=body) as r:
            await wait_until(lambda: engine.holding == 1, what="64 tokens streamed")
            held = prompt_blocks + 4
            await wait_until(lambda: worker.active_decode_blocks == held, what="the answer held")
            engine.release.set()
            events = sse_data((await r.aread()).decode())
        assert len(events) == 65 + 1  # every token, then [DONE]
        await wait_until(lambda: worker.in_flight == 0, what="load released")
        assert worker.active_decode_blocks == 0


async def test_client_disconnect_cancels_upstream_and_releases_load() -> None:
    engine = FakeEngine()
    body = {**CHAT, "stream": True, "fake": {"hold": "after_first_chunk"}}
    async with fleet(engine) as f, kvgate(f.urls) as gw:
        worker = gw.sent(f.urls[0])
        async with (
            httpx.AsyncClient(base_url=gw.url) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            await anext(r.aiter_raw())
            assert worker.in_flight == 1
        # leaving the block closed the client connection mid-stream
        await wait_until(engine.cancel_seen.is_set, what="engine to see the cancel")
        await wait_until(lambda: worker.in_flight == 0, what="load released")
        assert worker.pending_prefill_tokens == 0 and worker.active_decode_blocks == 0
        labels = {"worker": f.urls[0], "model": "fake-model", "status": "499"}
        await wait_until(
            lambda: gw.metric("kvgate_requests_total", labels) == 1, what="499 counted"
        )


async def test_client_disconnect_before_headers_cancels_upstream() -> None:
    engine = FakeEngine()
    body = {**CHAT, "fake": {"hold": "before_headers"}}
    async with fleet(engine) as f, kvgate(f.urls) as gw:
        worker = gw.sent(f.urls[0])
        async with httpx.AsyncClient(base_url=gw.url) as client:

            async def call() -> None:
                await client.post("/v1/chat/completions", json=body)

            async with anyio.create_task_group() as group:
                group.start_soon(call)
                await wait_until(lambda: engine.holding == 1, what="engine holding")
                group.cancel_scope.cancel()  # the client gives up: its connection closes
        await wait_until(engine.cancel_seen.is_set, what="engine to see the cancel")
        await wait_until(lambda: worker.in_flight == 0, what="load released")


async def test_openai_sdk_streaming_and_not() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls, api_keys=["sk-client"]) as gw:
        sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-client", max_retries=0)
        try:
            reply = await sdk.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}]
            )
            assert reply.choices[0].message.content == "tok0 tok1 tok2"
            stream = await sdk.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            parts = [chunk.choices[0].delta.content async for chunk in stream]
            assert "".join(p or "" for p in parts) == "tok0 tok1 tok2 "
            models = await sdk.models.list()
            assert [m.id for m in models.data] == ["fake-model"]
            completion = await sdk.completions.create(model="fake-model", prompt="x y")
            assert completion.choices[0].text == "tok0 tok1 tok2"
        finally:
            await sdk.close()


async def test_models_union_and_routing_by_model() -> None:
    a = FakeEngine("a", models=["m1"])
    b = FakeEngine("b", models=["m1", "m2"])
    async with fleet(a, b) as f, kvgate(f.urls) as gw:
        r = await gw.client.get("/v1/models")
        assert [m["id"] for m in r.json()["data"]] == ["m1", "m2"]
        for _ in range(3):
            r = await gw.client.post("/v1/completions", json={"model": "m2", "prompt": "x"})
            assert r.headers["x-kvgate-worker"] == f.urls[1]
        r = await gw.client.get("/v1/models/m2")
        assert r.json()["id"] == "m2"


async def test_embeddings_and_other_v1_paths_pass_through() -> None:
    async with fleet(FakeEngine("a", models=["emb"])) as f, kvgate(f.urls) as gw:
        r = await gw.client.post("/v1/embeddings", json={"model": "emb", "input": "hello"})
        assert r.status_code == 200
        assert r.json()["data"][0]["embedding"] == [0.5, 0.25]
        assert r.headers["x-kvgate-worker"] == f.urls[0]
        r = await gw.client.post("/v1/unknown_thing", json={"model": "emb"})
        assert r.status_code == 404  # the engine's own 404, passed through


async def test_failover_on_refused_connection() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    async with fleet(a, b) as f, kvgate(f.urls, policy="round_robin") as gw:
        await f.servers[0].stop()  # a is still marked healthy: its first request is refused
        for _ in range(2):
            r = await gw.client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            assert r.headers["x-kvgate-worker"] == f.urls[1]
        worker_a = gw.gateway.registry.get(f.urls[0])
        assert not worker_a.healthy
        assert gw.sent(f.urls[0]).in_flight == 0
        assert (
            gw.metric(
                "kvgate_upstream_retries_total",
                {"worker": f.urls[0], "reason": "refused"},
            )
            == 1
        )
        assert (
            gw.metric("kvgate_failovers_total", {"worker": f.urls[1], "model": "fake-model"}) >= 1
        )


async def test_usage_captured_streaming_and_not() -> None:
    engine = FakeEngine(cached_tokens=2)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "a b c d"}]}
    async with fleet(engine) as f, kvgate(f.urls) as gw:
        labels = {"worker": f.urls[0], "model": "fake-model"}
        await gw.client.post("/v1/chat/completions", json=body)
        assert gw.metric("kvgate_engine_cached_tokens_total", labels) == 2
        assert gw.metric("kvgate_prompt_tokens_total", labels) == 4
        # stream, usage not asked by the client: requested upstream, hidden downstream
        r = await gw.client.post("/v1/chat/completions", json={**body, "stream": True})
        assert all("usage" not in json.loads(e) for e in sse_data(r.text)[:-1])
        assert gw.metric("kvgate_engine_cached_tokens_total", labels) == 4
        # stream, usage asked by the client: passed through, still counted
        asked = {**body, "stream": True, "stream_options": {"include_usage": True}}
        r = await gw.client.post("/v1/chat/completions", json=asked)
        usage = [json.loads(e)["usage"] for e in sse_data(r.text)[:-1] if "usage" in e]
        assert usage and usage[0]["prompt_tokens_details"]["cached_tokens"] == 2
        assert gw.metric("kvgate_engine_cached_tokens_total", labels) == 6
        assert gw.metric("kvgate_prompt_tokens_total", labels) == 12
