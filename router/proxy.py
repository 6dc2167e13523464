"""Forwarding one request to the ranked workers: failover, streaming, disconnects, usage.

``ProxyResponse`` is an ASGI response that does the upstream exchange itself, so that it
can (1) watch the client connection the whole time and cancel the upstream request the
moment the client goes, (2) try the next worker when one fails before answering, and
(3) relay a stream chunk by chunk, putting late errors inside the stream.

Two limits bound what one exchange holds: the whole exchange (attempts, streaming, a slow
client reading) ends at ``upstream.response_timeout_s``, and a non-streamed answer is
buffered up to ``upstream.max_response_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from backends.registry import LoadTicket, Worker, WorkerRegistry
from index.types import WorkerId
from router.config import UpstreamConfig
from router.errors import (
    KvgateError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamHTTPError,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
    from_httpx,
)
from router.metrics import REMOVED, GatewayMetrics, RouteMetrics
from router.routing import Routed, Router
from router.upstream import BodyTooLarge, Origin, UpstreamPool, UpstreamResponse
from router.usage import SseUsageTap, Usage, usage_from_body

log = logging.getLogger("kvgate.proxy")

# Request headers never forwarded upstream (hop-by-hop, recomputed, or the client's secrets).
_DROP_REQUEST = frozenset(
    {
        b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
        b"trailer", b"upgrade", b"proxy-authorization", b"proxy-connection", b"authorization",
        b"accept-encoding", b"x-request-id", b"x-api-key", b"expect",
    }
)  # fmt: skip
# Response headers never relayed to the client.
_DROP_RESPONSE = frozenset(
    {
        b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
        b"content-length", b"date", b"server", b"proxy-authenticate", b"set-cookie",
        b"x-request-id",
    }
)  # fmt: skip
_CLIENT_CLOSED = "499"  # nginx's convention for "client closed the request"
_LAST_WRITE_S = 5.0  # past the deadline: how long the error may take to reach the client


class UsageMode(Enum):
    NONE = "none"  # do not look for usage
    BODY = "body"  # non-streaming JSON body
    TAP = "tap"  # stream: the client asked for usage, watch for it
    HIDE = "hide"  # stream: kvgate asked for usage, watch for it and hide it


@dataclass(slots=True)
class Exchange:
    """Everything needed to forward one client request."""

    request_id: str
    method: str
    path: str  # upstream path with query string
    body: bytes
    headers: list[tuple[bytes, bytes]]  # client headers safe to forward
    model: str
    routed: Routed
    stream: bool  # relay chunk by chunk (else read the whole body first)
    usage_mode: UsageMode
    received_at: float  # time.perf_counter() when the request arrived


@dataclass(slots=True)
class _Outcome:
    worker: Worker | None = None
    status: str = "500"
    usage: Usage | None = None
    first_choice: WorkerId | None = None


def forwardable_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Client request headers that may go upstream (ASGI names are lower-case)."""
    return [(k, v) for k, v in headers if k not in _DROP_REQUEST]


def _relay_headers(response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in response.headers.raw if k.lower() not in _DROP_RESPONSE]


class Proxy:
    """Shared state of all forwards: the upstream pool, the registry, metrics and limits."""

    def __init__(
        self,
        upstream: UpstreamPool,
        registry: WorkerRegistry,
        router: Router,
        metrics: GatewayMetrics,
        config: UpstreamConfig,
    ) -> None:
        self.upstream = upstream
        self.registry = registry
        self.router = router
        self.metrics = metrics
        self.config = config
        self._origins: dict[str, Origin] = {}

    def origin(self, worker: Worker) -> Origin:
        origin = self._origins.get(worker.url)
        if origin is None:
            if len(self._origins) > 4096:  # workers come and go: stay bounded
                self._origins.clear()
            origin = self._origins[worker.url] = Origin.of(worker.url)
        return origin

    def respond(self, exchange: Exchange) -> ProxyResponse:
        return ProxyResponse(self, exchange)

    def worker_label(self, worker: Worker) -> str:
        """The worker's metric label; a removed worker's series are gone and stay gone."""
        return REMOVED if worker.removed else worker.url

    def route_metrics(self, worker: Worker, model: str) -> RouteMetrics:
        return self.metrics.route(self.worker_label(worker), model)


