"""Model lists that follow the fleet (issue 17, part 2): each worker's /v1/models is read again
every ``health.models_interval_s`` (and soon after it answers 404 for a model it listed), so
LoRA adapters loaded or unloaded at run time are followed without a health flap.

Real uvicorn kvgate, simulated vLLM replicas loading and unloading adapters through vLLM's
own endpoints."""

from __future__ import annotations

import httpx
import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate, quiet_health
from fakes.simgate import MODEL, chat, fleet_config, gate, sim_fleets, until, worker_specs

pytestmark = pytest.mark.anyio


async def _adapter(url: str, action: str, name: str) -> None:
    body = {"lora_name": name, "lora_path": f"/adapters/{name}"}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        reply = await client.post(f"/v1/{action}_lora_adapter", json=body)
        assert reply.status_code == 200, reply.text


async def test_adapters_loaded_and_unloaded_at_run_time_are_followed() -> None:
    async with (
        sim_fleets(fleet_config(2)) as (fleet,),
        gate(worker_specs(fleet), health=quiet_health(models_interval_s=0.2)) as gw,
    ):
        holder = fleet.replicas[1].url
        refused = await gw.client.post("/v1/chat/completions", json=chat("live", "hi"))
        assert refused.status_code == 404
        assert gw.metric("kvgate_worker_models", {"worker": holder}) == 1.0

        await _adapter(holder, "load", "live")

        async def listed() -> bool:
            models = (await gw.client.get("/v1/models")).json()["data"]
            return "live" in {m["id"] for m in models}

        await until(listed, what="the loaded adapter listed")
        assert gw.metric("kvgate_worker_models", {"worker": holder}) == 2.0
        for i in range(3):
            reply = await gw.client.post("/v1/chat/completions", json=chat("live", f"q{i}"))
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvgate-worker"] == holder

        await _adapter(holder, "unload", "live")

        async def refused_again() -> bool:
            reply = await gw.client.post("/v1/chat/completions", json=chat("live", "bye"))
            return reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"

        await until(refused_again, what="the unloaded adapter refused by kvgate")
        assert gw.metric("kvgate_worker_models", {"worker": holder}) == 1.0


async def test_a_404_for_a_listed_model_rereads_that_workers_models() -> None:
    async with (
        sim_fleets(fleet_config(2, lora=["sql"])) as (fleet,),
        gate(
            worker_specs(fleet),
            policy="round_robin",
            health=quiet_health(models_interval_s=0),  # no periodic re-read
        ) as gw,
    ):
        gone, kept = fleet.replicas[0].url, fleet.replicas[1].url
        await _adapter(gone, "unload", "sql")
        statuses = set()
        for i in range(2):  # round robin: one of them reaches the replica that unloaded it
            reply = await gw.client.post("/v1/chat/completions", json=chat("sql", f"a{i}"))
            statuses.add((reply.headers.get("x-kvgate-worker"), reply.status_code))
        assert (gone, 404) in statuses and (kept, 200) in statuses

        registry = gw.gateway.registry
        await until(lambda: "sql" not in registry.get(gone).models, what="models read again")
        assert MODEL in registry.get(gone).models
        for i in range(3):
            reply = await gw.client.post("/v1/chat/completions", json=chat("sql", f"b{i}"))
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-kvgate-worker"] == kept


async def test_an_oversized_model_list_is_refused_and_the_old_one_kept() -> None:
    engine = FakeEngine(models=["small"])
    health = quiet_health(models_interval_s=0.05, models_max_bytes=4096, models_max_entries=3)
    async with fleet(engine) as f, kvgate(f.urls, health=health) as gw:
        worker = gw.gateway.registry.get(f.urls[0])
        engine.models = [f"model-{i:05d}" for i in range(400)]  # > 4096 bytes
        asked = len(engine.seen)
        await until(lambda: len(engine.seen) > asked + 2, what="two more rounds")
        assert worker.models == {"small"} and worker.healthy
        engine.models = ["small", "a", "b", "c"]  # more entries than allowed
        asked = len(engine.seen)
        await until(lambda: len(engine.seen) > asked + 2, what="two more rounds")
        assert worker.models == {"small"}
        engine.models = ["small", "embed"]
        await until(lambda: worker.models == {"small", "embed"}, what="the new list")
        reply = await gw.client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
        assert reply.status_code == 200 and reply.json()["model"] == "embed"
