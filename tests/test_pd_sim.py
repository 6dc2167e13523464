"""Prefill/decode disaggregation end to end: kvgate (real uvicorn) in front of simulated
vLLM replicas with roles (real HTTP, real ZMQ KV events, the simulator's transfer protocol:
a decode replica pulls a prefill's blocks over HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fakes.gateway import Kvgate
from fakes.otlp import ERROR, SERVER, OtlpReceiver
from fakes.server import serve
from fakes.simgate import (
    MODEL,
    cached_tokens,
    chat,
    fleet_config,
    gate,
    long_text,
    predicted,
    replica_counter,
    sim_fleets,
    until,
)

from kvgate.backends.sim.fleet import SimFleet

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def pd_gate(*roles: str, **overrides: Any) -> AsyncIterator[tuple[Kvgate, SimFleet]]:
    """kvgate over one simulated replica per role in ``roles``."""
    async with sim_fleets(fleet_config(len(roles))) as (fleet,):
        workers = [
            f"{r.url},events={r.events},replay={r.replay},role={role}"
            for r, role in zip(fleet.replicas, roles, strict=True)
        ]
        async with gate(workers, **overrides) as gw:
            yield gw, fleet


async def warm(gw: Kvgate, url: str, body: dict[str, Any]) -> int:
    """``body`` sent straight to the replica at ``url``; its prefix indexed there."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        reply = await client.post(f"{url}/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
    return await overlap(gw, body, url)


async def overlap(gw: Kvgate, body: dict[str, Any], url: str) -> int:
    """The overlap kvgate predicts for ``body`` on ``url`` (either leg's ranking) once its
    events are indexed."""
    found = 0

    async def some() -> bool:
        nonlocal found
        explained = (await gw.client.post("/debug/route", json=body)).json()
        rankings = [explained, (explained.get("disaggregated") or {}).get("prefill") or {}]
        entries = [w for r in rankings for w in r.get("workers", []) if w["worker"] == url]
        found = max((int(w.get("overlap_tokens", 0)) for w in entries), default=0)
        return found > 0

    await until(some, what=f"blocks of the prompt indexed for {url}")
    return found


def legs(gw: Kvgate, leg: str, outcome: str) -> float:
    return gw.metric("kvgate_pd_legs_total", {"leg": leg, "outcome": outcome})


async def test_prefill_leg_sends_the_prompt_to_the_decode_worker() -> None:
    """The prefill worker holds the prompt: the prefill leg runs there, the decode worker
    receives the blocks, reports them cached as kvgate predicted, and publishes them."""
    async with pd_gate("prefill", "decode") as (gw, fleet):
        p_url, d_url = (r.url for r in fleet.replicas)
        body = chat(MODEL, long_text("transfer", 900), max_tokens=3)
        await warm(gw, p_url, body)
        explained = (await gw.client.post("/debug/route", json=body)).json()
        plan = explained["disaggregated"]["plan"]
        assert (plan["decode_worker"], plan["prefill_worker"]) == (d_url, p_url)
        assert plan["skipped"] is False and plan["local_cost"] > plan["remote_cost"]
        assert explained["leg"] == "decode"
        assert {w["worker"]: w["role"] for w in explained["workers"]} == {
            p_url: "prefill",
            d_url: "decode",
        }
        reply = await gw.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kvgate-worker"] == d_url
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert "kv_transfer_params" not in reply.json()
        cached = cached_tokens(reply)
        assert cached > 0 and cached == predicted(reply) == plan["predicted_decode_cached_tokens"]
        assert legs(gw, "prefill", "ok") == 1 and legs(gw, "decode", "ok") == 1
        assert gw.metric("kvgate_pd_transferred_tokens_total") == cached
        on_p = {"worker": p_url}
        prefill_cached = gw.metric("kvgate_pd_prefill_engine_cached_tokens_total", on_p)
        assert prefill_cached > 0
        assert prefill_cached == gw.metric("kvgate_pd_prefill_predicted_cached_tokens_total", on_p)
        assert await overlap(gw, body, d_url) == cached  # the received blocks' events
        assert fleet.replica(1).engine.cache.gpu_cached > 0
        # the decode replica counts them as vLLM does: brought by a transfer, used
        by_source = "vllm:prompt_tokens_by_source"
        assert await replica_counter(d_url, by_source, source="external_kv_transfer") == cached
        assert await replica_counter(d_url, "kvgate_sim_kv_transfers", outcome="used") == 1
        assert await replica_counter(d_url, "kvgate_sim_kv_transfer_tokens") == cached
        prompt = reply.json()["usage"]["prompt_tokens"]
        assert await replica_counter(p_url, "kvgate_sim_prefill_leg_prompt_tokens") == prompt
        assert await replica_counter(d_url, "kvgate_sim_prefill_leg_prompt_tokens") == 0


