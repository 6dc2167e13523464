"""KV-event wire decoding (vLLM and SGLang ZMQ publishers) and a matching encoder.

A payload is a msgpack array ``[ts, events, data_parallel_rank?]``. Each event is either a map
tagged by its ``"type"`` key (current vLLM) or an array whose first element is the tag (older
vLLM, SGLang). Fields are positional in the array form; newer trailing fields are optional and
unknown trailing fields are ignored. Block hashes arrive as unsigned 64-bit ints, signed ints
(SGLang) or 32 raw bytes (vLLM with int hashes disabled); all fold to an unsigned 64-bit int.

Decoded events keep ``token_ids`` as the raw msgpack array (``msgspec.Raw``): the translator
keys the blocks straight from those bytes in the native core, without a Python int per token.
``BlockStored.tokens()`` gives the ids as a list either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from index.types import EngineBlockHash

_U64 = (1 << 64) - 1


class EventDecodeError(ValueError):
    """A payload that is not a KV-event batch."""


def fold_hash(value: int | bytes) -> EngineBlockHash:
    """An engine block hash as an unsigned 64-bit int (bytes: their low 8 bytes, big-endian)."""
    if isinstance(value, bytes):
        return EngineBlockHash(int.from_bytes(value[-8:], "big"))
    return EngineBlockHash(value & _U64)


_WIRE_HASHES = msgspec.msgpack.Decoder(list[int | bytes])
_native_fold_hashes: Callable[[msgspec.Raw], Sequence[int]] | None
try:
    from index._native import fold_hashes as _native_fold_hashes
except ImportError:  # never built (pip install builds it): msgspec, then fold one by one
    _native_fold_hashes = None


def _fold_all(hashes: Sequence[Any] | msgspec.Raw) -> Sequence[Any]:
    """Block hashes as unsigned 64-bit ints; from the wire (``Raw``) as ``array('Q')``."""
    if isinstance(hashes, msgspec.Raw):
        if _native_fold_hashes is not None:
            return _native_fold_hashes(hashes)  # ValueError (a validation error) if malformed
        wire: list[Any] = _WIRE_HASHES.decode(hashes)
        hashes = wire
    try:
        if min(hashes) >= 0 and max(hashes) <= _U64:
            return hashes
    except TypeError:
        pass  # bytes hashes (or a mix): fold one by one
    return [fold_hash(h) for h in hashes]


_TOKEN_IDS = msgspec.msgpack.Decoder(list[int])
_native_repeats_a_key: Callable[[bytes], bool] | None
try:
    from index._native import repeats_a_key as _native_repeats_a_key
except ImportError:  # never built: msgspec's own rule (the last value of a field wins)
    _native_repeats_a_key = None


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
        if _native_repeats_a_key is not None and _native_repeats_a_key(payload):
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


def _stored_fields(event: BlockStored) -> list[tuple[str, Any]]:
    fields: list[tuple[str, Any]] = [
        ("block_hashes", list(event.block_hashes)),
        ("parent_block_hash", event.parent_block_hash),
        ("token_ids", event.tokens()),
        ("block_size", event.block_size),
        ("lora_id", event.lora_id),
        ("medium", event.medium),
    ]
    if event.lora_name is not None or event.extra_keys is not None:
        fields.append(("lora_name", event.lora_name))
    if event.extra_keys is not None:
        fields.append(("extra_keys", event.extra_keys))
    return fields


def _wire_event(event: KvEvent, array_tagged: bool) -> Any:
    if isinstance(event, BlockStored):
        tag, fields = "BlockStored", _stored_fields(event)
    elif isinstance(event, BlockRemoved):
        fields = [("block_hashes", list(event.block_hashes)), ("medium", event.medium)]
        tag = "BlockRemoved"
    else:
        tag, fields = "AllBlocksCleared", []
    if array_tagged:
        return [tag, *(value for _, value in fields)]
    return {"type": tag, **dict(fields)}


def encode_event_batch(batch: EventBatch, *, array_tagged: bool) -> bytes:
    """vLLM's wire shape: events as maps tagged by ``"type"`` (current vLLM) or as arrays with
    the tag first (older vLLM, SGLang). ``lora_name``/``extra_keys`` are sent only when set and
    ``data_parallel_rank`` only when not None, as the engines omit defaults."""
    body: list[Any] = [batch.ts, [_wire_event(e, array_tagged) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgspec.msgpack.encode(body)
