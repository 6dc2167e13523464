"""A prompt without a local tokenizer is tokenized only by a worker it may be routed to, the
likeliest one first (issue 44, finding 13): never by one fixed worker of the model.

Real kvgate (policy ``kv``, approximate index: the fakes publish no events) in front of fake
engines that answer ``/tokenize``; each request's ``/tokenize`` call is found on the engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from fakes.engine import FakeEngine
from fakes.engine import _json as send_json
from fakes.gateway import Kvgate, fleet, kvgate

from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.router.config import ConfigError, load_settings

pytestmark = pytest.mark.anyio

MODEL = "fake-model"


def _words(tag: str, count: int = 48) -> str:
    """A message of ``count`` words: the fakes' tokenizer makes a token of each word, so a
    conversation fills whole blocks (16 tokens) and its cache draws its next turn back."""
    return " ".join(f"{tag}{i}" for i in range(count))


def _tokenized(engine: FakeEngine) -> int:
    return sum(1 for seen in engine.seen if seen.path == "/tokenize")


def _chat(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


async def _turn(
    gw: Kvgate, engines: dict[str, FakeEngine], body: dict[str, Any], **headers: str
) -> tuple[str, str]:
    """Send one request: (the worker that tokenized it, the worker that served it)."""
    before = {url: _tokenized(engine) for url, engine in engines.items()}
    answer = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    (asked,) = [url for url, engine in engines.items() if _tokenized(engine) > before[url]]
    assert _tokenized(engines[asked]) == before[asked] + 1  # one call, on one worker
    return asked, answer.headers["x-kvgate-worker"]


async def test_session_traffic_is_tokenized_where_its_cache_is() -> None:
    """Each turn is tokenized by the worker its session's last turn went to (where its cache
    is: the cost policy's likeliest choice); the sessions' prompts are spread over the
    workers, not all read by one."""
    a, b, c = (FakeEngine(name, tokenize=True) for name in "abc")
    async with fleet(a, b, c) as f, kvgate(f.urls, policy="kv") as gw:
        engines = dict(zip(f.urls, (a, b, c), strict=True))
        asked_by = set()
        for session in range(12):
            messages = [{"role": "user", "content": _words(f"s{session}w")}]
            served = None
            for turn in range(3):
                header = {"x-session-id": f"s{session}"}
                asked, now_served = await _turn(gw, engines, _chat(messages), **header)
                assert served is None or asked == served, (session, turn)
                served = now_served
                asked_by.add(asked)
                messages += [
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": _words(f"s{session}t{turn}w")},
                ]
        assert len(asked_by) > 1


async def test_a_conversation_without_a_session_key_is_tokenized_where_it_went() -> None:
    a, b = FakeEngine("a", tokenize=True), FakeEngine("b", tokenize=True)
    async with fleet(a, b) as f, kvgate(f.urls, policy="kv") as gw:
        engines = dict(zip(f.urls, (a, b), strict=True))
        asked_by = set()
        for conversation in range(16):
            messages = [
                {"role": "system", "content": "a shared system prompt"},
                {"role": "user", "content": _words(f"c{conversation}w")},
            ]
            asked, first_served = await _turn(gw, engines, _chat(messages))
            asked_by.add(asked)
            messages += [
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": _words(f"c{conversation}next")},
            ]
            # its next turn is tokenized by the worker that served the first (its cache)
            asked, _ = await _turn(gw, engines, _chat(messages))
            assert asked == first_served
        assert asked_by == set(f.urls)  # spread over the workers, not one reading them all


async def test_a_worker_that_does_not_serve_the_model_never_sees_its_prompts() -> None:
    serving = FakeEngine("serving", tokenize=True)
    other = FakeEngine("other", tokenize=True, models=["other-model"])
    async with fleet(serving, other) as f, kvgate(f.urls, policy="kv") as gw:
        engines = dict(zip(f.urls, (serving, other), strict=True))
        for i in range(4):
            body = _chat([{"role": "user", "content": f"prompt {i}"}])
            asked, served = await _turn(gw, engines, body, **{"x-session-id": f"s{i}"})
            assert asked == served == f.urls[0]
        assert _tokenized(other) == 0


async def test_engine_tokenization_off_needs_a_local_tokenizer(tmp_path: Any) -> None:
    workers = ["http://127.0.0.1:9"]
    with pytest.raises(ConfigError, match="--tokenizer"):
        load_settings(overrides={"workers": workers, "index": {"engine_tokenize": False}})
    settings = load_settings(
        overrides={
            "workers": workers,
            "index": {"engine_tokenize": False},
            "tokenizers": [str(tmp_path)],
        }
    )
    assert settings.index.default_tokenizer == tmp_path


async def test_engine_tokenization_off_asks_no_engine() -> None:
    engine = FakeEngine(tokenize=True)
    index = {"engine_tokenize": False}
    tokenizers = [f"{MODEL}={tokenizer_dir()}"]
    async with (
        fleet(engine) as f,
        kvgate(f.urls, policy="kv", index=index, tokenizers=tokenizers) as gw,
    ):
        for model, mode in ((MODEL, "tokenizer"), ("other-model", "approx")):
            engine.models.append(model)
            await gw.gateway.health.refresh_models()
            body = {**_chat([{"role": "user", "content": "hello there"}]), "model": model}
            assert (await gw.client.post("/v1/chat/completions", json=body)).status_code == 200
            assert gw.metric("kvgate_tokenize_total", {"model": model, "mode": mode}) == 1
        assert _tokenized(engine) == 0


@dataclass
class OtherTemplate(FakeEngine):
    """An engine whose chat template adds a token before the messages: the same prompt has
    other tokens there than on a ``FakeEngine``."""

    async def _route(self, method: str, path: str, body: Any, receive: Any, send: Any) -> None:
        if (method, path) == ("POST", "/tokenize"):
            text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
            await send_json(send, {"tokens": [1, *(len(word) for word in text.split())]})
            return
        await super()._route(method, path, body, receive, send)


async def _explain(gw: Kvgate, body: dict[str, Any], session: str) -> dict[str, Any]:
    answer = await gw.client.post("/debug/route", json=body, headers={"x-session-id": session})
    explained: dict[str, Any] = answer.json()
    return explained


def _matched(explained: dict[str, Any], url: str) -> int:
    (entry,) = [w for w in explained["workers"] if w["worker"] == url]
    return sum(entry["matched_blocks"].values())


@pytest.mark.parametrize("agree", [True, False])
async def test_a_mixed_fleet_is_keyed_per_engine(agree: bool) -> None:
    """A vLLM and an SGLang worker of one model, no local tokenizer: each engine kind keys
    the prompt itself; where their tokens differ neither is credited with the other's blocks,
    where they agree one key set serves both."""
    vllm = FakeEngine("vllm", tokenize=True)
    sglang = (
        FakeEngine("sglang", tokenize=True) if agree else OtherTemplate("sglang", tokenize=True)
    )
    async with fleet(vllm, sglang) as f:
        workers = [f.urls[0], f"{f.urls[1]},engine=sglang"]
        async with kvgate(workers, policy="kv") as gw:
            messages = [{"role": "user", "content": _words("mixed")}]
            first = await gw.client.post(
                "/v1/chat/completions", json=_chat(messages), headers={"x-session-id": "m"}
            )
            home = first.headers["x-kvgate-worker"]
            (away,) = set(f.urls) - {home}
            messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]
            explained = await _explain(gw, _chat(messages), "m")
            assert explained["tokenize_mode"] == "engine"
            other_kind = {f.urls[0]: "vllm", f.urls[1]: "sglang"}[away]
            expected = [] if agree else [other_kind]
            assert explained["engines_tokenizing_otherwise"] == expected
            assert _matched(explained, home) == 3  # 48 words: 3 blocks of 16 on the worker
            assert _matched(explained, away) == 0  # nothing there, whichever keys
