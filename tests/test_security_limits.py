"""Limits on what one client or one engine can hold: header and body read timeouts, a cap on
client connections, a whole-response upstream deadline and a cap on buffered upstream
bodies. Each is answered with its status and counted in ``kvgate_limits_exceeded_total``.

Timeouts here are short settings; the only waits are "no hang" guards far above them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate
from fakes.rawhttp import exchange, parse_response, request_bytes
from fakes.rawworker import raw_worker, write_until_closed
from fakes.wait import wait_until

from kvgate.backends import health
from kvgate.router.listener import MAX_HEAD_BYTES, MAX_HEADERS, MAX_URL_BYTES

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
CHAT_BYTES = json.dumps(CHAT).encode()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def limit_count(gw: object, limit: str) -> float:
    return gw.metric("kvgate_limits_exceeded_total", {"limit": limit})  # type: ignore[attr-defined]


async def stall(url: str, data: bytes, limit_s: float = 30.0) -> bytes:
    """Write ``data`` (an unfinished request, or nothing), then read until kvgate closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(url))
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(limit_s):  # a "no hang" guard only
            return await reader.read()
    finally:
        writer.close()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Did the server close the connection within ``seconds``?"""
    try:
        async with asyncio.timeout(seconds):
            return await reader.read(1) == b""
    except TimeoutError:
        return False


async def test_slow_request_head_is_408_and_closed() -> None:
    client = {"header_timeout_s": 0.2}
    async with fleet(FakeEngine()) as f, kvgate(f.urls, client=client) as gw:
        unfinished = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        response = parse_response(await stall(gw.url, unfinished))
        assert response.status == 408
        assert response.openai_error()["code"] == "request_timeout"
        assert limit_count(gw, "header_timeout") == 1


@pytest.mark.parametrize("sent", [b"", b"\r\n", b"\r\n\r\n\r\n"])
async def test_idle_connection_is_closed_without_an_answer(sent: bytes) -> None:
    """Nothing, or blank lines (which begin no request): closed at the header timeout."""
    async with kvgate([], client={"header_timeout_s": 0.2}) as gw:
        assert await stall(gw.url, sent) == b""


async def test_blank_lines_after_an_answer_do_not_hold_the_connection() -> None:
    """A keep-alive connection fed blank lines (each resets uvicorn's idle timer, none
    begins a request) is still closed at the header timeout."""
    async with kvgate([], client={"header_timeout_s": 0.3}) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gw.url))
        try:
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            async with asyncio.timeout(30):  # a "no hang" guard only
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
                assert await reader.readexactly(15) == b'{"status":"ok"}'
                while not await closed_within(reader, 0.05):
                    writer.write(b"\r\n")
        finally:
            writer.close()


async def test_slow_request_body_is_408() -> None:
    client = {"body_timeout_s": 0.3}
    async with fleet(FakeEngine()) as f, kvgate(f.urls, client=client) as gw:
        head = request_bytes("POST", "/v1/chat/completions", body=b"", content_length=False)
        unfinished = head[:-2] + b"content-length: 1000\r\n\r\n" + CHAT_BYTES[:10]
        response = parse_response(await stall(gw.url, unfinished))
        assert response.status == 408
        assert response.openai_error()["code"] == "request_timeout"
        assert limit_count(gw, "body_timeout") == 1
        labels = {"worker": "none", "model": "none", "status": "408"}
        assert gw.metric("kvgate_requests_total", labels) == 1


async def test_unread_body_dribbling_after_the_answer_is_cut() -> None:
    """A route that does not read the body answers; the rest of the body, dribbled (each
    byte resets uvicorn's idle timer), cannot hold the connection past the body timeout."""
    async with kvgate([], client={"body_timeout_s": 2.0}) as gw:  # /health answers first
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gw.url))
        try:
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n")
            async with asyncio.timeout(30):  # a "no hang" guard only
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
                assert await reader.readexactly(15) == b'{"status":"ok"}'
                while not await closed_within(reader, 0.05):
                    writer.write(b"x")
        finally:
            writer.close()
        assert limit_count(gw, "body_timeout") == 1


async def test_connection_cap_answers_503_and_frees_up() -> None:
    client = {"max_connections": 2, "header_timeout_s": 60}
    async with fleet(FakeEngine()) as f, kvgate(f.urls, client=client) as gw:
        port = port_of(gw.url)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await wait_until(lambda: gw.gateway.listener.connections == 2, what="2 connections")
        refused = await exchange(
            port, request_bytes("POST", "/v1/chat/completions", body=CHAT_BYTES)
        )
        assert refused.status == 503
        assert refused.openai_error()["code"] == "too_many_connections"
        assert refused.headers["retry-after"]
        assert refused.headers["connection"] == "close"
        assert limit_count(gw, "connections") == 1
        for _, writer in held:
            writer.close()
        await wait_until(lambda: gw.gateway.listener.connections == 0, what="connections closed")
        ok = await exchange(port, request_bytes("POST", "/v1/chat/completions", body=CHAT_BYTES))
        assert ok.status == 200


