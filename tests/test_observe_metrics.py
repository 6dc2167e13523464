"""The operator's metrics: every series there from the start, and the stream-derived ones
(output tokens, time per output token, time to first token) after a known request sequence.

A real kvgate (uvicorn on 127.0.0.1) in front of fake engines, one of them publishing KV
events over a real ZMQ socket; values are read from kvgate's own ``/metrics`` over HTTP.
"""

from __future__ import annotations

import asyncio
import platform
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
import zmq.asyncio
from fakes.engine import FakeEngine
from fakes.gateway import Kvgate, fleet, kvgate
from fakes.wait import wait_until
from kv_publisher import KvPublisher
from prometheus_client import Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from kvgate.router.app import build_gateway
from kvgate.router.config import load_settings
from kvgate.router.metrics import (
    MAX_MODEL_LABELS,
    OTHER_MODELS,
    GatewayRegistry,
    MetricsPage,
    kvgate_version,
)

pytestmark = pytest.mark.anyio

MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "one two three"}]}
# families that have no sample before their first value, and why (docs/observability.md)
FIRST_VALUE_ONLY = {
    "kvgate_index_last_seq",  # no sequence number before the first event batch
    "kvgate_index_entries",  # read at scrape time: a worker appears with its first block
    "kvgate_tokenize",  # per model and tokenize mode: appears with the model's first prompt
    "kvgate_tokenize_cache",  # per model: appears with the model's first prompt
    "kvgate_worker_scraped_waiting",  # unknown (not 0) until the engine's /metrics is read
    "kvgate_worker_scraped_kv_usage",  # likewise
    "kvgate_ttft_prediction_bias_seconds",  # no prediction error before the first answer
    "kvgate_ttft_prediction_mean_abs_error_seconds",  # likewise
    "kvgate_dp_rank_attempts",  # per worker and data-parallel rank: only workers with ranks
    "kvgate_tokenizer_mismatch",  # per model: once its local template was checked
}


async def scrape(gw: Kvgate) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """kvgate's /metrics: family name -> {sorted labels of a sample + its name: value}."""
    text = (await gw.client.get("/metrics")).text
    families: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            samples[(("__name__", sample.name), *sorted(sample.labels.items()))] = sample.value
    return families


