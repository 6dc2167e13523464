"""Do no harm: every mechanism that moves a request off the worker its price chose, or holds
it back, is audited on the engines' own feedback and turns itself off where it loses.

A *move* is one decision a mechanism made:

* a capacity part (``scheduling.capacity.Parts``: ``waiting``, ``pending_prefill``,
  ``in_flight``, ``kv_usage``, ``kv_room``, ``room_hold``) refused the worker the policy
  ranked first, so the request went to another worker or waited in kvgate's queue;
* the price itself (``price``) sent the request to a worker holding less of its prompt
  than the best-matched one (load traded for cache). Audited only: the price is the floor.

When the request's answer comes back, the move is settled on what the engine measured::

    net_s = predicted TTFT on the worker it was moved off (the TTFT model, learned from
            that engine's own measured TTFTs, at the moment of the move)
          - (time waited in kvgate's queue + the TTFT measured where it went)
          - the prefill time the move added (cached tokens given up x the prefill rate
            where it went: work the fleet does again, delaying whoever waits behind it)

Positive: the move paid. Each (worker, part) keeps its last ``window`` settled moves; when
at least ``min_moves`` are in and their mean is below zero, the part is turned off on that
worker for ``cooldown_s`` (doubled each time it is turned down again, up to
``max_cooldown_s``), then back on to be audited afresh. With every capacity part off, a
request goes where the price ranks it: kvgate's worst case is its plain overlap-versus-load
cost. A part whose signal an engine does not give (no waiting count, no KV usage, no KV
capacity) already refuses nothing there (``scheduling.capacity``); ``signals`` says which.

Pure: no clock of its own (times are passed in), no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvgate.index.api import EngineWorker
from kvgate.index.types import WorkerId
from kvgate.scheduling.capacity import PartsTable

PRICE = "price"
"""The price's own moves (load traded for cache): audited, never turned off."""
GUARDED = ("waiting", "pending_prefill", "in_flight", "kv_usage", "kv_room", "room_hold")
"""Capacity parts the guard may turn off on a worker (``Parts`` fields)."""
AUDITED = (*GUARDED, PRICE)
_CODE_PART = {"held": "room_hold"}  # a Refusal code -> the part that made it


def part_of(refusal_code: str) -> str:
    """The part behind a capacity refusal's code."""
    return _CODE_PART.get(refusal_code, refusal_code)


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """The guard's constants (``Tuning.guard``; never a user option)."""

    enabled: bool = True
    window: int = 32  # settled moves kept per (worker, part)
    min_moves: int = 8  # settled moves before a part can be turned off
    cooldown_s: float = 120.0  # first time off; doubled on each repeat
    max_cooldown_s: float = 1800.0


@dataclass(frozen=True, slots=True)
class Move:
    """One decision a part made, waiting for its outcome."""

    part: str
    worker: WorkerId  # the worker the request was moved off (or held back from)
    predicted_s: float  # its predicted TTFT there, at the move
    lost_tokens: int  # cached tokens given up where it went instead (0: none, or unknown)


@dataclass(slots=True)
class _Audit:
    """One (worker, part)'s recent settled moves and its state."""

    nets: deque[float]
    moves: int = 0
    net_total_s: float = 0.0
    off_until: float | None = None
    times_off: int = 0
    last_mean_s: float | None = None

    def mean(self) -> float | None:
        return sum(self.nets) / len(self.nets) if self.nets else None


@dataclass(frozen=True, slots=True)
class Settled:
    """A settled move (for metrics): its part, worker, net seconds and whether it turned
    the part off."""

    part: str
    worker: WorkerId
    net_s: float
    turned_off: bool


