"""KV events exactly as vLLM puts them on the wire (msgpack), in both encodings.

A batch is ``[ts, events, data_parallel_rank]`` (a msgpack array). Each event is either a
msgpack map tagged by ``"type"`` (current vLLM, ``map``) or an array whose first element is
the tag followed by every field in order (older vLLM and SGLang, ``array``). In the map form
fields equal to their default are omitted (``omit_defaults``, as vLLM does); msgspec's array
form always carries every field.

The simulator builds events as the map-form structs below and converts them at encoding time.
"""

from __future__ import annotations

from typing import Any

import msgspec
import xxhash

from backends.sim.config import EventEncoding, HashFormat

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """A chain of full blocks now cached; ``parent_block_hash`` precedes the first one."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks no longer cached in ``medium``."""

    block_hashes: list[Any]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Every cached block of the engine is gone (prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _BlockStoredArray(BlockStored, tag="BlockStored", array_like=True):
    pass


class _BlockRemovedArray(BlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events, as published."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def hash_bytes(block_hash: int) -> bytes:
    """The 32-byte form of a block hash (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

    Its last 8 bytes, big-endian, are the integer form; the first 24 are derived from it.
    """
    head = xxhash.xxh3_128_digest(block_hash.to_bytes(8, "big"))
    tail = xxhash.xxh3_64_digest(head)
    return head + tail + block_hash.to_bytes(8, "big")


class EventEncoder:
    """Encodes batches of events in the configured encoding and hash format."""

    def __init__(self, encoding: EventEncoding, hash_format: HashFormat) -> None:
        self._array = encoding == "array"
        self._bytes = hash_format == "bytes"
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: list[KVEvent], dp_rank: int = 0) -> bytes:
        wire = [self._convert(e) for e in events] if self._array or self._bytes else events
        return self._encoder.encode(EventBatch(ts, list(wire), dp_rank))

    def _hashes(self, hashes: list[Any]) -> list[Any]:
        return [hash_bytes(h) for h in hashes] if self._bytes else hashes

    def _convert(self, event: KVEvent) -> Any:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            if self._bytes and parent is not None:
                parent = hash_bytes(parent)
            cls = _BlockStoredArray if self._array else BlockStored
            return cls(
                self._hashes(event.block_hashes),
                parent,
                event.token_ids,
                event.block_size,
                event.lora_id,
                event.medium,
                event.lora_name,
                event.extra_keys,
            )
        if isinstance(event, BlockRemoved):
            removed = _BlockRemovedArray if self._array else BlockRemoved
            return removed(self._hashes(event.block_hashes), event.medium)
        return _AllBlocksClearedArray() if self._array else event
