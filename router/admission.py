"""Admission control: the router-side queue (docs/scoring.md, *Admission and the queue*).

``AdmissionQueue.admit`` lets a routed request through at once, as the policy ranked it,
when some worker it may go to is not busy (``scoring.busy.BusyGauge``), its API key and
model are under their concurrency limits and nothing of its model is queued ahead of it.
Otherwise it waits here, not in an engine's queue, bounded in number and in body bytes
(429 ``QueueFull``) and in time (503 ``QueueTimeout``); dispatched, it goes to the best
worker not busy then (one the policy did not set aside; ``free_first``). The bounds are
shared between API keys: a full queue gives the newest request of the key holding most to a
key holding less (``_make_room``), so one key cannot keep the others out, and a key alone
may use all of it:

    routed ──admit──▶ free worker, limits ok, none queued ──▶ Grant (sent now)
                   └▶ queued entry ── a worker frees up (registry.watch_load) ──▶ dispatch pass:
                        next_to_dispatch (scoring/dispatch_order.py) → Router.redecide
                        → the best non-busy worker now → Grant (with a reservation)
                   └▶ client gone: removed at once (499); deadline: 503; full: 429

A dispatch pass runs (``loop.call_soon``, coalesced) when load is released or re-measured,
a worker becomes healthy, a grant ends, or a request is queued: no polling. A dispatched
request's worker is charged at once (a ``LoadTicket`` reservation, handed over when the
proxy counts the request itself), so one pass never sends a burst to the worker that just
freed up. Each ``Grant`` holds its key's and model's concurrency share until ``release``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from backends.registry import LoadTicket, WorkerRegistry
from index.types import WorkerId
from router.config import QueueConfig
from router.errors import ClientClosed, InvalidRequest, KvgateError, QueueFull, QueueTimeout
from router.queue_metrics import QueueMetrics
from router.routing import Routed, Router
from scoring.busy import BusyGauge, BusyLimits, ThresholdGauge
from scoring.dispatch_order import OrderConfig, next_to_dispatch

TIMEOUT_HEADERS = ("x-request-timeout", "x-stainless-timeout")
"""Headers in which a client states its own timeout, in seconds (the OpenAI SDKs send the
second): a queued request waits no longer than that."""
_MAX_HEADER_CHARS = 32
MAX_ZERO_SERIES_MODELS = 32
"""Served models whose queue-length series every known key has at 0 (``queued_by``)."""


def client_timeout_s(headers: Mapping[str, str]) -> float | None:
    """The client's own timeout from ``TIMEOUT_HEADERS`` (first found), or None; a value
    that is not a positive finite number of seconds is a 400 naming the header."""
    for name in TIMEOUT_HEADERS:
        text = headers.get(name)
        if text is None:
            continue
        try:
            value = float(text) if len(text) <= _MAX_HEADER_CHARS else math.nan
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise InvalidRequest(f"{name}: expected a positive number of seconds", param=name)
        return value
    return None


Receive = Callable[[], Awaitable[Mapping[str, Any]]]


def disconnect_of(receive: Receive) -> Callable[[], Awaitable[None]]:
    """An awaitable factory that returns when the ASGI client disconnects (the request
    body already read: the next message is the disconnect)."""

    async def disconnected() -> None:
        for _ in range(1_000_000):  # bounded; a body-less message may come before
            if (await receive())["type"] == "http.disconnect":
                return
        await asyncio.Event().wait()  # never: a client flooding empty messages waits out

    return disconnected


def gauge_of(config: QueueConfig, kv_capacity_blocks: int | None = None) -> ThresholdGauge:
    """The default ``BusyGauge``: ``config``'s ``busy_*`` limits (``kv_capacity_blocks``:
    the KV capacity of engines that publish none, ``scoring.kv_capacity_blocks``)."""
    return ThresholdGauge(
        BusyLimits(
            pending_prefill_tokens=config.busy_pending_prefill_tokens,
            in_flight=config.busy_in_flight,
            waiting_requests=config.busy_waiting_requests,
            kv_usage=config.busy_kv_usage,
            kv_held=config.busy_kv_held,
            kv_capacity_blocks=kv_capacity_blocks,
        )
    )


class Grant:
    """One request let through: its key's and model's concurrency share, and (dispatched from
    the queue) a reservation of its worker's load until the proxy counts it (``started``)."""

    __slots__ = ("_queue", "_released", "_reservation", "key", "model", "routed", "waited_s")

    def __init__(
        self,
        queue: AdmissionQueue,
        routed: Routed,
        key: str,
        reservation: LoadTicket | None,
        waited_s: float | None,
    ) -> None:
        self._queue = queue
        self.routed = routed
        self.key = key
        self.model = routed.request.model
        self._reservation = reservation
        self.waited_s = waited_s  # None: never queued
        self._released = False

    def started(self) -> None:
        """The proxy charged the worker itself: the reservation is handed over."""
        if self._reservation is not None:
            self._reservation.finish()
            self._reservation = None

    def release(self) -> None:
        """The exchange is over (idempotent): the concurrency share goes back."""
        if not self._released:
            self._released = True
            self.started()
            self._queue._released(self)


