"""Metrics of the router-side queue (``kvgate_queue_*``), on an injected registry.

Labels are bounded: ``key`` is a key id (``accesslog.client_key_id``: a prefix of the key's
SHA-256, or "-" when kvgate has no client keys), never the key; every known key's series are
there at 0 before its first request; ``model`` only ever names a served model; ``reason`` is one
of ``REJECTIONS``. Queue lengths and in-flight shares are read from the queue at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.scheduling.queue import REJECTIONS, AdmissionQueue

_WAIT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class QueueMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.entered_total = Counter(
            "kvgate_queue_entered",
            "Requests that had to wait in the router-side queue, by API key id",
            ["key"],
            registry=registry,
        )
        self.wait = Histogram(
            "kvgate_queue_wait_seconds",
            "Time queued requests waited before being sent, by API key id",
            ["key"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.rejections = Counter(
            "kvgate_queue_rejected",
            "Requests the queue turned away or lost, by API key id and reason",
            ["key", "reason"],
            registry=registry,
        )

    def declare(self, keys: Sequence[str]) -> None:
        """Every series of these key ids at 0, before their first request."""
        for key in keys:
            self.entered_total.labels(key)
            self.wait.labels(key)
            for reason in REJECTIONS:
                self.rejections.labels(key, reason)

    def watch(self, queue: AdmissionQueue, models: Callable[[], set[str]]) -> None:
        """Read ``queue``'s lengths (for every key and each of ``models()``) at scrape time."""
        self._registry.register(_QueueCollector(queue, models))

    def entered(self, key: str) -> None:
        self.entered_total.labels(key).inc()

    def waited(self, key: str, seconds: float) -> None:
        self.wait.labels(key).observe(seconds)

    def rejected(self, key: str, reason: str) -> None:
        assert reason in REJECTIONS, reason
        self.rejections.labels(key, reason).inc()


class _QueueCollector(Collector):
    def __init__(self, queue: AdmissionQueue, models: Callable[[], set[str]]) -> None:
        self._queue = queue
        self._models = models

    def collect(self) -> Iterator[GaugeMetricFamily]:
        length = GaugeMetricFamily(
            "kvgate_queue_length",
            "Requests waiting in the router-side queue",
            labels=["key", "model"],
        )
        for key, model, n in self._queue.queued_by(self._models()):
            length.add_metric([key, model], n)
        flying = GaugeMetricFamily(
            "kvgate_key_in_flight",
            "Requests let through the admission queue and not finished, by API key id",
            labels=["key"],
        )
        for key, n in self._queue.in_flight_by_key().items():
            flying.add_metric([key], n)
        held = GaugeMetricFamily(
            "kvgate_queue_bytes",
            "Body bytes of the requests waiting in the router-side queue (queue.max_bytes)",
        )
        held.add_metric([], self._queue.queued_bytes)
        yield length
        yield flying
        yield held

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())
