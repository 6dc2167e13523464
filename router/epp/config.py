"""``EppSettings``: every option of ``kvgate serve`` (the same names, variables and file), and
the gRPC side of ``kvgate epp``."""

from __future__ import annotations

from pydantic import Field

from kvgate.router.config import Settings

EXT_PROC_PORT = 9002  # the Endpoint Picker Protocol's usual port


class EppSettings(Settings):
    """``kvgate epp``: ``host`` / ``port`` serve its HTTP side (/health, /ready, /metrics,
    /debug); ext_proc and gRPC health listen on ``host`` at ``grpc_port``."""

    grpc_port: int = Field(
        default=EXT_PROC_PORT,
        ge=0,
        le=65535,
        description="port of the ext_proc and gRPC health services (the one the gateway's "
        "InferencePool endpointPickerRef names)",
    )
    conformance_headers: bool = Field(
        default=False,
        description="honour the inference extension's conformance-test headers "
        "(test-epp-endpoint-selection picks the endpoints, the served one is echoed in "
        "x-conformance-test-served-endpoint): only to run its conformance suite, since any "
        "client may then choose its replica",
    )
    answer_sample: int = Field(
        default=16,
        ge=1,
        le=1_000_000,
        description="read one answer in N through kvgate (its usage, first-token time, "
        "streamed blocks, a cut): the others only to their head, when the gateway's Envoy "
        "allows mode overrides (deploy/envoy/envoy.yaml). 1 reads every answer: cache and "
        "TTFT metrics from every request, at about 3x kvgate's CPU per request",
    )
