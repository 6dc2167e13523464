"""``--discover`` wired into the real gateway (create_app under uvicorn, real engines over HTTP).

1. Real DNS: ``dns://localhost:PORT`` resolves to 127.0.0.1 and the engine there is routed to.
2. Pods coming and going (scripted resolver, engines on 127.0.0.1 and 127.0.0.2 at one port):
   a new address is added, a vanished one is drained (its in-flight stream finishes, no new
   request goes to it) and forgotten by the index; a DNS failure changes nothing.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import httpx
import pytest
from fakes.server import serve
from fakes.wait import wait_until
from prometheus_client import CollectorRegistry
from test_deploy_shutdown import MODEL, GatedEngine

from kvgate.backends.discovery import DiscoveredFleet
from kvgate.router.app import create_app
from kvgate.router.config import ConfigError, load_settings
from kvgate.router.gateway import Gateway

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def serve_on(
    app: Any, host: str, port: int = 0, *, lifespan: Literal["on", "off"] = "off"
) -> AsyncIterator[int]:
    """Run ``app`` under uvicorn on ``host:port`` (0: any free port); yields the port."""
    async with serve(app, lifespan=lifespan, port=port, host=host) as running:
        yield running.port


class ScriptedDns:
    def __init__(self, answer: list[str] | None) -> None:
        self.answer = answer
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls += 1
        if self.answer is None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return list(self.answer)


def settings_for(discover: str, **extra: Any) -> Any:
    return load_settings(
        overrides={
            "discover": [discover],
            "policy": "least_loaded",
            "health": {"interval_s": 3600, "metrics_interval_s": 0},
            **extra,
        }
    )


async def test_real_dns_localhost_worker_is_discovered_and_routed_to() -> None:
    engine = GatedEngine()
    async with serve_on(engine, "127.0.0.1") as engine_port:
        url = f"dns://localhost:{engine_port}?events_port=auto&replay_port=auto&interval=0.05"
        registry = CollectorRegistry()
        app = create_app(settings_for(url), metrics_registry=registry)
        async with (
            serve_on(app, "127.0.0.1", lifespan="on") as port,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client,
        ):
            workers = (await client.get("/admin/workers")).json()
            assert [w["url"] for w in workers["workers"]] == [f"http://127.0.0.1:{engine_port}"]
            assert (await client.get("/ready")).status_code == 200
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True, "hold": False}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200
            assert response.headers["x-kvgate-worker"] == f"http://127.0.0.1:{engine_port}"
            assert response.text.rstrip().endswith("data: [DONE]")
            metrics = (await client.get("/metrics")).text
            assert f'kvgate_discovery_workers{{target="localhost:{engine_port}"}} 1.0' in metrics


async def test_vanished_pod_is_drained_and_forgotten() -> None:
    engine_a, engine_b = GatedEngine(), GatedEngine()
    async with (
        serve_on(engine_a, "127.0.0.1") as engine_port,
        serve_on(engine_b, "127.0.0.2", engine_port),
    ):
        url_a, url_b = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.2:{engine_port}"
        dns = ScriptedDns(["127.0.0.1", "127.0.0.2"])
        target = f"dns://engines.test:{engine_port}?events_port=auto&interval=0.02&remove_after=1"
        registry = CollectorRegistry()
        app = create_app(settings_for(target), metrics_registry=registry)
        gateway: Gateway = app.state.gateway
        assert gateway.discovery is not None
        gateway.discovery = DiscoveredFleet(  # the same wiring, with a scripted resolver
            [target],
            add=gateway.add_worker,
            remove=gateway.remove_worker,
            exists=lambda url: gateway.registry.find(url) is not None,
            registry=CollectorRegistry(),
            resolver=dns,
        )
        async with (
            serve_on(app, "127.0.0.1", lifespan="on") as port,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client,
        ):
            assert {w.url for w in gateway.registry} == {url_a, url_b}
            await wait_until(lambda: gateway.registry.healthy_count() == 2, 10, "both healthy")

            # a long stream lands on B (A is busy with one of its own)
            first = asyncio.Event()
            streams: dict[str, list[str]] = {}

            async def stream(tag: str) -> None:
                body = {"model": MODEL, "prompt": tag, "max_tokens": 4, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    streams[tag] = [response.headers["x-kvgate-worker"]]
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            streams[tag].append(line.removeprefix("data: "))
                            first.set()

            held = [asyncio.create_task(stream("one")), asyncio.create_task(stream("two"))]
            await wait_until(
                lambda: len(streams) == 2 and all(len(s) > 1 for s in streams.values()), 10
            )
            assert {s[0] for s in streams.values()} == {url_a, url_b}
            on_b = next(tag for tag, s in streams.items() if s[0] == url_b)

            dns.answer = ["127.0.0.1"]  # pod B leaves the headless Service
            await wait_until(lambda: gateway.registry.find(url_b) is None, 10, "B removed")
            assert gateway.index is not None
            assert url_b not in gateway.index.workers()

            body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True, "hold": False}
            for _ in range(3):
                response = await client.post("/v1/completions", json=body)
                assert response.headers["x-kvgate-worker"] == url_a

            engine_a.release.set()
            engine_b.release.set()
            await asyncio.wait_for(asyncio.gather(*held), 10)
            assert streams[on_b][-1] == "[DONE]"  # drained: B's in-flight stream finished
            assert len(streams[on_b]) == 1 + 5

            dns.answer = None  # a DNS outage keeps the last known set
            calls = dns.calls
            await wait_until(lambda: dns.calls >= calls + 3, 10, "failed resolutions")
            assert [w.url for w in gateway.registry] == [url_a]

            dns.answer = ["127.0.0.1", "127.0.0.2"]  # B is back (a new pod, same address)
            await wait_until(lambda: gateway.registry.find(url_b) is not None, 10, "B re-added")


async def test_statically_configured_worker_is_never_removed_by_discovery() -> None:
    engine = GatedEngine()
    async with serve_on(engine, "127.0.0.1") as engine_port:
        static = f"http://127.0.0.1:{engine_port}"
        target = f"dns://engines.test:{engine_port}?events_port=auto&interval=0.02&remove_after=1"
        app = create_app(
            settings_for(target, workers=[f"{static},models={MODEL}"]),
            metrics_registry=CollectorRegistry(),
        )
        gateway: Gateway = app.state.gateway
        dns = ScriptedDns(["127.0.0.1"])
        gateway.discovery = DiscoveredFleet(
            [target],
            add=gateway.add_worker,
            remove=gateway.remove_worker,
            exists=lambda url: gateway.registry.find(url) is not None,
            registry=CollectorRegistry(),
            resolver=dns,
        )
        async with serve_on(app, "127.0.0.1", lifespan="on"):
            assert gateway.discovery.owned == set()
            dns.answer = []
            calls = dns.calls
            await wait_until(lambda: dns.calls >= calls + 3, 10, "resolutions")
            assert [w.url for w in gateway.registry] == [static]


def test_invalid_discovery_url_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"discover.*unknown option 'evnts_port'"):
        load_settings(overrides={"discover": ["dns://vllm:8000?evnts_port=1"]})
