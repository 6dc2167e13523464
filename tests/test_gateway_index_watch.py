"""The index watch (router/index_watch.py): its decisions on a hand-driven clock, then kvgate
in front of simulated replicas whose event stream stops or who crash (real HTTP and ZMQ)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from fakes.gateway import Kvgate
from fakes.wait import wait_until
from prometheus_client import CollectorRegistry
from test_gateway_retry import CHAT, MODEL, PROMPT, replica_fault, sim_gateway
from test_sim_support import refused

from kvgate.backends.config import WorkerConfig
from kvgate.backends.registry import Worker, WorkerRegistry
from kvgate.index.types import WorkerId
from kvgate.router.config import IndexWatchConfig
from kvgate.router.index_watch import IndexWatch, IndexWatchMetrics
from kvgate.router.usage import Usage

BLOCK = 16


@dataclass
class Harness:
    """An ``IndexWatch`` whose clock, event progress and resubscriptions the test drives."""

    now: float = 100.0
    seq: int | None = 5
    watched: bool = True
    resubscribed: list[tuple[str, bool]] = field(default_factory=list)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def watch(self, **config: object) -> IndexWatch:
        return IndexWatch(
            IndexWatchConfig.model_validate({"silence_s": 10, "silent_requests": 3, **config}),
            self.progress,
            self.resync,
            IndexWatchMetrics(self.registry),
            clock=lambda: self.now,
        )

    def progress(self, worker: WorkerId) -> int | None:
        if not self.watched:
            raise LookupError(worker)
        return self.seq

    def resync(self, worker: WorkerId, replay: bool) -> bool:
        self.resubscribed.append((worker, replay))
        return True

    def resyncs(self, worker: Worker, reason: str) -> float:
        value = self.registry.get_sample_value(
            "kvgate_index_resyncs_total", {"worker": worker.url, "reason": reason}
        )
        return value or 0.0


def a_worker(registry: WorkerRegistry | None = None) -> Worker:
    registry = registry or WorkerRegistry()
    return registry.add(WorkerConfig(url="http://127.0.0.1:9001", models=["m"]))


STORED = Usage(prompt_tokens=100, cached_tokens=32)  # 6 full blocks, 2 cached: 4 stored
ALL_CACHED = Usage(prompt_tokens=100, cached_tokens=96)


def served(watch: IndexWatch, h: Harness, worker: Worker, usage: Usage = STORED) -> None:
    watch.on_served(worker, usage, BLOCK, h.now)


def test_silence_while_serving_drops_the_entries_once() -> None:
    h = Harness()
    watch, worker = h.watch(), a_worker()
    served(watch, h, worker)  # first sight of seq 5
    for _ in range(3):
        h.now += 4
        served(watch, h, worker)
    assert h.resubscribed == []  # 3 silent requests, but only 8 s of silence
    h.now += 4
    served(watch, h, worker)
    assert h.resubscribed == [(worker.id, False)]  # without replay
    assert h.resyncs(worker, "events_silent") == 1
    for _ in range(5):  # still silent: once is enough
        h.now += 20
        served(watch, h, worker)
    assert len(h.resubscribed) == 1
    h.seq = 0  # the new subscription got a live batch: watched again from there
    served(watch, h, worker)
    for _ in range(4):
        h.now += 5
        served(watch, h, worker)
    assert len(h.resubscribed) == 2


def test_late_events_and_cached_prompts_are_not_silence() -> None:
    h = Harness()
    watch, worker = h.watch(), a_worker()
    served(watch, h, worker)
    for _ in range(10):
        h.now += 5
        served(watch, h, worker, ALL_CACHED)  # nothing new stored: no event expected
    assert h.resubscribed == []
    for _ in range(10):  # events a few seconds late: each batch restarts the count
        h.now += 5
        served(watch, h, worker)
        h.seq = (h.seq or 0) + 1
    assert h.resubscribed == []
    h.watched = False  # several sources, or disconnected: not watched
    for _ in range(10):
        h.now += 5
        served(watch, h, worker)
    assert h.resubscribed == []
    assert watch._config.silence_s == 10


def test_requests_sent_before_the_last_batch_do_not_count() -> None:
    h = Harness()
    watch, worker = h.watch(silent_requests=1, silence_s=1), a_worker()
    watch.on_served(worker, STORED, BLOCK, h.now)
    h.seq = 6
    h.now += 5
    watch.on_served(worker, STORED, BLOCK, h.now)  # sees batch 6 arrive
    for _ in range(3):  # sent before batch 6 was seen, answered after: they prove nothing
        h.now += 5
        watch.on_served(worker, STORED, BLOCK, h.now - 20)
    assert h.resubscribed == []
    h.now += 5
    watch.on_served(worker, STORED, BLOCK, h.now - 2)
    assert h.resubscribed == [(worker.id, False)]


def test_a_worker_going_down_is_resynced_with_replay() -> None:
    h = Harness()
    watch = h.watch()
    registry = WorkerRegistry()
    registry.subscribe(watch)
    worker = a_worker(registry)
    registry.record_success(worker)  # up: nothing to do
    registry.record_failure(worker, "refused", immediate=True)
    assert h.resubscribed == [(worker.id, True)]
    assert h.resyncs(worker, "worker_down") == 1
    off = Harness()
    quiet = off.watch(resync_on_down=False)
    registry.subscribe(quiet)
    registry.record_success(worker)
    registry.record_failure(worker, "refused", immediate=True)
    assert off.resubscribed == []


# -- kvgate in front of simulated replicas ------------------------------------------------
async def overlap(gw: Kvgate, worker: str, body: dict[str, object]) -> int:
    explained = (await gw.client.post("/debug/route", json=body)).json()
    entry = next(w for w in explained["workers"] if w["worker"] == worker)
    return int(entry.get("overlap_tokens", 0))


def chat(text: str) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_replica_whose_events_stop_is_dropped_then_learns_live() -> None:
    watch = {"silence_s": 0.3, "silent_requests": 2}
    async with sim_gateway(replicas=1, index_watch=watch) as (fleet, gw):
        url = fleet.replicas[0].url
        await gw.client.post("/v1/chat/completions", json=CHAT)
        await wait_until(lambda: _indexed(gw, url, CHAT), what="the prompt indexed")
        await replica_fault(fleet, 0, kind="stop_events")
        resyncs = {"worker": url, "reason": "events_silent"}
        for i in range(400):  # new prompts store blocks; no event comes
            await gw.client.post("/v1/chat/completions", json=chat(f"{PROMPT} fresh{i}"))
            if gw.metric("kvgate_index_resyncs_total", resyncs):
                break
        assert gw.metric("kvgate_index_resyncs_total", resyncs) == 1
        await wait_until(lambda: _not_indexed(gw, url, CHAT), what="entries dropped")
        await replica_fault(fleet, 0, kind="clear", fault="stop_events")
        # a new prompt's chain is learnt from live events; what was cached before the
        # silence is not predicted any more (a replay would bring back a stale history)
        later = {**CHAT, "messages": [{"role": "system", "content": "new " + PROMPT}]}
        await gw.client.post("/v1/chat/completions", json=later)
        await wait_until(lambda: _indexed(gw, url, later), what="live events learnt")
        assert await overlap(gw, url, CHAT) == 0


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_crashed_replica_comes_back_without_its_old_entries() -> None:
    async with sim_gateway(replicas=2, policy="kv") as (fleet, gw):
        first = await gw.client.post("/v1/chat/completions", json=CHAT)
        owner = first.headers["x-kvgate-worker"]
        index = [r.url for r in fleet.replicas].index(owner)
        await wait_until(lambda: _indexed(gw, owner, CHAT), what="the prompt indexed")
        await replica_fault(fleet, 1 - index, kind="crash", replica=index, downtime_s=30)
        await wait_until(lambda: refused(owner), what="the crashed replica refusing")
        r = await gw.client.post("/v1/chat/completions", json=CHAT)  # refused: retried
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] != owner
        resyncs = {"worker": owner, "reason": "worker_down"}
        assert gw.metric("kvgate_index_resyncs_total", resyncs) == 1
        await wait_until(lambda: _not_indexed(gw, owner, CHAT), what="entries dropped")
        await replica_fault(fleet, 1 - index, kind="resume", replica=index)
        worker = gw.gateway.registry.get(owner)
        await gw.gateway.health.probe(worker)
        assert worker.healthy
        assert await overlap(gw, owner, CHAT) == 0  # nothing predicted on the empty engine
        await wait_until(lambda: gw.sent(owner).in_flight == 0)


async def _indexed(gw: Kvgate, worker: str, body: dict[str, object]) -> bool:
    return await overlap(gw, worker, body) > 0


async def _not_indexed(gw: Kvgate, worker: str, body: dict[str, object]) -> bool:
    return await overlap(gw, worker, body) == 0
