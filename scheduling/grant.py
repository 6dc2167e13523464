"""A request let through: where to send it, and its share of the fleet until it ends.

The proxy moves bytes; the grant does the scheduler's side of each attempt::

    grant = await scheduler.schedule(...)
    try:
        ticket = grant.begin(grant.routed.chosen)  # the ledger counts it there
        ...                                        # send; grant.sent(worker) at the head
        routed = grant.reroute(tried)              # a failed attempt: rank again, or None
    finally:
        grant.release()                            # its key's and model's share goes back
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from kvgate.index.types import WorkerId
from kvgate.scheduling.errors import NoHealthyWorker
from kvgate.scheduling.guard import Move, Settled
from kvgate.scheduling.ledger import Ledger, LoadTicket, TtftObservation
from kvgate.scheduling.routing import Routed, Router

Settle = Callable[["Grant", Move, WorkerId, TtftObservation], Settled]


class Grant:
    """One request let through (``waited_s``: how long it was queued, None: never); from
    the queue, with a reservation of its worker's load until its first attempt begins."""

    __slots__ = (
        "_audit",
        "_ledger",
        "_on_release",
        "_released",
        "_reservation",
        "_router",
        "key",
        "model",
        "routed",
        "waited_s",
    )

    def __init__(
        self,
        routed: Routed,
        *,
        router: Router,
        ledger: Ledger,
        key: str = "-",
        waited_s: float | None = None,
        reservation: LoadTicket | None = None,
        on_release: Callable[[Grant], None] | None = None,
    ) -> None:
        self.routed = routed
        self.key = key
        self.model = routed.request.model
        self.waited_s = waited_s
        self._router = router
        self._ledger = ledger
        self._reservation = reservation
        self._on_release = on_release
        self._released = False
        self._audit: tuple[Move, Settle] | None = None

    def begin(self, worker: WorkerId, *, cached: int | None = None) -> LoadTicket:
        """An attempt on ``worker`` starts: the ledger counts the request there (the
        queue's reservation, if any, is handed over first: the request's own reservation is
        no load ahead of it). ``cached``: the prompt tokens it will find cached there, when
        not its predicted match (a decode leg given its prefill's KV)."""
        self.started()
        routed = self.routed
        request = routed.request
        uncached = routed.predicted_uncached_tokens(worker)
        if cached is not None:
            uncached = max(request.prompt_tokens - cached, 0)
        return self._ledger.begin(
            worker,
            uncached,
            routed.load_blocks,
            request.block_size,
            request.prompt_tokens,
            keys=request.block_keys,
            dp_rank=routed.dp_rank(worker),
        )

    def sent(self, worker: WorkerId) -> None:
        """``worker`` took the request (its answer's head came back)."""
        self._router.record_sent(self.routed, worker)

    def reroute(self, exclude: Collection[WorkerId]) -> Routed | None:
        """The request ranked again without ``exclude`` (failed attempts), or None when no
        worker is left."""
        try:
            self.routed = self._router.reroute(self.routed, exclude)
        except NoHealthyWorker:
            return None
        return self.routed

    def audit(self, move: Move, settle: Settle) -> None:
        """A mechanism moved this request (``scheduling.guard``): settle ``move`` on the
        first answer's measured TTFT."""
        self._audit = (move, settle)

    def observed(self, worker: WorkerId, observation: TtftObservation) -> Settled | None:
        """An attempt on ``worker`` was answered and its TTFT measured: the move that sent
        it there (if any) is settled, once."""
        audit, self._audit = self._audit, None
        if audit is None:
            return None
        move, settle = audit
        return settle(self, move, worker, observation)

    def started(self) -> None:
        """The reservation (if any) is handed over to the request's own ticket."""
        if self._reservation is not None:
            self._reservation.finish()
            self._reservation = None

    def release(self) -> None:
        """The exchange is over (idempotent): its share of the queue's limits goes back."""
        if not self._released:
            self._released = True
            self.started()
            if self._on_release is not None:
                self._on_release(self)
