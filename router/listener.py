"""The client-facing listener: uvicorn's httptools protocol with kvgate's connection limits.

* Read timeouts. A new connection must send a request head within
  ``client.header_timeout_s``; a head begun must be completed within it; a request body
  must arrive within ``client.body_timeout_s`` of the moment it was found incomplete.
  When a head or a body times out before its answer started, the client gets 408 and the
  connection is closed (the handler waiting for the body sees the client gone, and reports
  408 in the metrics: ``timed_out_body``); an idle new connection, or the unread rest of a
  body whose answer is sent, is just closed. Idle keep-alive connections are uvicorn's
  (``timeout_keep_alive``).
* Connection cap: a request on a connection opened beyond ``client.max_connections`` gets
  503 + Retry-After and the connection is closed.
* Head bounds. A request head (request line and header lines) may hold ``MAX_HEAD_BYTES``
  and ``MAX_HEADERS`` header lines (431 past either), its request target ``MAX_URL_BYTES``
  (414); the connection is then closed. The parser is fed at most the head's remaining
  budget at a time, so a head past its bound is refused before more of it is kept, and the
  target's pieces are joined once (not appended one to the other).
* A request the HTTP parser refuses gets an OpenAI-style 400 instead of plain text.

Timers are armed only while a connection holds an incomplete request after reading what
arrived, so a request that arrives whole costs none. Each limit is counted in
``kvgate_limits_exceeded_total``.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any, Literal

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kvgate.router.config import ClientConfig
from kvgate.router.errors import (
    InvalidRequest,
    KvgateError,
    RequestHeadTooLarge,
    RequestTimeout,
    TooManyConnections,
)
from kvgate.router.metrics import GatewayMetrics

Phase = Literal["header", "body"]
_BODY_TIMED_OUT = "kvgate.body_timed_out"  # scope key set when the listener cut a body

MAX_HEAD_BYTES = 64 * 1024
"""Bytes of one request head (request line, header lines, blank lines before it): 431 past
it. Room for large bearer tokens, cookies and trace context; nginx allows 32 KiB."""
MAX_HEADERS = 100
"""Header lines of one request head: 431 past it (Apache's default)."""
MAX_URL_BYTES = 8 * 1024
"""Bytes of one request target (path and query): 414 past it (nginx's and Apache's)."""
_HEAD_CODE = "request_header_fields_too_large"
_LINGER_S = 2.0  # after an error answer, how long the rest of what a client sends is dropped


def timed_out_body(scope: MutableMapping[str, Any]) -> bool:
    """Did the listener close this request's connection because its body was too slow?"""
    return bool(scope.get(_BODY_TIMED_OUT))


def raw_error_response(error: KvgateError) -> bytes:
    """``error`` as a complete HTTP/1.1 response that closes the connection."""
    body = error.body_bytes()
    headers = {
        **error.headers,
        "content-type": "application/json",
        "content-length": str(len(body)),
        "connection": "close",
    }
    head = b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items())
    return STATUS_LINE[error.status] + head + b"\r\n" + body


