"""Issue 7 test 1: kvgate's predicted cached tokens equal what vLLM reports.

Interleaved multi-turn sessions (chat and completions, streamed and not) go through a real
kvgate in front of two real replicas. For each request kvgate's ``x-kvgate-predicted-cached-
tokens`` header (its index's matched prefix on the chosen worker) is compared with vLLM's
``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kvgate_server import KvgateServer
from vllm_helpers import MODEL, ChatSession, sse_chunks, stream_result, usage_of

pytestmark = pytest.mark.vllm

TURNS = 5
SESSIONS: tuple[tuple[str, bool], ...] = (
    ("chat", False),
    ("chat", True),
    ("completion", False),
    ("completion", True),
    ("chat", False),
    ("chat", True),
    ("completion", False),
    ("chat", True),
)
MIN_AGREEMENT = 0.95


@dataclass(frozen=True)
class Observation:
    session: str
    turn: int
    kind: str
    stream: bool
    worker: str
    prompt_tokens: int
    predicted: int
    cached: int

    def describe(self) -> str:
        mode = "stream" if self.stream else "plain"
        return (
            f"{self.session} turn {self.turn} ({self.kind}, {mode}) on {self.worker}: "
            f"prompt {self.prompt_tokens}, predicted {self.predicted}, vLLM cached {self.cached}"
        )


def _body(kind: str, session: ChatSession, stream: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream}
    if kind == "chat":
        body["messages"] = session.messages
    else:
        body["prompt"] = session.as_prompt()
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _send(
    client: httpx.Client, path: str, body: dict[str, Any], session: str
) -> tuple[httpx.Headers, str, int, int]:
    headers = {"x-session-id": session}
    chat = "messages" in body
    if body["stream"]:
        with client.stream("POST", path, json=body, headers=headers) as reply:
            reply.raise_for_status()
            text, prompt_tokens, cached = stream_result(sse_chunks(reply.iter_lines()), chat)
            return reply.headers, text, prompt_tokens, cached
    reply = client.post(path, json=body, headers=headers)
    reply.raise_for_status()
    data = reply.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    prompt_tokens, cached = usage_of(data)
    return reply.headers, text or "", prompt_tokens, cached


def test_predicted_cached_tokens_match_vllm(
    kvgate: KvgateServer, report: Callable[[str], None]
) -> None:
    sessions = [ChatSession.start(f"predict-{i}", seed=1000 + i) for i in range(len(SESSIONS))]
    observations: list[Observation] = []
    with httpx.Client(base_url=kvgate.url, timeout=120.0) as client:
        for turn in range(TURNS):
            for session, (kind, stream) in zip(sessions, SESSIONS, strict=True):
                session.ask()
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                max_tokens = session.rng.choice((4, 16, 40))
                body = _body(kind, session, stream, max_tokens)
                headers, text, prompt_tokens, cached = _send(client, path, body, session.name)
                session.answer(text)
                observations.append(
                    Observation(
                        session.name,
                        turn,
                        kind,
                        stream,
                        headers["x-kvgate-worker"],
                        prompt_tokens,
                        int(headers["x-kvgate-predicted-cached-tokens"]),
                        cached,
                    )
                )
    mismatches = [o for o in observations if o.predicted != o.cached]
    agreement = 1 - len(mismatches) / len(observations)
    hits = sum(o.cached for o in observations) / sum(o.prompt_tokens for o in observations)
    workers = sorted({o.worker for o in observations})
    report(
        f"prediction agreement {agreement:.3f} over {len(observations)} requests "
        f"({len(mismatches)} mismatches); engine hit rate {hits:.3f}; workers used {workers}"
    )
    for miss in mismatches:
        report(f"  mismatch: {miss.describe()}")
    assert agreement >= MIN_AGREEMENT, json.dumps([m.describe() for m in mismatches], indent=1)
