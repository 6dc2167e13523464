"""A lean keep-alive HTTP/1.1 client for the proxied request path.

The gateway's hot path needs little from HTTP: write one request, read a status line and
headers, then relay the body as it arrives. A general client (httpx) spends far more CPU per
request than the rest of kvgate together, so requests to engines go through this one:
asyncio protocols, httptools' C parser, one ``transport.write`` per request, a bounded
idle-connection pool per engine, and flow control on relayed bodies. Health checks,
discovery and tokenizing still use httpx.

Failures raise httpx's own exception classes (``ConnectError``, ``ConnectTimeout``,
``ReadTimeout``, ``RemoteProtocolError``, ``ReadError``), so ``router.errors.from_httpx``
maps both clients alike.

What an engine sends is bounded like a client's request head: a response head (status line
and headers) may hold ``MAX_HEAD_BYTES`` and ``MAX_HEADERS`` header lines, trailers count
with them, and the parser never holds more than ``MAX_HEAD_BYTES`` it has not handed over (a
trailer line that never ends); past a bound the exchange fails with ``ResponseHeadTooLarge``
and the connection is closed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools
import httpx

_HIGH_WATER = 256 * 1024  # buffered body bytes before the engine socket is paused
_LOW_WATER = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
"""Bytes of an engine's response head (and of a trailer) the parser may hold."""
MAX_HEADERS = 100
"""Header lines of an engine's response, trailers included."""


class BodyTooLarge(Exception):
    """``UpstreamResponse.aread`` read more than its limit (the connection is not reused)."""


class ResponseHeadTooLarge(httpx.RemoteProtocolError):
    """An engine's response head (or trailer) past ``MAX_HEAD_BYTES`` or ``MAX_HEADERS``."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a worker listens."""

    scheme: str
    host: str
    port: int
    base_path: str  # path prefix of the worker URL ('' for most)

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        default = 443 if parts.scheme == "https" else 80
        return cls(
            parts.scheme, parts.hostname or "", parts.port or default, parts.path.rstrip("/")
        )

    @property
    def host_header(self) -> bytes:
        return f"{self.host}:{self.port}".encode()


class Headers:
    """Response headers as received (raw byte pairs) with a case-insensitive ``get``."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode()
        for k, v in self.raw:
            if k.lower() == key:
                return v.decode("latin-1")
        return default


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; carries one exchange at a time."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._parser = httptools.HttpResponseParser(self)
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        loop = asyncio.get_running_loop()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_seen = 0
        self.headers_done: asyncio.Future[None] = loop.create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.readable = asyncio.Event()
        self.paused = False
        self.received_any = False
        self._held = 0  # bytes fed that the parser has not handed over (a head, a trailer)

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        view = memoryview(data)
        while view and not self.closed:  # at most what the parser may still hold, each time
            budget = MAX_HEAD_BYTES - self._held
            piece, view = view[:budget], view[budget:]
            self._held += len(piece)
            try:
                self._parser.feed_data(piece)
            except httptools.HttpParserError as exc:  # a callback's error is its context
                bound = exc.__context__
                self._fail(
                    bound
                    if isinstance(bound, ResponseHeadTooLarge)
                    else httpx.RemoteProtocolError(f"malformed HTTP response: {exc}")
                )
                self.close()
            else:
                if self._held >= MAX_HEAD_BYTES and not self.complete:
                    what = "response head" if not self.headers_done.done() else "trailer"
                    self._fail(ResponseHeadTooLarge(f"the {what} exceeds {MAX_HEAD_BYTES} bytes"))
                    self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if not self.headers_done.done():
            error: Exception = httpx.RemoteProtocolError(
                "Server disconnected without sending a response."
            )
        else:
            error = httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body"
            )
        if exc is not None and not self.received_any:
            error = httpx.ReadError(str(exc) or type(exc).__name__)
        self._fail(error)

    # -- httptools callbacks ------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers_seen += 1
        if self.headers_seen > MAX_HEADERS:
            raise ResponseHeadTooLarge(f"the response has more than {MAX_HEADERS} header lines")
        if not self.headers_done.done():  # (trailers are counted, not kept)
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._held = 0
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._held = 0
        self.chunks.append(body)
        self.buffered += len(body)
        self.readable.set()
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self._held = 0
        self.complete = True
        self.readable.set()

    # -- exchange -----------------------------------------------------------------------
    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        if not self.headers_done.done():
            self.headers_done.set_exception(error)
            self.headers_done.exception()  # retrieved: no "never retrieved" warning
        self.readable.set()

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def take(self) -> bytes:
        """Everything buffered so far (resuming the socket when drained)."""
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        self.readable.clear()
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    @property
    def reusable(self) -> bool:
        return self.complete and not self.closed and self.keep_alive

    def recycle(self) -> None:
        self.reused = True
        self._reset_exchange()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """A response being received; read it with ``aread`` or ``aiter_raw``, then ``aclose``."""

    def __init__(self, pool: UpstreamPool, conn: _Connection, read_timeout: float) -> None:
        self._pool = pool
        self._conn = conn
        self._read_timeout = read_timeout
        self._released = False
        self.status_code = conn.status
        self.headers = Headers(conn.headers)

    async def next_chunk(self) -> bytes | None:
        """The body bytes received since the last call (waiting for some), None at its end."""
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.take()
            if conn.error is not None:
                raise conn.error
            if conn.complete:
                return None
            try:
                async with asyncio.timeout(self._read_timeout):
                    await conn.readable.wait()
            except TimeoutError as exc:
                raise httpx.ReadTimeout("timed out waiting for the response body") from exc

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body chunk by chunk as it arrives (chunked transfer already decoded)."""
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def aread(self, limit: int | None = None) -> bytes:
        """The whole body; ``BodyTooLarge`` as soon as it exceeds ``limit`` bytes."""
        parts = []
        size = 0
        while (chunk := await self.next_chunk()) is not None:
            size += len(chunk)
            if limit is not None and size > limit:
                raise BodyTooLarge(f"the response body exceeds {limit} bytes")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        """Release the connection: back to the pool when the exchange completed, else closed
        at once (so the engine sees the request go)."""
        if self._released:
            return
        self._released = True
        self._pool.release(self._conn)