async def test_streamed_answer_comes_from_the_decode_worker() -> None:
    async with pd_gate("prefill", "decode") as (gw, fleet):
        p_url, d_url = (r.url for r in fleet.replicas)
        body = chat(MODEL, long_text("stream", 900), max_tokens=4)
        await warm(gw, p_url, body)
        async with gw.client.stream(
            "POST", "/v1/chat/completions", json=body | {"stream": True}
        ) as reply:
            assert reply.status_code == 200
            assert reply.headers["x-kvgate-worker"] == d_url
            text = (await reply.aread()).decode()
        events = [line for line in text.splitlines() if line.startswith("data: {")]
        assert len(events) >= 4 and text.rstrip().endswith("data: [DONE]")
        assert '"usage"' not in text  # kvgate asked for usage, and hid it
        assert legs(gw, "prefill", "ok") == 1
        assert gw.metric("kvgate_engine_cached_tokens_total", {"worker": d_url, "model": MODEL}) > 0


async def test_an_idle_decode_worker_prefills_a_cold_prompt_itself() -> None:
    """Nothing cached anywhere, nothing running on the decode worker: a transfer costs more
    than prefilling there, so the prefill leg is skipped."""
    async with pd_gate("prefill", "decode") as (gw, fleet):
        d_url = fleet.replicas[1].url
        body = chat(MODEL, long_text("cold"))
        explained = (await gw.client.post("/debug/route", json=body)).json()
        plan = explained["disaggregated"]["plan"]
        assert plan["skipped"] is True and plan["local_cost"] <= plan["remote_cost"]
        assert "local prefill" in plan["reason"]
        reply = await gw.client.post("/v1/chat/completions", json=body)
        assert reply.headers["x-kvgate-worker"] == d_url
        assert cached_tokens(reply) == predicted(reply) == 0
        assert legs(gw, "prefill", "skipped") == 1 and legs(gw, "prefill", "ok") == 0
        assert gw.metric("kvgate_pd_transferred_tokens_total") == 0


async def test_a_failed_prefill_leg_is_retried_on_another_prefill_worker() -> None:
    async with pd_gate("prefill", "prefill", "decode") as (gw, fleet):
        p0, p1, d_url = (r.url for r in fleet.replicas)
        body = chat(MODEL, long_text("retry", 900))
        await warm(gw, p0, body)
        await warm(gw, p1, body)
        explained = (await gw.client.post("/debug/route", json=body)).json()
        first = explained["disaggregated"]["plan"]["prefill_worker"]
        other = p1 if first == p0 else p0
        async with httpx.AsyncClient(timeout=10.0) as client:
            fault = {"kind": "fail", "count": 1, "status": 503}
            assert (await client.post(f"{first}/sim/fault", json=fault)).status_code == 200
        reply = await gw.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kvgate-worker"] == d_url
        assert legs(gw, "prefill", "failed") == 1 and legs(gw, "prefill", "ok") == 1
        answered = "kvgate_pd_prefill_engine_cached_tokens_total"
        assert gw.metric(answered, {"worker": other}) > 0  # the retry's prefill worker
        assert gw.metric(answered, {"worker": first}) == 0
        assert cached_tokens(reply) == predicted(reply) > 0


