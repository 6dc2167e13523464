"""ext_proc messages in and out (``envoy.service.ext_proc.v3``), and the Endpoint Picker
Protocol's names.

Reading: a request's headers (``headers_of``), the protocol's metadata (``served_endpoint``,
``subset_hint``). Writing: the pick (``pick_headers``, with the ``envoy.lb`` dynamic metadata),
bodies sent back in full-duplex streamed mode (``streamed_bodies``, in pieces Envoy accepts),
plain continues, and refusals (``refusal``: an ``ImmediateResponse`` with kvgate's OpenAI-style
error body). Everything read is bounded: a peer's header list, metadata list or value is cut
at a fixed size, never followed to its end.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from google.protobuf import struct_pb2

from kvgate.router.epp import messages as pb
from kvgate.router.errors import KvgateError

LB_NAMESPACE = "envoy.lb"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
TEST_SELECTION = "test-epp-endpoint-selection"  # the conformance suite's forced pick
TEST_SERVED = "x-conformance-test-served-endpoint"  # ... and where it reads what served

MAX_HEADERS = 512  # header entries read from one message (Envoy's own limit is 100)
MAX_ENDPOINTS = 1024  # endpoints read from a subset hint or a forced pick
MAX_VALUE = 64 * 1024  # characters of one header or metadata value
BODY_PIECE = 62_000  # bytes of body per message sent back (Envoy takes up to 64 KiB)

BodyMode = int
FULL_DUPLEX = pb.FULL_DUPLEX_STREAMED
BUFFERED = pb.BUFFERED
STREAMED = pb.STREAMED
NO_BODY = pb.NONE

Message = Any  # a message of router.epp.messages (classes built at run time)


def endpoint_of(url: str) -> str:
    """A worker URL's ``ip:port`` as the protocol writes endpoints (IPv6 in brackets)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def headers_of(message: Message) -> dict[str, str]:
    """An ``HttpHeaders``' entries (names lower-case; a repeated name keeps its first value)."""
    found: dict[str, str] = {}
    for count, header in enumerate(message.headers.headers):
        if count >= MAX_HEADERS:
            break
        raw: bytes = header.raw_value
        value = raw.decode("utf-8", "replace") if raw else str(header.value)
        found.setdefault(str(header.key).lower(), value[:MAX_VALUE])
    return found


def headers_list(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """Headers as ASGI-style byte pairs (what the access log and tracing read)."""
    return [(k.encode(), v.encode()) for k, v in headers.items() if not k.startswith(":")]


def _lb_value(message: Message, namespace: str, key: str) -> Any:
    metadata = message.metadata_context.filter_metadata
    if namespace not in metadata:
        return None
    fields = metadata[namespace].fields
    return fields.get(key)


def served_endpoint(message: Message) -> str | None:
    """The endpoint that served the response (``envoy.lb`` / ``...-served``), if told."""
    value = _lb_value(message, LB_NAMESPACE, SERVED)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return str(value.string_value)[:MAX_VALUE] or None


def subset_hint(message: Message) -> list[str] | None:
    """The endpoints the proxy allows (``envoy.lb.subset_hint``), None when it sets none."""
    value = _lb_value(message, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "string_value":  # tolerated: one comma-separated string
        return split_endpoints(str(value.string_value))
    if kind != "list_value":
        return []
    items = value.list_value.values[:MAX_ENDPOINTS]
    return [
        str(v.string_value)[:MAX_VALUE] for v in items if v.WhichOneof("kind") == "string_value"
    ]


def split_endpoints(text: str) -> list[str]:
    """``ip:port,ip:port,...`` (or bare IPs) into its entries, bounded."""
    return [
        part.strip()
        for part in text[:MAX_VALUE].split(",", MAX_ENDPOINTS)[:MAX_ENDPOINTS]
        if part.strip()
    ]


def body_modes(message: Message) -> tuple[BodyMode, BodyMode] | None:
    """(request, response) body modes from the stream's first message, if Envoy sent them."""
    if not message.HasField("protocol_config"):
        return None
    config = message.protocol_config
    return int(config.request_body_mode), int(config.response_body_mode)


def _header_options(headers: Iterable[tuple[str, str]]) -> list[Message]:
    return [
        pb.HeaderValueOption(header=pb.HeaderValue(key=k, raw_value=v.encode())) for k, v in headers
    ]


def _mutation(set_headers: Iterable[tuple[str, str]], remove: Sequence[str] = ()) -> Message:
    return pb.HeaderMutation(set_headers=_header_options(set_headers), remove_headers=list(remove))


def _pick_common(endpoints: Sequence[str], rewrite: Rewrite) -> tuple[Message, Message]:
    value = ",".join(endpoints)
    metadata = struct_pb2.Struct()  # {LB_NAMESPACE: {DESTINATION: value}}
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = value
    sets = [(DESTINATION, value), *rewrite.set_headers]
    common = pb.CommonResponse(header_mutation=_mutation(sets, rewrite.remove_headers))
    return common, metadata


def pick_headers(endpoints: Sequence[str], rewrite: Rewrite) -> Message:
    """The answer to the request's headers: ``x-gateway-destination-endpoint`` and the
    ``envoy.lb`` dynamic metadata, the same list in both (chosen first, then fallbacks),
    with the request's other header changes."""
    common, metadata = _pick_common(endpoints, rewrite)
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata
    )


def pick_with_body(endpoints: Sequence[str], rewrite: Rewrite, body: bytes | None) -> Message:
    """Buffered mode: the pick rides on the answer to the (whole) body (replaced by
    ``body`` when given)."""
    common, metadata = _pick_common(endpoints, rewrite)
    if body is not None:
        common.body_mutation.body = body
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata
    )


