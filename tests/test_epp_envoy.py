"""A real Envoy (deploy/envoy/envoy.yaml) asking ``kvgate epp`` over ext_proc, in front of
simulated replicas (real HTTP, real KV events): where each request lands, what kvgate
predicted against what the engine reports, fallbacks past a dead replica, refusals, and the
load accounting when a client goes away."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.epp import envoy_stack, openai_error
from fakes.gateway import quiet_health
from fakes.simgate import MODEL, fleet_config, indexed, long_text, sim_fleets, until
from openai import AsyncOpenAI

from kvgate.backends.sim.config import SimConfig, TimingConfig

pytestmark = pytest.mark.anyio


def turn(history: list[dict[str, str]], text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [*history, {"role": "user", "content": text}], **extra}


def slow(replicas: int) -> SimConfig:
    """Replicas at the simulated engine's own speed (an answer of 400 tokens takes seconds)."""
    return replace(fleet_config(replicas), timing=TimingConfig(speedup=1.0))


async def test_a_conversation_through_envoy_stays_on_its_prefix_and_predictions_are_exact(
    tmp_path: Path,
) -> None:
    async with sim_fleets(fleet_config(4)) as (fleet,), envoy_stack(fleet, tmp_path) as stack:
        history = [{"role": "system", "content": long_text("system", 60)}]
        served: list[str] = []
        for number in range(5):
            body = turn(history, long_text(f"turn {number}", 40), max_tokens=8)
            if served:  # the previous turn's blocks are in kvgate's index (events applied)
                await indexed(stack.epp, body, served[0])
            reply = await stack.client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            worker = reply.headers["x-kvgate-worker"]
            usage = reply.json()["usage"]
            engine_cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert int(reply.headers["x-kvgate-predicted-cached-tokens"]) == engine_cached
            if served:
                assert worker == served[0]
                assert engine_cached > 0
            served.append(worker)
            answer = reply.json()["choices"][0]["message"]["content"]
            history += [body["messages"][-1], {"role": "assistant", "content": answer}]
        epp = stack.epp
        placed = {"outcome": "placed"}
        await until(lambda: epp.metric("kvgate_epp_streams_total", placed) == 5)  # all ended
        assert epp.idle()  # kvgate's load accounting released
        labels = {"model": MODEL, "worker": served[0]}
        predicted = epp.metric("kvgate_predicted_cached_tokens_total", labels)
        assert predicted > 0
        assert predicted == epp.metric("kvgate_engine_cached_tokens_total", labels)


async def test_streamed_turns_through_the_sdk_keep_the_cache_and_hide_kvgates_usage_request(
    tmp_path: Path,
) -> None:
    """The README's SDK loop pointed at Envoy: cached tokens grow turn after turn; a stream
    kvgate asked usage for (the client did not) carries no usage chunk to the client."""
    async with sim_fleets(fleet_config(3)) as (fleet,), envoy_stack(fleet, tmp_path) as stack:
        client = AsyncOpenAI(base_url=f"{stack.envoy.url}/v1", api_key="unused", max_retries=0)
        history = [{"role": "system", "content": "you are a helpful assistant"}]
        cached, workers = [], set()
        for text in ["hello there " * 20, "tell me more " * 20, "and then what " * 20]:
            history.append({"role": "user", "content": text})
            if workers:  # the previous answer's blocks are indexed before the next turn
                await indexed(stack.epp, {"model": MODEL, "messages": history}, min(workers))
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=history
            )
            workers.add(raw.headers["x-kvgate-worker"])
            reply = raw.parse()
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
            assert int(raw.headers["x-kvgate-predicted-cached-tokens"]) == cached[-1]
            history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        assert len(workers) == 1
        assert cached[0] == 0 and 0 < cached[1] < cached[2]
        stream = await client.chat.completions.create(
            model=MODEL, messages=history, stream=True, max_tokens=4
        )
        chunks = [chunk async for chunk in stream]
        assert chunks and all(chunk.usage is None for chunk in chunks)
        labels = {"model": MODEL, "worker": min(workers)}
        engine = "kvgate_engine_cached_tokens_total"
        await until(lambda: stack.epp.metric(engine, labels) > sum(cached))  # the stream's too
        assert stack.epp.metric("kvgate_predicted_cached_tokens_total", labels) == stack.epp.metric(
            engine, labels
        )
        await client.close()


