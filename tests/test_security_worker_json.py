"""Deep JSON from a worker (issue 44, finding 3): every decode of a worker's answer goes through
``index.jsonsafe`` (depth-capped, never ``RecursionError``), and no background loop dies of
what a worker answers.

A hostile worker here is a real HTTP server on 127.0.0.1 answering JSON nested 100,000 deep
where an engine answers JSON: its model list, a chat answer's body, its first SSE event, its
5xx error body. kvgate (``kvgate serve`` as a process, or the app under uvicorn) starts,
keeps the worker unhealthy with the reason, keeps probing and discovering, and a client gets
the honest worker's answer (failover) or an OpenAI-style error, never a plain-text 500.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate, quiet_health
from fakes.process import kvgate_process
from fakes.server import serve
from fakes.wait import wait_until
from prometheus_client import CollectorRegistry
from starlette.types import Receive, Send

from kvgate.backends.discovery import DiscoveredFleet
from kvgate.backends.engines import SGLANG
from kvgate.index.errors import JsonDecodeError
from kvgate.index.jsonsafe import MAX_JSON_DEPTH, decode_json, decode_json_as
from kvgate.index.types import WorkerId
from kvgate.router.app import create_app
from kvgate.router.commit import StreamStart, Verdict
from kvgate.router.config import load_settings
from kvgate.router.errors import UpstreamHTTPError
from kvgate.router.gateway import Gateway
from kvgate.router.usage import SseUsageTap, usage_from_body
from kvgate.scheduling.affinity import ClientKeyId, ResponseAffinity

pytestmark = pytest.mark.anyio
DEPTH = 100_000
MODEL = "fake-model"
PROBE_S = 10.0  # the start probe's timeout: generous, on a loaded box


def deep(depth: int = DEPTH) -> bytes:
    return b"[" * depth + b"]" * depth


DEEP_MODELS = b'{"object":"list","data":[{"id":"fake-model","object":"model","x":' + deep() + b"}]}"
DEEP_BODY = b'{"id":"x","object":"chat.completion","choices":' + deep() + b',"usage":{}}'
DEEP_EVENT = b'data: {"choices":' + deep() + b"}\n\n"


@dataclass
class HostileEngine(FakeEngine):
    """A fake engine answering deep JSON: its model list (``deep_models``) and/or its chat
    answers (``chat``: ``body``: a 200 body; ``error``: a 500 body; ``event``: the first SSE
    event of a stream)."""

    deep_models: bool = False
    chat: str | None = None

    async def _route(self, method: str, path: str, body: Any, receive: Receive, send: Send) -> None:
        if (method, path) == ("GET", "/v1/models") and self.deep_models:
            await _raw(send, 200, "application/json", DEEP_MODELS)
        elif (method, path) == ("POST", "/v1/chat/completions") and self.chat is not None:
            if self.chat == "body":
                await _raw(send, 200, "application/json", DEEP_BODY)
            elif self.chat == "error":
                await _raw(send, 500, "application/json", b'{"error":' + deep() + b"}")
            else:
                await _raw(send, 200, "text/event-stream", DEEP_EVENT + b"data: [DONE]\n\n")
        else:
            await super()._route(method, path, body, receive, send)


async def _raw(send: Send, status: int, content_type: str, body: bytes) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def chat(stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"].startswith("application/json"), response.text[:200]
    error = response.json()["error"]
    assert {"message", "type", "code"} <= error.keys()
    return dict(error)


# -- the one decoder ---------------------------------------------------------------------------
def test_the_decoder_refuses_depth_whatever_the_callers_stack() -> None:
    def at_depth(n: int) -> JsonDecodeError:
        if n > 0:
            return at_depth(n - 1)
        with pytest.raises(JsonDecodeError) as caught:
            decode_json(deep())
        return caught.value

    # 50 frames short of the interpreter's limit: a recursive parser would fail here anyway
    error = at_depth(sys.getrecursionlimit() - 50)
    assert error.too_deep and f"deeper than {MAX_JSON_DEPTH}" in str(error)
    assert decode_json(deep(MAX_JSON_DEPTH)) == decode_json(deep(MAX_JSON_DEPTH))
    with pytest.raises(JsonDecodeError) as shape:
        decode_json_as(b'{"tokens": "no"}', dict[str, list[int]])
    assert not shape.value.too_deep
    for garbage in (b"", b"{", b"NaN", b"\xff", b'{"a": 1,}'):
        with pytest.raises(JsonDecodeError):
            decode_json(garbage)


def test_every_decoder_of_worker_answers_takes_deep_json() -> None:
    start = StreamStart(1 << 20)
    assert start.feed(DEEP_EVENT) is Verdict.FAILED  # a broken answer: the attempt fails
    assert start.failure is not None and "deeper than" in start.failure
    with pytest.raises(JsonDecodeError):
        usage_from_body(DEEP_BODY)
    tap = SseUsageTap(hide=True)
    usage_event = b'data: {"usage":' + deep() + b"}\n\n"
    assert tap.feed(usage_event) == usage_event and tap.usage is None  # relayed, no usage
    affinity = ResponseAffinity(8, 60.0)
    tap_ids = affinity.tap(ClientKeyId("k"))
    assert tap_ids.feed(WorkerId("w"), b'{"object":"response","id":"r","x":' + deep() + b"}")
    assert len(affinity) == 0
    error = UpstreamHTTPError(500, b'{"error":' + deep() + b"}", "application/json", worker="w")
    assert b"deeper than" in error.body_bytes() and len(error.body_bytes()) < 300
    assert error.sse_bytes().startswith(b'data: {"error":')
    assert SGLANG.parse_server_info(b'{"page_size":' + deep() + b"}").block_size is None


# -- start, admin, background loops ------------------------------------------------------------
def _unhealthy_with_reason(workers: dict[str, Any], url: str) -> str:
    worker = next(w for w in workers["workers"] if w["url"] == url)
    assert worker["healthy"] is False
    reason = str(worker["last_error"])
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in reason
    return reason


async def test_kvgate_serve_starts_beside_a_worker_listing_deep_models(tmp_path: Path) -> None:
    async with fleet(FakeEngine(), HostileEngine(deep_models=True)) as f:
        honest, hostile = f.urls
        async with (
            kvgate_process(honest, tmp_path / "kvgate.log", "--worker", hostile) as (port, _),
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client,
        ):
            workers = (await client.get("/admin/workers")).json()
            _unhealthy_with_reason(workers, hostile)
            async with serve(HostileEngine(deep_models=True)) as another:
                added = await client.post("/admin/workers", json={"url": another.url})
                assert added.status_code == 201, added.text
                assert added.headers["content-type"] == "application/json"
                _unhealthy_with_reason({"workers": [added.json()]}, another.url)
            answer = await client.post("/v1/chat/completions", json=chat())
            assert answer.status_code == 200
            assert answer.headers["x-kvgate-worker"] == honest


class ScriptedDns:
    def __init__(self, answer: list[str]) -> None:
        self.answer = answer
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        return list(self.answer)


async def test_discovery_and_probes_go_on_past_a_hostile_pod() -> None:
    honest, hostile = FakeEngine(), HostileEngine(deep_models=True)
    async with serve(honest, host="127.0.0.1") as a, serve(hostile, host="127.0.0.2", port=a.port):
        good, bad = a.url, f"http://127.0.0.2:{a.port}"
        target = f"dns://engines.test:{a.port}?events_port=auto&interval=0.02&remove_after=1"
        settings = load_settings(
            overrides={
                "discover": [target],
                "policy": "round_robin",
                "health": quiet_health(interval_s=0.05),
            }
        )
        registry = CollectorRegistry()
        app = create_app(settings, metrics_registry=registry)
        gateway: Gateway = app.state.gateway
        dns = ScriptedDns(["127.0.0.1", "127.0.0.2"])
        discovery_metrics = CollectorRegistry()
        gateway.discovery = DiscoveredFleet(  # the same wiring, with a scripted resolver
            [target],
            add=gateway.add_worker,
            remove=gateway.remove_worker,
            exists=lambda url: gateway.registry.find(url) is not None,
            registry=discovery_metrics,
            resolver=dns,
        )
        async with (
            serve(app, lifespan="on") as running,
            httpx.AsyncClient(base_url=running.url, timeout=10) as client,
        ):
            assert {w.url for w in gateway.registry} == {good, bad}
            _unhealthy_with_reason((await client.get("/admin/workers")).json(), bad)
            # the probe loop goes on: the hostile worker is asked (and fails) round after round
            labels = {"worker": bad}
            failures = registry.get_sample_value("kvgate_health_probe_failures_total", labels)
            await wait_until(
                lambda: (
                    registry.get_sample_value("kvgate_health_probe_failures_total", labels)
                    >= (failures or 0) + 3
                ),
                10,
                "probe rounds",
            )
            # and so does discovery: the pod leaving is followed
            dns.answer = ["127.0.0.1"]
            await wait_until(lambda: gateway.registry.find(bad) is None, 10, "hostile pod removed")
            labels = {"target": f"engines.test:{a.port}"}
            up = discovery_metrics.get_sample_value("kvgate_discovery_up", labels)
            assert up == 1.0
            ready = await client.get("/ready")
            assert ready.status_code == 200


async def test_a_worker_that_turns_hostile_is_read_again_without_killing_the_loop() -> None:
    hostile = HostileEngine()
    async with fleet(FakeEngine(), hostile) as f:
        honest, bad = f.urls
        health = quiet_health(models_interval_s=0.05, timeout_s=PROBE_S)
        async with kvgate([honest, bad], health=health) as gw:
            assert gw.gateway.registry.get(bad).healthy
            hostile.deep_models = True  # its model list turns deep: kept as it was, loop alive
            seen = len([s for s in hostile.seen if s.path == "/v1/models"])
            await wait_until(
                lambda: len([s for s in hostile.seen if s.path == "/v1/models"]) >= seen + 3,
                10,
                "model refresh rounds",
            )
            assert gw.gateway.registry.get(bad).models == {MODEL}
            assert gw.metric("kvgate_health_round_failures_total", {"loop": "models"}) == 0


# -- chat answers --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "stream", "reason"),
    [("body", False, "bad_answer"), ("error", False, "http_5xx"), ("event", True, "error_event")],
)
async def test_deep_answers_to_a_chat_fail_over(mode: str, stream: bool, reason: str) -> None:
    async with fleet(FakeEngine(), HostileEngine(chat=mode)) as f:
        honest, bad = f.urls
        health = quiet_health(failure_threshold=100, timeout_s=PROBE_S)
        async with kvgate([honest, bad], health=health) as gw:
            assert gw.gateway.registry.healthy_count() == 2
            for _ in range(4):  # round robin: the hostile worker is the first choice twice
                answer = await gw.client.post("/v1/chat/completions", json=chat(stream))
                assert answer.status_code == 200, answer.text[:300]
                assert answer.headers["x-kvgate-worker"] == honest
            retried = gw.metric("kvgate_upstream_retries_total", {"worker": bad, "reason": reason})
            assert retried >= 1


@pytest.mark.parametrize(
    ("mode", "stream", "status", "code"),
    [
        ("body", False, 502, "upstream_protocol_error"),
        ("error", False, 500, "upstream_http_500"),
        ("error", True, 500, "upstream_http_500"),
        ("event", True, 502, "upstream_stream_error"),
    ],
)
async def test_deep_answers_of_the_only_worker_are_openai_errors(
    mode: str, stream: bool, status: int, code: str
) -> None:
    health = quiet_health(timeout_s=PROBE_S)
    async with fleet(HostileEngine(chat=mode)) as f, kvgate(f.urls, health=health) as gw:
        assert gw.gateway.registry.healthy_count() == 1
        answer = await gw.client.post("/v1/chat/completions", json=chat(stream))
        assert answer.status_code == status
        error = assert_openai_error(answer)
        assert error["code"] == code
        assert len(answer.content) < 1000  # kvgate's own message, not the worker's depth
