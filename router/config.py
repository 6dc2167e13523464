"""kvgate settings: one pydantic-settings model fed by a YAML file, ``KVGATE_*`` env vars and flags.

Precedence, highest first: command-line flags, environment (``KVGATE_PORT``, nested with
``__`` as in ``KVGATE_HEALTH__INTERVAL_S``), the ``--config`` YAML file, defaults.
Each package owns its section's model: ``workers`` and ``health`` are ``backends.config``'s
(a worker's compact CLI form is parsed there), ``index`` is ``index.config``'s, ``scoring``
``scoring.config``'s, ``scheduling`` and ``queue`` ``scheduling.config``'s; the HTTP side
(``upstream``, ``client``, the top level) is here. Settings that moved keep their old
spelling (``MOVED``).

Secrets (client keys, the admin token, engine keys, URL credentials) live in ``SecretStr``
fields only: they are refused when empty and never echoed in errors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
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

from kvgate.backends.allowlist import parse_allow_rule
from kvgate.backends.config import HealthConfig, WorkerConfig, check_secret, redact
from kvgate.backends.discovery import parse_discovery_url
from kvgate.index.config import IndexConfig
from kvgate.router.passthrough import check_extra_path
from kvgate.scheduling.config import QueueConfig, SchedulingConfig
from kvgate.scoring.config import KvPolicyConfig
from kvgate.scoring.policies import POLICY_NAMES

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

    connect_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="TCP connect timeout to an engine: lower it to fail over sooner from a host "
        "that does not answer",
    )
    read_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="longest wait for an engine's answer or its next streamed chunk: raise it "
        "for engines that queue requests for longer",
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
        default=2,
        ge=0,
        description="further workers tried when one fails before the first token; 0: never "
        "retry elsewhere",
    )
    response_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="longest one request's whole exchange with engines may take, streamed or "
        "not (504 before the answer starts, an error event inside a stream after): bounds a "
        "stuck stream",
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
        description="client connections served at once (requests on any further one get "
        "503): size it to your file-descriptor limit and expected clients",
    )


MOVED: Mapping[tuple[str, str], tuple[str, ...]] = MappingProxyType(
    {
        ("scoring", "seed"): ("seed",),
        ("scoring", "kv_capacity_blocks"): ("scheduling", "kv_capacity_blocks"),
        ("scoring", "max_waiting_requests"): ("scheduling", "max_waiting_requests"),
        ("scoring", "max_kv_usage"): ("scheduling", "max_kv_usage"),
        ("queue", "busy_waiting_requests"): ("scheduling", "max_waiting_requests"),
        ("queue", "busy_pending_prefill_tokens"): ("scheduling", "max_pending_prefill_tokens"),
        ("queue", "busy_in_flight"): ("scheduling", "max_in_flight"),
    }
)
"""Settings that moved (section, field) -> their place now: the old spelling is still read
from the config file, the environment and (``router.flags``) the command line."""


def _moved_settings(data: Any) -> Any:
    """``data`` (the merged sources, before validation) with moved settings in their new
    place; one setting given in its old and its new place with two values is an error."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for (section, name), target in MOVED.items():
        old = data.get(section)
        if not isinstance(old, dict) or name not in old:
            continue
        value = old[name]
        data[section] = {k: v for k, v in old.items() if k != name}
        *parents, leaf = target
        node = data
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                if child is not None:  # a model instance given as is: leave it to validation
                    raise ValueError(f"{section}.{name} moved to {'.'.join(target)}")
                child = {}
            node[part] = child = dict(child)
            node = child
        if leaf in node and node[leaf] != value:
            raise ValueError(
                f"{section}.{name} (now {'.'.join(target)}) is given twice: "
                f"{value!r} and {node[leaf]!r}"
            )
        node[leaf] = value
    return data


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


_SIM_ROLES = re.compile(r"(\d{1,3})p(\d{1,3})d")


def sim_roles_spec(value: Any) -> int | str:
    """``--sim``'s value: a replica count, or ``NpMd``; ``ValueError`` otherwise."""
    text = str(value).strip().lower()
    if text.isdigit():
        return int(text)
    found = _SIM_ROLES.fullmatch(text)
    if found is None or not int(found[1]) or not int(found[2]):
        raise ValueError("expected a replica count N, or NpMd (N prefill, M decode: 2p2d)")
    return text


