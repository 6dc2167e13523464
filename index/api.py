"""The index layer's interfaces: what it offers the layers above and what it needs of them.

* ``Indexer`` and the operations it applies, in kvgate's key space: engine events (engine
  hashes) are translated per worker into these by index/events/, which owns the engine-hash →
  ``BlockKey`` map; kvgate's own routing decisions are expressed the same way for the
  approximate (event-less) indexer. ``BatchResult``: what one KV-event payload did.
* ``BlockIndex``: what the gateway asks of the index (keys of a prompt, matches, routed
  requests).
* ``EngineWorker`` and ``WorkerListener``: the fleet as the index needs to know it, told by
  whoever keeps the list of workers (backends' registry): the index never keeps its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvgate.index.types import BlockKey, PrefixMatch, Tier, WorkerId, WorkerKey


@dataclass(frozen=True, slots=True)
class StoreBlocks:
    """``keys`` (a chain, parent first) are now cached on the worker in ``tier``.

    ``parent`` is the key of the block before ``keys[0]`` (None: ``keys[0]`` is a root).
    """

    keys: Sequence[BlockKey]
    tier: Tier = Tier.GPU
    parent: BlockKey | None = None


@dataclass(frozen=True, slots=True)
class RemoveBlocks:
    """``keys`` are no longer cached on the worker in ``tier``."""

    keys: Sequence[BlockKey]
    tier: Tier = Tier.GPU


@dataclass(frozen=True, slots=True)
class ClearAll:
    """Every block of the worker is gone (engine reset or restart)."""


IndexOp = StoreBlocks | RemoveBlocks | ClearAll


class Indexer(Protocol):
    """A global block → workers index."""

    def apply(self, worker: WorkerKey, op: IndexOp) -> None:
        """Apply one operation for one cache domain."""
        ...

    def find_matches(self, keys: Sequence[BlockKey]) -> Mapping[WorkerKey, PrefixMatch]:
        """Per cache domain holding ``keys[0]``, the contiguous matched prefix by tier."""
        ...

    def clear_worker(self, worker: WorkerKey) -> None:
        """Forget every block of one cache domain."""
        ...

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget every block of every data-parallel rank of a worker."""
        ...

    def entry_count(self) -> int:
        """Number of (block, cache domain) entries held."""
        ...

    def holds(self, worker: WorkerKey, key: BlockKey) -> bool:
        """Whether one cache domain holds ``key`` in some tier."""
        ...

    def domain_entries(self, worker: WorkerKey) -> int:
        """Blocks one cache domain holds."""
        ...

    def held_keys(self, worker: WorkerKey) -> Sequence[int]:
        """The blocks one cache domain holds."""
        ...


Refusal = Literal["undecodable", "failed", "dropped"]
"""Why a payload was not applied: not a KV-event batch; it raised while applied (what it did is
unknown: the worker is cleared); past a bound before anything was applied (a rank too many)."""


@dataclass(slots=True)
class BatchResult:
    """What one KV-event payload did, on either ingestion path (the native one fills it in C):
    the one result of ingestion, counted into the metrics as it is.

    A stored event is *seen* when applied, skipped for an unknown parent or skipped because
    its parent was pruned by the cap (``pruned_parent``); ``malformed``, ``mismatched`` (another
    block size) and ``over_limit`` (past ``max_event_blocks``: the domain is cleared) events are
    not. ``pruned`` counts the entries the cap evicted meanwhile."""

    ts: float = 0.0
    events: int = 0
    stored_events: int = 0
    stored_blocks: int = 0
    removed_events: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    unknown_parent: int = 0
    pruned_parent: int = 0
    malformed: int = 0
    mismatched: int = 0
    over_limit: int = 0
    pruned: int = 0
    refused: Refusal | None = None


TokenizeMode = Literal["tokenizer", "engine", "approx", "token_ids"]
"""How a prompt became tokens: the model's own tokenizer + chat template, the engine's
``/tokenize`` endpoint, approximate character chunks, or token ids given by the client."""