async def test_a_killed_replica_is_skipped_through_the_fallback_list(tmp_path: Path) -> None:
    async with sim_fleets(fleet_config(3)) as (fleet,), envoy_stack(fleet, tmp_path) as stack:
        histories = []
        first_workers = []
        for number in range(6):  # conversations spread over the replicas
            body = turn([], long_text(f"conversation {number}", 80), max_tokens=4)
            reply = await stack.client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            first_workers.append(reply.headers["x-kvgate-worker"])
            histories.append(body["messages"])
        victim = first_workers[0]
        await fleet.replica(stack.urls.index(victim)).crash(downtime_s=3600)
        for number, history in enumerate(histories):  # their second turns, streamed
            body = turn(history, f"go on {number}", max_tokens=4, stream=True)
            async with stack.client.stream("POST", "/v1/chat/completions", json=body) as reply:
                assert reply.status_code == 200
                text = (await reply.aread()).decode()
            assert '"content"' in text and "data: [DONE]" in text and '"error"' not in text
            assert reply.headers["x-kvgate-worker"] != victim
        retried = stack.envoy.stats("cluster.pool.upstream_rq_retry")
        assert retried["cluster.pool.upstream_rq_retry"] >= 1
        fallbacks = stack.epp.metric(
            "kvgate_upstream_retries_total", {"worker": victim, "reason": "fallback"}
        )
        assert fallbacks >= 1
        await until(stack.epp.idle, what="kvgate's load accounting released")


async def test_refusals_reach_the_client_as_openai_errors(tmp_path: Path) -> None:
    queue = {"max_in_flight_per_key": 1, "max_queued_per_key": 0}
    health = quiet_health(failure_threshold=1)
    async with (
        sim_fleets(slow(2)) as (fleet,),
        envoy_stack(fleet, tmp_path, queue=queue, health=health) as stack,
    ):
        unknown = await stack.client.post("/v1/chat/completions", json=turn([], "hi", model="nope"))
        assert unknown.status_code == 404 and openai_error(unknown)["code"] == "model_not_found"
        bad = await stack.client.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert bad.status_code == 400 and openai_error(bad)["type"] == "invalid_request_error"
        long = turn([], "write a long story", max_tokens=400, stream=True)
        async with stack.client.stream("POST", "/v1/chat/completions", json=long) as held:
            assert held.status_code == 200
            chunks = held.aiter_bytes()  # (kept: a dropped iterator closes the stream)
            await anext(chunks)  # it runs: the key's one request in flight
            shed = await stack.client.post("/v1/chat/completions", json=turn([], "me too"))
            assert shed.status_code == 429
            assert openai_error(shed)["code"] == "key_queue_full"
            assert shed.headers["retry-after"] == "1"
        await until(stack.epp.idle, what="the held request released")
        for replica in range(2):
            await fleet.replica(replica).crash(downtime_s=3600)
        await stack.epp.gateway.health.probe_all()  # kvgate finds every replica down
        none = await stack.client.post("/v1/chat/completions", json=turn([], "anyone?"))
        assert none.status_code == 503
        assert openai_error(none)["code"] == "no_healthy_worker"
        assert "retry-after" in none.headers
        refused = {"outcome": "refused"}  # counted as each stream ends, after its answer
        await until(lambda: stack.epp.metric("kvgate_epp_streams_total", refused) == 4)


async def test_a_client_leaving_releases_kvgates_load_accounting(tmp_path: Path) -> None:
    async with sim_fleets(slow(2)) as (fleet,), envoy_stack(fleet, tmp_path) as stack:
        body = turn([], long_text("a long answer", 60), max_tokens=2000, stream=True)
        async with (
            httpx.AsyncClient(base_url=stack.envoy.url, timeout=30.0) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as reply,
        ):
            assert reply.status_code == 200
            chunks = reply.aiter_bytes()
            await anext(chunks)
            assert stack.epp.in_flight() == 1
            worker = stack.epp.gateway.registry.get(reply.headers["x-kvgate-worker"])
            assert stack.epp.gateway.scheduler.ledger.of(worker).active_decode_blocks > 0
        # the client closed its connection mid-answer: Envoy ends the ext_proc stream
        await until(stack.epp.idle, what="the load of the abandoned request released")
        labels = {"worker": worker.url, "model": MODEL, "status": "499"}
        await until(lambda: stack.epp.metric("kvgate_requests_total", labels) == 1)


async def test_models_are_listed_by_kvgate_through_envoy(tmp_path: Path) -> None:
    async with sim_fleets(fleet_config(2)) as (fleet,), envoy_stack(fleet, tmp_path) as stack:
        listed = await stack.client.get("/v1/models")
        assert listed.status_code == 200
        assert [card["id"] for card in listed.json()["data"]] == [MODEL]
        one = await stack.client.get(f"/v1/models/{MODEL}")
        assert one.status_code == 200 and one.json()["id"] == MODEL


