"""The oracle: a trace's prefix reuse with one infinite cache (an upper bound on hit rate).

Computed offline from the hash ids. Each block is keyed by its whole prefix (a chain of the
ids before it); a block hits when the same chain was seen before, and the hit stops at the
first block that was never seen (or was seen only partially, shorter than now).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.traces import TRACE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True, slots=True)
class OracleResult:
    requests: int
    prompt_tokens: int
    hit_tokens: int
    blocks: int
    hit_blocks: int

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
    seen: dict[int, int] = {}  # chained prefix key -> most tokens of that block seen
    prompt = hit = blocks = hit_blocks = 0
    for r in sorted(requests, key=lambda q: (q.arrival_s, q.index)):
        lengths = _block_lengths(r, block_tokens)
        key = 0
        matching = True
        req_hit = 0
        for hid, length in zip(r.hash_ids, lengths, strict=True):
            key = hash((key, hid))
            before = seen.get(key, 0)
            if matching and before > 0:
                req_hit += min(length, before)
                hit_blocks += 1
                matching = before >= length
            else:
                matching = False
            if length > before:
                seen[key] = length
        blocks += len(lengths)
        total = sum(lengths)
        if engine_block_size > 1:
            req_hit = min(req_hit, max(0, total - 1))
            req_hit -= req_hit % engine_block_size
        prompt += total
        hit += req_hit
    return OracleResult(len(requests), prompt, hit, blocks, hit_blocks)
