"""The Responses API as vLLM serves it: the response object and its stream events, prompts
rendered by the chat template exactly as vLLM builds the conversation, previous_response_id
continued from the replica's bounded store, and vLLM's errors (real HTTP, OpenAI SDK)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from test_sim_support import sim_config, sim_fleet

from kvgate.backends.sim.config import ApiConfig
from kvgate.backends.sim.fleet import SimFleet
from kvgate.backends.sim.responses import ResponseStore

pytestmark = pytest.mark.anyio
BASE = "kvgate-sim"
LONG = "the history of prefix caching in serving engines is long " * 6


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(sim_config(block_size=4)) as f:
        yield f


@pytest.fixture
async def client(fleet: SimFleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.replicas[0].url, timeout=30) as c:
        yield c


async def _respond(c: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    reply = await c.post("/v1/responses", json={"max_output_tokens": 4, **body})
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def _tokens(c: httpx.AsyncClient, messages: list[dict[str, Any]]) -> int:
    reply = await c.post("/tokenize", json={"messages": messages})
    count: int = reply.json()["count"]
    return count


def _text(response: dict[str, Any]) -> str:
    text: str = response["output"][0]["content"][0]["text"]
    return text


def _error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert error["code"] == status
    return error


async def test_a_response_object(client: httpx.AsyncClient) -> None:
    response = await _respond(client, input="Hello!", instructions="Be brief.")
    assert response["id"].startswith("resp_") and response["object"] == "response"
    assert response["model"] == BASE
    # every simulated output ends at its max: vLLM reports that as incomplete
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = response["output"]
    assert (message["type"], message["role"], message["status"]) == (
        "message", "assistant", "completed"
    )  # fmt: skip
    assert len(_text(response).split()) == 4
    usage = response["usage"]
    expected = await _tokens(
        client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    )
    assert usage["input_tokens"] == expected
    assert usage["output_tokens"] == 4 and usage["total_tokens"] == expected + 4
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert (await client.get(f"/v1/responses/{response['id']}")).json() == response


async def test_input_items_render_like_chat_messages(client: httpx.AsyncClient) -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": LONG}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "noted"}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "user", "content": "and then?"},
    ]
    response = await _respond(client, input=items)
    messages = [
        {"role": "user", "content": LONG},
        {"role": "assistant", "content": "noted"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        ]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "user", "content": "and then?"},
    ]  # fmt: skip
    assert response["usage"]["input_tokens"] == await _tokens(client, messages)
    # the same conversation through chat completions finds the blocks cached
    chat = {"messages": messages, "max_tokens": 1}
    reply = (await client.post("/v1/chat/completions", json=chat)).json()
    prompt = reply["usage"]["prompt_tokens"]
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 4 * 4


async def test_previous_response_id_continues_the_conversation(client: httpx.AsyncClient) -> None:
    first = await _respond(client, input=LONG, instructions="Be brief.")
    second = await _respond(client, input="And then?", previous_response_id=first["id"])
    # vLLM: this turn's instructions (none), the stored conversation with its output, the input
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": LONG},
        {"role": "assistant", "content": _text(first)},
        {"role": "user", "content": "And then?"},
    ]
    assert second["usage"]["input_tokens"] == await _tokens(client, history)
    assert second["previous_response_id"] == first["id"]
    # the first turn's prompt and output (all but its last token) are cached, as full blocks
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached == (first["usage"]["input_tokens"] + 3) // 4 * 4
    third = await _respond(
        client, input="More?", instructions="Be brief.", previous_response_id=second["id"]
    )
    with_instructions = [{"role": "system", "content": "Be brief."}, *history]
    with_instructions += [
        {"role": "assistant", "content": _text(second)},
        {"role": "user", "content": "More?"},
    ]
    assert third["usage"]["input_tokens"] == await _tokens(client, with_instructions)


async def test_unknown_ids_get_vllms_errors(client: httpx.AsyncClient) -> None:
    body = {"input": "hi", "previous_response_id": "resp_nope"}
    error = _error(await client.post("/v1/responses", json=body), 404)
    assert error == {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    assert _error(await client.get("/v1/responses/resp_nope"), 404)["param"] == "response_id"
    done = await _respond(client, input="hi")
    cancel = await client.post(f"/v1/responses/{done['id']}/cancel")
    assert _error(cancel, 400)["message"] == "Cannot cancel a synchronous response."
    unknown_model = await client.post("/v1/responses", json={"input": "hi", "model": "gpt-x"})
    assert _error(unknown_model, 404)["message"] == "The model `gpt-x` does not exist."


async def test_store_false_is_not_kept(client: httpx.AsyncClient) -> None:
    response = await _respond(client, input="hi", store=False)
    assert (await client.get(f"/v1/responses/{response['id']}")).status_code == 404
    body = {"input": "hi", "previous_response_id": response["id"]}
    assert (await client.post("/v1/responses", json=body)).status_code == 404


async def test_a_replica_without_a_store_answers_404_like_default_vllm() -> None:
    config = replace(sim_config(), api=ApiConfig(responses_store=0))
    async with sim_fleet(config) as fleet, httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        response = await _respond(c, input="hi")
        body = {"input": "again", "previous_response_id": response["id"]}
        assert (await c.post("/v1/responses", json=body)).status_code == 404


async def test_streaming_events(client: httpx.AsyncClient) -> None:
    body = {"input": "stream it", "max_output_tokens": 3, "stream": True}
    names, payloads = [], []
    async with client.stream("POST", "/v1/responses", json=body) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        async for line in reply.aiter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            elif line.startswith("data: "):
                payloads.append(json.loads(line.removeprefix("data: ")))
    assert names == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [p["type"] for p in payloads] == names
    assert [p["sequence_number"] for p in payloads] == list(range(len(names)))
    final = payloads[-1]["response"]
    deltas = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    assert deltas == _text(final) == payloads[-4]["text"]
    assert payloads[0]["response"]["status"] == "in_progress"
    assert (await client.get(f"/v1/responses/{final['id']}")).json() == final


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"input": []},
        {"input": [{"type": "reasoning", "summary": []}]},
        {"input": "x", "background": True},
        {"input": "x", "max_output_tokens": 0},
        {"input": [{"role": "user"}]},
    ],
)
async def test_bad_requests_are_400(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    _error(await client.post("/v1/responses", json=body), 400)


async def test_openai_sdk(fleet: SimFleet) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{fleet.replicas[0].url}/v1", api_key="unused")
    try:
        first = await sdk.responses.create(model=BASE, input="Hello!", max_output_tokens=3)
        assert first.id.startswith("resp_") and len(first.output_text.split()) == 3
        assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0
        stream = await sdk.responses.create(
            model=BASE, input="More", previous_response_id=first.id, max_output_tokens=2,
            stream=True,
        )  # fmt: skip
        kinds = [event.type async for event in stream]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        again = await sdk.responses.retrieve(first.id)
        assert again.output_text == first.output_text
    finally:
        await sdk.close()


def test_the_store_is_bounded_by_count_and_bytes() -> None:
    store = ResponseStore(capacity=2, max_bytes=10_000)
    for i in range(3):
        store.put(f"resp_{i}", {"id": i}, [{"role": "user", "content": "x"}])
    assert len(store) == 2 and store.get("resp_0") is None
    assert store.get("resp_1") is not None  # used: now the most recent
    store.put("resp_3", {}, [{"role": "user", "content": "y"}])
    assert store.get("resp_2") is None and store.get("resp_1") is not None
    small = ResponseStore(capacity=100, max_bytes=300)
    for i in range(5):
        small.put(f"resp_{i}", {}, [{"role": "user", "content": "z" * 100}])
    assert len(small) == 2  # ~130 bytes each
    small.put("resp_big", {}, [{"role": "user", "content": "z" * 1000}])
    assert small.get("resp_big") is None and len(small) == 2  # larger than the whole store
