"""The HTTP side of ``kvgate epp`` and the process's lifespan.

HTTP (``--host`` / ``--port``): ``/health``, ``/ready``, ``/metrics``, ``POST /debug/route``
and ``/debug/index``, answered by the same gateway parts as ``kvgate serve``'s (admin-guarded
alike). No ``/v1`` route: requests reach the engines through Envoy. The lifespan starts the
gateway's parts (registry, health checks, KV-event subscriptions, queue, discovery), then
the gRPC side; it stops them in the reverse order, giving streams in flight the
graceful-shutdown time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.router.app import build_gateway
from kvgate.router.epp.config import EppSettings
from kvgate.router.epp.placement import Placer
from kvgate.router.epp.server import GrpcSide
from kvgate.router.epp.stream import EppMetrics, EppService
from kvgate.router.errors import KvgateError
from kvgate.router.gateway import Gateway, error_response, json_response
from kvgate.router.metrics import kvgate_version


def create_epp_app(settings: EppSettings) -> FastAPI:
    """The ``kvgate epp`` ASGI app; ``app.state.gateway`` holds the gateway's parts and
    ``app.state.grpc`` the gRPC side (its bound ``port``)."""
    gateway = build_gateway(settings)
    service = EppService(gateway, settings, Placer(gateway), EppMetrics(gateway.metrics_registry))
    grpc_side = GrpcSide(service)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            await grpc_side.start()
            try:
                yield
            finally:
                await grpc_side.stop(settings.shutdown_timeout_s)
        finally:
            await gateway.stop()

    app = FastAPI(
        title="kvgate epp",
        version=kvgate_version(),
        lifespan=lifespan,
        redirect_slashes=False,
        openapi_url=None,
    )
    app.state.gateway = gateway
    app.state.grpc = grpc_side
    _add_routes(app, gateway)
    return app


def _add_routes(app: FastAPI, gateway: Gateway) -> None:
    async def kvgate_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, KvgateError)
        return error_response(exc, request.headers.get("x-request-id"))

    app.add_exception_handler(KvgateError, kvgate_error)

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        return gateway.ready()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/debug/route")
    async def debug_route(request: Request) -> Response:
        return await gateway.explain(request)

    @app.get("/debug/index")
    async def debug_index(request: Request) -> Response:
        gateway.check_admin(request)
        return json_response(gateway.index_stats())
