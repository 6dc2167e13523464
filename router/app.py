"""``create_app``: the kvgate FastAPI application (OpenAI API, probes, metrics, admin)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kvgate.backends.allowlist import WorkerAllowlist, host_of_url
from kvgate.backends.discovery import DiscoveredFleet
from kvgate.backends.health import HealthChecker, HealthMetrics
from kvgate.backends.registry import WorkerRegistry
from kvgate.index.api import BlockIndex
from kvgate.index.service import KvIndexService
from kvgate.router.accesslog import AccessLog, client_key_id
from kvgate.router.config import Settings
from kvgate.router.errors import InvalidRequest, KvgateError, NotFound, backend_errors
from kvgate.router.gateway import Gateway, error_response, json_response
from kvgate.router.index_watch import IndexWatch, IndexWatchMetrics
from kvgate.router.listener import ListenerLimits
from kvgate.router.metrics import (
    GatewayMetrics,
    GatewayRegistry,
    MetricsPage,
    kvgate_version,
    register_worker_gauges,
)
from kvgate.router.observe import Observer, start_tracing
from kvgate.router.passthrough import ROOT_PATHS, PassThroughPaths
from kvgate.router.proxy import Proxy
from kvgate.router.queue_metrics import QueueMetrics
from kvgate.router.requests import ChatBody, CompletionBody, check_path, decode_json
from kvgate.router.upstream import UpstreamPool
from kvgate.scheduling.affinity import ResponseAffinity
from kvgate.scheduling.config import Tuning
from kvgate.scheduling.scheduler import Scheduler
from kvgate.scoring.api import Policy
from kvgate.scoring.policies import make_policy

log = logging.getLogger("kvgate")


def _http_client(settings: Settings) -> httpx.AsyncClient:
    upstream = settings.upstream
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=upstream.connect_timeout_s,
            read=upstream.read_timeout_s,
            write=upstream.read_timeout_s,
            pool=upstream.connect_timeout_s,
        ),
        limits=httpx.Limits(
            max_connections=upstream.max_connections,
            max_keepalive_connections=upstream.max_keepalive,
        ),
        trust_env=False,  # engines are reached directly, never through an environment proxy
    )


def build_gateway(
    settings: Settings,
    *,
    block_index: BlockIndex | None = None,
    policy: Policy | None = None,
    metrics_registry: CollectorRegistry | None = None,
    tuning: Tuning | None = None,
) -> Gateway:
    """Assemble the gateway's parts (no I/O happens until ``Gateway.start``). ``tuning``:
    the scheduler's internal constants (benchmarks and tests; users never set them)."""
    metrics_registry = metrics_registry if metrics_registry is not None else GatewayRegistry()
    registry = WorkerRegistry(
        settings.health, explicit_block_size=settings.index.explicit_block_size
    )
    for worker in settings.workers:
        registry.add(worker)
    if policy is None:
        policy = make_policy(
            settings.policy,
            seed=settings.seed,
            kv_config=settings.scoring,
            kv_capacity_blocks=settings.scheduling.kv_capacity_blocks,
        )
    client = _http_client(settings)
    allowlist = WorkerAllowlist(
        settings.worker_allow, static_hosts=[host_of_url(w.url) for w in settings.workers]
    )
    index: KvIndexService | None = None
    if block_index is None and settings.kv_index:
        index = KvIndexService(
            settings.index,
            metrics_registry,
            client,
            endpoint_allowed=allowlist.permits_endpoint,  # what workers declare at run time
            on_block_size=registry.observe_block_size,
        )
        block_index = index
    keys = [client_key_id(k.get_secret_value()) for k in settings.api_keys] or ["-"]
    queue_metrics = QueueMetrics(metrics_registry)
    queue_metrics.declare(keys)
    scheduler = Scheduler(
        registry,
        policy,
        block_index,
        config=settings.scheduling,
        queue=settings.queue,
        events=queue_metrics,
        tuning=tuning,
        affinity=ResponseAffinity(
            settings.responses.affinity_max_ids,
            settings.responses.affinity_ttl_s,
            keys=len(settings.api_keys),
        ),
        keys=keys,
    )
    queue_metrics.watch(
        scheduler.queue, lambda: {model for worker in registry for model in worker.models}
    )
    metrics = GatewayMetrics(metrics_registry, native_core=settings.index.table != "python")
    register_worker_gauges(metrics_registry, registry, scheduler.ledger, metrics)
    health_metrics = HealthMetrics(metrics_registry)
    health = HealthChecker(registry, client, settings.health, health_metrics)
    upstream = UpstreamPool(
        connect_timeout=settings.upstream.connect_timeout_s,
        read_timeout=settings.upstream.read_timeout_s,
        max_idle_per_origin=settings.upstream.max_keepalive,
    )
    proxy = Proxy(upstream, registry, metrics, settings.upstream)
    access = AccessLog(settings.access_log_sample_rate) if settings.access_log else None
    gateway = Gateway(
        settings=settings,
        registry=registry,
        scheduler=scheduler,
        proxy=proxy,
        health=health,
        metrics=metrics,
        metrics_registry=metrics_registry,
        client=client,
        allowlist=allowlist,
        listener=ListenerLimits(settings.client, metrics, retry_after_s=settings.retry_after_s),
        index=index,
        worker_series=[health_metrics] + ([index.metrics] if index is not None else []),
        observer=Observer(access, start_tracing(settings)),
        health_metrics=health_metrics,
        pass_paths=PassThroughPaths(settings.pass_through_paths),
    )
    if index is not None:
        watch_metrics = IndexWatchMetrics(metrics_registry)
        watch = IndexWatch(
            settings.index_watch, gateway.event_progress, gateway.resync, watch_metrics
        )
        proxy.served_listeners.append(watch.on_served)
        gateway.index_watch = watch
        gateway.worker_series.append(watch_metrics)
    if settings.discover:
        discovery = DiscoveredFleet(
            settings.discover,
            add=gateway.add_worker,
            remove=gateway.remove_worker,
            exists=lambda url: registry.find(url) is not None,
            registry=metrics_registry,
        )
        allowlist.add_known_hosts(discovery.hosts)
        gateway.discovery = discovery
    return gateway


