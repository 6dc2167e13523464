"""The one door from ``kvgate epp`` to kvgate's decision code: the same routing and
admission as ``kvgate serve`` (``router.routing.Router.decide``, then
``router.admission.AdmissionQueue.admit``), not a copy of them.

``Placer.place`` turns a request's facts into a ``Placement``: the workers Envoy is to try,
in order (the ranking the admission granted: the chosen worker first, then at most
``upstream.max_failover`` fallbacks), restricted to the endpoints the proxy allows (its
subset hint) or the conformance suite forces. ``Placement.begin`` charges a worker with the
request's load (``WorkerRegistry.begin``, the admission's reservation handed over) and
``release`` gives the admission's share back. Nothing else in ``router/epp`` reaches the
router, the queue or the registry's load accounting: when the decision core moves behind
one call, this module is what changes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, replace

from backends.registry import LoadTicket, Worker
from index.api import PromptInput
from index.types import WorkerId
from router.admission import Grant
from router.errors import NoHealthyWorker
from router.gateway import Gateway
from router.routing import Routed


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

    __slots__ = ("_gateway", "_grant", "order", "routed")

    def __init__(
        self, gateway: Gateway, routed: Routed, grant: Grant | None, order: tuple[Worker, ...]
    ) -> None:
        self._gateway = gateway
        self._grant = grant
        self.routed = routed  # the ranking the order comes from
        self.order = order  # chosen first, then the fallbacks

    @property
    def waited_s(self) -> float | None:
        """Seconds the request waited in the queue (None: never queued)."""
        return self._grant.waited_s if self._grant is not None else None

    def begin(self, worker: Worker) -> LoadTicket:
        """``worker`` takes the request: its load counted from now on (the queue's
        reservation, if any, handed over) and the index told (approximate mode learns)."""
        if self._grant is not None:
            self._grant.started()
        routed = self.routed
        request = routed.request
        ticket = self._gateway.registry.begin(
            worker.id,
            routed.predicted_uncached_tokens(worker.id),
            routed.load_blocks,
            request.block_size,
            request.prompt_tokens,
            keys=request.block_keys,
        )
        self._gateway.router.record_sent(routed, worker.id)
        return ticket

    def release(self) -> None:
        """The request is over (idempotent): its admission share goes back."""
        if self._grant is not None:
            self._grant.release()


class Placer:
    """Places requests with the gateway's router and admission queue."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._fallbacks = gateway.settings.upstream.max_failover

    async def place(self, ask: Ask, disconnected: Callable[[], Awaitable[None]]) -> Placement:
        """``ModelNotFound`` / ``NoHealthyWorker`` (none allowed can serve), ``QueueFull``,
        ``QueueTimeout``, ``ClientClosed`` as ``serve``'s routing and queue raise them."""
        gateway = self._gateway
        routed = await gateway.router.decide(
            ask.model,
            ask.prompt,
            session_key=ask.session,
            max_tokens=ask.max_tokens,
            only=ask.only,
        )
        routed = _among(routed, ask.among, gateway.settings.retry_after_s)
        grant = None
        queue = gateway.admission
        if ask.queued and queue is not None and queue.config.enabled:
            grant = await queue.admit(
                routed,
                key=ask.key,
                session=ask.session,
                timeout_s=ask.timeout_s,
                disconnected=disconnected,
                size=ask.size,
            )
            try:  # at dispatch the queue ranked afresh: keep to the allowed workers
                routed = _among(grant.routed, ask.among, gateway.settings.retry_after_s)
            except NoHealthyWorker:
                grant.release()
                raise
        order = []
        for worker_id in routed.decision.ranked[: 1 + self._fallbacks]:
            worker = gateway.registry.find(worker_id)
            if worker is not None:
                order.append(worker)
        if not order:
            if grant is not None:
                grant.release()
            raise NoHealthyWorker(ask.model, retry_after_s=gateway.settings.retry_after_s)
        return Placement(gateway, routed, grant, tuple(order))


def _among(routed: Routed, among: Collection[WorkerId] | None, retry_after_s: int) -> Routed:
    """``routed`` with only the workers in ``among`` ranked (their order kept);
    ``NoHealthyWorker`` when none of them is."""
    if among is None:
        return routed
    decision = routed.decision
    ranked = [w for w in decision.ranked if w in among]
    if not ranked:
        raise NoHealthyWorker(routed.request.model, retry_after_s=retry_after_s)
    if len(ranked) == len(decision.ranked):
        return routed
    scores = [s for s in decision.scores if s.worker in among]
    candidates = {w: c for w, c in routed.candidates.items() if w in among}
    return replace(
        routed, candidates=candidates, decision=replace(decision, ranked=ranked, scores=scores)
    )
