"""Bad input is the client's problem: a 4xx with an OpenAI-style body, never a 5xx, and
nothing reaches an engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate

from kvgate.backends.sim.tokenizer import tokenizer_dir

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
JSON = {"content-type": "application/json"}


def nested(depth: int, leaf: bytes = b"1") -> bytes:
    return b"[" * depth + leaf + b"]" * depth


def deep_bodies(depth: int) -> list[tuple[str, bytes]]:
    inner = nested(depth)
    return [
        ("/v1/chat/completions", nested(depth)),
        (
            "/v1/chat/completions",
            b'{"model":"fake-model","messages":[{"role":"user","content":' + inner + b"}]}",
        ),
        (
            "/v1/chat/completions",
            b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}],"x":'
            + inner
            + b"}",
        ),
        ("/v1/completions", b'{"model":"fake-model","prompt":' + inner + b"}"),
        ("/v1/completions", b'{"model":"fake-model","prompt":"hi","logit_bias":' + inner + b"}"),
        ("/v1/embeddings", b'{"model":"fake-model","input":' + inner + b"}"),
        ("/admin/workers", b'{"url":' + inner + b"}"),
        ("/debug/route", b'{"model":"fake-model","messages":' + inner + b"}"),
    ]


def generated(engine: FakeEngine) -> list[str]:
    """What reached the engine besides kvgate's own GETs (probes, event discovery)."""
    return [s.path for s in engine.seen if s.method != "GET"]


@pytest.mark.parametrize("kv_index", [True, False])
async def test_deep_nesting_is_400(kv_index: bool) -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls, kv_index=kv_index) as gw:
        for depth in (202, 250, 990, 1_000, 5_000, 100_000):
            for path, raw in deep_bodies(depth):
                r = await gw.client.post(path, content=raw, headers=JSON)
                assert r.status_code == 400, (depth, path, r.text[:200])
                error = r.json()["error"]
                assert error["type"] == "invalid_request_error"
                assert "nest" in error["message"], (depth, error)
        assert generated(f.engines[0]) == []
        assert (await gw.client.post("/v1/chat/completions", json=CHAT)).status_code == 200


ODD_LITERALS = [
    b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}],"temperature":1e400}',
    b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
    b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}],"x":-Infinity}',
    b'{"model":"fake-model","messages":[{"role":"user","content":"\\ud800"}]}',
    b'{"model":"fake-model","messages":[{"role":"user","content":"\xff"}]}',
]


async def test_odd_numbers_and_strings_never_5xx() -> None:
    """Out-of-range floats, NaN literals, lone surrogates, invalid UTF-8: 2xx or 400."""
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        for raw in ODD_LITERALS:
            for stream in (b"false", b"true"):
                body = raw[:-1] + b',"stream":' + stream + b"}"
                r = await gw.client.post("/v1/chat/completions", content=body)
                assert r.status_code in (200, 400), (body, r.text)
                if r.status_code == 400:
                    assert r.json()["error"]["code"] == "invalid_json"


async def test_reasonable_nesting_still_passes() -> None:
    """A tool schema a few dozen levels deep is fine (the limit is for attacks, not use)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(90):  # 180 levels with the request around it
        schema = {"type": "object", "properties": {"x": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "tools": tools})
        assert r.status_code == 200


OUT_OF_RANGE = [[-1], [1, 2**32], [2**40], [[5, -1]], [[1], [2**63]], [2**64 + 1], [-(2**70)]]


@pytest.mark.parametrize("kv_index", [True, False])
async def test_token_ids_outside_uint32_are_400(kv_index: bool) -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls, kv_index=kv_index) as gw:
        for prompt, stream in [(p, s) for p in OUT_OF_RANGE for s in (False, True)]:
            body = {"model": "fake-model", "prompt": prompt, "stream": stream}
            r = await gw.client.post("/v1/completions", json=body)
            assert r.status_code == 400, (prompt, r.text)
            error = r.json()["error"]
            assert error["param"] is not None and error["param"].startswith("prompt")
            r = await gw.client.post("/debug/route", json=body)
            assert r.status_code == 400, prompt
        assert generated(f.engines[0]) == []
        ok = {"model": "fake-model", "prompt": [0, 2**32 - 1]}
        assert (await gw.client.post("/v1/completions", json=ok)).status_code == 200


ODD_BODIES = [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**40}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -5}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -(10**30)}),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 2**70}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 10**400}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": {"a": [1e308, -1e308]}}]}),
    ("/v1/chat/completions", {**CHAT, "user": "\x00" * 10}),
    ("/v1/chat/completions", {**CHAT, "cache_salt": "\ud800"}),
    ("/v1/completions", {"model": "fake-model", "prompt": "\udfff"}),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"x": [[[[[]]]]]}}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{}]}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": 5, "content": None}]}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"function": 3}]}),
]


async def test_odd_but_decodable_bodies_never_5xx() -> None:
    """Values that parse but may upset later stages: out-of-range numbers, lone surrogates,
    control characters, odd shapes. Each is answered (2xx or 4xx), never a 5xx."""
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        for path, body in ODD_BODIES:
            r = await gw.client.post(path, content=json.dumps(body).encode())
            assert r.status_code < 500, (body, r.text)
            if r.status_code >= 400:
                assert r.json()["error"]["type"]
        assert (await gw.client.post("/v1/chat/completions", json=CHAT)).status_code == 200


ODD_MESSAGES = [
    {"role": "tool", "content": None, "tool_calls": 5},
    {"role": "user", "content": "x", "tool_calls": True},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
        ],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "1",
                "type": "function",
                "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000},
            }
        ],
    },
]


async def test_chat_templates_meeting_odd_messages_never_5xx() -> None:
    """kvgate renders the chat template itself (a tokenizer is configured): data the
    template cannot handle falls back to approximate keys, and the engine decides."""
    tokenizers = [f"fake-model={tokenizer_dir()}"]
    async with fleet(FakeEngine()) as f, kvgate(f.urls, tokenizers=tokenizers) as gw:
        for message in ODD_MESSAGES:
            body = {"model": "fake-model", "messages": [message]}
            r = await gw.client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, (message, r.text)
            r = await gw.client.post("/debug/route", json=body)
            assert r.status_code == 200 and r.json()["tokenize_mode"] != "tokenizer", message
