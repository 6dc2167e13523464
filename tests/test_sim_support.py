"""Helpers of the simulator tests (no tests here): fleets, condition waits, event logs.

``EventLog`` subscribes to a replica's real PUB socket, fills seq gaps through the real replay
socket, and rebuilds the cache from kvgate's own decoder (``index.events``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from types import TracebackType
from typing import Any

import httpx
import zmq
import zmq.asyncio

from kvgate.backends.sim.cache import CacheSnapshot
from kvgate.backends.sim.config import (
    ApiConfig,
    EngineConfig,
    EventsConfig,
    SimConfig,
    TimingConfig,
)
from kvgate.backends.sim.fleet import SimFleet
from kvgate.backends.sim.tokenizer import SimTokenizer
from kvgate.index.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_event_batch

END_SEQ = 2**64 - 1
Rebuilt = dict[str, dict[int, tuple[int | None, tuple[int, ...]]]]


def sim_config(
    *,
    replicas: int = 1,
    capacity_blocks: int = 4096,
    block_size: int = 4,
    cpu_blocks: int = 0,
    encoding: str = "map",
    topic: str = "kv-events",
    hash_format: str = "int",
    speedup: float = 1000.0,
    api: ApiConfig | None = None,
    **engine: Any,
) -> SimConfig:
    """A fleet on ephemeral loopback ports, fast (speed-up) and small."""
    return SimConfig(
        replicas=replicas,
        port=0,
        events_port=0,
        engine=replace(
            EngineConfig(),
            capacity_blocks=capacity_blocks,
            block_size=block_size,
            cpu_offload_blocks=cpu_blocks,
            **engine,
        ),
        timing=TimingConfig(speedup=speedup),
        events=EventsConfig(encoding=encoding, topic=topic, hash_format=hash_format),  # type: ignore[arg-type]
        api=api or ApiConfig(),
    )


@functools.cache
def shared_tokenizer() -> SimTokenizer:
    """One tokenizer for every test fleet (loading it is the slow part of a fleet start)."""
    return SimTokenizer.default()


def sim_fleet(config: SimConfig) -> SimFleet:
    return SimFleet(config, tokenizer=shared_tokenizer())


async def sse_lines(reply: httpx.Response) -> AsyncIterator[str]:
    """The non-empty lines of an SSE body as they arrive."""
    async for line in reply.aiter_lines():
        if line:
            yield line


async def fault(client: httpx.AsyncClient, **body: object) -> dict[str, Any]:
    """``POST /sim/fault`` (must succeed)."""
    reply = await client.post("/sim/fault", json=body)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


async def refused(url: str) -> bool:
    """Connections to ``url`` are refused (not accepted-then-dropped while a listener closes)."""
    async with httpx.AsyncClient(timeout=2) as c:
        try:
            await c.get(f"{url}/health")
        except httpx.ConnectError:
            return True
        except httpx.TransportError:
            return False
    return False


async def healthy(url: str) -> bool:
    async with httpx.AsyncClient(timeout=2) as c:
        try:
            return (await c.get(f"{url}/health")).status_code == 200
        except httpx.TransportError:  # refused, or dropped while the listener changes
            return False


async def replay(
    ctx: zmq.asyncio.Context, endpoint: str, start: int
) -> list[tuple[bytes, int, bytes]]:
    """Ask a replay socket for every buffered batch from ``start`` on (until the end mark)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out: list[tuple[bytes, int, bytes]] = []
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not await dealer.poll(5000):
                raise AssertionError("replay socket did not answer")
            frames = await dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            seq = int.from_bytes(frames[2], "big")
            if seq == END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                return out
            out.append((frames[1], seq, frames[3]))
    finally:
        dealer.close(linger=0)


class EventLog:
    """Every batch of one replica's current event stream, by seq (gaps filled by replay)."""

    def __init__(self, events: str, replay_endpoint: str, topic: bytes = b"kv-events") -> None:
        self.events_endpoint = events
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.batches: dict[int, bytes] = {}
        self.topics: set[bytes] = set()
        self.received: list[int] = []
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EventLog:
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.events_endpoint)
        self._task = asyncio.create_task(self._receive())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sub.close(linger=0)
        self._ctx.term()

    async def _receive(self) -> None:
        while True:
            topic, seq, payload = await self._sub.recv_multipart()
            self.topics.add(topic)
            number = int.from_bytes(seq, "big")
            self.received.append(number)
            self.batches[number] = payload

    def forget(self) -> None:
        """Start over (after an engine restart, seq counts from 0 again)."""
        self.batches.clear()
        self.received.clear()

    async def complete(self, next_seq: int, limit_s: float = 10.0) -> None:
        """Wait until seqs 0 .. next_seq - 1 are all here, replaying what PUB missed."""
        deadline = time.monotonic() + limit_s
        while True:
            missing = [s for s in range(next_seq) if s not in self.batches]
            if not missing:
                return
            for topic, seq, payload in await replay(self._ctx, self.replay_endpoint, missing[0]):
                assert topic == self.topic
                self.batches.setdefault(seq, payload)
            if time.monotonic() > deadline:
                raise AssertionError(f"batches {missing[:5]}... never arrived")
            await asyncio.sleep(0.005)

    def rebuild(self, upto: int | None = None) -> Rebuilt:
        """The cache as kvgate's decoder reads it: applies every batch in seq order (only
        seqs below ``upto`` when given: after a restart, a batch of the old generation can
        still arrive late, under a seq the new one has not reached)."""
        seqs = sorted(s for s in self.batches if upto is None or s < upto)
        return rebuild([self.batches[s] for s in seqs])


def rebuild(payloads: list[bytes]) -> Rebuilt:
    """Apply decoded batches; checks that removals and parents always refer to known blocks."""
    state: Rebuilt = {"GPU": {}, "CPU": {}}
    for payload in payloads:
        for event in decode_event_batch(payload).events:
            if isinstance(event, BlockStored):
                tier = state[event.medium or "GPU"]
                parent = event.parent_block_hash
                if parent is not None:
                    assert parent in state["GPU"] or parent in state["CPU"], "orphan store"
                size = event.block_size
                for i, h in enumerate(event.block_hashes):
                    tokens = tuple(event.tokens()[i * size : (i + 1) * size])
                    tier[int(h)] = (parent, tokens)
                    parent = h
            elif isinstance(event, BlockRemoved):
                tier = state[event.medium or "GPU"]
                for h in event.block_hashes:
                    assert h in tier, "removal of a block that is not cached"
                    del tier[h]
            elif isinstance(event, AllBlocksCleared):
                for tier in state.values():
                    tier.clear()
    return state


def expected(snapshot: CacheSnapshot) -> Rebuilt:
    return {
        "GPU": {h: (m.parent, m.token_ids) for h, m in snapshot.gpu.items()},
        "CPU": {h: (m.parent, m.token_ids) for h, m in snapshot.cpu.items()},
    }
