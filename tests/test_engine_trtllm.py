"""TensorRT-LLM (trtllm-serve) as an engine kind: its metrics, health, block size and KV
events, read by kvgate from the simulator speaking trtllm-serve's variant."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
from fakes.gateway import quiet_health
from fakes.simgate import (
    MODEL,
    cached_tokens,
    chat,
    fleet_config,
    gate,
    long_text,
    predicted,
    sim_fleets,
    until,
)

from kvgate.backends.engines import TRTLLM, adapter_for
from kvgate.backends.process import free_port_range
from kvgate.backends.sim.config import ApiConfig, SimConfig

pytestmark = pytest.mark.anyio

PAGE = """\
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="m",engine_type="trtllm"} 3.0
trtllm_num_requests_running{model_name="m",engine_type="other"} 1.0
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{model_name="m",engine_type="trtllm"} 2.0
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{model_name="m",engine_type="trtllm"} 0.25
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{model_name="m",engine_type="trtllm"} 5000.0
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{model_name="m",engine_type="trtllm"} 32.0
"""


def test_trtllm_adapter_reads_its_gauges() -> None:
    assert adapter_for("trtllm") is TRTLLM
    assert TRTLLM.metrics_path == "/prometheus/metrics" and TRTLLM.tokenize_path is None
    load = TRTLLM.parse_load(PAGE)
    assert (load.running, load.waiting, load.kv_usage, load.kv_capacity_blocks) == (
        4,
        2,
        0.25,
        5000,
    )
    assert TRTLLM.parse_facts(PAGE).block_size == 32
    # a fraction, NaN or disagreeing ranks declare nothing
    assert TRTLLM.parse_facts(PAGE.replace(" 32.0", " 32.5")).block_size is None
    assert TRTLLM.parse_facts(PAGE.replace(" 32.0", " NaN")).block_size is None
    two = PAGE + 'trtllm_kv_cache_tokens_per_block{model_name="m",engine_type="x"} 64.0\n'
    assert TRTLLM.parse_facts(two).block_size is None


def trtllm_config(dp_size: int = 1, **engine: int) -> SimConfig:
    base = fleet_config(1, **engine)
    return replace(base, dp_size=dp_size, api=ApiConfig(engine_kind="trtllm"))


async def test_sim_speaks_trtllm_serve() -> None:
    async with (
        sim_fleets(trtllm_config(block_size=32)) as (fleet,),
        httpx.AsyncClient(base_url=fleet.replicas[0].url, timeout=10) as client,
    ):
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/health_generate")).status_code == 200
        page = (await client.get("/prometheus/metrics")).text
        assert "trtllm_kv_cache_tokens_per_block" in page
        assert TRTLLM.parse_facts(page).block_size == 32
        assert isinstance((await client.get("/metrics")).json(), list)
        tokenize = await client.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
        assert tokenize.status_code == 404
        assert (await client.get("/kv_event_sources")).status_code == 404


async def test_kvgate_routes_trtllm_ranks_on_their_events() -> None:
    """Two replicas as trtllm-serve with two attention-DP ranks each (events on the base port
    + rank): kvgate adopts the block size from the gauge, reads the load and capacity from
    /prometheus/metrics, sends no rank header (the engine places requests itself) and predicts
    the cached tokens the engine reports."""
    events = free_port_range(8, start=37600)
    config = replace(trtllm_config(dp_size=2, block_size=32), replicas=2, events_port=events)
    async with sim_fleets(config) as (fleet,):
        specs = [
            f"{r.url},engine=trtllm,events={r.events},replay={r.replay},dp_size=2"
            for r in fleet.replicas
        ]
        health = quiet_health(metrics_interval_s=0.05)
        async with gate(specs, health=health) as gw:
            index = (await gw.client.get("/debug/index")).json()
            subscribers = index["workers"][fleet.replicas[0].url]["subscribers"]
            assert [s["dp_rank"] for s in subscribers] == [0, 1]

            async def scraped() -> bool:
                workers = (await gw.client.get("/admin/workers")).json()["workers"]
                return all(w["scraped"]["kv_capacity_blocks"] == 4096 for w in workers)

            await until(scraped, what="the trtllm gauges scraped")
            workers = (await gw.client.get("/admin/workers")).json()["workers"]
            assert [w["block_size"] for w in workers] == [32, 32]
            body = chat(MODEL, long_text("trt", words=200))
            first = await gw.client.post("/v1/chat/completions", json=body)
            assert cached_tokens(first) == 0 and "x-kvgate-dp-rank" not in first.headers
            worker = first.headers["x-kvgate-worker"]

            async def indexed() -> bool:
                explained = (await gw.client.post("/debug/route", json=body)).json()
                entry = next(w for w in explained["workers"] if w["worker"] == worker)
                return bool(entry["overlap_tokens"] > 0 and entry["dp_rank"] is None)

            await until(indexed, what="the first prompt's blocks indexed")
            again = await gw.client.post("/v1/chat/completions", json=body)
            assert again.headers["x-kvgate-worker"] == worker
            assert predicted(again) == cached_tokens(again) > 0
