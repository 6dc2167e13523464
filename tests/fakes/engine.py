"""A small fake vLLM-like engine (pure ASGI) whose behaviour each test controls.

A request body may carry ``"fake": {...}`` (kvgate forwards unknown fields untouched):

* ``"tokens": N``: number of output tokens (default 3);
* ``"hold": "before_headers" | "after_first_chunk" | "before_last_chunk"``: stop there until
  the connection goes away (the engine records the cancel) or ``FakeEngine.release`` is set
  (released before its last chunk, a stream goes on to its end);
* ``"status": CODE``: answer with this HTTP status and an OpenAI error body;
* ``"break_stream": true``: send one chunk, then break the connection;
* ``"trickle": true``: stream one chunk every few milliseconds until the client goes away
  (a response that never ends, though no single wait is long);
* ``"pad": N``: add a field of N bytes to the (non-streamed) JSON body.

Every request is recorded in ``FakeEngine.seen`` (path, headers, parsed body).

Like vLLM, it can also answer ``GET /kv_event_sources`` (``sources``: the JSON to answer; None:
404) and ``POST /tokenize`` (``tokenize``: one token per word, the word's length).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Message, Receive, Scope, Send


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    raw_path: bytes = b""


@dataclass
class FakeEngine:
    name: str = "engine"
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    healthy: bool = True
    cached_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    seen: list[Seen] = field(default_factory=list)
    cancels: int = 0
    cancel_seen: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    holding: int = 0
    sources: dict[str, Any] | None = None
    tokenize: bool = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        parsed = json.loads(body) if body.strip() else None
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        raw_path = scope.get("raw_path") or b""
        self.seen.append(Seen(scope["method"], scope["path"], headers, parsed, raw_path))
        await self._route(scope["method"], scope["path"], parsed, receive, send)

    async def _route(self, method: str, path: str, body: Any, receive: Receive, send: Send) -> None:
        match (method, path):
            case ("GET", "/health"):
                await _json(send, {"ok": self.healthy}, 200 if self.healthy else 503)
            case ("GET", "/v1/models"):
                cards = [
                    {"id": m, "object": "model", "owned_by": self.name, "max_model_len": 4096}
                    for m in self.models
                ]
                await _json(send, {"object": "list", "data": cards})
            case ("GET", "/metrics"):
                await _text(send, self._metrics())
            case ("GET", "/kv_event_sources") if self.sources is not None:
                await _json(send, self.sources)
            case ("POST", "/tokenize") if self.tokenize:
                text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
                await _json(send, {"tokens": [len(word) for word in text.split()]})
            case ("POST", "/v1/chat/completions" | "/v1/completions"):
                await self._generate(path, body, receive, send)
            case ("POST", "/v1/embeddings"):
                await _json(
                    send,
                    {
                        "object": "list",
                        "model": body["model"],
                        "engine": self.name,
                        "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
                    },
                )
            case _:
                await _json(
                    send, {"error": {"message": f"no route {path}", "type": "not_found"}}, 404
                )

    def _metrics(self) -> str:
        labels = '{engine="0",model_name="fake-model"}'
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {self.running}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {self.waiting}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} {self.kv_usage}\n"
        )

    async def _generate(
        self, path: str, body: dict[str, Any], receive: Receive, send: Send
    ) -> None:
        fake = body.get("fake") or {}
        if "status" in fake:
            error = {
                "error": {
                    "message": f"fake {fake['status']}",
                    "type": "BadRequestError",
                    "param": None,
                    "code": fake["status"],
                }
            }
            await _json(send, error, fake["status"])
            return
        if fake.get("hold") == "before_headers":
            await self._hold(receive)
            return
        chat = path.endswith("chat/completions")
        tokens = int(fake.get("tokens", 3))
        usage = self._usage(body, tokens)
        if not body.get("stream"):
            answer = _completion(body, chat, tokens, usage, self.name)
            if "pad" in fake:
                answer["pad"] = "x" * int(fake["pad"])
            await _json(send, answer)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"x-engine", self.name.encode()),
                ],
            }
        )
        if fake.get("trickle"):
            await self._trickle(body, chat, receive, send)
            return
        for i in range(tokens):
            await _event(send, _chunk(body, chat, i))
            if i == 0 and fake.get("hold") == "after_first_chunk":
                await self._hold(receive)
                return
            if i == tokens - 2 and fake.get("hold") == "before_last_chunk":
                await self._hold(receive)
                if not self.release.is_set():
                    return  # the client went
            if i == 0 and fake.get("break_stream"):
                raise ConnectionAbortedError("fake engine breaks the stream")
        if (body.get("stream_options") or {}).get("include_usage"):
            await _event(
                send,
                {
                    "id": "x",
                    "object": "chunk",
                    "model": body["model"],
                    "choices": [],
                    "usage": usage,
                },
            )
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _trickle(
        self, body: dict[str, Any], chat: bool, receive: Receive, send: Send
    ) -> None:
        """One chunk every few milliseconds until the connection goes."""
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            i = 0
            while not gone.done():
                await _event(send, _chunk(body, chat, i))
                i += 1
                await asyncio.wait({gone}, timeout=0.005)
            self.cancels += 1
            self.cancel_seen.set()
        finally:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)

    async def _hold(self, receive: Receive) -> None:
        """Wait until the client disconnects (counted as a cancel) or the test releases us."""
        self.holding += 1
        waiter = asyncio.ensure_future(_wait_disconnect(receive))
        released = asyncio.ensure_future(self.release.wait())
        try:
            done, _ = await asyncio.wait({waiter, released}, return_when=asyncio.FIRST_COMPLETED)
            if waiter in done:
                self.cancels += 1
                self.cancel_seen.set()
        finally:
            self.holding -= 1
            for task in (waiter, released):
                task.cancel()
            await asyncio.gather(waiter, released, return_exceptions=True)

    def _usage(self, body: dict[str, Any], completion_tokens: int) -> dict[str, Any]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_tokens = len(prompt)
        elif prompt is not None:
            prompt_tokens = len(str(prompt).split())
        else:
            prompt_tokens = sum(
                len(str(m.get("content", "")).split()) for m in body.get("messages", [])
            )
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(self.cached_tokens, prompt_tokens)},
        }


def _completion(
    body: dict[str, Any], chat: bool, tokens: int, usage: dict[str, Any], name: str
) -> dict[str, Any]:
    text = " ".join(f"tok{i}" for i in range(tokens))
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        if chat
        else {"index": 0, "text": text, "finish_reason": "stop"}
    )
    return {
        "id": f"cmpl-{name}",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": body["model"],
        "choices": [choice],
        "usage": usage,
    }


def _chunk(body: dict[str, Any], chat: bool, i: int) -> dict[str, Any]:
    choice: dict[str, Any] = (
        {"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}
        if chat
        else {"index": 0, "text": f"tok{i} ", "finish_reason": None}
    )
    return {
        "id": "chunk",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": body["model"],
        "choices": [choice],
    }


async def read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _wait_disconnect(receive: Receive) -> None:
    message: Message = await receive()
    while message["type"] != "http.disconnect":
        message = await receive()


async def _json(send: Send, data: Any, status: int = 200) -> None:
    body = json.dumps(data).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _text(send: Send, text: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": text.encode()})


async def _event(send: Send, data: Any) -> None:
    payload = b"data: " + json.dumps(data).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": payload, "more_body": True})
