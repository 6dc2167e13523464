"""Graceful shutdown of a real ``kvgate serve`` process (what Kubernetes and docker stop do).

SIGTERM must stop new connections, let an in-flight stream finish, then exit 0; a stream
that outlives the grace period (``--shutdown-timeout-s``) is cut and the process exits.
The engine is a small streaming ASGI app in this process whose chunks the test releases.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from fakes.process import kvgate_process
from fakes.server import serve
from fakes.wait import wait_until
from starlette.types import Receive, Scope, Send

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODEL = "gated-model"


class GatedEngine:
    """A streaming engine whose requests hold after their first chunk until ``release``.

    A request whose body has ``"hold": false`` streams straight through.
    """

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.streaming = asyncio.Event()
        self.served = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        match scope["path"]:
            case "/health":
                await self._json(send, {"ok": True})
            case "/v1/models":
                await self._json(send, {"object": "list", "data": [{"id": MODEL}]})
            case "/v1/completions":
                self.served += 1
                await self._stream(send, hold=msgspec.json.decode(raw).get("hold", True))
            case _:
                await self._json(send, {"error": {"message": "no route"}}, 404)

    async def _stream(self, send: Send, *, hold: bool) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._event(send, 0)
        if hold:
            self.streaming.set()
            await self.release.wait()
        for i in range(1, 4):
            await self._event(send, i)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    @staticmethod
    async def _event(send: Send, i: int) -> None:
        chunk = {"id": "c", "object": "text_completion", "model": MODEL,
                 "choices": [{"index": 0, "text": f"w{i} ", "finish_reason": None}]}  # fmt: skip
        data = b"data: " + msgspec.json.encode(chunk) + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})

    @staticmethod
    async def _json(send: Send, body: Any, status: int = 200) -> None:
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": msgspec.json.encode(body)})


def refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) != 0


def exited_cleanly(process: asyncio.subprocess.Process) -> bool:
    """Exit 0, or uvicorn's re-raised SIGTERM after its graceful shutdown completed."""
    return process.returncode in (0, -signal.SIGTERM)


async def read_stream(response: httpx.Response, first: asyncio.Event) -> list[str]:
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            lines.append(line.removeprefix("data: "))
            first.set()
    return lines


async def test_sigterm_lets_an_in_flight_stream_finish(tmp_path: Path) -> None:
    engine = GatedEngine()
    log = tmp_path / "kvgate.log"
    async with (
        serve(engine) as upstream,
        kvgate_process(f"{upstream.url},models={MODEL}", log, "--shutdown-timeout-s", "30") as (
            port,
            process,
        ),
        httpx.AsyncClient(timeout=30.0) as client,
    ):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
        first = asyncio.Event()
        async with client.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json=body
        ) as response:
            assert response.status_code == 200
            reader = asyncio.create_task(read_stream(response, first))
            await asyncio.wait_for(first.wait(), 10)

            process.send_signal(signal.SIGTERM)
            await wait_until(lambda: refuses_connections(port), 10, "the listener to close")
            assert process.returncode is None, log.read_text()  # still draining the stream

            engine.release.set()
            lines = await asyncio.wait_for(reader, 10)
        assert lines[-1] == "[DONE]"
        assert len(lines) == 5  # 4 chunks + [DONE]: nothing was cut
        await asyncio.wait_for(process.wait(), 15)
        assert exited_cleanly(process), log.read_text()


async def test_sigterm_cuts_streams_that_outlive_the_grace_period(tmp_path: Path) -> None:
    engine = GatedEngine()  # never released
    log = tmp_path / "kvgate.log"
    async with (
        serve(engine) as upstream,
        kvgate_process(f"{upstream.url},models={MODEL}", log, "--shutdown-timeout-s", "1") as (
            port,
            process,
        ),
        httpx.AsyncClient(timeout=30.0) as client,
    ):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
        first = asyncio.Event()
        async with client.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json=body
        ) as response:
            reader = asyncio.create_task(read_stream(response, first))
            await asyncio.wait_for(first.wait(), 10)
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 20)  # gives up on the stream and exits
            try:
                lines = await asyncio.wait_for(reader, 10)
            except httpx.HTTPError:
                lines = []  # the connection was cut mid-stream: also acceptable
        assert "[DONE]" not in lines
        assert exited_cleanly(process), log.read_text()
        assert "graceful shutdown exceeded" in log.read_text()
        engine.release.set()
