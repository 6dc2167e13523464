"""The data-parallel rank of a request on a worker that has several.

A data-parallel engine (vLLM ``--data-parallel-size``, SGLang ``--dp-size``) is one HTTP
server over several ranks, each with its own KV cache and scheduler; it publishes each rank's
KV events on its own endpoint and accepts a target rank per request (the
``X-data-parallel-rank`` header). kvgate prices the worker as a whole (its load, capacity and
health are the server's) on the prefix of the rank it would send to, and picks that rank
here: the one with the least prefill work ahead of the request, counting the prompt blocks
the rank does not hold and the prompt tokens kvgate sent there that are not prefilled yet
(the rank's own entry in the ledger); ties go to the rank with fewer requests in flight, then
to the one whose engine reports fewer requests running or waiting (vLLM's per-rank series,
traffic kvgate did not send included), then to the one kvgate sent fewer requests to (new
conversations spread over idle ranks), then to the lower rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace

from kvgate.index.types import NO_MATCH, PrefixMatch
from kvgate.scheduling.ledger import RankLoad
from kvgate.scoring.api import Candidate


def rank_cost(
    match: PrefixMatch,
    load: RankLoad,
    request_blocks: int,
    block_size: int,
    scraped_queue: int | None = None,
) -> tuple[int, int, int, int]:
    """Blocks of prefill ahead of the request on the rank, then its requests in flight
    (kvgate's), then those the engine reports there (0: not reported), then those sent."""
    pending = math.ceil(max(load.pending_prefill_tokens, 0) / max(block_size, 1))
    ahead = max(request_blocks - match.blocks, 0) + pending
    return ahead, load.in_flight, scraped_queue or 0, load.sent


def choose_rank(
    candidate: Candidate,
    ranks: Mapping[int, PrefixMatch],
    loads: Mapping[int, RankLoad],
    request_blocks: int,
    block_size: int,
    *,
    scraped: Callable[[int], int | None] = lambda rank: None,
) -> Candidate:
    """``candidate`` sent to its cheapest rank: its match becomes that rank's (``scraped``:
    the engine's running + waiting requests on a rank, None where not reported). A candidate
    with no match of its own (none, or filtered out: another cache domain) is credited none on
    any rank, and its rank is chosen on load alone."""
    credited = candidate.match.blocks > 0
    best: tuple[tuple[int, int, int, int], int] | None = None
    for rank in sorted(ranks):
        match = ranks[rank] if credited else NO_MATCH
        load = loads.get(rank) or RankLoad()
        cost = rank_cost(match, load, request_blocks, block_size, scraped(rank))
        if best is None or (cost, rank) < best:
            best = (cost, rank)
    if best is None:
        return candidate
    rank = best[1]
    match = ranks[rank] if credited else NO_MATCH
    return replace(candidate, match=match, dp_rank=rank)
