"""The one door from ``kvgate epp`` to kvgate's decision code: the scheduler
``kvgate serve`` uses (``scheduling.scheduler.Scheduler``: its route, then its admission),
not a copy of it.

``Placer.place`` turns a request's facts into a ``Placement``: the workers Envoy is to try,
in order (the order the scheduler granted: the chosen worker first, then at most
``upstream.max_failover`` fallbacks), ranked among the endpoints the proxy allows (its
subset hint) or the conformance suite forces alone (``RequestFacts.allowed``).
``Placement.begin`` charges a worker with the request's load (``Grant.begin``: the
scheduler's ledger, the queue's reservation handed over) and ``release`` gives the
admission's share back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvgate.backends.registry import Worker
from kvgate.index.api import PromptInput
from kvgate.index.types import WorkerId
from kvgate.router.errors import NoHealthyWorker, from_scheduling
from kvgate.router.gateway import Gateway
from kvgate.scheduling.errors import SchedulingError
from kvgate.scheduling.grant import Grant
from kvgate.scheduling.ledger import LoadTicket
from kvgate.scheduling.routing import Routed
from kvgate.scheduling.scheduler import RequestFacts


@dataclass(frozen=True, slots=True)
class Ask:
    """One request's facts, as the decision needs them."""

    model: str
    prompt: PromptInput | None
    session: str | None
    max_tokens: int | None
    key: str  # the client key id ("-" without client keys)
    timeout_s: float | None  # the client's own timeout (the queue waits no longer)
    queued: bool = True  # through the admission queue
    only: WorkerId | None = None  # the worker holding a previous response
    among: frozenset[WorkerId] | None = None  # the workers allowed (None: any)
    size: int = 0  # the bytes of the body it holds while queued


class Placement:
    """Where one request goes, and its share of the admission until ``release``."""

    __slots__ = ("_grant", "order", "routed")

    def __init__(self, routed: Routed, grant: Grant, order: tuple[Worker, ...]) -> None:
        self._grant = grant
        self.routed = routed  # the ranking the order comes from
        self.order = order  # chosen first, then the fallbacks

    @property
    def waited_s(self) -> float | None:
        """Seconds the request waited in the queue (None: never queued)."""
        return self._grant.waited_s

    def begin(self, worker: Worker) -> LoadTicket:
        """``worker`` takes the request: its load counted from now on (the queue's
        reservation, if any, handed over) and the index told (approximate mode learns)."""
        ticket = self._grant.begin(worker.id)
        self._grant.sent(worker.id)
        return ticket

    def release(self) -> None:
        """The request is over (idempotent): its admission share goes back."""
        self._grant.release()


class Placer:
    """Places requests with the gateway's scheduler."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._fallbacks = gateway.settings.upstream.max_failover

    async def place(self, ask: Ask, disconnected: Callable[[], Awaitable[None]]) -> Placement:
        """``ModelNotFound`` / ``NoHealthyWorker`` (none allowed can serve), ``QueueFull``,
        ``QueueTimeout``, ``ClientClosed`` as ``serve``'s scheduler raises them."""
        gateway = self._gateway
        retry = gateway.settings.retry_after_s
        scheduler = gateway.scheduler
        facts = RequestFacts(
            ask.model,
            ask.prompt,
            session_key=ask.session,
            max_tokens=ask.max_tokens,
            only=ask.only,
            allowed=ask.among,  # ranked among these alone, at the pick and at dispatch
        )
        try:
            grant = await scheduler.schedule(
                facts,
                key=ask.key,
                session=ask.session,
                timeout_s=ask.timeout_s,
                disconnected=disconnected,
                queued=ask.queued,
                size=ask.size,
            )
        except SchedulingError as exc:
            raise from_scheduling(exc, retry_after_s=retry) from exc
        routed = grant.routed
        order = []
        for worker_id in routed.order[: 1 + self._fallbacks]:
            worker = gateway.registry.find(worker_id)
            if worker is not None:
                order.append(worker)
        if not order:
            grant.release()
            raise NoHealthyWorker(ask.model, retry_after_s=retry)
        return Placement(routed, grant, tuple(order))
