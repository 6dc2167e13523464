"""Issue 7 test 4: kvgate closes an event gap through vLLM's real replay socket.

Replica 0's events reach kvgate through a relay that drops one batch on demand; its replay
endpoint is vLLM's own. The next batch reveals the gap, kvgate replays the missing range from
the engine, and routes the lost prompt to the replica holding it with an exact prediction.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from kvgate_server import KvgateServer, matched_blocks, route_explain
from relay import DroppingRelay
from vllm_helpers import (
    BLOCK,
    MODEL,
    ChatSession,
    engine_cached_tokens,
    usage_of,
    wait_subscribed,
)

from kvgate.backends.process import PortAllocator, wait_until
from kvgate.backends.vllm_cpu.launch import Fleet, ReplicaSpec
from kvgate.backends.vllm_cpu.layout import EngineLayout

pytestmark = pytest.mark.vllm


@pytest.fixture
def relay(
    vllm_fleet: Fleet, zmq_context: zmq.Context[zmq.Socket[bytes]], ports: PortAllocator
) -> Iterator[DroppingRelay]:
    upstream = wait_subscribed(zmq_context, vllm_fleet.replicas[0].spec.events_endpoint)
    forwarding = DroppingRelay(zmq_context, upstream, ports.one()).start()
    try:
        yield forwarding
    finally:
        forwarding.close()


@pytest.fixture
def relayed_kvgate(
    vllm_fleet: Fleet,
    relay: DroppingRelay,
    tiny_model_dir: Path,
    engine_layout: EngineLayout,
    ports: PortAllocator,
) -> Iterator[KvgateServer]:
    relayed = vllm_fleet.replicas[0].spec
    workers = [f"{relayed.url},events={relay.endpoint},replay={relayed.replay_endpoint}"]
    workers += [r.spec.worker_flag() for r in vllm_fleet.replicas[1:]]
    log_path = engine_layout.logs / "pytest" / "kvgate-gap.log"
    with KvgateServer(workers, tiny_model_dir, log_path, ports.one()) as server:
        yield server


def _direct_chat(replica: ReplicaSpec, messages: list[dict[str, str]]) -> int:
    """Send to the engine itself (kvgate only hears of it through events); prompt tokens."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    reply = httpx.post(f"{replica.url}/v1/chat/completions", json=body, timeout=60.0)
    reply.raise_for_status()
    return usage_of(reply.json())[0]


def _replays_covered(client: httpx.Client, worker: str) -> float:
    wanted = ("kvgate_index_replays_total{", f'worker="{worker}"', 'outcome="covered"')
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(wanted[0]) and all(part in line for part in wanted[1:]):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_dropped_batch_is_replayed_and_routed_exactly(
    relayed_kvgate: KvgateServer, relay: DroppingRelay, vllm_fleet: Fleet
) -> None:
    replica = vllm_fleet.replicas[0].spec
    with httpx.Client(base_url=relayed_kvgate.url, timeout=60.0) as client:

        def blocks_known(messages: list[dict[str, str]]) -> int:
            explained = route_explain(client, {"model": MODEL, "messages": messages})
            return matched_blocks(explained, replica.url)

        warm = ChatSession.start("gap-gw-warm", seed=4001).ask(40)
        warm_tokens = _direct_chat(replica, warm)
        wait_until(lambda: blocks_known(warm) == warm_tokens // BLOCK, 10.0, "warm-up indexed")
        replays_before = _replays_covered(client, replica.url)

        relay.drop(1)
        lost = ChatSession.start("gap-gw-lost", seed=4002).ask(90)
        lost_tokens = _direct_chat(replica, lost)
        wait_until(lambda: relay.counts()[1] == 1, 10.0, "the relay to drop one batch")
        assert blocks_known(lost) == 0

        revealing = ChatSession.start("gap-gw-next", seed=4003).ask(30)
        _direct_chat(replica, revealing)
        wait_until(lambda: blocks_known(lost) == lost_tokens // BLOCK, 10.0, "the gap replayed")
        assert _replays_covered(client, replica.url) == replays_before + 1

        reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": lost})
        reply.raise_for_status()
        prompt_tokens, cached = usage_of(reply.json())
        assert reply.headers["x-kvgate-worker"] == replica.url
        predicted = int(reply.headers["x-kvgate-predicted-cached-tokens"])
        assert cached == engine_cached_tokens(prompt_tokens, lost_tokens // BLOCK)
        assert predicted == cached