async def test_every_prefill_worker_failing_leaves_the_prefill_to_the_decode_worker() -> None:
    async with pd_gate("prefill", "decode") as (gw, fleet):
        p_url, d_url = (r.url for r in fleet.replicas)
        body = chat(MODEL, long_text("fallback", 900))
        await warm(gw, p_url, body)
        async with httpx.AsyncClient(timeout=10.0) as client:
            fault = {"kind": "fail", "count": 1, "status": 503}
            assert (await client.post(f"{p_url}/sim/fault", json=fault)).status_code == 200
        reply = await gw.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kvgate-worker"] == d_url
        assert cached_tokens(reply) == predicted(reply) == 0
        assert legs(gw, "prefill", "failed") == 1 and legs(gw, "decode", "ok") == 1


async def test_a_clients_transfer_params_never_reach_an_engine() -> None:
    """A client's ``kv_transfer_params`` or ``bootstrap_*`` fields would make the replica
    fetch KV from a host the client names; kvgate drops them (aggregated fleet and
    disaggregated alike)."""
    hostile = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 5}
    cases = [(("both",), {"kv_transfer_params": hostile}), (("prefill", "decode"), room)]
    for roles, fields in cases:
        async with pd_gate(*roles) as (gw, fleet):
            body = chat(MODEL, long_text("hostile")) | fields
            async with httpx.AsyncClient(timeout=10.0) as client:  # the engine would refuse
                direct = await client.post(
                    f"{fleet.replicas[-1].url}/v1/chat/completions", json=body
                )
            assert direct.status_code == 400
            reply = await gw.client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text


async def test_roles_are_shown_to_the_operator() -> None:
    async with pd_gate("prefill", "decode", "both") as (gw, fleet):
        urls = [r.url for r in fleet.replicas]
        listed = (await gw.client.get("/admin/workers")).json()["workers"]
        assert {w["url"]: w["role"] for w in listed} == dict(
            zip(urls, ("prefill", "decode", "both"), strict=True)
        )
        for url, role in zip(urls, ("prefill", "decode", "both"), strict=True):
            assert gw.metric("kvgate_worker_role", {"worker": url, "role": role}) == 1
        await until(lambda: True)


async def test_a_failed_decode_leg_reruns_the_prefill_leg_for_the_next_decode_worker() -> None:
    async with pd_gate("prefill", "decode", "decode") as (gw, fleet):
        p_url = fleet.replicas[0].url
        body = chat(MODEL, long_text("decode-retry", 900))
        await warm(gw, p_url, body)
        explained = (await gw.client.post("/debug/route", json=body)).json()
        first = explained["disaggregated"]["plan"]["decode_worker"]
        async with httpx.AsyncClient(timeout=10.0) as client:
            fault = {"kind": "fail", "count": 1, "status": 503}
            assert (await client.post(f"{first}/sim/fault", json=fault)).status_code == 200
        reply = await gw.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kvgate-worker"] not in (first, p_url)
        assert legs(gw, "prefill", "ok") == 2  # once for each decode worker tried
        assert cached_tokens(reply) == predicted(reply) > 0


async def test_a_client_leaving_during_the_prefill_leg_cancels_it() -> None:
    async with pd_gate("prefill", "decode") as (gw, fleet):
        p_url = fleet.replicas[0].url
        body = chat(MODEL, long_text("leave", 900))
        await warm(gw, p_url, body)
        prefill = fleet.replica(0).engine
        async with httpx.AsyncClient(timeout=10.0) as client:
            pause = {"kind": "pause"}
            assert (await client.post(f"{p_url}/sim/fault", json=pause)).status_code == 200
            request = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=body))
            await until(lambda: len(prefill.waiting) == 1, what="the prefill leg queued")
            request.cancel()  # the client leaves
            await until(lambda: not prefill.waiting, what="the prefill leg cancelled")
            clear = {"kind": "clear", "fault": "pause"}
            assert (await client.post(f"{p_url}/sim/fault", json=clear)).status_code == 200
        await until(lambda: legs(gw, "decode", "failed") == 1, what="the exchange recorded")
        assert legs(gw, "prefill", "ok") == 0
        assert fleet.replica(1).engine.cache.gpu_cached == 0  # the decode leg never ran
        for replica in fleet.replicas:  # both legs' tickets released
            assert gw.metric("kvgate_worker_in_flight", {"worker": replica.url}) == 0


