"""What kvgate reads from an engine's /metrics page (the engine adapters' parse_load), and
how it keeps the scraped KV usage current between scrapes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
from fakes.gateway import Kvgate, kvgate
from fakes.wait import wait_until
from test_sim_support import fault, sim_config, sim_fleet

from kvgate.backends.engines import SGLANG, VLLM
from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.scheduling.capacity import KV_FIT
from kvgate.scheduling.config import Tuning
from kvgate.scheduling.ledger import WorkerLedger

MODEL = "kvgate-sim"

VLLM_PAGE = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="8000",num_cpu_blocks="None"} 1.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="7000",num_cpu_blocks="None"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:prompt_tokens_total{model_name="m"} 123.0
"""


def test_vllm_load_sums_ranks_and_takes_the_smallest_capacity() -> None:
    load = VLLM.parse_load(VLLM_PAGE)
    assert (load.running, load.waiting, load.kv_usage) == (3, 4, 0.5)
    assert load.kv_capacity_blocks == 7000


def test_a_capacity_label_that_is_not_a_positive_int_is_ignored() -> None:
    page = 'vllm:cache_config_info{num_gpu_blocks="None"} 1.0\nvllm:num_requests_running 1.0\n'
    assert VLLM.parse_load(page).kv_capacity_blocks is None
    page = 'vllm:cache_config_info{num_gpu_blocks="0"} 1.0\n'
    assert VLLM.parse_load(page).kv_capacity_blocks is None
    assert VLLM.parse_load("vllm:num_requests_running 1.0\n").kv_capacity_blocks is None


def test_sglang_has_no_capacity_metric() -> None:
    page = "sglang:num_running_reqs 2.0\nsglang:num_queue_reqs 1.0\nsglang:token_usage 0.5\n"
    load = SGLANG.parse_load(page)
    assert (load.running, load.waiting, load.kv_usage, load.kv_capacity_blocks) == (2, 1, 0.5, None)


@contextlib.asynccontextmanager
async def one_replica() -> AsyncIterator[tuple[Kvgate, httpx.AsyncClient, WorkerLedger]]:
    """kvgate (kv policy, the simulator's tokenizer) before one simulated replica of 64 KV
    blocks of 4 tokens; a client of the replica itself (faults); the scheduler's ledger of
    the worker. The queue's wait for KV room (the ``room_wait`` part) is off: a request that
    lacks KV room goes to the engine's queue at once, the engine-side wait these tests read,
    instead of waiting in kvgate first."""
    config = sim_config(replicas=1, speedup=1000.0, block_size=4, capacity_blocks=64)
    async with sim_fleet(config) as fleet:
        url = fleet.replicas[0].url
        tokenizers = [f"{MODEL}={tokenizer_dir()}"]
        tuning = Tuning(parts=replace(KV_FIT, room_wait=False))
        async with (
            kvgate(
                [f"{url},models={MODEL}"], policy="kv", tokenizers=tokenizers, tuning=tuning
            ) as gw,
            httpx.AsyncClient(base_url=url) as sim,
        ):
            (worker,) = gw.gateway.scheduler.ledger
            yield gw, sim, worker


@pytest.mark.anyio
async def test_usage_leaves_out_the_blocks_of_requests_ended_since_the_scrape() -> None:
    """A scrape taken while a request held its blocks counts them until the next scrape;
    kvgate takes off what the requests it saw end there held (an agent's next turn follows
    at once, and its home must not look full of the blocks its last turn released)."""
    async with one_replica() as (gw, sim, worker):
        await fault(sim, kind="slow", factor=5e4)  # 0.3 s a step: the request stays
        body = {"model": MODEL, "prompt": " ".join(["forty blocks"] * 80), "max_tokens": 4}
        sent = asyncio.ensure_future(
            gw.client.post("/v1/completions", json={**body, "stream": True})
        )
        await wait_until(lambda: worker.in_flight == 1 and worker.pending_requests == 0)
        await gw.gateway.health.scrape_all()  # the request decoding: its 41 blocks held
        scraped = worker.worker.scraped.kv_usage
        assert scraped is not None and scraped >= 40 / 64
        assert worker.load().scraped_kv_usage == scraped
        await fault(sim, kind="clear")
        assert (await sent).status_code == 200
        assert worker.in_flight == 0
        released = worker.released_blocks - worker.scrape_mark
        assert released >= 41  # its prompt's 40 blocks and what its answer filled (4 tokens)
        now = worker.load().scraped_kv_usage
        assert now is not None and now == pytest.approx(max(scraped - released / 64, 0.0))
        await gw.gateway.health.scrape_all()  # a new scrape: nothing ended since
        assert worker.load().scraped_kv_usage == worker.worker.scraped.kv_usage == 0.0


@pytest.mark.anyio
async def test_a_request_sent_without_room_blocks_its_worker_until_the_engine_admits_it() -> None:
    """A request whose blocks do not fit beside the running one's (41 + 40 of 64) waits at the
    head of the engine's queue: kvgate counts its worker blocked (``blocked_requests``, the
    gauge). Read whole at its end (not streamed), it shows no first token while it runs, so
    a scrape with nothing waiting, asked after it was sent, says it started."""
    async with one_replica() as (gw, sim, worker):
        await gw.gateway.health.scrape_all()  # the engine's capacity: 64 blocks
        await fault(sim, kind="slow", factor=5e4)  # 0.3 s a step
        running = {"model": MODEL, "prompt": " ".join(["forty blocks"] * 80), "max_tokens": 6}
        first = asyncio.ensure_future(
            gw.client.post("/v1/completions", json={**running, "stream": True})
        )
        await wait_until(lambda: worker.in_flight == 1 and worker.pending_requests == 0)
        assert worker.blocked_requests == 0  # it had room
        waiting = {"model": MODEL, "prompt": " ".join(["other words"] * 78), "max_tokens": 20}
        second = asyncio.ensure_future(gw.client.post("/v1/completions", json=waiting))
        await wait_until(lambda: worker.in_flight == 2)
        assert worker.blocked_requests == 1
        text = (await gw.client.get("/metrics")).text
        assert f'kvgate_worker_blocked_requests{{worker="{worker.worker.url}"}} 1.0' in text
        await gw.gateway.health.scrape_all()  # the engine: one waiting
        assert worker.worker.scraped.waiting == 1 and worker.blocked_requests == 1
        assert (await first).status_code == 200  # room released: the engine admits it

        async def admitted() -> bool:
            await gw.gateway.health.scrape_all()
            return worker.worker.scraped.waiting == 0

        async with asyncio.timeout(10):
            while not await admitted():  # each scrape is an await
                pass
        assert worker.in_flight == 1 and worker.pending_requests == 1  # still decoding
        assert worker.blocked_requests == 0
        await fault(sim, kind="clear")
        assert (await second).status_code == 200
        assert worker.in_flight == 0 and worker.blocked_requests == 0