class ProxyResponse(Response):
    """Runs the upstream exchange while streaming the answer to the client."""

    def __init__(self, proxy: Proxy, exchange: Exchange) -> None:
        self._proxy = proxy
        self._x = exchange
        self._started = False
        self._completed = False
        self._sse = False
        self._client_gone = False
        self._late = False  # the whole-exchange deadline passed
        self.status_code = 200
        self.background = None
        self.raw_headers = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = _Outcome(first_choice=self._x.routed.decision.chosen)
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(self._watch_client(receive, task))
        deadline = loop.call_later(self._proxy.config.response_timeout_s, self._too_late, task)
        try:
            await self._forward(send, outcome)
        except asyncio.CancelledError:
            if not (self._client_gone or self._late):
                raise
            for _ in range(self._client_gone + self._late):
                task.uncancel()  # our own cancels: nothing more to do, or say it is late
            if self._late and not self._client_gone:
                await self._deadline_passed(send, outcome)
        finally:
            deadline.cancel()
            watcher.cancel()
            self._record(outcome)

    def _too_late(self, task: asyncio.Task[None]) -> None:
        """``upstream.response_timeout_s`` is up: stop the exchange where it is."""
        if not self._completed:
            self._late = True
            task.cancel()

    async def _deadline_passed(self, send: Send, outcome: _Outcome) -> None:
        """The exchange outlived ``response_timeout_s``: 504, or an error ending the stream
        (given a few seconds to reach a client that may be the slow part)."""
        self._proxy.metrics.limit_exceeded("response_deadline")
        limit = self._proxy.config.response_timeout_s
        worker = outcome.worker.url if outcome.worker is not None else "-"
        error = UpstreamTimeout(f"the exchange did not finish within {limit:g} s", worker=worker)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_LAST_WRITE_S):
                await self._fail(send, error, outcome)

    async def _watch_client(self, receive: Receive, task: asyncio.Task[None]) -> None:
        """Cancel the exchange the moment the client disconnects."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._completed:
            self._client_gone = True
            task.cancel()

    # -- attempts ---------------------------------------------------------------------
    async def _forward(self, send: Send, outcome: _Outcome) -> None:
        proxy, x = self._proxy, self._x
        attempts = list(x.routed.decision.ranked[: 1 + proxy.config.max_failover])
        last_error: UpstreamError | None = None
        for i, worker_id in enumerate(attempts):
            worker = proxy.registry.find(worker_id)
            if worker is None or not (worker.healthy or i == 0):
                continue  # removed, or marked down by a concurrent failure
            outcome.worker = worker
            try:
                await self._attempt(worker, send, outcome)
                return
            except UpstreamError as exc:
                last_error = exc
                if not exc.retryable or self._started:
                    break
                if i < len(attempts) - 1:
                    label = proxy.worker_label(worker)
                    proxy.metrics.retries.labels(label, exc.code or "error").inc()
                    log.info("%s: trying the next worker after: %s", x.request_id, exc.detail)
        if last_error is None:  # every ranked worker was removed or marked down meanwhile
            last_error = UpstreamConnectError("no ranked worker is left", worker="-")
        await self._fail(send, last_error, outcome)

    async def _attempt(self, worker: Worker, send: Send, outcome: _Outcome) -> None:
        proxy, x = self._proxy, self._x
        headers = self._upstream_headers(worker)
        routed = x.routed
        ticket = proxy.registry.begin(
            worker.id,
            routed.predicted_uncached_tokens(worker.id),
            routed.load_blocks,
            routed.request.block_size,
            routed.request.prompt_tokens,
        )
        try:
            proxy.metrics.overhead.observe(time.perf_counter() - x.received_at)
            try:
                response = await proxy.upstream.request(
                    proxy.origin(worker), x.method, x.path, headers, x.body
                )
            except httpx.HTTPError as exc:
                error = from_httpx(exc, worker=worker.url)
                # Refused/reset: the engine is gone, mark it down at once. A connect timeout
                # may only mean a starved box: it counts towards the failure threshold.
                proxy.registry.record_failure(
                    worker, error.detail, immediate=isinstance(exc, httpx.ConnectError)
                )
                raise error from exc
            proxy.router.record_sent(x.routed, worker.id)
            try:
                await self._relay(worker, response, ticket, send, outcome)
            finally:
                await response.aclose()  # never waits: closes at once when not complete
        finally:
            observed = ticket.finish()
            if observed is not None:
                miss = observed.measured_s - observed.predicted_s
                proxy.metrics.ttft_error.labels(worker.url).observe(miss)

    def _upstream_headers(self, worker: Worker) -> list[tuple[bytes, bytes]]:
        headers = [
            *self._x.headers,
            (b"x-request-id", self._x.request_id.encode()),
            (b"accept-encoding", b"identity"),
        ]
        authorization = worker.config.authorization()
        if authorization is not None:
            headers.append((b"authorization", authorization.encode()))
        return headers

    # -- relaying ---------------------------------------------------------------------
    async def _relay(
        self,
        worker: Worker,
        response: UpstreamResponse,
        ticket: LoadTicket,
        send: Send,
        outcome: _Outcome,
    ) -> None:
        if response.status_code >= 400:
            await self._pass_error(worker, response, send, outcome)
        elif self._x.stream:
            await self._relay_stream(worker, response, ticket, send, outcome)
        else:
            await self._relay_body(worker, response, ticket, send, outcome)

    async def _pass_error(
        self, worker: Worker, response: UpstreamResponse, send: Send, outcome: _Outcome
    ) -> None:
        body = await self._read(worker, response)
        if response.status_code >= 500:
            self._proxy.registry.record_failure(worker, f"answered {response.status_code}")
        else:  # a client error is no sign of a sick engine
            self._proxy.registry.record_ok_response(worker)
        error = UpstreamHTTPError(
            response.status_code, body, response.headers.get("content-type"), worker=worker.url
        )
        await self._fail(send, error, outcome)

    async def _relay_body(
        self,
        worker: Worker,
        response: UpstreamResponse,
        ticket: LoadTicket,
        send: Send,
        outcome: _Outcome,
    ) -> None:
        body = await self._read(worker, response)
        ticket.first_token(measured=False)  # the whole body: no first-token time
        self._proxy.registry.record_ok_response(worker)
        if self._x.usage_mode is UsageMode.BODY:
            outcome.usage = usage_from_body(body)
        headers = self._client_headers(worker, response)
        headers.append((b"content-length", str(len(body)).encode()))
        await self._start(send, response.status_code, headers)
        await self._end(send, body)
        outcome.status = str(response.status_code)

    async def _relay_stream(
        self,
        worker: Worker,
        response: UpstreamResponse,
        ticket: LoadTicket,
        send: Send,
        outcome: _Outcome,
    ) -> None:
        mode = self._x.usage_mode
        is_sse = (response.headers.get("content-type") or "").startswith("text/event-stream")
        tap = (
            SseUsageTap(hide=mode is UsageMode.HIDE)
            if is_sse and mode is not UsageMode.NONE
            else None
        )
        await self._start(send, response.status_code, self._client_headers(worker, response))
        outcome.status = str(response.status_code)
        self._sse = is_sse
        first = True
        try:
            async for chunk in response.aiter_raw():
                if first:
                    first = False
                    ticket.first_token()
                    elapsed = time.perf_counter() - self._x.received_at
                    self._proxy.route_metrics(worker, self._x.model).ttft.observe(elapsed)
                out = tap.feed(chunk) if tap is not None else chunk
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except httpx.HTTPError as exc:
            error = from_httpx(exc, worker=worker.url)
            self._proxy.registry.record_failure(worker, error.detail)
            await self._fail(send, error, outcome)
            return
        self._proxy.registry.record_ok_response(worker)
        tail = tap.flush() if tap is not None else b""
        if tap is not None:
            outcome.usage = tap.usage
        usage = outcome.usage
        ticket.complete(*((usage.prompt_tokens, usage.cached_tokens) if usage else (None, None)))
        await self._end(send, tail)

    async def _read(self, worker: Worker, response: UpstreamResponse) -> bytes:
        limit = self._proxy.config.max_response_bytes
        try:
            return await response.aread(limit)
        except httpx.HTTPError as exc:
            raise from_httpx(exc, worker=worker.url) from exc
        except BodyTooLarge as exc:
            self._proxy.metrics.limit_exceeded("upstream_response_bytes")
            raise UpstreamResponseTooLarge(limit, worker=worker.url) from exc

    # -- client side ------------------------------------------------------------------
    def _client_headers(
        self, worker: Worker, response: UpstreamResponse
    ) -> list[tuple[bytes, bytes]]:
        x = self._x
        predicted = x.routed.predicted_cached_tokens(worker.id)
        return [
            *_relay_headers(response),
            (b"x-kvgate-worker", worker.url.encode()),
            (b"x-request-id", x.request_id.encode()),
            (b"x-kvgate-predicted-cached-tokens", str(predicted).encode()),
        ]

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _end(self, send: Send, body: bytes) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._completed = True

    async def _fail(self, send: Send, error: KvgateError, outcome: _Outcome) -> None:
        """Report ``error``: as the response before it started, inside the stream after."""
        outcome.status = str(error.status)
        if self._started:
            detail = getattr(error, "detail", error.message)
            log.warning("%s: error inside the stream: %s", self._x.request_id, detail)
            await self._end(send, error.sse_bytes() if self._sse else b"")
            return
        content_type = getattr(error, "content_type", "application/json")
        headers = [
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body := error.body_bytes())).encode()),
            (b"x-request-id", self._x.request_id.encode()),
            *((k.encode(), v.encode()) for k, v in error.headers.items()),
        ]
        worker = getattr(error, "worker", None)
        if isinstance(worker, str) and worker != "-":
            headers.append((b"x-kvgate-worker", worker.encode()))
        await self._start(send, error.status, headers)
        await self._end(send, body)

    # -- accounting -------------------------------------------------------------------
    def _record(self, outcome: _Outcome) -> None:
        x, metrics = self._x, self._proxy.metrics
        status = _CLIENT_CLOSED if self._client_gone and not self._completed else outcome.status
        if outcome.worker is None:
            metrics.route("none", x.model).answered(status)
            return
        route = self._proxy.route_metrics(outcome.worker, x.model)
        route.answered(status)
        route.e2e.observe(time.perf_counter() - x.received_at)
        if outcome.worker.id != outcome.first_choice:
            route.failovers.inc()
        if status == "200" and x.usage_mode is not UsageMode.NONE:
            self._record_cache(route, outcome.worker, outcome.usage)

    def _record_cache(self, route: RouteMetrics, worker: Worker, usage: Usage | None) -> None:
        routed = self._x.routed
        prompt_tokens = routed.request.prompt_tokens
        if usage is not None and usage.prompt_tokens is not None:
            prompt_tokens = usage.prompt_tokens
        route.record_cache(
            prompt_tokens=prompt_tokens,
            predicted=routed.predicted_cached_tokens(worker.id),
            best_available=routed.best_available_cached_tokens,
            engine_cached=usage.cached_tokens if usage is not None else None,
        )
