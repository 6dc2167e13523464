"""A worker over raw HTTP/1.1 (asyncio streams on 127.0.0.1) whose answers to generation
requests the test writes byte by byte: what a well-behaved server framework would never send
(endless or countless header lines, endless trailers) still reaches kvgate.

It answers ``GET /health`` and ``GET /v1/models`` as an engine does (anything else: 404);
every ``POST /v1/...`` gets ``answer(writer)``, which writes whatever it likes (bounded by the
test), and is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]
MAX_REQUEST_HEAD = 64 * 1024


@dataclass
class RawWorker:
    answer: Answer
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    posts: int = 0
    url: str = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after the other, until the peer closes
                head = await reader.readuntil(b"\r\n\r\n")
                if len(head) > MAX_REQUEST_HEAD:
                    return
                request_line, *lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                length = 0
                for line in lines:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                if method == "POST" and path.startswith("/v1/") and not path.endswith("/render"):
                    self.posts += 1
                    await self.answer(writer)
                    return  # what an answer leaves of the connection is not reusable
                await self._engine_answer(path, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            return
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _engine_answer(self, path: str, writer: asyncio.StreamWriter) -> None:
        if path == "/v1/models":
            cards = [{"id": m, "object": "model", "owned_by": "raw"} for m in self.models]
            body = json.dumps({"object": "list", "data": cards}).encode()
            status = b"200 OK"
        elif path == "/health":
            body, status = b"{}", b"200 OK"
        else:
            body, status = b'{"error": {"message": "no route"}}', b"404 Not Found"
        writer.write(
            b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()


@asynccontextmanager
async def raw_worker(answer: Answer, **kwargs: object) -> AsyncIterator[RawWorker]:
    worker = RawWorker(answer, **kwargs)  # type: ignore[arg-type]
    server = await asyncio.start_server(worker._serve, "127.0.0.1", 0, limit=2 * MAX_REQUEST_HEAD)
    port = server.sockets[0].getsockname()[1]
    worker.url = f"http://127.0.0.1:{port}"
    async with server:
        yield worker
        server.close()


async def write_until_closed(writer: asyncio.StreamWriter, data: bytes, limit: int) -> int:
    """Write ``data`` again and again until the peer closes or ``limit`` bytes went out;
    the bytes written."""
    written = 0
    with contextlib.suppress(ConnectionError):
        while written < limit and not writer.is_closing():
            writer.write(data)
            await writer.drain()
            written += len(data)
    return written
