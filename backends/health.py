"""Active health checks, model discovery and load scraping of every worker.

* every ``interval_s``: ``GET /health`` (failure threshold, recovery threshold); a worker
  without configured models gets them from its ``/v1/models`` whenever it (re)becomes
  healthy;
* every ``metrics_interval_s``: ``GET /metrics`` parsed by the engine's adapter into
  ``Worker.scraped``.

Passive marking (connect errors, 5xx) is done by the proxy through the same registry.
Answers are read up to ``_MAX_ANSWER_BYTES`` (a worker cannot make kvgate buffer more); a
removed worker's failures are no longer counted (its series are dropped by the gateway).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter

from backends.config import HealthConfig
from backends.engines import ScrapedLoad
from backends.registry import Worker, WorkerRegistry

log = logging.getLogger("kvgate.health")
_MAX_ANSWER_BYTES = 16 * 1024 * 1024  # a probe, model list or /metrics page


class HealthMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.probe_failures = Counter(
            "kvgate_health_probe_failures",
            "Failed active health probes",
            ["worker"],
            registry=registry,
        )
        self.scrape_failures = Counter(
            "kvgate_metrics_scrape_failures",
            "Failed scrapes of an engine's /metrics",
            ["worker"],
            registry=registry,
        )

    def probe_failed(self, worker: Worker) -> None:
        if not worker.removed:  # a removed worker's series are gone: do not bring them back
            self.probe_failures.labels(worker.url).inc()

    def scrape_failed(self, worker: Worker) -> None:
        if not worker.removed:
            self.scrape_failures.labels(worker.url).inc()


class _Models(msgspec.Struct):
    data: list[dict[str, Any]]


_decode_models = msgspec.json.Decoder(_Models).decode


def _headers(worker: Worker) -> dict[str, str]:
    headers = {"accept-encoding": "identity"}  # the size cap counts what the worker sends
    authorization = worker.config.authorization()
    if authorization is not None:
        headers["authorization"] = authorization
    return headers


@dataclass(frozen=True, slots=True)
class _Answer:
    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class HealthChecker:
    """Keeps ``Worker.healthy``, ``Worker.models`` and ``Worker.scraped`` current."""

    def __init__(
        self,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        config: HealthConfig,
        metrics: HealthMetrics,
    ) -> None:
        self._registry = registry
        self._client = client
        self._config = config
        self._metrics = metrics
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._tasks.append(
            asyncio.create_task(self._every(self._config.interval_s, self.probe_all))
        )
        if self._config.metrics_interval_s > 0:
            interval = self._config.metrics_interval_s
            self._tasks.append(asyncio.create_task(self._every(interval, self.scrape_all)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _every(self, interval: float, action: Any) -> None:
        while True:
            await asyncio.sleep(interval)
            await action()

    # -- health -----------------------------------------------------------------------
    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self._registry))

    async def probe(self, worker: Worker) -> bool:
        """One health probe (plus model discovery when due); returns the new health."""
        try:
            response = await self._get(worker, worker.adapter.health_path)
            if response.status_code != 200:
                raise _ProbeFailed(
                    f"GET {worker.adapter.health_path} answered {response.status_code}"
                )
            if worker.config.models is None and (not worker.healthy or not worker.models):
                await self.discover(worker)
        except (httpx.HTTPError, _ProbeFailed) as exc:
            self._metrics.probe_failed(worker)
            self._registry.record_failure(worker, f"health probe: {exc or type(exc).__name__}")
            return worker.healthy
        if not worker.removed:
            self._registry.record_success(worker)
        return worker.healthy

    async def discover(self, worker: Worker) -> None:
        """Read the models a worker serves from its ``/v1/models``."""
        response = await self._get(worker, worker.adapter.models_path)
        if response.status_code != 200:
            raise _ProbeFailed(f"GET {worker.adapter.models_path} answered {response.status_code}")
        try:
            models = _decode_models(response.content).data
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _ProbeFailed(f"unreadable model list: {exc}") from exc
        cards = {str(m["id"]): m for m in models if isinstance(m.get("id"), str)}
        if not cards:
            raise _ProbeFailed("the worker lists no models")
        worker.set_models(cards)

    # -- load -------------------------------------------------------------------------
    async def scrape_all(self) -> None:
        await asyncio.gather(
            *(self.scrape(w) for w in self._registry if w.healthy and w.adapter.scrapes_load)
        )

    async def scrape(self, worker: Worker) -> None:
        path = worker.adapter.metrics_path
        if path is None:
            return
        try:
            response = await self._get(worker, path)
            if response.status_code != 200:
                raise _ProbeFailed(f"GET {path} answered {response.status_code}")
            worker.scraped = worker.adapter.parse_load(response.text)
        except (httpx.HTTPError, _ProbeFailed, ValueError) as exc:
            self._metrics.scrape_failed(worker)
            log.debug("scrape of %s failed: %s", worker.url, exc)
            worker.scraped = ScrapedLoad()

    async def _get(self, worker: Worker, path: str) -> _Answer:
        """``GET`` one of the worker's paths: the whole answer within ``timeout_s`` (a
        trickling worker cannot stall the probe round), up to ``_MAX_ANSWER_BYTES``."""
        timeout = self._config.timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._read(worker.url + path, _headers(worker))
        except TimeoutError as exc:
            raise _ProbeFailed(f"GET {path}: no whole answer within {timeout:g} s") from exc

    async def _read(self, url: str, headers: dict[str, str]) -> _Answer:
        timeout = self._config.timeout_s  # also httpx's, for its own pool and connect waits
        async with self._client.stream("GET", url, headers=headers, timeout=timeout) as response:
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > _MAX_ANSWER_BYTES:
                    raise _ProbeFailed(f"answer over {_MAX_ANSWER_BYTES} bytes")
                chunks.append(chunk)
        return _Answer(response.status_code, b"".join(chunks))


class _ProbeFailed(Exception):
    """A probe got an answer, but not a healthy one."""
