"""Which queued request goes first when a worker frees up: pure ordering, no I/O.

A queued request's *work* is the prompt it must still prefill on the free worker that holds
most of it (its uncached tokens there; the caller's ``work`` says, ``None`` when the request
may not go now: no free worker for it, or its tenant or model at its concurrency limit),
plus ``base_tokens`` for what every request costs. The cheapest work for the fleet goes
first (a session turn whose history is cached on a free worker needs little prefill, so it
frees its place soon and keeps its cache warm; one whose cache is on a busy worker would
recompute it and waits for its home instead), and waiting earns credit: each second in the
queue takes ``aging_tokens_per_s`` off the work. A request of work W therefore never waits
more than ``W / aging_tokens_per_s`` seconds longer than a request of no work that arrived
when it did: starvation is bounded whatever the arrival rate. The default (65,536 tokens a
second) lets the cheapest go first among requests that arrived close together and otherwise
keeps near the arrival order. Ties go to the earlier arrival. Only the oldest queued turn
of a session is eligible (its turns leave in order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

AGING_TOKENS_PER_S = 65536.0
"""Credit per second queued: a 32k-token prompt is passed by cheaper requests for about
half a second at most."""
BASE_TOKENS = 256
"""Work counted for every request."""


@dataclass(frozen=True, slots=True)
class OrderConfig:
    aging_tokens_per_s: float = AGING_TOKENS_PER_S
    base_tokens: int = BASE_TOKENS


class Queued(Protocol):
    """What the order reads of a queued request."""

    @property
    def seq(self) -> int: ...  # arrival order, unique

    @property
    def enqueued_at(self) -> float: ...  # monotonic seconds

    @property
    def session(self) -> str | None: ...


Q = TypeVar("Q", bound=Queued)


def dispatch_priority(entry: Queued, work_tokens: int, now: float, config: OrderConfig) -> float:
    """Lower goes first: ``base + work - aging_tokens_per_s * waited_seconds``."""
    waited = max(now - entry.enqueued_at, 0.0)
    return config.base_tokens + work_tokens - config.aging_tokens_per_s * waited


def session_heads(entries: Iterable[Q]) -> list[Q]:
    """Each session's oldest entry, and every entry without a session."""
    heads: dict[str, Q] = {}
    out: list[Q] = []
    for entry in entries:
        if entry.session is None:
            out.append(entry)
            continue
        held = heads.get(entry.session)
        if held is None or entry.seq < held.seq:
            heads[entry.session] = entry
    out.extend(heads.values())
    return out


def next_to_dispatch(
    entries: Iterable[Q], now: float, config: OrderConfig, work: Callable[[Q], int | None]
) -> Q | None:
    """The entry to dispatch first among the session heads that may go, or ``None``."""
    best: Q | None = None
    best_key = (0.0, 0)
    for entry in session_heads(entries):
        tokens = work(entry)
        if tokens is None:
            continue
        key = (dispatch_priority(entry, tokens, now, config), entry.seq)
        if best is None or key < best_key:
            best, best_key = entry, key
    return best
