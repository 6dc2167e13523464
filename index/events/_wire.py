"""The KV-event wire format (vLLM and SGLang ZMQ publishers): one module for both ends.

A payload is a msgpack array ``[ts, events, data_parallel_rank?]``. Each event is either a map
tagged by its ``"type"`` key (current vLLM) or an array whose first element is the tag (older
vLLM, SGLang). Fields are positional in the array form; newer trailing fields are optional and
unknown trailing fields are ignored. Block hashes arrive as unsigned 64-bit ints, signed ints
(SGLang) or 32 raw bytes (vLLM with int hashes disabled); all fold to an unsigned 64-bit int.

* Decoding (``EventDecoder``): decoded events keep ``token_ids`` as the raw msgpack array
  (``msgspec.Raw``): the translator keys the blocks straight from those bytes in the native
  core, without a Python int per token. ``BlockStored.tokens()`` gives the ids as a list
  either way.
* Encoding (``EventEncoder``): what the simulator publishes and tests and benchmarks send,
  shaped as vLLM's own msgspec structs encode it (``lora_name`` always present, defaults
  such as ``extra_keys=None`` omitted from maps), in either encoding, with int or 32-byte
  hashes (``hash_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

from kvgate.index import _native
from kvgate.index.errors import EventDecodeError
from kvgate.index.types import EngineBlockHash

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

_U64 = (1 << 64) - 1


def fold_hash(value: int | bytes) -> EngineBlockHash:
    """An engine block hash as an unsigned 64-bit int (bytes: their low 8 bytes, big-endian)."""
    if isinstance(value, bytes):
        return EngineBlockHash(int.from_bytes(value[-8:], "big"))
    return EngineBlockHash(value & _U64)


def _fold_all(hashes: Sequence[Any] | msgspec.Raw) -> Sequence[Any]:
    """Block hashes as unsigned 64-bit ints; from the wire (``Raw``) as ``array('Q')``."""
    if isinstance(hashes, msgspec.Raw):
        return _native.fold_hashes(hashes)  # ValueError (a validation error) if malformed
    try:
        if min(hashes) >= 0 and max(hashes) <= _U64:
            return hashes
    except TypeError:
        pass  # bytes hashes (or a mix): fold one by one
    return [fold_hash(h) for h in hashes]


_TOKEN_IDS = msgspec.msgpack.Decoder(list[int])


class BlockStored(msgspec.Struct, gc=False):
    """Blocks now cached on the engine: a chain, ``parent_block_hash`` before the first.

    ``token_ids`` is a list when built in Python and the undecoded msgpack array when decoded
    from the wire (see ``tokens()``); decoded ``block_hashes`` are an ``array('Q')``."""

    block_hashes: Sequence[EngineBlockHash]
    parent_block_hash: EngineBlockHash | None
    token_ids: list[int] | msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None

    def tokens(self) -> list[int]:
        """The token ids as a list (raises ``EventDecodeError`` if the raw array is not ints)."""
        if not isinstance(self.token_ids, msgspec.Raw):
            return self.token_ids
        try:
            return _TOKEN_IDS.decode(self.token_ids)
        except msgspec.MsgspecError as error:
            raise EventDecodeError(f"token_ids: {error}") from error

    def __post_init__(self) -> None:
        if self.block_hashes:
            self.block_hashes = _fold_all(self.block_hashes)
        parent: Any = self.parent_block_hash
        if parent is not None and (type(parent) is not int or not 0 <= parent <= _U64):
            self.parent_block_hash = fold_hash(parent)


class BlockRemoved(msgspec.Struct, gc=False):
    """Blocks evicted from ``medium``."""

    block_hashes: Sequence[EngineBlockHash]
    medium: str | None = None

    def __post_init__(self) -> None:
        if self.block_hashes:
            self.block_hashes = _fold_all(self.block_hashes)


class AllBlocksCleared(msgspec.Struct, gc=False):
    """The engine dropped its whole prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published payload."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


# Wire flavours. Block hashes stay raw msgpack (ints or bytes) until __post_init__ folds them
# in one native call; the parent hash is one value.
_WireHash = int | bytes


class _MapBlockStored(BlockStored, tag_field="type", tag="BlockStored", omit_defaults=True):
    block_hashes: msgspec.Raw  # type: ignore[assignment]
    parent_block_hash: _WireHash | None  # type: ignore[assignment]
    token_ids: msgspec.Raw


class _MapBlockRemoved(BlockRemoved, tag_field="type", tag="BlockRemoved", omit_defaults=True):
    block_hashes: msgspec.Raw  # type: ignore[assignment]


class _MapAllBlocksCleared(AllBlocksCleared, tag_field="type", tag="AllBlocksCleared"):
    pass


