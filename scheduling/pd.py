"""Prefill/decode disaggregation: whether a request's prefill leg pays for itself. Pure.

A disaggregated request is decided twice by the one router (``Router.for_leg``): its decode
leg among the decode workers (``decode`` and ``both``), its prefill leg among the prefill
workers, each ranked by the ordinary cost and checked by the capacity rule. ``plan_legs``
then compares, for the chosen decode worker, the two ways to get the prompt's KV there, in
the cost model's own units (blocks of prefill, ``scoring.cost.Price``):

* local: ``overlap_credit x prefill_blocks x (1 + in_flight) + queued_prefill_weight x
  queued``: the decode worker prefills what it lacks, and every request decoding there
  stalls while it does (``in_flight``: kvgate's requests on it, the request's own not yet);
* remote: the prefill worker's ``overlap_credit x prefill_blocks + queued_prefill_weight x
  queued`` plus ``TRANSFER_BLOCK_COST`` for each block the decode worker lacks (sent over).

The prefill leg is skipped when local is no dearer. So an idle decode worker, or one that
holds most of the prompt, prefills it itself, and a busy one receives it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvgate.backends.registry import Worker
from kvgate.index.types import WorkerId
from kvgate.scheduling.routing import Routed
from kvgate.scoring.config import KvPolicyConfig
from kvgate.scoring.cost import Price, overlap_tokens

TRANSFER_BLOCK_COST = 0.25
"""Cost of moving one KV block from a prefill worker to a decode worker, in blocks of
prefill: a transfer reads and writes memory a block at a time where a prefill computes
every layer's attention for it (a quarter is conservative for loopback and RDMA links)."""


def disaggregated(workers: Iterable[Worker]) -> bool:
    """Is the fleet of ``workers`` (those ready for a model) disaggregated: at least one
    prefill worker and one decode worker?"""
    roles = {w.config.role for w in workers}
    return "prefill" in roles and "decode" in roles


@dataclass(frozen=True, slots=True)
class LegPlan:
    """How one disaggregated request reaches its decode worker."""

    decode: WorkerId
    prefill: WorkerId | None  # None: the prefill leg is skipped
    local_cost: float
    remote_cost: float | None  # None: no prefill worker could take it
    transfer_blocks: int  # blocks the decode worker lacks (sent over unless skipped)
    decode_cached_tokens: int  # tokens the decode worker should report cached
    prefill_cached_tokens: int  # tokens the prefill worker should report cached
    reason: str

    @property
    def skipped(self) -> bool:
        return self.prefill is None

    def describe(self) -> dict[str, Any]:
        """The ``/debug/route`` view of the plan."""
        return {
            "decode_worker": self.decode,
            "prefill_worker": self.prefill,
            "skipped": self.skipped,
            "local_cost": self.local_cost,
            "remote_cost": self.remote_cost,
            "transfer_blocks": self.transfer_blocks,
            "transfer_block_cost": TRANSFER_BLOCK_COST,
            "predicted_decode_cached_tokens": self.decode_cached_tokens,
            "predicted_prefill_cached_tokens": self.prefill_cached_tokens,
            "reason": self.reason,
        }


def plan_legs(
    decode: Routed, worker: WorkerId, prefill: Routed | None, config: KvPolicyConfig
) -> LegPlan:
    """The plan for ``decode``'s request on decode worker ``worker`` (one of its
    candidates), with ``prefill`` the prefill leg's ranking (None: no prefill worker ready)."""
    size = decode.size
    here = Price(size, decode.candidates[worker], config)
    local = config.overlap_credit * here.prefill * (1 + here.in_flight)
    local += config.queued_prefill_weight * here.queued
    own_cached = decode.predicted_cached_tokens(worker)
    lacking = max(size.full_blocks - here.match.blocks, 0)
    if prefill is None:
        return LegPlan(worker, None, local, None, 0, own_cached, 0, "no prefill worker ready")
    chosen = prefill.chosen
    there = Price(prefill.size, prefill.candidates[chosen], config)
    remote = config.overlap_credit * there.prefill + config.queued_prefill_weight * there.queued
    remote += TRANSFER_BLOCK_COST * lacking
    if local <= remote:
        why = f"local prefill {local:g} <= prefill worker {remote:g} (transfer included)"
        return LegPlan(worker, None, local, remote, 0, own_cached, 0, why)
    why = f"local prefill {local:g} > prefill worker {remote:g} (transfer included)"
    transferred = overlap_tokens(size.full_blocks, size)
    return LegPlan(
        worker,
        chosen,
        local,
        remote,
        lacking,
        max(transferred, own_cached),
        prefill.predicted_cached_tokens(chosen),
        why,
    )
