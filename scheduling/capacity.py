"""The one capacity rule: may this worker take this request now, and if not, why. Pure.

Routing and the queue read the same rule. A worker is refused, in this order, when:

* ``waiting``: its engine reports ``max_waiting_requests`` or more waiting requests;
* ``pending_prefill``: kvgate sent it ``max_pending_prefill_tokens`` or more prompt tokens
  not yet prefilled;
* ``in_flight``: kvgate has ``max_in_flight`` or more requests in flight there;
* ``kv_usage``: its engine reports a KV usage of ``max_kv_usage`` or more;
* ``kv_room``: the request's blocks do not fit beside the blocks held by the requests in
  flight there (its capacity known, the request no larger than the whole cache).

Each limit is one comparison, ``>=``, for everyone. The rule never reorders: routing keeps
the policy's ranking and puts the refused workers after the admitted ones (failover only);
when none is admitted the queue waits.

Every mechanism that moves a request off the worker holding its prefix or holds it back is
a named part (``Parts``) that can be switched off per worker: the limits above, streamed
answers' blocks counted as held (``answer_blocks``, the ledger's), and the queue's wait for
KV room and its hold on the worker it waits for (``room_wait``, ``room_hold``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from kvgate.index.types import WorkerId
from kvgate.scoring.api import Candidate, WorkerLoad
from kvgate.scoring.cost import RequestSize


@dataclass(frozen=True, slots=True)
class Parts:
    """Which mechanisms are on for one worker (all by default)."""

    waiting: bool = True
    pending_prefill: bool = True
    in_flight: bool = True
    kv_usage: bool = True
    # Off by default (issue 46): on engines we did not write (Dynamo's mocker, and engines
    # measured outside this repository) requests refused for KV room and answers' blocks
    # counted as held cost hit rate and goodput; on for benchmarks (``KV_FIT``) only.
    kv_room: bool = False
    answer_blocks: bool = False
    room_wait: bool = True
    room_hold: bool = True

    def active(self) -> list[str]:
        """The names of the parts that are on."""
        return [f.name for f in fields(self) if getattr(self, f.name)]


KV_FIT = Parts(kv_room=True, answer_blocks=True)
"""The KV-room rule and answers' blocks on: the defaults before issue 46's measurements."""


class PartsTable:
    """The parts in force for each worker: a default and per-worker overrides (internal:
    issue 46's online guard turns a part down on a worker where it does harm)."""

    __slots__ = ("_overrides", "default")

    def __init__(self, default: Parts = Parts()) -> None:
        self.default = default
        self._overrides: dict[WorkerId, Parts] = {}

    def of(self, worker: WorkerId) -> Parts:
        return self._overrides.get(worker, self.default)

    def set(self, worker: WorkerId, parts: Parts | None) -> None:
        """``worker``'s own parts (None: the default again)."""
        if parts is None:
            self._overrides.pop(worker, None)
        else:
            self._overrides[worker] = parts

    def forget(self, worker: WorkerId) -> None:
        self._overrides.pop(worker, None)


@dataclass(frozen=True, slots=True)
class Limits:
    """The rule's thresholds (``SchedulingConfig``); ``None`` turns one off."""

    max_waiting_requests: int | None = 32
    max_pending_prefill_tokens: int | None = 65536
    max_in_flight: int | None = None
    max_kv_usage: float | None = 0.98
    kv_capacity_blocks: int | None = None  # of workers whose engine publishes none


HELD_TEXT = "held for a queued request waiting for KV room there"
ROOM_TEXT = "lacks KV room for this request"
_NAMES = {
    "waiting": "waiting",
    "pending_prefill": "pending prefill tokens",
    "in_flight": "in flight",
    "kv_usage": "kv usage",
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a worker may not take a request now: the part (``code``) and its figures."""

    code: str  # a Parts field, or "held" (the queue holds it for another request)
    value: float = 0.0
    limit: float = 0.0

    @property
    def text(self) -> str:
        if self.code == "kv_room":
            return ROOM_TEXT
        if self.code == "held":
            return HELD_TEXT
        return f"{_NAMES[self.code]} {self.value:g} >= {self.limit:g}"

    @property
    def busy(self) -> bool:
        """Refused whatever the request (a limit of the worker's), not for its size."""
        return self.code in _NAMES


HELD = Refusal("held")
ROOM = Refusal("kv_room")


def capacity_of(load: WorkerLoad, limits: Limits) -> int | None:
    """The worker's KV capacity in blocks: its engine's, else the configured one."""
    return load.kv_capacity_blocks or limits.kv_capacity_blocks


def held_blocks(load: WorkerLoad, capacity: int | None) -> tuple[float, float | None]:
    """Blocks held by the worker's requests in flight: (kvgate's count, the engine's KV
    usage x ``capacity``: None without either)."""
    scraped = None
    if load.scraped_kv_usage is not None and capacity is not None:
        scraped = min(max(load.scraped_kv_usage, 0.0), 1.0) * capacity
    return float(load.active_decode_blocks), scraped


def kv_overcommit(load: WorkerLoad, resident_blocks: float, capacity: int | None) -> float:
    """Held blocks (the larger of kvgate's count and the engine's) plus ``resident_blocks``,
    less ``capacity``: what requests in flight must release before a request needing
    ``resident_blocks`` starts there (it fits at 0 or below); 0 without a capacity."""
    if capacity is None:
        return 0.0
    predicted, scraped = held_blocks(load, capacity)
    held = max(predicted, 0.0)
    if scraped is not None and scraped > held:
        held = scraped
    return held + resident_blocks - capacity


def resident_blocks(candidate: Candidate, size: RequestSize) -> float:
    """The blocks a request needs room for on a worker: all of them, less the prefix a
    request in flight there holds already (referenced, not copied). A cached match counts:
    it is free, evictable memory until the request runs."""
    return float(max(size.blocks - max(candidate.in_flight_prefix, 0), 0))


def kv_shortfall(candidate: Candidate, size: RequestSize, limits: Limits) -> float:
    """KV blocks the request lacks on the worker to start beside its requests in flight (0:
    it fits, or the capacity is unknown); at most the request's resident blocks."""
    resident = resident_blocks(candidate, size)
    capacity = capacity_of(candidate.load, limits)
    return min(max(kv_overcommit(candidate.load, resident, capacity), 0.0), resident)


def busy(load: WorkerLoad, limits: Limits, parts: Parts) -> Refusal | None:
    """The first of the worker's limits ``load`` is at or over (whatever the request)."""
    limit: float | None = limits.max_waiting_requests
    waiting = load.scraped_waiting
    if parts.waiting and _over(waiting, limit):
        return Refusal("waiting", waiting or 0, limit or 0)
    limit = limits.max_pending_prefill_tokens
    if parts.pending_prefill and _over(load.pending_prefill_tokens, limit):
        return Refusal("pending_prefill", load.pending_prefill_tokens, limit or 0)
    limit = limits.max_in_flight
    if parts.in_flight and _over(load.in_flight, limit):
        return Refusal("in_flight", load.in_flight, limit or 0)
    limit, usage = limits.max_kv_usage, load.scraped_kv_usage
    if parts.kv_usage and _over(usage, limit):
        return Refusal("kv_usage", usage or 0.0, limit or 0.0)
    return None


def _over(value: float | None, limit: float | None) -> bool:
    return value is not None and limit is not None and value >= limit and value > 0


def lacks_room(candidate: Candidate, size: RequestSize, limits: Limits) -> bool:
    """Does the request not fit there now, though it would in the empty cache?"""
    resident = resident_blocks(candidate, size)
    capacity = capacity_of(candidate.load, limits)
    if capacity is None or resident > capacity:  # unknown, or it can never fit: no wait
        return False
    return kv_overcommit(candidate.load, resident, capacity) > 0.0


@dataclass(frozen=True, slots=True)
class Verdicts:
    """The rule's answer for each candidate of one request: its refusal, or none."""

    refused: dict[WorkerId, Refusal]
    room_waived: bool  # kv_room refusals were lifted (nowhere has room, or patience is over)

    def admits(self, worker: WorkerId) -> bool:
        return worker not in self.refused


def judge(
    size: RequestSize,
    candidates: list[Candidate],
    limits: Limits,
    parts_of: Callable[[WorkerId], Parts],
    *,
    held: frozenset[WorkerId] = frozenset(),
    waive_room: bool = False,
) -> Verdicts:
    """Every candidate's verdict for a request of ``size``.

    ``held``: workers the queue holds for another request (refused as ``held``). A
    ``kv_room`` refusal stands while some candidate has room for the request; where none
    has, it is lifted on the workers whose ``room_wait`` part is off (the request has no
    better place, and waits in the engine like anywhere else), and everywhere with
    ``waive_room`` (its patience is over)."""
    refused: dict[WorkerId, Refusal] = {}
    no_room: list[WorkerId] = []  # admitted but for the room they lack
    room_somewhere = False
    for candidate in candidates:
        worker = candidate.worker
        if worker in held:
            refused[worker] = HELD
            continue
        parts = parts_of(worker)
        short = parts.kv_room and not waive_room and lacks_room(candidate, size, limits)
        room_somewhere = room_somewhere or not short
        reason = busy(candidate.load, limits, parts)
        if reason is not None:
            refused[worker] = reason
        elif short:
            no_room.append(worker)
    waived = waive_room
    for worker in no_room:
        if room_somewhere or parts_of(worker).room_wait:
            refused[worker] = ROOM
        else:
            waived = True
    return Verdicts(refused, waived)
