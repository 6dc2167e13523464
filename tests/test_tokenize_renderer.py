"""The engines' renderer as the authority for tokens (issue 50 part 4).

Without a local tokenizer kvgate asks a worker the request may go to for vLLM's rendering of
the request (``/v1/chat/completions/render``), remembered per rendered request; a worker
without a renderer is asked ``/tokenize``. At start a local template is checked against an
engine's rendering of a few probe prompts (``kvgate_tokenizer_mismatch{model}``); a model
whose template disagrees is keyed by the engine. ``--tokenizer`` at a folder without
``tokenizer.json`` is a configuration error that says so.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from fakes.engine import FakeEngine
from fakes.engine import _json as send_json
from fakes.gateway import fleet, kvgate
from fakes.simgate import (
    MODEL,
    cached_tokens,
    fleet_config,
    gate,
    predicted,
    sim_fleets,
    until,
    worker_specs,
)

from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.index.errors import TokenizeError
from kvgate.index.keys._tokenize import ModelTokenizer
from kvgate.router.serve import main as serve_main

pytestmark = pytest.mark.anyio

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


def tool_chat(turn: int) -> dict[str, Any]:
    """An agent's conversation after ``turn`` tool calls, with its tools offered."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " * 20},
        {"role": "user", "content": "Fix the failing test in the parser module."},
    ]
    for i in range(turn):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/f{i}.py"})},
        }
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append(
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"def f{i}(): pass " * 12}
        )
    return {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 2}


class RenderingEngine(FakeEngine):
    """A fake engine whose renderer and /tokenize answer differently (so the test sees
    which was used): the renderer one token per word plus 1000."""

    async def _route(self, method: str, path: str, body: Any, receive: Any, send: Any) -> None:
        if (method, path) == ("POST", "/v1/chat/completions/render"):
            text = " ".join(str(m.get("content") or "") for m in body["messages"])
            ids = [1000 + len(word) for word in text.split()]
            await send_json(send, {"request_id": "r", "token_ids": ids})
            return
        await super()._route(method, path, body, receive, send)


def _calls(engine: FakeEngine, path: str) -> int:
    return sum(1 for s in engine.seen if s.path == path)


async def test_renderer_first_remembered_per_request_else_tokenize() -> None:
    renders = RenderingEngine("r", tokenize=True)
    plain = FakeEngine("p", tokenize=True)  # no renderer: 404, then /tokenize
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "a b c d " * 40}]}
    async with fleet(renders) as f, kvgate(f.urls, policy="kv") as gw:
        for _ in range(3):  # explained, explained again, sent: rendered once
            explained = (await gw.client.post("/debug/route", json=body)).json()
            assert explained["tokenize_mode"] == "engine"
        assert _calls(renders, "/v1/chat/completions/render") == 1
        assert _calls(renders, "/tokenize") == 0
    async with fleet(plain) as f, kvgate(f.urls, policy="kv") as gw:
        for i in range(2):
            other = {**body, "messages": [{"role": "user", "content": f"x{i} " * 40}]}
            explained = (await gw.client.post("/debug/route", json=other)).json()
            assert explained["tokenize_mode"] == "engine"
        # the 404 is remembered: the second prompt goes to /tokenize at once
        assert _calls(plain, "/v1/chat/completions/render") == 1
        assert _calls(plain, "/tokenize") == 2


async def test_tool_calling_chat_keyed_by_the_renderer_predicts_exactly() -> None:
    """No local tokenizer: a growing tool-calling conversation keyed through the simulated
    vLLM's renderer; predicted cached tokens equal the engine's."""
    async with sim_fleets(fleet_config(2)) as (sim,), gate(worker_specs(sim), tokenizers=[]) as gw:
        seen = []
        for turn in range(4):
            body = tool_chat(turn)
            explained = (await gw.client.post("/debug/route", json=body)).json()
            assert explained["tokenize_mode"] == "engine"
            reply = await gw.client.post("/v1/chat/completions", json=body)
            seen.append((predicted(reply), cached_tokens(reply)))
            worker = reply.headers["x-kvgate-worker"]

            async def indexed(body: dict[str, Any] = body, worker: str = worker) -> bool:
                explained = (await gw.client.post("/debug/route", json=body)).json()
                entry = next(w for w in explained["workers"] if w["worker"] == worker)
                return int(entry["overlap_tokens"]) > 0

            await until(indexed, what="the turn's blocks indexed")
        assert all(p == c for p, c in seen), seen
        assert sum(c for _, c in seen) > 0


def _bent_tokenizer(tmp_path: Path) -> Path:
    """The simulator's tokenizer with a chat template that renders roles otherwise."""
    bent = tmp_path / "bent"
    shutil.copytree(tokenizer_dir(), bent)
    config_path = bent / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}### assistant:{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    return bent


async def _mismatch(gw: Any) -> float | None:
    for line in (await gw.client.get("/metrics")).text.splitlines():
        if line.startswith(f'kvgate_tokenizer_mismatch{{model="{MODEL}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_self_check_agrees_with_the_engines_template() -> None:
    async with sim_fleets(fleet_config(1)) as (sim,), gate(worker_specs(sim)) as gw:

        async def checked() -> bool:
            return await _mismatch(gw) is not None

        await until(checked, what="the template self-check")
        assert await _mismatch(gw) == 0.0
        body = tool_chat(1)
        explained = (await gw.client.post("/debug/route", json=body)).json()
        assert explained["tokenize_mode"] == "tokenizer"


async def test_self_check_finds_a_bent_template_and_keys_by_the_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bent = _bent_tokenizer(tmp_path)
    caplog.set_level(logging.WARNING, logger="kvgate.index.keys._prompt")
    async with (
        sim_fleets(fleet_config(1)) as (sim,),
        gate(worker_specs(sim), tokenizers=[f"{MODEL}={bent}"]) as gw,
    ):

        async def found() -> bool:
            return await _mismatch(gw) == 1.0

        await until(found, what="the mismatch found")
        assert any(
            MODEL in r.getMessage() and "otherwise" in r.getMessage() for r in caplog.records
        )
        body = tool_chat(2)
        explained = (await gw.client.post("/debug/route", json=body)).json()
        assert explained["tokenize_mode"] == "engine"
        first = await gw.client.post("/v1/chat/completions", json=body)
        worker = first.headers["x-kvgate-worker"]

        async def indexed() -> bool:
            explained = (await gw.client.post("/debug/route", json=body)).json()
            entry = next(w for w in explained["workers"] if w["worker"] == worker)
            return int(entry["overlap_tokens"]) > 0

        await until(indexed, what="blocks indexed")
        again = await gw.client.post("/v1/chat/completions", json=body)
        assert predicted(again) == cached_tokens(again) > 0


def test_tokenizer_folder_without_tokenizer_json_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizeError, match=r"has no tokenizer\.json"):
        ModelTokenizer(tmp_path, 1000, 1000)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(TokenizeError, match="is not a tokenizer"):
        ModelTokenizer(tmp_path, 1000, 1000)
    empty = tmp_path / "empty"
    empty.mkdir()
    code = serve_main(["--worker", "http://127.0.0.1:9", "--tokenizer", str(empty)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {empty}: the folder has no tokenizer.json" in err
