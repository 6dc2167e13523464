"""The gRPC side of ``kvgate epp``: Envoy's external-processing service and gRPC health.

Health, as the Endpoint Picker Protocol names its services: ``liveness`` is SERVING while the
process answers; ``readiness``, ``envoy.service.ext_proc.v3.ExternalProcessor`` and the
server as a whole ("") are SERVING while some worker is ready (as ``/ready``), NOT_SERVING
otherwise. Every kvgate epp replica places requests on its own (share-nothing, each
following every engine's KV events): there is no leader to elect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvgate.backends.registry import WorkerRegistry
from kvgate.index.api import EngineWorker
from kvgate.index.types import WorkerId
from kvgate.router.epp import messages, wire
from kvgate.router.epp.stream import EppService, EppStream

log = logging.getLogger("kvgate.epp")

EXT_PROC_SERVICE = messages.SERVICE
LIVENESS = "liveness"
READINESS = "readiness"
_FOLLOWS_READINESS = ("", READINESS, EXT_PROC_SERVICE)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SLACK_BYTES = 1 << 16  # a message's framing beside the largest body it may carry


class ExternalProcessor:
    """``Process``: one stream per HTTP request (``router.epp.stream``)."""

    def __init__(self, service: EppService) -> None:
        self._service = service

    def handler(self) -> grpc.GenericRpcHandler:
        """The service, for ``Server.add_generic_rpc_handlers``."""
        process = grpc.stream_stream_rpc_method_handler(
            self.Process,
            request_deserializer=messages.ProcessingRequest.FromString,
            response_serializer=wire.serialize,
        )
        return grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": process})

    async def Process(
        self,
        request_iterator: AsyncIterator[wire.Message],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[wire.Message]:
        # an async generator itself: gRPC runs any other kind of handler in a thread
        async for message in EppStream(self._service, context).run(request_iterator):
            yield message


class Readiness:
    """Keeps the health service's statuses in step with the registry's ready workers: told
    of every fleet change, health verdict and engine fact (a ``WorkerListener``)."""

    def __init__(self, registry: WorkerRegistry, health: health_aio.HealthServicer) -> None:
        self._registry = registry
        self._health = health
        self._status: int | None = None
        self._pending: asyncio.Task[None] | None = None

    def refresh(self) -> None:
        status = _SERVING if self._registry.ready_count() > 0 else _NOT_SERVING
        if status == self._status:
            return
        self._status = status
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_task(self._publish())

    async def _publish(self) -> None:
        """Set every readiness-bound service to the latest status (a change made while this
        runs is published by the loop's next turn)."""
        published = None
        while (status := self._status) is not None and status != published:
            published = status
            for service in _FOLLOWS_READINESS:
                await self._health.set(service, status)

    def worker_added(self, worker: EngineWorker) -> None:
        self.refresh()

    def worker_removed(self, worker: WorkerId) -> None:
        self.refresh()

    def worker_health_changed(self, worker: EngineWorker) -> None:
        self.refresh()


class GrpcSide:
    """The gRPC server, started after the gateway's parts and stopped before them (made in
    ``start``: a gRPC asyncio server belongs to the event loop it is made on)."""

    def __init__(self, service: EppService) -> None:
        settings = service.settings
        self._service = service
        host, port = settings.host, settings.grpc_port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = port  # the bound port once started (``--grpc-port 0``: the kernel's pick)
        self.health = health_aio.HealthServicer()
        self.readiness = Readiness(service.gateway.registry, self.health)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        settings = self._service.settings
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
                ("grpc.max_receive_message_length", settings.max_body_bytes + _SLACK_BYTES),
                ("grpc.max_send_message_length", settings.max_body_bytes + _SLACK_BYTES),
            ],
            maximum_concurrent_rpcs=settings.client.max_connections,
        )
        server.add_generic_rpc_handlers((ExternalProcessor(self._service).handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = server.add_insecure_port(self.address)
        await self.health.set(LIVENESS, _SERVING)
        for service in _FOLLOWS_READINESS:
            await self.health.set(service, _NOT_SERVING)
        self._service.gateway.registry.subscribe(self.readiness)
        self.readiness.refresh()
        await server.start()
        self._server = server
        log.info("ext_proc and gRPC health on %s (port %d)", self.address, self.port)

    async def stop(self, grace_s: float) -> None:
        """Stop taking streams; those in flight get ``grace_s`` seconds to end."""
        self._service.gateway.registry.unsubscribe(self.readiness)
        await self.health.enter_graceful_shutdown()
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
