"""Active health checks, model discovery and load scraping of every worker.

* every ``interval_s``: ``GET /health`` (failure threshold, recovery threshold); whenever a
  worker (re)becomes healthy, its models from ``/v1/models`` (unless configured) and the engine
  facts it declares (block size, on its ``/metrics``);
* every ``models_interval_s``, and soon after a worker answered 404 for a model it listed:
  those again, so adapters loaded or unloaded at run time are followed;
* every ``metrics_interval_s``: ``GET /metrics`` parsed by the engine's adapter into
  ``Worker.scraped``.

Passive marking (connect errors, 5xx) is done by the proxy through the same registry.
Answers are read up to ``_MAX_ANSWER_BYTES`` (a worker cannot make kvgate buffer more) and
JSON through ``index.jsonsafe`` (depth-capped); a removed worker's failures are no longer
counted (its series are dropped by the gateway). Whatever a worker answers costs at most
its own round: an error nothing foresaw is logged, counted
(``kvgate_health_round_failures_total``) and, for a probe, a failure with its reason.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter

from kvgate.backends.config import HealthConfig
from kvgate.backends.engines import EngineFacts, ScrapedLoad
from kvgate.backends.registry import Worker, WorkerRegistry
from kvgate.index.errors import JsonDecodeError
from kvgate.index.jsonsafe import decode_json_as
from kvgate.index.types import WorkerId

log = logging.getLogger("kvgate.health")
_MAX_ANSWER_BYTES = 16 * 1024 * 1024  # a probe or /metrics page
_MODELS_MIN_GAP_S = 0.5  # model lists re-read at most this often (404 storms)
_MAX_REASON = 200  # characters of an unexpected error kept as a worker's last_error
_LOOPS = ("probe", "models", "scrape")


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
        self.round_failures = Counter(
            "kvgate_health_round_failures",
            "Rounds of the health checker's loops (probe, models, scrape) lost to an "
            "unexpected error, per worker or whole (logged with its traceback; the loop goes on)",
            ["loop"],
            registry=registry,
        )
        for loop in _LOOPS:
            self.round_failures.labels(loop)

    def declare(self, worker: str) -> None:
        """Start ``worker``'s series at zero (a dashboard shows 0 before the first failure)."""
        self.probe_failures.labels(worker)
        self.scrape_failures.labels(worker)

    def probe_failed(self, worker: Worker) -> None:
        if not worker.removed:  # a removed worker's series are gone: do not bring them back
            self.probe_failures.labels(worker.url).inc()

    def round_failed(self, loop: str) -> None:
        self.round_failures.labels(loop).inc()

    def scrape_failed(self, worker: Worker) -> None:
        if not worker.removed:
            self.scrape_failures.labels(worker.url).inc()