@dataclass(eq=False, slots=True)
class _Entry:
    seq: int
    enqueued_at: float
    session: str | None
    key: str
    routed: Routed
    future: asyncio.Future[Grant]
    size: int  # the bytes of the body it holds
    room_timer: asyncio.TimerHandle | None = None  # busy_kv_room: ends its wait for KV room

    @property
    def model(self) -> str:
        return self.routed.request.model

    @property
    def waits_for_room(self) -> bool:
        """Does it wait for KV room (``busy_kv_room``, its patience not yet over)?"""
        return self.room_timer is not None


@dataclass(slots=True)
class _Counts:
    """Queued and in-flight (granted, not released) requests, per key and per model."""

    queued_key: Counter[str] = field(default_factory=Counter)
    queued_model: Counter[str] = field(default_factory=Counter)
    queued_bytes: Counter[str] = field(default_factory=Counter)  # body bytes, per key
    flight_key: Counter[str] = field(default_factory=Counter)
    flight_model: Counter[str] = field(default_factory=Counter)

    @staticmethod
    def _move(counter: Counter[str], name: str, delta: int) -> None:
        counter[name] += delta
        if counter[name] <= 0:
            del counter[name]

    def queued(self, key: str, model: str, delta: int, size: int) -> None:
        """``delta`` (1 or -1) requests of ``size`` body bytes queued."""
        self._move(self.queued_key, key, delta)
        self._move(self.queued_model, model, delta)
        self.queued_bytes[key] += delta * size
        if self.queued_key[key] == 0:
            del self.queued_bytes[key]

    def flying(self, key: str, model: str, delta: int) -> None:
        self._move(self.flight_key, key, delta)
        self._move(self.flight_model, model, delta)


def busy_for(
    routed: Routed,
    worker: WorkerId,
    gauge: BusyGauge,
    kv_room: bool,
    held: Collection[WorkerId] = frozenset(),
) -> str | None:
    """Why ``worker`` takes no more of ``routed``'s request now (``None``: it may): held for
    another request waiting for KV room there (``held``, ``QueueConfig.kv_room_hold``), the
    gauge's reason, or (``kv_room``: ``QueueConfig.busy_kv_room``) that the request's new
    KV blocks do not fit there, as the policy found (``Decision.room``), unless nothing of
    kvgate's is in flight there to make room (a prompt larger than the cache never waits)."""
    if worker in held:
        return "held for a queued request waiting for KV room there"
    candidate = routed.candidates[worker]
    reason = gauge.busy(candidate)
    if reason is None and kv_room and candidate.load.in_flight > 0:
        room = routed.decision.room
        if room is not None and worker not in room:
            return "lacks KV room for this request"
    return reason


def any_free(routed: Routed, gauge: BusyGauge, kv_room: bool = False) -> bool:
    """Is some ranked worker not busy (the policy's first choice asked first)?"""
    return any(busy_for(routed, w, gauge, kv_room) is None for w in routed.decision.ranked)


