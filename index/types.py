"""Identity and key types shared by the index, scoring and the gateway.

Two hash spaces exist (see docs/block-keys.md):

* ``BlockKey``: kvgate's own chained xxh3_64 key of one full block of prompt tokens.
  kvgate computes it for requests *and* for the ``token_ids`` carried by engine events,
  so both sides meet in one space.
* ``EngineBlockHash``: the engine's opaque block hash as it appears in KV events. kvgate
  never tries to reproduce it; it only remembers, per worker, which ``BlockKey`` each
  engine hash stood for, so that ``BlockRemoved`` events can be applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import NewType

BlockKey = NewType("BlockKey", int)
"""kvgate's chained key of one full block (unsigned 64-bit)."""

EngineBlockHash = NewType("EngineBlockHash", int)
"""The engine's own block hash from a KV event (unsigned 64-bit; byte hashes are folded)."""

WorkerId = NewType("WorkerId", str)
"""A worker (one engine HTTP endpoint) as configured: its normalised base URL."""


class Tier(IntEnum):
    """Where a cached block lives; lower is faster."""

    GPU = 0
    CPU = 1
    DISK = 2


@dataclass(frozen=True, slots=True)
class WorkerKey:
    """One cache domain: a worker and its data-parallel rank (each rank has its own cache)."""

    worker: WorkerId
    dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a request's block-key prefix one worker holds, by tier.

    ``gpu`` counts the leading blocks resident on GPU; ``cpu`` the blocks after those
    that are (at best) on CPU; ``disk`` the blocks after those that are on disk only.
    The three runs are contiguous and together form the matched prefix.
    """

    gpu: int = 0
    cpu: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.gpu + self.cpu + self.disk


NO_MATCH = PrefixMatch()


@dataclass(frozen=True, slots=True)
class SlotStats:
    """Entries of one cache domain (a block counts once per tier it is held in)."""

    worker: WorkerKey
    entries: int
    by_tier: Mapping[Tier, int]
    orphans: int
