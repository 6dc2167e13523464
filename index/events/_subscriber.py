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
* a payload that cannot be decoded or applied is counted, logged at most once per interval,
  and its batch is lost: the worker is cleared as for a gap the replay cannot cover (a replay
  would bring back the same payload).

Everything a publisher sends is bounded (docs/security-events.md): ZMQ refuses frames over
``max_message_bytes`` and queues at most ``receive_hwm`` messages; a replay is applied as it
streams in and given up (the worker cleared) past ``replay_max_batches``,
``replay_max_bytes`` or ``replay_max_s``, so a replay socket that never ends holds neither
memory nor live events for long.

Reconnects are ZMQ's own, with exponential backoff (``RECONNECT_IVL`` .. ``RECONNECT_IVL_MAX``);
a subscriber whose task fails anyway is restarted by ``KvIndexService``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvgate.index.api import Endpoints
from kvgate.index.config import IndexConfig
from kvgate.index.events._feed import EventFeed
from kvgate.index.metrics import IndexMetrics

log = logging.getLogger(__name__)

END_OF_REPLAY = 0xFFFFFFFFFFFFFFFF
_DRAIN_MAX = 256
_SLICE_S = 0.001
"""Event work in one go: past it, a subscriber with more to do yields the event loop for as
long again. A flooding publisher then gets at most about half of the loop, and a request
waits at most about a slice (plus one payload, bounded by ``max_message_bytes``) per await."""


class ReplayFailed(Exception):
    """A replay that did not end with its end marker (``limit``: the bound it went past)."""

    def __init__(self, reason: str, limit: str | None = None) -> None:
        super().__init__(reason)
        self.limit = limit


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

    def forget(self, reason: str) -> None:
        """Clear the worker and start over as a fresh subscriber (the task failed)."""
        self.feed.reset(reason)
        self.next_seq = None
        self.history_complete = False
        self._duplicates_upto = -1
        self.connected = False
        self._metrics.connected.labels(*self._label).set(0)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        """A socket with the publisher's bounds: frame size, queued messages, no linger."""
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:5557 and IPv6-only pods; IPv4 still works
        sock.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, self._config.receive_hwm)
        return sock

    # -------------------------------------------------------------------- loop
    async def run(self) -> None:
        """Subscribe with one socket per connection: when a connection drops (the engine went
        away, or broke the protocol, e.g. a frame over ``max_message_bytes``, after which ZMQ
        would never reconnect that socket), it is closed and a fresh one connects after
        ``reconnect_backoff_s`` (ZMQ's own backoff then covers an engine that is down)."""
        while True:
            await self._connection()
            await asyncio.sleep(self._config.reconnect_backoff_s)

    async def _connection(self) -> None:
        sock = self._socket(zmq.SUB)
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
                if monitor in ready and not await self._on_monitor(monitor):
                    return
                if sock in ready:
                    await self._drain(sock)
        finally:
            self._metrics.connected.labels(*self._label).set(0)
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    async def _on_monitor(self, monitor: zmq.asyncio.Socket) -> bool:
        """A connection event; False when the connection dropped."""
        frames = await monitor.recv_multipart()
        event = parse_monitor_message(frames)["event"]
        self.connected = event == zmq.EVENT_CONNECTED
        self._metrics.connected.labels(*self._label).set(1 if self.connected else 0)
        if self.connected:
            if self.next_seq is None and self.endpoints.replay:
                await self._join()
            return True
        if self.next_seq is not None:
            # Most often the engine went away (its cache with it); a blip costs a rebuild
            # from the replay ring on reconnect, never a phantom hit.
            log.info("%s: event publisher %s disconnected: clearing", *self._label)
            self.feed.reset("disconnected")
            self.next_seq = None
            self.history_complete = False
            self._duplicates_upto = -1
        return False

    async def _join(self) -> None:
        """Learn the engine's history from its replay ring before any live batch arrives.

        Live batches queued meanwhile are matched against it by seq: the replayed ones are
        dropped as duplicates, a gap is replayed as usual."""
        log.info("%s: event publisher %s connected: replaying its history", *self._label)
        await self._replay(0, 0, joining=True)
        await self._notify()

    async def _drain(self, sock: zmq.asyncio.Socket) -> None:
        """What is queued, up to ``_DRAIN_MAX`` messages or a ``_SLICE_S`` time slice."""
        started = time.perf_counter()
        busy = False
        for _ in range(_DRAIN_MAX):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                message = await frames
            except zmq.Again:
                break
            await self.on_frames(message)
            busy = time.perf_counter() - started > _SLICE_S
            if busy:
                break
        await self._notify()
        if busy:
            await asyncio.sleep(_SLICE_S)

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
        if result.unknown_parent:
            self._metrics.gaps.labels(self.feed.worker, "unknown_parent").inc()
            if self.history_complete:
                log.warning("%s: stored block with unknown parent: clearing", self.feed.worker)
                self.feed.reset("unknown_parent")
                self.history_complete = False
        elif result.refused in ("undecodable", "failed"):
            # the batch is lost: a gap no replay covers (it would bring the same payload back)
            self.feed.reset(result.refused)
            self.history_complete = False

    async def _replay(self, start: int, upto: int, *, joining: bool) -> None:
        """Apply the batches from ``start`` as they stream in; clear first if they cannot
        cover the gap up to ``upto``, and again if the replay breaks off or goes past a
        bound (what came before stays: a prefix of the history). A join replay (the whole
        history) is not matched on until it ends: half applied, it is a past state of the
        cache (``EventFeed.hidden``)."""
        with self.feed.hidden() if joining else contextlib.nullcontext():
            await self._replay_batches_applied(start, upto, joining=joining)

    async def _replay_batches_applied(self, start: int, upto: int, *, joining: bool) -> None:
        settled = False
        outcome = "failed"
        try:
            async with contextlib.aclosing(self._replay_batches(start)) as batches:
                sliced = time.perf_counter()
                async for seq, payload in batches:
                    if time.perf_counter() - sliced > _SLICE_S:  # queued batches never yield
                        await asyncio.sleep(_SLICE_S)
                        sliced = time.perf_counter()
                    if not settled:
                        settled = True
                        outcome = self._settle(start, upto, joining, covered=seq == start)
                    if seq >= start:
                        self._apply(seq, payload)
                        self._duplicates_upto = max(self._duplicates_upto, seq)
            if not settled:  # an empty replay: it covers only an empty gap
                covered = self._settle(start, upto, joining, covered=upto == start) == "covered"
                outcome = "covered" if covered else "failed"
        except ReplayFailed as failure:
            outcome = "aborted" if failure.limit else "failed"
            self._replay_failed(failure, start, upto, joining=joining, settled=settled)
        if self.endpoints.replay:
            self._metrics.replays.labels(self.feed.worker, outcome).inc()

    def _settle(self, start: int, upto: int, joining: bool, *, covered: bool) -> str:
        """Before the first replayed batch (or at the end of an empty replay): does it cover
        the gap? If not, the worker is cleared first."""
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
        return "covered" if covered else "partial"

    def _replay_failed(
        self, failure: ReplayFailed, start: int, upto: int, *, joining: bool, settled: bool
    ) -> None:
        worker = self.feed.worker
        log.warning("%s: replay from %s: %s", worker, self.endpoints.replay, failure)
        if failure.limit is not None:
            self._metrics.limits.labels(worker, failure.limit).inc()
        if not settled and failure.limit is None:
            self._settle(start, upto, joining, covered=False)
            return
        # cut short: the batches up to ``upto`` are missing; start over from the live stream
        self.feed.reset("limit" if failure.limit else "gap")
        self.history_complete = False
        self.next_seq = None
        self._duplicates_upto = -1

    async def _replay_batches(self, start: int) -> AsyncGenerator[tuple[int, bytes]]:
        """The replayed ``(seq, payload)`` batches from ``start`` until the end marker;
        ``ReplayFailed`` when there is no replay socket, it times out, or it goes past a bound
        (the time spent applying them counts)."""
        if not self.endpoints.replay:
            raise ReplayFailed("no replay socket")
        budget = _ReplayBudget(self._config, asyncio.get_running_loop())
        sock = self._socket(zmq.DEALER)
        try:
            try:
                sock.connect(self.endpoints.replay)
                await sock.send_multipart([b"", start.to_bytes(8, "big")])
            except zmq.ZMQError as error:
                raise ReplayFailed(f"cannot ask for it: {error}") from error
            while True:
                if not await sock.poll(budget.wait_ms()):
                    budget.timed_out()
                frames = await sock.recv_multipart()
                budget.spend(frames)
                if len(frames) != 4 or len(frames[2]) != 8:
                    continue
                seq = int.from_bytes(frames[2], "big")
                if seq == END_OF_REPLAY:
                    return
                yield seq, frames[3]
        finally:
            sock.close(linger=0)