# -- request heads ---------------------------------------------------------------------------
def head_refusal(response: Any, status: int) -> str:
    """The refusal's code, checked to be ``status`` with an OpenAI body, closing."""
    assert response.status == status, response
    assert response.headers["connection"] == "close"
    return str(response.openai_error()["code"])


@pytest.mark.parametrize(
    "head",
    [
        [("x-big", "a" * (MAX_HEAD_BYTES + 1))],  # one header line past the head's bytes
        [(f"x-h{i}", "v" * 900) for i in range(100)],  # lines under the count, bytes past
        [(f"x-h{i}", "v") for i in range(MAX_HEADERS + 1)],  # one line too many
    ],
    ids=["one-line", "many-long-lines", "count"],
)
async def test_a_request_head_past_its_bounds_is_431_and_closed(head: list[Any]) -> None:
    """A whole head past its bytes or header lines: 431 (before: served, kept whole)."""
    async with kvgate([]) as gw:
        response = await exchange(port_of(gw.url), request_bytes("GET", "/health", headers=head))
        assert head_refusal(response, 431) == "request_header_fields_too_large"
        assert limit_count(gw, "request_head") == 1


async def test_an_endless_request_head_is_cut_at_its_bound() -> None:
    """A head that never ends is refused once its bytes pass the bound, not kept until the
    header timeout (before: all of it kept, then a 408 at the timeout)."""
    async with kvgate([], client={"header_timeout_s": 600}) as gw:
        endless = b"GET /health HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * (16 * 1024 * 1024)
        response = await exchange(port_of(gw.url), endless)
        assert head_refusal(response, 431) == "request_header_fields_too_large"
        assert limit_count(gw, "request_head") == 1


@pytest.mark.parametrize("endless", [False, True])
async def test_a_long_request_target_is_414(endless: bool) -> None:
    async with kvgate([], client={"header_timeout_s": 600}) as gw:
        target = b"/health?x=" + b"a" * (MAX_URL_BYTES if not endless else 16 * 1024 * 1024)
        data = b"GET " + target if endless else request_bytes("GET", target)
        response = await exchange(port_of(gw.url), data)
        assert head_refusal(response, 414) == "uri_too_long"
        assert limit_count(gw, "request_url") == 1


async def test_heads_within_the_bounds_are_served_pipelined_and_kept_alive() -> None:
    """Heads close to every bound pass, one after the other on a keep-alive connection and
    pipelined in one write: the budget is per head."""
    lines = [(f"x-h{i}", "v" * 500) for i in range(MAX_HEADERS - 2)]  # ~50 KiB, 98 lines
    target = "/health?x=" + "a" * (MAX_URL_BYTES - 20)
    one = request_bytes("GET", target, headers=lines, content_length=False)
    async with kvgate([]) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gw.url))
        try:
            async with asyncio.timeout(30):  # a "no hang" guard only
                for data in (one, one, one + one + one):
                    writer.write(data)
                    for _ in range(data.count(b"GET ")):
                        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
                        assert await reader.readexactly(15) == b'{"status":"ok"}'
        finally:
            writer.close()
        assert limit_count(gw, "request_head") == limit_count(gw, "request_url") == 0


# -- engines' response heads --------------------------------------------------------------
_HOSTILE_LIMIT = 32 * 1024 * 1024  # bytes a hostile worker writes at most (the test's bound)


