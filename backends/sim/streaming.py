"""Answering one generation request while the engine works on it.

* Streaming: the ``200`` and SSE headers go out when the request is accepted, before it
  queues and prefills (``stream_open`` ``at_accept``, vLLM), or with the first token
  (``at_first_token``). What the API sends at once (the Responses API's ``response.created``)
  waits for the response to open.
* A failure after the response opened is an error event inside the stream; before, it is an
  HTTP error. A request whose engine "crashed" (``TokenStream.dropped``) gets neither: its
  connection is reset, as a killed process's would be.
* A client that hangs up aborts its request in the engine.

Each API frames its own chunks (``Framer``): chat and text completions here, the Responses
API in ``responses.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Protocol

from kvgate.backends.sim.engine import Engine, SimRequest
from kvgate.backends.sim.protocol import (
    SSE_DONE,
    ApiError,
    ResponseShape,
    Sampling,
    json_encode,
    sse_error,
    usage,
)
from kvgate.backends.sim.responses import ResponseObject, usage_body
from kvgate.backends.sim.server import drop_connection

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
TextOf = Callable[[Sequence[int], bool], str]
"""Text of generated token ids (``True``: it follows earlier output, so a leading space)."""

JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_DROP_WAIT_S = 5.0


class Framer(Protocol):
    """The chunks and bodies of one API's response."""

    def opening(self) -> list[bytes]:
        """Sent as soon as the stream opens."""

    def tokens(self, req: SimRequest, new: Sequence[int]) -> list[bytes]:
        """Chunks for newly generated tokens (the first call opens the output)."""

    def closing(self, req: SimRequest) -> list[bytes]:
        """After the last token."""

    def error(self, error: ApiError) -> list[bytes]:
        """An error inside an open stream (its last chunks)."""

    def full(self, req: SimRequest) -> bytes:
        """The non-streaming body."""


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


class SseWriter:
    """An SSE response opened at accept or by its first write; ``opening`` goes first."""

    def __init__(self, send: Send, at_accept: bool) -> None:
        self._send = send
        self._at_accept = at_accept
        self._held: list[bytes] = []
        self.started = False

    async def accept(self, opening: list[bytes]) -> None:
        self._held = opening
        if self._at_accept:
            await self._open()

    async def write(self, chunks: list[bytes]) -> None:
        if not self.started:
            await self._open()
        for chunk in chunks:
            await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _open(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        self.started = True
        held, self._held = self._held, []
        await self.write(held)


class Generation:
    """One accepted request in the engine, answered on its HTTP connection."""

    def __init__(
        self, engine: Engine, req: SimRequest, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self._engine = engine
        self._req = req
        self._scope = scope
        self._receive = receive
        self._send = send
        self._watcher: asyncio.Task[None] | None = None

    async def serve(self, framer: Framer, *, stream: bool, at_accept: bool) -> None:
        self._watcher = asyncio.create_task(self._watch_disconnect())
        try:
            if stream:
                await self._stream(framer, SseWriter(self._send, at_accept))
            else:
                await self._complete(framer)
        finally:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._engine.abort(self._req)

    async def _watch_disconnect(self) -> None:
        message = await self._receive()
        req = self._req
        if message["type"] == "http.disconnect" and not req.stream.done:
            self._engine.abort(req)
            req.stream.fail("client disconnected")

    async def _drop(self) -> None:
        """Reset the connection and wait until the server has seen it go."""
        drop_connection(self._scope)
        if self._watcher is not None:
            await asyncio.wait({self._watcher}, timeout=_DROP_WAIT_S)

    async def _complete(self, framer: Framer) -> None:
        stream = self._req.stream
        while await stream.next():
            pass
        if stream.dropped:
            await self._drop()
        elif stream.error is not None:
            raise ApiError(500, stream.error)
        else:
            await respond(self._send, 200, framer.full(self._req), JSON_HEADERS)

    async def _stream(self, framer: Framer, writer: SseWriter) -> None:
        await writer.accept(framer.opening())
        req = self._req
        stream = req.stream
        while tokens := await stream.next():
            await writer.write(framer.tokens(req, tokens))
        if stream.dropped:
            await self._drop()
            return
        if stream.error is None:
            await writer.write(framer.closing(req))
        elif writer.started:
            await writer.write(framer.error(ApiError(500, stream.error)))
        else:
            raise ApiError(500, stream.error)
        await writer.end()


class ChatFramer:
    """``/v1/chat/completions`` and ``/v1/completions``: one chunk per token, vLLM's role
    chunk with the first token (chat), usage chunk on request, then ``[DONE]``."""

    def __init__(self, shape: ResponseShape, sampling: Sampling, text: TextOf) -> None:
        self._shape = shape
        self._sampling = sampling
        self._text = text
        self._sent = 0

    def opening(self) -> list[bytes]:
        return []

    def tokens(self, req: SimRequest, new: Sequence[int]) -> list[bytes]:
        shape = self._shape
        out = [shape.chunk("", None, first=True)] if shape.chat and self._sent == 0 else []
        finish = req.stream.finish_reason
        for token in new:
            self._sent += 1
            sent = self._sent
            last = finish is not None and sent == req.num_output
            running = (
                usage(req.prompt_len, sent, req.cached_tokens)
                if self._sampling.continuous_usage
                else None
            )
            text = self._text([token], sent > 1)
            out.append(shape.chunk(text, finish if last else None, usage_body=running))
        return out

    def closing(self, req: SimRequest) -> list[bytes]:
        if not self._sampling.include_usage:
            return [SSE_DONE]
        final = usage(req.prompt_len, req.num_output, req.cached_tokens)
        return [self._shape.usage_chunk(final), SSE_DONE]

    def error(self, error: ApiError) -> list[bytes]:
        return [sse_error(error), SSE_DONE]

    def full(self, req: SimRequest) -> bytes:
        final = usage(req.prompt_len, req.num_output, req.cached_tokens)
        text = self._text(req.output_ids, False)
        return self._shape.full(text, req.stream.finish_reason or "length", final)


class ResponsesFramer:
    """``/v1/responses``: vLLM's event sequence; the finished response goes to ``on_done``."""

    def __init__(
        self,
        response: ResponseObject,
        text: TextOf,
        on_done: Callable[[dict[str, Any], str], None],
    ) -> None:
        self._response = response
        self._text = text
        self._on_done = on_done
        self._sent = 0

    def opening(self) -> list[bytes]:
        return self._response.opening()

    def tokens(self, req: SimRequest, new: Sequence[int]) -> list[bytes]:
        out = self._response.first() if self._sent == 0 else []
        for token in new:
            self._sent += 1
            out.append(self._response.delta(self._text([token], self._sent > 1)))
        return out

    def closing(self, req: SimRequest) -> list[bytes]:
        return self._response.closing(self._final(req))

    def error(self, error: ApiError) -> list[bytes]:
        return [self._response.error(error)]

    def full(self, req: SimRequest) -> bytes:
        return json_encode(self._final(req))

    def _final(self, req: SimRequest) -> dict[str, Any]:
        text = self._text(req.output_ids, False)
        status = "incomplete" if req.stream.finish_reason == "length" else "completed"
        body = self._response.body(
            status, text, usage_body(req.prompt_len, req.num_output, req.cached_tokens)
        )
        self._on_done(body, text)
        return body