class _ReplayBudget:
    """What one replay may take: ``replay_max_s`` in all, ``replay_timeout_s`` of silence,
    ``replay_max_batches`` messages and ``replay_max_bytes``."""

    def __init__(self, config: IndexConfig, loop: asyncio.AbstractEventLoop) -> None:
        self._config = config
        self._loop = loop
        self._deadline = loop.time() + config.replay_max_s
        self._messages = 0
        self._bytes = 0
        self._capped = False  # the last wait was cut short by the deadline

    def wait_ms(self) -> int:
        """How long to wait for the next message (``ReplayFailed`` when the time is up)."""
        left = self._deadline - self._loop.time()
        if left <= 0:
            raise ReplayFailed(f"longer than {self._config.replay_max_s} s", "replay_seconds")
        self._capped = left < self._config.replay_timeout_s
        return max(1, int(min(self._config.replay_timeout_s, left) * 1000))

    def timed_out(self) -> None:
        """Nothing came within ``wait_ms``: always raises ``ReplayFailed``."""
        if self._capped:  # the whole replay's time is up: that bound
            raise ReplayFailed(f"longer than {self._config.replay_max_s} s", "replay_seconds")
        raise ReplayFailed(f"nothing for {self._config.replay_timeout_s} s")

    def spend(self, frames: list[bytes]) -> None:
        config = self._config
        self._messages += 1
        self._bytes += sum(len(frame) for frame in frames)
        if self._messages > config.replay_max_batches:
            raise ReplayFailed(f"over {config.replay_max_batches} batches", "replay_batches")
        if self._bytes > config.replay_max_bytes:
            raise ReplayFailed(f"over {config.replay_max_bytes} bytes", "replay_bytes")