@dataclass(frozen=True, slots=True)
class Rewrite:
    """Header changes on the request as it goes upstream."""

    set_headers: tuple[tuple[str, str], ...] = ()
    remove_headers: tuple[str, ...] = ()


def streamed_bodies(body: bytes, *, request: bool, end: bool) -> Iterator[Message]:
    """``body`` sent back in full-duplex streamed mode, in pieces of at most ``BODY_PIECE``
    bytes (one empty piece for an empty body); the last carries ``end``."""
    pieces = [body[i : i + BODY_PIECE] for i in range(0, len(body), BODY_PIECE)] or [b""]
    for number, piece in enumerate(pieces, 1):
        streamed = pb.StreamedBodyResponse(body=piece, end_of_stream=end and number == len(pieces))
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        answer = pb.BodyResponse(response=common)
        yield (
            pb.ProcessingResponse(request_body=answer)
            if request
            else pb.ProcessingResponse(response_body=answer)
        )


def body_continue(*, request: bool, body: bytes | None = None) -> Message:
    """Streamed or buffered mode: the body goes on (replaced by ``body`` when given)."""
    common = pb.CommonResponse()
    if body is not None:
        common.body_mutation.body = body
    answer = pb.BodyResponse(response=common)
    return (
        pb.ProcessingResponse(request_body=answer)
        if request
        else pb.ProcessingResponse(response_body=answer)
    )


def headers_continue(
    *,
    request: bool,
    set_headers: Iterable[tuple[str, str]] = (),
    mode_override: Message | None = None,
) -> Message:
    """The headers go on (with ``set_headers``); ``mode_override``: the processing mode of
    the rest of this request (Envoy honours it with ``allow_mode_override``)."""
    common = pb.CommonResponse(header_mutation=_mutation(set_headers))
    answer = pb.HeadersResponse(response=common)
    message = (
        pb.ProcessingResponse(request_headers=answer)
        if request
        else pb.ProcessingResponse(response_headers=answer)
    )
    if mode_override is not None:
        message.mode_override.CopyFrom(mode_override)
    return message


def can_skip_answer(modes: tuple[BodyMode, BodyMode]) -> bool:
    """Whether Envoy can be told to send no more of an answer than its head: it ignores a
    mode override when either body mode is full-duplex streamed, and its answer body mode
    must be streamed (with NONE the stream would end at the head for every request)."""
    return modes[0] == BUFFERED and modes[1] == STREAMED


def skip_answer_body(request_mode: BodyMode) -> Message:
    """The mode override that sends no more of the answer than its head: no body; the
    trailers (if any) still sent, so Envoy keeps the stream open until the request ends
    (ended by the client, the engine or a reset) and its close is the request's end."""
    return pb.ProcessingMode(
        request_body_mode=request_mode, response_body_mode=NO_BODY, response_trailer_mode=pb.SEND
    )


def trailers_continue(*, request: bool) -> Message:
    answer = pb.TrailersResponse()
    return (
        pb.ProcessingResponse(request_trailers=answer)
        if request
        else pb.ProcessingResponse(response_trailers=answer)
    )


def immediate(
    status: int, body: bytes, headers: Iterable[tuple[str, str]], details: str
) -> Message:
    """An ``ImmediateResponse``: Envoy answers the client itself, nothing goes upstream."""
    answer = pb.ImmediateResponse(
        status={"code": status}, headers=_mutation(headers), body=body, details=details[:128]
    )
    return pb.ProcessingResponse(immediate_response=answer)


def refusal(error: KvgateError, request_id: str) -> Message:
    """``error`` as the client's answer: its status, OpenAI-style body and headers
    (``Retry-After`` of a 429 / 503)."""
    content_type = getattr(error, "content_type", "application/json")
    headers = [("content-type", content_type), ("x-request-id", request_id), *error.headers.items()]
    details = f"kvgate_{error.code or 'error'}"
    return immediate(error.status, error.body_bytes(), headers, details)


def serialize(message: Message | bytes) -> bytes:
    """The gRPC response serializer: an answer serialized ahead (a constant) goes as is."""
    return message if isinstance(message, bytes) else bytes(message.SerializeToString())


# constant answers, serialized once (``serialize`` sends them as they are)
HEAD_CONTINUE = serialize(headers_continue(request=True))  # a buffered request's head
PIECE_CONTINUE = serialize(body_continue(request=False))  # an answer's piece, unchanged
REQUEST_TRAILERS_CONTINUE = serialize(trailers_continue(request=True))
ANSWER_TRAILERS_CONTINUE = serialize(trailers_continue(request=False))


def message_kind(message: Message) -> str | None:
    """Which part of the HTTP exchange a ``ProcessingRequest`` carries."""
    kind = message.WhichOneof("request")
    return None if kind is None else str(kind)
