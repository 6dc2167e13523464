"""The Responses API (issue 17, part 3): ``POST /v1/responses`` keyed as the engine renders it
(instructions and input through the chat template), and a turn naming a
``previous_response_id`` routed to the worker that produced that response (its id read from
the answer, streamed or not); when that worker is gone or down the client is told so.

Real uvicorn kvgate, simulated vLLM replicas serving the Responses API with a
previous_response_id store per replica."""

from __future__ import annotations

import urllib.parse
from typing import Any

import msgspec
import pytest
from fakes.simgate import (
    MODEL,
    cached_tokens,
    fleet_config,
    gate,
    indexed,
    long_text,
    predicted,
    sim_fleets,
    until,
    worker_specs,
)

from kvgate.index.types import WorkerId
from kvgate.scheduling.affinity import ClientKeyId, ResponseAffinity

pytestmark = pytest.mark.anyio


def _turn(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": text, "max_output_tokens": 2, **extra}


def _streamed_id(body: bytes) -> str:
    """The response id of a stream (its first event, ``response.created``)."""
    for line in body.split(b"\n"):
        if line.startswith(b"data:"):
            event = msgspec.json.decode(line[5:])
            response_id: str = event["response"]["id"]
            return response_id
    raise AssertionError(f"no event in {body[:200]!r}")


def _streamed_cached(body: bytes) -> int:
    """The cached tokens of a stream's ``response.completed`` event."""
    for line in body.split(b"\n"):
        if line.startswith(b"data:") and b"response.completed" in line:
            usage = msgspec.json.decode(line[5:])["response"]["usage"]
            return int(usage["input_tokens_details"]["cached_tokens"])
    raise AssertionError("no response.completed event")


@pytest.mark.parametrize(
    "body",
    [
        _turn(long_text("plain string"), instructions="You answer in one word."),
        {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": [
                {"type": "message", "role": "user", "content": long_text("items")},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "fine"}],
                },
                {"role": "user", "content": "and then?"},
            ],
            "max_output_tokens": 2,
        },
    ],
    ids=["string", "items"],
)
async def test_responses_are_keyed_as_the_engine_renders_them(body: dict[str, Any]) -> None:
    async with (
        sim_fleets(fleet_config(2)) as (fleet,),
        gate(worker_specs(fleet)) as gw,
    ):
        explained = (await gw.client.post("/debug/route", json=body)).json()
        assert explained["responses_prompt"] == "rendered"
        assert explained["tokenize_mode"] == "tokenizer"
        first = await gw.client.post("/v1/responses", json=body)
        assert first.status_code == 200, first.text
        worker = first.headers["x-kvgate-worker"]
        await indexed(gw, body, worker)
        labels = {"worker": worker, "model": MODEL}
        before = gw.metric("kvgate_engine_cached_tokens_total", labels)
        again = await gw.client.post("/v1/responses", json=body)
        assert again.headers["x-kvgate-worker"] == worker
        assert predicted(again) == cached_tokens(again) > 0
        counted = cached_tokens(again)  # the Responses usage is counted as the engine's

        def engine_cached() -> bool:
            return gw.metric("kvgate_engine_cached_tokens_total", labels) - before == counted

        await until(engine_cached, what="the engine's cached tokens counted")
        streamed = await gw.client.post("/v1/responses", json={**body, "stream": True})
        assert predicted(streamed) == _streamed_cached(streamed.content) > 0
        counted += predicted(streamed)
        await until(engine_cached, what="the streamed answer's cached tokens counted")
        # explained: the prompt tokens kvgate counts are the engine's
        explained = (await gw.client.post("/debug/route", json=body)).json()
        assert explained["prompt_tokens"] == again.json()["usage"]["input_tokens"]


async def test_unrendered_inputs_are_routed_by_load_with_the_reason() -> None:
    body = {
        "model": MODEL,
        "input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "hi"}],
    }
    async with (
        sim_fleets(fleet_config(1)) as (fleet,),
        gate(worker_specs(fleet)) as gw,
    ):
        explained = (await gw.client.post("/debug/route", json=body)).json()
        assert explained["responses_prompt"] == "an input item of type 'reasoning' is not rendered"
        assert explained["request_blocks"] == 0 and explained["chosen"] is not None


async def test_previous_response_id_goes_to_the_worker_that_produced_it() -> None:
    async with (
        sim_fleets(fleet_config(2)) as (fleet,),
        gate(worker_specs(fleet), policy="round_robin") as gw,
    ):
        first = await gw.client.post("/v1/responses", json=_turn("Hello there, who are you?"))
        assert first.status_code == 200, first.text
        holder, previous = first.headers["x-kvgate-worker"], first.json()["id"]
        for i in range(4):  # round robin alone would alternate: every turn stays on its holder
            stream = i % 2 == 1
            turn = _turn(f"turn {i}", previous_response_id=previous, stream=stream)
            reply = await gw.client.post("/v1/responses", json=turn)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvgate-worker"] == holder
            previous = _streamed_id(reply.content) if stream else reply.json()["id"]
        fetched = await gw.client.get(f"/v1/responses/{previous}")  # no model: its holder's
        assert fetched.status_code == 200 and fetched.json()["id"] == previous
        assert fetched.headers["x-kvgate-worker"] == holder
        explained = (
            await gw.client.post("/debug/route", json=_turn("x", previous_response_id=previous))
        ).json()
        assert explained["responses_prompt"].startswith("continues a stored response")
        assert [w["worker"] for w in explained["workers"] if w.get("eligible")] == [holder]


