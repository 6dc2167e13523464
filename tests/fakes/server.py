"""Run an ASGI app under a real uvicorn server on 127.0.0.1 (an ephemeral port) in this loop."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Literal

import uvicorn

STARTUP_TIMEOUT_S = 10.0


async def wait_for(
    predicate: Callable[[], bool], limit_s: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until it holds; fail after ``limit_s`` seconds."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def bound_socket(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def closed_port() -> int:
    """A loopback port nobody listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@contextmanager
def unresponsive_port() -> Iterator[int]:
    """A loopback port whose accept queue is full: new connections time out (a starved host)."""
    with bound_socket() as listener:
        listener.listen(0)
        port: int = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # fills the queue of one
            yield port


class RunningServer:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], port: int) -> None:
        self.server = server
        self.task = task
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if not self.task.done():
            self.server.should_exit = True
            await self.task


@asynccontextmanager
async def serve(
    app: Any,
    *,
    lifespan: Literal["on", "off"] = "off",
    port: int = 0,
    config: uvicorn.Config | None = None,
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` on 127.0.0.1:``port`` (0: a free one) until the block exits; with
    ``config`` (its host and port unused: the socket is bound here), under that config."""
    sock = bound_socket(port)
    if config is None:
        config = uvicorn.Config(
            app,
            lifespan=lifespan,
            log_level="warning",
            access_log=False,
            ws="none",
            http="httptools",
            timeout_graceful_shutdown=2,
        )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    running = RunningServer(server, task, sock.getsockname()[1])
    try:
        await wait_for(lambda: server.started or task.done(), STARTUP_TIMEOUT_S, "server start")
        if task.done():
            task.result()
            raise RuntimeError("server exited during startup")
        yield running
    finally:
        await running.stop()
        sock.close()
