"""Data-parallel ranks: kvgate routes to (worker, rank) and sends the rank with the request.

A simulated replica with two data-parallel ranks (each its own engine and cache, each
publishing its KV events on its own port, as vLLM ``--data-parallel-size`` does) behind
kvgate: the rank holding a prompt gets it again, predicted cached tokens equal the engine's,
a new prompt goes to the rank with less in flight, and /debug/route and /metrics show ranks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

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

from kvgate.backends.config import WorkerConfig
from kvgate.backends.engines import VLLM
from kvgate.backends.process import free_port_range
from kvgate.backends.sim.fleet import SimFleet
from kvgate.index.types import PrefixMatch, WorkerId
from kvgate.scheduling.dp_ranks import choose_rank, rank_cost
from kvgate.scheduling.ledger import RankLoad
from kvgate.scoring.api import Candidate

pytestmark = pytest.mark.anyio


# -- the choice of a rank (pure) -------------------------------------------------------------


def test_rank_cost_weighs_uncached_blocks_against_pending_prefill() -> None:
    assert rank_cost(PrefixMatch(gpu=6), RankLoad(), 10, 16) == (4, 0, 0, 0)
    load = RankLoad(in_flight=2, pending_prefill_tokens=33, sent=5)
    assert rank_cost(PrefixMatch(), load, 10, 16, scraped_queue=3) == (13, 2, 3, 5)


def test_choose_rank_prefers_the_cached_rank_unless_its_queue_costs_more() -> None:
    worker = Candidate(WorkerId("http://w"), "http://w", match=PrefixMatch(gpu=8))
    ranks = {0: PrefixMatch(), 1: PrefixMatch(gpu=8)}
    chosen = choose_rank(worker, ranks, {}, 10, 16)
    assert (chosen.dp_rank, chosen.match) == (1, PrefixMatch(gpu=8))
    # rank 1 has 160 tokens (10 blocks) of prefill pending: 2 + 10 > 10 + 0
    busy = {1: RankLoad(in_flight=1, pending_prefill_tokens=160)}
    chosen = choose_rank(worker, ranks, busy, 10, 16)
    assert (chosen.dp_rank, chosen.match) == (0, PrefixMatch())
    # equal otherwise: the rank where the engine reports fewer requests (vLLM engine="r")
    queues = {0: 4, 1: 1}
    chosen = choose_rank(replace(worker, match=PrefixMatch()), ranks, {}, 10, 16,
                         scraped=queues.get)  # fmt: skip
    assert chosen.dp_rank == 1
    # no match of its own (another cache domain): no rank is credited, load decides
    foreign = replace(worker, match=PrefixMatch())
    chosen = choose_rank(foreign, ranks, {0: RankLoad(in_flight=1)}, 10, 16)
    assert (chosen.dp_rank, chosen.match) == (1, PrefixMatch())


def test_vllm_per_rank_load_is_read_from_the_engine_label() -> None:
    page = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
"""
    load = VLLM.parse_load(page)
    assert (load.running, load.waiting) == (2, 4)
    assert (load.rank_queue(0), load.rank_queue(1), load.rank_queue(2)) == (5, 1, None)
    single = page.replace('engine="1"', 'engine="0"')
    assert VLLM.parse_load(single).rank_queues == ()  # one rank: nothing per rank


def test_worker_dp_size_offsets_event_ports_per_rank() -> None:
    config = WorkerConfig.model_validate(
        "http://127.0.0.1:8000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5567,dp_size=2"
    )
    assert config.dp_size == 2
    assert config.rank_endpoint("tcp://127.0.0.1:5557", 1) == "tcp://127.0.0.1:5558"
    with pytest.raises(ValueError, match="tcp://host:port"):
        WorkerConfig.model_validate("http://h:1,events=ipc:///tmp/e,dp_size=2")
    with pytest.raises(ValueError, match="exceeds 65535"):
        WorkerConfig.model_validate("http://h:1,events=tcp://h:65535,dp_size=2")


# -- end to end, against the simulator -------------------------------------------------------


def dp_config(**overrides: Any) -> Any:
    return replace(fleet_config(1), dp_size=2, **overrides)


