"""Issue 50 part 2: kvgate in front of one real vLLM server with two data-parallel ranks.

``--data-parallel-size 2`` on this CPU: each rank is its own engine process with its own KV
cache, publishing its KV events on the base port + its rank (``GET /kv_event_sources`` lists
both). kvgate discovers both ranks, routes each request to (worker, rank) and sends the rank
as ``X-data-parallel-rank``; its predicted cached tokens must equal what vLLM reports, on
both ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from kvgate_server import KvgateServer
from vllm_helpers import ranked_turns

from kvgate.backends.process import PortAllocator, free_port_range
from kvgate.backends.vllm_cpu.launch import EngineOptions, EngineStartError, Fleet, ReplicaSpec
from kvgate.backends.vllm_cpu.layout import EngineLayout

pytestmark = pytest.mark.vllm

READY_TIMEOUT_S = 600.0
"""Two engine-core processes and their warm-up on 2 busy cores (~3 min measured)."""
SESSIONS = 4
TURNS = 4


@pytest.fixture(scope="module")
def dp_server(
    engine_layout: EngineLayout, tiny_model_dir: Path, ports: PortAllocator
) -> Iterator[Fleet]:
    """One vLLM server, two data-parallel ranks (one core each), events over tcp."""
    options = EngineOptions(
        python=engine_layout.python,
        model_dir=tiny_model_dir,
        logs=engine_layout.logs / "pytest-dp",
        extra_args=("--data-parallel-size", "2"),
        extra_env=(("VLLM_CPU_OMP_THREADS_BIND", "0|1"),),
    )
    http = ports.one()
    events = free_port_range(2, start=41000)  # rank r publishes on events + r
    replay = free_port_range(2, start=events + 10)  # and replays on replay + r
    fleet = Fleet(options, [ReplicaSpec(0, http, replay, f"tcp://*:{events}")])
    try:
        fleet.start(ready_timeout=READY_TIMEOUT_S)
    except EngineStartError as exc:
        pytest.fail(f"vLLM with --data-parallel-size 2 did not start: {exc}", pytrace=False)
    try:
        yield fleet
    finally:
        fleet.stop()


def test_ranks_routed_and_predicted_exactly(
    dp_server: Fleet,
    tiny_model_dir: Path,
    engine_layout: EngineLayout,
    ports: PortAllocator,
    report: Callable[[str], None],
) -> None:
    url = dp_server.urls[0]
    sources = httpx.get(f"{url}/kv_event_sources", timeout=10).json()
    assert sorted(sources) == ["0", "1"]
    log_path = engine_layout.logs / "pytest-dp" / "kvgate-dp.log"
    with (
        KvgateServer([url], tiny_model_dir, log_path, ports.one(), dp_size=2) as server,
        httpx.Client(base_url=server.url, timeout=120.0) as client,
    ):
        seen = ranked_turns(client, "dp", 5000, SESSIONS, TURNS)  # (rank, predicted, cached)
        mismatches = [s for s in seen if s[1] != s[2]]
        ranks = sorted({s[0] for s in seen})
        hits = sum(s[2] for s in seen)
        report(
            f"dp ranks: {len(seen)} requests over ranks {ranks}, {len(mismatches)} "
            f"mismatches (rank, predicted, cached): {mismatches[:5]}; cached tokens {hits}"
        )
        assert ranks == [0, 1]
        assert not mismatches
        assert hits > 0
        metrics = client.get("/metrics").text
        assert 'kvgate_dp_rank_attempts_total{dp_rank="1"' in metrics
