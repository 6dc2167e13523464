"""One placed request from its pick to its end, as ``kvgate serve``'s proxy accounts for it:
the load on its worker (``LoadTicket``: pending prefill until the first token, the answer's
blocks, released at the end however it ends), the worker that really served it (Envoy's
``x-gateway-destination-endpoint-served``: a fallback moves the load there), the engine's
usage read from the answer (predicted against engine-reported cached tokens), time to first
token, the per-worker metrics and the access-log line.

Envoy, not kvgate, moves the bytes: ``chunk`` sees each piece of the answer as Envoy passes
it (and returns what the client gets: the usage event kvgate asked for is hidden, as in
``serve``).
"""

from __future__ import annotations

import asyncio
import time

from kvgate.backends.registry import Worker
from kvgate.index.types import WorkerId
from kvgate.router.commit import Reason, StreamStart, Verdict, error_events
from kvgate.router.epp.placement import Placement
from kvgate.router.epp.request import Parsed
from kvgate.router.epp.wire import Rewrite, endpoint_of
from kvgate.router.gateway import Gateway
from kvgate.router.observe import Observation
from kvgate.router.proxy import UsageMode
from kvgate.router.usage import SseUsageTap, Usage, usage_from_body
from kvgate.scheduling.affinity import ResponseIdTap
from kvgate.scheduling.ledger import LoadTicket

_SSE_DATA = b"data:"
_SSE_DONE = b"data: [DONE]"
_MAX_HELD = 1 << 20  # bytes looked at for a stream's first content (as serve's commit point)
_MAX_BODY = 1 << 20  # bytes of a whole (not streamed) answer kept to read its usage
_FALLBACK = "fallback"  # kvgate_upstream_retries_total{reason}: Envoy went down its list
_CUT = "499"  # the answer did not end: the client went, or the stream broke