FastHandler = Callable[[Request], Awaitable[Response]]


class KvgateApp(FastAPI):
    """FastAPI, with the two proxied hot paths dispatched before its middleware stack.

    Those handlers report their own errors (OpenAI bodies) and need neither dependency
    injection nor FastAPI's middleware; skipping them saves a good share of the gateway's
    per-request CPU. Every other path (and these same routes, for the OpenAPI docs) goes
    through FastAPI as usual.
    """

    fast_routes: dict[tuple[str, str], FastHandler]  # set by create_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self.fast_routes.get((scope["method"], scope["path"]))
            if handler is not None:
                scope["app"] = self
                response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
            try:  # before routing: a path with CR or LF would match no route (a 404)
                check_path(scope["path"])
            except InvalidRequest as exc:
                await error_response(exc)(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(
    settings: Settings,
    *,
    block_index: BlockIndex | None = None,
    policy: Policy | None = None,
    metrics_registry: CollectorRegistry | None = None,
    tuning: Tuning | None = None,
) -> FastAPI:
    """The kvgate ASGI app; ``app.state.gateway`` holds its parts.

    Without ``block_index``, kvgate builds its own ``KvIndexService`` (tokenizers, KV events,
    approximate fallback) when ``settings.kv_index`` is on, and keeps it in step with the
    workers; a given ``block_index`` is used as is (the caller runs it). ``policy``
    overrides ``settings.policy``; metrics go to ``metrics_registry`` (a fresh one if None);
    ``tuning``: the scheduler's internal constants (benchmarks and tests).
    """
    gateway = build_gateway(
        settings,
        block_index=block_index,
        policy=policy,
        metrics_registry=metrics_registry,
        tuning=tuning,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    # No redirects: every answer is the resource or an OpenAI-style error. FastAPI's own
    # OpenTelemetry instrumentation stays off: kvgate traces its requests itself (a global
    # OpenTelemetry setup would otherwise add a second, partial set of spans and metrics).
    app = KvgateApp(
        title="kvgate",
        version=kvgate_version(),
        lifespan=lifespan,
        redirect_slashes=False,
        telemetry={"tracing": False, "metrics": False, "logs": False, "auto_configure": False},
    )
    app.state.gateway = gateway
    app.fast_routes = {
        ("POST", "/v1/chat/completions"): lambda request: gateway.generate(request, ChatBody),
        ("POST", "/v1/completions"): lambda request: gateway.generate(request, CompletionBody),
        ("POST", "/v1/responses"): gateway.responses,
    }
    _add_error_handlers(app)
    _add_openai_routes(app, gateway)
    _add_ops_routes(app, gateway)
    _add_admin_routes(app, gateway)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    async def kvgate_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, KvgateError)
        return error_response(exc, request.headers.get("x-request-id"))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        error = NotFound(str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        error.status = exc.status_code
        if exc.status_code == 405:
            error.code = "method_not_allowed"
        return error_response(error)

    app.add_exception_handler(KvgateError, kvgate_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _add_openai_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post("/v1/chat/completions", tags=["openai"])
    async def chat_completions(request: Request) -> Response:
        return await gateway.generate(request, ChatBody)

    @app.post("/v1/completions", tags=["openai"])
    async def completions(request: Request) -> Response:
        return await gateway.generate(request, CompletionBody)

    @app.post("/v1/responses", tags=["openai"])
    async def responses(request: Request) -> Response:
        return await gateway.responses(request)

    @app.get("/v1/models", tags=["openai"])
    async def list_models(request: Request) -> Response:
        return gateway.list_models(request)

    @app.get("/v1/models/{model:path}", tags=["openai"])
    async def get_model(request: Request, model: str) -> Response:
        return gateway.get_model(request, model)

    @app.api_route(
        "/v1/{path:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
        tags=["openai"],
        summary="Any other OpenAI endpoint, passed through to a worker serving the model",
    )
    async def pass_through(request: Request, path: str) -> Response:
        return await gateway.pass_through(request)

    for root in ROOT_PATHS:  # vLLM's rerank and score outside /v1
        app.add_api_route(
            root,
            gateway.pass_through,
            methods=["POST"],
            tags=["openai"],
            summary="vLLM's " + root.strip("/") + ", passed through to a worker serving the model",
        )


def _add_ops_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/health", tags=["ops"])
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready", tags=["ops"])
    async def ready() -> Response:
        return gateway.ready()

    page = MetricsPage(gateway.metrics_registry)

    @app.get("/metrics", tags=["ops"])
    async def metrics(request: Request) -> Response:
        if gateway.settings.metrics_auth:
            gateway.check_admin(request)
        return Response(await page.render(), media_type=CONTENT_TYPE_LATEST)


def _add_admin_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/admin/workers", tags=["admin"])
    async def list_workers(request: Request) -> Response:
        gateway.check_admin(request)
        return json_response(gateway.describe_workers())

    @app.post("/admin/workers", tags=["admin"])
    async def add_worker(request: Request) -> Response:
        gateway.check_admin(request)
        spec: Any = decode_json(await gateway.read_body(request))
        with backend_errors():
            worker = await gateway.admit_worker(spec)
        return json_response(gateway.describe_worker(worker), 201)

    @app.delete("/admin/workers/{worker_id:path}", tags=["admin"])
    async def remove_worker(request: Request, worker_id: str) -> Response:
        gateway.check_admin(request)
        with backend_errors():
            worker = await gateway.remove_worker(worker_id)
        return json_response(gateway.describe_worker(worker))

    @app.post("/debug/route", tags=["admin"])
    async def debug_route(request: Request) -> Response:
        return await gateway.explain(request)

    @app.get("/debug/index", tags=["admin"])
    async def debug_index(request: Request) -> Response:
        gateway.check_admin(request)
        return json_response(gateway.index_stats())
