"""Per-engine adapters: where each engine kind keeps its load metrics and endpoints.

``vllm``, ``sglang`` and ``trtllm`` expose Prometheus gauges for running/waiting requests
and KV-cache usage; a plain ``openai`` endpoint exposes nothing, so only kvgate's own predicted
load counts for it. Health: vLLM's and TensorRT-LLM's ``/health`` are cheap; SGLang's runs a
one-token generation and sleeps a second before it answers, so SGLang is probed on ``/ready``
(startup done, healthy, not paused), and on ``/health`` with a longer timeout only where
``/ready`` does not exist. TensorRT-LLM's Prometheus page is ``/prometheus/metrics`` (its
``/metrics`` is a JSON list of iteration stats) and states its KV block size and capacity as
gauge values (``trtllm_kv_cache_tokens_per_block``, ``trtllm_kv_cache_max_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvgate.backends.config import EngineKind
from kvgate.index.errors import JsonDecodeError
from kvgate.index.jsonsafe import decode_json


@dataclass(frozen=True, slots=True)
class ScrapedLoad:
    """Load read from one scrape of an engine's /metrics (``None``: not exported)."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    kv_capacity_blocks: int | None = None  # GPU KV blocks per engine (smallest over ranks)
    # per data-parallel rank (its series' rank label): running + waiting requests there
    rank_queues: tuple[tuple[int, int], ...] = ()

    def rank_queue(self, dp_rank: int) -> int | None:
        """Requests running or waiting on one data-parallel rank (None: not reported)."""
        for rank, queued in self.rank_queues:
            if rank == dp_rank:
                return queued
        return None


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """Settings of an engine that kvgate's keys depend on, as the engine declares them
    (``None``: not declared)."""

    block_size: int | None = None
    kv_capacity_blocks: int | None = None  # its KV pool in blocks (SGLang's server info)


@dataclass(frozen=True, slots=True)
class EngineAdapter:
    """What kvgate needs to know about one engine kind."""

    kind: EngineKind
    running_metrics: tuple[str, ...] = ()
    waiting_metrics: tuple[str, ...] = ()
    kv_usage_metrics: tuple[str, ...] = ()  # first present wins; values in 0..1
    # an info metric and its label carrying the engine's KV capacity in blocks
    kv_capacity_info: tuple[str, str] | None = None
    # an info metric and its label carrying the engine's KV block size in tokens
    block_size_info: tuple[str, str] | None = None
    # or gauges whose value is the KV block size in tokens / the KV capacity in blocks
    block_size_gauge: str | None = None
    kv_capacity_gauge: str | None = None
    # else a JSON document of its settings and the key of the block size there
    server_info: tuple[str, str] | None = None
    server_info_legacy_path: str | None = None  # asked only where server_info's path is 404
    capacity_tokens_key: str | None = None  # the KV pool in tokens in that document
    health_path: str = "/health"
    # where health_path is 404 (an older engine): this path, with at least this timeout
    health_fallback: tuple[str, float] | None = None
    models_path: str = "/v1/models"
    metrics_path: str | None = "/metrics"
    tokenize_path: str | None = None  # POST {"model", "prompt"|"messages"} -> {"tokens": [...]}
    tokenize_accepts_messages: bool = False  # applies its own chat template
    # the label of its load series naming the data-parallel rank (vLLM: engine="0")
    rank_label: str | None = None
    # it sends a request to the data-parallel rank its X-data-parallel-rank header names
    # (else kvgate cannot choose the rank, and credits a worker its best rank's prefix)
    targets_dp_rank: bool = True

    @property
    def declares_facts_in_metrics(self) -> bool:
        """Its block size is read from its Prometheus page."""
        has_fact = self.block_size_info is not None or self.block_size_gauge is not None
        return has_fact and self.metrics_path is not None

    @property
    def scrapes_load(self) -> bool:
        return self.metrics_path is not None and bool(
            self.running_metrics or self.waiting_metrics or self.kv_usage_metrics
        )

    def parse_load(self, text: str) -> ScrapedLoad:
        """Sum running/waiting over every series and average KV usage (several engines/ranks).

        Only the lines of the wanted metrics are handed to the Prometheus parser, so a
        large /metrics page (histograms) costs a few string scans, not a full parse.
        """
        info = self.kv_capacity_info
        gauge = self.kv_capacity_gauge
        wanted = (*self.running_metrics, *self.waiting_metrics, *self.kv_usage_metrics)
        if info is not None:
            wanted = (*wanted, info[0])
        if gauge is not None:
            wanted = (*wanted, gauge)
        lines = [line for line in text.splitlines() if line.startswith(wanted)]
        values: dict[str, list[float]] = {}
        capacities: list[int] = []
        queues: dict[int, float] = {}
        queue_metrics = (*self.running_metrics[:1], *self.waiting_metrics[:1])
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                values.setdefault(sample.name, []).append(sample.value)
                if sample.name in queue_metrics and self.rank_label is not None:
                    _add_rank_queue(queues, sample.labels.get(self.rank_label), sample.value)
                if info is not None and sample.name == info[0]:
                    capacities += _positive_int(sample.labels.get(info[1]))
                elif sample.name == gauge:
                    capacities += _positive_value(sample.value)
        running = _first_sum(values, self.running_metrics)
        waiting = _first_sum(values, self.waiting_metrics)
        usage = _first_mean(values, self.kv_usage_metrics)
        return ScrapedLoad(
            running=None if running is None else round(running),
            waiting=None if waiting is None else round(waiting),
            kv_usage=usage,
            kv_capacity_blocks=min(capacities) if capacities else None,
            rank_queues=tuple(sorted((r, round(q)) for r, q in queues.items()))
            if len(queues) > 1
            else (),
        )

    def parse_facts(self, text: str) -> EngineFacts:
        """The engine facts of a /metrics page: the block size of its info metric (several
        ranks: they must agree, else none is taken)."""
        info, gauge = self.block_size_info, self.block_size_gauge
        name = info[0] if info is not None else gauge
        if name is None:
            return EngineFacts()
        lines = [line for line in text.splitlines() if line.startswith(name)]
        sizes: set[int] = set()
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name != name:
                    continue
                if info is not None:
                    sizes.update(_positive_int(sample.labels.get(info[1])))
                else:
                    sizes.update(_positive_value(sample.value))
        return EngineFacts(block_size=sizes.pop() if len(sizes) == 1 else None)

    def parse_server_info(self, content: bytes) -> EngineFacts:
        """The engine facts of its settings document (SGLang: ``page_size`` and
        ``max_total_num_tokens`` in ``/server_info``); nothing usable: none."""
        if self.server_info is None:
            return EngineFacts()
        try:
            settings = decode_json(content)
        except JsonDecodeError:
            return EngineFacts()
        if not isinstance(settings, dict):
            return EngineFacts()
        size = _positive(settings.get(self.server_info[1]))
        tokens = _positive(settings.get(self.capacity_tokens_key or ""))
        blocks = tokens // size if size is not None and tokens is not None else None
        return EngineFacts(block_size=size, kv_capacity_blocks=blocks or None)


