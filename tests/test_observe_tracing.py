"""Tracing end to end: a real kvgate exports its spans over OTLP/HTTP to a real receiver.

The receiver (``fakes.otlp``) is an HTTP server on 127.0.0.1 decoding the protobuf bodies
with the opentelemetry-proto package, as a collector would. The spans are checked for their
parent/child structure, timing order and attributes, and the ``traceparent`` each fake
engine received for continuity: client span -> kvgate request span -> upstream attempt span
-> the engine. Export is flushed with the SDK's ``force_flush`` (in a thread: the receiver
answers on this event loop), never waited for by sleeping.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from fakes.engine import FakeEngine
from fakes.gateway import Kvgate, fleet, kvgate
from fakes.otlp import CLIENT, ERROR, SERVER, OtlpReceiver, Received
from fakes.server import RunningServer, serve
from fakes.wait import wait_until
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from kvgate.backends.process import free_port
from kvgate.router.config import ConfigError, load_settings
from kvgate.router.logs import configure_logging
from kvgate.router.observe import client_trace_id, start_tracing, tracing_requested
from kvgate.router.tracing import OwnDraw

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
PROMPT = list(range(100, 148))  # 48 token ids: 3 blocks of 16


def traceparent(trace: str = TRACE, span: str = CLIENT_SPAN, flags: str = "01") -> str:
    return f"00-{trace}-{span}-{flags}"


@asynccontextmanager
async def receiver() -> AsyncIterator[tuple[OtlpReceiver, RunningServer]]:
    sink = OtlpReceiver()
    async with serve(sink) as server:
        yield sink, server


def answered(gw: Kvgate) -> float:
    total = 0.0
    for family in gw.metrics_registry.collect():
        if family.name == "kvgate_requests":
            total += sum(s.value for s in family.samples if s.name == "kvgate_requests_total")
    return total


async def flush(gw: Kvgate, requests: int) -> None:
    """Wait until ``requests`` requests ended (their spans too), then export everything."""
    await wait_until(lambda: answered(gw) >= requests, 10, f"{requests} requests to end")
    tracing = gw.gateway.observer.tracing
    assert tracing is not None
    assert await asyncio.to_thread(tracing.force_flush, 10.0)


def only(spans: list[Received]) -> Received:
    assert len(spans) == 1, spans
    return spans[0]


async def test_a_request_is_one_trace_joined_to_the_client_and_the_engine() -> None:
    engine = FakeEngine("a", cached_tokens=16)
    async with (
        receiver() as (sink, collector),
        fleet(engine) as f,
        kvgate(f.urls, policy="kv", otlp_traces_endpoint=f"{collector.url}/v1/traces") as gw,
    ):
        body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 3, "stream": True}
        warm = await gw.client.post("/v1/completions", json=body)  # the index learns the prefix
        assert warm.status_code == 200
        response = await gw.client.post(
            "/v1/completions",
            json=body,
            headers={"traceparent": traceparent(), "x-request-id": "traced-1"},
        )
        assert response.status_code == 200
        predicted = int(response.headers["x-kvgate-predicted-cached-tokens"])
        assert predicted > 0
        await flush(gw, 2)

    assert sink.content_types == {"application/x-protobuf"}
    traced = [s for s in sink.spans if s.trace_id == TRACE]
    root = only([s for s in traced if s.kind == SERVER])
    assert root.parent_id == CLIENT_SPAN  # the client's span is the parent
    assert root.name == "POST /v1/completions"
    assert root.service == "kvgate"
    children = sorted(sink.children(root), key=lambda s: s.start_ns)
    assert [c.name for c in children] == ["parse", "tokenize", "index match", "score", "upstream"]
    for before, after in itertools.pairwise(children):
        assert before.end_ns <= after.start_ns  # consecutive phases, in order
    assert all(root.start_ns <= c.start_ns and c.end_ns <= root.end_ns for c in children)

    upstream = children[-1]
    assert upstream.kind == CLIENT
    assert upstream.attributes["kvgate.worker"] == f.urls[0]
    assert upstream.attributes["kvgate.attempt"] == 0
    assert upstream.attributes["http.response.status_code"] == 200
    assert upstream.attributes["kvgate.connection_reused"] is True  # the warm-up's connection
    phases = sorted(sink.children(upstream), key=lambda s: s.start_ns)
    assert [p.name for p in phases] == ["connect", "first byte", "relay"]
    assert phases[0].end_ns == phases[1].start_ns and phases[1].end_ns == phases[2].start_ns
    assert phases[-1].end_ns <= upstream.end_ns <= root.end_ns

    assert root.attributes == root.attributes | {
        "kvgate.request_id": "traced-1",
        "http.request.method": "POST",
        "url.path": "/v1/completions",
        "http.response.status_code": 200,
        "gen_ai.request.model": "fake-model",
        "kvgate.worker": f.urls[0],
        "kvgate.policy": "kv",
        "kvgate.predicted_cached_tokens": predicted,
        "kvgate.best_available_cached_tokens": predicted,  # one worker: the best is its own
        "kvgate.engine_cached_tokens": 16,
        "gen_ai.usage.input_tokens": len(PROMPT),
        "gen_ai.usage.output_tokens": 3,
        "kvgate.attempts": 1,
        "kvgate.retries": 0,
        "kvgate.failover": False,
        "kvgate.stream": True,
        "kvgate.client_key_id": "-",
    }
    assert isinstance(root.attributes["kvgate.decision_reason"], str)
    assert root.attributes["kvgate.ttft_ms"] > 0
    # the engine got kvgate's attempt span as its parent, in the client's trace
    assert engine.seen[-1].headers["traceparent"] == traceparent(span=upstream.span_id)
    # the warm-up request had no traceparent: a trace of its own, kvgate's span the root
    other = only([s for s in sink.spans if s.kind == SERVER and s.trace_id != TRACE])
    assert other.parent_id == ""


async def test_failover_shows_each_attempt_and_the_engine_that_answered() -> None:
    async with (
        receiver() as (sink, collector),
        fleet(FakeEngine("a"), FakeEngine("b")) as f,
        kvgate(f.urls, otlp_traces_endpoint=f"{collector.url}/v1/traces") as gw,
    ):
        await f.servers[0].stop()  # a is gone, but still believed healthy: its turn fails over
        body = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}
        for i in range(2):  # round robin: one of the two requests starts on a
            trace = f"{i + 1:032x}"
            headers = {"traceparent": traceparent(trace=trace)}
            response = await gw.client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 200
        await flush(gw, 2)

    root = only([s for s in sink.spans if s.kind == SERVER and s.attributes["kvgate.retries"]])
    assert root.attributes["kvgate.attempts"] == 2
    assert root.attributes["kvgate.failover"] is True
    assert root.attributes["kvgate.worker"] == f.urls[1]
    attempts = [s for s in sink.children(root) if s.name == "upstream"]
    failed, good = sorted(attempts, key=lambda s: s.attributes["kvgate.attempt"])
    assert failed.attributes["kvgate.worker"] == f.urls[0]
    assert failed.status == ERROR
    assert failed.attributes["error.type"] == "upstream_connect_error"
    connect = only(sink.children(failed))
    assert (connect.name, connect.status) == ("connect", ERROR)
    assert good.attributes["kvgate.worker"] == f.urls[1]
    assert good.status != ERROR
    assert root.status != ERROR
    sent = [s.headers.get("traceparent", "") for s in f.engines[1].seen]
    assert traceparent(trace=root.trace_id, span=good.span_id) in sent


async def test_sampling_follows_the_rate_not_the_clients_flag() -> None:
    """``--trace-sample-rate`` holds whatever the client's ``traceparent`` says: its sampled
    flag, or a trace id low enough to pass any ratio test, records nothing at rate 0."""
    engine = FakeEngine()
    async with (
        receiver() as (sink, collector),
        fleet(engine) as f,
        kvgate(
            f.urls, otlp_traces_endpoint=f"{collector.url}/v1/traces", trace_sample_rate=0.0
        ) as gw,
    ):
        body = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}
        low = "0" * 31 + "1"
        for headers in ({}, {"traceparent": traceparent()}, {"traceparent": traceparent(low)}):
            reply = await gw.client.post("/v1/completions", json=body, headers=headers)
            assert reply.status_code == 200
            flags = engine.seen[-1].headers["traceparent"].rsplit("-", 1)[1]
            assert int(flags, 16) & 1 == 0  # propagated, marked not sampled
        await flush(gw, 3)
        assert sink.spans == []


async def test_a_trusted_parent_decides_when_the_operator_allows_it() -> None:
    engine = FakeEngine()
    async with (
        receiver() as (sink, collector),
        fleet(engine) as f,
        kvgate(
            f.urls,
            otlp_traces_endpoint=f"{collector.url}/v1/traces",
            trace_sample_rate=0.0,
            trace_trust_parent=True,
        ) as gw,
    ):
        body = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}
        headers = {"traceparent": traceparent()}
        assert (await gw.client.post("/v1/completions", json=body, headers=headers)).status_code
        await flush(gw, 1)
        assert {s.trace_id for s in sink.spans} == {TRACE}
        assert int(engine.seen[-1].headers["traceparent"].rsplit("-", 1)[1], 16) & 1


def test_the_own_draw_keeps_to_its_rate() -> None:
    """Half of 2,000 requests, whatever their parent says, within a generous margin."""
    sampler = OwnDraw(0.5, random.Random(7))
    parent = set_span_in_context(
        NonRecordingSpan(SpanContext(1, 1, True, TraceFlags(TraceFlags.SAMPLED)))
    )
    sampled = sum(
        sampler.should_sample(parent, 1, "x").decision is Decision.RECORD_AND_SAMPLE
        for _ in range(2000)
    )
    assert 900 < sampled < 1100


async def test_bad_traceparents_warn_once_per_window() -> None:
    """OpenTelemetry warns once per over-long ``traceparent`` or malformed ``tracestate``:
    thirty such requests leave one line each, the rest held back and counted."""
    stream = io.StringIO()
    output = configure_logging("info", "json", stream)
    try:
        async with (
            receiver() as (_, collector),
            fleet(FakeEngine()) as f,
            kvgate(f.urls, otlp_traces_endpoint=f"{collector.url}/v1/traces") as gw,
        ):
            body = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}
            for i in range(30):
                headers = {"traceparent": traceparent() + "-" + "x" * (600 + i)}
                assert await gw.client.post("/v1/completions", json=body, headers=headers)
                headers = {"traceparent": traceparent(), "tracestate": f"bad member {i}"}
                assert await gw.client.post("/v1/completions", json=body, headers=headers)
            await flush(gw, 60)
    finally:
        output.close()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    warned = [line["message"] for line in lines if line["logger"].startswith("opentelemetry")]
    assert len(warned) == 2, warned
    assert any("traceparent header exceeded" in m for m in warned)
    assert any("w3c identifiers format" in m for m in warned)


async def test_the_standard_endpoint_variable_alone_turns_export_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with receiver() as (sink, collector), fleet(FakeEngine()) as f:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)  # + /v1/traces
        monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-router")
        async with kvgate(f.urls) as gw:
            body = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}
            assert (await gw.client.post("/v1/completions", json=body)).status_code == 200
            await flush(gw, 1)
    root = only([s for s in sink.spans if s.kind == SERVER])
    assert root.service == "edge-router"
    assert {c.name for c in sink.children(root)} >= {"parse", "score", "upstream"}


async def test_a_collector_down_costs_no_request_and_stopping_is_bounded() -> None:
    """Export runs on the SDK's thread: with nothing listening at the endpoint every request
    is answered and traced upstream as usual, and stopping abandons the exporter's retries
    (``Tracing.shutdown``'s bound) instead of waiting for the OTLP timeout."""
    engine = FakeEngine()
    dead = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    async with fleet(engine) as f, kvgate(f.urls, otlp_traces_endpoint=dead) as gw:
        body = {"model": "fake-model", "prompt": "hello", "max_tokens": 2}
        for _ in range(3):
            headers = {"traceparent": traceparent()}
            response = await gw.client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 200
            assert engine.seen[-1].headers["traceparent"].startswith(f"00-{TRACE}-")
        await wait_until(lambda: answered(gw) >= 3, 10, "3 requests to end")
        tracing = gw.gateway.observer.tracing
        assert tracing is not None
        assert await asyncio.to_thread(tracing.shutdown, 0.5)  # the queued spans, abandoned


def test_when_tracing_is_on() -> None:
    settings = load_settings(overrides={})
    flagged = load_settings(overrides={"otlp_traces_endpoint": "http://collector:4318/v1/traces"})
    assert not tracing_requested(settings, {})
    assert tracing_requested(flagged, {})
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        assert tracing_requested(settings, {variable: "http://collector:4318"})
    assert not tracing_requested(flagged, {"OTEL_SDK_DISABLED": "true"})
    assert not tracing_requested(flagged, {"OTEL_TRACES_EXPORTER": "none"})
    assert start_tracing(settings, {}) is None


def test_misconfigured_export_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    flagged = load_settings(overrides={"otlp_traces_endpoint": "http://collector:4318/v1/traces"})
    with pytest.raises(ConfigError, match="http/protobuf only"):
        start_tracing(flagged, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(ConfigError, match="otlp_traces_endpoint"):
        load_settings(overrides={"otlp_traces_endpoint": "collector:4318"})
    monkeypatch.setitem(sys.modules, "kvgate.router.tracing", None)  # the extra is not installed
    with pytest.raises(ConfigError, match=r"kvgate\[otel\]"):
        start_tracing(flagged, {})


def test_client_trace_id() -> None:
    assert client_trace_id([(b"traceparent", traceparent().encode())]) == TRACE
    for bad in (b"00-xyz-b7ad6b7169203331-01", b"garbage", b"00-" + b"0" * 32 + b"-1-01"):
        assert client_trace_id([(b"traceparent", bad)]) is None
    assert client_trace_id([(b"x-other", b"1")]) is None


def test_the_base_install_never_loads_the_sdk() -> None:
    """Tracing off: building and serving the app imports no OpenTelemetry SDK or exporter
    (the API module is FastAPI's own dependency)."""
    code = (
        "import sys\n"
        "from router.app import create_app\n"
        "from router.config import load_settings\n"
        "import router.serve\n"
        "create_app(load_settings(overrides={}))\n"
        "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter', 'opentelemetry.proto', 'kvgate.router.tracing'))]\n"
        "print(loaded)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVGATE_"))}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
