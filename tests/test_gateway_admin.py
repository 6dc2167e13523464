"""Auth, admin API, /debug/route, health checks, load scraping and /metrics."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import quote

import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate, quiet_health
from fakes.wait import wait_until

from kvgate.index.api import PromptInput, PromptKeys, TokenizeOn
from kvgate.index.types import BlockKey, PrefixMatch, WorkerId

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def test_client_keys_and_upstream_keys_never_leak() -> None:
    engine = FakeEngine()
    async with fleet(engine) as f:
        worker = {"url": f.urls[0], "api_key": "upstream-secret"}
        async with kvgate([worker], api_keys=["client-key"]) as gw:
            r = await gw.client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            bad = {"authorization": "Bearer nope"}
            assert (
                await gw.client.post("/v1/chat/completions", json=CHAT, headers=bad)
            ).status_code == 401
            assert (await gw.client.get("/v1/models")).status_code == 401
            good = {"authorization": "Bearer client-key"}
            r = await gw.client.post("/v1/chat/completions", json=CHAT, headers=good)
            assert r.status_code == 200
            assert engine.seen[-1].headers["authorization"] == "Bearer upstream-secret"
            assert "upstream-secret" not in str(r.headers) and "upstream-secret" not in r.text
            admin = await gw.client.get("/admin/workers")
            assert "upstream-secret" not in admin.text
            assert (await gw.client.get("/health")).status_code == 200
            assert (await gw.client.get("/metrics")).status_code == 200


async def test_admin_token_guards_admin_and_debug() -> None:
    async with (
        fleet(FakeEngine()) as f,
        kvgate(f.urls, admin_token="adm-token", api_keys=["ck"]) as gw,
    ):
        assert (await gw.client.get("/admin/workers")).status_code == 401
        client_key = {"authorization": "Bearer ck"}
        assert (await gw.client.get("/admin/workers", headers=client_key)).status_code == 401
        assert (
            await gw.client.post("/debug/route", json=CHAT, headers=client_key)
        ).status_code == 401
        token = {"authorization": "Bearer adm-token"}
        r = await gw.client.get("/admin/workers", headers=token)
        assert r.status_code == 200
        assert r.json()["workers"][0]["url"] == f.urls[0]


async def test_add_and_remove_workers_at_run_time() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    async with fleet(a, b) as f, kvgate(f.urls[:1]) as gw:
        r = await gw.client.post("/admin/workers", json={"url": f.urls[1]})
        assert r.status_code == 201
        assert r.json()["healthy"] is True and r.json()["models"] == ["fake-model"]
        assert (await gw.client.post("/admin/workers", json={"url": f.urls[1]})).status_code == 409
        assert (await gw.client.post("/admin/workers", json={"url": "ftp://x"})).status_code == 400
        used = {
            (await gw.client.post("/v1/chat/completions", json=CHAT)).headers["x-kvgate-worker"]
            for _ in range(4)
        }
        assert used == set(f.urls)
        r = await gw.client.delete(f"/admin/workers/{quote(f.urls[0], safe='')}")
        assert r.status_code == 200
        used = {
            (await gw.client.post("/v1/chat/completions", json=CHAT)).headers["x-kvgate-worker"]
            for _ in range(3)
        }
        assert used == {f.urls[1]}
        assert (
            await gw.client.delete(f"/admin/workers/{quote(f.urls[0], safe='')}")
        ).status_code == 404
        r = await gw.client.post("/admin/workers", json=f"{f.urls[0]},models=fake-model")
        assert r.status_code == 201  # the CLI form works too (a JSON string)
        listed = (await gw.client.get("/admin/workers")).json()["workers"]
        assert sorted(w["url"] for w in listed) == sorted(f.urls)


async def test_active_health_checks_mark_down_and_recover() -> None:
    engine = FakeEngine()
    async with fleet(engine) as f, kvgate(f.urls, health=quiet_health(failure_threshold=2)) as gw:
        worker = gw.gateway.registry.get(f.urls[0])
        engine.healthy = False
        await gw.gateway.health.probe_all()
        assert worker.healthy  # one failure, threshold 2
        await gw.gateway.health.probe_all()
        assert not worker.healthy
        assert (await gw.client.get("/ready")).status_code == 503
        assert (await gw.client.get("/v1/models")).json()["data"] == []
        engine.healthy = True
        await gw.gateway.health.probe_all()
        assert worker.healthy
        assert (await gw.client.get("/ready")).json()["healthy_workers"] == 1


async def test_periodic_probes_run_on_their_own() -> None:
    engine = FakeEngine()
    health = {"interval_s": 0.02, "failure_threshold": 1, "metrics_interval_s": 0.02}
    engine.waiting = 4
    async with fleet(engine) as f, kvgate(f.urls, health=health) as gw:
        worker = gw.gateway.registry.get(f.urls[0])
        await wait_until(lambda: worker.scraped.waiting == 4, what="periodic scrape")
        engine.healthy = False
        await wait_until(lambda: not worker.healthy, what="periodic probe to mark it down")
        engine.healthy = True
        await wait_until(lambda: worker.healthy, what="periodic probe to recover it")


async def test_passive_marking_on_server_errors() -> None:
    """A 5xx may be the request's fault: it is charged to a worker only once another worker
    answered the same request (tests/test_gateway_retry.py), so the only worker answering
    5xx stays healthy; a client error clears the count."""
    async with (
        fleet(FakeEngine()) as f,
        kvgate(f.urls, health=quiet_health(failure_threshold=2)) as gw,
    ):
        worker = gw.gateway.registry.get(f.urls[0])
        worker.consecutive_failures = 1  # (a failed probe)
        r = await gw.client.post("/v1/chat/completions", json={**CHAT, "fake": {"status": 400}})
        assert r.status_code == 400
        assert worker.consecutive_failures == 0  # a client error is not the engine's fault
        for status in (500, 502, 503):
            body = {**CHAT, "fake": {"status": status}}
            assert (await gw.client.post("/v1/chat/completions", json=body)).status_code == status
        assert worker.healthy and worker.consecutive_failures == 0


async def test_scraped_load_reaches_candidates_and_metrics() -> None:
    engine = FakeEngine(running=3, waiting=2, kv_usage=0.5)
    async with fleet(engine) as f, kvgate(f.urls) as gw:
        await gw.gateway.health.scrape_all()
        registry = gw.gateway.registry
        (candidate,) = gw.gateway.scheduler.ledger.candidates(registry.serving("fake-model"))
        assert candidate.load.scraped_running == 3
        assert candidate.load.scraped_waiting == 2
        assert candidate.load.scraped_kv_usage == 0.5
        assert gw.metric("kvgate_worker_scraped_waiting", {"worker": f.urls[0]}) == 2


async def test_metrics_endpoint_exposes_gateway_metrics() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        await gw.client.post("/v1/chat/completions", json=CHAT)
        await gw.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        await gw.client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        text = (await gw.client.get("/metrics")).text
        for name in (
            "kvgate_requests_total",
            "kvgate_time_to_first_token_seconds_bucket",
            "kvgate_request_duration_seconds_bucket",
            "kvgate_router_overhead_seconds_bucket",
            "kvgate_worker_in_flight",
            "kvgate_worker_blocked_requests",
            "kvgate_worker_healthy",
            "kvgate_upstream_retries_total",
            "kvgate_failovers_total",
        ):
            assert name in text, name
        ok = {"worker": f.urls[0], "model": "fake-model", "status": "200"}
        assert gw.metric("kvgate_requests_total", ok) == 2
        missing = {"worker": "none", "model": "unknown", "status": "404"}
        assert gw.metric("kvgate_requests_total", missing) == 1
        assert gw.metric("kvgate_router_overhead_seconds_count") == 2
        assert gw.metric("kvgate_worker_healthy", {"worker": f.urls[0]}) == 1
        assert gw.metric("kvgate_worker_blocked_requests", {"worker": f.urls[0]}) == 0


class TableIndex:
    """A BlockIndex test double: fixed keys per prompt, fixed matches per worker."""

    def __init__(self, matches: Mapping[str, PrefixMatch], blocks: int = 4) -> None:
        self.matches = {WorkerId(w): m for w, m in matches.items()}
        self.blocks = blocks
        self.routed: list[tuple[str, int]] = []

    async def keys_for(
        self, model: str, prompt: PromptInput, *, tokenize_on: TokenizeOn | None = None
    ) -> PromptKeys:
        keys = [BlockKey(i + 1) for i in range(self.blocks)]
        return PromptKeys(keys, block_size=16, prompt_tokens=self.blocks * 16 + 5, mode="tokenizer")

    def match(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, PrefixMatch]:
        return self.matches

    def rank_matches(
        self, keys: Sequence[BlockKey]
    ) -> Mapping[WorkerId, Mapping[int, PrefixMatch]]:
        return {}

    def record_routed(self, worker: WorkerId, keys: Sequence[BlockKey]) -> None:
        self.routed.append((worker, len(keys)))


async def test_debug_route_explains_and_headers_predict() -> None:
    async with fleet(FakeEngine("a", cached_tokens=32), FakeEngine("b")) as f:
        index = TableIndex({f.urls[0]: PrefixMatch(gpu=1, cpu=1), f.urls[1]: PrefixMatch(gpu=3)})
        async with kvgate(f.urls, block_index=index, policy="kv") as gw:
            r = await gw.client.post("/debug/route", json=CHAT)
            assert r.status_code == 200
            explained = r.json()
            assert explained["chosen"] == f.urls[1]
            assert explained["tokenize_mode"] == "tokenizer" and explained["request_blocks"] == 4
            by_url = {w["worker"]: w for w in explained["workers"]}
            assert by_url[f.urls[0]]["matched_blocks"] == {"gpu": 1, "cpu": 1, "disk": 0}
            assert by_url[f.urls[1]]["overlap_tokens"] == 48
            for entry in by_url.values():
                assert {"prefill_blocks", "decode_blocks", "cost", "reason"} <= set(entry)
            assert by_url[f.urls[1]]["chosen"] and not by_url[f.urls[0]]["chosen"]
            assert index.routed == []  # explaining sends nothing

            r = await gw.client.post("/v1/chat/completions", json=CHAT)
            assert r.headers["x-kvgate-worker"] == f.urls[1]
            assert r.headers["x-kvgate-predicted-cached-tokens"] == "48"
            assert index.routed == [(f.urls[1], 4)]
            labels = {"worker": f.urls[1], "model": "fake-model"}
            assert gw.metric("kvgate_predicted_cached_tokens_total", labels) == 48
            assert gw.metric("kvgate_best_available_cached_tokens_total", labels) == 48


@pytest.mark.parametrize(("kv_index", "mode"), [(True, "approx"), (False, None)])
async def test_debug_route_lists_ineligible_workers(kv_index: bool, mode: str | None) -> None:
    """With the built-in index and no tokenizer nor events, keys are approximate."""
    engines = fleet(FakeEngine("a"), FakeEngine("b", models=["other"]))
    async with engines as f, kvgate(f.urls, kv_index=kv_index) as gw:
        explained = (await gw.client.post("/debug/route", json=CHAT)).json()
        assert explained["chosen"] == f.urls[0]
        assert explained["tokenize_mode"] == mode
        other = next(w for w in explained["workers"] if w["worker"] == f.urls[1])
        assert other["eligible"] is False and "does not serve" in other["reason"]
