"""The gateway's request handlers: authenticate, parse, route, hand over to the proxy.

Admin and debug calls need the admin token; without one they are served only when kvgate
listens on loopback alone (the demo), else refused. Workers added through the admin API must
be on hosts ``--worker-allow`` admits, their event endpoints too (``tcp://`` only).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import msgspec
import pydantic
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from backends.allowlist import WorkerAllowlist, host_of_endpoint, host_of_url
from backends.config import WorkerConfig
from backends.discovery import DiscoveredFleet
from backends.health import HealthChecker
from backends.registry import Worker, WorkerRegistry
from index.api import WorkerListener
from router.config import Settings, validation_problems
from router.errors import (
    AdminDisabled,
    ClientClosed,
    InvalidRequest,
    KvgateError,
    ModelNotFound,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    WorkerNotAllowed,
)
from router.listener import ListenerLimits, timed_out_body
from router.metrics import GatewayMetrics, forget_series
from router.proxy import Exchange, Proxy, UsageMode, forwardable_headers
from router.requests import (
    AnyModelBody,
    ChatBody,
    CompletionBody,
    decode_json_object,
    raw_with_usage_requested,
    upstream_target,
    validate,
)
from router.routing import Router

log = logging.getLogger("kvgate.gateway")
_encode = msgspec.json.Encoder().encode
_MAX_REQUEST_ID = 128


class IndexLifecycle(WorkerListener, Protocol):
    """What the gateway drives on the KV index service (``index.service.KvIndexService``): its
    lifecycle; it follows the registry's workers as a subscriber (``WorkerListener``)."""

    async def start(self) -> None: ...

    async def settled(self) -> None:
        """Until the index has caught up with the workers it was told of."""
        ...

    async def stop(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encode(data), status, headers, media_type="application/json")


def error_response(error: KvgateError, request_id: str | None = None) -> Response:
    headers = dict(error.headers)
    if request_id is not None:
        headers["x-request-id"] = request_id
    content_type = getattr(error, "content_type", "application/json")
    return Response(error.body_bytes(), error.status, headers, media_type=content_type)


class RequestIds:
    """New request ids in ``uuid.uuid4().hex`` form, drawn from a random generator seeded
    once (the OS's entropy per id costs a system call; ids need uniqueness, not secrecy)."""

    _VERSION_MASK = ~((0xF000 << 64) | (0xC000 << 48))
    _VERSION_BITS = (0x4000 << 64) | (0x8000 << 48)  # version 4, RFC 4122 variant

    def __init__(self, rng: random.Random | None = None) -> None:
        self._bits = (rng if rng is not None else random.Random()).getrandbits

    def new(self) -> str:
        return f"{self._bits(128) & self._VERSION_MASK | self._VERSION_BITS:032x}"

    def of(self, request: Request) -> str:
        """The client's ``x-request-id`` when usable, else a new id."""
        given = request.headers.get("x-request-id")
        if given and len(given) <= _MAX_REQUEST_ID and given.isprintable():
            return given
        return self.new()


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization")
    if value is None:
        return request.headers.get("x-api-key")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _secret_matches(given: str | None, secrets: list[str]) -> bool:
    if not given:
        return False
    encoded = given.encode()
    return any(hmac.compare_digest(encoded, s.encode()) for s in secrets)


