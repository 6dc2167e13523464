"""kvgate settings: one pydantic-settings model fed by a YAML file, ``KVGATE_*`` env vars and flags.

Precedence, highest first: command-line flags, environment (``KVGATE_PORT``, nested with
``__`` as in ``KVGATE_HEALTH__INTERVAL_S``), the ``--config`` YAML file, defaults.
Each package owns its section's model: ``workers`` and ``health`` are ``backends.config``'s
(a worker's compact CLI form is parsed there), ``index`` is ``index.config``'s, ``scoring``
``scoring.config``'s; the HTTP side (``upstream``, ``client``, the top level) is here.

Secrets (client keys, the admin token, engine keys, URL credentials) live in ``SecretStr``
fields only: they are refused when empty and never echoed in errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, overload
from urllib.parse import urlsplit

import msgspec
import pydantic
import yaml
from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from backends.allowlist import parse_allow_rule
from backends.config import HealthConfig, WorkerConfig, check_secret, redact
from backends.discovery import parse_discovery_url
from index.config import IndexConfig
from router.passthrough import check_extra_path
from scoring.config import KvPolicyConfig
from scoring.dispatch_order import AGING_TOKENS_PER_S, BASE_TOKENS
from scoring.policies import POLICY_NAMES

_SECRET_FIELDS = {"api_key", "api_keys", "admin_token", "basic_auth"}


class ResponsesConfig(BaseModel):
    """The Responses API: which worker holds which stored response."""

    affinity_max_ids: int = Field(
        default=100_000, gt=0, description="response ids remembered (previous_response_id)"
    )
    affinity_ttl_s: float = Field(
        default=3600.0, gt=0, description="how long a response id is remembered"
    )


class UpstreamConfig(BaseModel):
    """How kvgate talks to engines."""

    connect_timeout_s: float = Field(default=2.0, gt=0, description="TCP connect timeout")
    read_timeout_s: float = Field(
        default=600.0, gt=0, description="longest wait for the response or the next streamed chunk"
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="connections of the side client (probes, scrapes, engine /tokenize)",
    )
    max_keepalive: int = Field(
        default=256, ge=0, description="idle keep-alive connections kept per engine"
    )
    max_failover: int = Field(
        default=2, ge=0, description="further workers tried when one fails before answering"
    )
    response_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="longest one request's whole exchange with engines may take, streamed or "
        "not (504 before the answer starts, an error event inside a stream after)",
    )
    max_response_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1,
        description="largest non-streamed engine answer kvgate buffers (502 beyond; streams "
        "are relayed, not buffered)",
    )


class IndexWatchConfig(BaseModel):
    """When a worker's index entries are dropped because they may have outlived its cache
    (router/index_watch.py)."""

    resync_on_down: bool = Field(
        default=True,
        description="a worker marked down has its index entries dropped and its KV-event "
        "subscription started over (replayed from its engine's ring)",
    )
    silence_s: float = Field(
        default=10.0,
        ge=0,
        description="a worker serving requests that store blocks while no KV event arrives for "
        "this long has its entries dropped and learns from live events only (0: off)",
    )
    silent_requests: int = Field(
        default=3, ge=1, description="... and at least this many such requests finished"
    )


class ClientConfig(BaseModel):
    """Limits on client connections (408, 503)."""

    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="longest a new connection may go without a request head, and a head "
        "begun may take to complete (408; an idle or blank-line-only connection is closed)",
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="longest a request body may take to arrive once the bytes read so far "
        "leave it incomplete (408)",
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="client connections served at once; requests on any further one get 503",
    )


class QueueConfig(BaseModel):
    """Admission control: the router-side queue (docs/scoring.md, *Admission and the queue*).

    A request waits in kvgate when every eligible worker is busy (at or over one of the
    ``busy_*`` limits) or its API key or model is at its concurrency limit; it is sent when
    a worker frees up, to the best worker not busy then. While any worker is free the
    policy's choice stands. A worker is busy by default with eight full steps of vLLM's
    default prefill budget (8 x 8192 tokens) sent and not yet prefilled, or as many waiting
    requests as the kv policy's busy guard allows (``scoring.max_waiting_requests``, 32);
    and busy for one request when its KV blocks do not fit there (``busy_kv_room``), which
    holds a request that fits nowhere for its patience at most (``kv_room_patience``, a
    share of its wait limit); the first such request in the dispatch order keeps other
    queued requests off the worker it waits for (``kv_room_hold``).
    """

    enabled: bool = Field(default=True, description="hold requests in kvgate when all are busy")
    max_length: int = Field(
        default=1024,
        ge=0,
        description="requests queued at once; more get 429 (queue_full). Shared fairly "
        "between API keys: when it is full, a request of a key holding fewer queued requests "
        "than another key takes the place of that key's newest one (which gets 429), so one "
        "key cannot keep the others out; a key alone (one key, or none configured) may use "
        "all of it",
    )
    max_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="request body bytes queued at once (a queued request holds its body and "
        "its block keys: two to three times the body in memory); more get 429 "
        "(queue_bytes_full), shared between keys as max_length is. Raise it with kvgate's "
        "memory limit",
    )
    max_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="longest a request waits queued (503 queue_timeout past it); a client's "
        "own shorter timeout (X-Request-Timeout or X-Stainless-Timeout, seconds) wins",
    )
    busy_pending_prefill_tokens: int | None = Field(
        default=65536,
        ge=1,
        description="a worker is busy with this many predicted prompt tokens sent and not "
        "yet prefilled (none: no limit)",
    )
    busy_in_flight: int | None = Field(
        default=None, ge=1, description="a worker is busy with this many requests in flight"
    )
    busy_waiting_requests: int | None = Field(
        default=32,
        ge=1,
        description="a worker is busy when its engine reports this many waiting requests",
    )
    busy_kv_usage: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="a worker is busy when its engine reports this KV-cache usage (0..1)",
    )
    busy_kv_held: float | None = Field(
        default=None,
        gt=0,
        description="a worker is busy when its requests in flight (sent, unfinished: kvgate's "
        "prediction, or the scraped usage if more) need this share of its KV capacity",
    )
    busy_kv_room: bool = Field(
        default=True,
        description="a worker is busy for a request whose new KV blocks do not fit there now "
        "beside its requests in flight (the kv policy's KV fit): a request that fits nowhere "
        "waits in kvgate for the first worker with room, up to its kv_room_patience",
    )
    kv_room_patience: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="busy_kv_room: the share of its wait limit (max_wait_s, or the client's "
        "shorter timeout) a request waits in kvgate for KV room; then it goes as the policy "
        "ranked it and waits in that engine's queue (smaller requests that fit cannot keep "
        "it waiting until its deadline)",
    )
    kv_room_hold: bool = Field(
        default=True,
        description="busy_kv_room: the request waiting for KV room that comes first in the "
        "dispatch order holds the policy's first choice for it: no other queued request is "
        "sent there while it waits, so the room that frees there is its (as an engine's "
        "first-come-first-served queue would keep it) instead of smaller requests' that "
        "overtake it",
    )
    kv_room_holds: int = Field(
        default=1,
        ge=1,
        description="kv_room_hold: how many workers may be held at once, each by one of the "
        "first requests waiting for KV room in the dispatch order (never every worker of a "
        "request that has more than one)",
    )
    aging_tokens_per_s: float = Field(
        default=AGING_TOKENS_PER_S,
        gt=0,
        description="dispatch order: each second queued counts as this many prompt tokens "
        "less work (bounds how long a large prefill can be passed by cheaper requests: a "
        "32k-token one for half a second at the default)",
    )
    base_tokens: int = Field(
        default=BASE_TOKENS, ge=0, description="dispatch order: work counted for every request"
    )
    max_in_flight_per_key: int | None = Field(
        default=None, ge=1, description="requests one API key may have in flight; more wait"
    )
    max_queued_per_key: int | None = Field(
        default=None, ge=0, description="requests one API key may have queued; more get 429"
    )
    max_in_flight_per_model: int | None = Field(
        default=None, ge=1, description="requests one model may have in flight; more wait"
    )
    max_queued_per_model: int | None = Field(
        default=None, ge=0, description="requests one model may have queued; more get 429"
    )


def _split_words(value: Any) -> Any:
    """Env/flag lists: JSON, or whitespace-separated words."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "{")):
            return msgspec.json.decode(text)
        return text.split()
    return value


def _tokenizer_map(value: Any) -> Any:
    """``PATH`` (all models) or ``MODEL=PATH`` items into ``{model or "*": path}``."""
    if isinstance(value, str):
        value = _split_words(value)
    if isinstance(value, list):
        mapping: dict[str, str] = {}
        for item in value:
            model, sep, path = str(item).rpartition("=")
            mapping[model if sep else "*"] = path
        return mapping
    return value


class Settings(BaseSettings):
    """Every knob of ``kvgate serve``."""

    model_config = SettingsConfigDict(
        env_prefix="KVGATE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="bind port")
    workers: Annotated[list[WorkerConfig], NoDecode] = Field(
        default_factory=list, description="engine replicas (see --worker)"
    )
    discover: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="DNS discovery of engine replicas (see --discover, docs/deploy.md)",
    )
    policy: str = Field(default="kv", description=f"routing policy: {' | '.join(POLICY_NAMES)}")
    seed: int | None = Field(default=None, description="seed of randomised policies")
    tokenizers: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="tokenizer dir per model ('*': every model); flag form PATH or MODEL=PATH",
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1, description="request body limit (413)"
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="client API keys (Bearer); none: no client auth"
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="token protecting /admin and /debug (Bearer); none: those answer only "
        "when kvgate listens on loopback alone",
    )
    metrics_auth: bool = Field(
        default=False,
        description="guard /metrics as /admin and /debug are: the admin token (Bearer; "
        "Prometheus: authorization.credentials_file), or without one, served only while "
        "kvgate listens on loopback alone. The page names workers, models and client key ids: "
        "turn it on when untrusted clients reach kvgate's port",
    )
    worker_allow: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="hosts workers added at run time (POST /admin/workers) and their event "
        "endpoints may be on: CIDRs and host patterns; none given: loopback and the hosts "
        "of configured and discovered workers",
    )
    pass_through_paths: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="engine paths passed through besides embeddings, rerank, score and "
        "responses by id (e.g. /v1/load_lora_adapter: any client key could then load "
        "adapters); others get 404",
    )
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After of 503 answers")
    capture_usage: bool = Field(
        default=True, description="request usage upstream on streams to measure engine cache hits"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="log level"
    )
    log_format: Literal["text", "json", "logfmt"] = Field(
        default="text",
        description="format of every log line (kvgate's, uvicorn's, the access log), "
        "written to stdout; json: one object per line (docs/observability.md)",
    )
    access_log: bool = Field(
        default=True,
        description="one line per /v1 request on the kvgate.access logger (info level)",
    )
    access_log_sample_rate: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="share of successful (2xx) requests given an access-log line; every "
        "other status is always logged",
    )
    otlp_traces_endpoint: str | None = Field(
        default=None,
        description="export OpenTelemetry traces over OTLP HTTP/protobuf to this URL (e.g. "
        "http://collector:4318/v1/traces; needs pip install 'kvgate[otel]'); "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT turn tracing on too",
    )
    trace_sample_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="share of requests traced; a client's traceparent decides only with "
        "--trace-trust-parent; none: OTEL_TRACES_SAMPLER decides (default: every trace)",
    )
    trace_trust_parent: bool = Field(
        default=False,
        description="with --trace-sample-rate, follow the sampled flag of the client's "
        "traceparent (when every client is a trusted service whose traces you want whole)",
    )
    sim: int = Field(default=0, ge=0, description="start N simulated replicas and route to them")
    sim_port: int = Field(
        default=9001, ge=1, le=65535, description="--sim: HTTP port of replica 0 (+i)"
    )
    sim_events_port: int = Field(
        default=5557,
        ge=1,
        le=65535,
        description="--sim: KV-event PUB port of replica 0 (+2i), replay on the next port",
    )
    shutdown_timeout_s: int = Field(
        default=30,
        ge=1,
        description="after SIGTERM, seconds in-flight requests may take before they are cut",
    )
    kv_index: bool = Field(
        default=True,
        description="keep the KV block index (tokenize prompts, follow engine KV events); "
        "off: no cache prediction (baseline policies only need load)",
    )
    health: HealthConfig = Field(default_factory=HealthConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)
    index_watch: IndexWatchConfig = Field(default_factory=IndexWatchConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    index: IndexConfig = Field(default_factory=lambda: IndexConfig.model_validate({}))
    scoring: KvPolicyConfig = Field(default_factory=lambda: KvPolicyConfig.model_validate({}))

    @field_validator("workers", "api_keys", "worker_allow", "pass_through_paths", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split_words(value)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _no_blank_key_list(cls, value: Any) -> Any:
        """An empty ``KVGATE_API_KEYS`` (a Secret made from an empty file) is an error, not
        "no client keys": leave the variable out for an open gateway."""
        if isinstance(value, str) and not value.strip():
            raise ValueError("the client API keys are empty: set real keys, or leave them out")
        return value

    @field_validator("api_keys")
    @classmethod
    def _usable_keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for position, key in enumerate(keys):
            check_secret(key, f"API key {position + 1}")
        return keys

    @field_validator("admin_token")
    @classmethod
    def _usable_token(cls, token: SecretStr | None) -> SecretStr | None:
        return None if token is None else check_secret(token, "the admin token")

    @field_validator("worker_allow")
    @classmethod
    def _valid_rules(cls, rules: list[str]) -> list[str]:
        for rule in rules:
            parse_allow_rule(rule)  # a ValueError naming the problem
        return rules

    @field_validator("pass_through_paths")
    @classmethod
    def _valid_paths(cls, paths: list[str]) -> list[str]:
        for path in paths:
            check_extra_path(path)  # a ValueError naming the problem
        return paths

    @field_validator("discover", mode="before")
    @classmethod
    def _discover_list(cls, value: Any) -> Any:
        return _split_words(value)

    @field_validator("discover")
    @classmethod
    def _valid_discovery(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parse_discovery_url(url)  # DiscoveryUrlError is a ValueError naming the problem
        return urls

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _http_endpoint(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                "expected an http:// or https:// URL, e.g. http://collector:4318/v1/traces"
            )
        return url

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}")
        return name

    @field_validator("tokenizers", mode="before")
    @classmethod
    def _tokenizers(cls, value: Any) -> Any:
        return _tokenizer_map(value)

    @field_validator("workers")
    @classmethod
    def _unique_workers(cls, workers: list[WorkerConfig]) -> list[WorkerConfig]:
        seen: set[str] = set()
        for worker in workers:
            if worker.url in seen:
                raise ValueError(f"{worker.url} is listed twice")
            seen.add(worker.url)
        return workers

    @model_validator(mode="after")
    def _tokenizers_into_index(self) -> Settings:
        """``--tokenizer`` is shorthand for ``index.tokenizers`` / ``index.default_tokenizer``."""
        if not self.tokenizers:
            return self
        per_model = {m: Path(p) for m, p in self.tokenizers.items() if m != "*"}
        default = self.tokenizers.get("*")
        update: dict[str, Any] = {"tokenizers": {**self.index.tokenizers, **per_model}}
        if default is not None:
            update["default_tokenizer"] = Path(default)
        self.index = self.index.model_copy(update=update)
        return self

    @model_validator(mode="after")
    def _tokenized_somewhere(self) -> Settings:
        """Engine tokenization off (engines not equally trusted) needs a local tokenizer."""
        missing = self.index.local_tokenizer_missing()
        if missing is not None:
            raise ValueError(missing)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if settings_cls.model_config.get("yaml_file"):
            sources += (YamlConfigSettingsSource(settings_cls),)
        return sources


S = TypeVar("S", bound=Settings)


class ConfigError(ValueError):
    """Invalid configuration; the message names every offending field."""


def validation_problems(exc: pydantic.ValidationError, root: str = "(settings)") -> list[str]:
    """One ``field: message (got input)`` line per problem, secrets left out: inputs of
    secret fields and of workers (a spec string may hold a key anywhere) are not shown."""
    lines = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(part) for part in err["loc"]) or root
        hidden = any(str(part) in _SECRET_FIELDS for part in err["loc"])
        hidden = hidden or (bool(err["loc"]) and err["loc"][0] in ("workers", "url"))
        shown = "input" in err and not isinstance(err["input"], dict | list) and not hidden
        got = f" (got {err['input']!r})" if shown else ""
        lines.append(redact(f"{field}: {err['msg']}{got}"))
    return lines


def format_validation_error(exc: pydantic.ValidationError) -> str:
    lines = (f"  {line}" for line in validation_problems(exc))
    return "invalid configuration:\n" + "\n".join(lines)


@overload
def load_settings(
    config_file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings: ...


@overload
def load_settings(
    config_file: str | Path | None, overrides: Mapping[str, Any] | None, model: type[S]
) -> S: ...


def load_settings(
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    model: type[Settings] = Settings,
) -> Settings:
    """Build the settings from defaults, the YAML file, ``KVGATE_*`` env vars and ``overrides``
    (``model``: ``Settings`` or a command's extension of it, e.g. ``kvgate epp``'s).

    Raises ``ConfigError`` naming each invalid field.
    """
    settings_cls = model
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"invalid configuration:\n  --config: no such file {str(path)!r}")
        config = SettingsConfigDict(**{**model.model_config, "yaml_file": path})
        settings_cls = type(model.__name__, (model,), {"model_config": config})
    try:
        return settings_cls(**dict(overrides or {}))
    except pydantic.ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc
    except (msgspec.DecodeError, yaml.YAMLError, SettingsError, ValueError) as exc:
        raise ConfigError(redact(f"invalid configuration: {exc}")) from exc
