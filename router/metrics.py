"""The gateway's Prometheus metrics (``kvgate_*``), created on an injected registry.

Per-worker gauges (in-flight, health, predicted and scraped load) are read from the
``WorkerRegistry`` at scrape time by a collector, so the request path never updates them.
Labelled series of a removed worker are dropped (``forget_worker``): adding and removing
workers does not grow /metrics. The series per (worker, model) are bounded too: each worker
label carries at most ``MAX_MODEL_LABELS`` models of its own (its base models first), the
rest share ``model="_other"`` (``kvgate_worker_models_unlabelled`` counts them), so a worker
listing thousands of adapters does not make the page thousands of times longer.

``MetricsPage`` renders /metrics off the event loop, one render shared by the scrapes that
arrive while it runs.
"""

from __future__ import annotations

import asyncio
import itertools
import platform
from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvgate.backends.registry import WorkerRegistry
from kvgate.index.memo import BoundedMemo
from kvgate.router.commit import FOLLOWS_REQUEST, RETRY_REASONS, STREAM_ERROR_REASONS
from kvgate.scheduling.guard import AUDITED, GUARDED, Settled
from kvgate.scheduling.ledger import Ledger

_MAX_CACHED_ROUTES = 4096  # (worker, model) pairs whose labelled children are kept at hand
MAX_MODEL_LABELS = 32
"""Models with series of their own per worker label (about 75 lines each); the others share
``OTHER_MODELS``."""
OTHER_MODELS = "_other"
REMOVED = "removed"  # the worker label of requests that end after their worker was removed
LIMITS = (
    "header_timeout",  # a client took too long to send a request head (408)
    "request_head",  # a request head over its bytes or header lines (431)
    "request_url",  # a request target over its bytes (414)
    "body_timeout",  # ... or its body (408)
    "request_bytes",  # a request body over max_body_bytes (413)
    "connections",  # a request on a connection beyond client.max_connections (503)
    "response_deadline",  # an exchange with engines over upstream.response_timeout_s (504)
    "upstream_response_bytes",  # a non-streamed answer over upstream.max_response_bytes (502)
    "upstream_head",  # an engine's response head over its bytes or header lines (retried)
)
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
_ERROR_BUCKETS = (
    -10.0, -3.0, -1.0, -0.3, -0.1, -0.03, -0.01, 0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0,
)  # fmt: skip
_OVERHEAD_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1,
)  # fmt: skip


