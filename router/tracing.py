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

Spans are timed on ``time.perf_counter()`` marks taken along the request path and created
when each phase ends, with the phase's start and end times (a phase costs nothing until the
request is known to be sampled). kvgate uses its own ``TracerProvider``, never the global
one. Export: a ``BatchSpanProcessor`` (its own thread, a bounded queue: ``OTEL_BSP_*``)
sending OTLP HTTP/protobuf to ``--otlp-traces-endpoint`` or, without it, where the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` say (headers,
timeout, compression and certificates from ``OTEL_EXPORTER_OTLP_*`` too).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from router.config import ConfigError
from router.metrics import kvgate_version

_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_DEFAULT_SERVICE = "unknown_service"  # the SDK's name of a service nobody named (+ ":python")

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


class Tracing:
    """kvgate's tracer and exporter; ``request`` starts one request's spans."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("kvgate", kvgate_version())
        self.propagator = TraceContextTextMapPropagator()
        self.fields = frozenset(name.encode() for name in self.propagator.fields)

    @classmethod
    def start(
        cls,
        *,
        endpoint: str | None,
        sample_rate: float | None,
        environ: Mapping[str, str],
        exporter: SpanExporter | None = None,
    ) -> Tracing:
        """Export to ``endpoint`` (a full ``.../v1/traces`` URL; None: the OTEL_* variables
        decide). ``sample_rate`` None: ``OTEL_TRACES_SAMPLER`` (default: parent-based,
        always on); a rate: parent-based, that share of new traces."""
        _check_protocol(environ)
        sampler: Sampler | None = None
        if sample_rate is not None:
            sampler = ParentBased(TraceIdRatioBased(sample_rate))
        provider = TracerProvider(resource=_resource(), sampler=sampler, shutdown_on_exit=False)
        provider.add_span_processor(
            BatchSpanProcessor(exporter if exporter is not None else OTLPSpanExporter(endpoint))
        )
        return cls(provider)

    def request(
        self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], received_at: float
    ) -> RequestSpans:
        """The spans of one request received at ``received_at`` (perf_counter) with the
        client's ``headers`` (ASGI raw, lower-case names)."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in self.fields}
        parent = self.propagator.extract(carrier) if carrier else None
        return RequestSpans(self, f"{method} {path}", parent, received_at)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export every ended span now (blocks: call it from a thread, not the event loop)."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporter thread (blocks, like ``force_flush``)."""
        self.provider.shutdown()


def _clean(attributes: Attributes) -> dict[str, AttributeValue]:
    return {k: v for k, v in attributes.items() if v is not None}


class RequestSpans:
    """One request's spans. The request path calls ``phase`` at the end of each routing
    phase and ``attempt`` / ``sent`` / ``head`` / ``first_byte`` / ``attempt_failed`` per
    upstream attempt; ``finish`` ends the rest."""

    __slots__ = (
        "_attempt", "_attempt_context", "_attempt_start", "_context", "_first", "_head",
        "_last", "_root", "_sent", "_t0", "_t0_ns", "_tracing", "recording",
    )  # fmt: skip

    def __init__(
        self, tracing: Tracing, name: str, parent: Context | None, received_at: float
    ) -> None:
        now, now_ns = time.perf_counter(), time.time_ns()
        self._tracing = tracing
        self._t0 = received_at
        self._t0_ns = now_ns - int((now - received_at) * 1e9)
        self._root = tracing.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, start_time=self._t0_ns
        )
        self.recording = self._root.is_recording()
        self._context = set_span_in_context(self._root)
        self._last = received_at
        self._attempt: Span | None = None
        self._attempt_context: Context | None = None
        self._attempt_start = self._sent = self._head = self._first = 0.0

    @property
    def trace_id(self) -> str:
        return f"{self._root.get_span_context().trace_id:032x}"

    def _ns(self, mark: float) -> int:
        return self._t0_ns + int((mark - self._t0) * 1e9)

    def _child(
        self,
        name: str,
        parent: Context | None,
        start: float,
        end: float,
        error: str | None = None,
    ) -> None:
        span = self._tracing.tracer.start_span(name, context=parent, start_time=self._ns(start))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(end))

    # -- routing ------------------------------------------------------------------------
    def phase(self, name: str) -> None:
        """The phase ``name`` ran from the previous mark (or the request's arrival) to now."""
        now = time.perf_counter()
        if self.recording:
            self._child(name, self._context, self._last, now)
        self._last = now

    # -- upstream attempts --------------------------------------------------------------
    def attempt(self, worker: str, number: int, headers: Headers) -> Headers:
        """Start attempt ``number`` (0: the first choice) on ``worker``; ``headers`` with the
        client's trace context replaced by this attempt's."""
        now = time.perf_counter()
        self._end_attempt(now, "abandoned")
        span = self._tracing.tracer.start_span(
            "upstream",
            context=self._context,
            kind=SpanKind.CLIENT,
            start_time=self._ns(now),
            attributes={"kvgate.worker": worker, "kvgate.attempt": number},
        )
        self._attempt = span
        self._attempt_context = set_span_in_context(span)
        self._attempt_start, self._sent, self._head, self._first = now, 0.0, 0.0, 0.0
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=self._attempt_context)
        fields = self._tracing.fields
        kept = [h for h in headers if h[0] not in fields]
        return kept + [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]

    def sent(self, reused: bool) -> None:
        """The request is written to the engine (on a pooled connection when ``reused``)."""
        self._sent = time.perf_counter()
        if self._attempt is not None:
            self._attempt.set_attribute("kvgate.connection_reused", reused)

    def head(self, status: int) -> None:
        """The engine's response head arrived."""
        self._head = time.perf_counter()
        if self._attempt is not None:
            self._attempt.set_attribute("http.response.status_code", status)

    def first_byte(self) -> None:
        """The first streamed body byte arrived."""
        self._first = time.perf_counter()

    def attempt_failed(self, code: str, detail: str) -> None:
        if self._attempt is not None:
            self._attempt.set_attribute("error.type", code)
        self._end_attempt(time.perf_counter(), detail)

    def _end_attempt(self, end: float, error: str | None) -> None:
        span, context = self._attempt, self._attempt_context
        if span is None:
            return
        self._attempt = self._attempt_context = None
        if self.recording:
            self._attempt_phases(context, end, error)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(end))

    def _attempt_phases(self, context: Context | None, end: float, error: str | None) -> None:
        sent = self._sent
        if not sent:  # failed while connecting or writing
            self._child("connect", context, self._attempt_start, end, error)
            return
        self._child("connect", context, self._attempt_start, sent)
        first = self._first or self._head
        if not first:
            self._child("first byte", context, sent, end, error)
            return
        self._child("first byte", context, sent, first)
        self._child("relay", context, first, end, error)

    # -- end ----------------------------------------------------------------------------
    def finish(self, status: int, attributes: Attributes) -> None:
        """The request ended with HTTP ``status``; ``attributes`` go on the request span."""
        end = time.perf_counter()
        error = f"HTTP {status}" if status >= 500 else None
        self._end_attempt(end, error)
        root = self._root
        if self.recording:
            root.set_attributes(_clean(attributes))
            root.set_attribute("http.response.status_code", status)
            if error is not None:
                root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=self._ns(end))