class UpstreamPool:
    """Keep-alive connections per engine origin."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_idle_per_origin: int = 64,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle_per_origin = max_idle_per_origin
        self._ssl = ssl_context
        self._idle: dict[Origin, list[_Connection]] = {}
        self._closed = False

    async def request(
        self,
        origin: Origin,
        method: str,
        path: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        *,
        sent: Callable[[bool], None] | None = None,
    ) -> UpstreamResponse:
        """Send one request and wait for the response head; ``sent(reused)`` is called once
        the request is written (on a pooled connection when ``reused``).

        A reused keep-alive connection that turns out closed before any response byte is
        replaced by a fresh one once (the engine never saw the request).
        """
        head = _request_head(origin, method, path, headers, len(body))
        conn = await self._acquire(origin)
        try:
            return await self._exchange(conn, head, body, sent)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            if not conn.reused or conn.received_any:
                raise
        conn = await self._connect(origin)
        return await self._exchange(conn, head, body, sent)

    async def _exchange(
        self, conn: _Connection, head: bytes, body: bytes, sent: Callable[[bool], None] | None
    ) -> UpstreamResponse:
        try:
            conn.send(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.send(body)
            if sent is not None:
                sent(conn.reused)
            try:
                async with asyncio.timeout(self.read_timeout):
                    await conn.headers_done
            except TimeoutError as exc:
                raise httpx.ReadTimeout("timed out waiting for the response") from exc
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(self, conn, self.read_timeout)

    async def _acquire(self, origin: Origin) -> _Connection:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                conn.recycle()
                return conn
        return await self._connect(origin)

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context = self._ssl_context() if origin.scheme == "https" else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(origin), origin.host, origin.port, ssl=context
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connect to {origin.host}:{origin.port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{origin.host}:{origin.port}: {exc.strerror or exc}") from exc
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def release(self, conn: _Connection) -> None:
        if not conn.reusable or self._closed:
            conn.close()
            return
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= self.max_idle_per_origin:
            conn.close()
        else:
            idle.append(conn)

    def close_origin(self, origin: Origin) -> None:
        for conn in self._idle.pop(origin, []):
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        for origin in list(self._idle):
            self.close_origin(origin)


_SKIP = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding"})


def _request_head(
    origin: Origin, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], length: int
) -> bytes:
    lines = [
        f"{method} {origin.base_path}{path} HTTP/1.1".encode(),
        b"host: " + origin.host_header,
    ]
    lines += [k + b": " + v for k, v in headers if k.lower() not in _SKIP]
    if length or method in {"POST", "PUT", "PATCH"}:
        lines.append(b"content-length: " + str(length).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"