def value(
    families: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float | None:
    for family in families.values():
        key = (("__name__", name), *sorted(labels.items()))
        if key in family:
            return family[key]
    return None


async def test_every_series_is_there_before_the_first_request() -> None:
    context = zmq.asyncio.Context()
    publisher = KvPublisher(context)
    try:
        async with fleet(FakeEngine("a")) as f:
            url = f.urls[0]
            worker = f"{url},events={publisher.events_endpoint},replay={publisher.replay_endpoint}"
            async with kvgate([worker], policy="kv") as gw:
                await wait_until(publisher.subscribed.is_set, 10, "the event subscription")
                families = await scrape(gw)
    finally:
        await publisher.close()
        context.term()
    empty = {
        name for name, samples in families.items() if name.startswith("kvgate") and not samples
    }
    assert empty == FIRST_VALUE_ONLY
    route = {"worker": url, "model": MODEL}
    for name, labels in [
        ("kvgate_requests_total", {**route, "status": "200"}),
        ("kvgate_time_to_first_token_seconds_count", route),
        ("kvgate_request_duration_seconds_count", route),
        ("kvgate_time_per_output_token_seconds_count", route),
        ("kvgate_output_tokens_total", route),
        ("kvgate_prompt_tokens_total", route),
        ("kvgate_engine_cached_tokens_total", route),
        ("kvgate_failovers_total", route),
        ("kvgate_upstream_retries_total", {"worker": url, "reason": "refused"}),
        ("kvgate_stream_errors_total", {"worker": url, "reason": "engine_error"}),
        ("kvgate_index_resyncs_total", {"worker": url, "reason": "events_silent"}),
        ("kvgate_health_probe_failures_total", {"worker": url}),
        ("kvgate_index_gaps_total", {"worker": url, "kind": "seq"}),
        ("kvgate_index_replays_total", {"worker": url, "outcome": "aborted"}),
        ("kvgate_index_resets_total", {"worker": url, "reason": "gap"}),
        ("kvgate_index_limits_total", {"worker": url, "limit": "replay_bytes"}),
        ("kvgate_index_decode_errors_total", {"worker": url}),
        ("kvgate_tokenize_seconds_count", {"mode": "tokenizer"}),
    ]:
        assert value(families, name, **labels) == 0.0, (name, labels)
    build = {"version": kvgate_version(), "python": platform.python_version(),
             "native_core": "true"}  # fmt: skip
    assert value(families, "kvgate_build_info", **build) == 1.0


async def test_stream_metrics_after_a_known_sequence() -> None:
    async with fleet(FakeEngine("a")) as f, kvgate(f.urls, admin_token="adm") as gw:
        url = f.urls[0]
        requests = [
            ({**CHAT, "stream": True, "fake": {"tokens": 4}}, 200),  # usage: 4 tokens
            ({**CHAT, "stream": True, "fake": {"tokens": 1}}, 200),  # 1 token: no gap to time
            ({**CHAT, "fake": {"tokens": 3}}, 200),  # not streamed: tokens, no timing
            ({**CHAT, "model": "no-such-model"}, 404),
            ({**CHAT, "stream": True, "fake": {"status": 400}}, 400),  # engine refused
        ]
        for body, status in requests:
            assert (await gw.client.post("/v1/chat/completions", json=body)).status_code == status
        refused = {"worker": url, "model": MODEL, "status": "400"}
        await wait_until(lambda: gw.metric("kvgate_requests_total", refused) == 1, 10, "the end")
        families = await scrape(gw)
        route = {"worker": url, "model": MODEL}
        assert value(families, "kvgate_output_tokens_total", **route) == 8.0
        assert value(families, "kvgate_time_per_output_token_seconds_count", **route) == 1.0
        assert value(families, "kvgate_time_to_first_token_seconds_count", **route) == 2.0
        assert value(families, "kvgate_requests_total", **route, status="200") == 3.0
        tpot = value(families, "kvgate_time_per_output_token_seconds_sum", **route)
        e2e = value(families, "kvgate_request_duration_seconds_sum", **route)
        assert tpot is not None and e2e is not None and 0 < tpot < e2e
        # a removed worker's series go with it, the new ones included
        admin = {"authorization": "Bearer adm"}
        removed = await gw.client.delete(f"/admin/workers/{quote(url, safe='')}", headers=admin)
        assert removed.status_code == 200
        families = await scrape(gw)
        assert value(families, "kvgate_output_tokens_total", **route) is None
        assert value(families, "kvgate_time_per_output_token_seconds_count", **route) is None


async def test_build_info_names_the_block_table_chosen() -> None:
    gateway = build_gateway(load_settings(overrides={"index": {"table": "python"}}))
    try:
        info = gateway.metrics_registry.get_sample_value(
            "kvgate_build_info",
            {"version": kvgate_version(), "python": platform.python_version(),
             "native_core": "false"},
        )  # fmt: skip
        assert info == 1.0
    finally:
        await gateway.client.aclose()


# -- bounded, off the event loop, optionally guarded -----------------------------------------
MANY = [f"adapter-{i:04d}" for i in range(4095)]  # with the base: the 4,096 taken
HEALTH = {"interval_s": 3600, "metrics_interval_s": 0, "models_max_bytes": 10_000_000}


async def test_a_worker_listing_thousands_of_models_keeps_metrics_bounded() -> None:
    """A worker listing 4,096 models: at most MAX_MODEL_LABELS of them get series of their
    own, the others share model="_other" and are counted (before: every model had its own,
    a page of about 31 MiB)."""
    engine = FakeEngine(models=[MODEL, *MANY])
    async with fleet(engine) as f, kvgate(f.urls, kv_index=False, health=HEALTH) as gw:
        for model in (MODEL, MANY[0], MANY[-1], MANY[2000]):
            r = await gw.client.post("/v1/chat/completions", json={**CHAT, "model": model})
            assert r.status_code == 200
        r = await gw.client.get("/metrics")
        assert len(r.content) < 1024 * 1024
        samples = [s for family in text_string_to_metric_families(r.text) for s in family.samples]
        models = {s.labels.get("model") for s in samples if s.labels.get("worker") == f.urls[0]}
        models.discard(None)  # (series by worker only)
        assert MODEL in models  # the base model first
        assert len(models) == MAX_MODEL_LABELS + 1  # and the shared "_other"
        assert len({s.labels["model"] for s in samples if "model" in s.labels}) < 100
        worker = {"worker": f.urls[0]}
        assert gw.metric("kvgate_worker_models", worker) == 4096
        assert gw.metric("kvgate_worker_models_unlabelled", worker) == 4096 - MAX_MODEL_LABELS
        folded = {**worker, "model": OTHER_MODELS, "status": "200"}
        assert gw.metric("kvgate_requests_total", folded) >= 1


class BlockingGauge(Gauge):
    """A metric object (collected in the render thread) whose collection waits for a flag."""

    release = threading.Event()

    def collect(self) -> Any:
        assert self.release.wait(60), "never released"
        return super().collect()


async def test_metrics_are_rendered_off_the_event_loop() -> None:
    """While a scrape's render is held up in its thread, the gateway still answers (before:
    the render ran on the event loop and every request waited for it)."""
    async with kvgate([]) as gw:
        BlockingGauge.release.clear()
        BlockingGauge("kvgate_test_blocking", "held", registry=gw.metrics_registry)
        scrape = asyncio.ensure_future(gw.client.get("/metrics"))
        try:
            assert (await gw.client.get("/health")).status_code == 200
            assert not scrape.done()
        finally:
            BlockingGauge.release.set()
        assert "kvgate_test_blocking 0.0" in (await scrape).text


class CountingCollector:
    """A collector of loop state that counts how often it is collected."""

    def __init__(self) -> None:
        self.collected = 0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.collected += 1
        yield GaugeMetricFamily("kvgate_test_collected", "collections", value=self.collected)


async def test_concurrent_scrapes_share_one_render() -> None:
    """Scrapes arriving while a page is rendered get that page; a later one a fresh one."""
    registry = GatewayRegistry()
    counter = CountingCollector()
    registry.register(counter)
    page = MetricsPage(registry)
    pages = await asyncio.gather(*(page.render() for _ in range(8)))
    assert counter.collected == 1 and len(set(pages)) == 1
    assert b"kvgate_test_collected 2.0" in await page.render()


async def test_metrics_auth_asks_for_the_admin_token() -> None:
    async with kvgate([], metrics_auth=True, admin_token="metrics-admin-token") as gw:
        refused = await gw.client.get("/metrics")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_admin_token"
        ok = await gw.client.get(
            "/metrics", headers={"authorization": "Bearer metrics-admin-token"}
        )
        assert ok.status_code == 200 and "kvgate_requests_total" in ok.text
    async with kvgate([]) as gw:  # off by default: open
        assert (await gw.client.get("/metrics")).status_code == 200
