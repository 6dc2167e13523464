"""LoRA adapters (issue 17, part 1): a request naming an adapter is keyed with its base model's
tokenizer and block size in the adapter's own cache domain (the engine puts the adapter's
name in every block hash), so it gets credit only for the adapter's blocks and base-model
requests never for them; it goes only to workers that list the adapter.

Real uvicorn kvgate, simulated vLLM replicas publishing adapter blocks as vLLM does
(lora_id, lora_name, extra_keys); kvgate's predictions are checked against the cached
tokens the engine reports."""

from __future__ import annotations

import httpx
import pytest
from fakes.simgate import (
    MODEL,
    cached_tokens,
    chat,
    fleet_config,
    gate,
    indexed,
    long_text,
    predicted,
    sim_fleets,
    worker_specs,
)

pytestmark = pytest.mark.anyio


async def _load_adapter(url: str, name: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        reply = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/adapters/{name}"}
        )
        assert reply.status_code == 200, reply.text


async def test_adapter_requests_are_keyed_in_the_adapters_domain() -> None:
    async with (
        sim_fleets(fleet_config(2, lora=["sql"])) as (fleet,),
        gate(worker_specs(fleet)) as gw,
    ):
        c = gw.client
        base = chat(MODEL, long_text("shared prompt"))
        first = await c.post("/v1/chat/completions", json=base)
        base_worker = first.headers["x-kvgate-worker"]
        await indexed(gw, base, base_worker)

        # The same prompt for the adapter: the base model's blocks are no credit.
        sql = {**base, "model": "sql"}
        explained = (await c.post("/debug/route", json=sql)).json()
        assert explained["cache_domain"] == {"base_model": MODEL, "adapter": "sql"}
        assert explained["tokenize_mode"] == "tokenizer"  # the base model's tokenizer
        assert all(w.get("overlap_tokens", 0) == 0 for w in explained["workers"])
        cold = await c.post("/v1/chat/completions", json=sql)
        assert predicted(cold) == cached_tokens(cold) == 0

        # Its own blocks are: predicted exactly as the engine reports them.
        sql_worker = cold.headers["x-kvgate-worker"]
        await indexed(gw, sql, sql_worker)
        warm = await c.post("/v1/chat/completions", json=sql)
        assert warm.headers["x-kvgate-worker"] == sql_worker
        assert predicted(warm) == cached_tokens(warm) > 0

        # A prompt cached only for the adapter is no credit for the base model.
        other = chat("sql", long_text("adapter only"))
        seeded = await c.post("/v1/chat/completions", json=other)
        await indexed(gw, other, seeded.headers["x-kvgate-worker"])
        plain = await c.post("/v1/chat/completions", json={**other, "model": MODEL})
        assert predicted(plain) == cached_tokens(plain) == 0
        again = await c.post("/v1/chat/completions", json=base)
        assert again.headers["x-kvgate-worker"] == base_worker
        assert predicted(again) == cached_tokens(again) > 0


async def test_adapter_requests_go_only_to_workers_serving_the_adapter() -> None:
    async with sim_fleets(fleet_config(2)) as (fleet,):
        holder = fleet.replicas[1].url
        await _load_adapter(holder, "chat")
        async with gate(worker_specs(fleet)) as gw:
            body = chat("chat", long_text("only one"))
            explained = (await gw.client.post("/debug/route", json=body)).json()
            assert explained["chosen"] == holder
            other = next(w for w in explained["workers"] if w["worker"] != holder)
            assert other["eligible"] is False and "does not serve" in other["reason"]
            for i in range(3):
                reply = await gw.client.post(
                    "/v1/chat/completions", json=chat("chat", long_text(f"q{i}"))
                )
                assert reply.status_code == 200, reply.text
                assert reply.headers["x-kvgate-worker"] == holder
            seeded = await gw.client.post("/v1/chat/completions", json=body)
            assert seeded.status_code == 200, seeded.text
            await indexed(gw, body, holder)
            warm = await gw.client.post("/v1/chat/completions", json=body)
            assert predicted(warm) == cached_tokens(warm) > 0
