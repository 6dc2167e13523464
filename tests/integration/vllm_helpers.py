"""Helpers of the real-vLLM tests: deterministic prompts, event taps, usage parsing."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq
from zmq.utils.monitor import recv_monitor_message

MODEL = "tiny"
BLOCK = 32
END_SEQ = b"\xff" * 8

_WORDS = [
    "agent",
    "tool",
    "call",
    "result",
    "file",
    "read",
    "write",
    "patch",
    "test",
    "build",
    "error",
    "stack",
    "trace",
    "fix",
    "plan",
    "step",
    "review",
    "diff",
    "branch",
    "merge",
    "commit",
    "lint",
    "format",
    "type",
    "check",
    "module",
    "import",
    "class",
    "function",
    "return",
    "value",
    "cache",
    "block",
    "token",
    "prompt",
    "session",
    "turn",
    "reply",
    "history",
    "system",
]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class ChatSession:
    """A growing multi-turn conversation with a seeded, unique system prompt."""

    name: str
    rng: random.Random
    messages: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, seed: int, system_words: int = 160) -> ChatSession:
        rng = random.Random(seed)
        system = f"Session {name}. {sentence(rng, system_words)}"
        return cls(name, rng, [{"role": "system", "content": system}])

    def ask(self, words: int | None = None) -> list[dict[str, str]]:
        """Append a user turn; returns the messages to send."""
        count = words if words is not None else self.rng.randint(20, 90)
        self.messages.append({"role": "user", "content": sentence(self.rng, count)})
        return list(self.messages)

    def answer(self, content: str) -> None:
        self.messages.append({"role": "assistant", "content": content})

    def as_prompt(self) -> str:
        """The history as one plain-text prompt (for /v1/completions sessions)."""
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages) + "\nassistant:"


def usage_of(body: dict[str, Any]) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of a non-streamed response."""
    usage = body["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)


def ranked_turns(
    client: httpx.Client, name: str, seed: int, sessions: int, turns: int
) -> list[tuple[int, int, int]]:
    """``sessions`` chat sessions of ``turns`` turns each through kvgate (``client``), turn
    by turn across sessions: each answer's (data-parallel rank, predicted cached tokens,
    engine-reported cached tokens)."""
    chats = [ChatSession.start(f"{name}-{i}", seed=seed + i) for i in range(sessions)]
    seen: list[tuple[int, int, int]] = []
    for _ in range(turns):
        for session in chats:
            session.ask()
            body = {"model": MODEL, "messages": session.messages, "max_tokens": 8}
            reply = client.post("/v1/chat/completions", json=body)
            reply.raise_for_status()
            data = reply.json()
            session.answer(data["choices"][0]["message"]["content"] or "")
            _, cached = usage_of(data)
            predicted = int(reply.headers["x-kvgate-predicted-cached-tokens"])
            seen.append((int(reply.headers["x-kvgate-dp-rank"]), predicted, cached))
    return seen


def sse_chunks(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def stream_result(chunks: Iterable[dict[str, Any]], chat: bool) -> tuple[str, int, int]:
    """(text, prompt_tokens, cached_tokens) of a streamed response with include_usage."""
    text: list[str] = []
    usage: tuple[int, int] | None = None
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
            text.append(piece or "")
        if chunk.get("usage"):
            usage = usage_of(chunk)
    if usage is None:
        raise AssertionError("stream ended without a usage chunk")
    return "".join(text), usage[0], usage[1]


def engine_cached_tokens(prompt_tokens: int, cached_blocks: int) -> int:
    """What vLLM reports for ``cached_blocks`` matched blocks: it always recomputes at least
    the prompt's last token, so a fully cached block-aligned prompt loses its last block."""
    return min(cached_blocks, (prompt_tokens - 1) // BLOCK) * BLOCK


def wait_subscribed(
    context: zmq.Context[zmq.Socket[bytes]], endpoint: str, timeout: float = 10.0
) -> zmq.Socket[bytes]:
    """A SUB socket on ``endpoint`` (all topics) once its handshake has succeeded."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        if not monitor.poll(int(timeout * 1000)):
            sub.close(linger=0)
            raise AssertionError(f"no ZMQ handshake with {endpoint} within {timeout} s")
        recv_monitor_message(monitor)
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
    return sub


def recv_until(
    sock: zmq.Socket[bytes],
    done: Callable[[list[list[bytes]]], bool],
    timeout: float = 20.0,
) -> list[list[bytes]]:
    """Multipart frames received until ``done(frames)`` holds; fails after ``timeout``."""
    frames: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while not done(frames):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"condition not met within {timeout} s ({len(frames)} frames)")
        if sock.poll(int(min(left, 0.5) * 1000)):
            frames.append(sock.recv_multipart())
    return frames


def replay_from(
    context: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int, timeout: float = 10.0
) -> list[list[bytes]]:
    """Every ``[b"", topic, seq, payload]`` the replay socket returns from ``start``, end marker
    excluded."""
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        frames = recv_until(dealer, lambda got: bool(got) and got[-1][2] == END_SEQ, timeout)
    finally:
        dealer.close(linger=0)
    return frames[:-1]