class _Models(msgspec.Struct):
    data: list[dict[str, Any]]


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
        self._said: dict[WorkerId, str] = {}  # why each unhealthy worker is, as last logged

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._tasks.append(
            asyncio.create_task(self._every(self._config.interval_s, self.probe_all, "probe"))
        )
        if self._config.metrics_interval_s > 0:
            interval = self._config.metrics_interval_s
            scrape = self._every(interval, self.scrape_all, "scrape")
            self._tasks.append(asyncio.create_task(scrape))
        self._tasks.append(asyncio.create_task(self._follow_models()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _every(self, interval: float, action: Any, loop: str) -> None:
        while True:
            await asyncio.sleep(interval)
            await _supervised(action, self._metrics, loop)

    async def _follow_models(self) -> None:
        """Every ``models_interval_s``, every healthy worker's models and engine facts read
        again; at once (at most every ``_MODELS_MIN_GAP_S``) those of a worker that answered
        404 for a model it listed."""
        interval = self._config.models_interval_s
        stale = self._registry.stale_models
        while True:
            due = False
            try:
                async with asyncio.timeout(interval if interval > 0 else None):
                    await stale.wait()
            except TimeoutError:
                due = True
            stale.clear()
            refresh = functools.partial(self.refresh_models, every=due)
            await _supervised(refresh, self._metrics, "models")
            await asyncio.sleep(_MODELS_MIN_GAP_S)

    async def refresh_models(self, *, every: bool = True) -> None:
        """Read the models (and engine facts) of every healthy worker again (``every``), or of
        those marked stale; a worker that cannot answer keeps what it had."""
        workers = [w for w in self._registry if w.healthy and (every or w.models_stale)]
        await asyncio.gather(*(self._refresh(w) for w in workers))

    async def _refresh(self, worker: Worker) -> None:
        try:
            await self.discover(worker)
        except (httpx.HTTPError, _ProbeFailed) as exc:
            worker.models_stale = False
            log.info("%s: models not read again: %s", worker.url, exc or type(exc).__name__)
        except Exception:  # the worker's supervisor: this read is lost, not the others
            worker.models_stale = False
            self._metrics.round_failed("models")
            log.exception("%s: models not read again", worker.url)

    # -- health -----------------------------------------------------------------------
    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self._registry))

    async def probe(self, worker: Worker) -> bool:
        """One health probe (plus model discovery when due); returns the new health. Whatever
        the worker answers costs at most this probe: a failure, with its reason."""
        try:
            await self._check_health(worker)
            if not worker.healthy or not worker.models:
                await self.discover(worker)
        except (httpx.HTTPError, _ProbeFailed) as exc:
            return self._probe_failed(worker, str(exc) or type(exc).__name__)
        except Exception as exc:  # the worker's supervisor: this probe fails, nothing else
            self._metrics.round_failed("probe")
            log.exception("%s: health probe failed", worker.url)
            return self._probe_failed(worker, f"{type(exc).__name__}: {exc}"[:_MAX_REASON])
        if not worker.removed:
            self._registry.record_success(worker)
            self._tell(worker)
        return worker.healthy

    def _probe_failed(self, worker: Worker, reason: str) -> bool:
        self._metrics.probe_failed(worker)
        self._registry.record_failure(worker, f"health probe: {reason}")
        self._tell(worker)
        return worker.healthy

    async def _check_health(self, worker: Worker) -> None:
        """``GET`` the engine's health path (200 or ``_ProbeFailed``); where it is 404 (an
        older engine), its fallback path with the timeout that path needs."""
        path = worker.adapter.health_path
        response = await self._get(worker, path)
        fallback = worker.adapter.health_fallback
        if response.status_code == 404 and fallback is not None:
            path, at_least_s = fallback
            response = await self._get(worker, path, timeout_s=max(at_least_s, self._timeout()))
        if response.status_code != 200:
            raise _ProbeFailed(f"GET {path} answered {response.status_code}")

    def _tell(self, worker: Worker) -> None:
        """Log why a worker is not healthy, once per reason, and when it is healthy again."""
        if worker.removed:
            self._said.pop(worker.id, None)
            return
        said = self._said.get(worker.id)
        if worker.healthy:
            if said is not None:
                log.info("%s is healthy again", worker.url)
                del self._said[worker.id]
            return
        reason = worker.last_error or "not probed yet"
        if reason != said:
            log.warning("%s is not healthy: %s", worker.url, reason)
            self._said[worker.id] = reason

    async def discover(self, worker: Worker) -> None:
        """Read the models a worker serves from its ``/v1/models`` (unless configured) and
        the engine facts it declares; the registry checks them."""
        cards = await self._models(worker) if worker.config.models is None else None
        self._registry.update_models(worker, cards, await self._facts(worker))

    async def _facts(self, worker: Worker) -> EngineFacts:
        """What the engine declares on its /metrics or in its server info (none when it
        cannot be read: the block size its events carry is adopted then)."""
        adapter = worker.adapter
        if adapter.declares_facts_in_metrics and adapter.metrics_path is not None:
            path = adapter.metrics_path
        elif adapter.server_info is not None:
            path = adapter.server_info[0]
        else:
            return EngineFacts()
        try:
            response = await self._get(worker, path)
            legacy = adapter.server_info_legacy_path
            if response.status_code == 404 and path != adapter.metrics_path and legacy:
                path = legacy
                response = await self._get(worker, path)
            if response.status_code != 200:
                raise _ProbeFailed(f"GET {path} answered {response.status_code}")
            if path == adapter.metrics_path:
                return adapter.parse_facts(response.text)
            return adapter.parse_server_info(response.content)
        except (httpx.HTTPError, _ProbeFailed, ValueError) as exc:
            log.info("%s: engine facts not read from %s: %s", worker.url, path, exc)
            return EngineFacts()

    async def _models(self, worker: Worker) -> dict[str, dict[str, Any]]:
        limit = self._config.models_max_bytes
        response = await self._get(worker, worker.adapter.models_path, limit)
        if response.status_code != 200:
            raise _ProbeFailed(f"GET {worker.adapter.models_path} answered {response.status_code}")
        try:
            models = decode_json_as(response.content, _Models).data
        except JsonDecodeError as exc:
            raise _ProbeFailed(f"unreadable model list: {exc}") from exc
        cards = {str(m["id"]): m for m in models if isinstance(m.get("id"), str)}
        if not cards:
            raise _ProbeFailed("the worker lists no models")
        if len(cards) > self._config.models_max_entries:
            raise _ProbeFailed(
                f"the worker lists more than {self._config.models_max_entries} models"
            )
        return cards

    # -- load -------------------------------------------------------------------------
    async def scrape_all(self) -> None:
        await asyncio.gather(
            *(self.scrape(w) for w in self._registry if w.healthy and w.adapter.scrapes_load)
        )
        self._registry.load_changed()  # a busy worker may have been seen freeing up

    async def scrape(self, worker: Worker) -> None:
        path = worker.adapter.metrics_path
        if path is None:
            return
        asked = self._registry.scrape_begins(worker)
        try:
            response = await self._get(worker, path)
            if response.status_code != 200:
                raise _ProbeFailed(f"GET {path} answered {response.status_code}")
            load = _with_capacity(worker.adapter.parse_load(response.text), worker)
            self._registry.scraped(worker, load, asked)
        except (httpx.HTTPError, _ProbeFailed, ValueError) as exc:
            self._metrics.scrape_failed(worker)
            log.debug("scrape of %s failed: %s", worker.url, exc)
            self._registry.scraped(worker, ScrapedLoad(), asked)
        except Exception:  # the worker's supervisor: this scrape is lost, not the others
            self._metrics.scrape_failed(worker)
            self._metrics.round_failed("scrape")
            log.exception("scrape of %s failed", worker.url)
            self._registry.scraped(worker, ScrapedLoad(), asked)

    def _timeout(self) -> float:
        return self._config.timeout_s

    async def _get(
        self,
        worker: Worker,
        path: str,
        limit: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> _Answer:
        """``GET`` one of the worker's paths: the whole answer within ``timeout_s`` (default
        the configured one: a trickling worker cannot stall the probe round), up to
        ``limit`` bytes (default ``_MAX_ANSWER_BYTES``)."""
        timeout = self._timeout() if timeout_s is None else timeout_s
        limit = _MAX_ANSWER_BYTES if limit is None else limit
        try:
            async with asyncio.timeout(timeout):
                return await self._read(worker.url + path, _headers(worker), limit, timeout)
        except TimeoutError as exc:
            raise _ProbeFailed(f"GET {path}: no whole answer within {timeout:g} s") from exc

    async def _read(self, url: str, headers: dict[str, str], limit: int, wait_s: float) -> _Answer:
        # wait_s: the probe's timeout, also httpx's, for its own pool and connect waits
        async with self._client.stream("GET", url, headers=headers, timeout=wait_s) as response:
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise _ProbeFailed(f"answer over {limit} bytes")
                chunks.append(chunk)
        return _Answer(response.status_code, b"".join(chunks))


_ADDRESSES = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://\S+"  # URLs and endpoints
    r"|\(\s*'[^']*'\s*,\s*\d+\s*\)"  # ('host', port) of socket errors
    r"|\[[0-9A-Fa-f:.]+\](?::\d+)?"  # [v6]:port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # v4[:port]
)
_MAX_SHOWN_REASON = 200