def free_first(
    routed: Routed,
    gauge: BusyGauge,
    kv_room: bool = False,
    held: Collection[WorkerId] = frozenset(),
) -> Routed | None:
    """``routed`` with the workers it may go to now ranked first, in the policy's order, or
    ``None`` when every ranked worker is busy (``held``: workers held for other requests,
    busy for this one).

    A worker the policy set aside (``Decision.set_aside``: it lacks KV room where another has
    room, say) does not jump ahead of the policy's choice for being free: when every free
    worker is one it set aside, the policy's order stands, as at admission, and the request
    waits behind the prefill that makes its choice busy rather than for a decode to end on a
    worker without room."""
    ranked = routed.decision.ranked
    if busy_for(routed, ranked[0], gauge, kv_room, held) is None:
        return routed
    free = [w for w in ranked if busy_for(routed, w, gauge, kv_room, held) is None]
    if not free:
        return None
    first = [w for w in free if w not in routed.decision.set_aside]
    if not first:
        return routed
    chosen = set(first)
    order = first + [w for w in ranked if w not in chosen]
    scores = {s.worker: s for s in routed.decision.scores}
    decision = replace(
        routed.decision,
        ranked=order,
        scores=[scores[w] for w in order if w in scores] if scores else (),
    )
    return replace(routed, decision=decision)


