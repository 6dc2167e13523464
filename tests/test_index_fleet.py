"""One list of workers: the KV index follows the registry's membership and health.

The registry tells its subscribers of every worker added, removed or changing health; the
gateway subscribes its index once, at start. Against real kvgate and fake engines: the index
knows what the registry knows, asks only healthy workers to tokenize, sends each worker's
credentials on its own calls, and subscribes only to declared event endpoints the allowlist
admits.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate, quiet_health

from kvgate.backends.registry import WorkerRegistry
from kvgate.index.api import Endpoints, EngineWorker
from kvgate.index.types import WorkerId
from kvgate.router.config import HealthConfig, WorkerConfig

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "a bb ccc dddd"}]}
KEY = "engine-key-0123456789abcdef"


class Recorder:
    """A subscriber that writes down what it is told."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.views: list[EngineWorker] = []

    def worker_added(self, worker: EngineWorker) -> None:
        self.views.append(worker)
        self.calls.append(("added", worker.id, worker.healthy))

    def worker_removed(self, worker: WorkerId) -> None:
        self.calls.append(("removed", worker))

    def worker_health_changed(self, worker: EngineWorker) -> None:
        self.views.append(worker)
        self.calls.append(("health", worker.id, worker.healthy))


def test_the_registry_tells_its_subscribers_everything() -> None:
    registry = WorkerRegistry(HealthConfig(failure_threshold=1, recovery_threshold=1))
    a = registry.add(
        WorkerConfig(url="http://a:1", events="tcp://a:5557", models=["m"], api_key=KEY)
    )
    recorder = Recorder()
    registry.subscribe(recorder)  # told of the workers already there first
    b = registry.add(WorkerConfig(url="http://b:1", engine="sglang"))
    registry.record_success(a)
    registry.record_failure(a, "refused", immediate=True)
    registry.record_success(b)
    registry.remove(b.id)
    assert recorder.calls == [
        ("added", a.id, False),
        ("added", b.id, False),
        ("health", a.id, True),
        ("health", a.id, False),
        ("health", b.id, True),
        ("removed", b.id),
    ]
    view = recorder.views[0]
    assert view == EngineWorker(
        a.id,
        "http://a:1",
        "vllm",
        (Endpoints("tcp://a:5557", None, 0),),
        model="m",
        authorization=f"Bearer {KEY}",
    )
    assert KEY not in repr(view)  # credentials are never shown
    registry.unsubscribe(recorder)
    registry.remove(a.id)
    assert recorder.calls[-1] == ("removed", b.id)


async def test_the_index_follows_the_registry() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    health = quiet_health(failure_threshold=1)
    async with fleet(a, b) as f, kvgate(f.urls[:1], health=health) as gw:
        index = gw.gateway.index
        assert index is not None

        def known() -> dict[str, Any]:
            assert index is not None
            workers: dict[str, Any] = index.stats()["workers"]
            return workers

        assert list(known()) == [f.urls[0]] and known()[f.urls[0]]["healthy"] is True
        assert (await gw.client.post("/admin/workers", json={"url": f.urls[1]})).status_code == 201
        assert list(known()) == f.urls and known()[f.urls[1]]["healthy"] is True
        b.healthy = False
        await gw.gateway.health.probe_all()
        assert known()[f.urls[1]]["healthy"] is False
        b.healthy = True
        await gw.gateway.health.probe_all()
        assert known()[f.urls[1]]["healthy"] is True
        gone = await gw.client.delete(f"/admin/workers/{quote(f.urls[1], safe='')}")
        assert gone.status_code == 200
        assert list(known()) == [f.urls[0]]


async def test_engine_tokenize_asks_only_healthy_workers() -> None:
    """The /tokenize fallback (no tokenizer configured) skips workers marked unhealthy: it is
    on the request path, and an unhealthy worker would only cost its timeout."""
    a, b = FakeEngine("a", tokenize=True), FakeEngine("b", tokenize=True)
    async with (
        fleet(a, b) as f,
        kvgate(f.urls, health=quiet_health(failure_threshold=1)) as gw,
    ):
        engines = dict(zip(f.urls, (a, b), strict=True))

        def tokenized(engine: FakeEngine) -> int:
            return sum(1 for s in engine.seen if s.path == "/tokenize")

        assert (await gw.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        (asked,) = [url for url, engine in engines.items() if tokenized(engine)]  # one asked
        (other,) = set(f.urls) - {asked}
        engines[asked].healthy = False
        await gw.gateway.health.probe_all()
        for i in range(2):  # new prompts (a prompt keyed before is not asked again)
            body = {**CHAT, "messages": [{"role": "user", "content": f"prompt {i} " * 8}]}
            answer = await gw.client.post("/v1/chat/completions", json=body)
            assert answer.headers["x-kvgate-worker"] == other
        assert (tokenized(engines[asked]), tokenized(engines[other])) == (1, 2)
        engine_mode = {"model": "fake-model", "mode": "engine"}
        assert gw.metric("kvgate_tokenize_total", engine_mode) == 3


async def test_engine_calls_carry_the_workers_credentials() -> None:
    sources = {"0": {"publisher": "zmq", "endpoint": "tcp://*:5999"}}
    engine = FakeEngine(tokenize=True, sources=sources)
    async with fleet(engine) as f, kvgate([f"{f.urls[0]},api_key={KEY}"]) as gw:
        assert (await gw.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        calls = {s.path: s.headers.get("authorization") for s in engine.seen}
        assert calls["/kv_event_sources"] == f"Bearer {KEY}"
        assert calls["/tokenize"] == f"Bearer {KEY}"


@pytest.mark.parametrize(
    ("declared", "allow", "subscribed"),
    [
        ("tcp://127.0.0.2:5999", "127.0.0.1/32", False),  # another host the rules refuse
        ("tcp://127.0.0.2:5999", "127.0.0.0/8", True),  # another host the rules admit
        ("tcp://*:5999", "127.0.0.1/32", True),  # the worker's own host
        ("ipc:///tmp/kvgate-events", "127.0.0.0/8", True),  # a loopback worker: kvgate's host
    ],
)
async def test_declared_event_endpoints_pass_the_allowlist(
    declared: str, allow: str, subscribed: bool
) -> None:
    """What a vLLM worker declares at GET /kv_event_sources is subscribed to only on its own
    host or where --worker-allow admits it: a worker cannot point kvgate anywhere it likes."""
    sources = {"0": {"publisher": "zmq", "endpoint": declared}}
    engine = FakeEngine(sources=sources)
    async with fleet(engine) as f, kvgate(f.urls, worker_allow=[allow]) as gw:
        assert gw.gateway.index is not None
        described = gw.gateway.index.stats()["workers"][f.urls[0]]
        assert described["mode"] == ("events" if subscribed else "approx")