@dataclass(slots=True)
class Guard:
    """The audits of every (worker, part), and the per-worker parts they turn off."""

    parts: PartsTable
    config: GuardConfig = field(default_factory=GuardConfig)
    _audits: dict[tuple[WorkerId, str], _Audit] = field(default_factory=dict)
    _next_on: float | None = None  # the earliest time a part turned off comes back on

    def settle(
        self, move: Move, *, waited_s: float, measured_s: float, added_prefill_s: float, now: float
    ) -> Settled:
        """The outcome of ``move``: the request waited ``waited_s`` in kvgate, its TTFT where
        it went was ``measured_s``, and the cache it gave up cost ``added_prefill_s``."""
        net = move.predicted_s - (max(waited_s, 0.0) + measured_s) - max(added_prefill_s, 0.0)
        audit = self._audit(move.worker, move.part)
        audit.nets.append(net)
        audit.moves += 1
        audit.net_total_s += net
        audit.last_mean_s = mean = audit.mean()
        turned_off = False
        if (
            self.config.enabled
            and move.part in GUARDED
            and len(audit.nets) >= self.config.min_moves
            and mean is not None
            and mean < 0.0
        ):
            self._turn_off(move.worker, move.part, audit, now)
            turned_off = True
        return Settled(move.part, move.worker, net, turned_off)

    def tick(self, now: float) -> list[tuple[WorkerId, str]]:
        """Turn back on every part whose time off is over (to be audited afresh); returns
        the (worker, part) pairs turned back on."""
        if self._next_on is None or now < self._next_on:
            return []
        back: list[tuple[WorkerId, str]] = []
        self._next_on = None
        for (worker, part), audit in self._audits.items():
            if audit.off_until is None:
                continue
            if now >= audit.off_until:
                audit.off_until = None
                self._set_part(worker, part, on=True)
                back.append((worker, part))
            else:
                self._next_on = _earliest(self._next_on, audit.off_until)
        return back

    def is_off(self, worker: WorkerId, part: str) -> bool:
        audit = self._audits.get((worker, part))
        return audit is not None and audit.off_until is not None

    # -- following the fleet (a registry listener) ------------------------------------------
    def worker_added(self, worker: EngineWorker) -> None:
        pass

    def worker_removed(self, worker: WorkerId) -> None:
        """A worker left: its audits go (they are bounded by the fleet's size)."""
        for key in [key for key in self._audits if key[0] == worker]:
            del self._audits[key]
        self.parts.forget(worker)

    def worker_health_changed(self, worker: EngineWorker) -> None:
        pass

    def states(self) -> Iterator[tuple[WorkerId, str, bool]]:
        """Every audited (worker, part) and whether the guard has it off."""
        for (worker, part), audit in self._audits.items():
            yield worker, part, audit.off_until is not None

    def describe(self, worker: WorkerId, now: float) -> dict[str, Any]:
        """``/debug/route``'s view of one worker's audits."""
        out: dict[str, Any] = {}
        for (owner, part), audit in self._audits.items():
            if owner != worker:
                continue
            mean = audit.mean()
            out[part] = {
                "moves": audit.moves,
                "recent_moves": len(audit.nets),
                "recent_mean_net_s": None if mean is None else round(mean, 4),
                "net_total_s": round(audit.net_total_s, 4),
                "off_for_s": None
                if audit.off_until is None
                else round(max(audit.off_until - now, 0.0), 1),
                "times_turned_off": audit.times_off,
            }
        return out

    def _audit(self, worker: WorkerId, part: str) -> _Audit:
        key = (worker, part)
        audit = self._audits.get(key)
        if audit is None:
            audit = self._audits[key] = _Audit(deque(maxlen=max(self.config.window, 1)))
        return audit

    def _turn_off(self, worker: WorkerId, part: str, audit: _Audit, now: float) -> None:
        cooldown = min(self.config.cooldown_s * (2.0**audit.times_off), self.config.max_cooldown_s)
        audit.times_off += 1
        audit.off_until = now + cooldown
        audit.nets.clear()
        self._next_on = _earliest(self._next_on, audit.off_until)
        self._set_part(worker, part, on=False)

    def _set_part(self, worker: WorkerId, part: str, *, on: bool) -> None:
        current = self.parts.of(worker)
        updated = replace(current, **{part: on})
        self.parts.set(worker, None if updated == self.parts.default else updated)


def signals(
    *,
    waiting: bool,
    kv_usage: bool,
    kv_capacity: bool,
) -> dict[str, str]:
    """Which parts read a signal this worker's engine does not give (they refuse nothing
    there): part -> why."""
    missing: dict[str, str] = {}
    if not waiting:
        missing["waiting"] = "the engine reports no waiting count"
    if not kv_usage:
        missing["kv_usage"] = "the engine reports no KV-cache usage"
    if not kv_capacity:
        missing["kv_room"] = "the worker's KV capacity is unknown"
    return missing


def moved_part(
    ranked: Sequence[WorkerId],
    chosen: WorkerId,
    refused_code: Callable[[WorkerId], str | None],
    best_matched: WorkerId | None,
) -> tuple[str, WorkerId] | None:
    """Which part moved a request, and off which worker: the policy's first choice refused
    by a capacity part (that part), else a better-matched worker passed over by the price
    (``price``); None when the request goes where the price and the cache both point."""
    if not ranked:
        return None
    first = ranked[0]
    code = refused_code(first)
    if code is not None:
        return part_of(code), first
    if best_matched is not None and best_matched != chosen:
        return PRICE, best_matched
    return None


def _earliest(current: float | None, candidate: float) -> float:
    return candidate if current is None else min(current, candidate)