class ListenerLimits:
    """The limits every client connection of one gateway shares, and its open count."""

    def __init__(
        self, config: ClientConfig, metrics: GatewayMetrics, *, retry_after_s: int
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.connections = 0

    def protocol(self) -> type[asyncio.Protocol]:
        """The uvicorn ``http`` protocol class bound to these limits."""
        limits = self

        class BoundProtocol(GuardedProtocol):
            _limits = limits

        return BoundProtocol

    async def refuse(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app of a connection over the cap: 503 to each request, then close."""
        self.metrics.limit_exceeded("connections")
        error = TooManyConnections(self.config.max_connections, retry_after_s=self.retry_after_s)
        body = error.body_bytes()
        headers = [(k.encode(), v.encode()) for k, v in error.headers.items()]
        headers += [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head past its bounds."""


class GuardedProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` plus read timeouts, head bounds, the connection cap and JSON
    400s."""

    _limits: ListenerLimits  # set by ``ListenerLimits.protocol``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_phase: Phase | None = None
        self._head_started = False
        self._counted = False
        self._head_bytes = 0  # of the head being read (fed while reading a head)
        self._headers = 0
        self._url: list[bytes] = []
        self._url_bytes = 0
        self._refusal: RequestHeadTooLarge | None = None  # why a callback stopped the parser
        self._refused = False  # an error was answered: the connection is closing (the
        # transport closes itself when the client closes its side: eof_received)
        self._linger: asyncio.TimerHandle | None = None

    # -- connection -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self._limits
        limits.connections += 1
        self._counted = True
        if limits.connections > limits.config.max_connections:
            self.app = limits.refuse  # this connection's requests get 503
        self._arm("header")  # a new connection owes a request head

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self._counted = False
            self._limits.connections -= 1
        self._cancel()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered and closing: what the client still sends is dropped
        view = memoryview(data)
        while view:
            if not self._reading_head():
                piece, view = view, view[len(view) :]
            else:  # at most what is left of the head's budget, then look again
                budget = MAX_HEAD_BYTES - self._head_bytes
                piece, view = view[:budget], view[budget:]
                self._head_bytes += len(piece)
            super().data_received(piece)  # type: ignore[arg-type]  # the parser takes buffers
            if self._refused or self.transport.is_closing():
                return
            if self._reading_head() and self._head_bytes >= MAX_HEAD_BYTES:
                message = f"the request head exceeds {MAX_HEAD_BYTES} bytes"
                self._refuse_head("request_head", message, 431, _HEAD_CODE)
                return
        self._watch(self._incomplete())

    def _reading_head(self) -> bool:
        """Are the next bytes (part of) a request head? (Not a body being read.)"""
        cycle = self.cycle
        return self._head_started or cycle is None or not cycle.more_body

    # -- parser callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True
        self._headers = 0
        self._url = []
        self._url_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > MAX_URL_BYTES:
            message = f"the request target exceeds {MAX_URL_BYTES} bytes"
            self._stop("request_url", message, 414, "uri_too_long")
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        if self._headers > MAX_HEADERS:
            message = f"the request head has more than {MAX_HEADERS} header lines"
            self._stop("request_head", message, 431, _HEAD_CODE)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_started = False
        self._head_bytes = 0
        self.url = b"".join(self._url)
        self._url = []
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        error: KvgateError = InvalidRequest(f"malformed HTTP request: {msg}", code="invalid_http")
        if self._refusal is not None:  # a callback stopped the parser: a bound was passed
            error = self._refusal
        self._answer_and_close(error)

    # -- head bounds ----------------------------------------------------------------------
    def _stop(self, limit: str, message: str, status: int, code: str) -> None:
        """Refuse the head from a parser callback (``send_400_response`` answers)."""
        self._limits.metrics.limit_exceeded(limit)
        self._refusal = RequestHeadTooLarge(message, status=status, code=code)
        raise _HeadRefused(message)

    def _refuse_head(self, limit: str, message: str, status: int, code: str) -> None:
        self._limits.metrics.limit_exceeded(limit)
        self._answer_and_close(RequestHeadTooLarge(message, status=status, code=code))

    def _answer_and_close(self, error: KvgateError) -> None:
        """Answer ``error`` and close. The write side closes at once; what the client still
        sends is read and dropped until it closes its side, for ``_LINGER_S`` at most (a
        close with unread bytes would reset the connection, and the client could lose the
        answer). A head refused behind an answer in progress (pipelined) gets none: the
        connection closes once that answer is out."""
        self._refused = True
        self._cancel()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
            return
        self.transport.write(raw_error_response(error))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._linger = self.loop.call_later(_LINGER_S, self.transport.close)

    # -- read timeouts --------------------------------------------------------------------
    def _incomplete(self) -> Phase | None:
        """What this connection still waits for after the bytes read so far (None: a
        request is being answered)."""
        cycle = self.cycle
        if self._head_started or cycle is None:
            return "header"  # a head begun, or none yet (blank lines do not count)
        if cycle.more_body and not cycle.disconnected:
            return "body"
        return "header" if cycle.response_complete else None

    def _watch(self, phase: Phase | None) -> None:
        if phase is None:
            self._cancel()
        elif phase != self._timer_phase:
            self._arm(phase)

    def _arm(self, phase: Phase) -> None:
        self._cancel()
        config = self._limits.config
        timeout = config.header_timeout_s if phase == "header" else config.body_timeout_s
        self._timer = self.loop.call_later(timeout, self._timed_out)
        self._timer_phase = phase

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_phase = None

    def _timed_out(self) -> None:
        phase, self._timer, self._timer_phase = self._timer_phase, None, None
        if self.transport.is_closing() or phase is None:
            return
        cycle = self.cycle
        if phase == "header":
            serving = cycle is not None and not cycle.response_complete
            if serving:  # a pipelined head behind an answer in progress: wait for it
                self._arm("header")
                return
            if self._head_started:
                self._refuse("header_timeout", "request head", self._limits.config.header_timeout_s)
        elif cycle is not None and not cycle.response_started:
            cycle.scope[_BODY_TIMED_OUT] = True  # type: ignore[literal-required]
            self._refuse("body_timeout", "request body", self._limits.config.body_timeout_s)
            cycle.disconnected = True  # the handler reading the body sees the client gone
            cycle.message_event.set()
        else:  # the unread rest of a body whose answer is out
            self._limits.metrics.limit_exceeded("body_timeout")
        self.transport.close()

    def _refuse(self, limit: str, what: str, timeout: float) -> None:
        self._limits.metrics.limit_exceeded(limit)
        error = RequestTimeout(f"the {what} did not arrive within {timeout:g} s")
        self.transport.write(raw_error_response(error))
