"""Forwarding one request to a worker: retries until the first token, streaming, disconnects.

``ProxyResponse`` is an ASGI response that does the upstream exchange itself, so that it
can (1) watch the client connection the whole time and cancel the upstream request the
moment the client goes, (2) retry on another worker when one fails before the first token,
and (3) relay a stream chunk by chunk, putting late errors inside the stream.

One exchange, step by step (each step a method, so hooks have a defined place)::

    _forward                 the attempt loop: at most 1 + upstream.max_failover attempts
      _attempt               one worker: LoadTicket, upstream request, relay
        _relay_body          non-streaming: the whole body, then commit
        _relay_stream        streaming: hold until the first content event, commit, relay
        AttemptFailed        before the commit: worker marked, the scheduler ranks again
                             (``Grant.reroute``, failed workers excluded), next attempt;
                             a 5xx or an error event is charged to its worker only when
                             another worker answers, and ends the failover when a second
                             worker fails alike (the request's fault, ``_failed_alike``)
      _commit                the client's response starts (status and headers); from here
                             errors go inside the stream (``_fail``)
      _fail                  no attempt succeeded: the last failure as a JSON error

**The commit point.** Nothing reaches the client, not even the status, until the engine has
produced its first content (``router.commit``: a token, a usage chunk, ``[DONE]``; not an SSE
comment, an empty role chunk or the Responses API's ``response.created``) or, not streaming,
its whole body. What arrives before is held (at most ``_MAX_HELD_BYTES``). So an engine that
is refused, resets, times out, answers 5xx or sends an error event before the first token
costs a retry, never a ``200`` holding only an error. After the commit a failure ends the
stream with an OpenAI error event (``kvgate_stream_errors_total{reason}``); the client has
to retry those itself.

Two limits bound what one exchange holds: the whole exchange (attempts, streaming, a slow
client reading) ends at ``upstream.response_timeout_s``, and a non-streamed answer is
buffered up to ``upstream.max_response_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvgate.backends.registry import Worker, WorkerRegistry
from kvgate.index.errors import JsonDecodeError
from kvgate.index.memo import BoundedMemo
from kvgate.index.types import WorkerId
from kvgate.router.commit import (
    AttemptFailed,
    Reason,
    StreamStart,
    Verdict,
    error_events,
    failure_reason,
)
from kvgate.router.config import UpstreamConfig
from kvgate.router.errors import (
    KvgateError,
    UpstreamConnectError,
    UpstreamHTTPError,
    UpstreamProtocolError,
    UpstreamResponseTooLarge,
    UpstreamStreamError,
    UpstreamTimeout,
    from_httpx,
)
from kvgate.router.metrics import REMOVED, GatewayMetrics, RouteMetrics
from kvgate.router.observe import Observation
from kvgate.router.upstream import BodyTooLarge, Origin, UpstreamPool, UpstreamResponse
from kvgate.router.usage import SseUsageTap, Usage, usage_from_body
from kvgate.scheduling.grant import Grant
from kvgate.scheduling.ledger import LoadTicket
from kvgate.scheduling.routing import Routed

log = logging.getLogger("kvgate.proxy")

# Request headers never forwarded upstream (hop-by-hop, recomputed, or the client's secrets).
_DROP_REQUEST = frozenset(
    {
        b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
        b"trailer", b"upgrade", b"proxy-authorization", b"proxy-connection", b"authorization",
        b"accept-encoding", b"x-request-id", b"x-api-key", b"expect",
        b"x-data-parallel-rank",  # kvgate picks the rank (its ledger counts it there)
    }
)  # fmt: skip
DP_RANK_HEADER = b"x-data-parallel-rank"  # the target rank, read by vLLM and SGLang
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
_MAX_HELD_BYTES = 1 << 20  # a stream's bytes held before its first content, at most
_EVENT_ENDS = (b"\n\n", b"\r\r", b"\r\n\r\n")
_SSE_DATA = b"data:"  # an event's data line: one per streamed token
_SSE_DONE = b"data: [DONE]"  # the end of an OpenAI stream: no token
_WORKER_GONE = frozenset({Reason.REFUSED, Reason.RESET})


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
    grant: Grant  # where to send it (the scheduler's decision), its share until it ends
    stream: bool  # relay chunk by chunk (else read the whole body first)
    usage_mode: UsageMode
    received_at: float  # time.perf_counter() when the request arrived
    observation: Observation  # access log, trace and stream metrics of this request
    answer_tap: AnswerTap | None = None  # shown a successful answer's first bytes
    legs: AttemptBody | None = None  # a disaggregated request's prefill legs (router/pd.py)


class AttemptBody(Protocol):
    """What runs before each attempt of a disaggregated request (``router.pd.TwoLegs``)."""

    async def body_for(self, worker: Worker, routed: Routed, body: bytes) -> bytes:
        """The body to send ``worker`` (the prefill leg runs first, unless skipped)."""
        ...

    def predicted(self, worker: WorkerId) -> int | None:
        """Tokens ``worker`` should report cached (None: the routing's prediction)."""
        ...

    def observe(self, observation: Observation, status: str) -> None:
        """The exchange is over with ``status``."""
        ...


class AnswerTap(Protocol):
    def feed(self, worker: WorkerId, chunk: bytes) -> bool:
        """The next bytes of ``worker``'s successful answer; True: seen enough."""
        ...


@dataclass(slots=True)
class _Held:
    """A stream read up to its first content: the chunks, and whether the body ended."""

    chunks: list[bytes]
    ended: bool
    sse: bool


@dataclass(slots=True)
class _Outcome:
    routed: Routed  # the ranking the answering (or last tried) worker was chosen from
    worker: Worker | None = None
    status: str = "500"
    usage: Usage | None = None
    first_choice: WorkerId | None = None
    sent_at: float = 0.0  # time.monotonic() when the answering attempt was sent


ServedListener = Callable[[Worker, Usage, int, float], None]
"""Told of each answered request with engine usage: (worker, usage, block size, sent at)."""


def forwardable_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Client request headers that may go upstream (ASGI names are lower-case)."""
    return [(k, v) for k, v in headers if k not in _DROP_REQUEST]


def _relay_headers(response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in response.headers.raw if k.lower() not in _DROP_RESPONSE]


class Proxy:
    """Shared state of all forwards: the upstream pool, the registry (passive health),
    metrics and limits."""

    def __init__(
        self,
        upstream: UpstreamPool,
        registry: WorkerRegistry,
        metrics: GatewayMetrics,
        config: UpstreamConfig,
    ) -> None:
        self.upstream = upstream
        self.registry = registry
        self.metrics = metrics
        self.config = config
        self.served_listeners: list[ServedListener] = []
        self._origins: BoundedMemo[str, Origin] = BoundedMemo(4096)  # workers come and go

    def origin(self, worker: Worker) -> Origin:
        origin = self._origins.get(worker.url)
        if origin is None:
            origin = self._origins.put(worker.url, Origin.of(worker.url))
        return origin

    def respond(self, exchange: Exchange) -> ProxyResponse:
        return ProxyResponse(self, exchange)

    def worker_label(self, worker: Worker) -> str:
        """The worker's metric label; a removed worker's series are gone and stay gone."""
        return REMOVED if worker.removed else worker.url

    def route_metrics(self, worker: Worker, model: str) -> RouteMetrics:
        return self.metrics.route(self.worker_label(worker), model)

    def mark_failed(self, worker: Worker, reason: str, detail: str) -> None:
        """Passive health: a refused or broken connection marks the worker down at once;
        other failures count towards the failure threshold."""
        if reason == Reason.HEAD_TOO_LARGE:
            self.metrics.limit_exceeded("upstream_head")
        self.registry.record_failure(worker, detail, immediate=reason in _WORKER_GONE)


class ProxyResponse(Response):
    """Runs the upstream exchange while streaming the answer to the client."""

    def __init__(self, proxy: Proxy, exchange: Exchange) -> None:
        self._proxy = proxy
        self._x = exchange
        self._started = False  # the client's response started: the commit point is behind
        self._completed = False
        self._sse = False
        self._tail_open = False  # the last relayed bytes ended inside an SSE event
        self._watch_errors = False  # look for the engine's error events in the stream
        self._answer_tap: AnswerTap | None = None  # the committed stream's, until fed enough
        self._client_gone = False
        self._late = False  # the whole-exchange deadline passed
        # failures that may be the request's, charged to their workers at the commit
        self._uncharged: list[tuple[Worker, str, str]] = []
        self.status_code = 200
        self.background = None
        self.raw_headers = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        routed = self._x.grant.routed
        outcome = _Outcome(routed, first_choice=routed.chosen)
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
            self._x.grant.release()
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
                await self._fail(send, error, outcome, Reason.DEADLINE)

    async def _watch_client(self, receive: Receive, task: asyncio.Task[None]) -> None:
        """Cancel the exchange the moment the client disconnects."""
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._completed:
            self._client_gone = True
            task.cancel()

    # -- attempts ---------------------------------------------------------------------
    async def _forward(self, send: Send, outcome: _Outcome) -> None:
        """Attempts until one commits: the policy's choice first, then a fresh ranking
        without the workers that failed, at most ``1 + upstream.max_failover`` in all."""
        proxy = self._proxy
        attempts = 1 + proxy.config.max_failover
        routed = outcome.routed
        tried: list[WorkerId] = []
        failure: AttemptFailed | None = None
        for attempt in range(attempts):
            worker = proxy.registry.find(routed.chosen)
            usable = worker is not None and (worker.healthy or attempt == 0)
            if worker is not None and usable:  # else removed, or marked down meanwhile
                outcome.routed, outcome.worker = routed, worker
                try:
                    await self._attempt(worker, routed, send, outcome, first=attempt == 0)
                    return
                except AttemptFailed as exc:
                    failure = exc
                    self._x.observation.attempt_failed(exc.error)
                    if not exc.error.retryable or self._failed_alike(worker, exc):
                        break
            tried.append(routed.chosen)
            next_routed = self._x.grant.reroute(tried) if attempt + 1 < attempts else None
            if next_routed is None:
                break
            routed = next_routed
            if worker is not None and usable and failure is not None:
                self._count_retry(worker, failure)
        error = failure.error if failure is not None else None
        if error is None:  # every ranked worker was removed or marked down meanwhile
            error = UpstreamConnectError("no ranked worker is left", worker="-")
        await self._fail(send, error, outcome)

    def _failed_alike(self, worker: Worker, failure: AttemptFailed) -> bool:
        """Did another worker fail this request the same way (a 5xx, an error event before
        the first token)? Then it is the request's fault: no more failover, and no worker is
        charged a health failure for it (a client cannot mark the fleet down). Else such a
        failure waits to be charged until another worker answers (``_commit``)."""
        if failure.charge is None:
            return False
        if any(reason == failure.reason for _, reason, _ in self._uncharged):
            self._uncharged.clear()
            self._proxy.metrics.request_faults.labels(failure.reason).inc()
            log.info(
                "%s: failed alike on two workers (%s): the request's fault, not retried",
                self._x.request_id,
                failure.reason,
            )
            return True
        self._uncharged.append((worker, failure.reason, failure.charge))
        return False

    def _count_retry(self, worker: Worker, failure: AttemptFailed) -> None:
        label = self._proxy.worker_label(worker)
        self._proxy.metrics.retries.labels(label, failure.reason).inc()
        detail = getattr(failure.error, "detail", failure.error.message)
        log.info("%s: retrying on another worker after: %s", self._x.request_id, detail)

    async def _attempt(
        self, worker: Worker, routed: Routed, send: Send, outcome: _Outcome, *, first: bool
    ) -> None:
        """One worker's try; ``AttemptFailed`` when it fails before the commit."""
        proxy, x = self._proxy, self._x
        body = x.body
        if x.legs is not None:  # its prefill leg first (or not: skipped)
            body = await x.legs.body_for(worker, routed, body)
        headers = x.observation.attempt(worker.url, self._upstream_headers(worker, routed))
        spans = x.observation.spans
        cached = x.legs.predicted(worker.id) if x.legs is not None else None
        ticket = x.grant.begin(worker.id, cached=cached)  # the scheduler's ledger counts it
        dp_rank = routed.dp_rank(worker.id)
        if dp_rank is not None:
            proxy.metrics.dp_rank_attempts.labels(proxy.worker_label(worker), str(dp_rank)).inc()
        try:
            if first:
                proxy.metrics.overhead.observe(time.perf_counter() - x.received_at)
            outcome.sent_at = time.monotonic()
            try:
                response = await proxy.upstream.request(
                    proxy.origin(worker),
                    x.method,
                    x.path,
                    headers,
                    body,
                    sent=spans.sent if spans is not None else None,
                )
            except httpx.HTTPError as exc:
                raise self._transport_failed(worker, exc) from exc
            if spans is not None:
                spans.head(response.status_code)
            x.grant.sent(worker.id)
            try:
                await self._relay(worker, response, ticket, send, outcome)
            finally:
                await response.aclose()  # never waits: closes at once when not complete
        finally:
            routed.finish_keys()  # (if the first token did not already)
            observed = ticket.finish()
            if observed is not None:
                miss = observed.measured_s - observed.predicted_s
                proxy.metrics.ttft_error.labels(worker.url).observe(miss)
                settled = x.grant.observed(worker.id, observed)
                if settled is not None:
                    proxy.metrics.mechanism_settled(settled)

    def _transport_failed(self, worker: Worker, exc: httpx.HTTPError) -> AttemptFailed:
        error = from_httpx(exc, worker=worker.url)
        reason = failure_reason(exc)
        self._proxy.mark_failed(worker, reason, error.detail)
        return AttemptFailed(error, reason)

    def _upstream_headers(self, worker: Worker, routed: Routed) -> list[tuple[bytes, bytes]]:
        headers = [
            *self._x.headers,
            (b"x-request-id", self._x.request_id.encode()),
            (b"accept-encoding", b"identity"),
        ]
        dp_rank = routed.dp_rank(worker.id)
        if dp_rank is not None:  # the engine's rank for it (vLLM and SGLang read this header)
            headers.append((DP_RANK_HEADER, str(dp_rank).encode()))
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
        """The engine's 4xx goes to the client as it is; a 5xx fails the attempt."""
        body = await self._read(worker, response)
        error = UpstreamHTTPError(
            response.status_code, body, response.headers.get("content-type"), worker=worker.url
        )
        if error.retryable:  # charged once another worker answers it (_forward)
            charge = f"answered {response.status_code}"
            raise AttemptFailed(error, Reason.HTTP_5XX, charge=charge)
        self._proxy.registry.record_ok_response(worker)  # a client error: no sign of sickness
        if response.status_code == 404 and self._x.model in worker.models:
            self._proxy.registry.models_stale(worker)  # an adapter unloaded meanwhile?
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
        if self._x.usage_mode is UsageMode.BODY:
            outcome.usage = self._usage_of(worker, body)
        ticket.first_token(measured=False)  # the whole body: no first-token time
        self._proxy.registry.record_ok_response(worker)
        if self._x.answer_tap is not None:
            self._x.answer_tap.feed(worker.id, body)
        headers = self._client_headers(worker, outcome.routed, response)
        headers.append((b"content-length", str(len(body)).encode()))
        await self._commit(send, response.status_code, headers, outcome)
        await self._end(send, body)

    def _usage_of(self, worker: Worker, body: bytes) -> Usage | None:
        """The usage of a whole answer; one nested deeper than kvgate reads JSON fails the
        attempt (``bad_answer``)."""
        try:
            return usage_from_body(body)
        except JsonDecodeError as exc:
            detail = f"its answer: {exc}"
            self._proxy.mark_failed(worker, Reason.BAD_ANSWER, detail)
            error = UpstreamProtocolError(
                "the engine's answer could not be read", worker=worker.url, detail=detail
            )
            raise AttemptFailed(error, Reason.BAD_ANSWER) from exc

    async def _relay_stream(
        self,
        worker: Worker,
        response: UpstreamResponse,
        ticket: LoadTicket,
        send: Send,
        outcome: _Outcome,
    ) -> None:
        held = await self._hold(worker, response)
        ticket.first_token()
        outcome.routed.finish_keys()
        elapsed = time.perf_counter() - self._x.received_at
        self._proxy.route_metrics(worker, self._x.model).ttft.observe(elapsed)
        self._x.observation.first_byte(elapsed)
        headers = self._client_headers(worker, outcome.routed, response)
        await self._commit(send, response.status_code, headers, outcome)
        await self._relay_rest(worker, response, held, send, outcome, ticket=ticket)

    async def _hold(self, worker: Worker, response: UpstreamResponse) -> _Held:
        """Read a stream up to its first content (any byte when it is not SSE).
        ``AttemptFailed`` when it breaks, stalls or carries an error event first."""
        sse = (response.headers.get("content-type") or "").startswith("text/event-stream")
        start = StreamStart(_MAX_HELD_BYTES)
        while True:
            try:
                chunk = await response.next_chunk()
            except httpx.HTTPError as exc:
                raise self._transport_failed(worker, exc) from exc
            if chunk is None:
                return _Held(start.take(), True, sse)  # ended without content: the answer
            if not sse:
                return _Held([chunk], False, sse)
            verdict = start.feed(chunk)
            if verdict is Verdict.COMMIT:
                return _Held(start.take(), False, sse)
            if verdict is Verdict.FAILED:
                detail = start.failure or "error event"
                error = UpstreamStreamError(
                    "the engine failed the request before its first token",
                    worker=worker.url,
                    detail=detail,
                )
                raise AttemptFailed(error, Reason.ERROR_EVENT, charge=detail)

    async def _relay_rest(
        self,
        worker: Worker,
        response: UpstreamResponse,
        held: _Held,
        send: Send,
        outcome: _Outcome,
        *,
        ticket: LoadTicket,
    ) -> None:
        """After the commit: the held chunks, then the rest as it comes (errors go inside)."""
        self._sse = self._watch_errors = held.sse
        self._answer_tap = self._x.answer_tap
        mode = self._x.usage_mode
        tap = None
        if held.sse and mode is not UsageMode.NONE:
            tap = SseUsageTap(hide=mode is UsageMode.HIDE)
        for chunk in held.chunks:
            await self._relay_chunk(send, chunk, tap, worker, ticket)
        try:
            while not held.ended and (more := await response.next_chunk()) is not None:
                await self._relay_chunk(send, more, tap, worker, ticket)
        except httpx.HTTPError as exc:
            error = from_httpx(exc, worker=worker.url)
            reason = failure_reason(exc)
            self._proxy.mark_failed(worker, reason, error.detail)
            await self._fail(send, error, outcome, reason)
            return
        self._proxy.registry.record_ok_response(worker)
        tail = tap.flush() if tap is not None else b""
        if tap is not None:
            outcome.usage = tap.usage
        usage = outcome.usage
        ticket.complete(*((usage.prompt_tokens, usage.cached_tokens) if usage else (None, None)))
        await self._end(send, tail)

    async def _relay_chunk(
        self, send: Send, chunk: bytes, tap: SseUsageTap | None, worker: Worker, ticket: LoadTicket
    ) -> None:
        if self._sse:  # an event a token (vLLM, SGLang): the answer's blocks grow with them
            ticket.streamed(chunk.count(_SSE_DATA) - chunk.count(_SSE_DONE))
        if self._answer_tap is not None and self._answer_tap.feed(worker.id, chunk):
            self._answer_tap = None  # it has seen enough
        if self._watch_errors and error_events(chunk):  # the engine's own, after tokens
            self._watch_errors = False  # counted once per stream
            self._stream_error(worker, Reason.ENGINE_ERROR)
        out = tap.feed(chunk) if tap is not None else chunk
        if out:
            self._tail_open = not out.endswith(_EVENT_ENDS)
            self._x.observation.chunk(out)
            await send({"type": "http.response.body", "body": out, "more_body": True})

    async def _read(self, worker: Worker, response: UpstreamResponse) -> bytes:
        limit = self._proxy.config.max_response_bytes
        try:
            return await response.aread(limit)
        except httpx.HTTPError as exc:
            raise self._transport_failed(worker, exc) from exc
        except BodyTooLarge as exc:
            self._proxy.metrics.limit_exceeded("upstream_response_bytes")
            error = UpstreamResponseTooLarge(limit, worker=worker.url)
            raise AttemptFailed(error, Reason.TOO_LARGE) from exc

    # -- client side ------------------------------------------------------------------
    def _client_headers(
        self, worker: Worker, routed: Routed, response: UpstreamResponse
    ) -> list[tuple[bytes, bytes]]:
        predicted = self._predicted(worker, routed)
        headers = [
            *_relay_headers(response),
            (b"x-kvgate-worker", worker.url.encode()),
            (b"x-request-id", self._x.request_id.encode()),
            (b"x-kvgate-predicted-cached-tokens", str(predicted).encode()),
        ]
        dp_rank = routed.dp_rank(worker.id)
        if dp_rank is not None:
            headers.append((b"x-kvgate-dp-rank", str(dp_rank).encode()))
        return headers

    def _predicted(self, worker: Worker, routed: Routed) -> int:
        legs = self._x.legs
        predicted = legs.predicted(worker.id) if legs is not None else None
        return routed.predicted_cached_tokens(worker.id) if predicted is None else predicted

    async def _commit(
        self, send: Send, status: int, headers: list[tuple[bytes, bytes]], outcome: _Outcome
    ) -> None:
        """The commit point: the client's response starts; no other worker is tried after.
        The workers that failed it alone before are charged their health failure now."""
        outcome.status = str(status)
        for worker, reason, detail in self._uncharged:
            if not worker.removed:
                self._proxy.mark_failed(worker, reason, detail)
        self._uncharged.clear()
        await self._start(send, status, headers)

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _end(self, send: Send, body: bytes) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._completed = True
        self._x.observation.wrote(len(body))

    async def _fail(
        self, send: Send, error: KvgateError, outcome: _Outcome, reason: str | None = None
    ) -> None:
        """Report ``error``: as the response before it started, inside the stream after
        (counted in ``kvgate_stream_errors_total`` by ``reason``)."""
        outcome.status = str(error.status)
        if self._started:
            detail = getattr(error, "detail", error.message)
            log.warning("%s: error inside the stream: %s", self._x.request_id, detail)
            self._stream_error(outcome.worker, reason or Reason.RESET)
            event = error.sse_bytes() if self._sse else b""
            await self._end(send, b"\n\n" + event if event and self._tail_open else event)
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

    def _stream_error(self, worker: Worker | None, reason: str) -> None:
        label = self._proxy.worker_label(worker) if worker is not None else "-"
        self._proxy.metrics.stream_errors.labels(label, reason).inc()

    # -- accounting -------------------------------------------------------------------
    def _record(self, outcome: _Outcome) -> None:
        x, metrics = self._x, self._proxy.metrics
        status = _CLIENT_CLOSED if self._client_gone and not self._completed else outcome.status
        worker = outcome.worker
        route = self._proxy.route_metrics(worker, x.model) if worker is not None else None
        if x.legs is not None:
            x.legs.observe(x.observation, status)
            if worker is not None:
                x.observation.predicted = x.legs.predicted(worker.id)
        x.observation.finish(
            status,
            routed=outcome.routed,
            worker=worker,
            usage=outcome.usage,
            route=route,
            first_choice=outcome.first_choice,
        )
        if worker is None or route is None:
            metrics.route("none", x.model).answered(status)
            return
        route.answered(status)
        route.e2e.observe(time.perf_counter() - x.received_at)
        if worker.id != outcome.first_choice:
            route.failovers.inc()
        if status == "200" and x.usage_mode is not UsageMode.NONE:
            self._record_cache(route, outcome)

    def _record_cache(self, route: RouteMetrics, outcome: _Outcome) -> None:
        routed, worker, usage = outcome.routed, outcome.worker, outcome.usage
        assert worker is not None
        prompt_tokens = routed.request.prompt_tokens
        if usage is not None and usage.prompt_tokens is not None:
            prompt_tokens = usage.prompt_tokens
        route.record_cache(
            prompt_tokens=prompt_tokens,
            predicted=self._predicted(worker, routed),
            best_available=routed.best_available_cached_tokens,
            engine_cached=usage.cached_tokens if usage is not None else None,
        )
        if usage is not None:
            for listener in self._proxy.served_listeners:
                listener(worker, usage, routed.request.block_size, outcome.sent_at)
