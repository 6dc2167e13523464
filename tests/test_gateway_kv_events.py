"""The gateway's built-in KV index end to end: engine KV events (real ZMQ) steer routing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import zmq
import zmq.asyncio
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate
from fakes.wait import wait_until

from kvgate.index.events import BlockStored, EventBatch, EventEncoder
from kvgate.index.types import EngineBlockHash

pytestmark = pytest.mark.anyio

PROMPT = list(range(100, 140))  # 40 token ids: two full blocks of 16


@asynccontextmanager
async def publisher() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.LINGER, 0)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield socket, f"tcp://127.0.0.1:{port}"
    finally:
        socket.close()
        context.term()


def stored(tokens: list[int]) -> bytes:
    hashes = [EngineBlockHash(1000 + i) for i in range(len(tokens) // 16)]
    event = BlockStored(hashes, None, tokens, 16, medium="GPU")
    return EventEncoder(array_tagged=False).encode(EventBatch(time.time(), [event]))


async def test_events_from_an_engine_route_its_prefix_to_it() -> None:
    async with (
        fleet(FakeEngine("a"), FakeEngine("b")) as f,
        publisher() as (_, events_a),
        publisher() as (pub_b, events_b),
    ):
        workers = [f"{f.urls[0]},events={events_a}", f"{f.urls[1]},events={events_b}"]
        async with kvgate(workers, policy="kv") as gw:
            assert gw.gateway.index is not None  # the built-in KvIndexService
            body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 1}
            seq = 0

            async def publish_until_indexed() -> None:
                nonlocal seq
                explained: dict[str, object] = {}

                def matched() -> bool:
                    return any(
                        w["worker"] == f.urls[1] and w["matched_blocks"]["gpu"] == 2
                        for w in explained.get("workers", [])  # type: ignore[union-attr]
                    )

                deadline = time.monotonic() + 10
                while not matched():
                    assert time.monotonic() < deadline, "events never reached the index"
                    await pub_b.send_multipart([b"", seq.to_bytes(8, "big"), stored(PROMPT[:32])])
                    seq += 1
                    explained = (await gw.client.post("/debug/route", json=body)).json()

            await publish_until_indexed()
            for _ in range(3):
                r = await gw.client.post("/v1/completions", json=body)
                assert r.status_code == 200
                assert r.headers["x-kvgate-worker"] == f.urls[1]
                assert r.headers["x-kvgate-predicted-cached-tokens"] == "32"
            labels = {"worker": f.urls[1], "model": "fake-model"}
            await wait_until(
                lambda: gw.metric("kvgate_predicted_cached_tokens_total", labels) == 96
            )
            assert gw.metric("kvgate_best_available_cached_tokens_total", labels) == 96