async def test_a_queued_request_holds_its_stream_open_until_dispatched(tmp_path: Path) -> None:
    queue = {"max_in_flight_per_key": 1}
    async with (
        sim_fleets(slow(2)) as (fleet,),
        envoy_stack(fleet, tmp_path, queue=queue) as stack,
    ):
        first = turn([], "a story of some length", max_tokens=200, stream=True)
        async with stack.client.stream("POST", "/v1/chat/completions", json=first) as held:
            chunks = held.aiter_bytes()
            await anext(chunks)
            waiting = asyncio.create_task(
                stack.client.post("/v1/chat/completions", json=turn([], "after you"))
            )
            admission = stack.epp.gateway.scheduler.queue
            await until(lambda: len(admission) == 1, what="the second request queued")
            assert not waiting.done()
            async for _ in chunks:  # the first answer ends: its share of the key goes back
                pass
        second = await waiting
        assert second.status_code == 200, second.text
        labels = {"key": "-"}
        await until(lambda: stack.epp.metric("kvgate_queue_wait_seconds_count", labels) == 1)
        await until(stack.epp.idle, what="both requests released")


# -- answers kvgate does not read (deploy/envoy/envoy.yaml allows mode overrides) -----------


def ext_proc_messages(stack: Any) -> int:
    """Messages Envoy's ext_proc filter sent kvgate so far."""
    sent = stack.envoy.stats("http.inference.ext_proc.stream_msgs_sent")
    return int(sent.get("http.inference.ext_proc.stream_msgs_sent", 0))


async def test_an_answer_kvgate_skips_reaches_the_client_whole_and_its_end_releases_the_load(
    tmp_path: Path,
) -> None:
    """Not sampled: Envoy sends kvgate the request's head and body and the answer's head,
    then nothing more; the answer reaches the client untouched; the ext_proc stream's close
    at the request's end releases kvgate's load accounting."""
    async with (
        sim_fleets(fleet_config(2)) as (fleet,),
        envoy_stack(fleet, tmp_path, answer_sample=1_000_000) as stack,
    ):
        whole = await stack.client.post(
            "/v1/chat/completions", json=turn([], long_text("whole", 30), max_tokens=8)
        )
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"]["completion_tokens"] == 8
        assert whole.headers["x-kvgate-worker"] in stack.urls
        body = turn([], long_text("streamed", 30), max_tokens=8, stream=True)
        async with stack.client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            text = (await reply.aread()).decode()
        assert text.count('"content"') >= 8 and text.rstrip().endswith("data: [DONE]")
        assert '"usage"' not in text  # kvgate asked for none: it would not see it
        # request headers, request body, response headers: 3 messages a request, no more
        assert ext_proc_messages(stack) == 6
        await until(stack.epp.idle, what="both requests released at their ends")
        epp = stack.epp
        await until(lambda: epp.metric("kvgate_epp_streams_total", {"outcome": "placed"}) == 2)
        for url in stack.urls:  # nothing measured, so nothing predicted against it
            labels = {"model": MODEL, "worker": url}
            assert epp.metric("kvgate_predicted_cached_tokens_total", labels) == 0
        answered = sum(
            epp.metric("kvgate_requests_total", {"worker": u, "model": MODEL, "status": "200"})
            for u in stack.urls
        )
        assert answered == 2


async def test_a_skipped_answer_holds_its_load_until_the_client_leaves(tmp_path: Path) -> None:
    async with (
        sim_fleets(slow(2)) as (fleet,),
        envoy_stack(fleet, tmp_path, answer_sample=1_000_000) as stack,
    ):
        body = turn([], long_text("a long answer", 60), max_tokens=2000, stream=True)
        async with (
            httpx.AsyncClient(base_url=stack.envoy.url, timeout=30.0) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as reply,
        ):
            assert reply.status_code == 200
            chunks = reply.aiter_bytes()
            await anext(chunks)
            await anext(chunks)  # the answer streams past kvgate: its load stays counted
            assert stack.epp.in_flight() == 1
            assert ext_proc_messages(stack) == 3
        # the client closed its connection mid-answer: Envoy ends the ext_proc stream
        await until(stack.epp.idle, what="the load of the abandoned request released")


async def test_one_answer_in_n_is_read_and_its_cached_tokens_measured(tmp_path: Path) -> None:
    async with (
        sim_fleets(fleet_config(3)) as (fleet,),
        envoy_stack(fleet, tmp_path, answer_sample=2) as stack,
    ):
        history = [{"role": "system", "content": long_text("system", 60)}]
        served: list[str] = []
        engine_cached: list[int] = []
        for number in range(4):
            body = turn(history, long_text(f"turn {number}", 40), max_tokens=8)
            if served:
                await indexed(stack.epp, body, served[0])
            reply = await stack.client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            served.append(reply.headers["x-kvgate-worker"])
            engine_cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            answer = reply.json()["choices"][0]["message"]["content"]
            history += [body["messages"][-1], {"role": "assistant", "content": answer}]
        assert set(served) == {served[0]}
        await until(stack.epp.idle, what="every request released")
        labels = {"model": MODEL, "worker": served[0]}
        read = engine_cached[1] + engine_cached[3]  # the 2nd and 4th answers were read
        assert read > 0
        assert stack.epp.metric("kvgate_engine_cached_tokens_total", labels) == read
        assert stack.epp.metric("kvgate_predicted_cached_tokens_total", labels) == read
