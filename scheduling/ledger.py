"""What kvgate has sent where: the load ledger, and the TTFT model it teaches.

Load is accounted per request with a ``LoadTicket``::

    ticket = ledger.begin(worker_id, uncached_tokens, blocks, block_size, prompt_tokens)
    try:
        ...                   # send, wait for the first token
        ticket.first_token()  # the prompt's pending prefill is done (its TTFT measured)
        ticket.streamed(n)    # n more tokens of its answer: the blocks they fill are held
        ticket.complete(prompt_tokens, cached_tokens)  # answered: the engine's usage
    finally:
        ticket.finish()       # in flight and held blocks released (idempotent); a
                              # completed, measured request teaches the TTFT model

Per worker (``WorkerLedger``): requests in flight, prompt tokens pending prefill (and their
attention pairs), blocks held by requests in flight (shared prefixes once, streamed
answers' blocks included: the ``answer_blocks`` part), the requests sent lacking KV room and
not started, the decayed footprint of routed prompts, the recent cache reuse and the
prefill-busy share. Beside the engine's scraped load (the registry's raw facts) they make
the worker's ``WorkerLoad``. Whoever waits for a worker to free up (the queue) registers
with ``watch`` and is called when load is released (a first token, a request's end), a
scrape lands or a worker becomes healthy.

The ledger follows the registry: it hears of workers added and removed
(``WorkerListener``) and of each scrape (``ScrapeListener``). No I/O.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvgate.backends.engines import ScrapedLoad
from kvgate.backends.registry import Worker, WorkerRegistry
from kvgate.index.api import EngineWorker
from kvgate.index.keys import shared_prefix_blocks
from kvgate.index.types import NO_MATCH, BlockKey, PrefixMatch, WorkerId
from kvgate.scheduling.capacity import Limits, Parts, capacity_of, kv_overcommit
from kvgate.scheduling.ttft import (
    MAX_TOKENS,
    PRIOR_BASE_S,
    PRIOR_PREFILL_TOKENS_PER_S,
    PRIOR_WEIGHT,
    BusyShare,
    TtftCalibrator,
    TtftFeatures,
    TtftParams,
    attention_pairs,
    ttft_features,
)
from kvgate.scoring.api import Candidate, WorkerLoad

REUSE_REQUESTS = 32.0
"""Requests a worker's reuse (its recent cache hit share) averages over."""
FLIGHTS_COMPARED = 32
"""In-flight requests a new one is compared with for a shared prefix (the most recent): a
bound on the work per request however many are in flight."""
FOOTPRINT_HALF_LIFE_S = 60.0
"""Half-life of the routed prompt blocks counted in a worker's footprint."""
UTILISATION_HALF_LIFE_S = 30.0
"""Half-life of each worker's prefill-busy share (its utilisation)."""
_FOOTPRINT_REBASE_EXPONENT = 256.0
"""Footprints are rescaled once their common factor reaches 2**256 (floats reach 2**1023)."""
MAX_DECODE_BLOCKS = 1 << 20
"""The most blocks one request's streamed answer counts as holding where its worker reports
no KV capacity and none is configured (16M tokens at 16 a block: more than any engine's
cache)."""


@dataclass(slots=True)
class RankLoad:
    """What kvgate has in flight on one data-parallel rank of a worker (its own cache and
    its own scheduler): the rank's share of the worker's ``in_flight`` and pending prefill."""

    in_flight: int = 0
    pending_prefill_tokens: int = 0
    sent: int = 0  # requests sent there so far (spreads new prompts over idle ranks)