async def endless_lines(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    await write_until_closed(writer, b"x-h: " + b"v" * 90 + b"\r\n", _HOSTILE_LIMIT)


async def endless_value(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-h: ")
    await write_until_closed(writer, b"v" * 65536, _HOSTILE_LIMIT)


async def endless_trailer(writer: asyncio.StreamWriter) -> None:
    body = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked"
        b"\r\n\r\n" + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\nx-t: "
    )
    await write_until_closed(writer, b"v" * 65536, _HOSTILE_LIMIT)


@pytest.mark.parametrize(
    ("answer", "stream"),
    [
        (endless_lines, False),
        (endless_lines, True),
        (endless_value, True),
        (endless_trailer, False),
    ],
    ids=["lines", "lines-stream", "value-stream", "trailer"],
)
async def test_an_engine_head_past_its_bounds_fails_the_attempt(answer: Any, stream: bool) -> None:
    """A worker's endless head or trailer fails that attempt once past its bound (before:
    kept whole until the worker stopped), retried on another worker, with its reason."""
    async with (
        raw_worker(answer) as hostile,
        fleet(FakeEngine()) as f,
        kvgate([hostile.url, *f.urls]) as gw,  # round robin: the hostile worker first
    ):
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status_code == 200
        assert r.headers["x-kvgate-worker"] == f.urls[0]
        assert hostile.posts == 1
        labels = {"worker": hostile.url, "reason": "head_too_large"}
        assert gw.metric("kvgate_upstream_retries_total", labels) == 1
        assert limit_count(gw, "upstream_head") == 1
        assert "response head is too large" in str(gw.gateway.registry.get(hostile.url).last_error)


async def test_an_engine_head_past_its_bounds_alone_is_a_502() -> None:
    async with raw_worker(endless_lines) as hostile, kvgate([hostile.url]) as gw:
        r = await gw.client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["code"] == "upstream_protocol_error"
        assert "response head is too large" in error["message"]


async def test_a_response_that_never_ends_is_cut_at_the_deadline() -> None:
    """Chunks keep coming (the per-chunk read timeout never fires); the whole-response
    deadline ends the stream with an error event and frees the worker."""
    upstream = {"response_timeout_s": 3.0, "read_timeout_s": 60}  # the first chunk is sent
    async with fleet(FakeEngine()) as f, kvgate(f.urls, upstream=upstream) as gw:  # at once
        body = {**CHAT, "stream": True, "fake": {"trickle": True}}
        r = await gw.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert "tok0" in events[0]
        assert json.loads(events[-2])["error"]["code"] == "upstream_timeout"
        assert events[-1] == "[DONE]"
        assert limit_count(gw, "response_deadline") == 1
        await wait_until(lambda: f.engines[0].cancels == 1, what="the engine sees the cut")
        assert gw.sent(f.urls[0]).in_flight == 0


async def test_a_non_streamed_response_past_the_deadline_is_504() -> None:
    upstream = {"response_timeout_s": 0.3, "read_timeout_s": 60}
    async with fleet(FakeEngine()) as f, kvgate(f.urls, upstream=upstream) as gw:
        body = {**CHAT, "fake": {"hold": "before_headers"}}
        r = await gw.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "upstream_timeout"
        assert limit_count(gw, "response_deadline") == 1
        assert gw.gateway.registry.get(f.urls[0]).healthy  # a slow answer is no sick engine


async def test_buffered_upstream_bodies_are_capped() -> None:
    upstream = {"max_response_bytes": 4096}
    async with fleet(FakeEngine()) as f, kvgate(f.urls, upstream=upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "fake": {"pad": 100_000}})
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_response_too_large"
        assert limit_count(gw, "upstream_response_bytes") == 1
        small = await gw.client.post("/v1/chat/completions", json={**CHAT, "fake": {"pad": 10}})
        assert small.status_code == 200
        stream = {**CHAT, "stream": True, "fake": {"tokens": 400}}  # relayed, not buffered
        assert (await gw.client.post("/v1/chat/completions", json=stream)).status_code == 200


async def test_request_body_limit_is_counted() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls, max_body_bytes=100) as gw:
        r = await gw.client.post("/v1/chat/completions", content=b"x" * 500)
        assert r.status_code == 413
        assert limit_count(gw, "request_bytes") == 1


async def test_limit_defaults_are_set_and_long() -> None:
    async with kvgate([]) as gw:
        settings = gw.gateway.settings
        assert 1 <= settings.client.header_timeout_s <= 120
        assert 10 <= settings.client.body_timeout_s <= 600
        assert settings.client.max_connections >= 1000
        assert settings.upstream.response_timeout_s >= 600
        assert settings.upstream.max_response_bytes >= 16 * 1024 * 1024
        text = (await gw.client.get("/metrics")).text
        for limit in (
            "header_timeout", "body_timeout", "connections", "response_deadline",
            "upstream_response_bytes", "request_bytes", "request_head", "request_url",
            "upstream_head",
        ):  # fmt: skip
            assert f'kvgate_limits_exceeded_total{{limit="{limit}"}} 0.0' in text


class HostileMetricsEngine(FakeEngine):
    """A fake engine whose /metrics page is huge, or trickles without end."""

    def __init__(self, *, trickle: bool = False, size: int = 0) -> None:
        super().__init__()
        self.trickle = trickle
        self.size = size

    async def _route(self, method: str, path: str, body: Any, receive: Any, send: Any) -> None:
        if path != "/metrics":
            await super()._route(method, path, body, receive, send)
            return
        head = [(b"content-type", b"text/plain")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        if not self.trickle:
            await send({"type": "http.response.body", "body": b"#" * self.size})
            return
        gone = asyncio.ensure_future(receive())  # the disconnect
        while not gone.done():
            await send({"type": "http.response.body", "body": b"# x\n", "more_body": True})
            await asyncio.wait({gone}, timeout=0.01)


@pytest.mark.parametrize("engine", [{"trickle": True}, {"size": 4096}], ids=["trickle", "huge"])
async def test_worker_answers_to_probes_are_bounded(
    engine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape gets its whole answer within the probe timeout and up to a size cap: a
    trickling or huge /metrics page fails that scrape, it does not stall the probe round."""
    monkeypatch.setattr(health, "_MAX_ANSWER_BYTES", 1024, raising=False)  # (before: none)
    health_settings = {"interval_s": 3600, "metrics_interval_s": 0, "timeout_s": 0.3}
    async with (
        fleet(HostileMetricsEngine(**engine)) as f,
        kvgate(f.urls, health=health_settings) as gw,
    ):
        async with asyncio.timeout(30):  # a "no hang" guard only
            await gw.gateway.health.scrape_all()
        labels = {"worker": f.urls[0]}
        assert gw.metric("kvgate_metrics_scrape_failures_total", labels) == 1
        assert gw.gateway.registry.get(f.urls[0]).healthy  # /health itself is fine