@asynccontextmanager
async def bootstrap_gate() -> AsyncIterator[tuple[Kvgate, SimFleet]]:
    """A prefill replica speaking SGLang's bootstrap protocol (its bootstrap server: its
    HTTP port, as the simulator serves it) and a decode replica."""
    async with sim_fleets(fleet_config(2)) as (fleet,):
        p, d = fleet.replicas
        port = p.url.rsplit(":", 1)[1]
        workers = [
            f"{p.url},events={p.events},replay={p.replay},role=prefill,bootstrap_port={port}",
            f"{d.url},events={d.events},replay={d.replay},role=decode",
        ]
        async with gate(workers) as gw:
            yield gw, fleet


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_bootstrap_legs_are_sent_together(stream: bool) -> None:
    """Both legs carry the prefill worker's bootstrap address and one room; the decode
    replica waits for that room's prefill and reports its blocks cached."""
    async with bootstrap_gate() as (gw, fleet):
        p_url, d_url = (r.url for r in fleet.replicas)
        body = chat(MODEL, long_text(f"bootstrap {stream}", 900), max_tokens=3)
        await warm(gw, p_url, body)
        plan = (await gw.client.post("/debug/route", json=body)).json()["disaggregated"]["plan"]
        assert plan["prefill_worker"] == p_url and not plan["skipped"]
        generated = await replica_counter(p_url, "vllm:generation_tokens")  # warm's 3
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        reply = await gw.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kvgate-worker"] == d_url
        if stream:
            usage = [line for line in reply.text.splitlines() if '"usage"' in line][-1]
            cached = int(usage.split('"cached_tokens":')[1].split("}")[0].split(",")[0])
        else:
            cached = cached_tokens(reply)
        assert cached == predicted(reply) == plan["predicted_decode_cached_tokens"] > 0
        await until(lambda: legs(gw, "prefill", "ok") == 1, what="the prefill answer read")
        assert not fleet.replica(0).leases._rooms  # the decode leg took its room
        # SGLang's prefill server generates the first token only, whatever max_tokens says
        assert await replica_counter(p_url, "vllm:generation_tokens") == generated + 1


