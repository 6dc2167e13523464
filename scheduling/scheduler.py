"""One call decides for a request, without the proxy: ``Scheduler.schedule``.

    grant = await scheduler.schedule(facts, key=..., session=..., timeout_s=..., disconnected=...)
        # keys -> match -> candidates (registry + ledger) -> policy.rank (pure price)
        # -> the capacity rule (the first ranked worker it admits) -> admit now or queue
        # -> Grant (the worker order for attempts, the ledger's tickets, its queue share)
    scheduler.explain(facts, key)    # /debug/route: the same decision, without sending

The scheduler owns what decides: the ledger (what kvgate sent where), the policy (prices),
the capacity rule (limits and parts, per worker), the router (keys and matches, the
ranking, the rule) and the queue; it reads the fleet from the registry and keeps which
worker produced which stored response (the Responses API's ``previous_response_id``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.backends.registry import WorkerRegistry
from kvgate.index.api import BlockIndex, PromptInput
from kvgate.index.types import WorkerId
from kvgate.scheduling.affinity import ClientKeyId, ResponseAffinity
from kvgate.scheduling.capacity import PartsTable
from kvgate.scheduling.config import QueueConfig, SchedulingConfig, Tuning
from kvgate.scheduling.errors import ResponseHolderGone, ResponseHolderUnavailable, ResponseUnknown
from kvgate.scheduling.grant import Grant
from kvgate.scheduling.guard import Guard, Move, Settled, moved_part, signals
from kvgate.scheduling.ledger import Ledger, TtftObservation
from kvgate.scheduling.queue import AdmissionQueue, QueueEvents
from kvgate.scheduling.routing import Leg, Phases, Routed, Router
from kvgate.scoring.api import Policy


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What the scheduler needs to know of one request (the HTTP layer parsed it)."""

    model: str
    prompt: PromptInput | None = None  # None: not keyed (a pass-through call)
    session_key: str | None = None  # x-session-id, else the body's ``user``
    max_tokens: int | None = None
    only: WorkerId | None = None  # the one worker allowed (a stored response's)
    spans: Phases | None = None  # a trace's routing phases
    # the workers allowed (a gateway's subset of endpoints); None: any
    allowed: frozenset[WorkerId] | None = None
    leg: Leg | None = None  # one leg of a disaggregated request: its role's workers only


class _NoEvents:
    def entered(self, key: str) -> None:
        pass

    def waited(self, key: str, seconds: float) -> None:
        pass

    def rejected(self, key: str, reason: str) -> None:
        pass