async def explain(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    answer = (await client.post("/debug/route", json=body)).json()
    return dict(answer["workers"][0])


async def check_routed_per_rank(gw: Any, fleet: SimFleet) -> None:
    replica = fleet.replica(0)
    body = chat(MODEL, long_text("first"))
    first = await gw.client.post("/v1/chat/completions", json=body)
    assert cached_tokens(first) == 0
    entry = await explain(gw.client, body)
    home = entry["dp_rank"]
    assert home in (0, 1) and set(entry["dp_ranks"]) == {"0", "1"}

    async def indexed() -> bool:
        entry = await explain(gw.client, body)
        return bool(entry["dp_ranks"][str(home)]["matched_blocks"] > 0)

    await until(indexed, what="the first prompt's blocks indexed on its rank")
    entry = await explain(gw.client, body)
    assert entry["dp_rank"] == home
    assert entry["dp_ranks"][str(1 - home)]["matched_blocks"] == 0  # the other rank's cache
    again = await gw.client.post("/v1/chat/completions", json=body)
    assert predicted(again) == cached_tokens(again) > 0
    assert again.headers["x-kvgate-dp-rank"] == str(home)
    assert not replica.snapshot(1 - home).gpu  # only its rank computed it
    metrics = (await gw.client.get("/metrics")).text
    assert f'kvgate_dp_rank_attempts_total{{dp_rank="{home}"' in metrics


async def test_sim_ranks_discovered_and_routed_by_cache_then_load() -> None:
    """The ranks come from the worker's GET /kv_event_sources (one endpoint per rank); a
    repeated prompt returns to its rank with exact predictions; while a stream holds one
    rank, a new prompt goes to the other."""
    config = dp_config(timing=replace(fleet_config(1).timing, speedup=5.0))
    health = quiet_health(metrics_interval_s=0.05)  # the engine's per-rank load, scraped
    async with sim_fleets(config) as (fleet,), gate([fleet.replicas[0].url], health=health) as gw:
        await until(lambda: len(fleet.replica(0).ranks) == 2)

        async def ranks_known() -> bool:
            entry = await explain(gw.client, chat(MODEL, "x"))
            return "dp_ranks" in entry

        await until(ranks_known, what="both ranks subscribed")
        await check_routed_per_rank(gw, fleet)
        # hold a long stream on one rank: the next new prompt goes to the other
        held = chat(MODEL, long_text("held"), max_tokens=4000, stream=True)
        async with gw.client.stream("POST", "/v1/chat/completions", json=held) as stream:
            chunks = stream.aiter_lines()
            await anext(chunks)  # it has started
            fresh = await explain(gw.client, chat(MODEL, long_text("fresh")))
            in_flight = {int(r): v["in_flight"] for r, v in fresh["dp_ranks"].items()}
            busy = next(r for r, n in in_flight.items() if n == 1)
            assert in_flight[1 - busy] == 0
            assert fresh["dp_rank"] == 1 - busy

            async def engine_reports_it() -> bool:  # vLLM's per-rank series, engine="r"
                entry = await explain(gw.client, chat(MODEL, long_text("fresh")))
                return bool(entry["dp_ranks"][str(busy)]["engine_queue"] == 1)

            await until(engine_reports_it, what="the busy rank's load scraped")
            entry = await explain(gw.client, chat(MODEL, long_text("fresh")))
            assert entry["dp_ranks"][str(1 - busy)]["engine_queue"] == 0
            await stream.aclose()


async def test_sim_ranks_from_dp_size_and_rank_events_on_port_plus_rank() -> None:
    """Configured as ``events=tcp://...:P,replay=tcp://...:R,dp_size=2``: kvgate subscribes
    to P+r and R+r, and each rank's batches carry its data_parallel_rank."""
    events = free_port_range(4, start=36500)
    config = replace(dp_config(), events_port=events)
    async with sim_fleets(config) as (fleet,):
        r = fleet.replicas[0]
        assert r.events.endswith(f":{events}")
        spec = f"{r.url},events={r.events},replay={r.replay},dp_size=2"
        async with gate([spec]) as gw:
            index = (await gw.client.get("/debug/index")).json()
            ranks = index["workers"][r.url]["subscribers"]
            assert [(s["dp_rank"], s["events"]) for s in ranks] == [
                (0, f"tcp://127.0.0.1:{events}"),
                (1, f"tcp://127.0.0.1:{events + 1}"),
            ]
            await check_routed_per_rank(gw, fleet)


async def test_sim_honours_the_rank_header_and_refuses_a_missing_rank() -> None:
    async with sim_fleets(dp_config()) as (fleet,):
        replica = fleet.replica(0)
        url = fleet.replicas[0].url
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            body = chat(MODEL, long_text("pinned"))
            for _ in range(2):
                answer = await client.post(
                    "/v1/chat/completions", json=body, headers={"X-data-parallel-rank": "1"}
                )
                assert answer.status_code == 200
            assert cached_tokens(answer) > 0
            await until(replica.idle)
            assert not replica.snapshot(0).gpu and replica.snapshot(1).gpu
            refused = await client.post(
                "/v1/chat/completions", json=body, headers={"X-data-parallel-rank": "2"}
            )
            assert refused.status_code == 400
            sources = (await client.get("/kv_event_sources")).json()
            assert sorted(sources) == ["0", "1"]
            assert sources["1"]["endpoint"] != sources["0"]["endpoint"]
