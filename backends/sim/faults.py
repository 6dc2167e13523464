"""Standing faults of one replica: failing or aborting requests, dropping, delaying or
stopping events, slowness, a paused engine.

A standing fault lasts until cleared, for ``count`` occurrences, or for ``duration_s``
seconds (wall clock), whichever ends first; ``rate`` is the chance that an occasion is hit.
One-shot faults (restart, crash, refuse, reset_cache) are actions of the replica
(``replica.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeGuard, get_args

StandingKind = Literal[
    "fail", "abort", "drop_events", "delay_events", "stop_events", "slow", "slow_prefill", "pause"
]
ActionKind = Literal["restart", "crash", "refuse", "resume", "reset_cache", "clear"]
FAULT_KINDS: tuple[str, ...] = (*get_args(StandingKind), *get_args(ActionKind))


class FaultError(ValueError):
    """A malformed fault request; the message names the field."""


@dataclass(slots=True)
class Fault:
    """One standing fault. ``value``: HTTP status (fail), tokens before the failure (abort),
    seconds (delay_events), factor (slow, slow_prefill)."""

    kind: StandingKind
    rate: float = 1.0
    count: int | None = None
    until: float | None = None
    value: float = 0.0
    replayable: bool = True
    drop: bool = False
    """abort: the connection is dropped (no error event, no end of stream)."""

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def _number(body: Mapping[str, Any], name: str, default: float | None) -> float | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultError(f"'{name}' must be a number")
    return float(value)


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise FaultError(f"'{name}' must be a boolean")
    return value


_VALUES: dict[str, tuple[str, float]] = {
    "fail": ("status", 500),
    "abort": ("after_tokens", 0),
    "delay_events": ("delay_s", 0.0),
    "slow": ("factor", 1.0),
    "slow_prefill": ("factor", 1.0),
}
"""Kinds with a value: the body field that sets it and its default."""


def _value(kind: str, body: Mapping[str, Any]) -> float:
    if kind not in _VALUES:
        return 0.0
    name, default = _VALUES[kind]
    value = _number(body, name, default)
    if value is None or value < 0 or (kind in ("slow", "slow_prefill") and value <= 0):
        raise FaultError(f"'{name}' must be a positive number")
    if kind == "fail" and not 400 <= value <= 599:
        raise FaultError("'status' must be an HTTP error status (400..599)")
    if kind == "abort" and value != int(value):
        raise FaultError("'after_tokens' must be a non-negative integer")
    return value


def _is_standing(kind: object) -> TypeGuard[StandingKind]:
    return kind in get_args(StandingKind)


def parse_fault(body: Mapping[str, Any], now: float) -> Fault:
    """A standing fault from an admin request body (``kind`` is one of the standing kinds)."""
    kind = body.get("kind")
    if not _is_standing(kind):
        raise FaultError(f"'kind' must be one of {', '.join(FAULT_KINDS)}")
    rate = _number(body, "rate", 1.0)
    count = _number(body, "count", None)
    duration = _number(body, "duration_s", None)
    if rate is None or not 0.0 <= rate <= 1.0:
        raise FaultError("'rate' must be within 0..1")
    if count is not None and (count < 0 or count != int(count)):
        raise FaultError("'count' must be a non-negative integer")
    if duration is not None and duration < 0:
        raise FaultError("'duration_s' must be >= 0")
    return Fault(
        kind=kind,
        rate=rate,
        count=None if count is None else int(count),
        until=None if duration is None else now + duration,
        value=_value(kind, body),
        replayable=_flag(body, "replayable", True),
        drop=_flag(body, "drop", False),
    )


class FaultState:
    """The standing faults of one replica; ``rng`` decides rate-limited hits (seeded)."""

    def __init__(self, rng: random.Random, clock: Callable[[], float]) -> None:
        self._rng = rng
        self._clock = clock
        self._faults: dict[str, Fault] = {}
        self.hits: dict[str, int] = {}

    def set(self, fault: Fault) -> None:
        self._faults[fault.kind] = fault

    def clear(self, kind: str | None = None) -> None:
        if kind is None:
            self._faults.clear()
        else:
            self._faults.pop(kind, None)

    def active(self, kind: StandingKind) -> Fault | None:
        """The fault of this kind if it is still in force (without consuming an occurrence)."""
        fault = self._faults.get(kind)
        if fault is None:
            return None
        if (fault.until is not None and self._clock() >= fault.until) or fault.count == 0:
            del self._faults[kind]
            return None
        return fault

    def hit(self, kind: StandingKind) -> Fault | None:
        """Whether this occasion is hit by the fault (consumes one occurrence if so)."""
        fault = self.active(kind)
        if fault is None or (fault.rate < 1.0 and self._rng.random() >= fault.rate):
            return None
        if fault.count is not None:
            fault.count -= 1
        self.hits[kind] = self.hits.get(kind, 0) + 1
        return fault

    def slowdown(self) -> float:
        fault = self.active("slow")
        return fault.value if fault is not None else 1.0

    def prefill_slowdown(self) -> float:
        fault = self.active("slow_prefill")
        return fault.value if fault is not None else 1.0

    def event_delay(self) -> float:
        fault = self.active("delay_events")
        return fault.value if fault is not None else 0.0

    def describe(self) -> list[dict[str, Any]]:
        return [f.describe() for f in list(self._faults.values()) if self.active(f.kind)]
