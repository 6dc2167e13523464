"""Every error class, with its OpenAI-style body and status, through a real kvgate."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate
from fakes.server import unresponsive_port
from fakes.wait import wait_until

from kvgate.backends import errors as backend
from kvgate.backends.process import free_port
from kvgate.router import errors

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def error_of(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_request"),
        (b'{"messages": []}', "model", "invalid_request"),
        (b'{"model": "fake-model", "messages": "hi"}', "messages", "invalid_request"),
        (b'{"model": "fake-model"}', "messages", "invalid_request"),
        (b'{"model": "fake-model", "messages": [], "stream": "yes"}', "stream", "invalid_request"),
        (b'{"model": 3, "messages": []}', "model", "invalid_request"),
    ],
)
async def test_bad_requests_are_400_naming_the_field(
    raw: bytes, param: str | None, code: str
) -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        r = await gw.client.post("/v1/chat/completions", content=raw)
        assert r.status_code == 400
        err = error_of(r)
        assert err["param"] == param and err["code"] == code
        assert err["type"] == "invalid_request_error"
        assert f.engines[0].seen == [
            s for s in f.engines[0].seen if s.path != "/v1/chat/completions"
        ]


async def test_completion_prompt_type_is_checked() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        r = await gw.client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": {"a": 1}}
        )
        assert r.status_code == 400 and error_of(r)["param"] == "prompt"


async def test_body_over_the_limit_is_413() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls, max_body_bytes=200) as gw:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 500}]}
        r = await gw.client.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and error_of(r)["code"] == "payload_too_large"

        async def chunks():  # no content-length: the limit holds while streaming the body
            for _ in range(10):
                yield b"x" * 50

        r = await gw.client.post("/v1/chat/completions", content=chunks())
        assert r.status_code == 413


async def test_unknown_model_is_404() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert r.status_code == 404
        assert error_of(r)["code"] == "model_not_found" and error_of(r)["param"] == "model"
        r = await gw.client.get("/v1/models/nope")
        assert r.status_code == 404


async def test_no_healthy_worker_is_503_with_retry_after() -> None:
    engine = FakeEngine(models=["fake-model"])
    engine.healthy = False
    worker = {"url": "", "models": ["fake-model"]}
    async with fleet(engine) as f, kvgate([{**worker, "url": f.urls[0]}], retry_after_s=3) as gw:
        assert not gw.gateway.registry.get(f.urls[0]).healthy
        r = await gw.client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "3"
        assert error_of(r)["code"] == "no_healthy_worker"
        ready = await gw.client.get("/ready")
        assert ready.status_code == 503
        assert (await gw.client.get("/health")).status_code == 200


async def test_upstream_timeout_is_504() -> None:
    engine = FakeEngine()
    upstream = {"read_timeout_s": 0.2}
    async with fleet(engine) as f, kvgate(f.urls, upstream=upstream) as gw:
        r = await gw.client.post(
            "/v1/chat/completions", json={**CHAT, "fake": {"hold": "before_headers"}}
        )
        assert r.status_code == 504
        assert error_of(r)["code"] == "upstream_timeout"
        assert r.headers["x-kvgate-worker"] == f.urls[0]
        assert gw.sent(f.urls[0]).in_flight == 0


@pytest.mark.parametrize("status", [400, 422, 500, 503])
async def test_upstream_errors_pass_through_unchanged(status: int) -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        for stream in (False, True):
            body = {**CHAT, "stream": stream, "fake": {"status": status}}
            r = await gw.client.post("/v1/chat/completions", json=body)
            assert r.status_code == status
            assert r.json()["error"]["message"] == f"fake {status}"
            assert r.json()["error"]["code"] == status


async def test_error_after_stream_started_goes_inside_the_stream() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        body = {**CHAT, "stream": True, "fake": {"tokens": 5, "break_stream": True}}
        r = await gw.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert "tok0" in events[0]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "upstream_protocol_error"
        assert events[-1] == "[DONE]"
        assert gw.sent(f.urls[0]).in_flight == 0


async def test_every_worker_refusing_is_502() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with kvgate([{"url": dead, "models": ["fake-model"]}]) as gw:
        gw.gateway.registry.get(dead).healthy = True  # as if it died after its last probe
        r = await gw.client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502
        assert error_of(r)["code"] == "upstream_connect_error"


async def test_a_connect_timeout_is_not_taken_for_a_dead_worker() -> None:
    """A refused connection marks a worker down at once; a connect timeout (a starved box)
    only counts towards the failure threshold, so one slow accept does not empty the fleet."""
    with unresponsive_port() as port:
        slow = f"http://127.0.0.1:{port}"
        upstream = {"connect_timeout_s": 0.2}
        async with kvgate([{"url": slow, "models": ["fake-model"]}], upstream=upstream) as gw:
            worker = gw.gateway.registry.get(slow)
            worker.healthy = True
            r = await gw.client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 502
            assert error_of(r)["code"] == "upstream_connect_error"
            assert worker.healthy
            assert worker.consecutive_failures >= 1


async def test_unknown_route_is_openai_style_404() -> None:
    async with kvgate([]) as gw:
        r = await gw.client.get("/nowhere")
        assert r.status_code == 404 and error_of(r)["code"] == "not_found"
        r = await gw.client.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400 and error_of(r)["param"] == "model"


@pytest.mark.parametrize(
    ("exc", "cls", "status"),
    [
        (httpx.ConnectError("refused"), errors.UpstreamConnectError, 502),
        (httpx.ConnectTimeout("slow"), errors.UpstreamConnectError, 502),
        (httpx.ReadTimeout("slow"), errors.UpstreamTimeout, 504),
        (httpx.PoolTimeout("full"), errors.UpstreamTimeout, 504),
        (httpx.RemoteProtocolError("closed"), errors.UpstreamProtocolError, 502),
        (httpx.ReadError("reset"), errors.UpstreamProtocolError, 502),
        (httpx.UnsupportedProtocol("ftp"), errors.UpstreamError, 502),
    ],
)
def test_httpx_errors_map_to_the_most_specific_class(
    exc: httpx.HTTPError, cls: type[errors.UpstreamError], status: int
) -> None:
    mapped = errors.from_httpx(exc, worker="http://w")
    assert type(mapped) is cls
    assert mapped.status == status
    assert "http://w" in mapped.message
    assert mapped.sse_bytes().endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("exc", "cls", "status", "code", "param"),
    [
        (backend.WorkerExists("http://w"), errors.WorkerExists, 409, "worker_exists", "url"),
        (backend.WorkerNotFound("http://w"), errors.WorkerNotFound, 404, "worker_not_found", "id"),
        (backend.BackendError("odd"), errors.KvgateError, 500, "internal_error", None),
    ],
)
def test_backend_errors_map_to_client_errors(
    exc: backend.BackendError,
    cls: type[errors.KvgateError],
    status: int,
    code: str,
    param: str | None,
) -> None:
    assert not isinstance(exc, errors.KvgateError)  # the backends layer knows no HTTP
    with pytest.raises(errors.KvgateError) as caught, errors.backend_errors():
        raise exc
    mapped = caught.value
    assert type(mapped) is cls and mapped.__cause__ is exc
    assert (mapped.status, mapped.code, mapped.param) == (status, code, param)


async def test_registry_refusals_are_openai_errors() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        again = await gw.client.post("/admin/workers", json={"url": f.urls[0]})
        assert again.status_code == 409
        assert error_of(again) == {
            "message": f"worker {f.urls[0]!r} is already registered",
            "type": "invalid_request_error",
            "param": "url",
            "code": "worker_exists",
        }
        gone = await gw.client.delete("/admin/workers/http%3A%2F%2F127.0.0.1%3A1")
        assert gone.status_code == 404
        assert error_of(gone)["code"] == "worker_not_found" and error_of(gone)["param"] == "id"


async def test_client_leaving_mid_body_is_counted_499() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n"
        writer.write(head + b'{"model": "fake-')
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        labels = {"worker": "none", "model": "none", "status": "499"}
        await wait_until(lambda: gw.metric("kvgate_requests_total", labels) == 1, what="499")
