"""Configuration of a simulated fleet: engine, timing, KV events and start-up faults.

Defaults model Llama-3.1-8B (bf16) on one H100 80GB SXM served by vLLM; the derivation of
every figure is in docs/simulator.md ("Calibration").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

EventEncoding = Literal["map", "array"]
HashFormat = Literal["int", "bytes"]
SourcesFormat = Literal["object", "list"]
StreamOpen = Literal["at_accept", "at_first_token"]
EngineKind = Literal["vllm", "trtllm"]
OwnedBy = Literal["vllm", "sglang"]
PrefillMode = Literal["chunked", "serial"]


class ConfigError(ValueError):
    """An invalid simulator setting; the message names the setting."""


@dataclass(frozen=True, slots=True)
class TimingConfig:
    """Step-time model of one replica (wall seconds are these divided by ``speedup``).

    One engine step costs ``max(step_floor_ms, tokens * token_us)`` (weights read once per
    step vs. the linear layers' compute), plus prefill attention ``prefill_attn_ns`` per
    (prefill token x earlier token of its sequence), plus ``decode_kv_ns`` per cached token
    read by each decoding sequence, plus ``cpu_load_us_per_token`` per token brought back
    from the CPU tier.
    """

    step_floor_ms: float = 6.0
    token_us: float = 30.0
    prefill_attn_ns: float = 1.0
    decode_kv_ns: float = 49.0
    cpu_load_us_per_token: float = 5.2
    speedup: float = 1.0
    catch_up_ms: float = 50.0
    """Wall milliseconds a replica may run behind its model (its steps begun late: the
    simulator's own work per step, timer slack, a busy loop) and make up by shortening the
    steps after; time behind past it is lost, counted by ``kvgate_sim_late_seconds_total``."""

    def validate(self) -> None:
        for name in ("step_floor_ms", "token_us", "prefill_attn_ns", "decode_kv_ns"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.cpu_load_us_per_token < 0:
            raise ConfigError("cpu_load_us_per_token must be >= 0")
        if not self.speedup > 0:
            raise ConfigError("speedup must be > 0")
        if self.catch_up_ms < 0:
            raise ConfigError("catch_up_ms must be >= 0")


@dataclass(frozen=True, slots=True)
class LoraModule:
    """A LoRA adapter served from the start (vLLM's ``--lora-modules name=path``)."""

    name: str
    path: str

    @classmethod
    def parse(cls, spec: str) -> LoraModule:
        """``NAME`` or ``NAME=PATH`` (the path defaults to the name)."""
        name, _, path = spec.partition("=")
        return cls(name.strip(), path.strip() or name.strip())


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler and KV-cache settings of one replica (vLLM names where vLLM has them)."""

    model: str = "kvgate-sim"
    block_size: int = 16
    capacity_blocks: int = 27_000
    cpu_offload_blocks: int = 0
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    prefill_mode: PrefillMode = "chunked"
    """``chunked``: every step fills its token budget with prefill chunks of as many
    requests as fit (vLLM v1 with chunked prefill); ``serial``: at most one request prefills
    per step, first come first served, so a newcomer waits for every prefill queued ahead
    (vLLM when one long prefill holds the token budget). Decodes batch alongside in both."""
    max_model_len: int = 131_072
    default_max_tokens: int = 64
    """Output length when a chat request gives no ``max_tokens`` (completions default: 16)."""
    lora_modules: tuple[LoraModule, ...] = ()
    """Adapters served from the start; more come and go through ``/v1/load_lora_adapter``."""

    @property
    def effective_max_model_len(self) -> int:
        """``max_model_len`` capped so that one request always fits in the GPU cache."""
        return min(self.max_model_len, self.capacity_blocks * self.block_size)

    def validate(self) -> None:
        if not self.model:
            raise ConfigError("model must not be empty")
        positive = ("block_size", "capacity_blocks", "max_num_seqs", "max_num_batched_tokens")
        for name in (*positive, "max_model_len", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.cpu_offload_blocks < 0:
            raise ConfigError("cpu_offload_blocks must be >= 0")
        if self.prefill_mode not in ("chunked", "serial"):
            raise ConfigError("prefill_mode must be 'chunked' or 'serial'")
        names = [m.name for m in self.lora_modules]
        if any(not n for n in names) or any(not m.path for m in self.lora_modules):
            raise ConfigError("every LoRA adapter needs a name and a path")
        if len(set(names)) != len(names) or self.model in names:
            raise ConfigError("LoRA adapter names must be unique and differ from the model")


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """Behaviour of the OpenAI server in front of the engine."""

    stream_open: StreamOpen = "at_accept"
    """``at_accept``: a streaming response's ``200`` and headers go out as soon as the request
    is accepted, before it queues and prefills (vLLM); ``at_first_token``: with the first
    token, so a failure before it is an HTTP error status."""
    responses_store: int = 10_000
    """Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}`` (0: none,
    like vLLM without ``VLLM_ENABLE_RESPONSES_API_STORE``; vLLM's store is unbounded)."""
    responses_store_bytes: int = 256 * 1024 * 1024
    """The store also keeps at most this many bytes of conversation text (each response is
    counted with its whole conversation)."""
    engine_kind: EngineKind = "vllm"
    """The server the replica presents: ``vllm``, or ``trtllm`` (trtllm-serve: its Prometheus
    gauges at ``/prometheus/metrics``, JSON iteration stats at ``/metrics``,
    ``/health_generate``; no ``/tokenize``, renderer nor ``/kv_event_sources``; the
    data-parallel rank header is ignored). The engine and its KV events are the same."""
    owned_by: OwnedBy = "vllm"
    """The engine ``/v1/models`` names as the models' owner. Routers tell engines apart by it:
    smg speaks SGLang's disaggregation protocol (bootstrap host, port and room; both legs at
    once), which the simulator serves too, only to workers owned by ``sglang``."""

    def validate(self) -> None:
        if self.stream_open not in ("at_accept", "at_first_token"):
            raise ConfigError("stream_open must be 'at_accept' or 'at_first_token'")
        if self.engine_kind not in ("vllm", "trtllm"):
            raise ConfigError("engine_kind must be 'vllm' or 'trtllm'")
        if self.owned_by not in ("vllm", "sglang"):
            raise ConfigError("owned_by must be 'vllm' or 'sglang'")
        if self.responses_store < 0 or self.responses_store_bytes < 0:
            raise ConfigError("responses_store and responses_store_bytes must be >= 0")


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV-event publishing, as vLLM's ``--kv-events-config`` with the ZMQ publisher."""

    encoding: EventEncoding = "map"
    topic: str = "kv-events"
    buffer_steps: int = 10_000
    buffer_bytes: int = 64 * 1024 * 1024
    """The replay ring also keeps at most this many payload bytes (long prompts make big
    batches; vLLM bounds the ring by steps only)."""
    hwm: int = 100_000
    hash_format: HashFormat = "int"
    sources_format: SourcesFormat = "object"
    """``GET /kv_event_sources``: ``object`` = {"0": config} (vLLM 0.32), ``list`` = the bare
    array of {data_parallel_rank, endpoint, replay_endpoint, topic} of newer vLLM."""

    def validate(self) -> None:
        if self.encoding not in ("map", "array"):
            raise ConfigError("event encoding must be 'map' or 'array'")
        if self.hash_format not in ("int", "bytes"):
            raise ConfigError("hash format must be 'int' or 'bytes'")
        if self.sources_format not in ("object", "list"):
            raise ConfigError("kv_event_sources format must be 'object' or 'list'")
        if self.buffer_steps < 0 or self.buffer_bytes < 0 or self.hwm < 0:
            raise ConfigError("buffer_steps, buffer_bytes and hwm must be >= 0")


@dataclass(frozen=True, slots=True)
class StartupFaults:
    """Faults every replica starts with (``--fail-rate`` ...); 0 means off."""

    fail_rate: float = 0.0
    drop_events_rate: float = 0.0
    event_delay_s: float = 0.0
    slowdown: float = 1.0
    prefill_slowdown: float = 1.0

    def validate(self) -> None:
        for name in ("fail_rate", "drop_events_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be within 0..1")
        if self.event_delay_s < 0:
            raise ConfigError("event_delay_s must be >= 0")
        if not (self.slowdown > 0 and self.prefill_slowdown > 0):
            raise ConfigError("slowdown and prefill_slowdown must be > 0")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A fleet of ``replicas`` replicas in one process: replicas ``first_replica`` to
    ``first_replica + replicas - 1`` of a fleet that may be split over several processes.

    Ports: replica i serves HTTP on ``port + i`` and publishes KV events on
    ``events_port + 2 i`` with its replay socket on ``events_port + 2 i + 1``. Port 0 means
    ephemeral ports for every replica (tests). A replica's seeds (outputs, hashes, faults)
    depend on its index, not on the process it runs in.

    With ``dp_size`` D > 1 each replica is one server over D data-parallel ranks (each its
    own engine and cache, as vLLM ``--data-parallel-size``): rank r of replica i publishes on
    ``events_port + 2 D i + r`` and replays on ``events_port + 2 D i + D + r`` (the engines'
    base port + rank), and a request goes to the rank its ``X-data-parallel-rank`` header
    names, else to the least loaded rank.
    """

    replicas: int = 4
    first_replica: int = 0
    host: str = "127.0.0.1"
    port: int = 9001
    events_port: int = 5557
    seed: int = 0
    dp_size: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)
    timing: TimingConfig = field(default_factory=TimingConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    faults: StartupFaults = field(default_factory=StartupFaults)
    api: ApiConfig = field(default_factory=ApiConfig)

    def validate(self) -> None:
        if self.replicas < 1:
            raise ConfigError("replicas must be >= 1")
        if not 1 <= self.dp_size <= 64:
            raise ConfigError("dp_size must be within 1..64")
        if self.first_replica < 0:
            raise ConfigError("first_replica must be >= 0")
        last = self.first_replica + self.replicas - 1
        for name in ("port", "events_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"{name} must be within 0..65535")
        if self.port and self.port + last > 65535:
            raise ConfigError("port + last replica's index exceeds 65535")
        if self.events_port and self.replay_port(last, self.dp_size - 1) > 65535:
            raise ConfigError("the last replica's last event port exceeds 65535")
        self.engine.validate()
        self.timing.validate()
        self.events.validate()
        self.faults.validate()
        self.api.validate()

    @property
    def indices(self) -> range:
        """The indices of this process's replicas."""
        return range(self.first_replica, self.first_replica + self.replicas)

    def http_port(self, index: int) -> int:
        return self.port + index if self.port else 0

    def pub_port(self, index: int, dp_rank: int = 0) -> int:
        return self.events_port + 2 * self.dp_size * index + dp_rank if self.events_port else 0

    def replay_port(self, index: int, dp_rank: int = 0) -> int:
        if not self.events_port:
            return 0
        return self.events_port + 2 * self.dp_size * index + self.dp_size + dp_rank
