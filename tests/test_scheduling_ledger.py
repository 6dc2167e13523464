"""The scheduler's ledger: the blocks kvgate's requests in flight hold (shared prefixes once,
streamed answers' blocks), the requests sent lacking KV room, and how long they wait."""

from __future__ import annotations

from dataclasses import replace

from kvgate.backends.config import WorkerConfig
from kvgate.backends.registry import WorkerRegistry
from kvgate.index.keys import shared_prefix_blocks
from kvgate.index.types import BlockKey, WorkerId
from kvgate.scheduling.capacity import KV_FIT, Limits, Parts, kv_overcommit
from kvgate.scheduling.ledger import FLIGHTS_COMPARED, Ledger

BS = 16


# ---- held blocks: in-flight requests that share a prefix hold it once ----


def _keys(prefix: int, own: int, tag: int) -> list[BlockKey]:
    """Chained-like keys: ``prefix`` blocks every caller shares, then ``own`` of its own."""
    return [BlockKey(i) for i in range(prefix)] + [BlockKey(10**6 * tag + i) for i in range(own)]


def test_shared_prefix_blocks_bisects_chained_keys() -> None:
    a, b = _keys(1_200, 240, 1), _keys(1_200, 1_700, 2)
    assert shared_prefix_blocks(a, b) == 1_200
    assert shared_prefix_blocks(a, a) == len(a)
    assert shared_prefix_blocks(a, a[:500]) == 500
    assert shared_prefix_blocks(a, []) == 0
    assert shared_prefix_blocks(_keys(0, 5, 1), _keys(0, 5, 2)) == 0


def _ledger(
    limits: Limits | None = None, parts: Parts | None = None, clock: list[float] | None = None
) -> tuple[WorkerRegistry, Ledger, WorkerId]:
    now = clock if clock is not None else [0.0]
    reg = WorkerRegistry(clock=lambda: now[0])
    worker = reg.add(WorkerConfig(url="http://w", models=["m"]))
    chosen = parts or KV_FIT  # answers' blocks on (off by default)
    sent = Ledger(reg, limits=limits, parts_of=lambda w: chosen, clock=lambda: now[0])
    return reg, sent, worker.id


def test_siblings_in_flight_hold_their_shared_prefix_once() -> None:
    _, reg, wid = _ledger()
    worker = reg.entry(wid)
    assert worker is not None
    parent = reg.begin(wid, 2_900 * BS, 2_900, BS, keys=_keys(1_200, 1_700, 1))
    child = reg.begin(wid, 240 * BS, 1_440, BS, keys=_keys(1_200, 240, 2))
    assert worker.active_decode_blocks == 2_900 + 240
    unrelated = reg.begin(wid, 100 * BS, 100, BS, keys=_keys(0, 100, 3))
    assert worker.active_decode_blocks == 2_900 + 240 + 100
    parent.finish()
    child.finish()
    unrelated.finish()
    assert worker.active_decode_blocks == 0 and not worker.flights


def test_a_request_without_keys_counts_all_its_blocks() -> None:
    _, reg, wid = _ledger()
    worker = reg.entry(wid)
    assert worker is not None
    first = reg.begin(wid, 0, 500, BS, keys=_keys(500, 0, 1))
    second = reg.begin(wid, 0, 500, BS)  # keyed approximately or not at all: no sharing known
    assert worker.active_decode_blocks == 1_000
    first.finish()
    second.finish()
    assert worker.active_decode_blocks == 0


def test_candidates_carry_the_prefix_a_request_in_flight_holds() -> None:
    fleet, reg, wid = _ledger()
    fleet.get(wid).healthy = True  # as after its first health probe
    sibling = reg.begin(wid, 0, 1_700, BS, keys=_keys(1_200, 500, 1))
    (candidate,) = reg.candidates(fleet.serving("m"), keys=_keys(1_200, 240, 2))
    assert candidate.in_flight_prefix == 1_200
    (unrelated,) = reg.candidates(fleet.serving("m"), keys=_keys(0, 240, 3))
    assert unrelated.in_flight_prefix == 0
    sibling.finish()
    (alone,) = reg.candidates(fleet.serving("m"), keys=_keys(1_200, 240, 2))
    assert alone.in_flight_prefix == 0


def test_only_the_most_recent_flights_are_compared() -> None:
    _, reg, wid = _ledger()
    worker = reg.entry(wid)
    assert worker is not None
    shared = reg.begin(wid, 0, 300, BS, keys=_keys(300, 0, 1))
    others = [reg.begin(wid, 0, 1, BS, keys=_keys(0, 1, 10 + i)) for i in range(FLIGHTS_COMPARED)]
    late = reg.begin(wid, 0, 300, BS, keys=_keys(300, 0, 2))  # its sibling is too far back
    assert worker.active_decode_blocks == 300 + FLIGHTS_COMPARED + 300
    for ticket in [shared, *others, late]:
        ticket.finish()
    assert worker.active_decode_blocks == 0 and not worker.flights


# ---- answers: the blocks a streamed answer fills count as held ----


def test_a_streamed_answer_holds_a_block_more_every_block_size_tokens() -> None:
    """A prompt of 100 tokens ends 4 tokens into its seventh block: its answer's first 12
    tokens fill that block, the next 16 a new one. All of it is released at the end."""
    _, reg, wid = _ledger()
    worker = reg.entry(wid)
    assert worker is not None
    ticket = reg.begin(wid, 100, 7, BS, prompt_tokens=100, keys=_keys(0, 7, 1))
    assert worker.active_decode_blocks == 7
    ticket.first_token()
    ticket.streamed(12)
    assert worker.active_decode_blocks == 7
    ticket.streamed(1)
    assert worker.active_decode_blocks == 8
    ticket.streamed(16 * 10)
    assert worker.active_decode_blocks == 18
    assert worker.load().active_decode_blocks == 18
    ticket.finish()
    assert worker.active_decode_blocks == 0
    assert worker.released_blocks == 18  # the scrape counted them: what it still holds less
    ticket.streamed(1_000)  # a late event changes nothing
    assert worker.active_decode_blocks == 0