def is_loopback(host: str | None) -> bool:
    """Is ``host`` (an address or ``localhost``) on the loopback interface only?"""
    if host is None:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class Gateway:
    """Every long-lived part of one kvgate process."""

    settings: Settings
    registry: WorkerRegistry
    router: Router
    proxy: Proxy
    health: HealthChecker
    metrics: GatewayMetrics
    metrics_registry: CollectorRegistry
    client: httpx.AsyncClient
    allowlist: WorkerAllowlist
    listener: ListenerLimits  # the client connection limits, shared with the listener
    index: IndexLifecycle | None = None  # owned: started, stopped, subscribed to the registry
    discovery: DiscoveredFleet | None = None  # --discover targets, started and stopped here
    request_ids: RequestIds = field(default_factory=RequestIds)
    # metric holders whose series labelled with a worker go when it is removed
    worker_series: list[object] = field(default_factory=list)

    # -- auth ---------------------------------------------------------------------------
    def check_client(self, request: Request) -> None:
        keys = [k.get_secret_value() for k in self.settings.api_keys]
        if keys and not _secret_matches(_bearer(request), keys):
            raise Unauthorized("missing or invalid API key (Authorization: Bearer KEY)")

    def check_admin(self, request: Request) -> None:
        """The admin token, or (none set) a loopback-only listener; else 401 / 403."""
        token = self.settings.admin_token
        if token is None:
            server = request.scope.get("server")
            local = server[0] if server else None
            if not (is_loopback(self.settings.host) and is_loopback(local)):
                raise AdminDisabled
            return
        if not _secret_matches(_bearer(request), [token.get_secret_value()]):
            raise Unauthorized("missing or invalid admin token", code="invalid_admin_token")

    async def read_body(self, request: Request) -> bytes:
        """The whole body, within ``max_body_bytes`` (413); a body the listener cut for
        being too slow (``client.body_timeout_s``) is a 408."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self.metrics.limit_exceeded("request_bytes")
            raise PayloadTooLarge(limit)
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    self.metrics.limit_exceeded("request_bytes")
                    raise PayloadTooLarge(limit)
                chunks.append(chunk)
        except ClientDisconnect as exc:
            if timed_out_body(request.scope):
                timeout = self.settings.client.body_timeout_s
                raise RequestTimeout(
                    f"the request body did not arrive within {timeout:g} s"
                ) from exc
            raise ClientClosed from exc
        return b"".join(chunks)

    # -- proxied endpoints --------------------------------------------------------------
    async def generate(
        self, request: Request, body_type: type[ChatBody | CompletionBody]
    ) -> Response:
        """``POST /v1/chat/completions`` and ``POST /v1/completions``."""
        received_at = time.perf_counter()
        request_id = self.request_ids.of(request)
        model = "none"
        try:
            self.check_client(request)
            raw = await self.read_body(request)
            data = decode_json_object(raw)
            parsed = validate(body_type, data)
            model = parsed.model
            session = request.headers.get("x-session-id") or parsed.user
            routed = await self.router.decide(
                model, parsed.prompt_input(), session_key=session, max_tokens=parsed.output_limit
            )
        except KvgateError as exc:
            return self._refuse(exc, request_id, model)
        stream = bool(parsed.stream)
        usage_mode, body = UsageMode.BODY, raw
        if stream:
            asked = parsed.stream_options is not None and parsed.stream_options.include_usage
            if asked:
                usage_mode = UsageMode.TAP
            elif self.settings.capture_usage:
                usage_mode, body = UsageMode.HIDE, raw_with_usage_requested(raw, data)
            else:
                usage_mode = UsageMode.NONE
        return self.proxy.respond(
            Exchange(
                request_id=request_id,
                method="POST",
                path=request.scope["path"],
                body=body,
                headers=forwardable_headers(request.headers.raw),
                model=model,
                routed=routed,
                stream=stream,
                usage_mode=usage_mode,
                received_at=received_at,
            )
        )

    async def pass_through(self, request: Request) -> Response:
        """Any other ``/v1/*`` request: to a worker serving the body's (or query's) model."""
        received_at = time.perf_counter()
        request_id = self.request_ids.of(request)
        model = "none"
        try:
            path = upstream_target(request.scope["path"], request.scope.get("query_string", b""))
            self.check_client(request)
            raw = await self.read_body(request)
            model = self._model_of(request, raw)
            routed = await self.router.decide(
                model, None, session_key=request.headers.get("x-session-id")
            )
        except KvgateError as exc:
            return self._refuse(exc, request_id, model)
        return self.proxy.respond(
            Exchange(
                request_id=request_id,
                method=request.method,
                path=path,
                body=raw,
                headers=forwardable_headers(request.headers.raw),
                model=model,
                routed=routed,
                stream=True,
                usage_mode=UsageMode.NONE,
                received_at=received_at,
            )
        )

    def _model_of(self, request: Request, raw: bytes) -> str:
        if raw.strip():
            return validate(AnyModelBody, decode_json_object(raw)).model
        model = request.query_params.get("model")
        if not model:
            raise InvalidRequest("model: a model is required to choose a worker", param="model")
        return model

    def _refuse(self, error: KvgateError, request_id: str, model: str) -> Response:
        if isinstance(error, ModelNotFound):
            model = "unknown"  # never one label series per made-up model name
        self.metrics.route("none", model).answered(str(error.status))
        if error.status >= 500:
            log.warning("%s: %s", request_id, error.message)
        return error_response(error, request_id)

    # -- models and probes --------------------------------------------------------------
    def list_models(self, request: Request) -> Response:
        self.check_client(request)
        return json_response({"object": "list", "data": self.registry.model_cards()})

    def get_model(self, request: Request, model: str) -> Response:
        self.check_client(request)
        for card in self.registry.model_cards():
            if card.get("id") == model:
                return json_response(card)
        self.router.require_servable(model)  # 404 when nobody serves it
        return json_response({"id": model, "object": "model", "owned_by": "kvgate"})

    def ready(self) -> Response:
        healthy = self.registry.healthy_count()
        body = {"ready": healthy > 0, "healthy_workers": healthy, "workers": len(self.registry)}
        return json_response(body, 200 if healthy else 503)

    # -- admin --------------------------------------------------------------------------
    def describe_workers(self) -> dict[str, Any]:
        return {
            "policy": self.router.policy.name,
            "workers": [w.describe() for w in self.registry],
        }

    async def admit_worker(self, spec: Any) -> Worker:
        """``POST /admin/workers``: a worker on an allowed host, with allowed ``tcp://``
        event endpoints (discovery and configuration, trusted, use ``add_worker``)."""
        config = _worker_config(spec)
        checks = [("url", host_of_url(config.url))]
        for param in ("events", "replay"):
            endpoint = getattr(config, param)
            if endpoint is None:
                continue
            try:
                checks.append((param, host_of_endpoint(endpoint)))
            except ValueError as exc:
                message = f"{param}: workers added at run time take tcp://HOST:PORT endpoints"
                raise InvalidRequest(message, param=param) from exc
        for param, host in checks:
            if not await self.allowlist.permits_host(host):
                raise WorkerNotAllowed(host, param=param, rules=self.allowlist.describe())
        return await self.add_worker(config)

    async def add_worker(self, spec: Any) -> Worker:
        config = spec if isinstance(spec, WorkerConfig) else _worker_config(spec)
        worker = self.registry.add(config)
        await self.health.probe(worker)
        if self.index is not None:
            await self.index.settled()
        log.info("worker added: %s (healthy=%s)", worker.url, worker.healthy)
        return worker

    async def remove_worker(self, worker_id: str) -> Worker:
        worker = self.registry.remove(worker_id)
        self.proxy.upstream.close_origin(self.proxy.origin(worker))
        self.metrics.forget_worker(worker.url)
        for holder in self.worker_series:
            forget_series(vars(holder).values(), worker.url)
        log.info("worker removed: %s", worker.url)
        return worker

    async def explain(self, request: Request) -> Response:
        """``POST /debug/route``: the routing decision for a body, without sending it."""
        self.check_admin(request)
        data = decode_json_object(await self.read_body(request))
        parsed: ChatBody | CompletionBody
        parsed = validate(ChatBody, data) if "messages" in data else validate(CompletionBody, data)
        session = request.headers.get("x-session-id") or parsed.user
        routed = await self.router.decide(
            parsed.model, parsed.prompt_input(), session_key=session, max_tokens=parsed.output_limit
        )
        return json_response(self.router.explain(routed))

    # -- lifecycle ----------------------------------------------------------------------
    def index_stats(self) -> dict[str, Any]:
        return self.index.stats() if self.index is not None else {"index": None}

    async def start(self) -> None:
        if self.index is not None:
            await self.index.start()
        await self.health.probe_all()
        if self.index is not None:  # from now on the index follows the registry's workers
            self.registry.subscribe(self.index)
            await self.index.settled()
        self.health.start()
        if self.discovery is not None:
            await self.discovery.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.health.stop()
        if self.index is not None:
            self.registry.unsubscribe(self.index)
            await self.index.stop()
        await self.proxy.upstream.aclose()
        await self.client.aclose()


def _worker_config(spec: Any) -> WorkerConfig:
    """A worker from an admin body; a 400 naming the problems, never echoing a secret."""
    try:
        return WorkerConfig.model_validate(spec)
    except pydantic.ValidationError as exc:
        where = exc.errors()[0]["loc"]
        problems = "; ".join(validation_problems(exc, root="worker"))
        raise InvalidRequest(
            f"invalid worker: {problems}", param=str(where[0]) if where else "url"
        ) from exc
