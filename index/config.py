"""Configuration of the index layer (every field has a default)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from kvgate.index.types import Tier

DEFAULT_MEDIUM_TIERS: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_TIER": Tier.CPU,
    "DISK": Tier.DISK,
    "SSD": Tier.DISK,
}


class IndexConfig(BaseModel):
    """Knobs of tokenization, block keys, the indexes and event ingestion."""

    block_size: int = Field(
        16,
        gt=0,
        description="the engines' KV block size in tokens: leave it unset to adopt each "
        "model's engines' own (vllm:cache_config_info, KV events); set it only for engines that "
        "declare none (an engine declaring another is then not ready)",
    )
    model_block_sizes: dict[str, int] = Field(
        default_factory=dict, description="Per-model block sizes (set: as block_size)."
    )
    tokenizers: dict[str, Path] = Field(
        default_factory=dict,
        description="Per-model local directory holding tokenizer.json (+ tokenizer_config.json).",
    )
    default_tokenizer: Path | None = Field(
        None, description="Tokenizer directory used for models without their own entry."
    )
    max_entries: int = Field(
        2_000_000,
        gt=0,
        description="cap on the block index's entries (about 150-350 bytes each; the least "
        "recently stored are pruned past it): bounds kvgate's memory; raise it when your "
        "engines' caches hold more blocks in all",
    )
    table: Literal["auto", "native", "python"] = Field(
        "auto",
        description="Block table: the native core (built at install), the pure-Python one, or "
        "auto (native when built).",
    )
    approx_ttl_s: float = Field(
        120.0, gt=0, description="Approximate mode: how long a routed prefix is assumed cached."
    )
    approx_worker_capacity: int = Field(
        200_000, gt=0, description="Approximate mode: blocks remembered per worker (LRU)."
    )
    approx_chars_per_block: int = Field(
        64, gt=0, description="Approximate tokenization: characters per pseudo-block."
    )
    medium_tiers: dict[str, Tier] = Field(
        default_factory=lambda: dict(DEFAULT_MEDIUM_TIERS),
        description="Event `medium` (upper-cased) → tier: 0 GPU, 1 CPU, 2 disk.",
    )
    unknown_medium_tier: Tier = Field(Tier.DISK, description="Tier of media not listed above.")
    tokenize_cache_tokens: int = Field(
        4_000_000, ge=0, description="Budget (tokens) of the rendered-prefix tokenization cache."
    )
    tokenize_inline_chars: int = Field(
        8_000, ge=0, description="Cold tokenizations of longer texts run in a worker thread."
    )
    engine_tokenize: bool = Field(
        True,
        description="For a model without a local tokenizer, tokenize each prompt with an "
        "engine's POST /tokenize (vLLM, SGLang: exact, chat template included), asked only of "
        "workers the request may be routed to, the likeliest first. Off: prompts are tokenized "
        "locally only and kvgate needs a --tokenizer; turn it off when the engines are not "
        "equally trusted (docs/security.md).",
    )
    engine_tokenize_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Longest wait for an engine's /tokenize answer; past it the next candidate "
        "is asked (raise it for engines that tokenize long prompts slowly).",
    )
    topic: str = Field("", description="ZMQ topic prefix subscribed to ('' = every topic).")
    reconnect_backoff_s: float = Field(0.2, gt=0, description="First reconnect delay.")
    reconnect_backoff_max_s: float = Field(5.0, gt=0, description="Longest reconnect delay.")
    replay_timeout_s: float = Field(
        2.0, gt=0, description="Give up on a replay after this long without a batch."
    )
    # Bounds on what an event publisher controls (docs/security-events.md): past one, the
    # publisher's domain is cleared (or its batch dropped), counted in
    # kvgate_index_limits_total, and ingestion carries on.
    replay_max_s: float = Field(
        20.0, gt=0, description="Give up on a replay (and clear the worker) after this long."
    )
    replay_max_batches: int = Field(
        20_000, gt=0, description="Give up on a replay after this many batches (vLLM keeps 10k)."
    )
    replay_max_bytes: int = Field(
        256 * 2**20, gt=0, description="Give up on a replay after this many payload bytes."
    )
    max_message_bytes: int = Field(
        2**20,
        gt=0,
        description="Largest ZMQ frame taken from an event or replay socket: a publisher "
        "sending more is disconnected by ZMQ (and its worker cleared). An engine step's batch "
        "stores at most its batched tokens (chunked prefill: 8-16k, about 50 KB).",
    )
    receive_hwm: int = Field(
        128,
        gt=0,
        description="Messages queued per event socket before ZMQ stops reading it (memory: up "
        "to receive_hwm x max_message_bytes per socket).",
    )
    max_event_blocks: int = Field(
        65_536, gt=0, description="Blocks in one event; past it the rank's domain is cleared."
    )
    max_ranks_per_endpoint: int = Field(
        8,
        gt=0,
        description="Data-parallel ranks one event endpoint may publish for; batches for more "
        "are dropped.",
    )
    discovery_timeout_s: float = Field(2.0, gt=0, description="GET /kv_event_sources timeout.")
    decode_error_log_interval_s: float = Field(
        10.0, gt=0, description="At most one log line per burst of undecodable payloads."
    )

    def local_tokenizer_missing(self) -> str | None:
        """Why the configuration cannot key prompts exactly: engine tokenization is off and
        no local tokenizer is given (None: it can)."""
        if self.engine_tokenize or self.tokenizers or self.default_tokenizer is not None:
            return None
        return (
            "engine tokenization is off (--no-index-engine-tokenize): give the models' "
            "tokenizer with --tokenizer [MODEL=]DIR"
        )

    def table_kind(self) -> Literal["native", "python"] | None:
        """The block table asked for (None: the default, native when built)."""
        return None if self.table == "auto" else self.table

    def block_size_for(self, model: str | None) -> int:
        """The block size of ``model``'s engines (None: a model not known, the default)."""
        return (
            self.block_size if model is None else self.model_block_sizes.get(model, self.block_size)
        )

    def explicit_block_size(self, model: str) -> int | None:
        """The block size set for ``model`` (its own entry, or ``block_size`` given
        explicitly); None: not set, the engines' declared size is adopted."""
        size = self.model_block_sizes.get(model)
        if size is None and "block_size" in self.model_fields_set:
            size = self.block_size
        return size

    def tokenizer_dir(self, model: str) -> Path | None:
        return self.tokenizers.get(model, self.default_tokenizer)

    def tokenizer_problems(self) -> list[str]:
        """What is wrong with the configured tokenizer folders (each must hold the model's
        ``tokenizer.json``), one line each; empty: nothing."""
        named = [(f"{model}=", path) for model, path in self.tokenizers.items()]
        if self.default_tokenizer is not None:
            named.append(("", self.default_tokenizer))
        return [problem for label, path in named if (problem := tokenizer_problem(label, path))]

    def tier_of(self, medium: str | None) -> Tier:
        if medium is None:
            return Tier.GPU
        return self.medium_tiers.get(medium.upper(), self.unknown_medium_tier)


def tokenizer_problem(label: str, path: Path) -> str | None:
    """Why ``path`` is not a usable tokenizer folder (None: it is)."""
    shown = f"--tokenizer {label}{path}"
    if not path.is_dir():
        return f"{shown}: no such folder (give the folder holding the model's tokenizer.json)"
    if not (path / "tokenizer.json").is_file():
        return (
            f"{shown}: the folder has no tokenizer.json (give the model's folder as "
            "downloaded: tokenizer.json, tokenizer_config.json)"
        )
    return None
