"""Issue 7 test 5: the OpenAI Python SDK streams through kvgate to real vLLM replicas."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from kvgate_server import KvgateServer
from vllm_helpers import BLOCK, MODEL, ChatSession, engine_cached_tokens

pytestmark = pytest.mark.vllm


@pytest.fixture
def sdk(kvgate: KvgateServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{kvgate.url}/v1", api_key="not-checked", max_retries=0)
    try:
        yield client
    finally:
        client.close()


def test_sdk_streams_chat_with_usage_and_cache_hits(sdk: openai.OpenAI) -> None:
    messages = ChatSession.start("sdk-chat", seed=5001).ask(120)
    usages = []
    for _ in range(2):
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
