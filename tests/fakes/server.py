"""Run an ASGI app under a real uvicorn server on loopback (an ephemeral port) in this loop."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Literal

import uvicorn

from fakes.wait import wait_until

STARTUP_TIMEOUT_S = 10.0


def bound_socket(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


@contextmanager
def unresponsive_port() -> Iterator[int]:
    """A loopback port whose accept queue is full: new connections time out (a starved host)."""
    with bound_socket() as listener:
        listener.listen(0)
        port: int = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # fills the queue of one
            yield port


class RunningServer:
    def __init__(
        self, server: uvicorn.Server, task: asyncio.Task[None], port: int, host: str = "127.0.0.1"
    ) -> None:
        self.server = server
        self.task = task
        self.port = port
        self.url = f"http://{host}:{port}"

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
    host: str = "127.0.0.1",
    config: uvicorn.Config | None = None,
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` on ``host``:``port`` (0: a free one; a loopback host) until the block
    exits; with ``config`` (its host and port unused: the socket is bound here), under it."""
    sock = bound_socket(port, host)
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
    running = RunningServer(server, task, sock.getsockname()[1], host)
    try:
        await wait_until(lambda: server.started or task.done(), STARTUP_TIMEOUT_S, "server start")
        if task.done():
            task.result()
            raise RuntimeError("server exited during startup")
        yield running
    finally:
        await running.stop()
        sock.close()
