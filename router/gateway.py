"""The gateway's request handlers: authenticate, parse, schedule, hand over to the proxy.

Admin and debug calls need the admin token; without one they are served only when kvgate
listens on loopback alone (the demo), else refused, and then only to a request naming a
loopback ``Host`` with kvgate's port (no DNS rebinding). They are never a browser's: a request
carrying ``Origin`` is refused, and a body must be ``application/json`` (a cross-origin form
or ``text/plain`` POST needs no preflight). Workers added through the admin API must be on
hosts ``--worker-allow`` admits, their event endpoints too (``tcp://`` only).

Tenants: with client keys, the Responses API's stored responses are bound to the key whose
request created them (``scheduling.affinity``), and session keys (``x-session-id``, ``user``)
are namespaced by the client key's id. Without client keys every client is one tenant.
"""

from __future__ import annotations

import asyncio
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

from kvgate.backends.allowlist import WorkerAllowlist, host_of_endpoint, host_of_url
from kvgate.backends.config import WorkerConfig
from kvgate.backends.discovery import DiscoveredFleet
from kvgate.backends.health import HealthChecker, HealthMetrics, unhealthy_reasons
from kvgate.backends.registry import Worker, WorkerRegistry
from kvgate.index.api import WorkerListener
from kvgate.index.types import WorkerId
from kvgate.router.accesslog import client_key_id
from kvgate.router.config import Settings, validation_problems
from kvgate.router.errors import (
    AdminDisabled,
    AdminRefused,
    ClientClosed,
    InvalidRequest,
    KvgateError,
    ModelNotFound,
    PathNotPassedThrough,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    UnsupportedMediaType,
    WorkerNotAllowed,
    from_scheduling,
)
from kvgate.router.index_watch import IndexWatch
from kvgate.router.listener import ListenerLimits, timed_out_body
from kvgate.router.metrics import GatewayMetrics, forget_series
from kvgate.router.observe import Observation, Observer
from kvgate.router.passthrough import PassThroughPaths
from kvgate.router.pd import TwoLegs, strip_transfer_params
from kvgate.router.proxy import AnswerTap, Exchange, Proxy, UsageMode, forwardable_headers
from kvgate.router.requests import (
    AnyModelBody,
    ChatBody,
    CompletionBody,
    ResponsesBody,
    client_timeout_s,
    decode_json_object,
    disconnect_of,
    normalised_path,
    raw_with_usage_requested,
    upstream_target,
    validate,
)
from kvgate.scheduling.affinity import ClientKeyId
from kvgate.scheduling.errors import QueueTimeout, SchedulingError
from kvgate.scheduling.grant import Grant
from kvgate.scheduling.pd import disaggregated
from kvgate.scheduling.routing import Leg, Routed
from kvgate.scheduling.scheduler import RequestFacts, Scheduler
from kvgate.scoring.config import KvPolicyConfig

log = logging.getLogger("kvgate.gateway")
_encode = msgspec.json.Encoder().encode
_MAX_REQUEST_ID = 128
_RESPONSES = "/v1/responses/"
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_BODY_METHODS = ("POST", "PUT", "PATCH")