class _ArrBlockStored(BlockStored, array_like=True, tag="BlockStored", omit_defaults=True):
    block_hashes: msgspec.Raw  # type: ignore[assignment]
    parent_block_hash: _WireHash | None  # type: ignore[assignment]
    token_ids: msgspec.Raw


class _ArrBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved", omit_defaults=True):
    block_hashes: msgspec.Raw  # type: ignore[assignment]


class _ArrAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared]
    data_parallel_rank: int | None = None


class _ArrBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrBlockStored | _ArrBlockRemoved | _ArrAllBlocksCleared]
    data_parallel_rank: int | None = None


class EventDecoder:
    """Reusable decoder for both encodings (holds msgspec decoders; cheap to share)."""

    def __init__(self) -> None:
        self._map = msgspec.msgpack.Decoder(_MapBatch)
        self._arr = msgspec.msgpack.Decoder(_ArrBatch)

    def decode(self, payload: bytes) -> EventBatch:
        """One payload's batch. A map event holding a known key twice is refused (the native
        path's rule, checked by its own reader: tests/test_native_ingest.py), and so is
        nesting too deep for the decoder."""
        if _native.repeats_a_key(payload):
            raise EventDecodeError("an event repeats a key")
        try:
            return self._decode(payload)
        except RecursionError as error:
            raise EventDecodeError("nested too deeply") from error

    def _decode(self, payload: bytes) -> EventBatch:
        try:
            wire: _MapBatch | _ArrBatch = self._map.decode(payload)
        except msgspec.ValidationError as map_error:
            try:
                wire = self._arr.decode(payload)
            except msgspec.ValidationError as arr_error:
                raise EventDecodeError(f"not a KV-event batch: {arr_error}") from map_error
            except msgspec.DecodeError as error:
                raise EventDecodeError(f"malformed msgpack: {error}") from error
        except msgspec.DecodeError as error:
            raise EventDecodeError(f"malformed msgpack: {error}") from error
        events: list[KvEvent] = list(wire.events)
        return EventBatch(wire.ts, events, wire.data_parallel_rank)


def decode_event_batch(payload: bytes) -> EventBatch:
    """Decode one ZMQ payload; raises ``EventDecodeError`` on anything else."""
    return EventDecoder().decode(payload)


def hash_bytes(block_hash: int) -> bytes:
    """The 32-byte form of a block hash (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``): its last 8
    bytes, big-endian, are the int form (what ``fold_hash`` reads back); the first 24 are
    derived from it."""
    head = xxhash.xxh3_128_digest(block_hash.to_bytes(8, "big"))
    tail = xxhash.xxh3_64_digest(head)
    return head + tail + block_hash.to_bytes(8, "big")


# What vLLM's own structs put on the wire (vllm/distributed/kv_events.py): every field up to
# ``lora_name``, then the ones with defaults, omitted from maps when at their default.
class _StoredOut(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None


class _RemovedOut(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[Any]
    medium: str | None


class _ClearedOut(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class _StoredOutArray(_StoredOut, array_like=True):
    pass


class _RemovedOutArray(_RemovedOut, array_like=True):
    pass


class _ClearedOutArray(_ClearedOut, array_like=True):
    pass


class EventEncoder:
    """Encodes batches as an engine publishes them: events as maps tagged by ``"type"``
    (current vLLM) or, ``array_tagged``, as arrays with the tag first (older vLLM, SGLang);
    block hashes as ints or, ``bytes_hashes``, in their 32-byte form (``hash_bytes``)."""

    def __init__(self, *, array_tagged: bool = False, bytes_hashes: bool = False) -> None:
        self._stored = _StoredOutArray if array_tagged else _StoredOut
        self._removed = _RemovedOutArray if array_tagged else _RemovedOut
        self._cleared = _ClearedOutArray() if array_tagged else _ClearedOut()
        self._bytes = bytes_hashes
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, batch: EventBatch) -> bytes:
        """``[ts, events]``, then ``data_parallel_rank`` unless it is None."""
        body: list[Any] = [batch.ts, [self._wire(event) for event in batch.events]]
        if batch.data_parallel_rank is not None:
            body.append(batch.data_parallel_rank)
        return self._encoder.encode(body)

    def _hashes(self, hashes: Sequence[int]) -> list[Any]:
        return [hash_bytes(h) for h in hashes] if self._bytes else list(hashes)

    def _wire(self, event: KvEvent) -> Any:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            if self._bytes and parent is not None:
                parent = hash_bytes(parent)  # type: ignore[assignment]
            return self._stored(
                self._hashes(event.block_hashes),
                parent,
                event.tokens(),
                event.block_size,
                event.lora_id,
                event.medium,
                event.lora_name,
                event.extra_keys,
            )
        if isinstance(event, BlockRemoved):
            return self._removed(self._hashes(event.block_hashes), event.medium)
        return self._cleared
