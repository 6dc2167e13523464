"""Prefill/decode disaggregation: whether a request's prefill leg pays for itself. Pure.

A disaggregated request is decided twice by the one router (``Router.for_leg``): its decode
leg among the decode workers (``decode`` and ``both``), its prefill leg among the prefill
workers, each ranked by the ordinary cost and checked by the capacity rule. ``plan_legs``
then compares, for the chosen decode worker, the two ways to get the prompt's KV there, in
the cost model's own units (blocks of prefill, ``scoring.cost.Price``):

* local: ``overlap_credit x lacking x (1 + in_flight) + queued_prefill_weight x queued``:
  the decode worker prefills the whole blocks it lacks (``lacking``, its cache credit
  taken off), and every request decoding there stalls while it does (``in_flight``:
  kvgate's requests on it, the request's own not yet);
* remote: the prefill worker's ``overlap_credit x prefill_blocks + queued_prefill_weight x
  queued``, plus ``TRANSFER_BLOCK_COST`` for each block the decode worker lacks (sent
  over), plus ``TRANSFER_SETUP_TOKENS`` (in blocks) for the leg itself.

The prompt's partial last block is computed on the decode worker either way, so it is in
neither. The prefill leg is skipped when local is no dearer, or when the capacity rule
admits the request on no prefill worker (each at a limit: the decode worker does not wait
for them). So a decode worker that holds most of the prompt, or an idle one given a short
prompt, prefills it itself; a busy one, or one given a long prompt that a prefill worker
holds, receives it.
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
TRANSFER_SETUP_TOKENS = 256
"""The prefill leg's own cost, in tokens of prefill: one more request on the prefill
worker (a scheduling step), two HTTP hops and the decode worker's fetch. A prefill shorter
than this is a fraction of one engine step on the decode worker."""


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
            "transfer_setup_tokens": TRANSFER_SETUP_TOKENS,
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
    tail = size.blocks - size.full_blocks  # computed where it decodes, either way
    local = config.overlap_credit * max(here.prefill - tail, 0.0) * (1 + here.in_flight)
    local += config.queued_prefill_weight * here.queued
    own_cached = decode.predicted_cached_tokens(worker)
    lacking = max(size.full_blocks - here.match.blocks, 0)
    if prefill is None:
        return LegPlan(worker, None, local, None, 0, own_cached, 0, "no prefill worker ready")
    chosen = prefill.chosen
    if not prefill.admitted:  # every prefill worker at a limit: no leg to wait for there
        why = f"no prefill worker admits it ({prefill.refused[chosen].text})"
        return LegPlan(worker, None, local, None, 0, own_cached, 0, why)
    there = Price(prefill.size, prefill.candidates[chosen], config)
    remote = config.overlap_credit * there.prefill + config.queued_prefill_weight * there.queued
    remote += TRANSFER_BLOCK_COST * lacking + TRANSFER_SETUP_TOKENS / size.block_size
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
