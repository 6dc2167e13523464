"""Issue 7 test 5: the OpenAI Python SDK streams through kvgate to real vLLM replicas."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from kvgate_server import KvgateServer, route_explain
from vllm_helpers import BLOCK, MODEL, ChatSession, engine_cached_tokens

from kvgate.backends.process import wait_until

pytestmark = pytest.mark.vllm


@pytest.fixture
def sdk(kvgate: KvgateServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{kvgate.url}/v1", api_key="not-checked", max_retries=0)
    try:
        yield client
    finally:
        client.close()


def _wait_indexed(kvgate: KvgateServer, messages: list[dict[str, str]]) -> None:
    """Wait until some worker's KV events for this prompt have reached kvgate's index."""
    body = {"model": MODEL, "messages": messages}
    with httpx.Client(base_url=kvgate.url, timeout=30.0) as client:

        def indexed() -> bool:
            return any(w["overlap_tokens"] > 0 for w in route_explain(client, body)["workers"])

        wait_until(indexed, 10.0, "the first turn indexed")


def test_sdk_streams_chat_with_usage_and_cache_hits(
    sdk: openai.OpenAI, kvgate: KvgateServer
) -> None:
    messages = ChatSession.start("sdk-chat", seed=5001).ask(120)
    usages = []
    for turn in range(2):
        if turn == 1:  # KV events arrive asynchronously: the repeat is routed on them
            _wait_indexed(kvgate, messages)
        pieces: list[str] = []
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        with stream:
            for chunk in stream:
                pieces.extend(choice.delta.content or "" for choice in chunk.choices)
                if chunk.usage is not None:
                    usages.append(chunk.usage)
        assert len(pieces) >= 1
    cold, warm = usages
    assert cold.completion_tokens == warm.completion_tokens == 12
    assert warm.prompt_tokens_details is not None
    assert warm.prompt_tokens_details.cached_tokens == engine_cached_tokens(
        warm.prompt_tokens, warm.prompt_tokens // BLOCK
    )


def test_sdk_streams_completions_and_sees_kvgate_headers(sdk: openai.OpenAI) -> None:
    prompt = ChatSession.start("sdk-completion", seed=5002).as_prompt()
    with sdk.completions.with_streaming_response.create(
        model=MODEL, prompt=prompt, max_tokens=8, stream=True
    ) as response:
        assert response.headers["x-kvgate-worker"].startswith("http://127.0.0.1:")
        assert response.headers["x-request-id"]
        chunks = [chunk for chunk in response.parse() if chunk.choices]
    assert chunks[-1].choices[0].finish_reason == "length"  # all 8 tokens arrived