class IndexLifecycle(WorkerListener, Protocol):
    """What the gateway drives on the KV index service (``index.service.KvIndexService``): its
    lifecycle; it follows the registry's workers as a subscriber (``WorkerListener``)."""

    async def start(self) -> None: ...

    async def settled(self) -> None:
        """Until the index has caught up with the workers it was told of."""
        ...

    async def stop(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def applied_seq(self, worker: WorkerId, dp_rank: int = 0) -> int | None: ...

    def connected(self, worker: WorkerId, dp_rank: int = 0) -> bool: ...

    def resync(self, worker: WorkerId, *, replay: bool) -> bool: ...


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
    """Is ``given`` one of ``secrets``? (constant-time compares, every one made)"""
    if not given:
        return False
    encoded = given.encode()
    return any(hmac.compare_digest(encoded, s.encode()) for s in secrets)


@dataclass(slots=True)
class _Call:
    """One proxied request on its way through the gateway: what its refusal or its
    ``Exchange`` is built from."""

    request: Request
    request_id: str
    received_at: float  # time.perf_counter() when it arrived
    observation: Observation
    model: str = "none"  # the body's model, once read
    stream: bool = False

    def parsed(self, model: str, body_bytes: int, stream: bool) -> None:
        self.model, self.stream = model, stream
        self.observation.parsed(model, body_bytes, stream=stream)


def _loopback_host(host: str | None, port: int) -> bool:
    """Is a ``Host`` header ``localhost``, ``127.0.0.1`` or ``[::1]`` with ``port`` (or no
    port when that is 80)?"""
    if not host:
        return False
    split = host.rfind("]") + 1 if host.startswith("[") else host.rfind(":")
    if split <= 0:
        split = len(host)
    name, given = host[:split], host[split:]
    ports = (f":{port}", "") if port == 80 else (f":{port}",)
    return name.lower() in _LOOPBACK_NAMES and given in ports


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").partition(";")[0].strip().lower()


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
    scheduler: Scheduler  # the decision core: ledger, policy, capacity rule, queue
    proxy: Proxy
    health: HealthChecker
    metrics: GatewayMetrics
    metrics_registry: CollectorRegistry
    client: httpx.AsyncClient
    allowlist: WorkerAllowlist
    listener: ListenerLimits  # the client connection limits, shared with the listener
    index: IndexLifecycle | None = None  # owned: started, stopped, subscribed to the registry
    discovery: DiscoveredFleet | None = None  # --discover targets, started and stopped here
    index_watch: IndexWatch | None = None  # resyncs workers whose entries may be stale
    request_ids: RequestIds = field(default_factory=RequestIds)
    # metric holders whose series labelled with a worker go when it is removed
    worker_series: list[object] = field(default_factory=list)
    observer: Observer = field(default_factory=lambda: Observer(None, None))
    health_metrics: HealthMetrics | None = None  # per-worker series declared on add
    pass_paths: PassThroughPaths = field(default_factory=PassThroughPaths)
    _client_keys: list[tuple[bytes, str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        keys = [key.get_secret_value() for key in self.settings.api_keys]
        self._client_keys = [(key.encode(), client_key_id(key)) for key in keys]

    # -- auth ---------------------------------------------------------------------------
    def check_client(self, request: Request) -> str:
        """The client's key id (``accesslog.client_key_id``; "-" when kvgate has no client
        keys); 401 without a valid key."""
        if not self._client_keys:
            return "-"
        key = self._key_id(_bearer(request))
        if key is None:
            raise Unauthorized("missing or invalid API key (Authorization: Bearer KEY)")
        return key

    def _key_id(self, given: str | None) -> str | None:
        """The id of the client key ``given`` is, or None; every key compared in constant
        time, none skipped once one matched."""
        if not given:
            return None
        encoded = given.encode()
        found = [key_id for key, key_id in self._client_keys if hmac.compare_digest(encoded, key)]
        return found[0] if found else None

    @property
    def tenants(self) -> bool:
        """Are clients told apart (client keys configured)? Without keys, one tenant."""
        return bool(self._client_keys)

    def check_admin(self, request: Request) -> None:
        """The admin token, or (none set) a loopback-only listener reached by a loopback
        ``Host``; never a browser's request (``Origin``), a body only as JSON; else 401 /
        403 / 415."""
        if "origin" in request.headers:
            raise AdminRefused(
                "the admin API does not serve browsers: requests carrying Origin are refused",
                code="origin_refused",
            )
        token = self.settings.admin_token
        if token is None:
            server = request.scope.get("server")
            local = server[0] if server else None
            if not (is_loopback(self.settings.host) and is_loopback(local)):
                raise AdminDisabled
            if not _loopback_host(request.headers.get("host"), server[1] if server else 0):
                raise AdminRefused(
                    "without an admin token the admin API answers only requests to "
                    "localhost, 127.0.0.1 or [::1] with kvgate's port (Host)",
                    code="host_refused",
                )
        elif not _secret_matches(_bearer(request), [token.get_secret_value()]):
            raise Unauthorized("missing or invalid admin token", code="invalid_admin_token")
        if request.method in _BODY_METHODS and _media_type(request) != "application/json":
            raise UnsupportedMediaType("application/json")

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
        call = self._begin(request)
        try:
            raw = await self._read_client(call)
            data = decode_json_object(raw)
            parsed = validate(body_type, data)
            stream = bool(parsed.stream)
            call.parsed(parsed.model, len(raw), stream)
            session = self._session(call, parsed.user)
            leg = self._leg(parsed.model)
            routed = await self._route(
                RequestFacts(
                    parsed.model,
                    parsed.prompt_input(),
                    session_key=session,
                    max_tokens=parsed.output_limit,
                    spans=call.observation.spans,
                    leg=leg,
                )
            )
            raw = strip_transfer_params(raw, data)  # never an engine's to read from a client
            legs = self._two_legs(call, data) if leg is not None else None
            usage_mode, body = UsageMode.BODY, raw
            if stream:
                asked = parsed.stream_options is not None and parsed.stream_options.include_usage
                if asked:
                    usage_mode = UsageMode.TAP
                elif self.settings.capture_usage:
                    usage_mode, body = UsageMode.HIDE, raw_with_usage_requested(raw, data)
                else:
                    usage_mode = UsageMode.NONE
            del raw, data, parsed  # a queued request holds its body to send, not its JSON too
            grant = await self._admit(call, routed, len(body))
        except KvgateError as exc:
            return self._refuse(exc, call)
        return self._send(call, grant, body=body, usage_mode=usage_mode, legs=legs)

    def _leg(self, model: str) -> Leg | None:
        """``decode`` when ``model``'s ready workers are disaggregated (prefill and decode
        workers): the request is routed as its decode leg, its prefill leg before each
        attempt (router/pd.py); else None (whole requests)."""
        return "decode" if disaggregated(self.scheduler.registry.serving(model)) else None

    def _policy_config(self) -> KvPolicyConfig:
        config = getattr(self.scheduler.policy, "config", None)
        return config if isinstance(config, KvPolicyConfig) else KvPolicyConfig()

    def _two_legs(self, call: _Call, data: dict[str, Any]) -> TwoLegs:
        request = call.request
        return TwoLegs(
            self.proxy,
            self.scheduler,
            self._policy_config(),
            data=data,
            path=request.scope["path"],
            request_id=call.request_id,
            headers=forwardable_headers(request.headers.raw),
            key=call.observation.client,
            spans=call.observation.spans,
        )

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``: keyed like a chat when kvgate renders its prompt as the
        engine does (else by load, ``ResponsesBody.prompt_input`` says why); a turn naming a
        ``previous_response_id`` goes to the worker that produced that response."""
        call = self._begin(request)
        try:
            raw = await self._read_client(call)
            data = decode_json_object(raw)
            if "request_id" in data:  # vLLM makes it the response id: one client could
                raise InvalidRequest(  # take over another's id
                    "request_id: kvgate does not take a client-chosen request_id on "
                    "/v1/responses (the engine would use it as the response id); leave it out",
                    param="request_id",
                )
            parsed = validate(ResponsesBody, data)
            call.parsed(parsed.model, len(raw), bool(parsed.stream))
            prompt, _ = parsed.prompt_input()
            session = self._session(call, parsed.user)
            key = ClientKeyId(call.observation.client)
            routed = await self._route(
                RequestFacts(
                    parsed.model,
                    prompt,
                    session_key=session,
                    max_tokens=parsed.output_limit,
                    spans=call.observation.spans,
                    only=self.holder_of(parsed.previous_response_id, key, "previous_response_id"),
                    leg=self._leg(parsed.model),  # whole, on a decode worker (no P/D leg)
                )
            )
            stored = parsed.store is not False  # store=false: its id is not recorded
            del data, parsed, prompt  # a queued request holds its body, not its JSON too
            grant = await self._admit(call, routed, len(raw))
        except KvgateError as exc:
            return self._refuse(exc, call)
        usage_mode = UsageMode.TAP if call.stream else UsageMode.BODY
        tap = self.scheduler.affinity.tap(key) if stored else None
        return self._send(call, grant, body=raw, usage_mode=usage_mode, answer_tap=tap)

    def holder_of(
        self, response_id: str | None, key: ClientKeyId | None, param: str
    ) -> WorkerId | None:
        """The worker holding a stored response of client ``key`` (``Scheduler.holder``;
        None: the admin's view, any key's). With client keys an id kvgate does not hold for
        ``key`` is a 404; without, it is routed by load and the engine answers for it."""
        try:
            return self.scheduler.holder(response_id, key, param=param, strict=self.tenants)
        except SchedulingError as exc:
            raise from_scheduling(exc, retry_after_s=self.settings.retry_after_s) from exc

    async def pass_through(self, request: Request) -> Response:
        """Any other ``/v1/*`` request: to a worker serving the body's (or query's) model.
        A POST (work for the engine, e.g. embeddings) goes through the router-side queue."""
        call = self._begin(request)
        try:
            path = normalised_path(request.scope["path"])
            if not self.pass_paths.permits(request.method, path):
                raise PathNotPassedThrough(request.method, path)
            target = upstream_target(path, request.scope.get("query_string", b""))
            raw = await self._read_client(call)
            stored, holder = self.stored_response(path, ClientKeyId(call.observation.client))
            call.parsed(stored or self._model_of(request, raw), len(raw), False)
            session = self._session(call, None)
            facts = RequestFacts(
                call.model, None, session_key=session, spans=call.observation.spans, only=holder
            )
            routed = await self._route(facts)
            grant = await self._admit(call, routed, len(raw), queued=request.method == "POST")
        except KvgateError as exc:
            return self._refuse(exc, call)
        return self._send(call, grant, body=raw, usage_mode=UsageMode.NONE, path=target)

    def _session(self, call: _Call, user: str | None) -> str | None:
        """The request's session key (``x-session-id``, else the body's ``user``), in its
        client key's namespace: one tenant cannot steer another's affinity or queue order."""
        return self.namespaced(
            call.observation.client, call.request.headers.get("x-session-id") or user
        )

    def namespaced(self, key: str, session: str | None) -> str | None:
        """A session key in client ``key``'s space (with client keys, two keys' sessions
        never share a worker by name)."""
        if session is None or not self.tenants:
            return session
        return f"{key}:{session}"

    def _begin(self, request: Request) -> _Call:
        """A proxied request arrives: its id, arrival time and observation (access log,
        trace, stream metrics)."""
        received_at = time.perf_counter()
        request_id = self.request_ids.of(request)
        scope = request.scope
        observation = self.observer.begin(
            request_id, scope["method"], scope["path"], scope["headers"], received_at
        )
        return _Call(request, request_id, received_at, observation)

    async def _read_client(self, call: _Call) -> bytes:
        """The client's key checked (401), then its body read (bounded)."""
        call.observation.client = self.check_client(call.request)
        return await self.read_body(call.request)

    async def _route(self, facts: RequestFacts) -> Routed:
        """The scheduler's routing decision (``Scheduler.route``: keys, matches, the
        policy's ranking, the capacity rule)."""
        try:
            return await self.scheduler.route(facts)
        except SchedulingError as exc:
            raise from_scheduling(exc, retry_after_s=self.settings.retry_after_s) from exc

    async def _admit(self, call: _Call, routed: Routed, size: int, *, queued: bool = True) -> Grant:
        """``routed`` through the router-side queue (``Scheduler.admit``) when it is on and
        ``queued``, else at once; ``size``: the bytes of the body it holds while queued. The
        two halves of ``Scheduler.schedule``, apart so that the handler drops the request's
        JSON before it may wait."""
        headers = call.request.headers
        timeout_s = client_timeout_s(headers) if queued else None
        try:
            grant = await self.scheduler.admit(
                routed,
                key=call.observation.client,
                session=routed.request.session_key,
                timeout_s=timeout_s,
                disconnected=disconnect_of(call.request.receive),
                queued=queued,
                size=size,
            )
        except SchedulingError as exc:
            if isinstance(exc, QueueTimeout):
                call.observation.queued = exc.waited_s
            raise from_scheduling(exc, retry_after_s=self.settings.retry_after_s) from exc
        call.observation.queued = grant.waited_s
        return grant

    def _send(
        self,
        call: _Call,
        grant: Grant,
        *,
        body: bytes,
        usage_mode: UsageMode,
        path: str | None = None,
        answer_tap: AnswerTap | None = None,
        legs: TwoLegs | None = None,
    ) -> Response:
        """Proxy the accepted request to the workers its grant names, in order."""
        request = call.request
        return self.proxy.respond(
            Exchange(
                request_id=call.request_id,
                method=request.method,
                path=path if path is not None else request.scope["path"],
                body=body,
                headers=forwardable_headers(request.headers.raw),
                model=call.model,
                grant=grant,
                stream=call.stream if path is None else True,
                usage_mode=usage_mode,
                received_at=call.received_at,
                observation=call.observation,
                answer_tap=answer_tap,
                legs=legs,
            )
        )

    def stored_response(self, path: str, key: ClientKeyId) -> tuple[str | None, WorkerId | None]:
        """``/v1/responses/{id}[/...]`` of a response kvgate routed for ``key``: to the
        worker holding it (a model it serves, and its id); anything else: (None, None)."""
        if not path.startswith(_RESPONSES):
            return None, None
        response_id = path.removeprefix(_RESPONSES).partition("/")[0]
        holder = self.holder_of(response_id, key, "response_id")
        models = self.registry.get(holder).models if holder is not None else None
        if holder is None or not models:
            return None, None
        return min(models), holder

    def _model_of(self, request: Request, raw: bytes) -> str:
        if raw.strip():
            return validate(AnyModelBody, decode_json_object(raw)).model
        model = request.query_params.get("model")
        if not model:
            raise InvalidRequest("model: a model is required to choose a worker", param="model")
        return model

    def _refuse(self, error: KvgateError, call: _Call) -> Response:
        observation = call.observation
        # never one label series per made-up model name
        model = "unknown" if isinstance(error, ModelNotFound) else call.model
        self.metrics.route("none", model).answered(str(error.status))
        if error.status >= 500:
            log.warning("%s: %s", observation.request_id, error.message)
        response = error_response(error, observation.request_id)
        observation.wrote(len(response.body))
        observation.finish(str(error.status))
        return response

    # -- models and probes --------------------------------------------------------------
    def list_models(self, request: Request) -> Response:
        self.check_client(request)
        return json_response({"object": "list", "data": self.registry.model_cards()})

    def get_model(self, request: Request, model: str) -> Response:
        self.check_client(request)
        for card in self.registry.model_cards():
            if card.get("id") == model:
                return json_response(card)
        try:
            self.scheduler.router.require_servable(model)  # 404 when nobody serves it
        except SchedulingError as exc:
            raise from_scheduling(exc) from exc
        return json_response({"id": model, "object": "model", "owned_by": "kvgate"})

    def ready(self) -> Response:
        """Ready with one ready worker (healthy, engine facts agreeing); how many workers
        their engines' facts keep out, per fact (which ones and why: ``/debug/index``, an
        admin path: this one is open)."""
        ready = self.registry.ready_count()
        body: dict[str, Any] = {
            "ready": ready > 0,
            "ready_workers": ready,
            "healthy_workers": self.registry.healthy_count(),
            "workers": len(self.registry),
        }
        unhealthy = unhealthy_reasons(self.registry)  # by position: /ready is open
        if unhealthy:
            body["unhealthy"] = unhealthy
        kept_out: dict[str, int] = {}
        for facts in self.registry.problems().values():
            for fact in facts:
                kept_out[fact] = kept_out.get(fact, 0) + 1
        if kept_out:
            body["not_ready"] = kept_out
        unresolved = self.registry.unresolved_models()
        if unresolved:  # no block size agreed: no worker serves the model (no URL in a reason)
            body["models_not_ready"] = unresolved
        return json_response(body, 200 if ready else 503)

    # -- admin --------------------------------------------------------------------------
    def describe_workers(self) -> dict[str, Any]:
        return {
            "policy": self.scheduler.policy.name,
            "workers": [self.describe_worker(w) for w in self.registry],
        }

    def describe_worker(self, worker: Worker) -> dict[str, Any]:
        """The admin view of a worker: the fleet's facts and what kvgate has in flight there."""
        return worker.describe() | self.scheduler.ledger.describe(worker.id)

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
        self._declare_series(worker)
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
        """``POST /debug/route``: the scheduler's decision for a body, without sending it
        (the queue's view for the client key in X-Api-Key: Bearer is the admin's)."""
        self.check_admin(request)
        data = decode_json_object(await self.read_body(request))
        key = self._key_id(request.headers.get("x-api-key")) or "-"  # Bearer is admin's
        session = request.headers.get("x-session-id")
        extra: dict[str, Any] = {}
        if "input" in data:  # a Responses API body
            body = validate(ResponsesBody, data)
            prompt, keyed = body.prompt_input()
            facts = RequestFacts(
                body.model,
                prompt,
                session_key=self.namespaced(key, session or body.user),
                max_tokens=body.output_limit,
                only=self.holder_of(body.previous_response_id, None, "previous_response_id"),
                leg=self._leg(body.model),
            )
            extra["responses_prompt"] = keyed
        else:
            parsed: ChatBody | CompletionBody
            if "messages" in data:
                parsed = validate(ChatBody, data)
            else:
                parsed = validate(CompletionBody, data)
            facts = RequestFacts(
                parsed.model,
                parsed.prompt_input(),
                session_key=self.namespaced(key, session or parsed.user),
                max_tokens=parsed.output_limit,
                leg=self._leg(parsed.model),
            )
        try:
            explained = await self.scheduler.explain(facts, key)
            if facts.leg is not None and "input" not in data:
                extra["disaggregated"] = await self._explain_legs(facts)
        except SchedulingError as exc:
            raise from_scheduling(exc, retry_after_s=self.settings.retry_after_s) from exc
        return json_response(explained | extra)

    async def _explain_legs(self, facts: RequestFacts) -> dict[str, Any]:
        """``/debug/route`` of a disaggregated request: its prefill leg's ranking and the
        plan for its chosen decode worker (the skip rule's two costs)."""
        routed = await self.scheduler.route(facts, held=True)
        plan, ranked = TwoLegs.plan_for(self.scheduler, self._policy_config(), routed)
        prefill = self.scheduler.router.explain(ranked) if ranked is not None else None
        return {"plan": plan.describe(), "prefill": prefill}

    # -- lifecycle ----------------------------------------------------------------------
    def index_stats(self) -> dict[str, Any]:
        stats = self.index.stats() if self.index is not None else {"index": None}
        return {**stats, "config_mismatch": self.registry.problems()}

    def resync(self, worker: WorkerId, replay: bool) -> bool:
        """Drop a worker's index entries and subscribe to its events again
        (``router.index_watch.Resync``)."""
        return self.index is not None and self.index.resync(worker, replay=replay)

    def event_progress(self, worker: WorkerId) -> int | None:
        """The seq of the worker's last applied event batch; ``LookupError`` unless it has
        exactly one event source, connected (``router.index_watch.EventProgress``)."""
        index = self.index
        if index is None or not index.connected(worker):  # KeyError: no event source
            raise LookupError(worker)
        try:
            index.applied_seq(worker, 1)
        except KeyError:
            return index.applied_seq(worker)
        raise LookupError(f"{worker} has several data-parallel event sources")

    def _declare_series(self, worker: Worker) -> None:
        """Start the worker's labelled series at zero (its index series start when the index
        subscribes to its events)."""
        self.metrics.declare_worker(worker.url, [*worker.base_models(), *sorted(worker.models)])
        if self.health_metrics is not None:
            self.health_metrics.declare(worker.url)

    async def start(self) -> None:
        if self.index is not None:
            await self.index.start()
        await self.health.probe_all()
        for worker in self.registry:
            self._declare_series(worker)
        if self.index is not None:  # from now on the index follows the registry's workers
            self.registry.subscribe(self.index)
            if self.index_watch is not None:  # after the index: it resyncs what it follows
                self.registry.subscribe(self.index_watch)
            await self.index.settled()
        self.health.start()
        self.scheduler.start()
        if self.discovery is not None:
            await self.discovery.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.health.stop()
        if self.index_watch is not None:
            self.registry.unsubscribe(self.index_watch)
        self.scheduler.stop()
        if self.index is not None:
            self.registry.unsubscribe(self.index)
            await self.index.stop()
        await self.proxy.upstream.aclose()
        await self.client.aclose()
        tracing = self.observer.tracing
        if tracing is not None:  # exports what is left: blocking I/O, off the event loop
            await asyncio.to_thread(tracing.shutdown)


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