class Exchange:
    """The accounting of one request Envoy sends to the endpoints of ``placement``."""

    __slots__ = (
        "_answer_tap", "_body", "_ended", "_gateway", "_measured", "_observation", "_parsed",
        "_placement", "_prefill_timer", "_received_at", "_sent_at", "_start", "_status", "_tap",
        "_ticket", "_trace", "_usage", "_worker", "reads_answer",
    )  # fmt: skip

    def __init__(
        self,
        gateway: Gateway,
        placement: Placement,
        parsed: Parsed,
        observation: Observation,
        *,
        answer_tap: ResponseIdTap | None = None,
        reads_answer: bool = True,
    ) -> None:
        """``reads_answer`` False: Envoy is to send the answer's head only (the stream's
        close is the answer's end; its prompt counts as prefilling until the predicted
        first token)."""
        self._gateway = gateway
        self.reads_answer = reads_answer
        self._placement = placement
        self._parsed = parsed
        self._observation = observation
        self._received_at = observation.received_at
        self._answer_tap = answer_tap
        self._worker = placement.order[0]
        self._status: str | None = None
        self._ended = False
        self._usage: Usage | None = None
        self._measured = True  # its first token times the worker's TTFT (not after a move)
        self._body = bytearray()
        self._start: StreamStart | None = StreamStart(_MAX_HELD) if parsed.stream else None
        mode = parsed.usage
        sse_usage = parsed.stream and mode in (UsageMode.TAP, UsageMode.HIDE)
        self._tap = SseUsageTap(hide=mode is UsageMode.HIDE) if sse_usage else None
        self._trace = observation.attempt(self._worker.url, [])  # tracing: its traceparent
        gateway.metrics.overhead.observe(time.perf_counter() - self._received_at)
        self._sent_at = time.monotonic()
        self._ticket: LoadTicket = placement.begin(self._worker)
        self._prefill_timer: asyncio.TimerHandle | None = None
        if not reads_answer:
            self._prefill_timer = asyncio.get_running_loop().call_later(
                self._ticket.predicted_ttft_s, self._predicted_first_token
            )

    def _predicted_first_token(self) -> None:
        """An answer kvgate does not read: its prompt stops counting as prefilling when
        kvgate predicted its first token (not measured: nothing is learnt from it)."""
        self._prefill_timer = None
        self._ticket.first_token(measured=False)

    @property
    def worker(self) -> Worker:
        return self._worker

    # -- the answer ---------------------------------------------------------------------
    def served(self, endpoint: str | None, status: int | None) -> None:
        """The answer's head: the status, and the endpoint Envoy reports it came from (none:
        an answer of Envoy's own, e.g. when no endpoint of the list could be reached)."""
        self._status = str(status) if status is not None else None
        if endpoint is not None and endpoint != endpoint_of(self._worker.url):
            self._moved(endpoint)
        proxy = self._gateway.proxy
        if status is None:
            return
        if status < 500:
            self._gateway.registry.record_ok_response(self._worker)
        elif endpoint is not None:
            proxy.mark_failed(self._worker, Reason.HTTP_5XX, f"answered {status}")
        else:  # Envoy's own 5xx: none of the listed endpoints answered
            for worker in self._placement.order:
                proxy.mark_failed(worker, _FALLBACK, f"the proxy answered {status} for it")

    def upstream_headers(self, *, body_changed: bool) -> Rewrite:
        """The request's header changes on its way to the engine, as ``serve`` makes them:
        the client's credentials dropped (kvgate's client keys are not the engine's), the
        chosen engine's own (``api_key`` / ``basic_auth`` of its ``--worker``) set; the trace
        context of kvgate's span; a stale ``content-length`` dropped."""
        sets = [(k.decode(), v.decode()) for k, v in self._trace]
        removed = ["x-api-key"]
        authorization = self._worker.config.authorization()
        if authorization is not None:
            sets.append(("authorization", authorization))
        else:
            removed.append("authorization")
        if body_changed:
            removed.append("content-length")
        return Rewrite(tuple(sets), tuple(removed))

    def client_headers(self) -> list[tuple[str, str]]:
        """What ``serve`` tells a client of its answer: the worker, and the cached tokens
        kvgate predicted there."""
        predicted = self._placement.routed.predicted_cached_tokens(self._worker.id)
        return [
            ("x-kvgate-worker", self._worker.url),
            ("x-kvgate-predicted-cached-tokens", str(predicted)),
        ]

    def _moved(self, endpoint: str) -> None:
        """Envoy served from a fallback: the ones before it failed; the load moves there."""
        order = self._placement.order
        served = next((w for w in order if endpoint_of(w.url) == endpoint), None)
        if served is None:  # not one kvgate listed: it cannot be accounted for
            return
        proxy = self._gateway.proxy
        for skipped in order[: order.index(served)]:
            proxy.mark_failed(skipped, _FALLBACK, f"skipped by the proxy for {endpoint}")
            proxy.metrics.retries.labels(proxy.worker_label(skipped), _FALLBACK).inc()
        self._ticket.finish()
        self._worker = served
        self._observation.attempt(served.url, [])
        self._ticket = self._placement.begin(served)
        self._measured = False  # sent when the first endpoint was: its wait is not the TTFT

    def chunk(self, data: bytes) -> bytes:
        """A piece of the answer's body; what the client gets of it."""
        ticket, worker = self._ticket, self._worker
        if self._answer_tap is not None and self._answer_tap.feed(worker.id, data):
            self._answer_tap = None
        if not self._parsed.stream:
            if len(self._body) + len(data) <= _MAX_BODY:
                self._body += data
            return data
        ticket.streamed(data.count(_SSE_DATA) - data.count(_SSE_DONE))
        start = self._start
        if start is not None:
            verdict = start.feed(data)
            start.take()  # nothing is held back: Envoy has the bytes
            if verdict is not Verdict.WAIT:
                self._first_content(verdict, start)
        elif error_events(data):
            self._stream_error(Reason.ENGINE_ERROR)
        out = self._tap.feed(data) if self._tap is not None else data
        self._observation.chunk(out)
        return out

    def _first_content(self, verdict: Verdict, start: StreamStart) -> None:
        self._start = None
        if verdict is Verdict.FAILED:
            detail = start.failure or "error event"
            self._gateway.proxy.mark_failed(self._worker, Reason.ERROR_EVENT, detail)
            self._stream_error(Reason.ERROR_EVENT)
            return
        self._ticket.first_token(measured=self._measured)
        self._placement.routed.finish_keys()
        elapsed = time.perf_counter() - self._received_at
        self._gateway.proxy.route_metrics(self._worker, self._parsed.model).ttft.observe(elapsed)
        self._observation.first_byte(elapsed)

    def _stream_error(self, reason: str) -> None:
        proxy = self._gateway.proxy
        proxy.metrics.stream_errors.labels(proxy.worker_label(self._worker), reason).inc()

    def ended(self) -> bytes:
        """The answer's body ended; the bytes still held for the client (a hidden usage
        event's unterminated remainder, none in practice)."""
        self._ended = True
        tail = b""
        usage: Usage | None = None
        if self._tap is not None:
            tail = self._tap.flush()
            usage = self._tap.usage
        elif not self._parsed.stream:
            self._ticket.first_token(measured=False)  # a whole body: no first-token time
            if self._parsed.usage is UsageMode.BODY:
                usage = usage_from_body(bytes(self._body))
        self._body = bytearray()
        self._ticket.complete(
            *((usage.prompt_tokens, usage.cached_tokens) if usage else (None, None))
        )
        self._usage = usage
        return tail

    # -- the end ------------------------------------------------------------------------
    def close(self) -> None:
        """The ext_proc stream is over: everything released, the request recorded."""
        placement, ticket = self._placement, self._ticket
        if self._prefill_timer is not None:
            self._prefill_timer.cancel()
            self._prefill_timer = None
        answered = self._ended  # its body's end seen
        if not answered and not self.reads_answer and self._status is not None:
            # the body skipped: the stream ends with the request, which had its head's status
            ticket.complete(None, None)
            self._ended = True
        placement.routed.finish_keys()
        observed = ticket.finish()
        placement.release()
        worker = self._worker
        proxy = self._gateway.proxy
        if observed is not None:
            proxy.metrics.ttft_error.labels(worker.url).observe(
                observed.measured_s - observed.predicted_s
            )
        status = self._status if self._ended and self._status is not None else _CUT
        usage = self._usage if self._ended else None
        route = proxy.route_metrics(worker, self._parsed.model)
        first: WorkerId = placement.order[0].id
        self._observation.finish(
            status,
            routed=placement.routed,
            worker=worker,
            usage=usage,
            route=route,
            first_choice=first,
        )
        route.answered(status)
        route.e2e.observe(time.perf_counter() - self._received_at)
        if worker.id != first:
            route.failovers.inc()
        if answered and status == "200" and self._parsed.usage is not UsageMode.NONE:
            self._record_cache(usage)

    def _record_cache(self, usage: Usage | None) -> None:
        routed, worker = self._placement.routed, self._worker
        route = self._gateway.proxy.route_metrics(worker, self._parsed.model)
        prompt_tokens = routed.request.prompt_tokens
        if usage is not None and usage.prompt_tokens is not None:
            prompt_tokens = usage.prompt_tokens
        route.record_cache(
            prompt_tokens=prompt_tokens,
            predicted=routed.predicted_cached_tokens(worker.id),
            best_available=routed.best_available_cached_tokens,
            engine_cached=usage.cached_tokens if usage is not None else None,
        )
        if usage is not None:
            for listener in self._gateway.proxy.served_listeners:
                listener(worker, usage, routed.request.block_size, self._sent_at)
