"""The oracle: a trace's prefix reuse with one infinite cache (an upper bound on hit rate).

Computed offline from the hash ids. Each block is keyed by its whole prefix (a chain of the
ids before it); a block hits when the same chain was seen before, and the hit stops at the
first block that was never seen (or was seen only partially, shorter than now).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.backends.sim.config import SimConfig, StartupFaults, TimingConfig
from kvgate.backends.sim.timing import StepWork, prefill_pairs, step_seconds
from kvgate.bench.traces import TRACE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True, slots=True)
class OracleResult:
    requests: int
    prompt_tokens: int
    hit_tokens: int
    blocks: int
    hit_blocks: int
    per_request: tuple[tuple[int, int], ...] = ()
    """(prompt tokens, hit tokens) of each request, in arrival order."""

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0


def _block_lengths(r: TraceRequest, block_tokens: int) -> list[int]:
    n = len(r.hash_ids)
    if n == 0:
        return []
    last = r.input_length - block_tokens * (n - 1)
    return [block_tokens] * (n - 1) + [max(0, min(block_tokens, last))]


def oracle(
    requests: Sequence[TraceRequest],
    *,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    engine_block_size: int = 1,
) -> OracleResult:
    """Prefix reuse of ``requests`` in arrival order with one infinite cache.

    ``engine_block_size`` > 1 floors each request's hit to whole engine blocks and keeps at
    least one prompt token to compute, as vLLM does (a slightly lower, engine-realistic bound).
    ``block_tokens`` is the number of tokens per hash id (512 unless prompts were scaled).
    """
    return _prefix_reuse(requests, block_tokens, None, engine_block_size)


def pooled_lru(
    requests: Sequence[TraceRequest],
    capacity_tokens: int,
    *,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> OracleResult:
    """Prefix reuse with one LRU cache of ``capacity_tokens`` (a fleet's total capacity).

    A reference, not a bound: a fleet of N caches of C tokens holds at most N x C, and one
    pooled LRU of that size is what perfect routing with LRU eviction could keep at best
    without duplicating shared prefixes. Blocks are whole trace blocks, evicted least
    recently used first; a request's blocks are touched in order, so its tail is the most
    recent.
    """
    return _prefix_reuse(requests, block_tokens, capacity_tokens, 1)


def _prefix_reuse(
    requests: Sequence[TraceRequest],
    block_tokens: int,
    capacity_tokens: int | None,
    engine_block_size: int,
) -> OracleResult:
    """One cache replayed in arrival order: infinite (``capacity_tokens`` None) or LRU.

    Each block is keyed by its whole prefix (a chain of the ids before it); a block hits when
    the same chain was seen before, and the hit stops at the first block that was never seen
    (or was seen only partially, shorter than now).
    """
    cache: OrderedDict[int, int] = OrderedDict()  # chained prefix key -> tokens held
    held = 0
    prompt = hit = blocks = hit_blocks = 0
    per_request: list[tuple[int, int]] = []
    for r in sorted(requests, key=lambda q: (q.arrival_s, q.index)):
        lengths = _block_lengths(r, block_tokens)
        key = 0
        matching = True
        req_hit = 0
        for hid, length in zip(r.hash_ids, lengths, strict=True):
            key = hash((key, hid))
            before = cache.get(key, 0)
            if matching and before > 0:
                req_hit += min(length, before)
                hit_blocks += 1
                matching = before >= length
            else:
                matching = False
            if length > before:
                held += length - before
                cache[key] = length
            if capacity_tokens is not None:
                cache.move_to_end(key)
        while capacity_tokens is not None and held > capacity_tokens and cache:
            held -= cache.popitem(last=False)[1]
        blocks += len(lengths)
        total = sum(lengths)
        if engine_block_size > 1:
            req_hit = min(req_hit, max(0, total - 1))
            req_hit -= req_hit % engine_block_size
        prompt += total
        hit += req_hit
        per_request.append((total, req_hit))
    return OracleResult(len(requests), prompt, hit, blocks, hit_blocks, tuple(per_request))


def idle_prefill_seconds(
    prompt_tokens: int,
    cached_tokens: int,
    timing: TimingConfig,
    max_batched_tokens: int,
    faults: StartupFaults | None = None,
) -> float:
    """Time to first token of a request alone on an idle simulated replica.

    Its uncached tokens (at least one, as in vLLM) are prefilled in chunks of
    ``max_batched_tokens``, each step timed by the simulator's own model (with the fleet's
    start-up ``slowdown`` and ``prefill_slowdown``); the first token comes with the step that
    completes the prompt. Alone, a serial-prefill replica is a chunked one.
    """
    faults = faults or StartupFaults()
    done = min(cached_tokens, max(0, prompt_tokens - 1))
    seconds = 0.0
    while done < prompt_tokens:
        n = min(max_batched_tokens, prompt_tokens - done)
        work = StepWork(tokens=n, prefill_tokens=n, prefill_pairs=prefill_pairs(done, n))
        seconds += step_seconds(work, timing, faults.slowdown, faults.prefill_slowdown)
        done += n
    return seconds


def ttft_floor(result: OracleResult, sim: SimConfig) -> list[float]:
    """Per request, the lowest TTFT any router could give it on the simulated fleet ``sim``:
    the oracle's cache (one infinite cache, whole blocks) and an idle replica (no queueing,
    no batching with other requests)."""
    block = sim.engine.block_size
    batched = sim.engine.max_num_batched_tokens
    return [
        idle_prefill_seconds(prompt, hit - hit % block, sim.timing, batched, sim.faults)
        for prompt, hit in result.per_request
    ]
