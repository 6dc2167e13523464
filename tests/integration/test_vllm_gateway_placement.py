"""Issue 7 test 2: a session stays on its replica; a new session goes where load says."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from kvgate_server import KvgateServer, index_stats, matched_blocks, route_explain
from vllm_helpers import MODEL, ChatSession

from kvgate.backends.process import wait_until
from kvgate.backends.vllm_cpu.launch import Fleet

pytestmark = pytest.mark.vllm


def _turn(client: httpx.Client, session: ChatSession) -> str:
    """One turn of ``session``; returns once the turn's KV events are in kvgate's index (they
    arrive asynchronously; an agent's next turn comes after its think time)."""
    body = {"model": MODEL, "messages": session.ask(), "max_tokens": 8}
    reply = client.post("/v1/chat/completions", json=body, headers={"x-session-id": session.name})
    reply.raise_for_status()
    worker = reply.headers["x-kvgate-worker"]
    sent = {"model": MODEL, "messages": list(session.messages)}
    wait_until(
        lambda: matched_blocks(route_explain(client, sent), worker) > 0,
        10.0,
        f"the turn of {session.name} indexed on {worker}",
    )
    session.answer(reply.json()["choices"][0]["message"]["content"] or "")
    return worker


def test_sessions_stay_home_and_new_ones_follow_load(
    kvgate: KvgateServer, vllm_fleet: Fleet
) -> None:
    first = ChatSession.start("place-first", seed=2001)
    with httpx.Client(base_url=kvgate.url, timeout=120.0) as client:
        homes = {_turn(client, first) for _ in range(3)}
        assert len(homes) == 1, f"one session, several replicas: {homes}"
        home = homes.pop()
        (other,) = set(vllm_fleet.urls) - {home}

        # Keep a long generation of the first session running on its home replica...
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": first.ask(),
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        explained = route_explain(client, body)
        with client.stream("POST", "/v1/chat/completions", json=body) as running:
            assert running.headers["x-kvgate-worker"] == home, (explained, index_stats(client))
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # generating
            # ...so a new session (no cached prefix anywhere) goes to the idle replica.
            second = ChatSession.start("place-second", seed=2002)
            second.ask()
            asked = {"model": MODEL, "messages": list(second.messages)}
            explained = route_explain(client, asked, second.name)
            assert explained["chosen"] == other, explained
            second.messages.pop()
            went = _turn(client, second)
            assert went == other, (  # the explain again and the log: the failure's evidence
                explained,
                route_explain(client, asked, second.name),
                kvgate.log_tail(120),
            )
        first.messages.pop()  # the cut-short turn

        # Both sessions keep their replicas while the other one's prefix sits elsewhere.
        assert _turn(client, first) == home
        assert _turn(client, second) == other
        explained = route_explain(client, {"model": MODEL, "messages": first.ask()})
        assert matched_blocks(explained, home) > 0
        assert matched_blocks(explained, other) == 0
