"""A KV-event publisher for tests with vLLM's framing and a real ROUTER replay socket.

XPUB instead of PUB (wire-identical for subscribers) so that a test can wait until the
subscription has arrived instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import zmq
import zmq.asyncio

from kvgate.index.events import EventBatch, EventEncoder, KvEvent

END = (0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")


class KvPublisher:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        *,
        topic: bytes = b"kv-events",
        array_tagged: bool = False,
        ring: int = 10_000,
        bind: tuple[int, int] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.topic = topic
        self.array_tagged = array_tagged
        address = f"[{host}]" if ":" in host else host
        self.pub = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.IPV6, int(":" in host))
        if bind is None:
            port = self.pub.bind_to_random_port(f"tcp://{address}")
        else:
            port = bind[0]
            self.pub.bind(f"tcp://{address}:{port}")
        self.events_endpoint = f"tcp://{address}:{port}"
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.IPV6, int(":" in host))
        if bind is None:
            port = self.router.bind_to_random_port(f"tcp://{address}")
        else:
            port = bind[1]
            self.router.bind(f"tcp://{address}:{port}")
        self.replay_endpoint = f"tcp://{address}:{port}"
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=ring)
        self.subscribed = asyncio.Event()
        self.replay_requests: list[int] = []
        self._tasks = [
            asyncio.create_task(self._serve_replay()),
            asyncio.create_task(self._watch_subscriptions()),
        ]

    async def _watch_subscriptions(self) -> None:
        while True:
            message = await self.pub.recv()
            if message[:1] == b"\x01":
                self.subscribed.set()

    async def _serve_replay(self) -> None:
        while True:
            identity, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart(
                        [identity, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([identity, b"", b"", END, b""])

    async def send_raw(self, payload: bytes, *, drop: bool = False) -> int:
        """Publish (or, with ``drop``, only buffer: a gap for the subscriber) one payload."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def publish(
        self, *events: KvEvent, drop: bool = False, dp_rank: int | None = None, ts: float = 0.0
    ) -> int:
        batch = EventBatch(ts, list(events), dp_rank)
        return await self.send_raw(
            EventEncoder(array_tagged=self.array_tagged).encode(batch), drop=drop
        )

    def restart(self) -> None:
        """Engine restart as seen on the wire: seq back to 0, replay ring emptied."""
        self.seq = 0
        self.buffer.clear()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.pub.close(linger=0)
        self.router.close(linger=0)
