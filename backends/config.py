"""Configuration of the backends layer: one engine replica (``WorkerConfig``) and the health
checks and load scraping of every replica (``HealthConfig``).

A worker can be written as a mapping or in the compact CLI form
``URL[,engine=vllm][,role=prefill|decode|both][,bootstrap_port=N][,models=a;b]
[,events=tcp://...][,replay=tcp://...][,dp_size=N][,api_key=...]``.
A worker URL's ``user:password@`` becomes its HTTP Basic credentials and leaves the URL (the
worker's id, shown everywhere), so it cannot be displayed; keys live in ``SecretStr`` fields,
refused when empty and never echoed in errors.
"""

from __future__ import annotations

import re
from base64 import b64encode
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from kvgate.index.types import WorkerId

EngineKind = Literal["vllm", "sglang", "trtllm", "openai"]
WorkerRole = Literal["prefill", "decode", "both"]
"""A worker's part in a disaggregated fleet: ``prefill`` workers run the prefill leg of a
request, ``decode`` workers its decode leg; ``both`` (the default) serve whole requests."""

_WORKER_KEYS = {
    "engine", "role", "bootstrap_port", "models", "events", "replay", "dp_size", "api_key",
}  # fmt: skip
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
MAX_DP_SIZE = 256  # data-parallel ranks of one engine (a subscription and a task each)
_USERINFO = re.compile(r"(?<=://)[^/@\s'\"]*@")
_KEY_VALUE = re.compile(r"(?i)((?:api_?key|token|password|secret)\w*\s*[=:]\s*)[^,\s'\"}]+")
_TCP_PORT = re.compile(r"tcp://.+:[0-9]{1,5}")
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
    engine: EngineKind = Field(
        default="vllm", description="engine kind: vllm | sglang | trtllm | openai"
    )
    role: WorkerRole = Field(
        default="both",
        description="prefill | decode | both: its part in a prefill/decode disaggregated "
        "fleet (docs/pd.md); both: it serves whole requests",
    )
    bootstrap_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="a prefill worker speaking SGLang's bootstrap protocol: its "
        "--disaggregation-bootstrap-port (an sglang prefill worker without it: 8998)",
    )
    models: list[str] | None = Field(
        default=None, description="models it serves; discovered from its /v1/models when not given"
    )
    events: str | None = Field(
        default=None, description="KV events ZMQ PUB endpoint (tcp://host:port)"
    )
    replay: str | None = Field(default=None, description="KV events replay ZMQ ROUTER endpoint")
    dp_size: int = Field(
        default=1,
        ge=1,
        le=MAX_DP_SIZE,
        description="data-parallel ranks of the engine (vLLM --data-parallel-size, SGLang "
        "--dp-size): rank r publishes KV events on the events and replay ports + r, and "
        "kvgate picks the rank of each request (X-data-parallel-rank)",
    )
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

    @model_validator(mode="after")
    def _ranks_on_tcp(self) -> WorkerConfig:
        if self.dp_size > 1:
            for endpoint in (self.events, self.replay):
                if endpoint is None:
                    continue
                if not _TCP_PORT.fullmatch(endpoint):
                    raise ValueError(
                        "dp_size > 1 needs tcp://host:port event endpoints (rank r: port + r)"
                    )
                if int(endpoint.rpartition(":")[2]) + self.dp_size - 1 > 65535:
                    raise ValueError("an event port + dp_size - 1 exceeds 65535")
        return self

    def rank_endpoint(self, endpoint: str, dp_rank: int) -> str:
        """``endpoint`` of rank ``dp_rank``: its port + the rank (as vLLM and SGLang offset)."""
        if dp_rank == 0:
            return endpoint
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + dp_rank}"

    @property
    def id(self) -> WorkerId:
        return WorkerId(self.url)

    @property
    def bootstrap(self) -> tuple[str, int] | None:
        """Where a decode worker fetches this prefill worker's KV by SGLang's bootstrap
        protocol (host, port); None: it speaks vLLM's ``kv_transfer_params``."""
        if self.bootstrap_port is None and self.engine != "sglang":
            return None
        host = urlsplit(self.url).hostname or ""
        return host, self.bootstrap_port or SGLANG_BOOTSTRAP_PORT

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

    interval_s: float = Field(
        default=2.0,
        gt=0,
        description="seconds between GET /health probes: lower it to notice a dead engine sooner",
    )
    timeout_s: float = Field(default=1.0, gt=0, description="timeout of one probe or scrape")
    failure_threshold: int = Field(
        default=3,
        ge=1,
        description="consecutive failures (probes or 5xx) before a worker is taken out: raise "
        "it on a flaky network",
    )
    recovery_threshold: int = Field(
        default=1, ge=1, description="consecutive successful probes before it is healthy again"
    )
    metrics_interval_s: float = Field(
        default=1.0,
        ge=0,
        description="seconds between scrapes of each engine's /metrics (its waiting queue and KV "
        "usage): lower it for fresher load figures; 0: never scrape",
    )
    models_interval_s: float = Field(
        default=10.0,
        ge=0,
        description="seconds between re-reads of each healthy worker's /v1/models and engine "
        "facts (adapters loaded or unloaded at run time; 0: only when it becomes healthy or "
        "answers 404 for a model it listed)",
    )
    models_max_bytes: int = Field(
        default=1 << 20, gt=0, description="largest /v1/models answer read from a worker"
    )
    models_max_entries: int = Field(
        default=4096, gt=0, description="most models (adapters included) taken from one worker"
    )
