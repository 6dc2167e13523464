"""The simulator's KV events, read by kvgate's real decoder over real ZMQ sockets, rebuild
exactly the replica's cache: long random sessions, eviction, preemption, CPU offload, both
encodings, byte hashes, topics and the replay socket."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import httpx
import pytest
import zmq.asyncio
from fakes.wait import wait_until
from test_sim_support import EventLog, expected, rebuild, replay, sim_config, sim_fleet

from kvgate.index.events import BlockRemoved, BlockStored, decode_event_batch

pytestmark = pytest.mark.anyio


async def _random_session(url: str, rng: random.Random, requests: int, max_len: int) -> None:
    """Completions (token ids) and chats drawn from shared prefixes, a few at a time."""
    prefixes = [[rng.randrange(100, 30_000) for _ in range(rng.randrange(8, 60))] for _ in range(6)]

    def body() -> dict[str, object]:
        max_tokens = rng.randrange(1, 7)
        if rng.random() < 0.25:
            words = " ".join(f"w{rng.randrange(40)}" for _ in range(rng.randrange(1, 30)))
            return {"messages": [{"role": "user", "content": words}], "max_tokens": max_tokens}
        prompt = list(rng.choice(prefixes)) + [
            rng.randrange(100, 30_000) for _ in range(rng.randrange(0, 40))
        ]
        return {"prompt": prompt[: max_len - max_tokens], "max_tokens": max_tokens}

    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        sent = 0
        while sent < requests:
            wave = [body() for _ in range(rng.randrange(1, 9))]
            sent += len(wave)
            replies = await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions" if "messages" in b else "/v1/completions", json=b
                    )
                    for b in wave
                )
            )
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]


@pytest.mark.parametrize(
    ("encoding", "cpu_blocks", "hash_format"),
    [("map", 0, "int"), ("array", 0, "int"), ("map", 24, "int"), ("array", 24, "bytes")],
)
async def test_events_rebuild_the_cache_over_a_long_random_session(
    encoding: str, cpu_blocks: int, hash_format: str
) -> None:
    config = sim_config(
        capacity_blocks=40,
        block_size=4,
        cpu_blocks=cpu_blocks,
        encoding=encoding,
        hash_format=hash_format,
    )
    async with sim_fleet(config) as fleet:
        replica = fleet.replica(0)
        url, events, replay_endpoint = fleet.replicas[0]
        async with EventLog(events, replay_endpoint) as log:
            rng = random.Random(f"{encoding}{cpu_blocks}{hash_format}")
            await _random_session(url, rng, 220, config.engine.effective_max_model_len)
            await wait_until(replica.idle, what="replica idle")
            await log.complete(replica.publisher.next_seq)
            assert log.rebuild() == expected(replica.snapshot())
            decoded = [decode_event_batch(p).events for p in log.batches.values()]
            flat = [e for events_ in decoded for e in events_]
    removed = [e for e in flat if isinstance(e, BlockRemoved)]
    assert removed, "the session was meant to evict"
    if cpu_blocks:
        assert any(isinstance(e, BlockStored) and e.medium == "CPU" for e in flat)
        assert any(e.medium == "CPU" for e in removed)
        assert replica.snapshot().cpu
    assert replica.engine.cache.free_blocks == config.engine.capacity_blocks


async def test_preempted_requests_finish_and_events_stay_exact() -> None:
    config = sim_config(capacity_blocks=24, block_size=4, max_num_batched_tokens=16)
    async with sim_fleet(config) as fleet:
        replica = fleet.replica(0)
        url, events, replay_endpoint = fleet.replicas[0]
        async with (
            EventLog(events, replay_endpoint) as log,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            bodies = [
                {"prompt": [200 + 7 * i + k for k in range(30)], "max_tokens": 40} for i in range(6)
            ]
            replies = await asyncio.gather(
                *(client.post("/v1/completions", json=b) for b in bodies)
            )
            assert [r.json()["usage"]["completion_tokens"] for r in replies] == [40] * 6
            await wait_until(replica.idle)
            await log.complete(replica.publisher.next_seq)
            assert log.rebuild() == expected(replica.snapshot())
    preemptions = replica.registry.get_sample_value(
        "vllm:num_preemptions_total", {"model_name": "kvgate-sim", "engine": "0"}
    )
    assert preemptions and preemptions > 0


@pytest.mark.parametrize("topic", ["", "custom-topic"])
async def test_topic_frame_is_configurable(topic: str) -> None:
    async with sim_fleet(sim_config(topic=topic)) as fleet:
        replica = fleet.replica(0)
        url, events, replay_endpoint = fleet.replicas[0]
        sources = replica.kv_event_sources()
        assert sources["0"]["topic"] == topic
        async with EventLog(events, replay_endpoint, topic.encode()) as log:
            async with httpx.AsyncClient(base_url=url) as client:
                for i in range(200):  # until the subscription is live (ZMQ slow joiner)
                    reply = await client.post(
                        "/v1/completions", json={"prompt": [100 + i] * 20, "max_tokens": 2}
                    )
                    assert reply.status_code == 200
                    await wait_until(replica.idle)
                    if log.received:
                        break
            await log.complete(replica.publisher.next_seq)
            assert log.topics == {topic.encode()}
            assert log.rebuild() == expected(replica.snapshot())


async def test_replay_serves_missed_batches_from_any_seq() -> None:
    async with sim_fleet(sim_config()) as fleet:
        replica = fleet.replica(0)
        url, events, replay_endpoint = fleet.replicas[0]
        async with httpx.AsyncClient(base_url=url) as client:
            for i in range(5):
                reply = await client.post(
                    "/v1/completions", json={"prompt": [300 + i] * 12, "max_tokens": 3}
                )
                assert reply.status_code == 200
        await wait_until(replica.idle)
        total = replica.publisher.next_seq
        assert total >= 5
        ctx = zmq.asyncio.Context()
        try:
            everything = await replay(ctx, replay_endpoint, 0)
            tail = await replay(ctx, replay_endpoint, total - 2)
            none = await replay(ctx, replay_endpoint, total + 100)
        finally:
            ctx.term()
        assert [seq for _, seq, _ in everything] == list(range(total))
        assert [seq for _, seq, _ in tail] == [total - 2, total - 1]
        assert none == []
        state = rebuild([payload for _, _, payload in everything])
        assert state == expected(replica.snapshot())
        # a subscriber that joins late catches up through replay alone
        async with EventLog(events, replay_endpoint) as late:
            await late.complete(total)
            assert late.received == []
            assert late.rebuild() == expected(replica.snapshot())


async def test_replay_ring_is_bounded_by_steps_and_bytes() -> None:
    base = sim_config()
    for events in (replace(base.events, buffer_steps=3), replace(base.events, buffer_bytes=1)):
        async with sim_fleet(replace(base, events=events)) as fleet:
            replica = fleet.replica(0)
            url, _, replay_endpoint = fleet.replicas[0]
            async with httpx.AsyncClient(base_url=url) as client:
                for i in range(4):
                    body = {"prompt": [400 + i] * 12, "max_tokens": 3}
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
            await wait_until(replica.idle)
            ctx = zmq.asyncio.Context()
            try:
                kept = [seq for _, seq, _ in await replay(ctx, replay_endpoint, 0)]
            finally:
                ctx.term()
            last = replica.publisher.next_seq - 1
            expected_seqs = list(range(last - 2, last + 1)) if events.buffer_steps == 3 else [last]
            assert kept == expected_seqs