@dataclass(eq=False, slots=True)
class WorkerLedger:
    """What kvgate has sent to one worker and not seen end, and what that taught it."""

    worker: Worker  # the registry's: its identity and the engine's scraped load
    in_flight: int = 0
    pending_prefill_tokens: int = 0
    pending_prefill_pairs: float = 0.0  # attention pairs of that pending prefill
    pending_requests: int = 0  # sent and not started (no first token yet)
    # of those, the ones sent lacking KV room (LoadTicket.blocking), oldest first: when sent
    blocked: dict[LoadTicket, float] = field(default_factory=dict)
    # in-flight requests' blocks: their prompts' (shared prefixes counted once) and the
    # blocks their streamed answers have filled so far
    active_decode_blocks: int = 0
    # block keys of the in-flight requests (for the prefixes they share), by ticket
    flights: dict[LoadTicket, Sequence[BlockKey]] = field(default_factory=dict)
    footprint: float = 0.0  # see Ledger.record_footprint
    # per data-parallel rank kvgate sent to (ranks come from the worker's event endpoints)
    ranks: dict[int, RankLoad] = field(default_factory=dict)
    reuse: float = 0.0  # see Ledger.record_reuse
    prefill_busy: BusyShare | None = None  # share of time with a pending request
    # blocks of its requests kvgate saw end (a running count), that count when the scrape
    # in hand was asked for (what ended since, the scrape still counts as held), and that
    # count when the scrape in flight was asked for
    released_blocks: int = 0
    scrape_mark: int = 0
    asked_mark: int = 0
    # The last snapshots handed out, reused while nothing they hold has changed (immutable).
    _load: WorkerLoad | None = field(default=None, init=False, repr=False)
    _load_scraped: ScrapedLoad | None = field(default=None, init=False, repr=False)
    _candidate: Candidate | None = field(default=None, init=False, repr=False)

    @property
    def id(self) -> WorkerId:
        return self.worker.id

    @property
    def blocked_requests(self) -> int:
        """Requests sent here lacking KV room and not started yet."""
        return len(self.blocked)

    def unblock(self, sent_before: float) -> None:
        """The engine reported no request waiting in a scrape asked for at ``sent_before``:
        the blocked requests sent before then have started (a request read whole at its end,
        not streamed, shows no first token until then)."""
        while self.blocked:
            ticket, sent = next(iter(self.blocked.items()))
            if sent > sent_before:
                return
            del self.blocked[ticket]

    def blocked_s(self, now: float | None) -> float:
        """How long the oldest of ``blocked_requests`` has waited at ``now`` (0: none, or no
        ``now``), to the hundredth of a second."""
        if not self.blocked or now is None:
            return 0.0
        return round(max(now - next(iter(self.blocked.values())), 0.0), 2)

    def kv_usage_now(self) -> float | None:
        """The scraped KV usage less the blocks of kvgate's requests that ended here since
        the scrape was asked for (a scrape is up to ``metrics_interval_s`` old, and an
        agent's next turn follows the end of its last one at once: the stale figure would
        show its home full of the blocks that turn just released). The scrape as is without
        a capacity to weigh the blocks against; never below 0."""
        scraped = self.worker.scraped
        usage, capacity = scraped.kv_usage, scraped.kv_capacity_blocks
        released = self.released_blocks - self.scrape_mark
        if usage is None or not capacity or released <= 0:
            return usage
        return max(usage - released / capacity, 0.0)

    def load(self, now: float | None = None) -> WorkerLoad:
        """The worker's load (an immutable snapshot); its busy share at ``now`` (to the
        hundredth, so that snapshots are reused while nothing else changes)."""
        busy = self.prefill_busy
        share = 0.0 if busy is None or now is None else round(busy.at(now), 2)
        usage = self.kv_usage_now()
        scraped = self.worker.scraped
        last = self._load
        if (
            last is not None
            and self._load_scraped is scraped
            and last.scraped_kv_usage == usage
            and last.in_flight == self.in_flight
            and last.pending_prefill_tokens == self.pending_prefill_tokens
            and last.pending_prefill_pairs == self.pending_prefill_pairs
            and last.active_decode_blocks == self.active_decode_blocks
            and last.footprint == self.footprint
            and last.prefill_busy_share == share
        ):
            return last
        self._load_scraped = scraped
        self._load = WorkerLoad(
            in_flight=self.in_flight,
            pending_prefill_tokens=self.pending_prefill_tokens,
            pending_prefill_pairs=self.pending_prefill_pairs,
            active_decode_blocks=self.active_decode_blocks,
            scraped_running=scraped.running,
            scraped_waiting=scraped.waiting,
            scraped_kv_usage=usage,
            kv_capacity_blocks=scraped.kv_capacity_blocks,
            footprint=self.footprint,
            prefill_busy_share=share,
        )
        return self._load

    def candidate(
        self, match: PrefixMatch = NO_MATCH, now: float | None = None, keys: Sequence[BlockKey] = ()
    ) -> Candidate:
        """The worker as a routing candidate with its current load, ``match`` and the
        leading blocks of ``keys`` (the request's) that a request in flight here holds."""
        load = self.load(now)
        shared = self.shared_blocks(keys)
        worker = self.worker
        last = self._candidate
        if (
            last is not None
            and last.load is load
            and last.match is match
            and last.url is worker.url
            and last.in_flight_prefix == shared
        ):
            return last
        self._candidate = Candidate(worker.id, worker.url, load, match, shared)
        return self._candidate

    def shared_blocks(self, keys: Sequence[BlockKey]) -> int:
        """Leading blocks of ``keys`` that a request in flight here already holds (the most
        shared with any of the last ``FLIGHTS_COMPARED`` sent): a running request's blocks
        are referenced, not copied, by another that shares its prefix."""
        if not keys or not self.flights:
            return 0
        recent = itertools.islice(reversed(self.flights.values()), FLIGHTS_COMPARED)
        return max(shared_prefix_blocks(keys, other) for other in recent)

    def rank_load(self, dp_rank: int) -> RankLoad:
        """What kvgate has in flight on one of its data-parallel ranks."""
        return self.ranks.get(dp_rank) or RankLoad()

    def describe(self) -> dict[str, Any]:
        """The admin view of what kvgate has in flight there."""
        out = {name: getattr(self, name) for name in _DESCRIBED}
        if self.ranks:
            out["dp_ranks"] = {
                str(r): {"in_flight": x.in_flight, "pending_prefill": x.pending_prefill_tokens}
                for r, x in sorted(self.ranks.items())
            }
        return out


