"""What one ``/v1`` request leaves for the operator: its access-log line, its trace, and the
metrics only the stream can tell (output tokens, time per output token).

The gateway opens an ``Observation`` when a request arrives (``Observer.begin``) and the
request path calls its hooks at fixed points: ``parsed`` (body validated), ``attempt`` (an
upstream attempt starts), ``sent`` / ``head`` (through ``spans``, tracing only),
``first_byte``, ``chunk`` (each relayed stream chunk), ``wrote`` (the last body bytes),
``attempt_failed`` and ``finish`` (the answer is over, however it ended).

With tracing off, ``Observation.spans`` is None and nothing trace-related runs: the hooks
that remain count bytes and SSE events and keep the time of the first byte.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvgate.router.accesslog import AccessLog
from kvgate.router.config import ConfigError, Settings
from kvgate.router.errors import KvgateError

if TYPE_CHECKING:
    from kvgate.backends.registry import Worker
    from kvgate.router.metrics import RouteMetrics
    from kvgate.router.tracing import RequestSpans, Tracing
    from kvgate.router.usage import Usage
    from kvgate.scheduling.routing import Routed

Headers = list[tuple[bytes, bytes]]
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_DATA = b"data:"
_DONE = b"[DONE]"
_TRACEPARENT = b"traceparent"
_MAX_TEXT = 256  # client-given text (model name, path) kept in a line or span, in characters

# access-log field -> span attribute of the request span (OpenTelemetry names where they exist)
SPAN_ATTRIBUTES = {
    "request_id": "kvgate.request_id",
    "client": "kvgate.client_key_id",
    "method": "http.request.method",
    "path": "url.path",
    "model": "gen_ai.request.model",
    "stream": "kvgate.stream",
    "worker": "kvgate.worker",
    "policy": "kvgate.policy",
    "reason": "kvgate.decision_reason",
    "attempts": "kvgate.attempts",
    "failover": "kvgate.failover",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "predicted_cached_tokens": "kvgate.predicted_cached_tokens",
    "best_cached_tokens": "kvgate.best_available_cached_tokens",
    "engine_cached_tokens": "kvgate.engine_cached_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "queued_ms": "kvgate.queued_ms",
    "ttft_ms": "kvgate.ttft_ms",
}


def tracing_requested(settings: Settings, environ: Mapping[str, str]) -> bool:
    """Tracing is on when an OTLP traces endpoint is configured: ``--otlp-traces-endpoint``,
    or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` (as in other
    OpenTelemetry-instrumented servers); ``OTEL_SDK_DISABLED=true`` or
    ``OTEL_TRACES_EXPORTER=none`` turn it off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    if settings.otlp_traces_endpoint is not None:
        return True
    return any(environ.get(name) for name in _ENDPOINT_VARIABLES)


def start_tracing(settings: Settings, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """kvgate's tracer when tracing is requested (importing the OpenTelemetry SDK only
    then); ``ConfigError`` when the ``otel`` extra is missing or the export misconfigured."""
    environ = os.environ if environ is None else environ
    if not tracing_requested(settings, environ):
        return None
    try:
        from kvgate.router.tracing import Tracing  # noqa: PLC0415 (the optional extra)
    except ImportError as exc:
        raise ConfigError(
            "tracing needs the OpenTelemetry SDK: pip install 'kvgate[otel]' (or unset the "
            f"OTLP traces endpoint): {exc}"
        ) from exc
    return Tracing.start(
        endpoint=settings.otlp_traces_endpoint,
        sample_rate=settings.trace_sample_rate,
        trust_parent=settings.trace_trust_parent,
        environ=environ,
    )


class Observer:
    """The gateway's side of observation: the access log and the tracer, both optional."""

    def __init__(self, access: AccessLog | None, tracing: Tracing | None) -> None:
        self.access = access
        self.tracing = tracing

    def begin(
        self, request_id: str, method: str, path: str, headers: Headers, received_at: float
    ) -> Observation:
        spans = None
        if self.tracing is not None:
            spans = self.tracing.request(method, path, headers, received_at)
        return Observation(
            self, request_id, received_at, method=method, path=path, headers=headers, spans=spans
        )


class Observation:
    """One request's facts as they arrive, and what becomes of them at ``finish``."""

    __slots__ = (
        "_events", "_headers", "_observer", "_tail", "attempts", "bytes_in", "bytes_out",
        "client", "method", "model", "path", "pd", "predicted", "queued", "received_at",
        "request_id", "spans", "stream", "ttft",
    )  # fmt: skip

    def __init__(
        self,
        observer: Observer,
        request_id: str,
        received_at: float,
        *,
        method: str,
        path: str,
        headers: Headers,
        spans: RequestSpans | None,
    ) -> None:
        self._observer = observer
        self.request_id = request_id
        self.method = method
        self.path = _capped(path)
        self._headers = headers
        self.received_at = received_at
        self.spans = spans
        self.client = "-"
        self.model = "none"
        self.stream = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.attempts = 0
        self.ttft: float | None = None
        self.queued: float | None = None
        """Seconds waited in kvgate's queue (scheduling/queue.py); None: never queued."""
        self.pd: tuple[str | None, bool | None] | None = None
        """A disaggregated request's (prefill worker, prefill leg skipped); None: not one."""
        self.predicted: int | None = None  # cached tokens predicted, when not the routing's
        self._events = 0
        self._tail = b""

    # -- hooks --------------------------------------------------------------------------
    def parsed(self, model: str, body_bytes: int, *, stream: bool) -> None:
        """The body is read and valid."""
        self.model = _capped(model)
        self.bytes_in = body_bytes
        self.stream = stream
        if self.spans is not None:
            self.spans.phase("parse")

    def attempt(self, worker: str, headers: Headers) -> Headers:
        """An upstream attempt on ``worker`` starts; the headers to send it."""
        self.attempts += 1
        if self.spans is None:
            return headers
        return self.spans.attempt(worker, self.attempts - 1, headers)

    def attempt_failed(self, error: KvgateError) -> None:
        if self.spans is not None:
            self.spans.attempt_failed(
                error.code or "error", getattr(error, "detail", error.message)
            )

    def first_byte(self, ttft: float) -> None:
        """The first streamed body byte, ``ttft`` seconds after the request arrived."""
        self.ttft = ttft
        if self.spans is not None:
            self.spans.first_byte()

    def chunk(self, data: bytes) -> None:
        """A relayed stream chunk (bytes as sent to the client)."""
        self.bytes_out += len(data)
        self._events += data.count(_DATA)
        self._tail = data

    def wrote(self, size: int) -> None:
        """The last (or only) body bytes sent to the client."""
        self.bytes_out += size

    # -- end ----------------------------------------------------------------------------
    def finish(
        self,
        status: str,
        *,
        routed: Routed | None = None,
        worker: Worker | None = None,
        usage: Usage | None = None,
        route: RouteMetrics | None = None,
        first_choice: str | None = None,
    ) -> None:
        """The request is over: record the stream metrics, end the trace, write the line.
        ``routed``: the ranking of the attempt that answered (a retry is ranked afresh);
        ``first_choice``: the worker first chosen (default: ``routed``'s choice)."""
        duration = time.perf_counter() - self.received_at
        output = self._output_tokens(usage)
        if route is not None and status == "200" and output is not None:
            route.output_tokens.inc(output)
            if self.ttft is not None and output > 1:
                route.tpot.observe((duration - self.ttft) / (output - 1))
        access, spans = self._observer.access, self.spans
        wanted = access is not None and access.wanted(status)
        if spans is not None and not spans.recording:
            spans = None  # not sampled: no span to build
        if not wanted and spans is None:
            return
        fields = self._fields(status, duration, output, routed=routed, worker=worker, usage=usage)
        if worker is not None and first_choice is not None:
            fields["failover"] = worker.id != first_choice
        if spans is not None:
            attributes = {SPAN_ATTRIBUTES[k]: fields[k] for k in SPAN_ATTRIBUTES}
            attributes["kvgate.retries"] = max(self.attempts - 1, 0)
            spans.finish(int(status), attributes)
        if wanted and access is not None:
            access.write(fields)

    def _output_tokens(self, usage: Usage | None) -> int | None:
        """The engine's ``completion_tokens``; else, for a stream, its content events."""
        if usage is not None and usage.completion_tokens is not None:
            return usage.completion_tokens
        if not self.stream or not self._events:
            return None
        return self._events - (_DONE in self._tail)

    def trace_id(self) -> str | None:
        if self.spans is not None:
            return self.spans.trace_id
        return client_trace_id(self._headers)

    def _fields(
        self,
        status: str,
        duration: float,
        output: int | None,
        *,
        routed: Routed | None,
        worker: Worker | None,
        usage: Usage | None,
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "trace_id": self.trace_id(),
            "client": self.client,
            "method": self.method,
            "path": self.path,
            "model": self.model,
            "stream": self.stream,
            "status": int(status),
            "worker": worker.url if worker is not None else None,
            "policy": routed.policy if routed is not None else None,
            "reason": None,
            "attempts": self.attempts,
            "failover": False,
            "prompt_tokens": None,
            "predicted_cached_tokens": None,
            "best_cached_tokens": None,
            "engine_cached_tokens": usage.cached_tokens if usage is not None else None,
            "output_tokens": output,
            "prefill_worker": self.pd[0] if self.pd is not None else None,
            "prefill_skipped": self.pd[1] if self.pd is not None else None,
            "queued_ms": _ms(self.queued),
            "ttft_ms": _ms(self.ttft),
            "duration_ms": _ms(duration),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }
        if routed is not None and worker is not None:
            fields["reason"] = _reason(routed, worker)
            fields["failover"] = worker.id != routed.chosen
            predicted = self.predicted
            if predicted is None:
                predicted = routed.predicted_cached_tokens(worker.id)
            fields["predicted_cached_tokens"] = predicted
        if routed is not None and routed.keys is not None:
            fields["prompt_tokens"] = routed.request.prompt_tokens
            fields["best_cached_tokens"] = routed.best_available_cached_tokens
        if usage is not None and usage.prompt_tokens is not None:
            fields["prompt_tokens"] = usage.prompt_tokens
        return fields


def _capped(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _reason(routed: Routed, worker: Worker) -> str | None:
    """The policy's reason for the worker, and the capacity rule's refusal of it, if any."""
    refusal = routed.refused.get(worker.id)
    for score in routed.decision.scores:
        if score.worker == worker.id:
            if refusal is not None:
                return f"{score.reason}; {refusal.text}" if score.reason else refusal.text
            return score.reason or None
    return None


def client_trace_id(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The trace id of the client's W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``)."""
    for name, value in headers:
        if name == _TRACEPARENT:
            parts = value.split(b"-")
            trace = parts[1] if len(parts) == 4 else b""
            if len(trace) == 32 and trace.strip(b"0123456789abcdef") == b"" and trace != b"0" * 32:
                return trace.decode()
            return None
    return None