async def test_a_decode_replica_refuses_a_transfer_it_cannot_find() -> None:
    async with sim_fleets(fleet_config(2)) as (fleet,), httpx.AsyncClient(timeout=10) as client:
        p, d = fleet.replicas
        body = chat(MODEL, long_text("missing", 300))
        ask = body | {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
        params = (await client.post(f"{p.url}/v1/chat/completions", json=ask)).json()[
            "kv_transfer_params"
        ]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"][0]
        url = f"{d.url}/v1/chat/completions"
        for wrong in (
            params | {"remote_engine_id": "restarted"},
            params | {"remote_block_ids": [[10**6]]},
            params | {"remote_port": 1},
        ):
            refused = await client.post(url, json=body | {"kv_transfer_params": wrong})
            assert refused.status_code == 400
            assert refused.json()["error"]["type"] == "BadRequestError"
        other = chat(MODEL, long_text("another prompt", 300))
        refused = await client.post(url, json=other | {"kv_transfer_params": params})
        assert refused.status_code == 400  # the lease was for another prompt (and is gone)
        ask = body | {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
        params = (await client.post(f"{p.url}/v1/chat/completions", json=ask)).json()[
            "kv_transfer_params"
        ]
        served = await client.post(url, json=body | {"kv_transfer_params": params})
        assert cached_tokens(served) > 0
        again = await client.post(url, json=chat(MODEL, "x") | {"kv_transfer_params": params})
        assert again.status_code == 400  # a lease is taken once


async def test_streamed_bootstrap_legs_as_smg_sends_them() -> None:
    """smg sends SGLang's two legs at once, each as the client asked (here streamed): the
    streamed prefill leg still hands its room to the decode leg, which reports the blocks
    cached and counts them as transferred."""
    async with sim_fleets(fleet_config(2)) as (fleet,), httpx.AsyncClient(timeout=10) as client:
        p, d = fleet.replicas
        port = int(p.url.rsplit(":", 1)[1])
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 7}
        body = chat(MODEL, long_text("streamed legs", 300), max_tokens=4) | room | {
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        prefill, decode = await asyncio.gather(
            client.post(f"{p.url}/v1/chat/completions", json=body),
            client.post(f"{d.url}/v1/chat/completions", json=body),
        )
        assert prefill.status_code == decode.status_code == 200
        usage = [line for line in decode.text.splitlines() if '"usage"' in line][-1]
        cached = int(usage.split('"cached_tokens":')[1].split("}")[0].split(",")[0])
        assert cached > 0
        transferred = await replica_counter(d.url, "kvgate_sim_kv_transfer_tokens")
        assert transferred == cached


async def test_a_decode_leg_given_its_kv_counts_only_its_tail_as_pending_prefill() -> None:
    async with pd_gate("prefill", "decode") as (gw, fleet):
        p_url, d_url = (r.url for r in fleet.replicas)
        body = chat(MODEL, long_text("pending", 900))
        await warm(gw, p_url, body)
        plan = (await gw.client.post("/debug/route", json=body)).json()["disaggregated"]["plan"]
        prompt = (await gw.client.post("/debug/route", json=body)).json()["prompt_tokens"]
        decode = fleet.replica(1).engine
        async with httpx.AsyncClient(timeout=10.0) as client:
            pause = {"kind": "pause"}
            assert (await client.post(f"{d_url}/sim/fault", json=pause)).status_code == 200
            request = asyncio.ensure_future(gw.client.post("/v1/chat/completions", json=body))
            await until(lambda: len(decode.waiting) == 1, what="the decode leg queued")
            pending = gw.metric("kvgate_worker_pending_prefill_tokens", {"worker": d_url})
            assert pending == prompt - plan["predicted_decode_cached_tokens"] < 16
            clear = {"kind": "clear", "fault": "pause"}
            assert (await client.post(f"{d_url}/sim/fault", json=clear)).status_code == 200
            assert (await request).status_code == 200


async def test_the_trace_shows_the_prefill_leg_beside_the_decode_attempt() -> None:
    sink = OtlpReceiver()
    async with serve(sink) as collector:
        endpoint = f"{collector.url}/v1/traces"
        async with pd_gate("prefill", "decode", otlp_traces_endpoint=endpoint) as (gw, fleet):
            p_url, d_url = (r.url for r in fleet.replicas)
            body = chat(MODEL, long_text("traced", 900))
            await warm(gw, p_url, body)
            reply = await gw.client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200
            tracing = gw.gateway.observer.tracing
            assert tracing is not None
            assert await asyncio.to_thread(tracing.force_flush, 10.0)
        await until(lambda: any(s.name == "prefill leg" for s in sink.spans), what="the spans")
    root = next(s for s in sink.spans if s.kind == SERVER)
    children = sink.children(root)
    leg = next(s for s in children if s.name == "prefill leg")
    upstream = next(s for s in children if s.name == "upstream")
    assert (leg.attributes["kvgate.worker"], upstream.attributes["kvgate.worker"]) == (p_url, d_url)
    assert leg.status != ERROR and leg.end_ns <= upstream.start_ns


async def test_a_request_a_prefill_worker_refuses_is_not_retried() -> None:
    async with pd_gate("prefill", "prefill", "decode") as (gw, fleet):
        body = chat(MODEL, long_text("too long", 900), n=2)  # the simulator serves n=1 only
        for url in (r.url for r in fleet.replicas[:2]):
            await warm(gw, url, chat(MODEL, long_text("too long", 900)))
        reply = await gw.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400
        assert reply.json()["error"]["type"] == "BadRequestError"  # the decode worker's
        assert legs(gw, "prefill", "failed") == 1 and legs(gw, "prefill", "ok") == 0
