"""The router-side queue (docs/scoring.md, *The queue*): it decides when, never where.

``AdmissionQueue.admit`` lets a routed request through at once when the capacity rule
admits it somewhere (``Routed.admitted``), its API key and model are under their concurrency
limits and nothing of its model is queued ahead of it. Otherwise it waits here, not in an
engine's queue, bounded in number and in body bytes (``QueueFull``) and in time
(``QueueTimeout``); when a worker frees up it is routed again (fresh prices, fresh
capacity) and sent to the first worker admitting it then. The bounds are shared between API
keys: a full queue gives the newest request of the key holding most to a key holding less
(``_make_room``), so one key cannot keep the others out, and a key alone may use all of it::

    routed ──admit──▶ admitted, limits ok, none queued ──▶ Grant (sent now)
                   └▶ queued entry ── a worker frees up (ledger.watch) ──▶ dispatch pass:
                        next_to_dispatch (scheduling/dispatch_order.py) → Router.reroute
                        → admitted somewhere → Grant (with a reservation)
                   └▶ client gone: removed at once; deadline: QueueTimeout; full: QueueFull

A request whose only obstacle is KV room (the ``kv_room`` part) waits for it at most
``Tuning.room_patience`` of its wait limit (the ``room_wait`` part), then goes as ranked and
waits in that engine's queue; the first such request in the dispatch order holds the worker
it waits for (``room_hold``): no other queued request is sent there meanwhile.

A dispatch pass runs (``loop.call_soon``, coalesced) when load is released or re-measured,
a worker becomes healthy, a grant ends, or a request is queued: no polling. A dispatched
request's worker is charged at once (a ``LoadTicket`` reservation, handed over when its
first attempt begins), so one pass never sends a burst to the worker that just freed up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvgate.index.types import WorkerId
from kvgate.scheduling.capacity import busy
from kvgate.scheduling.config import QueueConfig, Tuning
from kvgate.scheduling.dispatch_order import next_to_dispatch
from kvgate.scheduling.errors import ClientGone, QueueFull, QueueTimeout, SchedulingError
from kvgate.scheduling.grant import Grant
from kvgate.scheduling.ledger import Ledger, LoadTicket
from kvgate.scheduling.routing import Routed, Router

REJECTIONS = (
    "queue_full",  # the whole queue is full
    "queue_bytes_full",  # the queue's body bytes are at queue.max_bytes
    "key_share",  # its place went to a key holding fewer queued requests (or bytes)
    "key_queue_full",  # the key's share of the queue is full
    "model_queue_full",  # the model's share of the queue is full
    "deadline",  # waited until its deadline
    "client_gone",  # the client disconnected while queued
    "no_worker",  # no healthy worker for its model was left at dispatch
)
ROOM_HOLDS = 1
"""Workers held at once for requests waiting for KV room (never every worker of one)."""
MAX_ZERO_SERIES_MODELS = 32
"""Served models whose queue-length series every known key has at 0 (``queued_by``)."""


class QueueEvents(Protocol):
    """What the queue reports (``router.queue_metrics.QueueMetrics``)."""

    def entered(self, key: str) -> None: ...

    def waited(self, key: str, seconds: float) -> None: ...

    def rejected(self, key: str, reason: str) -> None: ...


@dataclass(eq=False, slots=True)
class _Entry:
    seq: int
    enqueued_at: float
    session: str | None
    key: str
    routed: Routed
    future: asyncio.Future[Grant]
    size: int  # the bytes of the body it holds
    room_timer: asyncio.TimerHandle | None = None  # ends its wait for KV room

    @property
    def model(self) -> str:
        return self.routed.request.model

    @property
    def waits_for_room(self) -> bool:
        """Does it still wait for KV room (its patience not yet over)?"""
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


class AdmissionQueue:
    """Requests waiting in kvgate for a worker, and each key's and model's share."""

    def __init__(
        self,
        config: QueueConfig,
        router: Router,
        ledger: Ledger,
        events: QueueEvents,
        *,
        tuning: Tuning | None = None,
        keys: Sequence[str] = ("-",),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``keys``: the client key ids ("-" without client keys), listed at 0 before their
        first request."""
        self.config = config
        self.keys = tuple(keys)
        self._router = router
        self._ledger = ledger
        self._events = events
        self._tuning = tuning or Tuning()
        self._clock = clock
        self._entries: dict[int, _Entry] = {}
        self._bytes = 0  # body bytes of the queued requests
        self._counts = _Counts()
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._holds: dict[int, WorkerId] = {}  # room_hold: entry -> the worker it holds

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ledger.watch(self._wake)

    def stop(self) -> None:
        """Stop dispatching; every queued request gets ``QueueTimeout`` (kvgate stops)."""
        self._ledger.unwatch(self._wake)
        for entry in list(self._entries.values()):
            self._remove(entry)
            if not entry.future.done():
                entry.future.set_exception(QueueTimeout(self._clock() - entry.enqueued_at))
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
        """Let ``routed`` through now or once a worker admits it (the grant's ``routed`` is
        the decision then); ``size``: the bytes of the body it holds while queued.
        ``QueueFull``, ``QueueTimeout``, ``ClientGone`` (the client went while queued:
        ``disconnected`` returned), or a routing error at dispatch."""
        model = routed.request.model
        if routed.admitted and self._may_pass(key, model):
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
        patience = limit * self._tuning.room_patience
        entry.room_timer = loop.call_later(patience, self._out_of_patience, entry)
        self._entries[entry.seq] = entry
        self._bytes += size
        self._counts.queued(key, model, 1, size)
        self._events.entered(key)
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
        if gone in done:
            self._events.rejected(entry.key, "client_gone")
            raise ClientGone
        self._events.rejected(entry.key, "deadline")
        raise QueueTimeout(self._clock() - entry.enqueued_at)

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
                self._events.rejected(key, code)
                message = (
                    f"every worker is busy and {whose} share of the queue is full "
                    f"({limit} requests); retry later"
                )
                raise QueueFull(message, code=code)

    def _make_room(self, key: str, size: int) -> None:
        """Room for one more request of ``key`` holding ``size`` body bytes, within
        ``max_length`` and ``max_bytes``. A full queue gives the newest request of the key
        holding most (requests, or bytes when those are short) to ``key`` when that key
        still holds more than ``key`` would (it gets ``QueueFull`` queue_share); else this
        request gets ``QueueFull``. So one key's requests cannot keep another key's out,
        and a key alone may fill the queue."""
        cfg = self.config
        by_count = False
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
        self._events.rejected(entry.key, "key_share")
        message = (
            f"every worker is busy and the queue is full; key {entry.key} holds the largest "
            "share of it, and this request gave its place to another key's; retry later"
        )
        entry.future.set_exception(QueueFull(message, code="queue_share"))

    def _refuse_room(self, key: str, code: str, why: str) -> None:
        self._events.rejected(key, code)
        raise QueueFull(f"every worker is busy and {why}; retry later", code=code)

    # -- grants -----------------------------------------------------------------------------
    def _grant(
        self, routed: Routed, key: str, *, reservation: LoadTicket | None, waited_s: float | None
    ) -> Grant:
        self._counts.flying(key, routed.request.model, 1)
        if waited_s is not None:
            self._events.waited(key, waited_s)
        return Grant(
            routed,
            router=self._router,
            ledger=self._ledger,
            key=key,
            waited_s=waited_s,
            reservation=reservation,
            on_release=self._released,
        )

    def _released(self, grant: Grant) -> None:
        self._counts.flying(grant.key, grant.model, -1)
        self._wake()

    def _reserve(self, routed: Routed) -> LoadTicket | None:
        """Charge the chosen worker now, as the first attempt will (no footprint: not sent
        yet)."""
        worker = routed.chosen
        if self._ledger.entry(worker) is None:
            return None
        request = routed.request
        return self._ledger.reserve(
            worker,
            routed.predicted_uncached_tokens(worker),
            routed.load_blocks,
            request.block_size,
            request.prompt_tokens,
            keys=request.block_keys,
            dp_rank=routed.dp_rank(worker),
        )

    # -- the dispatch side ------------------------------------------------------------------
    def _wake(self) -> None:
        loop = self._loop
        if self._entries and not self._scheduled and loop is not None:
            self._scheduled = True
            loop.call_soon(self._dispatch)

    def _out_of_patience(self, entry: _Entry) -> None:
        """``entry`` has waited for KV room as long as it may: from now on it goes as
        ranked. The timer's firing ends the wait, not a clock reading, which a timer may
        precede by the loop's clock resolution (the pass would skip it again)."""
        entry.room_timer = None
        self._release_hold(entry)
        self._wake()

    def _release_hold(self, entry: _Entry) -> None:
        """``entry`` no longer waits for room: the worker it held is everyone's again."""
        if self._holds.pop(entry.seq, None) is not None:
            self._wake()

    def holds(self, seq: int | None = None) -> frozenset[WorkerId]:
        """The workers held for KV room by entries other than ``seq`` (None: any entry's)."""
        return frozenset(w for s, w in self._holds.items() if s != seq)

    def _hold(self, entry: _Entry, routed: Routed, held: frozenset[WorkerId]) -> None:
        """``entry`` waits for KV room: it holds (or keeps holding) the policy's first
        choice no other request holds, when it holds one already or fewer than
        ``ROOM_HOLDS`` are held (never every worker of a request that has more than one);
        not a worker whose ``room_hold`` part is off."""
        most = min(ROOM_HOLDS, max(1, len(routed.candidates) - 1))
        if entry.seq not in self._holds and len(self._holds) >= most:
            return
        target = next((w for w in routed.decision.ranked if w not in held), None)
        if target is not None and self._router.parts.of(target).room_hold:
            self._holds[entry.seq] = target

    def _dispatch(self) -> None:
        """Send queued requests while some worker admits them, best first (one pass)."""
        self._scheduled = False
        now = self._clock()
        free = self._free_workers()
        no_room: set[int] = set()  # entries that fit on no free worker (this pass)

        def work(entry: _Entry) -> int | None:
            """Its uncached tokens on the free worker holding most of its prompt."""
            if entry.seq in no_room or not self._under_limits(entry.key, entry.model):
                return None
            routed, held = entry.routed, self.holds(entry.seq)
            tokens = [
                routed.predicted_uncached_tokens(w)
                for w in routed.candidates
                if w in free and w not in held
            ]
            return min(tokens) if tokens else None

        order = self._tuning.order
        while (entry := next_to_dispatch(self._entries.values(), now, order, work)) is not None:
            held = self.holds(entry.seq)
            try:
                self._router.require_servable(entry.model)
                routed = self._router.reroute(
                    entry.routed, held=held, waive_room=not entry.waits_for_room
                )
            except SchedulingError as exc:  # the model's workers went away meanwhile
                self._remove(entry)
                self._events.rejected(entry.key, "no_worker")
                entry.future.set_exception(exc)
                continue
            if not routed.admitted:
                room = [w for w, r in routed.refused.items() if r.code == "kv_room" and w in free]
                if room:  # free, but the request lacks KV room there: it waits for room
                    no_room.add(entry.seq)  # a smaller request may fit where this one does not
                    self._hold(entry, routed, held)
                else:  # the free workers it could use turned out busy
                    free.difference_update(routed.candidates)
                    free.difference_update(entry.routed.candidates)  # (its workers then)
                continue
            self._remove(entry)
            grant = self._grant(
                routed,
                entry.key,
                reservation=self._reserve(routed),
                waited_s=now - entry.enqueued_at,
            )
            entry.future.set_result(grant)
            free = self._free_workers()  # the chosen worker now carries it

    def _free_workers(self) -> set[WorkerId]:
        """Ready workers at none of their limits now (any model, whatever the request)."""
        limits, parts = self._router.limits, self._router.parts
        return {
            e.id
            for e in self._ledger
            if e.worker.ready and busy(e.load(), limits, parts.of(e.id)) is None
        }

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

    def queued_by(self, served: set[str]) -> Iterator[tuple[str, str, int]]:
        """(key, model, queued requests): every known key with the first
        ``MAX_ZERO_SERIES_MODELS`` of the ``served`` models by name (0 when none is queued: a
        fleet serving thousands of adapters does not multiply the series), and any pair with
        some queued."""
        pairs = Counter((e.key, e.model) for e in self._entries.values())
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
        """Would a request routed as ``routed`` (with ``holds()``) for ``key`` queue now,
        and why."""
        model = routed.request.model
        busy_workers = {
            routed.candidates[w].url: refusal.text for w, refusal in routed.refused.items()
        }
        reason = None
        if not self.config.enabled:
            pass
        elif self._counts.queued_model[model]:
            reason = f"{self._counts.queued_model[model]} requests of this model are queued ahead"
        elif not self._under_limits(key, model):
            reason = f"key {key} or model {model} is at its concurrency limit"
        elif not any(
            w not in routed.refused or routed.refused[w].code == "held" for w in routed.candidates
        ):
            reason = "every eligible worker is busy"  # (a worker held for others is not)
        return {
            "enabled": self.config.enabled,
            "would_queue": reason is not None,
            "reason": reason,
            "key": key,
            "queued": len(self._entries),
            "queued_for_model": self._counts.queued_model[model],
            "key_in_flight": self._counts.flight_key[key],
            "busy_workers": busy_workers,
        }
