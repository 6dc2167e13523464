"""Retry until the first token: kvgate in front of simulated vLLM replicas that open their
streams at accept (as vLLM does) and then fail, over real HTTP and ZMQ.

Before the first token a failure costs a retry on another worker and the client sees one
clean answer; after it the stream ends with an error event, counted by reason.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from fakes.engine import FakeEngine
from fakes.gateway import Kvgate, fleet, kvgate
from fakes.wait import wait_until
from test_sim_support import fault, sim_config, sim_fleet

from kvgate.backends.sim.fleet import SimFleet
from kvgate.backends.sim.tokenizer import tokenizer_dir

pytestmark = pytest.mark.anyio
MODEL = "kvgate-sim"
PROMPT = " ".join(["alpha beta gamma delta epsilon"] * 40)  # 200 tokens
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}


@asynccontextmanager
async def sim_gateway(
    replicas: int = 2, policy: str = "round_robin", **overrides: Any
) -> AsyncIterator[tuple[SimFleet, Kvgate]]:
    """``replicas`` simulated vLLM replicas (16-token blocks, stream opened at accept) and
    kvgate in front, KV events wired."""
    async with sim_fleet(sim_config(replicas=replicas, block_size=16)) as fleet:
        tokenizer = await anyio.to_thread.run_sync(tokenizer_dir)
        workers = [
            f"{r.url},models={MODEL},events={r.events},replay={r.replay}" for r in fleet.replicas
        ]
        async with kvgate(
            workers, policy=policy, tokenizers=[f"{MODEL}={tokenizer}"], **overrides
        ) as gw:
            yield fleet, gw


def events(text: str) -> list[Any]:
    out = []
    for line in text.split("\n"):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def content(text: str) -> str:
    parts = []
    for event in events(text):
        if isinstance(event, dict):
            for choice in event.get("choices", []):
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def retries(gw: Kvgate, worker: str, reason: str) -> float:
    return gw.metric("kvgate_upstream_retries_total", {"worker": worker, "reason": reason})


def stream_errors(gw: Kvgate, worker: str, reason: str) -> float:
    return gw.metric("kvgate_stream_errors_total", {"worker": worker, "reason": reason})


def assert_load_released(gw: Kvgate) -> None:
    for worker in gw.gateway.scheduler.ledger:
        url = worker.worker.url
        assert worker.in_flight == 0, url
        assert worker.pending_prefill_tokens == 0, url
        assert worker.active_decode_blocks == 0, url


async def replica_fault(fleet: SimFleet, index: int, **body: object) -> None:
    async with httpx.AsyncClient(base_url=fleet.replicas[index].url) as client:
        await fault(client, **body)


@pytest.mark.parametrize(
    ("drop", "reason", "down_at_once"), [(False, "error_event", False), (True, "reset", True)]
)
async def test_a_failure_before_the_first_token_is_retried_elsewhere(
    drop: bool, reason: str, down_at_once: bool
) -> None:
    async with sim_gateway() as (fleet, gw):
        first, second = (r.url for r in fleet.replicas)
        await replica_fault(fleet, 0, kind="abort", count=1, drop=drop)  # round robin: first
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200
        assert r.headers["x-kvgate-worker"] == second
        assert "error" not in r.text
        assert len(content(r.text).split()) == 4
        assert events(r.text)[-1] == "[DONE]"
        assert fleet.replica(0).faults.hits["abort"] == 1
        assert retries(gw, first, reason) == 1
        assert gw.metric("kvgate_failovers_total", {"worker": second, "model": MODEL}) == 1
        ok = {"worker": second, "model": MODEL, "status": "200"}
        assert gw.metric("kvgate_requests_total", ok) == 1
        assert gw.gateway.registry.get(first).healthy is not down_at_once
        assert_load_released(gw)


async def test_a_5xx_is_retried_streaming_and_not() -> None:
    async with sim_gateway() as (fleet, gw):
        first, second = (r.url for r in fleet.replicas)
        for stream in (True, False):
            await replica_fault(fleet, 0, kind="fail", count=1, status=503)
            router = gw.gateway.scheduler.router
            router.policy = type(router.policy)()  # round robin: first
            r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert r.status_code == 200
            assert r.headers["x-kvgate-worker"] == second
        assert retries(gw, first, "http_5xx") == 2
        assert gw.gateway.registry.get(first).healthy  # 5xx: towards the threshold only
        assert_load_released(gw)


async def test_a_replica_crashing_while_requests_wait_loses_none() -> None:
    """Requests accepted (their 200 sent by the engine) and queued when the engine dies are
    answered by the other replica; the dead one is marked down at once."""
    async with sim_gateway() as (fleet, gw):
        first, second = (r.url for r in fleet.replicas)
        await replica_fault(fleet, 0, kind="pause")
        replica = fleet.replica(0)
        results: list[httpx.Response] = []

        async def call(stream: bool) -> None:
            results.append(
                await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            )

        async with anyio.create_task_group() as group:
            for i in range(4):  # round robin: requests 0 and 2 go to the paused replica
                group.start_soon(call, i % 2 == 0)
            await wait_until(lambda: len(replica.engine.waiting) == 2, what="2 queued requests")
            await replica_fault(fleet, 0, kind="crash", downtime_s=30)
        assert [r.status_code for r in results] == [200] * 4
        assert all(r.headers["x-kvgate-worker"] == second for r in results)
        assert all("error" not in r.text for r in results)
        assert retries(gw, first, "reset") == 2
        assert not gw.gateway.registry.get(first).healthy
        assert_load_released(gw)


async def test_no_first_token_in_time_is_retried() -> None:
    # 2 s: the paused replica times out; the other answers well within it on a loaded box
    async with sim_gateway(upstream={"read_timeout_s": 2.0}) as (fleet, gw):
        first, second = (r.url for r in fleet.replicas)
        await replica_fault(fleet, 0, kind="pause")
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200
        assert r.headers["x-kvgate-worker"] == second
        assert retries(gw, first, "timeout") == 1
        await wait_until(lambda: not fleet.replica(0).engine.waiting, what="abandoned request gone")
        assert_load_released(gw)


async def test_when_every_worker_fails_before_a_token_the_client_gets_one_error() -> None:
    async with sim_gateway() as (fleet, gw):
        for index in (0, 1):
            await replica_fault(fleet, index, kind="abort")
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["code"] == "upstream_stream_error"
        assert error["type"] == "upstream_error"
        assert gw.metric("kvgate_stream_errors_total", {}) == 0
        assert_load_released(gw)


@pytest.mark.parametrize(("drop", "reason"), [(False, "engine_error"), (True, "reset")])
async def test_after_tokens_the_stream_ends_with_an_error_event(drop: bool, reason: str) -> None:
    async with sim_gateway() as (fleet, gw):
        first = fleet.replicas[0].url
        await replica_fault(fleet, 0, kind="abort", count=1, after_tokens=2, drop=drop)
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200
        assert r.headers["x-kvgate-worker"] == first  # no retry once tokens went out
        assert len(content(r.text).split()) == 2
        tail = events(r.text)
        assert "error" in tail[-2] and tail[-1] == "[DONE]"
        assert stream_errors(gw, first, reason) == 1
        assert gw.metric("kvgate_upstream_retries_total", {"worker": first, "reason": reason}) == 0
        assert_load_released(gw)


async def test_client_leaving_while_the_engine_holds_its_stream_cancels_upstream() -> None:
    """The engine opened its stream (200) but produced nothing yet; kvgate held it, and the
    client leaving cancels the engine's request at once."""
    async with sim_gateway() as (fleet, gw):
        await replica_fault(fleet, 0, kind="pause")
        replica = fleet.replica(0)
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:

            async def call() -> None:
                await client.post("/v1/chat/completions", json={**CHAT, "stream": True})

            async with anyio.create_task_group() as group:
                group.start_soon(call)
                await wait_until(lambda: len(replica.engine.waiting) == 1, what="request queued")
                group.cancel_scope.cancel()
        await wait_until(lambda: not replica.engine.waiting, what="engine saw the cancel")
        await wait_until(lambda: gw.sent(fleet.replicas[0].url).in_flight == 0)
        assert_load_released(gw)
        labels = {"worker": fleet.replicas[0].url, "model": MODEL, "status": "499"}
        await wait_until(lambda: gw.metric("kvgate_requests_total", labels) == 1, what="499")


