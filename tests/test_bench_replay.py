"""The replayer against a small real engine written here (uvicorn on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from fakes.server import serve
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from kvgate.bench.replay import ReplayConfig, parse_prometheus, replay, select_slice
from kvgate.bench.report import References, markdown_table, summarize
from kvgate.bench.traces import SyntheticAgentOptions, TraceRequest, synthetic_agent_sessions

BLOCK = 16


@dataclass
class FakeEngine:
    """Prefix cache at 16-word blocks; remembers when each session's turns ran."""

    seen: set[tuple[str, ...]] = field(default_factory=set)
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    requests: int = 0

    def cached(self, words: list[str]) -> int:
        n = 0
        while n + BLOCK < len(words) and tuple(words[: n + BLOCK]) in self.seen:
            n += BLOCK
        for end in range(BLOCK, len(words) + 1, BLOCK):
            self.seen.add(tuple(words[:end]))
        return n


def make_app(engine: FakeEngine) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = json.loads(await request.body())
        words = body["prompt"].split(" ")
        cached = engine.cached(words)
        engine.requests += 1
        user = body.get("user") or "-"
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def stream() -> AsyncIterator[bytes]:
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0)
                chunk = {"choices": [{"index": 0, "text": " tok"}], "usage": None}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            usage = {
                "prompt_tokens": len(words),
                "completion_tokens": body["max_tokens"],
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"
            engine.spans.setdefault(user, []).append((start, loop.time()))

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"x-kvgate-worker": "fake-0"}
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            '# HELP x\nvllm:num_requests_running{model_name="m"} 2.0\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {engine.requests}.0\n'
        )

    return app


@pytest.mark.anyio
async def test_replay_records_every_request_in_session_order() -> None:
    reqs = synthetic_agent_sessions(
        SyntheticAgentOptions(
            sessions=3, turns=4, session_rate=50.0, mean_gap_s=0.01, seed=1, output_tokens=(2, 6)
        )
    )
    engine = FakeEngine()
    async with serve(make_app(engine)) as server:
        url = server.url
        cfg = ReplayConfig(
            target=url,
            speedup=10.0,
            progress=False,
            block_tokens=512,
            metrics_urls=(f"{url}/metrics",),
            metrics_interval_s=0.05,
        )
        result = await replay(reqs, cfg)
    assert len(result.records) == len(reqs) == 12
    assert all(r.status == "ok" for r in result.records), [r.error for r in result.records]
    for rec, req in zip(result.records, reqs, strict=True):
        assert rec.prompt_tokens == req.input_length
        assert rec.output_tokens == req.output_length
        assert rec.worker == "fake-0"
        assert rec.ttft_s is not None and rec.e2e_s is not None and rec.ttft_s <= rec.e2e_s
    # turns of one session never overlap at the engine
    for spans in engine.spans.values():
        assert len(spans) == 4
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end
    later_turns = [r for r in result.records if r.expected_prompt_tokens > 6000]
    assert any(r.cached_tokens > 0 for r in later_turns)
    assert result.final_metrics[f"{url}/metrics"]["vllm:num_requests_waiting"] == 12.0
    summary = summarize(
        "fake", result.records, oracle_hit_rate=0.9, wall_s=result.wall_s, replicas=1
    )
    assert summary.ok == 12 and 0.0 < summary.hit_rate <= 1.0
    assert summary.per_worker_requests == {"fake-0": 12}
    assert "| fake | 12/12 |" in markdown_table([summary], References(0.9))


@pytest.mark.anyio
async def test_unreachable_target_is_recorded_not_raised() -> None:
    reqs = [TraceRequest(i, i * 0.001, 20, 2, (i,)) for i in range(3)]
    cfg = ReplayConfig(target="http://127.0.0.1:9", progress=False, request_timeout_s=2.0)
    result = await replay(reqs, cfg)
    assert [r.status for r in result.records] == ["error"] * 3


def test_slice_is_fixed_by_schedule_not_by_wall_clock() -> None:
    reqs = [TraceRequest(i, float(i), 20, 2, (i,)) for i in range(10)]
    cfg = ReplayConfig(target="x", speedup=2.0, max_duration_s=2.0)
    assert [r.index for r in select_slice(reqs, cfg)] == [0, 1, 2, 3, 4]
    cfg = ReplayConfig(target="x", max_requests=3)
    assert len(select_slice(reqs, cfg)) == 3


def test_parse_prometheus_sums_label_sets() -> None:
    text = 'a_total{x="1"} 2\na_total{x="2"} 3.5\n# TYPE b gauge\nb 1e3\nc 7\n'
    assert parse_prometheus(text, ["a_total", "b"]) == {"a_total": 5.5, "b": 1000.0}