def _positive(value: object) -> int | None:
    """A JSON value that is a positive int, else None."""
    usable = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if usable and isinstance(value, int) else None


def _positive_int(label: str | None) -> list[int]:
    """A label's value as a positive int, or nothing (absent, ``None``, garbage)."""
    if label is None or not label.isdigit() or int(label) <= 0:
        return []
    return [int(label)]


def _positive_value(value: float) -> list[int]:
    """A gauge's value as a positive whole number, or nothing (NaN, fraction, <= 0)."""
    if not 0 < value < 1 << 62 or value != int(value):
        return []
    return [int(value)]


_MAX_RANKS = 256  # ranks read from one page (its rank labels are the engine's to choose)


def _add_rank_queue(queues: dict[int, float], label: str | None, value: float) -> None:
    """Count ``value`` for the rank a series' label names (a rank number; else nothing)."""
    if label is None or not label.isdigit() or not 0 <= value < 1 << 31:
        return
    rank = int(label)
    if rank in queues or len(queues) < _MAX_RANKS:
        queues[rank] = queues.get(rank, 0.0) + value


def _first_sum(values: dict[str, list[float]], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in values:
            return sum(values[name])
    return None


def _first_mean(values: dict[str, list[float]], names: tuple[str, ...]) -> float | None:
    for name in names:
        if values.get(name):
            return sum(values[name]) / len(values[name])
    return None


VLLM = EngineAdapter(
    kind="vllm",
    running_metrics=("vllm:num_requests_running",),
    waiting_metrics=("vllm:num_requests_waiting",),
    # vLLM V0 named it gpu_cache_usage_perc; both are fractions in 0..1.
    kv_usage_metrics=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    kv_capacity_info=("vllm:cache_config_info", "num_gpu_blocks"),
    block_size_info=("vllm:cache_config_info", "block_size"),
    rank_label="engine",  # each data-parallel rank's series: engine="<rank>"
    tokenize_path="/tokenize",
    tokenize_accepts_messages=True,
)

SGLANG = EngineAdapter(
    kind="sglang",
    running_metrics=("sglang:num_running_reqs",),
    waiting_metrics=("sglang:num_queue_reqs",),
    kv_usage_metrics=("sglang:token_usage",),
    server_info=("/server_info", "page_size"),
    server_info_legacy_path="/get_server_info",  # before /server_info (deprecated since)
    capacity_tokens_key="max_total_num_tokens",
    health_path="/ready",
    health_fallback=("/health", 5.0),  # SGLang's /health sleeps 1 s, then waits for a token
    tokenize_path="/tokenize",
    tokenize_accepts_messages=True,
)

# trtllm-serve (TensorRT-LLM): Prometheus gauges at /prometheus/metrics (with
# return_perf_metrics on), a cheap /health (its /health_generate generates), no /tokenize, and
# its attention-DP ranks are scheduled by the engine itself (no per-request rank).
TRTLLM = EngineAdapter(
    kind="trtllm",
    running_metrics=("trtllm_num_requests_running",),
    waiting_metrics=("trtllm_num_requests_waiting",),
    kv_usage_metrics=("trtllm_kv_cache_utilization",),
    kv_capacity_gauge="trtllm_kv_cache_max_blocks",
    block_size_gauge="trtllm_kv_cache_tokens_per_block",
    metrics_path="/prometheus/metrics",
    targets_dp_rank=False,
)

# A generic OpenAI-compatible server may lack /health: its model list doubles as the probe.
OPENAI = EngineAdapter(kind="openai", metrics_path=None, health_path="/v1/models")


def adapter_for(kind: EngineKind) -> EngineAdapter:
    match kind:
        case "vllm":
            return VLLM
        case "sglang":
            return SGLANG
        case "trtllm":
            return TRTLLM
        case "openai":
            return OPENAI