@dataclass(frozen=True, slots=True)
class PromptInput:
    """The parts of an OpenAI request body that decide its tokens and cache domain."""

    kind: Literal["chat", "completion"]
    messages: Sequence[Mapping[str, Any]] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    prompt: str | Sequence[int] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Mapping[str, Any] | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    add_special_tokens: bool | None = None
    """The tokenizer's own special tokens (BOS, ...) around the rendered text; None: as the
    engine does for ``kind`` (completions yes, chats no). vLLM's Responses API adds them."""


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """A prompt's block keys (full blocks only) and how they were obtained.

    ``finish``, when set, starts work the keying left for later (the whole text of a long
    prompt keyed only as far as a worker holds it, tokenized in the background for the
    session's next turn): call it once the request's first token is back (or it ended), so
    that this work does not compete with the request's own way to the engine. Calling it
    again does nothing; never calling it only leaves the next turn to tokenize more.

    Keyed by engines (mode ``engine``): ``engine`` is the engine kind whose ``/tokenize`` gave
    ``block_keys``; in a fleet of several kinds each other kind tokenizes the prompt too, and
    ``other_engines`` holds the keys of each kind whose tokens differ (empty: it could not
    tokenize it, its workers get no credit). A worker is matched with its own kind's keys.
    """

    block_keys: Sequence[BlockKey]
    block_size: int
    prompt_tokens: int
    mode: TokenizeMode
    finish: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    engine: str | None = None
    other_engines: Mapping[str, Sequence[BlockKey]] = field(default_factory=dict, repr=False)

    def keys_of(self, engine: str) -> Sequence[BlockKey]:
        """The prompt's keys as a worker of engine kind ``engine`` tokenizes it."""
        return self.other_engines.get(engine, self.block_keys)


TokenizeOn = Callable[[], Sequence[WorkerId]]
"""The workers a request may be routed to, the likeliest first (called only when its prompt
is tokenized by an engine): only these see the prompt, in this order."""


class BlockIndex(Protocol):
    """What the gateway needs from the index layer (implemented in index/)."""

    async def keys_for(
        self, model: str, prompt: PromptInput, *, tokenize_on: TokenizeOn | None = None
    ) -> PromptKeys:
        """Tokenize (exactly as the engine does, or the best fallback) and key a prompt;
        ``tokenize_on``: the workers whose ``/tokenize`` may see it (see ``TokenizeOn``)."""
        ...

    def match(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, PrefixMatch]:
        """Per worker, the best matched prefix over its data-parallel ranks."""
        ...

    def rank_matches(
        self, keys: Sequence[BlockKey]
    ) -> Mapping[WorkerId, Mapping[int, PrefixMatch]]:
        """For each worker with several data-parallel ranks (each its own cache): every
        rank's matched prefix; workers with one rank are left out."""
        ...

    def record_routed(self, worker: WorkerId, keys: Sequence[BlockKey]) -> None:
        """Tell the index a request was sent (feeds the approximate, event-less mode)."""
        ...


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where one data-parallel rank of a worker publishes its KV events (ZMQ)."""

    events: str
    replay: str | None = None
    dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class EngineWorker:
    """What the index needs of a worker: its id and URL, its engine kind, its configured KV-event
    endpoints (none: asked of a vLLM worker, ``GET /kv_event_sources``, else approximate
    mode), the one model it serves if known (its events' block size), the ``Authorization``
    header value for the index's own calls to it (``/kv_event_sources``, ``/tokenize``; never
    shown), whether it is healthy (only healthy workers are asked to tokenize), and the KV block
    size its engine declares (None: not declared, or contradicted: the configured one applies)."""

    id: WorkerId
    url: str
    engine: str = "vllm"
    endpoints: tuple[Endpoints, ...] = ()
    model: str | None = None
    authorization: str | None = field(default=None, repr=False)
    healthy: bool = False
    block_size: int | None = None


class WorkerListener(Protocol):
    """Told of every change of the fleet by whoever keeps the list of workers."""

    def worker_added(self, worker: EngineWorker) -> None:
        """A worker joined (or was there when the listener subscribed)."""
        ...

    def worker_removed(self, worker: WorkerId) -> None:
        """A worker left: forget it (its entries, its subscriptions)."""
        ...

    def worker_health_changed(self, worker: EngineWorker) -> None:
        """A worker became healthy or unhealthy, or what it serves or declares changed
        (``worker`` as it is now, models and block size included)."""
        ...
