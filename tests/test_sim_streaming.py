"""When a streaming response opens (vLLM: at accept, before queueing and prefill) and how a
request fails before and after its first token: error events, HTTP errors, dropped
connections, engine crashes. Real HTTP on loopback; the engine is held with the ``pause``
fault instead of timing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fakes.wait import wait_until
from test_sim_support import fault, refused, sim_config, sim_fleet, sse_lines

from kvgate.backends.sim.config import ApiConfig, StreamOpen
from kvgate.backends.sim.fleet import SimFleet

pytestmark = pytest.mark.anyio
MODES: tuple[StreamOpen, ...] = ("at_accept", "at_first_token")
PROMPT = list(range(300, 340))  # 40 tokens: 9 full blocks of 4 are cached after a prefill


def _fleet(stream_open: StreamOpen = "at_accept") -> SimFleet:
    return sim_fleet(sim_config(block_size=4, api=ApiConfig(stream_open=stream_open)))


@pytest.fixture
async def client() -> AsyncIterator[tuple[SimFleet, httpx.AsyncClient]]:
    async with _fleet() as fleet, httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        yield fleet, c


def _completion(**extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 5, **extra}


def _events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body (``[DONE]`` kept as the string)."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def _cached(c: httpx.AsyncClient) -> int:
    reply = await c.post("/v1/completions", json=_completion(max_tokens=1))
    cached: int = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


async def test_at_accept_sends_headers_before_the_request_is_scheduled(
    client: tuple[SimFleet, httpx.AsyncClient],
) -> None:
    fleet, c = client
    engine = fleet.replica(0).engine
    await fault(c, kind="pause")
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3,
            "stream": True}  # fmt: skip
    async with c.stream("POST", "/v1/chat/completions", json=body) as reply:
        # headers in hand while the request still waits in the paused engine, unprefilled
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert len(engine.waiting) == 1 and engine.waiting[0].num_computed == 0
        await fault(c, kind="clear", fault="pause")
        chunks = [json.loads(x[6:]) for x in [x async for x in sse_lines(reply)][:-1]]
    # vLLM's role chunk comes with the first token, not at accept
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [ch["choices"][0]["delta"]["content"] != "" for ch in chunks[1:]] == [True] * 3


async def test_responses_api_sends_created_and_in_progress_at_accept(
    client: tuple[SimFleet, httpx.AsyncClient],
) -> None:
    fleet, c = client
    engine = fleet.replica(0).engine
    await fault(c, kind="pause")
    body = {"input": "hello there", "max_output_tokens": 2, "stream": True}
    async with c.stream("POST", "/v1/responses", json=body) as reply:
        lines = sse_lines(reply)
        head = [await anext(lines) for _ in range(4)]
        assert engine.waiting and engine.waiting[0].num_computed == 0  # not prefilled yet
        await fault(c, kind="clear", fault="pause")
        rest = [line async for line in lines]
    assert head[0] == "event: response.created" and head[2] == "event: response.in_progress"
    assert rest[0] == "event: response.output_item.added"
    assert rest[-2] == "event: response.completed"


@pytest.mark.parametrize("stream_open", MODES)
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", _completion(stream=True)),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": True}),
    ],
)  # fmt: skip
async def test_engine_dying_while_the_request_waits(
    stream_open: StreamOpen, path: str, body: dict[str, Any]
) -> None:
    """at_accept: a 200 stream holding only an error (the case a router must retry);
    at_first_token: an HTTP 500 with an OpenAI error body."""
    async with _fleet(stream_open) as fleet, httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        engine = fleet.replica(0).engine
        await fault(c, kind="pause")
        task = asyncio.create_task(c.post(path, json=body))
        await wait_until(lambda: len(engine.waiting) == 1, what="the request queued")
        await fault(c, kind="restart")
        reply = await task
    if stream_open == "at_first_token":
        assert reply.status_code == 500
        assert reply.json()["error"]["code"] == 500
        return
    assert reply.status_code == 200
    events = _events(reply.text)
    if path == "/v1/responses":
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
        assert events[-1]["message"].startswith("engine restarted")
    else:
        assert [set(e) if isinstance(e, dict) else e for e in events] == [{"error"}, "[DONE]"]
        assert events[0]["error"]["code"] == 500


@pytest.mark.parametrize("stream_open", MODES)
async def test_abort_fault_fails_a_request_after_its_prefill(stream_open: StreamOpen) -> None:
    async with _fleet(stream_open) as fleet, httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        await fault(c, kind="abort", count=2)
        streamed = await c.post("/v1/completions", json=_completion(stream=True))
        plain = await c.post("/v1/completions", json=_completion())
        assert await _cached(c) == 36  # the aborted requests' prefill was done and cached
        assert fleet.replica(0).faults.hits["abort"] == 2
    assert plain.status_code == 500 and plain.json()["error"]["code"] == 500
    if stream_open == "at_first_token":
        assert streamed.status_code == 500
    else:
        assert streamed.status_code == 200
        events = _events(streamed.text)
        assert len(events) == 2 and events[0]["error"]["code"] == 500 and events[1] == "[DONE]"


async def test_abort_after_tokens_cuts_a_stream_mid_way(
    client: tuple[SimFleet, httpx.AsyncClient],
) -> None:
    _, c = client
    await fault(c, kind="abort", count=1, after_tokens=2)
    reply = await c.post("/v1/completions", json=_completion(stream=True))
    events = _events(reply.text)
    assert [("error" in e) if isinstance(e, dict) else e for e in events] == [
        False, False, True, "[DONE]"
    ]  # fmt: skip


async def test_abort_with_drop_resets_the_connection(
    client: tuple[SimFleet, httpx.AsyncClient],
) -> None:
    fleet, c = client
    replica = fleet.replica(0)
    await fault(c, kind="abort", count=2, drop=True)
    async with c.stream("POST", "/v1/completions", json=_completion(stream=True)) as reply:
        assert reply.status_code == 200  # opened at accept, then the connection goes
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            async for _ in reply.aiter_lines():
                pass
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await c.post("/v1/completions", json=_completion())  # no answer at all
    await wait_until(replica.idle, what="the dropped requests gone from the engine")
    assert replica.engine.cache.free_blocks == replica.config.engine.capacity_blocks
    assert (await c.get("/health")).status_code == 200  # the server itself is fine
    assert await _cached(c) == 36


async def test_crash_resets_connections_and_restarts_cold(
    client: tuple[SimFleet, httpx.AsyncClient],
) -> None:
    fleet, c = client
    replica = fleet.replica(0)
    url = fleet.replicas[0].url
    assert (await c.post("/v1/completions", json=_completion())).status_code == 200
    stored = (await c.post("/v1/responses", json={"input": "remember me"})).json()["id"]
    old_hashes = set(replica.snapshot().gpu)
    assert replica.publisher.next_seq > 0
    await fault(c, kind="pause")
    async with c.stream("POST", "/v1/completions", json=_completion(stream=True)) as reply:
        assert reply.status_code == 200
        await fault(c, kind="crash", downtime_s=3600)  # back only when resumed below
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            async for _ in reply.aiter_lines():
                pass
    await wait_until(lambda: refused(url), what="the port refusing connections")
    assert replica.generation == 1 and replica.publisher.next_seq == 0
    assert replica.snapshot().gpu == {} and replica.idle()
    await replica.resume()
    async with httpx.AsyncClient(base_url=url) as fresh:
        await fault(fresh, kind="clear")
        assert await _cached(fresh) == 0
        assert not old_hashes & set(replica.snapshot().gpu)  # a new hash seed
        assert (await fresh.get(f"/v1/responses/{stored}")).status_code == 404
    crashes = replica.registry.get_sample_value("kvgate_sim_faults_total", {"kind": "crash"})
    assert crashes == 1


async def test_pause_with_a_duration_ends_by_itself(
    client: tuple[SimFleet, httpx.AsyncClient],
) -> None:
    fleet, c = client
    await fault(c, kind="pause", duration_s=0.2)
    reply = await c.post("/v1/completions", json=_completion())
    assert reply.status_code == 200
    assert fleet.replica(0).faults.describe() == []
