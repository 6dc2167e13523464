"""Issue 50 part 2 on SGLang: kvgate in front of one real SGLang server with two
data-parallel ranks (``--dp-size 2``, one core each; rank r publishes its KV events on the
base port + r). Given as ``dp_size=2``, kvgate subscribes to both ranks, routes each request
to (worker, rank) with ``X-data-parallel-rank`` (SGLang reads that header), and its
predicted cached tokens equal what SGLang reports, on both ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from kvgate_server import KvgateServer
from vllm_helpers import ranked_turns

from kvgate.backends.process import PortAllocator, free_port_range
from kvgate.backends.sglang_cpu.launch import (
    SglangFleet,
    SglangOptions,
    SglangReplicaSpec,
    SglangStartError,
)
from kvgate.backends.sglang_cpu.layout import SglangLayout

pytestmark = pytest.mark.sglang

READY_TIMEOUT_S = 600.0
"""Two scheduler processes and their warm-up on 2 busy cores (~3 min measured)."""
SESSIONS = 4
TURNS = 4


@pytest.fixture(scope="module")
def dp_sglang(
    sglang_layout: SglangLayout, sglang_model_dir: Path, ports: PortAllocator
) -> Iterator[SglangFleet]:
    options = SglangOptions(
        python=sglang_layout.python,
        model_dir=sglang_model_dir,
        logs=sglang_layout.logs / "pytest-dp",
        dp_size=2,
    )
    events = free_port_range(2, start=42000)  # rank r publishes on events + r
    replay = free_port_range(2, start=events + 10)  # and replays on replay + r
    spec = SglangReplicaSpec(0, ports.one(), events, replay, ports.one())
    fleet = SglangFleet(options, [spec])
    try:
        fleet.start(ready_timeout=READY_TIMEOUT_S)
    except SglangStartError as exc:
        pytest.fail(f"SGLang with --dp-size 2 did not start: {exc}", pytrace=False)
    try:
        yield fleet
    finally:
        fleet.stop()


def test_ranks_routed_and_predicted_exactly(
    dp_sglang: SglangFleet,
    sglang_layout: SglangLayout,
    ports: PortAllocator,
    report: Callable[[str], None],
) -> None:
    worker = dp_sglang.worker_flags()[0] + ",dp_size=2"
    log_path = sglang_layout.logs / "pytest-dp" / "kvgate-sglang-dp.log"
    with (
        KvgateServer([worker], None, log_path, ports.one(), block_size=None, dp_size=2) as server,
        httpx.Client(base_url=server.url, timeout=120.0) as client,
    ):
        seen = ranked_turns(client, "sdp", 7000, SESSIONS, TURNS)  # (rank, predicted, cached)
        mismatches = [s for s in seen if s[1] != s[2]]
        ranks = sorted({s[0] for s in seen})
        hits = sum(s[2] for s in seen)
        report(
            f"SGLang dp ranks: {len(seen)} requests over ranks {ranks}, {len(mismatches)} "
            f"mismatches (rank, predicted, cached): {mismatches[:5]}; cached tokens {hits}"
        )
        assert ranks == [0, 1]
        assert not mismatches
        assert hits > 0