class GatewayMetrics:
    """Request, latency, failover and cache-hit metrics of the gateway."""

    def __init__(self, registry: CollectorRegistry, *, native_core: bool = True) -> None:
        self.requests = Counter(
            "kvgate_requests",
            "Requests answered, by worker (none: not routed), model and HTTP status",
            ["worker", "model", "status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_token_seconds",
            "Gateway time from request received to the first response body byte",
            ["worker", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "kvgate_request_duration_seconds",
            "Gateway time from request received to the last response byte",
            ["worker", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            "kvgate_router_overhead_seconds",
            "Time from request received to the upstream request being sent",
            buckets=_OVERHEAD_BUCKETS,
            registry=registry,
        )
        self.retries = Counter(
            "kvgate_upstream_retries",
            "Attempts that failed before the first token and were retried on another worker, "
            "by the failed worker and reason",
            ["worker", "reason"],
            registry=registry,
        )
        self.request_faults = Counter(
            "kvgate_upstream_request_faults",
            "Requests two workers failed alike before the first token (a 5xx, an error "
            "event): taken as the request's fault, not retried further and charged to no "
            "worker's health, by reason",
            ["reason"],
            registry=registry,
        )
        for reason in FOLLOWS_REQUEST:
            self.request_faults.labels(reason)
        self.stream_errors = Counter(
            "kvgate_stream_errors",
            "Streams that ended with an error event after their first token (the client must "
            "retry), by worker and reason",
            ["worker", "reason"],
            registry=registry,
        )
        self.dp_rank_attempts = Counter(
            "kvgate_dp_rank_attempts",
            "Attempts sent to a data-parallel rank of a worker that has several (the rank "
            "kvgate chose, sent as X-data-parallel-rank), by worker and rank",
            ["worker", "dp_rank"],
            registry=registry,
        )
        self.failovers = Counter(
            "kvgate_failovers",
            "Requests answered by a worker other than the policy's first choice",
            ["worker", "model"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens",
            "Prompt tokens of answered requests (engine usage when reported, else kvgate's count)",
            ["worker", "model"],
            registry=registry,
        )
        self.predicted_cached = Counter(
            "kvgate_predicted_cached_tokens",
            "Prompt tokens kvgate predicted cached on the chosen worker (matched blocks x size)",
            ["worker", "model"],
            registry=registry,
        )
        self.engine_cached = Counter(
            "kvgate_engine_cached_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
            ["worker", "model"],
            registry=registry,
        )
        self.best_available_cached = Counter(
            "kvgate_best_available_cached_tokens",
            "Best predicted cached prompt tokens over every eligible worker of the request",
            ["worker", "model"],
            registry=registry,
        )
        self.output_tokens = Counter(
            "kvgate_output_tokens",
            "Output tokens of answered requests (engine usage when reported, else the "
            "stream's content events)",
            ["worker", "model"],
            registry=registry,
        )
        self.tpot = Histogram(
            "kvgate_time_per_output_token_seconds",
            "Mean inter-token latency of each streamed answer: (last byte - first byte) / "
            "(output tokens - 1)",
            ["worker", "model"],
            buckets=_TPOT_BUCKETS,
            registry=registry,
        )
        self.limits = Counter(
            "kvgate_limits_exceeded",
            "Requests and connections cut by a limit (see docs/security.md), by limit",
            ["limit"],
            registry=registry,
        )
        self._limits = {name: self.limits.labels(name) for name in LIMITS}
        self.build = Info(
            "kvgate_build", "kvgate's version, Python and index core", registry=registry
        )
        self.build.info(build_labels(native_core=native_core))

        self.ttft_error = Histogram(
            "kvgate_ttft_prediction_error_seconds",
            "Measured minus predicted time to first token (from dispatch) of answered streamed "
            "requests, by worker: > 0 when the worker's learned model was optimistic",
            ["worker"],
            buckets=_ERROR_BUCKETS,
            registry=registry,
        )

        self.mechanism_moves = Counter(
            "kvgate_mechanism_moves",
            "Settled requests a mechanism moved off the worker its price or its cache pointed "
            "to, or held back (docs/scoring.md, Do no harm), by part ('price': load traded "
            "for cache)",
            ["part"],
            registry=registry,
        )
        self.mechanism_gain = Counter(
            "kvgate_mechanism_gain_seconds",
            "Seconds of TTFT those moves saved against the prediction where they were moved "
            "off (moves that paid)",
            ["part"],
            registry=registry,
        )
        self.mechanism_loss = Counter(
            "kvgate_mechanism_loss_seconds",
            "Seconds those moves cost (moves that did not pay, the cache they gave up included)",
            ["part"],
            registry=registry,
        )
        self.mechanism_turned_off = Counter(
            "kvgate_mechanism_turned_off",
            "Times the guard turned a mechanism off on a worker (it lost more than it gained "
            "over its recent moves there)",
            ["part"],
            registry=registry,
        )
        for part in AUDITED:  # every series from the start, at 0
            for counter in (self.mechanism_moves, self.mechanism_gain, self.mechanism_loss):
                counter.labels(part)
            if part in GUARDED:
                self.mechanism_turned_off.labels(part)

        self.pd_legs = Counter(
            "kvgate_pd_legs",
            "Legs of disaggregated requests (docs/pd.md), by leg (prefill, decode) and "
            "outcome (ok, failed; a prefill leg also skipped: prefilled on the decode worker)",
            ["leg", "outcome"],
            registry=registry,
        )
        for leg, outcome in (("prefill", "ok"), ("prefill", "failed"), ("prefill", "skipped")):
            self.pd_legs.labels(leg, outcome)
        for outcome in ("ok", "failed"):
            self.pd_legs.labels("decode", outcome)
        self.pd_transferred = Counter(
            "kvgate_pd_transferred_tokens",
            "Prompt tokens of disaggregated requests predicted sent from a prefill worker to a "
            "decode worker (the blocks the decode worker lacked)",
            registry=registry,
        )
        self.pd_prefill_predicted = Counter(
            "kvgate_pd_prefill_predicted_cached_tokens",
            "Prompt tokens kvgate predicted cached on the prefill worker of a prefill leg",
            ["worker"],
            registry=registry,
        )
        self.pd_prefill_engine_cached = Counter(
            "kvgate_pd_prefill_engine_cached_tokens",
            "Prompt tokens a prefill worker reported cached for its prefill legs",
            ["worker"],
            registry=registry,
        )

        self._routes: BoundedMemo[tuple[str, str], RouteMetrics] = BoundedMemo(_MAX_CACHED_ROUTES)
        # per worker label (workers, "none", "removed"), the models with series of their own
        self._labelled: dict[str, set[str]] = {}

    def declare_worker(self, worker: str, models: Iterable[str]) -> None:
        """Start ``worker``'s series at zero for each model it serves, in the order given,
        up to ``MAX_MODEL_LABELS`` (a dashboard shows 0, not "no data", before its first
        request); its retries and stream errors by reason too."""
        for model in itertools.islice(dict.fromkeys(models), MAX_MODEL_LABELS):
            self.route(worker, model).declare()
        for reason in RETRY_REASONS:
            self.retries.labels(worker, reason)
        for reason in STREAM_ERROR_REASONS:
            self.stream_errors.labels(worker, reason)
        self.pd_prefill_predicted.labels(worker)
        self.pd_prefill_engine_cached.labels(worker)
        self.ttft_error.labels(worker)

    def mechanism_settled(self, settled: Settled) -> None:
        """A move settled (``scheduling.guard``): its net gain or loss, by part."""
        part = settled.part
        self.mechanism_moves.labels(part).inc()
        if settled.net_s >= 0.0:
            self.mechanism_gain.labels(part).inc(settled.net_s)
        else:
            self.mechanism_loss.labels(part).inc(-settled.net_s)
        if settled.turned_off:
            self.mechanism_turned_off.labels(part).inc()

    def limit_exceeded(self, limit: str) -> None:
        self._limits[limit].inc()

    def forget_worker(self, worker: str) -> None:
        """Drop every series labelled with ``worker`` (it was removed)."""
        self._routes.forget_where(lambda key: key[0] == worker)
        self._labelled.pop(worker, None)
        forget_series(vars(self).values(), worker)

    def route(self, worker: str, model: str) -> RouteMetrics:
        """The labelled children of one (worker, model) pair, looked up once and kept (the
        model's own, or ``OTHER_MODELS``' past the worker's ``MAX_MODEL_LABELS``)."""
        found = self._routes.get((worker, model))
        if found is None:
            label = self._model_label(worker, model)
            shared = self._routes.get((worker, label)) if label != model else None
            found = shared if shared is not None else RouteMetrics(self, worker, label)
            self._routes.put((worker, model), found)
        return found

    def _model_label(self, worker: str, model: str) -> str:
        labelled = self._labelled.setdefault(worker, set())
        if model not in labelled:
            if len(labelled) >= MAX_MODEL_LABELS:
                return OTHER_MODELS
            labelled.add(model)
        return model

    def unlabelled(self, worker: str, models: Iterable[str]) -> int:
        """How many of ``models`` have no series of their own under ``worker``."""
        labelled = self._labelled.get(worker, set())
        return sum(1 for model in models if model not in labelled)


class RouteMetrics:
    """Pre-labelled metrics of one (worker, model) pair: the request path's hot counters."""

    __slots__ = (
        "_labels", "_requests", "_statuses", "best_available_cached", "e2e", "engine_cached",
        "failovers", "output_tokens", "predicted_cached", "prompt_tokens", "tpot", "ttft",
    )  # fmt: skip

    def __init__(self, metrics: GatewayMetrics, worker: str, model: str) -> None:
        self._requests = metrics.requests
        self._statuses: dict[str, Any] = {}
        labels = (worker, model)
        self.ttft = metrics.ttft.labels(*labels)
        self.e2e = metrics.e2e.labels(*labels)
        self.failovers = metrics.failovers.labels(*labels)
        self.prompt_tokens = metrics.prompt_tokens.labels(*labels)
        self.predicted_cached = metrics.predicted_cached.labels(*labels)
        self.engine_cached = metrics.engine_cached.labels(*labels)
        self.best_available_cached = metrics.best_available_cached.labels(*labels)
        self.output_tokens = metrics.output_tokens.labels(*labels)
        self.tpot = metrics.tpot.labels(*labels)
        self._labels = labels

    def declare(self) -> None:
        """Create the answered-with-200 series (every other child exists already)."""
        self._child("200")

    def answered(self, status: str) -> None:
        self._child(status).inc()

    def _child(self, status: str) -> Any:
        child = self._statuses.get(status)
        if child is None:
            child = self._statuses[status] = self._requests.labels(*self._labels, status)
        return child

    def record_cache(
        self, *, prompt_tokens: int, predicted: int, best_available: int, engine_cached: int | None
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.predicted_cached.inc(predicted)
        self.best_available_cached.inc(best_available)
        if engine_cached is not None:
            self.engine_cached.inc(engine_cached)


class WorkerStateCollector(Collector):
    """Per-worker gauges read from the registry and the scheduler's ledger when Prometheus
    scrapes."""

    def __init__(self, workers: WorkerRegistry, ledger: Ledger, metrics: GatewayMetrics) -> None:
        self._workers = workers
        self._ledger = ledger
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauges = {
            key: GaugeMetricFamily(name, text, labels=["worker"])
            for key, name, text in (*_WORKER_GAUGES, *_MODEL_GAUGES)
        }
        gauges["role"] = GaugeMetricFamily(
            "kvgate_worker_role",
            "1 for the worker's role: prefill, decode or both (a prefill/decode "
            "disaggregated fleet, docs/pd.md)",
            labels=["worker", "role"],
        )
        gauges["mismatch"] = GaugeMetricFamily(
            "kvgate_worker_config_mismatch",
            "1 when an engine fact (block_size) contradicts kvgate's: the worker is not ready "
            "(/ready says why)",
            labels=["worker", "fact"],
        )
        gauges["mechanism"] = GaugeMetricFamily(
            "kvgate_mechanism_active",
            "1 when a capacity mechanism is in force on the worker, 0 when it is off (turned "
            "off by the guard where it did harm)",
            labels=["worker", "part"],
        )
        calibrator = self._ledger.calibrator
        for w in self._workers:
            parts = self._ledger.parts(w.id)
            for part in GUARDED:
                gauges["mechanism"].add_metric([w.url, part], float(getattr(parts, part)))
            sent = self._ledger.of(w)
            labels = [w.url]
            params = calibrator.params(w.id)
            gauges["rate"].add_metric(labels, params.prefill_tokens_per_s)
            gauges["queued_weight"].add_metric(labels, params.queued_weight)
            gauges["base"].add_metric(labels, params.base_s)
            error = calibrator.error(w.id)
            if error is not None:
                gauges["abs_error"].add_metric(labels, error.mean_abs_s)
                gauges["bias"].add_metric(labels, error.bias_s)
            gauges["healthy"].add_metric(labels, 1.0 if w.healthy else 0.0)
            gauges["role"].add_metric([w.url, w.config.role], 1.0)
            gauges["in_flight"].add_metric(labels, sent.in_flight)
            gauges["prefill"].add_metric(labels, sent.pending_prefill_tokens)
            gauges["decode"].add_metric(labels, sent.active_decode_blocks)
            gauges["blocked"].add_metric(labels, sent.blocked_requests)
            if w.scraped.waiting is not None:
                gauges["waiting"].add_metric(labels, w.scraped.waiting)
            if w.scraped.kv_usage is not None:
                gauges["kv_usage"].add_metric(labels, w.scraped.kv_usage)
            gauges["mismatch"].add_metric([w.url, "block_size"], float("block_size" in w.problems))
            gauges["models"].add_metric(labels, len(w.models))
            gauges["unlabelled"].add_metric(labels, self._metrics.unlabelled(w.url, w.models))
        yield from gauges.values()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


_WORKER_GAUGES = (
    ("healthy", "kvgate_worker_healthy", "1 when the worker is healthy"),
    ("in_flight", "kvgate_worker_in_flight", "Requests in flight on the worker"),
    (
        "prefill",
        "kvgate_worker_pending_prefill_tokens",
        "Predicted prompt tokens waiting for their first token",
    ),
    ("decode", "kvgate_worker_active_decode_blocks", "Predicted KV blocks of requests in flight"),
    (
        "blocked",
        "kvgate_worker_blocked_requests",
        "Requests sent lacking KV room (predicted) and not started: the engine starts nothing "
        "sent after them first",
    ),
    (
        "waiting",
        "kvgate_worker_scraped_waiting",
        "Waiting requests scraped from the engine's /metrics",
    ),
    (
        "kv_usage",
        "kvgate_worker_scraped_kv_usage",
        "KV-cache usage (0..1) scraped from the engine's /metrics",
    ),
    (
        "models",
        "kvgate_worker_models",
        "Models the worker serves (base models and adapters), from its /v1/models",
    ),
    (
        "unlabelled",
        "kvgate_worker_models_unlabelled",
        f"Models of the worker without series of their own: past {MAX_MODEL_LABELS} a "
        f'worker\'s requests share model="{OTHER_MODELS}"',
    ),
)
"""Per-worker gauges of the registry's state: (key, metric name, help)."""

_MODEL_GAUGES = (
    (
        "rate",
        "kvgate_ttft_model_prefill_tokens_per_second",
        "Learned prefill rate of the worker (its own uncached tokens)",
    ),
    (
        "queued_weight",
        "kvgate_ttft_model_queued_weight",
        "Learned delay of a queued prefill token relative to one of the request's own",
    ),
    (
        "base",
        "kvgate_ttft_model_base_seconds",
        "Learned TTFT of an empty prompt on the idle worker",
    ),
    (
        "abs_error",
        "kvgate_ttft_prediction_mean_abs_error_seconds",
        "Running mean |measured - predicted| TTFT of the worker's requests",
    ),
    (
        "bias",
        "kvgate_ttft_prediction_bias_seconds",
        "Running mean measured - predicted TTFT of the worker's requests",
    ),
)
"""The learned TTFT model of each worker and its running calibration error."""


class GatewayRegistry(CollectorRegistry):
    """The gateway's metrics registry: its collectors in the order registered, to tell
    prometheus_client's own metric objects (thread-safe, collected in the render thread)
    from the collectors that read the event loop's state at scrape time (every other one:
    per-worker gauges, the queue, the index; collected on the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self._collectors: list[Collector] = []  # one per metric family: registered at start

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self._collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self._collectors.remove(collector)

    def snapshot(self) -> _Snapshot:
        """On the event loop: what the loop-state collectors report now, and the metric
        objects to collect in the render thread."""
        return _Snapshot(
            [c if isinstance(c, MetricWrapperBase) else list(c.collect()) for c in self._collectors]
        )


class _Snapshot:
    """Metric families gathered on the event loop, and metric objects collected later."""

    def __init__(self, parts: list[Collector | list[Metric]]) -> None:
        self._parts = parts

    def collect(self) -> Iterator[Metric]:
        for part in self._parts:
            yield from (part if isinstance(part, list) else part.collect())


class MetricsPage:
    """The /metrics page, rendered off the event loop: the collectors reading the loop's
    state run on it (``GatewayRegistry.snapshot``: a few milliseconds, the series being
    bounded; any other registry is collected whole on it), the formatting and
    prometheus_client's own metrics in a worker thread. One render at a time: the scrapes
    arriving while a page is rendered get that page, so however many scrape, the loop's
    part runs at most once per render, and no page is older than its scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._rendering: asyncio.Future[bytes] | None = None

    async def render(self) -> bytes:
        if self._rendering is None:
            self._rendering = asyncio.ensure_future(self._render())
            self._rendering.add_done_callback(self._rendered)
        return await asyncio.shield(self._rendering)

    async def _render(self) -> bytes:
        registry = self._registry
        if isinstance(registry, GatewayRegistry):
            snapshot = registry.snapshot()
        else:
            snapshot = _Snapshot([list(registry.collect())])
        return await asyncio.to_thread(generate_latest, snapshot)

    def _rendered(self, future: asyncio.Future[bytes]) -> None:
        self._rendering = None
        if not future.cancelled():
            future.exception()  # retrieved: the scrapes waiting for it have it raised


def forget_series(metrics: Iterable[object], worker: str) -> None:
    """Remove the children labelled ``worker=<worker>`` of each labelled metric in
    ``metrics`` (other objects are skipped), found through public ``collect``/``remove``."""
    for metric in metrics:
        if not isinstance(metric, MetricWrapperBase):
            continue
        for family in metric.collect():
            stale = {
                tuple(v for k, v in sample.labels.items() if k not in ("le", "quantile"))
                for sample in family.samples
                if sample.labels.get("worker") == worker
            }
            for labels in stale:
                metric.remove(*labels)


def register_worker_gauges(
    registry: CollectorRegistry, workers: WorkerRegistry, ledger: Ledger, metrics: GatewayMetrics
) -> None:
    registry.register(WorkerStateCollector(workers, ledger, metrics))


def kvgate_version() -> str:
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_labels(*, native_core: bool) -> dict[str, str]:
    """``kvgate_build_info``'s labels: the installed version, Python, and whether the index
    runs on its native block table (``native_core=False``: the pure-Python one was chosen)."""
    return {
        "version": kvgate_version(),
        "python": platform.python_version(),
        "native_core": "true" if native_core else "false",
    }
