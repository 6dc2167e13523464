"""Start kvgate (real uvicorn, ``kvgate serve``'s listener configuration) in front of fake
engines for a test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from fakes.engine import FakeEngine
from fakes.server import RunningServer, serve
from kvgate.index.api import BlockIndex
from kvgate.router.app import create_app
from kvgate.router.config import load_settings
from kvgate.router.gateway import Gateway
from kvgate.router.metrics import GatewayRegistry
from kvgate.router.serve import uvicorn_config
from kvgate.scheduling.config import Tuning
from kvgate.scheduling.ledger import WorkerLedger


@dataclass
class Fleet:
    engines: list[FakeEngine]
    servers: list[RunningServer]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]


@dataclass
class Kvgate:
    url: str
    gateway: Gateway
    client: httpx.AsyncClient
    metrics_registry: GatewayRegistry

    def sent(self, url: str) -> WorkerLedger:
        """What kvgate has in flight on the worker at ``url`` (the scheduler's ledger)."""
        return self.gateway.scheduler.ledger.of(self.gateway.registry.get(url))

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.metrics_registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else value


@asynccontextmanager
async def fleet(*engines: FakeEngine) -> AsyncIterator[Fleet]:
    async with AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(serve(e)) for e in engines]
        yield Fleet(list(engines), servers)


def quiet_health(**extra: Any) -> dict[str, Any]:
    """Health settings for tests: probes only at start (and when a test calls them)."""
    return {"interval_s": 3600, "metrics_interval_s": 0, **extra}


@asynccontextmanager
async def kvgate(
    workers: Sequence[str | dict[str, Any]],
    *,
    block_index: BlockIndex | None = None,
    tuning: Tuning | None = None,
    **overrides: Any,
) -> AsyncIterator[Kvgate]:
    """kvgate serving ``workers`` (settings ``overrides``; ``tuning``: the scheduler's
    internal constants, as benchmarks vary them)."""
    overrides.setdefault("health", quiet_health())
    overrides.setdefault("policy", "round_robin")
    settings = load_settings(overrides={"workers": list(workers), **overrides})
    registry = GatewayRegistry()
    app = create_app(settings, block_index=block_index, metrics_registry=registry, tuning=tuning)
    config = uvicorn_config(app, settings, log_level="warning", timeout_graceful_shutdown=2)
    async with (
        serve(app, config=config) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10.0) as client,
    ):
        yield Kvgate(server.url, app.state.gateway, client, registry)
