"""Engine facts by agreement: a model's block size and what a name is, from what every worker
declares, so that no single worker decides for the others.

* **Block size.** A model's block size is the one kvgate is configured with, else the one a
  strict majority of its workers that declare one declare. A worker that declares another
  is not used for that model; without a majority (a tie, or no size over half) the model is
  not ready on any of its workers until the operator sets one or the replicas agree. A
  worker whose own KV events contradict what its ``/metrics`` declares is not used at all
  (and does not vote).
* **Adapters.** A name is a LoRA adapter (keyed in its own cache domain, on its parent's
  prompt) only where no worker serves it as a base model; its parent is the one most of the
  workers listing it give (a tie: the first name in sort order). Each worker's own relation
  says which cache domain its blocks for that name are in.

Reasons never name a worker's URL: they are shown on the open ``/ready``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvgate.index.types import WorkerId


@dataclass(frozen=True, slots=True)
class Declared:
    """What one worker declares that the fleet must agree on."""

    worker: WorkerId
    base_models: tuple[str, ...]
    block_size: int | None  # on its /metrics (or, with none there, carried by its events)
    events_block_size: int | None  # carried by its KV events, when seen


@dataclass(slots=True)
class BlockSizes:
    """Which worker is not used, and why: for any model (``own``) or per model (``per_model``);
    the models without an agreed size (``unresolved``)."""

    own: dict[WorkerId, str] = field(default_factory=dict)
    per_model: dict[WorkerId, dict[str, str]] = field(default_factory=dict)
    unresolved: dict[str, str] = field(default_factory=dict)

    def refuse(self, worker: WorkerId, model: str, reason: str) -> None:
        self.per_model.setdefault(worker, {})[model] = reason


def agree_block_sizes(
    declared: Iterable[Declared], explicit: Callable[[str], int | None]
) -> BlockSizes:
    """Every model's block size by agreement (``explicit``: the configured size of a model,
    None when not set), and the workers kept out of a model for it."""
    out = BlockSizes()
    serving: dict[str, list[Declared]] = {}
    for each in declared:
        size, events = each.block_size, each.events_block_size
        if size is not None and events is not None and events != size:
            out.own[each.worker] = (
                f"its KV events have block_size {events} but its /metrics declares {size}"
            )
        for model in each.base_models:
            serving.setdefault(model, []).append(each)
    for model, workers in serving.items():
        sizes = {
            w.worker: w.block_size
            for w in workers
            if w.block_size is not None and w.worker not in out.own
        }
        configured = explicit(model)
        if configured is not None:
            for worker, size in sizes.items():
                if size != configured:
                    out.refuse(worker, model, _configured(model, size, configured))
            continue
        votes = Counter(sizes.values())
        if not votes:
            continue
        (agreed, count), *_ = votes.most_common(1)
        if 2 * count > len(sizes):
            for worker, size in sizes.items():
                if size != agreed:
                    out.refuse(worker, model, _outvoted(model, size, agreed, count, len(sizes)))
            continue
        reason = _no_majority(model, votes)
        out.unresolved[model] = reason
        for w in workers:
            out.refuse(w.worker, model, reason)
    return out


def _configured(model: str, size: int, configured: int) -> str:
    return (
        f"the engine's block size is {size} but kvgate is configured with {configured} for "
        f"model {model!r}: set --index-block-size {size} (or index.model_block_sizes "
        f"{model}={size}), or leave it unset to adopt the engines'"
    )


def _outvoted(model: str, size: int, agreed: int, count: int, voters: int) -> str:
    return (
        f"block size {size} but {count} of the {voters} workers of model {model!r} that "
        f"declare one use {agreed}: every replica of a model must use the same --block-size"
    )


def _no_majority(model: str, votes: Counter[int]) -> str:
    sizes = ", ".join(f"{size} by {n}" for size, n in sorted(votes.items()))
    return (
        f"no block size has a majority of the workers of model {model!r} (declared: {sizes}): "
        f"make its replicas agree, or set index.model_block_sizes {model}=SIZE"
    )


def adapter_parents(relations: Iterable[Mapping[str, str | None]]) -> dict[str, str]:
    """adapter name → its parent, from each worker's relations (name → parent, None: a base
    model): only names no worker serves as a base model; the parent most workers give (a
    tie: the first in sort order)."""
    bases: set[str] = set()
    parents: dict[str, Counter[str]] = {}
    for relation in relations:
        for name, parent in relation.items():
            if parent is None:
                bases.add(name)
            else:
                parents.setdefault(name, Counter())[parent] += 1
    return {
        name: min(votes, key=lambda parent: (-votes[parent], parent))
        for name, votes in parents.items()
        if name not in bases
    }