async def test_a_retry_is_ranked_again_without_the_failed_worker() -> None:
    """The prefix is cached on the first choice; when it fails, the retry is ranked afresh
    (its prediction is the new worker's, not the failed one's)."""
    async with sim_gateway(replicas=3, policy="kv") as (fleet, gw):
        warm = await gw.client.post("/v1/chat/completions", json=CHAT)
        owner = warm.headers["x-kvgate-worker"]
        index = [r.url for r in fleet.replicas].index(owner)

        async def predicted() -> int:
            explained = (await gw.client.post("/debug/route", json=CHAT)).json()
            return int(next(w for w in explained["workers"] if w["chosen"])["overlap_tokens"])

        await wait_until(predicted, what="the prefix indexed")
        await replica_fault(fleet, index, kind="abort", count=1)
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status_code == 200
        assert r.headers["x-kvgate-worker"] != owner
        assert r.headers["x-kvgate-predicted-cached-tokens"] == "0"
        assert retries(gw, owner, "error_event") == 1
        assert_load_released(gw)


async def test_the_responses_api_is_held_past_its_created_events() -> None:
    async with sim_gateway() as (fleet, gw):
        second = fleet.replicas[1].url
        await replica_fault(fleet, 0, kind="abort", count=1)
        body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 3, "stream": True}
        r = await gw.client.post("/v1/responses", json=body)
        assert r.status_code == 200
        assert r.headers["x-kvgate-worker"] == second
        kinds = [e["type"] for e in events(r.text)]
        assert kinds[0] == "response.created"
        assert kinds.count("response.created") == 1  # the failed attempt's were never sent
        assert "error" not in kinds and kinds[-1] == "response.completed"
        assert retries(gw, fleet.replicas[0].url, "error_event") == 1


