"""The lean upstream HTTP/1.1 client against a real uvicorn fake engine."""

from __future__ import annotations

import json

import httpx
import pytest
from fakes.engine import FakeEngine
from fakes.server import serve

from kvgate.backends.process import free_port
from kvgate.router.upstream import Origin, UpstreamPool

pytestmark = pytest.mark.anyio

JSON = [(b"content-type", b"application/json")]


def body(**extra: object) -> bytes:
    return json.dumps({"model": "fake-model", "prompt": "a b c", **extra}).encode()


async def test_keep_alive_reuse_and_large_bodies() -> None:
    pool = UpstreamPool(connect_timeout=2, read_timeout=5)
    async with serve(FakeEngine()) as server:
        origin = Origin.of(server.url)
        for _ in range(3):
            response = await pool.request(origin, "POST", "/v1/completions", JSON, body())
            assert response.status_code == 200
            assert json.loads(await response.aread())["object"] == "text_completion"
            await response.aclose()
        assert len(pool._idle[origin]) == 1  # one connection served all three
        big = body(padding="x" * 200_000)
        response = await pool.request(origin, "POST", "/v1/completions", JSON, big)
        assert response.status_code == 200 and await response.aread()
        await response.aclose()
        response = await pool.request(origin, "POST", "/v1/completions", JSON, body(stream=True))
        chunks = [c async for c in response.aiter_raw()]
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
        await response.aclose()
    await pool.aclose()


async def test_a_restarted_engine_gets_a_fresh_connection() -> None:
    pool = UpstreamPool(connect_timeout=2, read_timeout=5)
    async with serve(FakeEngine("first")) as first:
        origin = Origin.of(first.url)
        response = await pool.request(origin, "GET", "/health", [], b"")
        await response.aread()
        await response.aclose()
        assert len(pool._idle[origin]) == 1
    with pytest.raises(httpx.ConnectError):  # down: refused, not a hang
        await pool.request(origin, "GET", "/health", [], b"")
    second = FakeEngine("second")
    async with serve(second, port=first.port):
        response = await pool.request(origin, "GET", "/health", [], b"")
        assert response.status_code == 200
        await response.aread()
        await response.aclose()
        assert [s.path for s in second.seen] == ["/health"]
    await pool.aclose()


async def test_errors_use_httpx_classes() -> None:
    pool = UpstreamPool(connect_timeout=2, read_timeout=0.2)
    with pytest.raises(httpx.ConnectError):
        await pool.request(Origin.of(f"http://127.0.0.1:{free_port()}"), "GET", "/", [], b"")
    engine = FakeEngine()
    async with serve(engine) as server:
        held = body(fake={"hold": "before_headers"})
        with pytest.raises(httpx.ReadTimeout):
            await pool.request(Origin.of(server.url), "POST", "/v1/completions", JSON, held)
        broken = body(stream=True, fake={"tokens": 4, "break_stream": True})
        response = await pool.request(
            Origin.of(server.url), "POST", "/v1/completions", JSON, broken
        )
        with pytest.raises(httpx.RemoteProtocolError):
            await response.aread()
        await response.aclose()
    await pool.aclose()