def sim_roles(sim: int | str) -> list[str]:
    """The role of each replica of ``--sim`` ``sim`` (``sim_roles_spec``'s form)."""
    if isinstance(sim, int):
        return ["both"] * sim
    found = _SIM_ROLES.fullmatch(sim)
    assert found is not None
    return ["prefill"] * int(found[1]) + ["decode"] * int(found[2])


class Settings(BaseSettings):
    """Every knob of ``kvgate serve``."""

    model_config = SettingsConfigDict(
        env_prefix="KVGATE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    host: str = Field(
        default="127.0.0.1",
        description="address to listen on: 0.0.0.0 (or a pod IP) to serve beyond this machine "
        "(then /admin and /debug need --admin-token)",
    )
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    workers: Annotated[list[WorkerConfig], NoDecode] = Field(
        default_factory=list, description="engine replicas (see --worker)"
    )
    discover: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="DNS discovery of engine replicas (see --discover, docs/deploy.md)",
    )
    policy: str = Field(
        default="kv",
        description="routing policy: kv (cache-aware), or a cache-unaware baseline to compare "
        "against",
        json_schema_extra={"choices": list(POLICY_NAMES)},
    )
    seed: int | None = Field(
        default=None,
        description="seed of the random choices (scoring temperature above 0, the random "
        "policy): set it for runs you can repeat",
    )
    tokenizers: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="tokenizer dir per model ('*': every model); flag form PATH or MODEL=PATH",
    )
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1,
        description="largest request body (413 beyond): raise it for prompts past 32 MiB of JSON",
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="client API keys (Bearer); none: no client auth"
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="token that opens /admin and /debug (Bearer): set it to use them when "
        "kvgate listens beyond loopback (without one they answer on loopback alone)",
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
        default=True,
        description="ask engines for usage on streams whose client did not (and hide it from "
        "the client) to measure their cache hits; turn it off for engines that refuse "
        "stream_options",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info",
        description="log level; debug logs every routing decision with its terms",
    )
    log_format: Literal["text", "json", "logfmt"] = Field(
        default="text",
        description="format of every log line (kvgate's, uvicorn's, the access log), "
        "written to stdout: json (one object per line) or logfmt for a log pipeline "
        "(docs/observability.md)",
    )
    access_log: bool = Field(
        default=True,
        description="one line per /v1 request on the kvgate.access logger (worker, cache hit, "
        "TTFT, queue wait); turn it off to save log volume",
    )
    access_log_sample_rate: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="share of successful (2xx) requests given an access-log line (every "
        "other status always is): lower it at high request rates",
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
    sim: int | str = Field(
        default=0,
        description="start N simulated replicas and route to them: a demo, or a test bed "
        "without GPUs; NpMd (e.g. 2p2d): N prefill and M decode replicas, a disaggregated "
        "fleet (docs/pd.md)",
        json_schema_extra={"metavar": "N|NpMd"},
    )
    sim_port: int = Field(
        default=9001,
        ge=1,
        le=65535,
        description="--sim: HTTP port of replica 0 (+i); move it when those ports are taken",
    )
    sim_events_port: int = Field(
        default=5557,
        ge=1,
        le=65535,
        description="--sim: KV-event PUB port of replica 0 (+2i), replay on the next port; "
        "move it when those ports are taken",
    )
    shutdown_timeout_s: int = Field(
        default=30,
        ge=1,
        description="after SIGTERM, seconds in-flight requests may take before they are cut: "
        "match your orchestrator's grace period",
    )
    kv_index: bool = Field(
        default=True,
        description="keep the KV block index (tokenize prompts, follow the engines' KV "
        "events); turn it off when only a baseline policy is used (they need load only)",
    )
    health: HealthConfig = Field(default_factory=HealthConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)
    index_watch: IndexWatchConfig = Field(default_factory=IndexWatchConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    index: IndexConfig = Field(default_factory=lambda: IndexConfig.model_validate({}))
    scoring: KvPolicyConfig = Field(default_factory=lambda: KvPolicyConfig.model_validate({}))

    @field_validator("sim", mode="before")
    @classmethod
    def _sim_fleet(cls, value: Any) -> int | str:
        """``N`` (whole-request replicas) or ``NpMd`` (prefill and decode replicas)."""
        return sim_roles_spec(value)

    @property
    def sim_roles(self) -> list[str]:
        """The role of each ``--sim`` replica, in order."""
        return sim_roles(self.sim)

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

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        return _moved_settings(data)

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