# -- whose fault: the request's or the worker's -----------------------------------------------
class BrokenEngine(FakeEngine):
    """An engine whose every generation fails with a 500 (its /health still answers)."""

    async def _generate(self, path: str, body: dict[str, Any], receive: Any, send: Any) -> None:
        await super()._generate(path, {**body, "fake": {"status": 500}}, receive, send)


def generations(engines: list[FakeEngine]) -> int:
    return sum(1 for e in engines for seen in e.seen if seen.path == "/v1/chat/completions")


FAKE_CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_request_failing_alike_on_two_workers_is_its_own_fault() -> None:
    """A poison request (every engine answers it 500) is tried on two workers, not three,
    and charges no worker: a trickle of them cannot mark the fleet down (before: three such
    requests marked every worker down and the other clients got 503)."""
    engines = [FakeEngine(name=f"e{i}") for i in range(3)]
    async with fleet(*engines) as f, kvgate(f.urls) as gw:
        for round_ in range(4):
            for _ in range(3):
                poison = {**FAKE_CHAT, "fake": {"status": 500}}
                r = await gw.client.post("/v1/chat/completions", json=poison)
                assert r.status_code == 500
            ok = await gw.client.post("/v1/chat/completions", json=FAKE_CHAT)
            assert ok.status_code == 200, (round_, ok.text)
        assert generations(engines) == 12 * 2 + 4
        for worker in gw.gateway.registry:
            assert worker.healthy and worker.consecutive_failures == 0, worker.url
        faults = {"reason": "http_5xx"}
        assert gw.metric("kvgate_upstream_request_faults_total", faults) == 12


async def test_a_worker_failing_alone_is_charged_and_marked_down() -> None:
    """A real engine failure on one worker still fails over, and counts towards its health:
    charged when another worker answered the same request."""
    engines: list[FakeEngine] = [BrokenEngine(name="broken"), FakeEngine(name="ok")]
    async with fleet(*engines) as f, kvgate(f.urls) as gw:  # threshold: 3 failures
        broken = gw.gateway.registry.get(f.urls[0])
        for _ in range(30):  # bounded: round robin sends every other request there first
            r = await gw.client.post("/v1/chat/completions", json=FAKE_CHAT)
            assert r.status_code == 200
            assert r.headers["x-kvgate-worker"] == f.urls[1]
            if not broken.healthy:
                break
        assert not broken.healthy
        assert broken.last_error == "answered 500"
        assert retries(gw, f.urls[0], "http_5xx") == 3
        assert gw.metric("kvgate_upstream_request_faults_total", {"reason": "http_5xx"}) == 0
