"""The HTTP face of one replica: a lean ASGI app (served by uvicorn) speaking vLLM's API.

OpenAI: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not, with
``usage.prompt_tokens_details.cached_tokens``), ``GET /v1/models``. vLLM: ``GET /health``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``POST /v1/completions/render``,
``POST /v1/chat/completions/render``, ``GET /kv_event_sources``, ``POST /reset_prefix_cache``,
``GET /version``. Simulator: ``POST /sim/fault``, ``GET /sim/state``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.sim.engine import SimRequest
from backends.sim.faults import FaultError
from backends.sim.protocol import (
    SSE_DONE,
    ApiError,
    ResponseShape,
    Sampling,
    check_length,
    check_model,
    get_bool,
    json_encode,
    parse_messages,
    parse_object,
    parse_prompt,
    parse_sampling,
    parse_tools,
    render_request,
    sse_error,
    usage,
)
from index.chat_template import TemplateError

if TYPE_CHECKING:
    from backends.sim.replica import SimReplica

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Scope, bytes, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 64 * 1024 * 1024
VERSION = "kvgate-sim 0.1.0"
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, payload: Any, status: int = 200) -> None:
    await _respond(send, status, json_encode(payload), _JSON)


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class ReplicaApp:
    """ASGI application of one simulated replica."""

    def __init__(self, replica: SimReplica) -> None:
        self._replica = replica
        self._routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self._health,
            ("GET", "/ping"): self._health,
            ("GET", "/version"): self._version,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/kv_event_sources"): self._kv_event_sources,
            ("GET", "/sim/state"): self._state,
            ("POST", "/sim/fault"): self._fault,
            ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions/render"): self._render_completion,
            ("POST", "/v1/chat/completions/render"): self._render_chat,
        }
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        try:
            if handler is None:
                if scope["path"] in self._paths:
                    raise ApiError(405, f"method {scope['method']} not allowed")
                raise ApiError(404, f"no route {scope['path']}")
            body = await _read_body(receive) if scope["method"] == "POST" else b""
            await handler(scope, body, receive, send)
        except ApiError as exc:
            await _respond(send, exc.status, exc.body(), _JSON)
        except ConnectionAbortedError:
            return

    # --- plain endpoints -----------------------------------------------------------------

    async def _health(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await _respond(send, 200, b"", [])

    async def _version(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await _json(send, {"version": VERSION})

    async def _models(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        cfg = self._replica.config.engine
        await _json(
            send,
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "created": self._replica.started_at,
                        "owned_by": "vllm",
                        "root": cfg.model,
                        "parent": None,
                        "max_model_len": cfg.effective_max_model_len,
                    }
                ],
            },
        )

    async def _metrics(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        payload = generate_latest(self._replica.registry)
        await _respond(send, 200, payload, [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def _kv_event_sources(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        await _json(send, self._replica.kv_event_sources())

    async def _state(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await _json(send, self._replica.state())

    async def _fault(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        try:
            result = await self._replica.apply_fault(parse_object(body))
        except FaultError as exc:
            raise ApiError(400, str(exc)) from exc
        await _json(send, result)

    async def _reset_prefix_cache(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        if not self._replica.engine.reset_prefix_cache():
            raise ApiError(409, "blocks are in use: the prefix cache was not reset")
        await _respond(send, 200, b"", [])

    # --- tokenization --------------------------------------------------------------------

    async def _prompt_ids(self, data: dict[str, Any], chat: bool) -> list[int]:
        """Token ids of a request: chat ``messages`` (rendered) or a completion ``prompt``."""
        tok = self._replica.tokenizer
        if chat:
            try:
                text = tok.render_chat(
                    parse_messages(data),
                    tools=parse_tools(data),
                    add_generation_prompt=get_bool(data, "add_generation_prompt", True),
                    continue_final_message=get_bool(data, "continue_final_message", False),
                    template_kwargs=data.get("chat_template_kwargs") or None,
                )
            except TemplateError as exc:
                raise ApiError(400, str(exc), "messages") from exc
            return await tok.encode_async(text)
        prompt = parse_prompt(data, tok.vocab_size)
        return prompt if isinstance(prompt, list) else await tok.encode_async(prompt)

    async def _tokenize(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        data = parse_object(body)
        check_model(data, self._replica.config.engine.model)
        ids = await self._prompt_ids(data, chat="messages" in data)
        tok = self._replica.tokenizer
        strs = (
            [tok.token_text(i) for i in ids] if get_bool(data, "return_token_strs", False) else None
        )
        await _json(
            send,
            {
                "count": len(ids),
                "max_model_len": self._replica.config.engine.effective_max_model_len,
                "tokens": ids,
                "token_strs": strs,
            },
        )

    async def _detokenize(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        data = parse_object(body)
        check_model(data, self._replica.config.engine.model)
        tokens = data.get("tokens")
        tok = self._replica.tokenizer
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tok.vocab_size
            for t in tokens
        ):
            raise ApiError(400, "'tokens' must be an array of token ids", "tokens")
        await _json(send, {"prompt": tok.decode(tokens)})

    def _request(self, body: bytes, chat: bool) -> tuple[dict[str, Any], Sampling]:
        """A generation or render body, checked: the served model and the sampling options."""
        data = parse_object(body)
        cfg = self._replica.config.engine
        check_model(data, cfg.model)
        return data, parse_sampling(data, cfg.default_max_tokens if chat else 16, chat=chat)

    async def _render_completion(
        self, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        data, sampling = self._request(body, chat=False)
        ids = await self._prompt_ids(data, chat=False)
        model = self._replica.config.engine.model
        await _json(send, [render_request(ids, model, sampling.max_tokens, sampling.stream)])

    async def _render_chat(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        data, sampling = self._request(body, chat=True)
        ids = await self._prompt_ids(data, chat=True)
        model = self._replica.config.engine.model
        await _json(send, render_request(ids, model, sampling.max_tokens, sampling.stream))

    # --- generation ----------------------------------------------------------------------

    async def _chat(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await self._generate(body, chat=True, receive=receive, send=send)

    async def _completions(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        await self._generate(body, chat=False, receive=receive, send=send)

    async def _generate(self, body: bytes, *, chat: bool, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        data, sampling = self._request(body, chat)
        replica = self._replica
        fault = replica.faults.hit("fail")
        if fault is not None:
            replica.metrics.on_fault("fail")
            raise ApiError(int(fault.value), "simulated failure (fault 'fail')")
        ids = await self._prompt_ids(data, chat)
        check_length(len(ids), sampling.max_tokens, replica.config.engine.effective_max_model_len)
        engine = replica.engine
        req = engine.submit(ids, sampling.max_tokens, sampling.cache_salt, arrival)
        watcher = asyncio.create_task(self._watch_disconnect(receive, req))
        shape = ResponseShape.new(chat, replica.config.engine.model)
        try:
            if sampling.stream:
                await self._stream(req, shape, sampling, send)
            else:
                await self._complete(req, shape, send)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            engine.abort(req)

    async def _watch_disconnect(self, receive: Receive, req: SimRequest) -> None:
        message = await receive()
        if message["type"] == "http.disconnect" and not req.stream.done:
            self._replica.engine.abort(req)
            req.stream.fail("client disconnected")

    def _text(self, token_ids: list[int], leading_space: bool) -> str:
        tok = self._replica.tokenizer
        text = " ".join(tok.token_text(t) for t in token_ids)
        return " " + text if leading_space and text else text

    async def _complete(self, req: SimRequest, shape: ResponseShape, send: Send) -> None:
        stream = req.stream
        while await stream.next():
            pass
        if stream.error is not None:
            raise ApiError(500, stream.error)
        final = usage(req.prompt_len, req.num_output, req.cached_tokens)
        body = shape.full(
            self._text(req.output_ids, False), stream.finish_reason or "length", final
        )
        await _respond(send, 200, body, _JSON)

    async def _stream(
        self, req: SimRequest, shape: ResponseShape, sampling: Sampling, send: Send
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        stream = req.stream
        sent = 0
        if shape.chat:
            await self._send(send, shape.chunk("", None, first=True))
        while tokens := await stream.next():
            for token in tokens:
                sent += 1
                last = stream.finish_reason is not None and sent == req.num_output
                running_usage = (
                    usage(req.prompt_len, sent, req.cached_tokens)
                    if sampling.continuous_usage
                    else None
                )
                chunk = shape.chunk(
                    self._text([token], sent > 1), stream.finish_reason if last else None,
                    usage_body=running_usage,
                )  # fmt: skip
                await self._send(send, chunk)
        if stream.error is not None:
            await self._send(send, sse_error(ApiError(500, stream.error)))
        elif sampling.include_usage:
            final = usage(req.prompt_len, req.num_output, req.cached_tokens)
            await self._send(send, shape.usage_chunk(final))
        await send({"type": "http.response.body", "body": SSE_DONE, "more_body": False})

    @staticmethod
    async def _send(send: Send, chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
