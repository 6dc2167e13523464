"""Issue 50 part 4: a tool-calling conversation keyed through vLLM's renderer.

kvgate without ``--tokenizer`` in front of the shared real replicas (started with
``--enable-scale-out``, which serves ``/v1/chat/completions/render``): each turn of an agent's
conversation (tools offered, assistant tool calls, tool results) is keyed by the token ids
vLLM renders for it, and kvgate's predicted cached tokens equal what vLLM reports.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvgate_server import KvgateServer, route_explain
from vllm_helpers import MODEL, usage_of

from kvgate.backends.process import PortAllocator
from kvgate.backends.vllm_cpu.launch import Fleet
from kvgate.backends.vllm_cpu.layout import EngineLayout

pytestmark = pytest.mark.vllm

TURNS = 5
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def _renders(fleet: Fleet) -> int:
    """Render calls the replicas have answered so far (their access log)."""
    return sum(
        Path(r.log_path).read_text(errors="replace").count("/v1/chat/completions/render HTTP")
        for r in fleet.replicas
    )


def test_tool_calling_chat_keyed_by_the_renderer(
    vllm_fleet: Fleet,
    engine_layout: EngineLayout,
    ports: PortAllocator,
    report: Callable[[str], None],
) -> None:
    log_path = engine_layout.logs / "pytest" / "kvgate-renderer.log"
    before = _renders(vllm_fleet)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent working in a repository. " * 8},
        {"role": "user", "content": "The parser test fails; find out why and fix it."},
    ]
    seen: list[tuple[int, int]] = []
    with (
        KvgateServer(
            vllm_fleet.worker_flags(), None, log_path, ports.one(), block_size=None
        ) as server,
        httpx.Client(base_url=server.url, timeout=120.0) as client,
    ):
        for turn in range(TURNS):
            body = {
                "model": MODEL,
                "messages": messages,
                "tools": TOOLS,
                "tool_choice": "none",  # "auto" needs a tool parser for the model (none here)
                "max_tokens": 8,
            }
            explained = route_explain(client, body, session="agent")
            assert explained["tokenize_mode"] == "engine"
            reply = client.post(
                "/v1/chat/completions", json=body, headers={"x-session-id": "agent"}
            )
            reply.raise_for_status()
            _, cached = usage_of(reply.json())
            seen.append((int(reply.headers["x-kvgate-predicted-cached-tokens"]), cached))
            call = {
                "id": f"call_{turn}",
                "type": "function",
                "function": {
                    "name": "read_file",
                    "arguments": json.dumps({"path": f"src/m{turn}.py"}),
                },
            }
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": f"call_{turn}",
                    "content": f"def m{turn}(): ... " * 20,
                }
            )
    renders = _renders(vllm_fleet) - before
    report(f"renderer: {TURNS} tool-calling turns, (predicted, cached) {seen}, {renders} renders")
    assert renders >= TURNS  # keyed by the renderer (the self-check adds none: no --tokenizer)
    assert all(p == c for p, c in seen), seen
    assert sum(c for _, c in seen) > 0
