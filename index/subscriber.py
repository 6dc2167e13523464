"""One ZMQ subscriber per event endpoint (one per worker data-parallel rank).

Frames are ``[topic, seq (u64 BE), payload]``. Sequence handling:

* on connect (and on the first batch seen with seq > 0) → replay from 0 to learn the engine's
  existing cache, so a fresh kvgate knows an idle engine's cache before its next batch;
* seq gap → replay the missing range through the engine's replay socket (DEALER → ROUTER:
  send ``[b"", start]``, receive ``[b"", topic, seq, payload]``... until seq = 2**64-1);
  a range the replay cannot cover → the worker's entries are cleared (no phantom hits);
* seq going back → the engine restarted: clear, then continue from the new stream;
* a stored block whose parent is unknown → with the full history it means events were lost:
  clear, as for a gap; with a partial history (joined late) the block cannot be keyed and is
  skipped and counted;
* undecodable payloads are counted, logged once per burst, and skipped.

Reconnects are ZMQ's own, with exponential backoff (``RECONNECT_IVL`` .. ``RECONNECT_IVL_MAX``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from index.config import IndexConfig
from index.ingest import BatchStatus, EventFeed
from index.metrics import IndexMetrics

log = logging.getLogger(__name__)

END_OF_REPLAY = 0xFFFFFFFFFFFFFFFF
_DRAIN_MAX = 256


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where one data-parallel rank of a worker publishes."""

    events: str
    replay: str | None = None
    dp_rank: int = 0


class Subscriber:
    """Keeps one endpoint's events flowing into an ``EventFeed``."""

    def __init__(
        self,
        feed: EventFeed,
        endpoints: Endpoints,
        config: IndexConfig,
        context: zmq.asyncio.Context,
        metrics: IndexMetrics,
    ) -> None:
        self.feed = feed
        self.endpoints = endpoints
        self._config = config
        self._context = context
        self._metrics = metrics
        self.next_seq: int | None = None
        self.history_complete = False
        self._duplicates_upto = -1
        self._duplicates_from = 0
        self._progress = asyncio.Condition()
        self.connected = False
        self._label = (feed.worker, endpoints.events)

    # ----------------------------------------------------------------- waiting
    @property
    def applied_seq(self) -> int | None:
        """Sequence number of the last batch handled (applied or skipped)."""
        return None if self.next_seq is None else self.next_seq - 1

    async def wait_for(self, seq: int, timeout_s: float) -> None:
        """Wait until the batch ``seq`` of the current stream has been handled."""
        async with asyncio.timeout(timeout_s), self._progress:
            await self._progress.wait_for(lambda: self.next_seq is not None and self.next_seq > seq)

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    # -------------------------------------------------------------------- loop
    async def run(self) -> None:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:5557 and IPv6-only pods; IPv4 still works
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, int(self._config.reconnect_backoff_s * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self._config.reconnect_backoff_max_s * 1000))
        sock.setsockopt(zmq.SUBSCRIBE, self._config.topic.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sock.connect(self.endpoints.events)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._on_monitor(monitor)
                if sock in ready:
                    await self._drain(sock)
        finally:
            self._metrics.connected.labels(*self._label).set(0)
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    async def _on_monitor(self, monitor: zmq.asyncio.Socket) -> None:
        frames = await monitor.recv_multipart()
        event = parse_monitor_message(frames)["event"]
        self.connected = event == zmq.EVENT_CONNECTED
        self._metrics.connected.labels(*self._label).set(1 if self.connected else 0)
        if not self.connected and self.next_seq is not None:
            # Most often the engine went away (its cache with it); a blip costs a rebuild
            # from the replay ring on reconnect, never a phantom hit.
            log.info("%s: event publisher %s disconnected: clearing", *self._label)
            self.feed.reset("disconnected")
            self.next_seq = None
            self.history_complete = False
            self._duplicates_upto = -1
        elif self.connected and self.next_seq is None and self.endpoints.replay:
            await self._join()

    async def _join(self) -> None:
        """Learn the engine's history from its replay ring before any live batch arrives.

        Live batches queued meanwhile are matched against it by seq: the replayed ones are
        dropped as duplicates, a gap is replayed as usual."""
        log.info("%s: event publisher %s connected: replaying its history", *self._label)
        await self._replay(0, 0, joining=True)
        await self._notify()

    async def _drain(self, sock: zmq.asyncio.Socket) -> None:
        for _ in range(_DRAIN_MAX):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                message = await frames
            except zmq.Again:
                break
            await self.on_frames(message)
        await self._notify()

    # --------------------------------------------------------------- sequence
    async def on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.feed.malformed(
                f"expected [topic, seq(8 bytes), payload], got {len(frames)} frames"
            )
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        expected = self.next_seq
        if expected is None:
            if seq != 0:
                await self._replay(0, seq, joining=True)
            else:
                self.history_complete = True
        elif seq < expected:
            if self._duplicates_from <= seq <= self._duplicates_upto:
                # already applied through a replay; live frames come in order, so a later
                # frame at or below this one means the engine restarted
                self._duplicates_from = seq + 1
                return
            log.info(
                "%s: seq went back from %d to %d: engine restarted",
                self.feed.worker,
                expected - 1,
                seq,
            )
            self.feed.reset("restart", restarted=True)
            self.next_seq = None
            self.history_complete = seq == 0
            if seq != 0:
                await self._replay(0, seq, joining=True)
        elif seq > expected:
            self._metrics.gaps.labels(self.feed.worker, "seq").inc()
            await self._replay(expected, seq, joining=False)
        if self.next_seq is not None and seq < self.next_seq:
            return  # the replay covered it
        self._duplicates_upto = -1
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        result = self.feed.apply_payload(payload)
        self.next_seq = seq + 1
        self._metrics.last_seq.labels(*self._label).set(seq)
        if result.status is BatchStatus.UNKNOWN_PARENT:
            self._metrics.gaps.labels(self.feed.worker, "unknown_parent").inc()
            if self.history_complete:
                log.warning("%s: stored block with unknown parent: clearing", self.feed.worker)
                self.feed.reset("unknown_parent")
                self.history_complete = False

    async def _replay(self, start: int, upto: int, *, joining: bool) -> None:
        """Fetch and apply batches from ``start``; clear first if they cannot cover the gap."""
        batches = await self._fetch_replay(start) if self.endpoints.replay else None
        covered = batches is not None and bool(batches) and batches[0][0] == start
        if batches is not None and not batches and upto == start:
            covered = True
        outcome = "covered" if covered else ("partial" if batches else "failed")
        if self.endpoints.replay:
            self._metrics.replays.labels(self.feed.worker, outcome).inc()
        if joining:
            self.history_complete = covered and start == 0
        elif not covered:
            log.warning(
                "%s: replay cannot cover seq %d..%d: clearing", self.feed.worker, start, upto - 1
            )
            self.feed.reset("gap")
            self.history_complete = False
        if self._duplicates_upto < 0:
            self._duplicates_from = start
        for seq, payload in batches or ():
            if seq >= start:
                self._apply(seq, payload)
                self._duplicates_upto = max(self._duplicates_upto, seq)

    async def _fetch_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        assert self.endpoints.replay is not None
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        timeout_ms = int(self._config.replay_timeout_s * 1000)
        batches: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.endpoints.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(timeout_ms):
                    log.warning("%s: replay from %s timed out", *self._label)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    continue
                seq = int.from_bytes(frames[2], "big")
                if seq == END_OF_REPLAY:
                    return batches
                batches.append((seq, frames[3]))
        finally:
            sock.close(linger=0)
