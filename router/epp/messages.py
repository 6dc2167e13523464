"""The ext_proc messages kvgate reads and writes, declared here (protobuf descriptors built
in code) with the field numbers and types of Envoy's ``envoy.service.ext_proc.v3`` API.

Only what the Endpoint Picker Protocol needs is declared; a field a peer sends that is not
declared here is kept as an unknown field and ignored. Enum fields are declared ``int32``
(the same varint on the wire). The messages live in a package of kvgate's own
(``kvgate.ext_proc``), so they never collide with Envoy's generated protos should those be
installed too (the ``xds-protos`` package also ships an older copy of OpenTelemetry's protos
that replaces the one kvgate's tracing imports, which is why kvgate does not depend on it);
the gRPC method is named by its path, ``/envoy.service.ext_proc.v3.ExternalProcessor/Process``.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, struct_pb2

PACKAGE = "kvgate.ext_proc"
PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

# body send modes (envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode)
NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED, GRPC = range(6)
# header and trailer send modes (ProcessingMode.HeaderSendMode)
DEFAULT, SEND, SKIP = range(3)

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "bool": _F.TYPE_BOOL,
    "int32": _F.TYPE_INT32,
}

# message -> [(number, name, type, repeated, oneof)]; a type not in _SCALARS is a message
# (a bare name: one of these; else a full name)
_MESSAGES: dict[str, list[tuple[int, str, str, bool, str | None]]] = {
    "HeaderValue": [(1, "key", "string", False, None), (2, "value", "string", False, None),
                    (3, "raw_value", "bytes", False, None)],
    "HeaderValueOption": [(1, "header", "HeaderValue", False, None),
                          (3, "append_action", "int32", False, None),
                          (4, "keep_empty_value", "bool", False, None)],
    "HeaderMap": [(1, "headers", "HeaderValue", True, None)],
    "Metadata": [(1, "filter_metadata", "Metadata.FilterMetadataEntry", True, None)],
    "HttpStatus": [(1, "code", "int32", False, None)],
    "ProtocolConfiguration": [(1, "request_body_mode", "int32", False, None),
                              (2, "response_body_mode", "int32", False, None),
                              (3, "send_body_without_waiting_for_header_response", "bool",
                               False, None)],
    "HttpHeaders": [(1, "headers", "HeaderMap", False, None),
                    (3, "end_of_stream", "bool", False, None)],
    "HttpBody": [(1, "body", "bytes", False, None), (2, "end_of_stream", "bool", False, None)],
    "HttpTrailers": [(1, "trailers", "HeaderMap", False, None)],
    "ProcessingRequest": [
        (2, "request_headers", "HttpHeaders", False, "request"),
        (3, "response_headers", "HttpHeaders", False, "request"),
        (4, "request_body", "HttpBody", False, "request"),
        (5, "response_body", "HttpBody", False, "request"),
        (6, "request_trailers", "HttpTrailers", False, "request"),
        (7, "response_trailers", "HttpTrailers", False, "request"),
        (8, "metadata_context", "Metadata", False, None),
        (10, "observability_mode", "bool", False, None),
        (11, "protocol_config", "ProtocolConfiguration", False, None),
    ],
    "HeaderMutation": [(1, "set_headers", "HeaderValueOption", True, None),
                       (2, "remove_headers", "string", True, None)],
    "StreamedBodyResponse": [(1, "body", "bytes", False, None),
                             (2, "end_of_stream", "bool", False, None)],
    "BodyMutation": [(1, "body", "bytes", False, "mutation"),
                     (2, "clear_body", "bool", False, "mutation"),
                     (3, "streamed_response", "StreamedBodyResponse", False, "mutation")],
    "CommonResponse": [(1, "status", "int32", False, None),
                       (2, "header_mutation", "HeaderMutation", False, None),
                       (3, "body_mutation", "BodyMutation", False, None),
                       (5, "clear_route_cache", "bool", False, None)],
    "HeadersResponse": [(1, "response", "CommonResponse", False, None)],
    "BodyResponse": [(1, "response", "CommonResponse", False, None)],
    "TrailersResponse": [(1, "header_mutation", "HeaderMutation", False, None)],
    "ImmediateResponse": [(1, "status", "HttpStatus", False, None),
                          (2, "headers", "HeaderMutation", False, None),
                          (3, "body", "bytes", False, None),
                          (5, "details", "string", False, None)],
    "ProcessingMode": [(1, "request_header_mode", "int32", False, None),
                       (2, "response_header_mode", "int32", False, None),
                       (3, "request_body_mode", "int32", False, None),
                       (4, "response_body_mode", "int32", False, None),
                       (5, "request_trailer_mode", "int32", False, None),
                       (6, "response_trailer_mode", "int32", False, None)],
    "ProcessingResponse": [
        (1, "request_headers", "HeadersResponse", False, "response"),
        (2, "response_headers", "HeadersResponse", False, "response"),
        (3, "request_body", "BodyResponse", False, "response"),
        (4, "response_body", "BodyResponse", False, "response"),
        (5, "request_trailers", "TrailersResponse", False, "response"),
        (6, "response_trailers", "TrailersResponse", False, "response"),
        (7, "immediate_response", "ImmediateResponse", False, "response"),
        (8, "dynamic_metadata", "google.protobuf.Struct", False, None),
        (9, "mode_override", "ProcessingMode", False, None),
    ],
}  # fmt: skip


def _field(
    message: descriptor_pb2.DescriptorProto,
    spec: tuple[int, str, str, bool, str | None],
    oneofs: dict[str, int],
) -> None:
    number, name, kind, repeated, oneof = spec
    field = message.field.add(number=number, name=name, json_name=name)
    field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
    if kind in _SCALARS:
        field.type = _SCALARS[kind]
    else:
        field.type = _F.TYPE_MESSAGE
        field.type_name = f".{kind}" if kind.startswith("google.") else f".{PACKAGE}.{kind}"
    if oneof is not None:
        if oneof not in oneofs:
            oneofs[oneof] = len(message.oneof_decl)
            message.oneof_decl.add(name=oneof)
        field.oneof_index = oneofs[oneof]


def _file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="kvgate/ext_proc.proto",
        package=PACKAGE,
        syntax="proto3",
        dependency=["google/protobuf/struct.proto"],
    )
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        oneofs: dict[str, int] = {}
        for spec in fields:
            _field(message, spec, oneofs)
        if name == "Metadata":  # map<string, google.protobuf.Struct> filter_metadata
            entry = message.nested_type.add(name="FilterMetadataEntry")
            entry.options.map_entry = True
            _field(entry, (1, "key", "string", False, None), {})
            _field(entry, (2, "value", "google.protobuf.Struct", False, None), {})
    return file


def _classes() -> dict[str, Any]:
    pool = descriptor_pool.Default()
    struct_pb2.Struct()  # google/protobuf/struct.proto is in the pool first
    try:
        pool.FindFileByName("kvgate/ext_proc.proto")
    except KeyError:
        pool.Add(_file())
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name in _MESSAGES
    }


_CLASSES = _classes()
HeaderValue: Any = _CLASSES["HeaderValue"]
HeaderValueOption: Any = _CLASSES["HeaderValueOption"]
HeaderMap: Any = _CLASSES["HeaderMap"]
Metadata: Any = _CLASSES["Metadata"]
HttpStatus: Any = _CLASSES["HttpStatus"]
ProtocolConfiguration: Any = _CLASSES["ProtocolConfiguration"]
HttpHeaders: Any = _CLASSES["HttpHeaders"]
HttpBody: Any = _CLASSES["HttpBody"]
HttpTrailers: Any = _CLASSES["HttpTrailers"]
ProcessingRequest: Any = _CLASSES["ProcessingRequest"]
HeaderMutation: Any = _CLASSES["HeaderMutation"]
StreamedBodyResponse: Any = _CLASSES["StreamedBodyResponse"]
BodyMutation: Any = _CLASSES["BodyMutation"]
CommonResponse: Any = _CLASSES["CommonResponse"]
HeadersResponse: Any = _CLASSES["HeadersResponse"]
BodyResponse: Any = _CLASSES["BodyResponse"]
TrailersResponse: Any = _CLASSES["TrailersResponse"]
ImmediateResponse: Any = _CLASSES["ImmediateResponse"]
ProcessingMode: Any = _CLASSES["ProcessingMode"]
ProcessingResponse: Any = _CLASSES["ProcessingResponse"]
