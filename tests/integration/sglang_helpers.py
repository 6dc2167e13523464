"""Helpers of the real-SGLang tests: one turn through kvgate, kvgate's view of a worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from kvgate_server import matched_blocks, route_explain
from vllm_helpers import MODEL, ChatSession, sse_chunks, stream_result, usage_of

from kvgate.backends.process import PortAllocator, wait_until
from kvgate.backends.sglang_cpu.launch import SglangReplicaSpec

PAGE = 32  # the replicas' --page-size: kvgate adopts it
CAPACITY_TOKENS = 40960  # their --max-total-tokens


def plan_free_sglang(count: int, ports: PortAllocator, first: int = 0) -> list[SglangReplicaSpec]:
    """SGLang replicas ``first``.. (their index names their log and core) on free loopback
    ports (HTTP, events, replay, torch.distributed)."""
    taken = ports.take(4 * count)
    return [SglangReplicaSpec(first + i, *taken[4 * i : 4 * i + 4]) for i in range(count)]


@dataclass(frozen=True)
class Turn:
    """One request through kvgate: where it went, its size, kvgate's prediction, the
    engine's report."""

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
            f"{self.session} turn {self.turn} ({self.kind}, {mode}) on {self.worker}: prompt "
            f"{self.prompt_tokens}, predicted {self.predicted}, engine cached {self.cached}"
        )


def body_of(session: ChatSession, kind: str, stream: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream}
    if kind == "chat":
        body["messages"] = session.messages
    else:
        body["prompt"] = session.as_prompt()
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def turn(
    client: httpx.Client,
    session: ChatSession,
    index: int,
    kind: str = "chat",
    stream: bool = False,
    max_tokens: int = 8,
) -> Turn:
    """Ask the session's next question through kvgate and record the answer."""
    session.ask()
    body = body_of(session, kind, stream, max_tokens)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    headers = {"x-session-id": session.name}
    if stream:
        with client.stream("POST", path, json=body, headers=headers) as reply:
            reply.raise_for_status()
            text, prompt_tokens, cached = stream_result(
                sse_chunks(reply.iter_lines()), kind == "chat"
            )
            answer_headers = reply.headers
    else:
        reply = client.post(path, json=body, headers=headers)
        reply.raise_for_status()
        data = reply.json()
        choice = data["choices"][0]
        text = (choice["message"]["content"] if kind == "chat" else choice["text"]) or ""
        prompt_tokens, cached = usage_of(data)
        answer_headers = reply.headers
    session.answer(text)
    return Turn(
        session.name,
        index,
        kind,
        stream,
        answer_headers["x-kvgate-worker"],
        prompt_tokens,
        int(answer_headers["x-kvgate-predicted-cached-tokens"]),
        cached,
    )


def next_chat(session: ChatSession) -> dict[str, Any]:
    """The body of the session's next chat turn, without asking it (for ``/debug/route``)."""
    user = {"role": "user", "content": "?"}
    return {"model": MODEL, "messages": [*session.messages, user], "max_tokens": 1}


def wait_indexed(client: httpx.Client, session: ChatSession, worker: str) -> None:
    """Events reach kvgate shortly after the answer: wait until its index holds the session's
    last prompt on ``worker`` before the next turn is sent."""
    probe = next_chat(session)
    wait_until(
        lambda: matched_blocks(route_explain(client, probe, session.name), worker) > 0,
        15.0,
        f"kvgate to index {session.name}'s blocks on {worker}",
    )


def entries(client: httpx.Client, worker: str) -> int:
    """(block, cache domain) entries kvgate's event index holds for a worker."""
    domains = client.get("/debug/index").json()["domains"]
    return sum(d["entries"] for d in domains if d["worker"] == worker)


def worker_view(client: httpx.Client, worker: str) -> dict[str, Any]:
    workers = client.get("/admin/workers").json()["workers"]
    (view,) = [w for w in workers if w["url"] == worker]
    found: dict[str, Any] = view
    return found
