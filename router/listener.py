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

from router.config import ClientConfig
from router.errors import InvalidRequest, KvgateError, RequestTimeout, TooManyConnections
from router.metrics import GatewayMetrics

Phase = Literal["header", "body"]
_BODY_TIMED_OUT = "kvgate.body_timed_out"  # scope key set when the listener cut a body


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


class GuardedProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` plus read timeouts, the connection cap and JSON 400s."""

    _limits: ListenerLimits  # set by ``ListenerLimits.protocol``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_phase: Phase | None = None
        self._head_started = False
        self._counted = False

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
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.transport.is_closing():
            self._watch(self._incomplete())

    # -- parser callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True

    def on_headers_complete(self) -> None:
        self._head_started = False
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        error = InvalidRequest(f"malformed HTTP request: {msg}", code="invalid_http")
        self.transport.write(raw_error_response(error))
        self.transport.close()

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
