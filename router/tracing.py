"""OpenTelemetry tracing of proxied requests (the optional extra: ``pip install 'kvgate[otel]'``).

This module imports the OpenTelemetry SDK; kvgate imports it only when tracing is on
(``router.observe.tracing_requested``), so a base install never loads it.

One trace per ``/v1`` request::

    POST /v1/chat/completions   SERVER  request received -> last byte (kvgate.* attributes)
    ├── parse                           body read, JSON decoded, validated
    ├── tokenize                        prompt -> block keys (chat template, tokenizer)
    ├── index match                     block keys -> each worker's cached prefix
    ├── score                           candidates and their load, the policy's ranking
    └── upstream                CLIENT  one per attempt (failover: several)
        ├── connect                     a pooled or new connection, the request written
        ├── first byte                  request written -> first body byte (streams) or
        │                               the response head (non-streamed answers)
        └── relay                       first byte -> the answer relayed to the client

The client's W3C ``traceparent`` (and ``tracestate``) makes the request span its child; the
engine gets the ``upstream`` span's context instead of the client's, so the engine's own
spans (vLLM's ``--otlp-traces-endpoint``) join the trace under the attempt that carried them.

Cost. The request path only takes ``time.perf_counter()`` marks: the sampling decision and
the span ids are made when the request arrives and when an attempt starts (the ids travel
upstream), and the spans themselves are built once, when the request ends, as finished
``ReadableSpan``s handed to the batch processor (the SDK's ``Tracer`` would build, lock and
check a live ``Span`` per phase: several times the CPU). An unsampled request builds none.
Export: the SDK's ``BatchSpanProcessor`` (its own thread, a bounded queue: ``OTEL_BSP_*``)
and OTLP HTTP/protobuf exporter, to ``--otlp-traces-endpoint`` or, without it, where the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` say
(headers, timeout, compression, certificates from ``OTEL_EXPORTER_OTLP_*`` too). The sampler:
``--trace-sample-rate`` samples that share of requests by kvgate's own draw, whatever the
client's ``traceparent`` says (its sampled flag, or a trace id picked to pass a ratio test,
cannot raise the share); ``--trace-trust-parent`` makes it the SDK's parent-based ratio (a
client's sampled flag is followed). Without a rate, the SDK's ``OTEL_TRACES_SAMPLER``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    get_current_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from kvgate.router.config import ConfigError
from kvgate.router.metrics import kvgate_version

_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_DEFAULT_SERVICE = "unknown_service"  # the SDK's name of a service nobody named (+ ":python")
_UNSET = Status(StatusCode.UNSET)

Headers = list[tuple[bytes, bytes]]
Attributes = Mapping[str, AttributeValue | None]


def _resource() -> Resource:
    """``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` when given; else ``kvgate``."""
    detected = Resource.create({SERVICE_VERSION: kvgate_version()})
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith(_DEFAULT_SERVICE):
        detected = detected.merge(Resource({SERVICE_NAME: "kvgate"}))
    return detected


def _check_protocol(environ: Mapping[str, str]) -> None:
    for name in _PROTOCOLS:
        protocol = environ.get(name)
        if protocol:
            if protocol.strip() != "http/protobuf":
                raise ConfigError(
                    f"invalid configuration:\n  {name}: kvgate exports traces over OTLP "
                    f"http/protobuf only (got {protocol!r})"
                )
            return


class OwnDraw(Sampler):
    """Samples ``rate`` of requests by a draw of kvgate's own: neither the parent's sampled
    flag nor the bits of a (client-chosen) trace id change the odds. The parent's trace
    state is kept."""

    def __init__(self, rate: float, rng: random.Random | None = None) -> None:
        self._rate = rate
        self._random = (rng if rng is not None else random.Random()).random

    def should_sample(  # noqa: PLR0917 - the SDK's Sampler.should_sample signature
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes | None = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        sampled = self._random() < self._rate
        state = get_current_span(parent_context).get_span_context().trace_state
        return SamplingResult(Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP, None, state)

    def get_description(self) -> str:
        return f"kvgate.OwnDraw{{{self._rate}}}"


class _Export(SpanExporter):
    """The exporter, shut once: ``Tracing.shutdown`` may shut it early (abandoning a
    collector that does not answer) before the processor shuts it again."""

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner
        self._closed = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed.is_set():
            return SpanExportResult.FAILURE
        return self._inner.export(spans)

    def shutdown(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class Tracing:
    """kvgate's sampler, span ids and exporter; ``request`` starts one request's trace."""

    def __init__(self, exporter: SpanExporter, sampler: Sampler) -> None:
        self._exporter = _Export(exporter)
        self.processor = BatchSpanProcessor(self._exporter)
        self.sampler = sampler
        self.resource = _resource()
        self.scope = InstrumentationScope("kvgate", kvgate_version())
        self.ids = RandomIdGenerator()
        self.propagator = TraceContextTextMapPropagator()
        self.fields = frozenset(name.encode() for name in self.propagator.fields)

    @classmethod
    def start(
        cls,
        *,
        endpoint: str | None,
        sample_rate: float | None,
        environ: Mapping[str, str],
        trust_parent: bool = False,
        exporter: SpanExporter | None = None,
    ) -> Tracing:
        """Export to ``endpoint`` (a full ``.../v1/traces`` URL; None: the OTEL_* variables
        decide). ``sample_rate`` None: ``OTEL_TRACES_SAMPLER`` (default: parent-based,
        always on); a rate: that share of requests (``OwnDraw``), or with ``trust_parent``
        parent-based, that share of new traces."""
        _check_protocol(environ)
        sampler: Sampler | None = None
        if sample_rate is not None:
            ratio = TraceIdRatioBased(sample_rate)
            sampler = ParentBased(ratio) if trust_parent else OwnDraw(sample_rate)
        # the provider only resolves the sampler the SDK's way (OTEL_TRACES_SAMPLER[_ARG])
        sampler = TracerProvider(sampler=sampler, shutdown_on_exit=False).sampler
        return cls(exporter if exporter is not None else OTLPSpanExporter(endpoint), sampler)

    def request(
        self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], received_at: float
    ) -> RequestSpans:
        """The trace of one request received at ``received_at`` (perf_counter) with the
        client's ``headers`` (ASGI raw, lower-case names)."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in self.fields}
        context = self.propagator.extract(carrier) if carrier else None
        parent = get_current_span(context).get_span_context() if context is not None else None
        if parent is not None and not parent.is_valid:
            parent, context = None, None
        trace_id = parent.trace_id if parent is not None else self.ids.generate_trace_id()
        name = f"{method} {path}"
        sampled = self.sampler.should_sample(context, trace_id, name, SpanKind.SERVER)
        flags = TraceFlags(
            TraceFlags.SAMPLED if sampled.decision is Decision.RECORD_AND_SAMPLE else 0
        )
        root = SpanContext(trace_id, self.ids.generate_span_id(), False, flags, sampled.trace_state)
        return RequestSpans(self, name, root, parent, received_at)

    def emit(self, span: ReadableSpan) -> None:
        self.processor.on_end(span)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export every ended span now (blocks: call it from a thread, not the event loop)."""
        return self.processor.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued and stop the exporter thread (blocks, like ``force_flush``),
        within about ``timeout_s``: past it (a collector down or slow) the exporter is shut,
        which ends its retries and drops the spans left. True when the thread stopped."""
        closing = threading.Thread(
            target=self.processor.shutdown, name="kvgate-tracing-shutdown", daemon=True
        )
        closing.start()
        closing.join(timeout_s)
        if closing.is_alive():
            self._exporter.shutdown()
            closing.join(timeout_s)
        return not closing.is_alive()


_MAX_LEGS = 16  # prefill-leg spans kept per request (attempts x retries are bounded anyway)


def _clean(attributes: Attributes) -> dict[str, AttributeValue]:
    return {k: v for k, v in attributes.items() if v is not None}


@dataclass(slots=True)
class _Attempt:
    """One upstream attempt's marks (perf_counter seconds; 0.0: not reached)."""

    context: SpanContext
    worker: str
    number: int
    start: float
    sent: float = 0.0
    head: float = 0.0
    first: float = 0.0
    end: float = 0.0
    error: str | None = None
    attributes: dict[str, AttributeValue] = field(default_factory=dict)


class RequestSpans:
    """One request's trace. The request path calls ``phase`` at the end of each routing
    phase and ``attempt`` / ``sent`` / ``head`` / ``first_byte`` / ``attempt_failed`` per
    upstream attempt; ``finish`` builds and exports the spans (when sampled)."""

    __slots__ = (
        "_attempts", "_last", "_legs", "_name", "_parent", "_phases", "_t0", "_t0_ns",
        "_tracing", "context", "recording",
    )  # fmt: skip

    def __init__(
        self,
        tracing: Tracing,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        received_at: float,
    ) -> None:
        now, now_ns = time.perf_counter(), time.time_ns()
        self._tracing = tracing
        self._name = name
        self.context = context
        self._parent = parent
        self.recording = context.trace_flags.sampled
        self._t0 = received_at
        self._t0_ns = now_ns - int((now - received_at) * 1e9)
        self._last = received_at
        self._phases: list[tuple[str, float, float]] = []
        self._attempts: list[_Attempt] = []
        self._legs: list[_Attempt] = []  # a disaggregated request's prefill legs

    @property
    def trace_id(self) -> str:
        return f"{self.context.trace_id:032x}"

    # -- routing ------------------------------------------------------------------------
    def phase(self, name: str) -> None:
        """The phase ``name`` ran from the previous mark (or the request's arrival) to now."""
        now = time.perf_counter()
        if self.recording:
            self._phases.append((name, self._last, now))
        self._last = now

    # -- upstream attempts --------------------------------------------------------------
    def attempt(self, worker: str, number: int, headers: Headers) -> Headers:
        """Start attempt ``number`` (0: the first choice) on ``worker``; ``headers`` with the
        client's trace context replaced by this attempt's."""
        now = time.perf_counter()
        self._close_attempt(now, "abandoned")
        root = self.context
        span_id = self._tracing.ids.generate_span_id()
        context = SpanContext(root.trace_id, span_id, False, root.trace_flags, root.trace_state)
        self._attempts.append(_Attempt(context, worker, number, now))
        flags = int(root.trace_flags)
        traceparent = f"00-{root.trace_id:032x}-{span_id:016x}-{flags:02x}".encode()
        fields = self._tracing.fields
        kept = [h for h in headers if h[0] not in fields]
        kept.append((b"traceparent", traceparent))
        if root.trace_state:
            kept.append((b"tracestate", root.trace_state.to_header().encode("latin-1")))
        return kept

    def leg(self, worker: str, start: float, error: str | None) -> None:
        """A prefill leg on ``worker`` (docs/pd.md) from ``start`` (perf_counter) to now."""
        if len(self._legs) < _MAX_LEGS:
            span = _Attempt(self._child_context(), worker, len(self._legs), start)
            span.end, span.error = time.perf_counter(), error
            self._legs.append(span)

    def _current(self) -> _Attempt | None:
        attempt = self._attempts[-1] if self._attempts else None
        return attempt if attempt is not None and not attempt.end else None

    def sent(self, reused: bool) -> None:
        """The request is written to the engine (on a pooled connection when ``reused``)."""
        attempt = self._current()
        if attempt is not None:
            attempt.sent = time.perf_counter()
            attempt.attributes["kvgate.connection_reused"] = reused

    def head(self, status: int) -> None:
        """The engine's response head arrived."""
        attempt = self._current()
        if attempt is not None:
            attempt.head = time.perf_counter()
            attempt.attributes["http.response.status_code"] = status

    def first_byte(self) -> None:
        """The first streamed body byte arrived."""
        attempt = self._current()
        if attempt is not None:
            attempt.first = time.perf_counter()

    def attempt_failed(self, code: str, detail: str) -> None:
        attempt = self._current()
        if attempt is not None:
            attempt.attributes["error.type"] = code
        self._close_attempt(time.perf_counter(), detail)

    def _close_attempt(self, end: float, error: str | None) -> None:
        attempt = self._current()
        if attempt is not None:
            attempt.end = end
            attempt.error = error

    # -- end ----------------------------------------------------------------------------
    def finish(self, status: int, attributes: Attributes) -> None:
        """The request ended with HTTP ``status``: build and export its spans."""
        end = time.perf_counter()
        error = f"HTTP {status}" if status >= 500 else None
        self._close_attempt(end, error)
        if not self.recording:
            return
        root = self.context
        values = _clean(attributes)
        values["http.response.status_code"] = status
        self._emit(
            self._name, root, self._parent, self._t0, end,
            kind=SpanKind.SERVER, attributes=values, error=error,
        )  # fmt: skip
        for name, start, stop in self._phases:
            self._emit(name, self._child_context(), root, start, stop)
        for attempt in self._attempts:
            self._emit_attempt(attempt)
        for leg in self._legs:
            marks: dict[str, AttributeValue] = {
                "kvgate.worker": leg.worker,
                "kvgate.attempt": leg.number,
            }
            self._emit(
                "prefill leg", leg.context, root, leg.start, leg.end,
                kind=SpanKind.CLIENT, attributes=marks, error=leg.error,
            )  # fmt: skip

    def _child_context(self) -> SpanContext:
        root = self.context
        span_id = self._tracing.ids.generate_span_id()
        return SpanContext(root.trace_id, span_id, False, root.trace_flags, root.trace_state)

    def _emit_attempt(self, attempt: _Attempt) -> None:
        context, end, error = attempt.context, attempt.end, attempt.error
        attributes: dict[str, AttributeValue] = {
            "kvgate.worker": attempt.worker,
            "kvgate.attempt": attempt.number,
        }
        attributes |= attempt.attributes
        self._emit(
            "upstream", context, self.context, attempt.start, end,
            kind=SpanKind.CLIENT, attributes=attributes, error=error,
        )  # fmt: skip
        phases = _attempt_phases(attempt)
        for i, (name, start, stop) in enumerate(phases):
            failed = error if i == len(phases) - 1 else None
            self._emit(name, self._child_context(), context, start, stop, error=failed)

    def _emit(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start: float,
        end: float,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: dict[str, AttributeValue] | None = None,
        error: str | None = None,
    ) -> None:
        tracing = self._tracing
        tracing.emit(
            ReadableSpan(
                name,
                context=context,
                parent=parent,
                resource=tracing.resource,
                attributes=attributes,
                kind=kind,
                status=_UNSET if error is None else Status(StatusCode.ERROR, error),
                start_time=self._t0_ns + int((start - self._t0) * 1e9),
                end_time=self._t0_ns + int((end - self._t0) * 1e9),
                instrumentation_scope=tracing.scope,
            )
        )


def _attempt_phases(attempt: _Attempt) -> list[tuple[str, float, float]]:
    """connect, first byte, relay: as far as the attempt got."""
    if not attempt.sent:  # failed while connecting or writing
        return [("connect", attempt.start, attempt.end)]
    phases = [("connect", attempt.start, attempt.sent)]
    first = attempt.first or attempt.head
    if not first:
        return [*phases, ("first byte", attempt.sent, attempt.end)]
    return [*phases, ("first byte", attempt.sent, first), ("relay", first, attempt.end)]
