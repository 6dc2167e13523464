"""kvgate settings: one pydantic-settings model fed by a YAML file, ``KVGATE_*`` env vars and flags.

Precedence, highest first: command-line flags, environment (``KVGATE_PORT``, nested with
``__`` as in ``KVGATE_HEALTH__INTERVAL_S``), the ``--config`` YAML file, defaults.
A worker can be written as a mapping or in the compact CLI form
``URL[,engine=vllm][,models=a;b][,events=tcp://...][,replay=tcp://...][,api_key=...]``.

Secrets (client keys, the admin token, engine keys, URL credentials) live in ``SecretStr``
fields only: they are refused when empty and never echoed in errors; a worker URL's
``user:password@`` becomes its HTTP Basic credentials and leaves the URL (the worker's id,
shown everywhere), so it cannot be displayed.
"""

from __future__ import annotations

import re
from base64 import b64encode
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlsplit

import msgspec
import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from backends.allowlist import parse_allow_rule
from backends.discovery import parse_discovery_url
from index.config import IndexConfig
from index.types import WorkerId
from scoring.config import KvPolicyConfig
from scoring.policies import POLICY_NAMES

EngineKind = Literal["vllm", "sglang", "openai"]

_WORKER_KEYS = {"engine", "models", "events", "replay", "api_key"}
_SECRET_FIELDS = {"api_key", "api_keys", "admin_token", "basic_auth"}
_USERINFO = re.compile(r"(?<=://)[^/@\s'\"]*@")
_KEY_VALUE = re.compile(r"(?i)((?:api_?key|token|password|secret)\w*\s*[=:]\s*)[^,\s'\"}]+")
_URL_PATH_OK = re.compile(r"[!-~]*")  # printable ASCII, no space: it goes in a request line


def strip_userinfo(url: str) -> str:
    """``url`` without its ``user:password@`` part (what kvgate may show of any URL)."""
    return _USERINFO.sub("", url)


def redact(text: str) -> str:
    """``text`` with URL credentials and ``api_key=...``-style values masked."""
    return _KEY_VALUE.sub(r"\1***", _USERINFO.sub("***@", text))


def normalise_url(url: str) -> str:
    """A worker's base URL in canonical form (its ``WorkerId``): no credentials, no
    trailing slash, lower-case host. Errors show the URL without its credentials."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    shown = strip_userinfo(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(f"expected an http(s)://host[:port] URL, got {shown!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"a worker URL takes no query or fragment: {shown!r}")
    if not _URL_PATH_OK.fullmatch(parts.path):
        raise ValueError(f"a worker URL path must be printable ASCII without spaces: {shown!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"invalid port in {shown!r}") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if port is None else f"{host}:{port}"
    return f"{parts.scheme}://{netloc}{parts.path}"


def parse_worker_spec(spec: str) -> dict[str, Any]:
    """Parse ``URL,key=value,...`` (``models`` separated by ``;``) into WorkerConfig fields.

    Errors name the offending option by its key or position, never by its value (it may
    be a key)."""
    url, *options = (part.strip() for part in spec.split(","))
    fields: dict[str, Any] = {"url": url}
    allowed = ", ".join(sorted(_WORKER_KEYS))
    for position, option in enumerate(options, start=1):
        key, sep, value = option.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"worker option {position} is not KEY=VALUE (KEY in {allowed})")
        if key not in _WORKER_KEYS:
            shown = key if key.isidentifier() and len(key) <= 32 else f"number {position}"
            raise ValueError(f"unknown worker option {shown!r}: expected KEY in {allowed}")
        fields[key] = [m for m in value.split(";") if m] if key == "models" else value
    return fields


def _split_userinfo(fields: dict[str, Any]) -> dict[str, Any]:
    """Move a URL's ``user:password@`` into ``basic_auth``: the URL is shown, never it."""
    url = fields.get("url")
    if not isinstance(url, str):
        return fields
    parts = urlsplit(url.strip())
    userinfo, at, _ = parts.netloc.rpartition("@")
    if not at:
        return fields
    if fields.get("basic_auth") is not None:
        raise ValueError("give the worker's credentials once: in the URL or in basic_auth")
    return {**fields, "url": strip_userinfo(url), "basic_auth": userinfo}


def check_secret(value: SecretStr, what: str) -> SecretStr:
    """A usable secret: not empty or blank, no surrounding spaces nor control characters.

    The message names ``what``, never the value."""
    text = value.get_secret_value()
    if not text.strip():
        raise ValueError(f"{what} is empty: set a real value, or leave it out entirely")
    if text != text.strip() or not text.isprintable():
        raise ValueError(f"{what} has surrounding spaces or control characters")
    return value


