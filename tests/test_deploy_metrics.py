"""The Grafana dashboard and the alert rules name only metrics kvgate really exports.

A real kvgate (``router.app.create_app`` under uvicorn on 127.0.0.1) routes real requests
to two fake engines, ingests KV events from a real ZMQ publisher (a gap that replay covers,
a cache reset), scrapes the engines' /metrics and runs DNS discovery; then its /metrics
output is scraped over HTTP and every ``kvgate_*`` series named by
deploy/grafana/kvgate-dashboard.json and deploy/prometheus/alerts.yaml must be in it, with
the labels the queries select and group by. When promtool is installed
(``apt-get install prometheus``) the rules and every dashboard query are also parsed by it
and the alert rules' unit tests (deploy/prometheus/alerts_test.yaml) run.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq.asyncio
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate, quiet_health
from fakes.wait import wait_until
from kv_publisher import KvPublisher
from prometheus_client.parser import text_string_to_metric_families

from kvgate.index.config import IndexConfig
from kvgate.index.events import AllBlocksCleared, BlockStored
from kvgate.index.types import EngineBlockHash

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvgate-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yaml"

# Labels Prometheus itself attaches at scrape time (target labels), never in /metrics.
SCRAPE_LABELS = {"instance", "job", "namespace", "pod"}
METRIC = re.compile(r"\bkvgate_[a-zA-Z0-9_]*")
SELECTOR = re.compile(r"\b(kvgate_[a-zA-Z0-9_]*)\s*\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
GRAFANA_VARS = {"$__rate_interval": "5m", "$__range": "1h", "$instance": ".*", "$model": ".*"}


# --- what the dashboard and the rules ask for ---------------------------------------------


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            queries.append(query["query"])
    return queries


def alert_queries() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


# --- what kvgate exports ------------------------------------------------------------------


@dataclass
class Exported:
    """Series names kvgate exports and the label names seen on each."""

    labels: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Exported:
        exported = cls()
        for family in text_string_to_metric_families(text):
            for name in _names_of(family.name, family.type):
                exported.labels.setdefault(name, set())
            for sample in family.samples:
                exported.labels.setdefault(sample.name, set()).update(sample.labels)
        return exported

    def missing(self, query: str) -> list[str]:
        """What ``query`` names that is not exported (metrics, then ``metric{label}``)."""
        problems = [name for name in METRIC.findall(query) if name not in self.labels]
        for name, matchers in SELECTOR.findall(query):
            for label in MATCHER_LABEL.findall(matchers):
                if name in self.labels and label not in self.labels[name] | SCRAPE_LABELS:
                    problems.append(f"{name}{{{label}}}")
        known = set().union(*(self.labels.get(n, set()) for n in METRIC.findall(query)))
        for group in GROUPING.findall(query):
            for label in filter(None, (part.strip() for part in group.split(","))):
                if label not in known | SCRAPE_LABELS:
                    problems.append(f"by ({label})")
        return problems


def _names_of(family: str, kind: str) -> Iterator[str]:
    if kind == "counter":
        yield f"{family}_total"
    elif kind == "histogram":
        yield from (f"{family}_bucket", f"{family}_sum", f"{family}_count")
    else:
        yield family


def test_checker_catches_unknown_metrics_and_labels() -> None:
    exported = Exported.parse(
        '# TYPE kvgate_x counter\nkvgate_x_total{worker="a"} 1\n'
        '# TYPE kvgate_h histogram\nkvgate_h_bucket{le="1"} 1\nkvgate_h_bucket{le="+Inf"} 1\n'
        "kvgate_h_sum 1\nkvgate_h_count 1\n"
    )
    assert exported.missing('sum by (worker) (rate(kvgate_x_total{instance=~"$i"}[5m]))') == []
    assert (
        exported.missing("histogram_quantile(0.9, sum by (le) (rate(kvgate_h_bucket[5m])))") == []
    )
    assert exported.missing("rate(kvgate_y_total[5m])") == ["kvgate_y_total"]
    assert exported.missing('kvgate_x_total{model="m"}') == ["kvgate_x_total{model}"]
    assert exported.missing("sum by (model) (kvgate_x_total)") == ["by (model)"]
    assert exported.missing("kvgate_x") == ["kvgate_x"]  # the family name is not a series


# --- a real kvgate with every kind of series ----------------------------------------------


def stored(first_hash: int, tokens: list[int], block_size: int) -> BlockStored:
    hashes = [EngineBlockHash(first_hash + i) for i in range(len(tokens) // block_size)]
    return BlockStored(hashes, None, tokens, block_size, medium="GPU")


@pytest.fixture(scope="module")
def exported() -> Exported:
    """One real kvgate run, shared by every query check of this module."""
    return Exported.parse(asyncio.run(scrape_a_busy_kvgate()))


async def scrape_a_busy_kvgate() -> str:
    block = IndexConfig.model_validate({}).block_size
    prompt = list(range(100, 100 + 3 * block))
    context = zmq.asyncio.Context()
    publisher = KvPublisher(context)
    engine_a = FakeEngine("a", cached_tokens=2 * block, running=1, waiting=2, kv_usage=0.25)
    try:
        async with fleet(engine_a, FakeEngine("b")) as engines:
            url_a, url_b = engines.urls
            port_a = url_a.rsplit(":", 1)[1]
            workers = [
                f"{url_a},events={publisher.events_endpoint},replay={publisher.replay_endpoint}",
                url_b,
            ]
            async with kvgate(
                workers,
                policy="kv",
                health=quiet_health(metrics_interval_s=0.05),
                discover=[f"dns://localhost:{port_a}?events_port=auto&interval=0.05"],
            ) as gw:
                await wait_until(publisher.subscribed.is_set, 10, "the event subscription")
                await publisher.publish(stored(1000, prompt[: 2 * block], block))
                await publisher.publish(stored(2000, prompt[:block], block), drop=True)
                await publisher.publish(AllBlocksCleared())  # after a gap: replay covers it
                await publisher.publish(stored(1000, prompt[: 2 * block], block))
                await wait_until(
                    lambda: gw.metric("kvgate_index_events_total",
                                      {"worker": url_a, "type": "BlockStored"}) >= 3,
                    10, "events applied",
                )  # fmt: skip
                for stream in (False, True):
                    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 2,
                            "stream": stream}  # fmt: skip
                    response = await gw.client.post("/v1/completions", json=body)
                    assert response.status_code == 200
                chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
                assert (await gw.client.post("/v1/chat/completions", json=chat)).status_code == 200
                unknown = {"model": "no-such-model", "prompt": "x"}
                assert (await gw.client.post("/v1/completions", json=unknown)).status_code == 404
                # engine b goes away: the next request for it fails over to a (retry series)
                await engines.servers[1].stop()
                for i in range(6):
                    body = {"model": "fake-model", "prompt": [7, 8, 9, i], "max_tokens": 1}
                    assert (await gw.client.post("/v1/completions", json=body)).status_code == 200
                    if gw.metric(
                        "kvgate_failovers_total", {"worker": url_a, "model": "fake-model"}
                    ):
                        break
                await wait_until(
                    lambda: gw.metric("kvgate_discovery_resolutions_total",
                                      {"target": f"localhost:{port_a}", "result": "ok"}) >= 2,
                    10, "discovery rounds",
                )  # fmt: skip
                text = (await gw.client.get("/metrics")).text
                deadline = time.monotonic() + 10
                while "kvgate_worker_scraped_kv_usage{" not in text:
                    assert time.monotonic() < deadline, "engine /metrics never scraped"
                    text = (await gw.client.get("/metrics")).text
    finally:
        await publisher.close()
        context.term()
    return text


@pytest.mark.parametrize("query", dashboard_queries())
def test_dashboard_query_names_exported_series(exported: Exported, query: str) -> None:
    assert exported.missing(query) == []


@pytest.mark.parametrize("query", alert_queries())
def test_alert_rule_names_exported_series(exported: Exported, query: str) -> None:
    assert exported.missing(query) == []


def test_dashboard_covers_what_operators_need() -> None:
    """The panels the deploy issue asks for are there."""
    queries = " ".join(dashboard_queries())
    for name in (
        "kvgate_engine_cached_tokens_total",  # measured hit rate
        "kvgate_predicted_cached_tokens_total",  # predicted hit rate
        "kvgate_time_to_first_token_seconds_bucket",  # TTFT
        "kvgate_router_overhead_seconds_bucket",  # router overhead
        "kvgate_worker_in_flight",  # per-worker load
        "kvgate_index_entries",  # index size
        "kvgate_index_gaps_total",  # event gaps
        "kvgate_output_tokens_total",  # output tokens per worker
        "kvgate_time_per_output_token_seconds_bucket",  # inter-token latency
        "kvgate_build_info",  # versions running
    ):
        assert name in queries, name
    alerts = {
        rule["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for rule in g["rules"]
    }
    assert {
        "KvgateNoHealthyWorkers",
        "KvgateKvEventGapsRising",
        "KvgateMeasuredHitRateBelowPredicted",
    } <= alerts


def test_dashboard_panels_are_well_formed() -> None:
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
    names = {v["name"] for v in board["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(board["panels"])))
    assert used - {"__rate_interval", "__range"} <= names


# --- promtool (Prometheus' own parser), when installed ------------------------------------

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not installed (apt-get install prometheus)"
)


@needs_promtool
def test_promtool_accepts_the_alert_rules() -> None:
    assert promtool is not None
    result = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_alert_unit_tests_pass() -> None:
    assert promtool is not None
    result = subprocess.run(
        [promtool, "test", "rules", str(ALERT_TESTS)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    assert promtool is not None
    rules: list[dict[str, Any]] = []
    for i, query in enumerate(dashboard_queries()):
        if query.startswith("label_values("):
            continue  # a Grafana function, not PromQL; its metric is checked above
        expr = query
        for variable, value in GRAFANA_VARS.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
