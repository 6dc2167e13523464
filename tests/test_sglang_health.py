"""SGLang at kvgate's defaults (issue 50, part 1): health on its cheap ``/ready`` (its
``/health`` runs a generation and sleeps a second, past kvgate's 1 s probe timeout), on
``/health`` with a longer timeout where ``/ready`` does not exist; why a worker is not healthy,
in the log (once per reason) and in ``/ready`` (by position, without addresses); its KV
capacity and page size from ``/server_info`` (``/get_server_info`` only where that is 404).

Real uvicorn kvgate, fake SGLang servers written here (real HTTP), no mocks."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import pytest
from fakes.engine import FakeEngine
from fakes.engine import _json as send_json
from fakes.gateway import fleet, kvgate, quiet_health

pytestmark = pytest.mark.anyio

SLOW_HEALTH_S = 1.2  # SGLang's /health: one generation, then a 1 s sleep before its check


@dataclass
class FakeSglang(FakeEngine):
    """SGLang's health, readiness and server-info paths as 0.5.23 serves them."""

    ready: bool = True
    has_ready: bool = True  # older SGLang: no /ready
    has_server_info: bool = True  # older SGLang: /get_server_info only
    page_size: int = 32
    max_total_num_tokens: int = 40960

    def paths(self) -> list[str]:
        return [seen.path for seen in self.seen]

    async def _route(self, method: str, path: str, body: Any, receive: Any, send: Any) -> None:
        match (method, path):
            case ("GET", "/ready") if self.has_ready:
                await send_json(send, {}, 200 if self.ready else 503)
            case ("GET", "/health"):
                await asyncio.sleep(SLOW_HEALTH_S)
                await send_json(send, {}, 200 if self.ready else 503)
            case ("GET", "/server_info") if self.has_server_info:
                await send_json(send, self._info())
            case ("GET", "/get_server_info"):
                await send_json(send, self._info())
            case _:
                await super()._route(method, path, body, receive, send)

    def _metrics(self) -> str:
        return "sglang:num_running_reqs 1.0\nsglang:num_queue_reqs 0.0\nsglang:token_usage 0.25\n"

    def _info(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size,
            "max_total_num_tokens": self.max_total_num_tokens,
            "kv_events": {"endpoint_port_base": 5557, "dp_size": 1, "block_size": 32},
        }


def _sglang(url: str) -> str:
    return f"{url},engine=sglang"


def _patient(**extra: Any) -> dict[str, Any]:
    """Health settings for tests whose subject is not the probe timeout (a loaded machine
    can stall a start probe past the default 1 s)."""
    return quiet_health(timeout_s=5.0, **extra)


async def test_sglang_is_healthy_at_the_default_probe_timeout() -> None:
    engine = FakeSglang()
    async with fleet(engine) as f, kvgate([_sglang(f.urls[0])], health=quiet_health()) as gw:
        for _ in range(3):  # a loaded machine may stall one start probe past 1 s
            if gw.gateway.registry.healthy_count():
                break
            await gw.gateway.health.probe_all()
        ready = await gw.client.get("/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["healthy_workers"] == 1
        assert "/health" not in engine.paths()  # the slow path is never waited on


async def test_an_sglang_without_ready_is_probed_on_health_with_time_to_answer() -> None:
    engine = FakeSglang(has_ready=False)
    async with fleet(engine) as f, kvgate([_sglang(f.urls[0])], health=quiet_health()) as gw:
        assert (await gw.client.get("/ready")).status_code == 200
        assert engine.paths()[:2] == ["/ready", "/health"]


async def test_why_a_worker_is_not_healthy_is_said_once_and_shown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "kvgate.health")
    good, bad = FakeSglang("good"), FakeSglang("bad", ready=False)
    async with fleet(good, bad) as f:
        workers = [_sglang(url) for url in f.urls]
        async with kvgate(workers, health=_patient(failure_threshold=1)) as gw:
            for _ in range(3):
                await gw.gateway.health.probe_all()
            ready = await gw.client.get("/ready")
            assert ready.status_code == 200
            body = ready.json()
            assert body["unhealthy"] == {"1": "health probe: GET /ready answered 503"}
            assert "127.0.0.1" not in ready.text  # /ready is open: no addresses
            said = [r.getMessage() for r in caplog.records if f.urls[1] in r.getMessage()]
            assert said == [f"{f.urls[1]} is not healthy: health probe: GET /ready answered 503"]
            bad.ready = True
            await gw.gateway.health.probe_all()
            said = [r.getMessage() for r in caplog.records if f.urls[1] in r.getMessage()]
            assert said[1:] == [f"{f.urls[1]} is healthy again"]
            assert "unhealthy" not in (await gw.client.get("/ready")).json()


async def test_a_worker_that_is_down_says_why_without_its_address() -> None:
    async with fleet(FakeSglang()) as f:
        gone = "http://127.0.0.1:9,engine=sglang"  # nothing listens on port 9
        async with kvgate([_sglang(f.urls[0]), gone], health=_patient()) as gw:
            ready = await gw.client.get("/ready")
            reason = ready.json()["unhealthy"]["1"]
            assert reason.startswith("health probe: ") and "127.0.0.1" not in reason
            assert ":9" not in reason


async def test_sglang_page_size_and_kv_capacity_come_from_server_info() -> None:
    engine = FakeSglang(page_size=32, max_total_num_tokens=40960)
    health = _patient(metrics_interval_s=3600)
    async with fleet(engine) as f, kvgate([_sglang(f.urls[0])], health=health) as gw:
        worker = gw.gateway.registry.get(f.urls[0])
        assert (worker.facts.block_size, worker.facts.kv_capacity_blocks) == (32, 1280)
        await gw.gateway.health.scrape(worker)
        assert worker.scraped.kv_capacity_blocks == 1280  # what the KV fit weighs usage by
        assert (worker.scraped.running, worker.scraped.kv_usage) == (1, 0.25)
        assert "/get_server_info" not in engine.paths()  # deprecated: logged on every call


async def test_an_older_sglang_server_info_is_read_at_its_old_path() -> None:
    engine = FakeSglang(has_server_info=False, page_size=16, max_total_num_tokens=8192)
    async with fleet(engine) as f, kvgate([_sglang(f.urls[0])], health=_patient()) as gw:
        worker = gw.gateway.registry.get(f.urls[0])
        assert (worker.facts.block_size, worker.facts.kv_capacity_blocks) == (16, 512)
        paths = engine.paths()
        assert paths.index("/server_info") < paths.index("/get_server_info")