class WorkerConfig(BaseModel):
    """One engine replica (an HTTP endpoint serving the OpenAI API)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="base URL of the engine, e.g. http://127.0.0.1:9001")
    engine: EngineKind = Field(default="vllm", description="engine kind: vllm | sglang | openai")
    models: list[str] | None = Field(
        default=None, description="models it serves; discovered from its /v1/models when not given"
    )
    events: str | None = Field(
        default=None, description="KV events ZMQ PUB endpoint (tcp://host:port)"
    )
    replay: str | None = Field(default=None, description="KV events replay ZMQ ROUTER endpoint")
    api_key: SecretStr | None = Field(
        default=None, description="bearer key kvgate sends to this engine"
    )
    basic_auth: SecretStr | None = Field(
        default=None,
        description="user:password kvgate sends to this engine as HTTP Basic credentials "
        "(a URL's user:password@ lands here)",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, value: Any) -> Any:
        fields = parse_worker_spec(value) if isinstance(value, str) else value
        return _split_userinfo(fields) if isinstance(fields, dict) else fields

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, key: SecretStr | None) -> SecretStr | None:
        return None if key is None else check_secret(key, "api_key")

    @field_validator("basic_auth")
    @classmethod
    def _usable_credentials(cls, credentials: SecretStr | None) -> SecretStr | None:
        if credentials is None:
            return None
        if ":" not in credentials.get_secret_value():
            raise ValueError("basic_auth: expected user:password")
        return check_secret(credentials, "basic_auth")

    @model_validator(mode="after")
    def _one_credential(self) -> WorkerConfig:
        if self.api_key is not None and self.basic_auth is not None:
            raise ValueError("give the engine either an api_key or URL credentials, not both")
        return self

    @field_validator("url")
    @classmethod
    def _normalise(cls, url: str) -> str:
        return normalise_url(url)

    @field_validator("events", "replay")
    @classmethod
    def _zmq_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"expected a ZMQ endpoint such as tcp://127.0.0.1:5557, got {endpoint!r}"
            )
        return endpoint

    @property
    def id(self) -> WorkerId:
        return WorkerId(self.url)

    def authorization(self) -> str | None:
        """The ``Authorization`` header value kvgate sends this engine, if any."""
        if self.api_key is not None:
            return "Bearer " + self.api_key.get_secret_value()
        if self.basic_auth is not None:
            user, _, password = self.basic_auth.get_secret_value().partition(":")
            pair = f"{unquote(user)}:{unquote(password)}".encode()
            return "Basic " + b64encode(pair).decode("ascii")
        return None


class HealthConfig(BaseModel):
    """Active health checks and load scraping."""

    interval_s: float = Field(default=2.0, gt=0, description="seconds between GET /health probes")
    timeout_s: float = Field(default=1.0, gt=0, description="timeout of one probe or scrape")
    failure_threshold: int = Field(
        default=3,
        ge=1,
        description="consecutive failures (probes or 5xx) before a worker is unhealthy",
    )
    recovery_threshold: int = Field(
        default=1, ge=1, description="consecutive successful probes before it is healthy again"
    )
    metrics_interval_s: float = Field(
        default=1.0, ge=0, description="seconds between scrapes of each engine's /metrics (0: off)"
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
    worker_allow: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="hosts workers added at run time (POST /admin/workers) and their event "
        "endpoints may be on: CIDRs and host patterns; none given: loopback and the hosts "
        "of configured and discovered workers",
    )
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After of 503 answers")
    capture_usage: bool = Field(
        default=True, description="request usage upstream on streams to measure engine cache hits"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="log level"
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
    index: IndexConfig = Field(default_factory=lambda: IndexConfig.model_validate({}))
    scoring: KvPolicyConfig = Field(default_factory=lambda: KvPolicyConfig.model_validate({}))

    @field_validator("workers", "api_keys", "worker_allow", mode="before")
    @classmethod
    def _lists(cls, value: Any) -> Any:
        return _split_words(value)

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

    def tokenizer_for(self, model: str) -> str | None:
        return self.tokenizers.get(model, self.tokenizers.get("*"))

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


def load_settings(
    config_file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Build the settings from defaults, the YAML file, ``KVGATE_*`` env vars and ``overrides``.

    Raises ``ConfigError`` naming each invalid field.
    """
    settings_cls: type[Settings] = Settings
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"invalid configuration:\n  --config: no such file {str(path)!r}")
        config = SettingsConfigDict(**{**Settings.model_config, "yaml_file": path})
        settings_cls = type("Settings", (Settings,), {"model_config": config})
    try:
        return settings_cls(**dict(overrides or {}))
    except pydantic.ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc
    except (msgspec.DecodeError, yaml.YAMLError, SettingsError, ValueError) as exc:
        raise ConfigError(redact(f"invalid configuration: {exc}")) from exc
