"""Engine facts from the engines (issue 17, part 0): kvgate adopts the block size its engines
declare (vllm:cache_config_info on /metrics, or the block_size of their KV events), and a
block size that contradicts kvgate's setting or what the model's other replicas agree on (a
strict majority; issue 44) keeps the worker out, loudly: /ready, /metrics, /debug/index and
the log say why. Without a majority the model is not ready.

Real uvicorn kvgate, simulated vLLM replicas (real HTTP and ZMQ), no mocks."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fakes.engine import FakeEngine
from fakes.engine import _json as send_json
from fakes.gateway import Kvgate, fleet, kvgate, quiet_health
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


async def _predicted_equals_engine(gw: Kvgate, tag: str) -> None:
    """Send a prompt, wait for its blocks to be indexed, send it again: kvgate's prediction
    equals what the engine reports cached, and is not zero."""
    client = gw.client
    body = chat(MODEL, long_text(tag))
    first = await client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    worker = first.headers["x-kvgate-worker"]
    await indexed(gw, body, worker)
    again = await client.post("/v1/chat/completions", json=body)
    assert again.headers["x-kvgate-worker"] == worker
    assert predicted(again) == cached_tokens(again) > 0


async def test_block_size_declared_on_metrics_is_adopted() -> None:
    async with (
        sim_fleets(fleet_config(2, block_size=32)) as (fleet,),
        gate(worker_specs(fleet, models=MODEL)) as gw,
    ):
        stats = (await gw.client.get("/debug/index")).json()
        assert stats["block_sizes"]["declared_by_engines"] == {MODEL: 32}
        assert stats["config_mismatch"] == {}
        await _predicted_equals_engine(gw, "metrics")
        explained = (await gw.client.post("/debug/route", json=chat(MODEL, long_text("x")))).json()
        assert explained["block_size"] == 32


async def test_block_size_of_events_is_adopted_when_nothing_declares_one() -> None:
    # engine=openai: kvgate reads no /metrics from it; the events' block_size is adopted
    async with (
        sim_fleets(fleet_config(1, block_size=32)) as (fleet,),
        gate(worker_specs(fleet, models=MODEL, engine="openai")) as gw,
    ):
        body = chat(MODEL, long_text("events"))
        first = await gw.client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200
        worker = first.headers["x-kvgate-worker"]
        await indexed(gw, body, worker)  # joined again with 32, the replay brought it back
        again = await gw.client.post("/v1/chat/completions", json=body)
        assert predicted(again) == cached_tokens(again) > 0
        assert gw.gateway.registry.get(worker).facts.block_size == 32


async def test_explicit_block_size_that_contradicts_the_engine_is_loud(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, "kvgate.registry")
    async with sim_fleets(fleet_config(1, block_size=32)) as (fleet,):
        (spec,) = worker_specs(fleet, models=MODEL)
        async with gate([spec], index={"block_size": 16}) as gw:
            url = fleet.replicas[0].url
            ready = await gw.client.get("/ready")
            assert ready.status_code == 503
            assert ready.json()["not_ready"] == {"block_size": 1}  # counts: /ready is open
            stats = (await gw.client.get("/debug/index")).json()
            reason = stats["config_mismatch"][url]["block_size"]
            assert "block size is 32" in reason and "configured with 16" in reason
            assert "--index-block-size 32" in reason  # what to change
            labels = {"worker": url, "fact": "block_size"}
            assert gw.metric("kvgate_worker_config_mismatch", labels) == 1.0
            refused = await gw.client.post("/v1/chat/completions", json=chat(MODEL, "hi"))
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "no_healthy_worker"
            assert any("--index-block-size 32" in r.getMessage() for r in caplog.records)


async def test_one_lying_replica_among_two_honest_ones_is_outvoted() -> None:
    # issue 44, finding 4: the first worker listed used to decide the model's block size
    async with sim_fleets(fleet_config(1, block_size=32), fleet_config(2, block_size=16)) as (
        liar,
        honest,
    ):
        workers = worker_specs(liar, models=MODEL) + worker_specs(honest, models=MODEL)
        bad, good = liar.replicas[0].url, {r.url for r in honest.replicas}
        async with gate(workers) as gw:
            ready = await gw.client.get("/ready")
            assert ready.status_code == 200
            body = ready.json()
            assert body["ready_workers"] == 2 and body["not_ready"] == {"block_size": 1}
            assert "models_not_ready" not in body
            stats = (await gw.client.get("/debug/index")).json()
            reason = stats["config_mismatch"][bad]["block_size"]
            assert "block size 32 but 2 of the 3 workers" in reason and "use 16" in reason
            labels = {"worker": bad, "fact": "block_size"}
            assert gw.metric("kvgate_worker_config_mismatch", labels) == 1.0
            assert stats["block_sizes"]["declared_by_engines"] == {MODEL: 16}
            for i in range(6):
                reply = await gw.client.post("/v1/chat/completions", json=chat(MODEL, f"q{i}"))
                assert reply.headers["x-kvgate-worker"] in good
            await _predicted_equals_engine(gw, "outvoted")
            listed = {
                w["url"]: w for w in (await gw.client.get("/admin/workers")).json()["workers"]
            }
            assert listed[bad]["model_problems"] == {MODEL: reason}
            assert not listed[bad]["ready"]


async def test_one_against_one_is_not_ready_with_the_reason() -> None:
    async with sim_fleets(fleet_config(1, block_size=16), fleet_config(1, block_size=32)) as (
        small,
        big,
    ):
        workers = worker_specs(small, models=MODEL) + worker_specs(big, models=MODEL)
        async with gate(workers) as gw:
            ready = await gw.client.get("/ready")
            assert ready.status_code == 503
            body = ready.json()
            assert body["ready_workers"] == 0
            reason = body["models_not_ready"][MODEL]
            assert "no block size has a majority" in reason and "16 by 1, 32 by 1" in reason
            assert "http" not in reason  # the open /ready names no worker
            listed = (await gw.client.get("/admin/workers")).json()["workers"]
            assert [w["model_problems"] for w in listed] == [{MODEL: reason}] * 2
            refused = await gw.client.post("/v1/chat/completions", json=chat(MODEL, "hi"))
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "no_healthy_worker"


async def test_the_explicit_setting_wins_over_a_majority() -> None:
    async with sim_fleets(fleet_config(2, block_size=32), fleet_config(1, block_size=16)) as (
        many,
        one,
    ):
        workers = worker_specs(many, models=MODEL) + worker_specs(one, models=MODEL)
        async with gate(workers, index={"model_block_sizes": {MODEL: 16}}) as gw:
            body = (await gw.client.get("/ready")).json()
            assert body["ready_workers"] == 1 and body["not_ready"] == {"block_size": 2}
            stats = (await gw.client.get("/debug/index")).json()
            assert set(stats["config_mismatch"]) == {r.url for r in many.replicas}
            for i in range(3):
                reply = await gw.client.post("/v1/chat/completions", json=chat(MODEL, f"q{i}"))
                assert reply.headers["x-kvgate-worker"] == one.replicas[0].url


class SglangEngine(FakeEngine):
    """A fake SGLang server: its settings (``page_size``) at ``/get_server_info``."""

    page_size: int = 32

    async def _route(self, method: str, path: str, body: Any, receive: Any, send: Any) -> None:
        if (method, path) == ("GET", "/get_server_info"):
            settings = {"model_path": "/models/m", "page_size": self.page_size, "tp_size": 1}
            await send_json(send, settings)
            return
        await super()._route(method, path, body, receive, send)


async def test_sglang_page_size_is_read_from_its_server_info() -> None:
    async with fleet(SglangEngine()) as f:
        spec = f"{f.urls[0]},engine=sglang"
        async with kvgate([spec], health=quiet_health(timeout_s=5.0)) as gw:
            assert gw.gateway.registry.get(f.urls[0]).facts.block_size == 32
            stats = (await gw.client.get("/debug/index")).json()
            assert stats["block_sizes"]["declared_by_engines"] == {"fake-model": 32}
        async with kvgate([spec], index={"block_size": 16}) as gw:
            ready = await gw.client.get("/ready")
            assert ready.status_code == 503
            stats = (await gw.client.get("/debug/index")).json()
            assert "block size is 32" in stats["config_mismatch"][f.urls[0]]["block_size"]