class Scheduler:
    """The decision core of one kvgate process."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        block_index: BlockIndex | None = None,
        *,
        config: SchedulingConfig | None = None,
        queue: QueueConfig | None = None,
        events: QueueEvents | None = None,
        tuning: Tuning | None = None,
        affinity: ResponseAffinity | None = None,
        keys: Sequence[str] = ("-",),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config = config or SchedulingConfig()
        tuning = tuning or Tuning()
        limits = config.limits()
        self.registry = registry
        self.parts = PartsTable(tuning.parts)
        self.ledger = Ledger(registry, limits=limits, parts_of=self.parts.of, clock=clock)
        self.router = Router(
            registry, self.ledger, policy, block_index, limits=limits, parts=self.parts
        )
        self.queue = AdmissionQueue(
            queue or QueueConfig(),
            self.router,
            self.ledger,
            events or _NoEvents(),
            tuning=tuning,
            keys=keys,
            clock=clock,
        )
        self.affinity = affinity if affinity is not None else ResponseAffinity(100_000, 3600.0)
        self.guard = Guard(self.parts, tuning.guard)
        registry.subscribe(self.guard)

    @property
    def policy(self) -> Policy:
        return self.router.policy

    def start(self) -> None:
        self.queue.start()

    def stop(self) -> None:
        """Queued requests get ``QueueTimeout``."""
        self.queue.stop()

    # -- deciding ------------------------------------------------------------------------
    async def route(self, facts: RequestFacts, *, held: bool = False) -> Routed:
        """The routing decision alone (``held``: with the workers the queue holds refused,
        as a dispatch would see them)."""
        return await self.router.decide(
            facts.model,
            facts.prompt,
            session_key=facts.session_key,
            max_tokens=facts.max_tokens,
            spans=facts.spans,
            only=facts.only,
            allowed=facts.allowed,
            held=self.queue.holds() if held else frozenset(),
            leg=facts.leg,
        )

    def route_leg(self, routed: Routed, leg: Leg) -> Routed:
        """``routed``'s request ranked again for ``leg`` of a disaggregated exchange (the
        same keys; ``NoHealthyWorker`` when no worker of that role is ready)."""
        return self.router.for_leg(routed, leg)

    async def schedule(
        self,
        facts: RequestFacts,
        *,
        key: str,
        session: str | None,
        timeout_s: float | None,
        disconnected: Callable[[], Awaitable[None]],
        queued: bool = True,
        size: int = 0,
    ) -> Grant:
        """Decide for ``facts``: route, then admit now or queue until a worker admits it
        (``queued`` False, or the queue off: sent at once, as ranked; ``size``: the bytes
        the request holds while queued)."""
        routed = await self.route(facts)
        del facts  # a queued request holds its keys, not its prompt
        return await self.admit(
            routed,
            key=key,
            session=session,
            timeout_s=timeout_s,
            disconnected=disconnected,
            queued=queued,
            size=size,
        )

    async def admit(
        self,
        routed: Routed,
        *,
        key: str,
        session: str | None,
        timeout_s: float | None,
        disconnected: Callable[[], Awaitable[None]],
        queued: bool = True,
        size: int = 0,
    ) -> Grant:
        """``routed`` through the queue (when it is on and ``queued``), else at once."""
        move = self.move_of(routed)
        if not (queued and self.queue.config.enabled):
            grant = Grant(routed, router=self.router, ledger=self.ledger, key=key)
        else:
            grant = await self.queue.admit(
                routed,
                key=key,
                session=session,
                timeout_s=timeout_s,
                disconnected=disconnected,
                size=size,
            )
        if move is not None:
            grant.audit(move, self._settle)
        return grant

    # -- do no harm (scheduling.guard) -----------------------------------------------------
    def move_of(self, routed: Routed) -> Move | None:
        """The mechanism that moves ``routed`` off the worker its price or its cache points
        to (a capacity part refusing the policy's first choice, or the price passing over
        the best-matched worker), with the predicted TTFT there; None: no move."""
        self.guard.tick(self.ledger.now())
        if not self.guard.config.enabled:
            return None
        ranked = routed.decision.ranked
        refused = routed.refused
        found = moved_part(
            ranked,
            routed.chosen,
            lambda w: refused[w].code if w in refused else None,
            routed.best_matched,
        )
        if found is None:
            return None
        part, worker = found
        return Move(
            part,
            worker,
            self.router.predicted_ttft_s(routed, worker),
            routed.predicted_cached_tokens(worker),
        )

    def _settle(
        self, grant: Grant, move: Move, worker: WorkerId, observation: TtftObservation
    ) -> Settled:
        cached_there = grant.routed.predicted_cached_tokens(worker)
        lost = max(move.lost_tokens - cached_there, 0)
        rate = self.ledger.calibrator.params(worker).prefill_tokens_per_s
        return self.guard.settle(
            move,
            waited_s=grant.waited_s or 0.0,
            measured_s=observation.measured_s,
            added_prefill_s=lost / rate if rate > 0 else 0.0,
            now=self.ledger.now(),
        )

    async def explain(self, facts: RequestFacts, key: str) -> dict[str, Any]:
        """The decision for ``facts`` and why, without sending (``/debug/route``)."""
        routed = await self.route(facts, held=True)
        explained = self.router.explain(routed)
        explained["admission"] = self.queue.explain(routed, key)
        explained["guard"] = self.explain_guard()
        return explained

    def explain_guard(self) -> dict[str, Any]:
        """Each worker's mechanisms: the parts in force, those whose signal its engine does
        not give, and the guard's audits (``/debug/route``)."""
        now = self.ledger.now()
        out: dict[str, Any] = {}
        for worker in self.registry:
            entry = self.ledger.entry(worker.id)
            capacity = self.ledger.capacity(entry) if entry is not None else None
            missing = signals(
                waiting=worker.scraped.waiting is not None,
                kv_usage=worker.scraped.kv_usage is not None,
                kv_capacity=capacity is not None,
            )
            out[worker.url] = {
                "parts_in_force": self.parts.of(worker.id).active(),
                "no_signal": missing,
                "audits": self.guard.describe(worker.id, now),
            }
        return out

    # -- stored responses ------------------------------------------------------------------
    def holder(
        self,
        response_id: str | None,
        key: ClientKeyId | None,
        *,
        param: str = "previous_response_id",
        strict: bool = False,
    ) -> WorkerId | None:
        """The worker holding a stored response of client ``key`` (None for ``key``: any
        key's, the admin's view). None: not one kvgate routed, or forgotten (routed by load,
        the engine answers for it), unless ``strict`` (clients told apart by their keys):
        then ``ResponseUnknown``. ``ResponseHolderGone`` when its worker left,
        ``ResponseHolderUnavailable`` when it cannot take a request now."""
        if response_id is None:
            return None
        holder = self.affinity.worker_of(response_id, key)
        if holder is None:
            if key is not None and strict:
                raise ResponseUnknown(response_id, param)
            return None
        worker = self.registry.find(holder)
        if worker is None:
            raise ResponseHolderGone(response_id, holder)
        if not worker.ready:
            why = "not ready" if worker.healthy else "unhealthy"
            raise ResponseHolderUnavailable(response_id, worker.url, why)
        return holder
