"""Each simulated fault behaves as docs/simulator.md says (real HTTP and ZMQ, no sleeps)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest
import zmq.asyncio
from fakes.wait import wait_until
from test_sim_support import (
    EventLog,
    expected,
    fault,
    healthy,
    refused,
    replay,
    sim_config,
    sim_fleet,
)

from kvgate.backends.sim.config import StartupFaults
from kvgate.backends.sim.faults import FaultError
from kvgate.backends.sim.fleet import SimFleet
from kvgate.index.events import AllBlocksCleared, decode_event_batch

pytestmark = pytest.mark.anyio
LABELS = {"model_name": "kvgate-sim", "engine": "0"}


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(sim_config(replicas=2, block_size=4)) as f:
        yield f


async def _complete(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int = 2
) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})


async def _live(log: EventLog, client: httpx.AsyncClient, fleet: SimFleet) -> None:
    """Send small requests until the subscriber receives batches live (ZMQ slow joiner)."""
    for i in range(200):
        assert (await _complete(client, [50 + i] * 5)).status_code == 200
        await wait_until(fleet.replica(0).idle)
        if log.received:
            return
    raise AssertionError("subscription never became live")


async def test_fail_answers_errors_for_count_requests(fleet: SimFleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        await fault(c, kind="fail", count=2, status=503)
        statuses = [(await _complete(c, [7] * 6)).status_code for _ in range(3)]
        assert statuses == [503, 503, 200]
        await fault(c, kind="fail")  # rate 1, until cleared
        reply = await _complete(c, [7] * 6)
        assert reply.status_code == 500
        assert reply.json()["error"]["code"] == 500
        await fault(c, kind="clear", fault="fail")
        assert (await _complete(c, [7] * 6)).status_code == 200
    assert fleet.replica(0).faults.hits["fail"] == 3


async def test_startup_fail_rate_from_config() -> None:
    config = replace(sim_config(), faults=StartupFaults(fail_rate=1.0))
    async with sim_fleet(config) as fleet, httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        assert (await _complete(c, [1, 2, 3])).status_code == 500


async def test_dropped_batches_leave_a_gap_that_replay_fills(fleet: SimFleet) -> None:
    replica = fleet.replica(0)
    url, events, replay_endpoint = fleet.replicas[0]
    async with EventLog(events, replay_endpoint) as log, httpx.AsyncClient(base_url=url) as c:
        await _live(log, c, fleet)
        await fault(c, kind="drop_events", count=1)
        dropped = replica.publisher.next_seq
        assert (await _complete(c, list(range(200, 230)), max_tokens=3)).status_code == 200
        await wait_until(replica.idle)
        await wait_until(lambda: log.received[-1] == replica.publisher.next_seq - 1)
        assert dropped not in log.received  # a seq gap for subscribers
        await log.complete(replica.publisher.next_seq)  # ... that replay covers
        assert log.rebuild() == expected(replica.snapshot())


async def test_lost_batches_are_missing_from_replay_too(fleet: SimFleet) -> None:
    replica = fleet.replica(0)
    url, events, replay_endpoint = fleet.replicas[0]
    async with EventLog(events, replay_endpoint) as log, httpx.AsyncClient(base_url=url) as c:
        await _live(log, c, fleet)
        await fault(c, kind="drop_events", count=1, replayable=False)
        lost = replica.publisher.next_seq
        assert (await _complete(c, list(range(300, 330)), max_tokens=3)).status_code == 200
        await wait_until(replica.idle)
        ctx = zmq.asyncio.Context()
        try:
            served = [seq for _, seq, _ in await replay(ctx, replay_endpoint, lost)]
        finally:
            ctx.term()
        assert served and served[0] == lost + 1
    lost_count = replica.registry.get_sample_value(
        "kvgate_sim_event_batches_total", {"outcome": "lost"}
    )
    assert lost_count == 1


async def test_delayed_batches_are_held_then_published_in_order(fleet: SimFleet) -> None:
    replica = fleet.replica(0)
    url, events, replay_endpoint = fleet.replicas[0]
    async with EventLog(events, replay_endpoint) as log, httpx.AsyncClient(base_url=url) as c:
        await _live(log, c, fleet)
        before = replica.publisher.next_seq
        await fault(c, kind="delay_events", delay_s=3600)
        assert (await _complete(c, list(range(400, 420)), max_tokens=3)).status_code == 200
        await wait_until(replica.idle)
        held = replica.publisher.pending_delayed
        assert held == replica.publisher.next_seq - before > 0
        assert max(log.received) < before
        await fault(c, kind="clear", fault="delay_events")  # releases what was held
        assert replica.publisher.pending_delayed == 0
        await wait_until(lambda: max(log.received) == replica.publisher.next_seq - 1)
        assert log.received == sorted(log.received)
        await log.complete(replica.publisher.next_seq)
        assert log.rebuild() == expected(replica.snapshot())


async def test_slow_multiplies_modelled_step_time(fleet: SimFleet) -> None:
    engine = fleet.replica(0).engine
    async with httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        start = engine.busy_s
        assert (await _complete(c, [11] * 7, max_tokens=3)).status_code == 200
        normal = engine.busy_s - start
        state = await fault(c, kind="slow", factor=3)
        assert state["faults"] == [
            {"kind": "slow", "rate": 1.0, "count": None, "until": None, "value": 3.0,
             "replayable": True, "drop": False}
        ]  # fmt: skip
        start = engine.busy_s
        assert (await _complete(c, [12] * 7, max_tokens=3)).status_code == 200
        slowed = engine.busy_s - start
    assert slowed == pytest.approx(3 * normal)


async def test_restart_fails_requests_resets_cache_and_seq() -> None:
    async with sim_fleet(sim_config(block_size=4, speedup=1.0)) as fleet:
        replica = fleet.replica(0)
        url, events, replay_endpoint = fleet.replicas[0]
        prompt = list(range(500, 540))
        async with (
            EventLog(events, replay_endpoint) as log,
            httpx.AsyncClient(base_url=url, timeout=30) as c,
        ):
            assert (await _complete(c, prompt)).status_code == 200
            old_hashes = set(replica.snapshot().gpu)
            body = {"prompt": [9] * 8, "max_tokens": 5000, "stream": True}
            lines = []
            async with c.stream("POST", "/v1/completions", json=body) as stream:
                async for line in stream.aiter_lines():
                    lines.append(line)
                    if len(lines) == 1:
                        await fault(c, kind="restart")
            errors = [json.loads(x[6:]) for x in lines if x.startswith('data: {"error"')]
            assert errors and errors[0]["error"]["code"] == 500
            assert [x for x in lines if x][-1] == "data: [DONE]"
            assert replica.generation == 1
            assert replica.publisher.next_seq == 0
            assert replica.snapshot().gpu == {}
            log.forget()
            again = await _complete(c, prompt)
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await wait_until(replica.idle)
            next_seq = replica.publisher.next_seq
            await log.complete(next_seq)  # seq counts from 0 again
            assert log.rebuild(upto=next_seq) == expected(replica.snapshot())
            assert not old_hashes & set(replica.snapshot().gpu)  # a new hash seed


async def test_restart_with_downtime_refuses_connections_for_a_while(fleet: SimFleet) -> None:
    url = fleet.replicas[0].url
    async with httpx.AsyncClient(base_url=url) as c:
        await fault(c, kind="restart", downtime_s=0.3)
    await wait_until(lambda: refused(url), what="connections refused")
    await wait_until(lambda: healthy(url), what="the replica back")
    assert fleet.replica(0).generation == 1


async def test_refuse_until_resume_keeps_the_cache(fleet: SimFleet) -> None:
    replica = fleet.replica(0)
    url = fleet.replicas[0].url
    async with httpx.AsyncClient(base_url=url) as c:
        assert (await _complete(c, list(range(600, 620)))).status_code == 200
        cached = replica.snapshot()
        await fault(c, kind="refuse")
    await wait_until(lambda: refused(url), what="connections refused")
    assert not replica.http_up
    await replica.resume()
    assert await healthy(url)
    assert replica.snapshot() == cached
    async with httpx.AsyncClient(base_url=url) as c:
        reply = await _complete(c, list(range(600, 620)))
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


async def test_admin_of_one_replica_can_target_another(fleet: SimFleet) -> None:
    down = fleet.replicas[0].url
    async with httpx.AsyncClient(base_url=fleet.replicas[1].url) as c:
        # long enough that a poll delayed on a busy machine still sees the refusal
        result = await fault(c, kind="refuse", replica=0, duration_s=2.0)
        assert result["replica"] == 0
        await wait_until(lambda: refused(down), what="replica 0 refusing")
        assert await healthy(fleet.replicas[1].url)
        await wait_until(lambda: healthy(down), what="replica 0 back after its duration")
        reply = await c.post("/sim/fault", json={"kind": "slow", "factor": 2, "replica": 9})
        assert reply.status_code == 400


async def test_reset_prefix_cache_sends_all_blocks_cleared(fleet: SimFleet) -> None:
    replica = fleet.replica(0)
    url, events, replay_endpoint = fleet.replicas[0]
    async with EventLog(events, replay_endpoint) as log, httpx.AsyncClient(base_url=url) as c:
        assert (await _complete(c, list(range(700, 740)))).status_code == 200
        assert replica.snapshot().gpu
        assert (await c.post("/reset_prefix_cache")).status_code == 200
        assert replica.snapshot().gpu == {}
        await wait_until(lambda: replica.publisher.next_seq > 0 and replica.idle())
        await log.complete(replica.publisher.next_seq)
        last = decode_event_batch(log.batches[replica.publisher.next_seq - 1])
        assert isinstance(last.events[-1], AllBlocksCleared)
        assert log.rebuild() == expected(replica.snapshot())
        assert (await fault(c, kind="reset_cache"))["reset"] is True


async def test_reset_is_refused_while_blocks_are_in_use() -> None:
    async with sim_fleet(sim_config(speedup=1.0)) as fleet:
        replica = fleet.replica(0)
        async with httpx.AsyncClient(base_url=fleet.replicas[0].url, timeout=30) as c:
            body = {"prompt": [3] * 10, "max_tokens": 5000, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as stream:
                async for _ in stream.aiter_lines():
                    reply = await c.post("/reset_prefix_cache")
                    assert reply.status_code == 409
                    break
        await wait_until(replica.idle)


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "explode"},
        {"kind": "fail", "rate": 2},
        {"kind": "fail", "status": 200},
        {"kind": "slow", "factor": 0},
        {"kind": "drop_events", "count": -1},
        {"kind": "drop_events", "replayable": "yes"},
        {"kind": "restart", "downtime_s": "soon"},
        {"kind": "clear", "fault": "everything"},
        {"kind": "slow", "replica": "one"},
    ],
)
async def test_malformed_fault_requests_are_rejected(
    fleet: SimFleet, body: dict[str, object]
) -> None:
    async with httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        reply = await c.post("/sim/fault", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == 400


async def test_stopped_event_stream_goes_silent_without_a_gap(fleet: SimFleet) -> None:
    """A wedged publisher: nothing published, no seq consumed, replays unanswered; once it
    resumes the seqs run on with no gap, so a subscriber cannot see what it missed."""
    replica = fleet.replica(0)
    url, events, replay_endpoint = fleet.replicas[0]
    async with EventLog(events, replay_endpoint) as log, httpx.AsyncClient(base_url=url) as c:
        await _live(log, c, fleet)
        before = replica.publisher.next_seq
        await fault(c, kind="stop_events")
        assert (await _complete(c, list(range(800, 840)), max_tokens=3)).status_code == 200
        await wait_until(replica.idle)
        assert replica.publisher.next_seq == before
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(replay_endpoint)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # ignored while stopped
            await wait_until(
                lambda: (
                    replica.registry.get_sample_value(
                        "kvgate_sim_replay_requests_total", {"outcome": "ignored"}
                    )
                    == 1
                ),
                what="the replay request received",
            )
            await fault(c, kind="clear", fault="stop_events")
            assert (await _complete(c, list(range(900, 920)), max_tokens=2)).status_code == 200
            await wait_until(replica.idle)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            ends = 0
            while ends == 0:
                assert await dealer.poll(5000), "the replay socket did not answer"
                frames = await dealer.recv_multipart()
                ends += frames[2] == b"\xff" * 8
            assert not await dealer.poll(0)  # one answer: the stopped-time request was dropped
        finally:
            dealer.close(linger=0)
            ctx.term()
        await wait_until(lambda: log.received[-1] == replica.publisher.next_seq - 1)
        assert log.received == list(range(log.received[0], replica.publisher.next_seq))
        await log.complete(replica.publisher.next_seq)
        missed = set(expected(replica.snapshot())["GPU"]) - set(log.rebuild()["GPU"])
        assert missed  # the blocks stored while stopped never reach the subscriber
    stopped = replica.registry.get_sample_value(
        "kvgate_sim_event_batches_total", {"outcome": "stopped"}
    )
    assert stopped is not None and stopped > 0


async def test_slow_prefill_stretches_prefill_steps_only(fleet: SimFleet) -> None:
    engine = fleet.replica(0).engine

    async def busy(prompt: list[int], max_tokens: int) -> float:
        start = engine.busy_s
        assert (await _complete(c, prompt, max_tokens=max_tokens)).status_code == 200
        return engine.busy_s - start

    async with httpx.AsyncClient(base_url=fleet.replicas[0].url) as c:
        prefill = await busy(list(range(1000, 2000)), 1)  # one 1000-token prefill step
        decode = await busy([3] * 5, 30)  # steps at the weight-read floor
        await fault(c, kind="slow_prefill", factor=4)
        slow_prefill = await busy(list(range(2000, 3000)), 1)
        slow_decode = await busy([4] * 5, 30)
    assert slow_prefill == pytest.approx(4 * prefill)
    assert slow_decode == pytest.approx(decode)


async def test_a_replica_split_off_is_the_same_replica(fleet: SimFleet) -> None:
    """``first_replica``: replica 1 run in a fleet of its own answers, hashes and seeds as
    replica 1 of the whole fleet does; the other index is not there to be faulted."""
    body = {"prompt": [7, 8, 9, 10, 11, 12, 13, 14, 15], "max_tokens": 4}
    alone = replace(sim_config(block_size=4), first_replica=1)
    async with sim_fleet(alone) as split, httpx.AsyncClient() as c:
        assert split.replica(1).index == 1
        with pytest.raises(FaultError, match="no replica 0 in this process"):
            split.replica(0)
        answers = []
        for f in (fleet, split):
            reply = await c.post(f"{f.replica(1).url}/v1/completions", json=body)
            assert reply.status_code == 200
            answers.append(reply.json()["choices"][0]["text"])
            await wait_until(f.replica(1).idle)
        assert answers[0] == answers[1]
        assert fleet.replica(1).snapshot() == split.replica(1).snapshot()
        state = (await c.get(f"{split.replicas[0].url}/sim/state")).json()
        assert state["replica"] == 1
