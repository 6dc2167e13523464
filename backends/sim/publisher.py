"""vLLM's ZMQ KV-event publisher: a PUB socket, a replay ROUTER socket and a ring buffer.

* PUB frames: ``[topic, seq (u64 big-endian), payload]``; ``seq`` counts batches from 0 and
  starts again at 0 after a restart (``reset``).
* Replay: a DEALER sends ``[b"", start_seq]``; the ROUTER answers ``[b"", topic, seq,
  payload]`` for every buffered batch with ``seq >= start_seq`` (ring of the last
  ``buffer_steps`` batches, at most ``buffer_bytes``), then ``[b"", b"", -1 (0xff * 8), b""]``.
* Faults: a dropped batch consumes its ``seq`` (subscribers see a gap) and, if replayable,
  stays in the ring; a delayed batch goes out ``delay_s`` later, batches keep their order;
  while the stream is stopped (``stop_events``: a wedged publisher) batches vanish without
  taking a ``seq`` (no gap to see once it resumes) and replay requests get no answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvgate.backends.sim.config import EventsConfig
from kvgate.backends.sim.faults import FaultState
from kvgate.backends.sim.metrics import ReplicaMetrics
from kvgate.index.events import EventBatch, EventEncoder, KvEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)
log = logging.getLogger(__name__)


def zmq_endpoint(host: str, port: int) -> str:
    """``tcp://host:port`` (``*`` port = ephemeral; IPv6 hosts bracketed)."""
    shown = f"[{host}]" if ":" in host else host
    return f"tcp://{shown}:{port if port else '*'}"


class EventPublisher:
    """Publishes one replica's KV-event batches and serves replays."""

    def __init__(
        self,
        config: EventsConfig,
        faults: FaultState,
        metrics: ReplicaMetrics,
        clock: Callable[[], float],
        dp_rank: int = 0,
    ) -> None:
        self._config = config
        self._dp_rank = dp_rank  # written in every batch, as vLLM does
        self._faults = faults
        self._metrics = metrics
        self._clock = clock
        self._encoder = EventEncoder(
            array_tagged=config.encoding == "array", bytes_hashes=config.hash_format == "bytes"
        )
        self._topic = config.topic.encode()
        self._ring: deque[tuple[int, bytes]] = deque()
        self._ring_bytes = 0
        self._delayed: deque[tuple[float, int, bytes]] = deque()
        self._next_seq = 0
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.endpoint = ""
        self.replay_endpoint = ""

    @property
    def next_seq(self) -> int:
        """The seq the next batch will get (= batches since start or restart)."""
        return self._next_seq

    async def start(
        self, ctx: zmq.asyncio.Context, host: str, pub_port: int, replay_port: int
    ) -> None:
        pub: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._config.hwm)
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            for sock in (pub, router):
                sock.setsockopt(zmq.IPV6, int(":" in host))
            pub.bind(zmq_endpoint(host, pub_port))
            router.bind(zmq_endpoint(host, replay_port))
        except zmq.ZMQError:
            pub.close(linger=0)
            router.close(linger=0)
            raise
        self._pub, self._router = pub, router
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay_task = asyncio.create_task(self._serve_replay(router))

    async def stop(self) -> None:
        for task in (self._replay_task, self._drain_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._replay_task = self._drain_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    @property
    def pending_delayed(self) -> int:
        """Batches held back by a ``delay_events`` fault."""
        return len(self._delayed)

    def release_delayed(self) -> None:
        """Publish every held-back batch now, in order (the delay fault was cleared)."""
        while self._delayed:
            _, seq, payload = self._delayed.popleft()
            self._send(seq, payload)

    def reset(self) -> None:
        """Engine restart: seq back to 0, ring and pending delayed batches forgotten."""
        self._next_seq = 0
        self._ring.clear()
        self._ring_bytes = 0
        self._delayed.clear()

    def _keep(self, seq: int, payload: bytes) -> None:
        """Into the replay ring: the last ``buffer_steps`` batches, within ``buffer_bytes``
        (the newest batch is kept whatever its size)."""
        ring = self._ring
        ring.append((seq, payload))
        self._ring_bytes += len(payload)
        limit_steps, limit_bytes = self._config.buffer_steps, self._config.buffer_bytes
        while ring and (
            len(ring) > limit_steps or (self._ring_bytes > limit_bytes and len(ring) > 1)
        ):
            self._ring_bytes -= len(ring.popleft()[1])

    def publish(self, events: list[KvEvent]) -> None:
        if self._faults.active("stop_events") is not None:
            self._metrics.on_batch("stopped")
            return
        payload = self._encoder.encode(EventBatch(time.time(), events, self._dp_rank))
        seq = self._next_seq
        self._next_seq += 1
        dropped = self._faults.hit("drop_events")
        if dropped is not None:
            if dropped.replayable:
                self._keep(seq, payload)
            self._metrics.on_fault("drop_events")
            self._metrics.on_batch("dropped" if dropped.replayable else "lost")
            return
        delay = self._faults.event_delay()
        if delay > 0 or self._delayed:
            self._delayed.append((self._clock() + delay, seq, payload))
            self._metrics.on_batch("delayed")
            if self._drain_task is None or self._drain_task.done():
                self._drain_task = asyncio.create_task(self._drain())
            return
        self._send(seq, payload)

    def _send(self, seq: int, payload: bytes) -> None:
        if self._pub is None:
            return
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        self._keep(seq, payload)
        self._metrics.on_batch("published")

    async def _drain(self) -> None:
        while self._delayed:
            due, seq, payload = self._delayed[0]
            wait = due - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            self._delayed.popleft()
            self._send(seq, payload)

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed replay request (%d frames)", len(frames))
                self._metrics.on_replay("malformed")
                continue
            if self._faults.active("stop_events") is not None:
                self._metrics.on_replay("ignored")  # a wedged publisher answers nothing
                continue
            self._metrics.on_replay("served")
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in [item for item in self._ring if item[0] >= first]:
                await router.send_multipart(
                    [identity, b"", self._topic, seq.to_bytes(8, "big"), payload]
                )
            await router.send_multipart([identity, b"", b"", END_SEQ, b""])
