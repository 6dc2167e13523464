"""A small OTLP/HTTP trace receiver (an ASGI app served on 127.0.0.1 by ``fakes.server``):
``POST /v1/traces`` bodies decoded with the opentelemetry-proto package, as a collector
would, and kept as ``Received`` spans."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from starlette.types import Receive, Scope, Send

from fakes.engine import read_body

SERVER = Span.SpanKind.SPAN_KIND_SERVER
CLIENT = Span.SpanKind.SPAN_KIND_CLIENT
ERROR = Status.StatusCode.STATUS_CODE_ERROR


@dataclass
class Received:
    """One exported span, ids as lower-case hex."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int
    service: str

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.requests = 0
        self.content_types: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if scope["method"] != "POST" or scope["path"] != "/v1/traces":
            await _answer(send, 404, b"")
            return
        self.requests += 1
        self.content_types.add(headers.get("content-type", ""))
        if headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        self._keep(ExportTraceServiceRequest.FromString(body))
        await _answer(send, 200, ExportTraceServiceResponse().SerializeToString())

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        Received(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            status=span.status.code,
                            service=str(resource.get("service.name")),
                        )
                    )

    def named(self, name: str) -> list[Received]:
        return [s for s in self.spans if s.name == name]

    def children(self, parent: Received) -> list[Received]:
        return [s for s in self.spans if s.parent_id == parent.span_id]

    def dump(self) -> list[tuple[str, str, str]]:
        """(name, span id, parent id) of each span, for assertion messages."""
        return [(s.name, s.span_id, s.parent_id) for s in self.spans]


async def _answer(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/x-protobuf")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
