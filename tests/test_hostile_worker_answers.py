"""Hostile worker answers against a real kvgate (property-based; issue 44, finding 3).

One kvgate (the production app and listener configuration under uvicorn on 127.0.0.1) in
front of one scripted worker, a real HTTP server on 127.0.0.1 whose next answer hypothesis
writes: any status and content type, bodies of valid and mangled JSON, JSON nested up to
3,000 deep, arbitrary bytes, SSE streams of such events cut at any byte. Both run in a thread
of their own; the test sends chat requests (streamed or not) with a blocking client.

Properties: every request gets kvgate's answer (its ``x-request-id``, never the server's
bare 500 for an exception), a failed answer is an OpenAI-style error unless it is the
worker's own 4xx/5xx passed through, nothing is logged with a traceback, and the worker's
model list, whatever it holds, is read without an unexpected error (the probe's catch-all
never fires).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fakes.engine import FakeEngine
from fakes.gateway import Kvgate, fleet, kvgate, quiet_health
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.types import Receive, Send

MODEL = "fake-model"
LIMIT_S = 30.0  # "no hang" guard per request, far above any answer's time
EXAMPLES = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Answer:
    status: int
    content_type: str | None
    chunks: list[bytes]


@dataclass
class ScriptedEngine(FakeEngine):
    """A fake engine whose chat answer (``answer``) and model list (``models_answer``) the
    test sets; anything else as the fake engine answers it."""

    answer: Answer | None = None
    models_answer: Answer | None = None

    async def _route(self, method: str, path: str, body: Any, receive: Receive, send: Send) -> None:
        scripted = self.answer if path == "/v1/chat/completions" else None
        if path == "/v1/models":
            scripted = self.models_answer
        if scripted is None:
            await super()._route(method, path, body, receive, send)
            return
        kind = scripted.content_type
        headers = [] if kind is None else [(b"content-type", kind.encode())]
        await send({"type": "http.response.start", "status": scripted.status, "headers": headers})
        for chunk in scripted.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


class Tracebacks(logging.Handler):
    """Every record logged with an exception, anywhere."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


@dataclass
class Scene:
    engine: ScriptedEngine
    engine_url: str
    gateway: Kvgate
    loop: asyncio.AbstractEventLoop
    tracebacks: Tracebacks = field(default_factory=Tracebacks)

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(LIMIT_S)


@pytest.fixture(scope="module")
def scene() -> Iterator[Scene]:
    ready, box = threading.Event(), {}

    async def main() -> None:
        stop = asyncio.Event()
        engine = ScriptedEngine(name="scripted")
        health = quiet_health(failure_threshold=10**6, recovery_threshold=1, timeout_s=10.0)
        async with fleet(engine) as f, kvgate(f.urls, health=health, kv_index=False) as gw:
            box["scene"] = Scene(engine, f.urls[0], gw, asyncio.get_running_loop())
            box["stop"] = stop
            ready.set()
            await stop.wait()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to the test thread, which fails with it
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(60), "kvgate and the scripted worker did not start"
    if "error" in box:
        raise box["error"]
    found: Scene = box["scene"]
    logging.getLogger().addHandler(found.tracebacks)
    try:
        yield found
    finally:
        logging.getLogger().removeHandler(found.tracebacks)
        found.loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)


# -- strategies -----------------------------------------------------------------------------
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def deep_json(draw: st.DrawFn) -> bytes:
    depth = draw(st.sampled_from([150, 199, 200, 201, 250, 1_000, 3_000]))
    if draw(st.booleans()):
        inner = b"[" * depth + b"]" * depth
    else:
        inner = b'{"a":' * depth + b"1" + b"}" * depth
    where = draw(st.sampled_from(["bare", "choices", "usage", "error", "response"]))
    if where == "bare":
        return inner
    if where == "response":
        return b'{"object":"response","id":"r1","response":' + inner + b"}"
    return b'{"id":"x","object":"chat.completion","' + where.encode() + b'":' + inner + b"}"


def chunk_like(value: Any) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": value}]}


JSON_DOCS = st.one_of(
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    JSON_VALUES.map(lambda v: json.dumps(chunk_like(v)).encode()),
    JSON_VALUES.map(lambda v: json.dumps({"error": v}).encode()),
    JSON_VALUES.map(lambda v: json.dumps({"choices": [], "usage": v}).encode()),
    JSON_VALUES.map(lambda v: json.dumps({"type": "response.created", "response": v}).encode()),
    deep_json(),
    st.binary(max_size=64).filter(lambda b: b"\n" not in b and b"\r" not in b),
)
EVENTS = st.one_of(
    JSON_DOCS.map(lambda doc: b"data: " + doc + b"\n\n"),
    st.just(b"data: [DONE]\n\n"),
    JSON_DOCS.map(lambda doc: b"event: error\ndata: " + doc + b"\n\n"),
    st.just(b": keep-alive\n\n"),
    st.binary(max_size=64),
)


@st.composite
def cut(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` cut at up to three arbitrary points."""
    points = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    pieces, start = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[start:point])
        start = point
    return [p for p in pieces if p]


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    status = draw(st.sampled_from([200, 200, 200, 400, 404, 429, 500, 502, 503]))
    if draw(st.booleans()):
        body = b"".join(draw(st.lists(EVENTS, min_size=1, max_size=6)))
        content_type: str | None = "text/event-stream"
    else:
        body = draw(JSON_DOCS)
        content_type = draw(st.sampled_from(["application/json", "text/plain", None]))
    return Answer(status, content_type, draw(cut(body)))


# -- the properties --------------------------------------------------------------------------
def check_no_tracebacks(scene: Scene) -> None:
    records, scene.tracebacks.records = scene.tracebacks.records, []
    assert not records, [f"{r.name}: {r.getMessage()}" for r in records]


@EXAMPLES
@given(answer=answers(), stream=st.booleans())
def test_hostile_chat_answers(scene: Scene, answer: Answer, stream: bool) -> None:
    scene.engine.answer = answer
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    with httpx.Client(base_url=scene.gateway.url, timeout=LIMIT_S) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert "x-request-id" in response.headers, (response.status_code, response.text[:200])
    if response.status_code >= 400 and response.status_code != answer.status:
        # not the worker's own status passed through: kvgate's error, OpenAI-style
        error = response.json()["error"]
        assert {"message", "type", "code"} <= error.keys(), error
        assert len(response.content) < 4096  # kvgate's message, never the worker's depth
    check_no_tracebacks(scene)


@settings(EXAMPLES, max_examples=100)  # one JSON document each: a smaller space
@given(answer=answers())
def test_hostile_model_lists(scene: Scene, answer: Answer) -> None:
    scene.engine.models_answer = answer
    registry = scene.gateway.gateway.registry
    worker = registry.get(scene.engine_url)

    async def probe_from_unhealthy() -> bool:
        worker.healthy = False  # a probe of an unhealthy worker reads its model list
        return await scene.gateway.gateway.health.probe(worker)

    try:
        healthy = scene.call(probe_from_unhealthy())
        assert healthy == (worker.last_error is None)
        if not healthy:
            assert str(worker.last_error).startswith("health probe: ")
        assert scene.gateway.metric("kvgate_health_round_failures_total", {"loop": "probe"}) == 0
        check_no_tracebacks(scene)
    finally:
        scene.engine.models_answer = None
        assert scene.call(probe_from_unhealthy())  # as it was: the default list
