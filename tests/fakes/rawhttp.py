"""Raw HTTP/1.1 exchanges for hostile-input tests: bytes out exactly as written, the answer
parsed with httptools (what a client library would refuse to send, a server still gets).

``exchange`` (async) and ``exchange_sync`` (blocking, for hypothesis tests) write ``data``,
then read one response. ``limit_s`` only guards against a hang (the test fails instead of
blocking forever); it is never what a test asserts on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass, field
from typing import Any

import httptools

DEFAULT_LIMIT_S = 30.0


@dataclass
class RawResponse:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names, last wins
    body: bytes = b""
    complete: bool = False  # a whole response was read (else the server closed first)

    def json(self) -> Any:
        return json.loads(self.body)

    def openai_error(self) -> dict[str, Any]:
        """The ``error`` member of an OpenAI-style error body (asserting its shape)."""
        assert self.headers.get("content-type", "").startswith("application/json"), self
        error = self.json()["error"]
        assert isinstance(error["message"], str) and error["message"], self
        assert isinstance(error["type"], str) and error["type"], self
        assert "code" in error, self
        return dict(error)


class _Reader:
    def __init__(self, head_only: bool) -> None:
        self.response = RawResponse()
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._head_only = head_only

    def on_message_begin(self) -> None:
        self.response.headers.clear()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.response.status = self._parser.get_status_code()
        if self._head_only:  # a HEAD answer has no body whatever its headers say
            self.response.complete = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self.response.status < 200:  # an interim answer (100 Continue): read the next
            self.response = RawResponse()
            self._body.clear()
            return
        self.response.complete = True

    def feed(self, data: bytes) -> bool:
        """Feed bytes; True once a whole response was read."""
        headers = self.response.headers
        if not data:  # EOF: a body delimited by the connection's end is complete here
            delimited = "content-length" in headers or "transfer-encoding" in headers
            if self.response.status and not delimited:
                self.response.complete = True
        else:
            self._parser.feed_data(data)
        self.response.body = b"".join(self._body)
        return self.response.complete


def parse_response(data: bytes) -> RawResponse:
    """One response from bytes read up to the server's close."""
    reader = _Reader(head_only=False)
    reader.feed(data)
    reader.feed(b"")
    return reader.response


def _is_head(data: bytes) -> bool:
    return data.startswith(b"HEAD ")


async def exchange(
    port: int, data: bytes, *, limit_s: float = DEFAULT_LIMIT_S, host: str = "127.0.0.1"
) -> RawResponse:
    """Write ``data`` to a new connection, read one response (or up to the server's close)."""
    reader_, writer = await asyncio.open_connection(host, port)
    reader = _Reader(_is_head(data))
    try:
        async with asyncio.timeout(limit_s):
            # the server may answer (and close) before reading everything: read the answer
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                writer.write(data)
                await writer.drain()
            while True:
                try:
                    chunk = await reader_.read(65536)
                except ConnectionResetError:
                    chunk = b""
                if reader.feed(chunk) or not chunk:
                    break
    finally:
        writer.close()
        await asyncio.gather(writer.wait_closed(), return_exceptions=True)
    return reader.response


def exchange_sync(
    port: int, data: bytes, *, limit_s: float = DEFAULT_LIMIT_S, host: str = "127.0.0.1"
) -> RawResponse:
    """``exchange`` for blocking callers (a reset by the server ends the read)."""
    reader = _Reader(_is_head(data))
    with socket.create_connection((host, port), timeout=limit_s) as sock:
        # the server may answer (and close) before reading everything: read the answer
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if reader.feed(chunk) or not chunk:
                break
    return reader.response


def request_bytes(
    method: str,
    target: str | bytes,
    *,
    headers: list[tuple[str | bytes, str | bytes]] | None = None,
    body: bytes = b"",
    content_length: bool = True,
) -> bytes:
    """A request as bytes: ``host`` first, then ``headers``, then ``content-length``."""

    def raw(value: str | bytes) -> bytes:
        return value if isinstance(value, bytes) else value.encode("latin-1")

    lines = [raw(method) + b" " + raw(target) + b" HTTP/1.1", b"host: 127.0.0.1"]
    lines += [raw(k) + b": " + raw(v) for k, v in headers or []]
    if content_length:
        lines.append(b"content-length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