class AdmissionQueue:
    """Requests waiting in kvgate for a worker, and each key's and model's share."""

    def __init__(
        self,
        config: QueueConfig,
        router: Router,
        registry: WorkerRegistry,
        metrics: QueueMetrics,
        *,
        gauge: BusyGauge | None = None,
        keys: Sequence[str] = ("-",),
        retry_after_s: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``keys``: the client key ids (``accesslog.client_key_id``; "-" without client
        keys), whose series are on /metrics at 0 before their first request."""
        self.config = config
        self.keys = tuple(keys)
        self.gauge = gauge if gauge is not None else gauge_of(config)
        self._router = router
        self._registry = registry
        self._metrics = metrics
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._order = OrderConfig(config.aging_tokens_per_s, config.base_tokens)
        self._entries: dict[int, _Entry] = {}
        self._bytes = 0  # body bytes of the queued requests
        self._counts = _Counts()
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._holds: dict[int, WorkerId] = {}  # kv_room_hold: entry -> the worker it holds
        metrics.declare(self.keys)
        metrics.watch(self)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._registry.watch_load(self._wake)

    def stop(self) -> None:
        """Stop dispatching; every queued request gets a 503 (kvgate is shutting down)."""
        self._registry.unwatch_load(self._wake)
        for entry in list(self._entries.values()):
            self._remove(entry)
            if not entry.future.done():
                waited = self._clock() - entry.enqueued_at
                entry.future.set_exception(QueueTimeout(waited, retry_after_s=self._retry_after_s))
        self._loop = None

    # -- the request side -----------------------------------------------------------------
    async def admit(
        self,
        routed: Routed,
        *,
        key: str,
        session: str | None,
        timeout_s: float | None,
        disconnected: Callable[[], Awaitable[None]],
        size: int = 0,
    ) -> Grant:
        """Let ``routed`` through now or once a worker frees up (the grant's ``routed`` is
        the decision then); ``size``: the bytes of the body it holds while queued.
        ``QueueFull``, ``QueueTimeout``, ``ClientClosed`` (the client went while queued:
        ``disconnected`` returned), or a routing error at dispatch."""
        model = routed.request.model
        if self._may_pass(key, model) and any_free(routed, self.gauge, self.config.busy_kv_room):
            # the policy's choice stands (busy or not): the queue acts only when all are busy
            return self._grant(routed, key, reservation=None, waited_s=None)
        self._check_room(key, model)
        self._make_room(key, size)
        limit = (
            self.config.max_wait_s if timeout_s is None else min(timeout_s, self.config.max_wait_s)
        )
        loop = asyncio.get_running_loop()
        entry = _Entry(
            seq=next(self._seq),
            enqueued_at=self._clock(),
            session=session,
            key=key,
            routed=routed,
            future=loop.create_future(),
            size=size,
        )
        if self.config.busy_kv_room:
            patience = limit * self.config.kv_room_patience
            entry.room_timer = loop.call_later(patience, self._out_of_patience, entry)
        self._entries[entry.seq] = entry
        self._bytes += size
        self._counts.queued(key, model, 1, size)
        self._metrics.entered(key)
        self._wake()
        return await self._wait(entry, limit, disconnected)

    async def _wait(
        self, entry: _Entry, limit_s: float, disconnected: Callable[[], Awaitable[None]]
    ) -> Grant:
        gone = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait(
                (entry.future, gone), timeout=limit_s, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            self._abandon(entry)
            raise
        finally:
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
        if entry.future.done():
            return entry.future.result()
        self._abandon(entry)
        waited = self._clock() - entry.enqueued_at
        if gone in done:
            self._metrics.rejected(entry.key, "client_gone")
            raise ClientClosed
        self._metrics.rejected(entry.key, "deadline")
        raise QueueTimeout(waited, retry_after_s=self._retry_after_s)

    def _abandon(self, entry: _Entry) -> None:
        """The waiter is leaving: out of the queue, or its grant (if just made) released."""
        self._remove(entry)
        future = entry.future
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().release()
        else:
            future.cancel()

    def _may_pass(self, key: str, model: str) -> bool:
        """Nothing of ``model`` queued ahead, and ``key`` and ``model`` under their limits."""
        return self._counts.queued_model[model] == 0 and self._under_limits(key, model)

    def _under_limits(self, key: str, model: str) -> bool:
        cfg, counts = self.config, self._counts
        key_limit, model_limit = cfg.max_in_flight_per_key, cfg.max_in_flight_per_model
        return (key_limit is None or counts.flight_key[key] < key_limit) and (
            model_limit is None or counts.flight_model[model] < model_limit
        )

    def _check_room(self, key: str, model: str) -> None:
        """The key's and the model's own limits (``max_queued_per_*``), when set."""
        cfg, counts = self.config, self._counts
        checks = (
            ("key_queue_full", counts.queued_key[key], cfg.max_queued_per_key, f"key {key}'s"),
            (
                "model_queue_full",
                counts.queued_model[model],
                cfg.max_queued_per_model,
                f"model {model}'s",
            ),
        )
        for code, held, limit, whose in checks:
            if limit is not None and held >= limit:
                self._metrics.rejected(key, code)
                message = (
                    f"every worker is busy and {whose} share of the queue is full "
                    f"({limit} requests); retry later"
                )
                raise QueueFull(message, code=code, retry_after_s=self._retry_after_s)

    def _make_room(self, key: str, size: int) -> None:
        """Room for one more request of ``key`` holding ``size`` body bytes, within
        ``max_length`` and ``max_bytes``. A full queue gives the newest request of the key
        holding most (requests, or bytes when those are short) to ``key`` when that key
        still holds more than ``key`` would (it gets 429 ``queue_share``); else this
        request gets 429. So one key's requests cannot keep another key's out, and a key
        alone may fill the queue."""
        cfg = self.config
        for _ in range(len(self._entries) + 1):  # bounded: each round takes one entry out
            by_count = len(self._entries) >= cfg.max_length
            if not by_count and self._bytes + size <= cfg.max_bytes:
                return
            victim = self._victim(key, size, by_count) if size <= cfg.max_bytes else None
            if victim is None:
                break
            self._evict(victim)
        if by_count:
            self._refuse_room(key, "queue_full", f"the queue is full ({cfg.max_length} requests)")
        self._refuse_room(
            key, "queue_bytes_full", f"the queue's bodies would pass {cfg.max_bytes} bytes"
        )

    def _victim(self, key: str, size: int, by_count: bool) -> _Entry | None:
        """The newest request of the key holding most of the queue (``by_count``: requests,
        else body bytes), if that key holds more than ``key`` would with one more."""
        held = self._counts.queued_key if by_count else self._counts.queued_bytes
        heaviest = max(held, key=held.__getitem__, default=None)
        if heaviest is None:
            return None
        fair = held[heaviest] >= held[key] + 2 if by_count else held[heaviest] > held[key] + size
        if not fair:
            return None
        return next((e for e in reversed(self._entries.values()) if e.key == heaviest), None)

    def _evict(self, entry: _Entry) -> None:
        self._remove(entry)
        self._metrics.rejected(entry.key, "key_share")
        message = (
            f"every worker is busy and the queue is full; key {entry.key} holds the largest "
            "share of it, and this request gave its place to another key's; retry later"
        )
        error = QueueFull(message, code="queue_share", retry_after_s=self._retry_after_s)
        entry.future.set_exception(error)

    def _refuse_room(self, key: str, code: str, why: str) -> None:
        self._metrics.rejected(key, code)
        message = f"every worker is busy and {why}; retry later"
        raise QueueFull(message, code=code, retry_after_s=self._retry_after_s)

    # -- grants -----------------------------------------------------------------------------
    def _grant(
        self, routed: Routed, key: str, *, reservation: LoadTicket | None, waited_s: float | None
    ) -> Grant:
        self._counts.flying(key, routed.request.model, 1)
        if waited_s is not None:
            self._metrics.waited(key, waited_s)
        return Grant(self, routed, key, reservation, waited_s)

    def _released(self, grant: Grant) -> None:
        self._counts.flying(grant.key, grant.model, -1)
        self._wake()

    def _reserve(self, routed: Routed) -> LoadTicket | None:
        """Charge the chosen worker now, as the proxy will (no footprint: not sent yet)."""
        worker = self._registry.find(routed.decision.chosen)
        if worker is None:
            return None
        uncached = routed.predicted_uncached_tokens(worker.id)
        request = routed.request
        return self._registry.reserve(
            worker.id,
            uncached,
            routed.load_blocks,
            request.block_size,
            request.prompt_tokens,
            keys=request.block_keys,
        )

    # -- the dispatch side ------------------------------------------------------------------
    def _wake(self) -> None:
        loop = self._loop
        if self._entries and not self._scheduled and loop is not None:
            self._scheduled = True
            loop.call_soon(self._dispatch)

    def _out_of_patience(self, entry: _Entry) -> None:
        """``entry`` has waited for KV room as long as it may (``kv_room_patience``): from
        now on it goes as ranked. The timer's firing ends the wait, not a clock reading, which
        a timer may precede by the loop's clock resolution (the pass would skip it again)."""
        entry.room_timer = None
        self._release_hold(entry)
        self._wake()

    def _release_hold(self, entry: _Entry) -> None:
        """``entry`` no longer waits for room: the worker it held is everyone's again."""
        if self._holds.pop(entry.seq, None) is not None:
            self._wake()

    def _held_from(self, seq: int | None) -> frozenset[WorkerId]:
        """The workers held for KV room (``kv_room_hold``) by entries other than ``seq``
        (None: any entry's)."""
        return frozenset(w for s, w in self._holds.items() if s != seq)

    def _hold(self, entry: _Entry, routed: Routed, held: frozenset[WorkerId]) -> None:
        """``entry`` waits for KV room: it holds (or keeps holding) a worker when it holds one
        already or fewer than ``kv_room_holds`` are held (one by default; never all of its
        workers): the first such in the dispatch order hold one each."""
        cfg = self.config
        most = min(cfg.kv_room_holds, max(1, len(routed.candidates) - 1))
        if not cfg.kv_room_hold or (entry.seq not in self._holds and len(self._holds) >= most):
            return
        # its policy's first choice among the workers no other request holds
        target = next((w for w in routed.decision.ranked if w not in held), None)
        if target is not None:
            self._holds[entry.seq] = target

    def _dispatch(self) -> None:
        """Send queued requests while some worker is free, best first (one pass)."""
        self._scheduled = False
        now = self._clock()
        free = self._free_workers()
        kv_room = self.config.busy_kv_room
        no_room: set[int] = set()  # entries that fit on no free worker (this pass)

        def work(entry: _Entry) -> int | None:
            """Its uncached tokens on the free worker holding most of its prompt."""
            if entry.seq in no_room or not self._under_limits(entry.key, entry.model):
                return None
            routed, held = entry.routed, self._held_from(entry.seq)
            tokens = [
                routed.predicted_uncached_tokens(w)
                for w in routed.candidates
                if w in free and w not in held
            ]
            return min(tokens) if tokens else None

        while (
            entry := next_to_dispatch(self._entries.values(), now, self._order, work)
        ) is not None:
            try:
                routed = self._router.redecide(entry.routed)
            except KvgateError as exc:  # the model's workers went away meanwhile
                self._remove(entry)
                self._metrics.rejected(entry.key, "no_worker")
                entry.future.set_exception(exc)
                continue
            held = self._held_from(entry.seq)
            chosen = free_first(routed, self.gauge, kv_room, held)
            if chosen is None and kv_room:
                chosen = free_first(routed, self.gauge, held=held)  # a free worker, room or not
                if chosen is not None and entry.waits_for_room:
                    no_room.add(entry.seq)  # a smaller request may fit where this one does not
                    self._hold(entry, routed, held)
                    continue
                # else it waited for room long enough: it takes its place in an engine's queue
            if chosen is None:  # the free workers it could use turned out busy
                free.difference_update(routed.candidates)
                free.difference_update(entry.routed.candidates)  # (its workers then: progress)
                continue
            self._remove(entry)
            grant = self._grant(
                chosen,
                entry.key,
                reservation=self._reserve(chosen),
                waited_s=now - entry.enqueued_at,
            )
            entry.future.set_result(grant)
            free = self._free_workers()  # the chosen worker now carries it

    def _free_workers(self) -> set[WorkerId]:
        """Ready workers not busy now (any model)."""
        gauge = self.gauge
        return {w.id for w in self._registry if w.ready and gauge.busy(w.candidate()) is None}

    def _remove(self, entry: _Entry) -> None:
        self._release_hold(entry)
        if entry.room_timer is not None:
            entry.room_timer.cancel()
            entry.room_timer = None
        if self._entries.pop(entry.seq, None) is not None:
            self._bytes -= entry.size
            self._counts.queued(entry.key, entry.model, -1, entry.size)

    # -- views --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def queued_bytes(self) -> int:
        """Body bytes of the queued requests."""
        return self._bytes

    def queued_by(self) -> Iterator[tuple[str, str, int]]:
        """(key, model, queued requests): every known key with the first
        ``MAX_ZERO_SERIES_MODELS`` served models by name (0 when none is queued: a fleet
        serving thousands of adapters does not multiply the series), and any pair with
        some queued."""
        pairs = Counter((e.key, e.model) for e in self._entries.values())
        served = {model for worker in self._registry for model in worker.models}
        zeros = sorted(served)[:MAX_ZERO_SERIES_MODELS]
        for key in self.keys:
            for model in zeros:
                pairs[(key, model)] += 0
        for (key, model), n in pairs.items():
            yield key, model, n

    def in_flight_by_key(self) -> dict[str, int]:
        """Granted, unfinished requests per key (every known key, 0 included)."""
        return {**dict.fromkeys(self.keys, 0), **self._counts.flight_key}

    def explain(self, routed: Routed, key: str) -> dict[str, Any]:
        """Would a request routed as ``routed`` for ``key`` queue now, and why."""
        model = routed.request.model
        kv_room = self.config.busy_kv_room
        held = self._held_from(None)
        busy = {
            c.url: reason
            for c in routed.candidates.values()
            if (reason := busy_for(routed, c.worker, self.gauge, kv_room, held)) is not None
        }
        reason = None
        if not self.config.enabled:
            pass
        elif self._counts.queued_model[model]:
            reason = f"{self._counts.queued_model[model]} requests of this model are queued ahead"
        elif not self._under_limits(key, model):
            reason = f"key {key} or model {model} is at its concurrency limit"
        elif not any_free(routed, self.gauge, kv_room):
            reason = "every eligible worker is busy"
        return {
            "enabled": self.config.enabled,
            "would_queue": reason is not None,
            "reason": reason,
            "key": key,
            "queued": len(self._entries),
            "queued_for_model": self._counts.queued_model[model],
            "key_in_flight": self._counts.flight_key[key],
            "busy_workers": busy,
        }
