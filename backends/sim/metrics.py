"""A replica's ``/metrics``: vLLM's metric names (so routers scrape it like vLLM) plus a few
``kvgate_sim_*`` metrics of the simulator itself. One registry per replica, no globals."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.backends.sim.engine import SimRequest

# vLLM's time-to-first-token and end-to-end latency buckets.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""vLLM's ``vllm:prompt_tokens_by_source`` labels (computed + local hit + external = total)."""


@dataclass(frozen=True, slots=True)
class LiveState:
    """Callables the gauges read at scrape time."""

    running: Callable[[], int]
    waiting: Callable[[], int]
    usage: Callable[[], float]
    cpu_cached: Callable[[], int]
    event_seq: Callable[[], int]
    busy_s: Callable[[], float]
    late_s: Callable[[], float]
    # per data-parallel rank, in rank order: (running, waiting, usage); with several, the
    # load gauges have one series per rank (engine="<rank>"), as vLLM's
    ranks: Callable[[], Sequence[tuple[int, int, float]]] | None = None


class _LiveCollector(Collector):
    def __init__(self, state: LiveState, labels: dict[str, str], cache_info: dict[str, str]):
        self._state = state
        self._labels = labels
        self._cache_info = cache_info

    def _gauge(
        self, name: str, doc: str, value: float, extra: dict[str, str] | None = None
    ) -> Metric:
        labels = {**self._labels, **(extra or {})}
        family = GaugeMetricFamily(name, doc, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        return family

    def _per_rank(self, ranks: Sequence[tuple[int, int, float]]) -> Iterator[Metric]:
        """The load gauges with one series per data-parallel rank (``engine="<rank>"``)."""
        docs = ("Requests in the batch.", "Requests queued.", "KV-cache usage, 0..1.")
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
        for column, name in enumerate((*names, "vllm:kv_cache_usage_perc")):
            family = GaugeMetricFamily(name, docs[column], labels=list(self._labels))
            for rank, values in enumerate(ranks):
                labels = {**self._labels, "engine": str(rank)}
                family.add_metric(list(labels.values()), float(values[column]))
            yield family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self._state
        ranks = s.ranks() if s.ranks is not None else ()
        if len(ranks) > 1:
            yield from self._per_rank(ranks)
        else:
            yield self._gauge("vllm:num_requests_running", "Requests in the batch.", s.running())
            yield self._gauge("vllm:num_requests_waiting", "Requests queued.", s.waiting())
            yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1.", s.usage())
        # vLLM labels its config info with the engine index only (no model name)
        labels = ["engine", *self._cache_info]
        info = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration.", labels=labels)
        info.add_metric([self._labels["engine"], *self._cache_info.values()], 1.0)
        yield info
        yield self._gauge("kvgate_sim_cpu_cached_blocks", "Blocks on the CPU tier.", s.cpu_cached())
        yield self._gauge("kvgate_sim_event_seq", "Next KV-event sequence number.", s.event_seq())
        yield self._counter(
            "kvgate_sim_busy_seconds", "Modelled engine step time (wall s).", s.busy_s()
        )
        yield self._counter(
            "kvgate_sim_late_seconds",
            "Wall s lost to the model: steps begun later than the catch-up allows.",
            s.late_s(),
        )


class ReplicaMetrics:
    """The metrics of one simulated replica, in its own registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model: str,
        live: LiveState,
        cache_info: dict[str, str],
        cpu_tier: bool = False,
    ) -> None:
        self._cpu_tier = cpu_tier
        labels = {"model_name": model, "engine": "0"}
        names = list(labels)
        values = list(labels.values())

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry)

        self._queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up.").labels(
            *values
        )
        self._hits = counter("vllm:prefix_cache_hits", "Prompt tokens found on GPU.").labels(
            *values
        )
        self._ext_queries = counter(
            "vllm:external_prefix_cache_queries", "Tokens looked up in the CPU tier."
        ).labels(*values)
        self._ext_hits = counter(
            "vllm:external_prefix_cache_hits", "Tokens found in the CPU tier."
        ).labels(*values)
        self._cached = counter(
            "vllm:prompt_tokens_cached", "Prompt tokens served from cache."
        ).labels(*values)
        self._prompt = counter("vllm:prompt_tokens", "Prompt tokens processed.").labels(*values)
        by_source = Counter(
            "vllm:prompt_tokens_by_source", "Prompt tokens by source.", [*names, "source"],
            registry=registry,
        )  # fmt: skip
        self._by_source = {src: by_source.labels(*values, src) for src in PROMPT_SOURCES}
        transfers = Counter(
            "kvgate_sim_kv_transfers",
            "Decode legs that received a KV transfer: used (it brought blocks this replica "
            "lacked) or redundant (every block it brought was already here).",
            ["outcome"],
            registry=registry,
        )
        self._transfers = {o: transfers.labels(o) for o in ("used", "redundant")}
        self._prefill_legs = Counter(
            "kvgate_sim_prefill_leg_prompt_tokens",
            "Prompt tokens of prefill legs (prefilled for a remote decode; the request's "
            "decode leg counts them again).",
            registry=registry,
        )
        self._pulled = Counter(
            "kvgate_sim_kv_transfer_tokens", "Prompt tokens pulled by KV transfers.",
            registry=registry,
        )  # fmt: skip
        self._generation = counter("vllm:generation_tokens", "Tokens generated.").labels(*values)
        self._preemptions = counter("vllm:num_preemptions", "Preemptions.").labels(*values)
        self._success = Counter(
            "vllm:request_success", "Finished requests.", [*names, "finished_reason"],
            registry=registry,
        )  # fmt: skip
        self._values = values
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token (wall).", names,
            buckets=TTFT_BUCKETS, registry=registry,
        ).labels(*values)  # fmt: skip
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end latency (wall).", names,
            buckets=E2E_BUCKETS, registry=registry,
        ).labels(*values)  # fmt: skip
        self._faults = Counter(
            "kvgate_sim_faults", "Fault occurrences by kind.", ["kind"], registry=registry
        )
        self._batches = Counter(
            "kvgate_sim_event_batches", "KV-event batches by outcome.", ["outcome"],
            registry=registry,
        )  # fmt: skip
        self._replays = Counter(
            "kvgate_sim_replay_requests", "Replay requests by outcome.", ["outcome"],
            registry=registry,
        )  # fmt: skip
        registry.register(_LiveCollector(live, labels, cache_info))

    # --- engine observer -----------------------------------------------------------------

    def on_admitted(
        self,
        prompt_tokens: int,
        gpu_hit_tokens: int,
        cpu_hit_tokens: int,
        remote_tokens: int,
        prefill_leg: bool,
    ) -> None:
        if prefill_leg:
            self._prefill_legs.inc(prompt_tokens)
        self._queries.inc(prompt_tokens)
        self._hits.inc(gpu_hit_tokens)
        if self._cpu_tier:
            self._ext_queries.inc(prompt_tokens - gpu_hit_tokens)
            self._ext_hits.inc(cpu_hit_tokens)
        external = cpu_hit_tokens + remote_tokens  # vLLM: the connector's tokens
        self._cached.inc(gpu_hit_tokens + external)
        self._prompt.inc(prompt_tokens)
        sources = self._by_source
        sources["local_compute"].inc(prompt_tokens - gpu_hit_tokens - external)
        sources["local_cache_hit"].inc(gpu_hit_tokens)
        sources["external_kv_transfer"].inc(external)

    def on_transfer(self, pulled_tokens: int, used_tokens: int) -> None:
        self._pulled.inc(pulled_tokens)
        self._transfers["used" if used_tokens else "redundant"].inc()

    def on_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def on_finished(self, req: SimRequest, reason: str, e2e_s: float) -> None:
        self._generation.inc(req.num_output)
        self._success.labels(*self._values, reason).inc()
        self._e2e.observe(e2e_s)

    def on_preempted(self) -> None:
        self._preemptions.inc()

    # --- simulator -----------------------------------------------------------------------

    def on_fault(self, kind: str) -> None:
        self._faults.labels(kind).inc()

    def on_batch(self, outcome: str) -> None:
        """``published``, ``delayed``, ``dropped`` (replayable), ``lost`` or ``stopped``."""
        self._batches.labels(outcome).inc()

    def on_replay(self, outcome: str) -> None:
        """``served``, ``malformed`` or ``ignored`` (the stream is stopped)."""
        self._replays.labels(outcome).inc()