def unhealthy_reasons(registry: WorkerRegistry) -> dict[str, str]:
    """Why each worker that is not healthy is not, keyed by its position in the worker list
    (``/admin/workers``'s order): for an open endpoint, so without addresses."""
    reasons = {}
    for position, worker in enumerate(registry):
        if not worker.healthy:
            reason = _ADDRESSES.sub("<address>", worker.last_error or "not probed yet")
            reasons[str(position)] = reason[:_MAX_SHOWN_REASON]
    return reasons


def _with_capacity(scraped: ScrapedLoad, worker: Worker) -> ScrapedLoad:
    """A scrape without a KV capacity takes the one the engine declares in its settings
    (SGLang's ``max_total_num_tokens``, in blocks), as vLLM's comes with every scrape."""
    declared = worker.facts.kv_capacity_blocks
    if scraped.kv_capacity_blocks is not None or declared is None:
        return scraped
    return replace(scraped, kv_capacity_blocks=declared)


async def _supervised(
    action: Callable[[], Awaitable[None]], metrics: HealthMetrics, loop: str
) -> None:
    """One round of a background loop: whatever it raises costs that round, never the loop."""
    try:
        await action()
    except Exception:  # a loop's supervisor: logged with its traceback, the loop goes on
        metrics.round_failed(loop)
        log.exception("a background round of the health checker failed (%s)", loop)


class _ProbeFailed(Exception):
    """A probe got an answer, but not a healthy one."""
