"""Prometheus metrics of the index layer (created per registry; no globals)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.index.api import TokenizeMode
from kvgate.index.types import SlotStats


class _EntriesCollector(Collector):
    """Entries per cache domain and tier, read from the indexes at scrape time."""

    def __init__(self, sources: Callable[[], Iterable[tuple[str, list[SlotStats]]]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvgate_index_entries",
            "Blocks held per cache domain and tier, as kvgate believes",
            labels=["source", "worker", "dp_rank", "tier"],
        )
        for source, stats in self._sources():
            for slot in stats:
                for tier, count in slot.by_tier.items():
                    family.add_metric(
                        [source, slot.worker.worker, str(slot.worker.dp_rank), tier.name],
                        count,
                    )
        yield family


# label values a worker's event series start with at zero (declare_feed)
_GAP_KINDS = ("seq", "unknown_parent")
_REPLAY_OUTCOMES = ("covered", "partial", "failed", "aborted")
_RESET_REASONS = (
    "gap", "unknown_parent", "disconnected", "restart", "limit", "overflow",
    "all_blocks_cleared", "removed", "undecodable", "failed", "subscriber_failed",
)  # fmt: skip
_LIMITS = ("ranks", "event_blocks", "mapped_hashes", "replay_batches", "replay_bytes",
           "replay_seconds")  # fmt: skip


class IndexMetrics:
    """Event ingestion, index contents and tokenization counters."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "kvgate_index_events_total",
            "KV events applied, by worker and type",
            ["worker", "type"],
            registry=registry,
        )
        self.blocks_stored = Counter(
            "kvgate_index_blocks_stored_total",
            "Blocks indexed from BlockStored events",
            ["worker"],
            registry=registry,
        )
        self.gaps = Counter(
            "kvgate_index_gaps_total",
            "Gaps detected in a worker's event stream (seq gap or unknown parent)",
            ["worker", "kind"],
            registry=registry,
        )
        self.replays = Counter(
            "kvgate_index_replays_total",
            "Replay requests to an engine's replay socket, by outcome",
            ["worker", "outcome"],
            registry=registry,
        )
        self.resets = Counter(
            "kvgate_index_resets_total",
            "Times a worker's entries were dropped, by reason",
            ["worker", "reason"],
            registry=registry,
        )
        self.decode_errors = Counter(
            "kvgate_index_decode_errors_total",
            "Undecodable event payloads skipped",
            ["worker"],
            registry=registry,
        )
        self.failed_batches = Counter(
            "kvgate_index_failed_batches_total",
            "Event batches dropped because applying them failed (the worker is cleared)",
            ["worker"],
            registry=registry,
        )
        self.limits = Counter(
            "kvgate_index_limits_total",
            "Times an event publisher went past a bound (ranks, event_blocks, mapped_hashes, "
            "replay_batches, replay_bytes, replay_seconds)",
            ["worker", "limit"],
            registry=registry,
        )
        self.skipped_events = Counter(
            "kvgate_index_skipped_events_total",
            "Events skipped without a reset (pruned_parent: stored under a block the index pruned)",
            ["worker", "reason"],
            registry=registry,
        )
        self.subscriber_restarts = Counter(
            "kvgate_index_subscriber_restarts_total",
            "Event subscribers restarted after a failure (the worker is cleared meanwhile)",
            ["worker"],
            registry=registry,
        )
        self.block_size_mismatch = Counter(
            "kvgate_index_block_size_mismatch_total",
            "Events ignored because their block_size differs from the configured one",
            ["worker"],
            registry=registry,
        )
        self.ingest_lag = Histogram(
            "kvgate_index_ingest_lag_seconds",
            "Time from the engine publishing a batch to kvgate applying it",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
            registry=registry,
        )
        self.last_seq = Gauge(
            "kvgate_index_last_seq",
            "Sequence number of the last event batch applied",
            ["worker", "endpoint"],
            registry=registry,
        )
        self.connected = Gauge(
            "kvgate_index_subscriber_connected",
            "1 while the subscriber is connected to the worker's event publisher",
            ["worker", "endpoint"],
            registry=registry,
        )
        self.tokenize = Counter(
            "kvgate_tokenize_total",
            "Prompts turned into block keys, by how they were tokenized",
            ["model", "mode"],
            registry=registry,
        )
        self.tokenize_cache = Counter(
            "kvgate_tokenize_cache_total",
            "Rendered-prefix tokenization cache lookups",
            ["model", "result"],
            registry=registry,
        )
        self.tokenize_seconds = Histogram(
            "kvgate_tokenize_seconds",
            "Time from a prompt to its block keys",
            ["mode"],
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=registry,
        )
        for mode in get_args(TokenizeMode):
            self.tokenize_seconds.labels(mode)
        self.tokenizer_mismatch = Gauge(
            "kvgate_tokenizer_mismatch",
            "1 when the local tokenizer and chat template render the start-up probe prompts "
            "otherwise than an engine serving the model (its prompts are then keyed by the "
            "engine's renderer), 0 when they agree",
            ["model"],
            registry=registry,
        )
        self._registry = registry
        self._entries: _EntriesCollector | None = None

    def declare_feed(self, worker: str) -> None:
        """Start the event series of ``worker`` at zero, so a dashboard shows 0 (not "no
        data") before its first gap, replay or reset. Series per model (``tokenize_*``) and
        the scrape-time ``kvgate_index_entries`` appear with their first value."""
        for kind in _GAP_KINDS:
            self.gaps.labels(worker, kind)
        for outcome in _REPLAY_OUTCOMES:
            self.replays.labels(worker, outcome)
        for reason in _RESET_REASONS:
            self.resets.labels(worker, reason)
        for limit in _LIMITS:
            self.limits.labels(worker, limit)
        for counter in (
            self.decode_errors, self.failed_batches, self.subscriber_restarts,
            self.block_size_mismatch,
        ):  # fmt: skip
            counter.labels(worker)

    def watch_entries(self, sources: Callable[[], Iterable[tuple[str, list[SlotStats]]]]) -> None:
        """Export entries per worker and tier from ``sources`` at scrape time."""
        if self._entries is None:
            self._entries = _EntriesCollector(sources)
            self._registry.register(self._entries)

    def close(self) -> None:
        if self._entries is not None:
            self._registry.unregister(self._entries)
            self._entries = None