_DESCRIBED = (
    "in_flight",
    "pending_prefill_tokens",
    "pending_requests",
    "active_decode_blocks",
    "blocked_requests",
)


@dataclass(frozen=True, slots=True)
class TtftObservation:
    """One finished request's predicted and measured time to first token (seconds)."""

    worker: Worker
    predicted_s: float
    measured_s: float
    learned: bool  # False when the calibrator refused it (implausible, or no room)


class LoadTicket:
    """One request's share of a worker's load; every release is idempotent."""

    __slots__ = (
        "_answer_cap",
        "_block_size",
        "_blocks",
        "_completed",
        "_decoded",
        "_dp_rank",
        "_entry",
        "_features",
        "_finished",
        "_grown",
        "_ledger",
        "_pairs",
        "_predicted_s",
        "_prefill_done",
        "_prompt",
        "_prompt_tokens",
        "_reserved",
        "_sent_at",
        "_ttft_s",
    )

    def __init__(
        self,
        ledger: Ledger,
        entry: WorkerLedger,
        *,
        prompt_tokens: int,
        own_blocks: int,
        features: TtftFeatures,
        predicted_s: float,
        keys: Sequence[BlockKey] = (),
        reserved: bool = False,
        blocking: bool = False,
        prompt: int = 0,
        block_size: int = 16,
        answer_cap: int = 0,
        dp_rank: int | None = None,
    ) -> None:
        """``prompt_tokens``: its tokens to prefill, of ``prompt`` (the whole prompt, where
        its answer's first block starts: ``block_size`` tokens a block); ``answer_cap``: the
        most blocks its streamed answer counts as holding (0: none, ``answer_blocks`` off)."""
        self._entry = entry
        self._ledger = ledger
        self._reserved = reserved  # a queue's hold, handed over: its end releases nothing
        self._prompt_tokens = prompt_tokens
        # its own blocks: those past the prefix it shares with a request in flight there
        self._blocks = own_blocks
        self._prompt = max(prompt, 0)
        self._block_size = max(block_size, 1)
        self._answer_cap = answer_cap
        self._decoded = 0  # answer tokens streamed so far
        self._grown = 0  # the blocks they filled past the prompt's (in active_decode_blocks)
        if keys:
            entry.flights[self] = keys
        self._features = features
        self._pairs = features.own_pairs
        self._predicted_s = predicted_s
        self._sent_at = ledger.now()
        self._ttft_s: float | None = None
        self._completed = False
        self._prefill_done = False
        self._finished = False
        entry.in_flight += 1
        entry.pending_prefill_tokens += prompt_tokens
        entry.pending_prefill_pairs += features.own_pairs
        entry.active_decode_blocks += self._blocks
        entry.pending_requests += 1
        self._dp_rank = dp_rank  # the data-parallel rank it was sent to (None: not chosen)
        if dp_rank is not None:
            rank = entry.ranks.setdefault(dp_rank, RankLoad())
            rank.in_flight += 1
            rank.pending_prefill_tokens += prompt_tokens
            if not reserved:
                rank.sent += 1
        # sent lacking KV room: until it starts, the engine starts nothing sent after it
        if blocking:
            entry.blocked[self] = self._sent_at
        if entry.pending_requests == 1 and entry.prefill_busy is not None:
            entry.prefill_busy.set(self._sent_at, busy=True)

    @property
    def worker(self) -> Worker:
        return self._entry.worker

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def predicted_ttft_s(self) -> float:
        return self._predicted_s

    @property
    def blocking(self) -> bool:
        """Sent lacking KV room (kvgate's prediction then), and not known to have started."""
        return self in self._entry.blocked

    def first_token(self, *, measured: bool = True) -> None:
        """The first token came back: the prompt is no longer pending prefill.

        ``measured``: this is the moment the first token arrived (a stream's first chunk),
        so the time since dispatch is the request's TTFT; not for a whole body read at once.
        """
        if self._prefill_done:
            return
        self._prefill_done = True
        entry = self._entry
        entry.pending_prefill_tokens -= self._prompt_tokens
        entry.pending_requests -= 1
        rank = None if self._dp_rank is None else entry.ranks.get(self._dp_rank)
        if rank is not None:
            rank.pending_prefill_tokens -= self._prompt_tokens
        entry.blocked.pop(self, None)
        entry.pending_prefill_pairs = (
            max(entry.pending_prefill_pairs - self._pairs, 0.0) if entry.pending_requests else 0.0
        )
        now = self._ledger.now()
        if measured:
            self._ttft_s = now - self._sent_at
        if entry.pending_requests == 0 and entry.prefill_busy is not None:
            entry.prefill_busy.set(now, busy=False)
        if not self._finished:  # (finish tells the watchers once, itself)
            self._ledger.load_changed()

    def streamed(self, tokens: int) -> None:
        """``tokens`` more of its answer came back (a stream's events): the engine holds
        the blocks they fill, as long as the request runs. A long answer grows a block
        every ``block_size`` tokens, and two of them decoding for a minute hold hundreds
        more than their prompts did. Counted from the stream, at most ``answer_cap`` (the
        worker's capacity): a worker that streams without end makes only itself look full,
        and only until the request ends."""
        if self._finished or tokens <= 0 or self._answer_cap <= 0:
            return
        self._decoded += tokens
        size = self._block_size
        grown = -(-(self._prompt + self._decoded) // size) - -(-self._prompt // size)
        grown = min(grown, self._answer_cap)
        if grown > self._grown:
            self._entry.active_decode_blocks += grown - self._grown
            self._grown = grown

    def complete(self, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """The request was answered in full; the engine's usage, when it reported it, says
        what was really prefilled (the TTFT model learns from that, not the prediction)."""
        self._completed = True
        if prompt_tokens is not None and cached_tokens is not None:
            uncached = float(max(min(prompt_tokens - cached_tokens, MAX_TOKENS), 0))
            pairs = attention_pairs(uncached, float(min(max(prompt_tokens, 0), MAX_TOKENS)))
            self._features = replace(self._features, uncached_tokens=uncached, own_pairs=pairs)

    def finish(self) -> TtftObservation | None:
        """The request is over (done, failed or cancelled): release everything. Returns the
        TTFT observation when the request was answered and its first token timed."""
        if self._finished:
            return None
        self._finished = True
        self.first_token(measured=False)
        entry = self._entry
        entry.in_flight -= 1
        rank = None if self._dp_rank is None else entry.ranks.get(self._dp_rank)
        if rank is not None:
            rank.in_flight -= 1
        held = self._blocks + self._grown
        entry.active_decode_blocks -= held
        if not self._reserved:
            entry.released_blocks += held
        entry.flights.pop(self, None)
        self._ledger.load_changed()
        if not self._completed or self._ttft_s is None or entry.worker.removed:
            return None
        return self._ledger.observe_ttft(
            entry.worker, self._features, self._predicted_s, self._ttft_s
        )


class Ledger:
    """Every worker's ledger entry, by id, following the registry's workers."""

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        limits: Limits | None = None,
        parts_of: Callable[[WorkerId], Parts] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``limits``: the capacity rule's (its configured KV capacity); ``parts_of``: the
        parts in force on a worker (``answer_blocks``; all on when not given)."""
        self._registry = registry
        self._limits = limits or Limits()
        self._parts_of = parts_of or (lambda worker: Parts())
        self._clock = clock
        self._footprint_epoch = clock()
        self._entries: dict[WorkerId, WorkerLedger] = {}
        self._watchers: list[Callable[[], None]] = []
        self.calibrator = TtftCalibrator(
            TtftParams.prior(PRIOR_PREFILL_TOKENS_PER_S, PRIOR_BASE_S), prior_weight=PRIOR_WEIGHT
        )
        registry.subscribe(self)
        registry.watch_scrapes(self)
        registry.watch_load(self.load_changed)

    def now(self) -> float:
        return self._clock()

    # -- following the fleet ---------------------------------------------------------------
    def worker_added(self, view: EngineWorker) -> None:
        worker = self._registry.find(view.id)
        if worker is not None and view.id not in self._entries:
            busy = BusyShare(UTILISATION_HALF_LIFE_S, self._clock())
            self._entries[view.id] = WorkerLedger(worker, prefill_busy=busy)

    def worker_removed(self, worker: WorkerId) -> None:
        self._entries.pop(worker, None)
        self.calibrator.forget(worker)

    def worker_health_changed(self, view: EngineWorker) -> None:
        """(Health is the registry's; a worker becoming healthy wakes the watchers there.)"""

    def scrape_begins(self, worker: WorkerId) -> None:
        entry = self._entries.get(worker)
        if entry is not None:  # requests that end from now on are not in this scrape
            entry.asked_mark = entry.released_blocks

    def scraped(self, worker: WorkerId, load: ScrapedLoad, asked_at: float) -> None:
        entry = self._entries.get(worker)
        if entry is None:
            return
        entry.scrape_mark = entry.asked_mark
        if load.waiting == 0:
            entry.unblock(asked_at)

    # -- watchers ------------------------------------------------------------------------
    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (synchronously, cheap) whenever a worker may have freed up."""
        self._watchers.append(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        if callback in self._watchers:
            self._watchers.remove(callback)

    def load_changed(self) -> None:
        """Load was released or re-measured somewhere: tell the watchers."""
        for callback in self._watchers:
            callback()

    # -- views ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[WorkerLedger]:
        return iter(list(self._entries.values()))

    def entry(self, worker: WorkerId) -> WorkerLedger | None:
        return self._entries.get(worker)

    def of(self, worker: Worker) -> WorkerLedger:
        """``worker``'s entry (a worker the registry holds has one)."""
        entry = self._entries.get(worker.id)
        if entry is None:  # added before the ledger subscribed, or raced: start one now
            busy = BusyShare(UTILISATION_HALF_LIFE_S, self._clock())
            entry = self._entries[worker.id] = WorkerLedger(worker, prefill_busy=busy)
        return entry

    def describe(self, worker: WorkerId) -> dict[str, Any]:
        """The admin view of what kvgate has in flight on ``worker`` (zeros: none known)."""
        entry = self._entries.get(worker)
        if entry is None:
            return dict.fromkeys(_DESCRIBED, 0)
        return entry.describe()

    def candidates(
        self,
        workers: Sequence[Worker],
        matches: Mapping[WorkerId, PrefixMatch] | None = None,
        keys: Sequence[BlockKey] = (),
    ) -> list[Candidate]:
        """``workers`` as routing candidates, each with its entry of ``matches`` (the
        index's prefix matches; none given: ``NO_MATCH``) and the leading blocks of ``keys``
        (the request's block keys) a request in flight there holds."""
        now = self._clock()
        matches = matches or {}
        of = self.of
        return [of(w).candidate(matches.get(w.id, NO_MATCH), now, keys) for w in workers]

    def parts(self, worker: WorkerId) -> Parts:
        """The capacity rule's parts in force on ``worker`` (the guard may turn some off)."""
        return self._parts_of(worker)

    def capacity(self, entry: WorkerLedger) -> int | None:
        """The worker's KV capacity in blocks: its engine's, else the configured one."""
        return capacity_of(entry.load(), self._limits)

    def answer_cap(self, entry: WorkerLedger) -> int:
        """The most blocks one streamed answer counts as holding there: its KV capacity
        (``MAX_DECODE_BLOCKS`` when unknown); 0 with the worker's ``answer_blocks`` off."""
        if not self._parts_of(entry.id).answer_blocks:
            return 0
        capacity = entry.worker.scraped.kv_capacity_blocks or self._limits.kv_capacity_blocks
        return capacity or MAX_DECODE_BLOCKS

    # -- tickets -------------------------------------------------------------------------
    def begin(
        self,
        worker_id: WorkerId,
        prefill_tokens: int,
        blocks: int,
        block_size: int = 16,
        prompt_tokens: int | None = None,
        *,
        keys: Sequence[BlockKey] = (),
        dp_rank: int | None = None,
    ) -> LoadTicket:
        """Count a request sent (to data-parallel rank ``dp_rank``, if chosen):
        ``prefill_tokens`` (its uncached prompt tokens, of ``prompt_tokens``) are pending
        prefill until its first token; ``blocks`` (of ``block_size`` tokens) are held until it
        ends, less the leading ones its block ``keys`` share with a request in flight there.
        Its TTFT is predicted from the load it finds."""
        entry = self.of(self._registry.get(worker_id))
        self.record_footprint(entry, blocks)
        prompt = prompt_tokens if prompt_tokens is not None else prefill_tokens
        self.record_reuse(entry, prefill_tokens, prompt)
        return self._ticket(
            entry, prefill_tokens, blocks, block_size, prompt, keys=keys, dp_rank=dp_rank
        )

    def reserve(
        self,
        worker_id: WorkerId,
        prefill_tokens: int,
        blocks: int,
        block_size: int = 16,
        prompt_tokens: int | None = None,
        *,
        keys: Sequence[BlockKey] = (),
        dp_rank: int | None = None,
    ) -> LoadTicket:
        """Count the load of a request about to be sent (the queue's hold on the worker it
        dispatched to) as ``begin`` does, without its footprint and reuse: ``begin`` records
        those when the request is sent. Never completed: it teaches nothing."""
        prompt = prompt_tokens if prompt_tokens is not None else prefill_tokens
        entry = self.of(self._registry.get(worker_id))
        return self._ticket(
            entry,
            prefill_tokens,
            blocks,
            block_size,
            prompt,
            keys=keys,
            reserved=True,
            dp_rank=dp_rank,
        )

    def _ticket(
        self,
        entry: WorkerLedger,
        prefill_tokens: int,
        blocks: int,
        block_size: int,
        prompt: int,
        *,
        keys: Sequence[BlockKey],
        reserved: bool = False,
        dp_rank: int | None = None,
    ) -> LoadTicket:
        load = entry.load(self._clock())
        capacity = capacity_of(load, self._limits)
        features = ttft_features(load, prefill_tokens, prompt, block_size, capacity)
        predicted = self.calibrator.params(entry.id).predict(features).total_s
        own = max(blocks - entry.shared_blocks(keys), 0)  # past a prefix one in flight holds
        return LoadTicket(
            self,
            entry,
            prompt_tokens=prefill_tokens,
            own_blocks=own,
            features=features,
            predicted_s=predicted,
            keys=keys,
            reserved=reserved,
            blocking=kv_overcommit(load, own, capacity) > 0.0,
            prompt=prompt,
            block_size=block_size,
            answer_cap=self.answer_cap(entry),
            dp_rank=dp_rank,
        )

    def observe_ttft(
        self, worker: Worker, features: TtftFeatures, predicted_s: float, measured_s: float
    ) -> TtftObservation:
        """A finished request's measured TTFT: the worker's model learns from it."""
        learned = self.calibrator.observe(worker.id, features, measured_s)
        self.calibrator.record_error(worker.id, predicted_s, measured_s)
        return TtftObservation(worker, predicted_s, measured_s, learned)

    @staticmethod
    def record_reuse(entry: WorkerLedger, prefill_tokens: int, prompt_tokens: int) -> None:
        """Fold one routed request's predicted hit (its cached share) into the worker's
        reuse, an exponentially weighted mean over about ``REUSE_REQUESTS`` requests."""
        if prompt_tokens <= 0:
            return
        hit = min(max(1.0 - prefill_tokens / prompt_tokens, 0.0), 1.0)
        entry.reuse += (hit - entry.reuse) / REUSE_REQUESTS

    def record_footprint(self, entry: WorkerLedger, blocks: int) -> None:
        """Add a routed prompt's ``blocks`` to the worker's decayed footprint.

        Instead of decaying every worker's value all the time, each addition is scaled up by
        ``2 ** (age of the epoch / half-life)``: every worker's value is then the decayed sum
        times one common factor, so ratios between workers are exact without any clock at
        read time. The epoch moves (all values scaled down) before the factor gets large."""
        exponent = (self._clock() - self._footprint_epoch) / FOOTPRINT_HALF_LIFE_S
        if exponent > _FOOTPRINT_REBASE_EXPONENT:
            scale = 2.0**-exponent
            for each in self._entries.values():
                each.footprint *= scale
            self._footprint_epoch += exponent * FOOTPRINT_HALF_LIFE_S
            exponent = 0.0
        entry.footprint += blocks * 2.0**exponent
