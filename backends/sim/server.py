"""The HTTP server of one replica: uvicorn on a socket bound here, started and stopped on
demand (faults take the port down and bring it back), whose requests can drop their own
connection (a simulated crash: no answer, no end of stream)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_STARTUP_TIMEOUT_S = 10.0
_ABORT = "kvgate.sim.abort"


class _Server(uvicorn.Server):
    """uvicorn without signal capture: many servers share one loop; the CLI owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _Protocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol, giving every request's scope its connection's ``abort``."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {_ABORT: {"abort": self.transport.abort}}


def drop_connection(scope: MutableMapping[str, Any]) -> None:
    """Reset the connection a request came on, as a killed engine process would."""
    scope["extensions"][_ABORT]["abort"]()


class HttpServer:
    """One ASGI app on ``host:port`` (port 0: an ephemeral port, kept across restarts)."""

    def __init__(self, app: Any, host: str, port: int, name: str) -> None:
        self._app = app
        self._host = host
        self.port = port
        self._name = name
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        return self._server is not None

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # proto=IPPROTO_TCP so that asyncio sets TCP_NODELAY on accepted connections
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        return sock

    async def start(self) -> None:
        if self._server is not None:
            return
        sock = self._bind()
        config = uvicorn.Config(
            self._app,
            lifespan="off",
            http=_Protocol,
            ws="none",
            log_config=None,
            log_level=None,
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        server = _Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not server.started:
            if task.done():
                sock.close()
                task.result()
                raise RuntimeError(f"{self._name}: HTTP server exited at start-up")
            if time.monotonic() > deadline:
                task.cancel()
                sock.close()
                raise TimeoutError(f"{self._name}: HTTP server did not start")
            await asyncio.sleep(0.005)
        self._server, self._task = server, task

    async def stop(self) -> None:
        """Stop listening (connections are refused); requests in flight may finish."""
        server, task = self._server, self._task
        self._server = self._task = None
        if server is None or task is None:
            return
        server.should_exit = True
        await task