def test_an_answer_that_never_ends_counts_at_most_the_worker_capacity() -> None:
    fleet, reg, wid = _ledger()
    worker = reg.entry(wid)
    assert worker is not None
    fleet.get(wid).scraped = replace(fleet.get(wid).scraped, kv_capacity_blocks=1_000)
    ticket = reg.begin(wid, 16, 1, BS, prompt_tokens=16)
    for _ in range(100):
        ticket.streamed(10**9)  # a worker streaming without end, or lying in its events
    assert worker.active_decode_blocks == 1 + 1_000
    ticket.finish()
    assert worker.active_decode_blocks == 0


def test_where_none_is_scraped_the_configured_capacity_caps_an_answer() -> None:
    _, reg, wid = _ledger(Limits(kv_capacity_blocks=500))
    (worker,) = list(reg)
    assert worker.worker.scraped.kv_capacity_blocks is None
    ticket = reg.begin(wid, 16, 1, BS, prompt_tokens=16)
    ticket.streamed(10**9)
    assert worker.active_decode_blocks == 1 + 500
    ticket.finish()
    assert worker.active_decode_blocks == 0


def test_the_answer_blocks_part_off_counts_the_prompts_only() -> None:
    _, reg, wid = _ledger(parts=replace(KV_FIT, answer_blocks=False))
    (worker,) = list(reg)
    ticket = reg.begin(wid, 16, 1, BS, prompt_tokens=16)
    ticket.streamed(1_000)
    assert worker.active_decode_blocks == 1
    ticket.finish()
    assert worker.active_decode_blocks == 0


def test_a_long_answer_takes_the_room_a_prompt_needed() -> None:
    """The case measured on the faithful simulator: two long answers decoding where, by
    their prompts, a 500-block prompt fits; by what they hold now, it does not."""
    _, reg, wid = _ledger(Limits(kv_capacity_blocks=1_000))
    (worker,) = list(reg)
    running = [reg.begin(wid, 240 * BS, 240, BS, keys=_keys(0, 240, i)) for i in (1, 2)]
    assert kv_overcommit(worker.load(), 500, 1_000) == -20  # fits, 20 blocks to spare
    for ticket in running:
        ticket.first_token()
        ticket.streamed(20 * BS)  # 20 blocks of answer each
    assert kv_overcommit(worker.load(), 500, 1_000) == 20
    assert reg.begin(wid, 0, 500, BS, keys=_keys(0, 500, 3)).blocking


# ---- blocked: a worker whose engine queue holds a request sent lacking room ----


def test_a_request_sent_lacking_room_blocks_its_worker_until_it_starts() -> None:
    """The registry marks a request sent where its blocks do not fit beside the held ones
    (kvgate's prediction then); the worker's load says so until its first token, or its end
    without one. A request that fits marks nothing."""
    _, reg, wid = _ledger(Limits(kv_capacity_blocks=1_000))
    (worker,) = list(reg)
    running = reg.begin(wid, 600 * BS, 600, BS, keys=_keys(0, 600, 1))
    assert not running.blocking and worker.blocked_requests == 0
    big = reg.begin(wid, 500 * BS, 500, BS, keys=_keys(0, 500, 2))  # 600 + 500 > 1,000
    assert big.blocking and worker.blocked_requests == 1
    small = reg.begin(wid, 10 * BS, 10, BS, keys=_keys(0, 10, 3))  # behind it: lacks too
    assert small.blocking and worker.blocked_requests == 2
    small.finish()  # cancelled before it started
    assert worker.blocked_requests == 1
    running.finish()
    big.first_token()  # room released: it started
    assert not big.blocking and worker.blocked_requests == 0
    big.finish()
    assert worker.blocked_requests == 0
    reused = reg.begin(wid, 0, 900, BS, keys=_keys(0, 900, 4))
    assert not reused.blocking  # 900 fit in 1,000
    reused.finish()


# ---- blocked wait: how long a worker's blocked head has waited so far ----


def test_the_oldest_blocked_request_sets_the_blocked_time() -> None:
    clock = [100.0]
    _, reg, wid = _ledger(Limits(kv_capacity_blocks=1_000), clock=clock)
    (worker,) = list(reg)
    running = reg.begin(wid, 600 * BS, 600, BS, keys=_keys(0, 600, 1))
    clock[0] = 101.0
    first = reg.begin(wid, 500 * BS, 500, BS, keys=_keys(0, 500, 2))  # lacks room
    clock[0] = 102.5
    second = reg.begin(wid, 10 * BS, 10, BS, keys=_keys(0, 10, 3))  # behind it
    clock[0] = 104.0
    assert worker.blocked_s(clock[0]) == 3.0 and worker.blocked_requests == 2
    worker.unblock(sent_before=102.0)  # a scrape asked at 102 s saw nothing waiting
    assert not first.blocking and second.blocking
    assert worker.blocked_s(clock[0]) == 1.5  # the next oldest
    first.first_token()
    second.finish()
    assert worker.blocked_s(clock[0]) == 0.0 and worker.blocked_requests == 0
    for ticket in (running, first):
        ticket.finish()