async def test_a_streamed_first_turn_is_remembered_too() -> None:
    async with (
        sim_fleets(fleet_config(2)) as (fleet,),
        gate(worker_specs(fleet), policy="round_robin") as gw,
    ):
        first = await gw.client.post("/v1/responses", json=_turn("Stream me", stream=True))
        assert first.status_code == 200
        holder, previous = first.headers["x-kvgate-worker"], _streamed_id(first.content)
        for i in range(3):
            turn = _turn(f"next {i}", previous_response_id=previous)
            reply = await gw.client.post("/v1/responses", json=turn)
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvgate-worker"] == holder
            previous = reply.json()["id"]


async def test_when_the_holder_is_down_or_gone_the_client_is_told() -> None:
    async with (
        sim_fleets(fleet_config(2)) as (fleet,),
        gate(worker_specs(fleet)) as gw,
    ):
        first = await gw.client.post("/v1/responses", json=_turn("Remember this"))
        holder, previous = first.headers["x-kvgate-worker"], first.json()["id"]
        turn = _turn("and now?", previous_response_id=previous)

        index = [r.url for r in fleet.replicas].index(holder)
        await fleet.replica(index).refuse()
        worker = gw.gateway.registry.get(holder)
        for _ in range(3):  # the failure threshold of active probes
            await gw.gateway.health.probe(worker)
        down = await gw.client.post("/v1/responses", json=turn)
        assert down.status_code == 503 and down.headers["retry-after"] == "1"
        error = down.json()["error"]
        assert error["code"] == "previous_response_worker_unavailable"
        assert error["param"] == "previous_response_id" and holder in error["message"]

        admin = f"/admin/workers/{urllib.parse.quote(holder, safe='')}"
        assert (await gw.client.delete(admin)).status_code == 200
        gone = await gw.client.post("/v1/responses", json=turn)
        assert gone.status_code == 404
        error = gone.json()["error"]
        assert error["code"] == "previous_response_not_found"
        assert error["type"] == "invalid_request_error" and "left the fleet" in error["message"]


ONE = ClientKeyId("-")


def test_the_response_map_is_bounded_in_count_and_age() -> None:
    now = [0.0]
    affinity = ResponseAffinity(3, 10.0, clock=lambda: now[0])
    for i in range(5):
        affinity.record(f"resp_{i}", WorkerId(f"w{i}"), ONE)
    assert len(affinity) == 3 and affinity.worker_of("resp_1", ONE) is None
    assert affinity.worker_of("resp_4", ONE) == "w4"
    affinity.record("x" * 300, WorkerId("w"), ONE)  # not an id we keep
    assert len(affinity) == 3
    now[0] = 10.0
    assert affinity.worker_of("resp_4", ONE) is None  # too old
    affinity.record("resp_new", WorkerId("w9"), ONE)
    assert len(affinity) == 1


def test_ids_stay_with_their_key_and_each_key_keeps_its_share() -> None:
    mine, theirs = ClientKeyId("aaaa0000"), ClientKeyId("bbbb1111")
    affinity = ResponseAffinity(5, 60.0, keys=2)
    assert affinity.per_key == 3
    affinity.record("resp_a", WorkerId("w1"), mine)
    affinity.record("resp_a", WorkerId("w2"), theirs)  # an engine echoing a known id
    assert affinity.worker_of("resp_a", mine) == "w1"
    assert affinity.worker_of("resp_a", theirs) is None
    assert affinity.worker_of("resp_a", None) == "w1"  # the admin's view
    for i in range(10):
        affinity.record(f"resp_b{i}", WorkerId("w2"), theirs)
    assert affinity.worker_of("resp_a", mine) == "w1"  # not evicted by the other key
    assert [affinity.worker_of(f"resp_b{i}", theirs) for i in (6, 7, 8, 9)] == [None] + ["w2"] * 3
    assert len(affinity) == 4


@pytest.mark.parametrize(
    "chunks",
    [
        [b'{"id": "resp_a", "object": "response", "output": []}'],
        [
            b'event: response.created\ndata: {"type": "response.created", ',
            b'"response": {"id": "resp_a", "object": "response"}}\n\nevent: more\ndata: {}\n\n',
        ],
    ],
    ids=["body", "split-stream"],
)
def test_the_tap_reads_the_id_from_a_body_or_the_first_event(chunks: list[bytes]) -> None:
    affinity = ResponseAffinity(10, 10.0)
    tap = affinity.tap(ONE)
    done = [tap.feed(WorkerId("w"), chunk) for chunk in chunks]
    assert done[-1] and not any(done[:-1])
    assert affinity.worker_of("resp_a", ONE) == "w"


def test_the_tap_gives_up_on_a_stream_it_does_not_know() -> None:
    affinity = ResponseAffinity(10, 10.0)
    tap = affinity.tap(ONE)
    assert not tap.feed(WorkerId("w"), b"x" * 1000)
    assert tap.feed(WorkerId("w"), b"x" * 70_000)  # past the scan bound, no event end
    assert len(affinity) == 0
