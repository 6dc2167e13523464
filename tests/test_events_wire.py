"""KV-event wire format: both encodings, optional and unknown trailing fields, hash folding."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.index.errors import EventDecodeError
from kvgate.index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventEncoder,
    decode_event_batch,
    fold_hash,
)

STORED = BlockStored([1, 2], None, list(range(32)), 16, None, "GPU")


def test_map_tagged_shape_is_vllms() -> None:
    payload = EventEncoder(array_tagged=False).encode(
        EventBatch(1.5, [STORED, AllBlocksCleared()], None)
    )
    assert msgspec.msgpack.decode(payload) == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1, 2],
                "parent_block_hash": None,
                "token_ids": list(range(32)),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "AllBlocksCleared"},
        ],
    ]


def test_array_tagged_shape() -> None:
    payload = EventEncoder(array_tagged=True).encode(EventBatch(2.0, [BlockRemoved([3], "CPU")], 1))
    assert msgspec.msgpack.decode(payload) == [2.0, [["BlockRemoved", [3], "CPU"]], 1]


@pytest.mark.parametrize("array_tagged", [False, True])
def test_round_trip(array_tagged: bool) -> None:
    stored = BlockStored([9], 8, [1] * 16, 16, 3, "CPU", "adapter", [["salt"]])
    batch = EventBatch(3.0, [stored, BlockRemoved([9], None), AllBlocksCleared()], 2)
    decoded = decode_event_batch(EventEncoder(array_tagged=array_tagged).encode(batch))
    assert decoded.ts == 3.0 and decoded.data_parallel_rank == 2
    first, second, third = decoded.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockRemoved)
    assert isinstance(third, AllBlocksCleared)
    assert (
        list(first.block_hashes),
        first.parent_block_hash,
        first.lora_id,
        first.medium,
        first.lora_name,
        first.extra_keys,
    ) == ([9], 8, 3, "CPU", "adapter", [["salt"]])


def test_unknown_trailing_fields_and_missing_optional_ones() -> None:
    newer = [
        1.0,
        [
            ["BlockStored", [1], None, [0] * 16, 16, None, "GPU", None, None, 0, "full_attention"],
            ["BlockRemoved", [1], "GPU", 0],
            {
                "type": "BlockStored",
                "block_hashes": [2],
                "parent_block_hash": None,
                "token_ids": [0] * 16,
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "group_idx": 1,
                "kv_cache_spec_kind": "x",
            },
        ],
    ]
    mixed = decode_event_batch(msgspec.msgpack.encode([*newer[:1], newer[1][:2]]))
    assert len(mixed.events) == 2
    mapped = decode_event_batch(msgspec.msgpack.encode([1.0, newer[1][2:]]))
    assert isinstance(mapped.events[0], BlockStored)
    older = decode_event_batch(msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [0], 1]]]))
    event = older.events[0]
    assert (
        isinstance(event, BlockStored) and event.medium is None and older.data_parallel_rank is None
    )


def test_byte_and_signed_hashes_fold_to_u64() -> None:
    digest = bytes(range(32))
    payload = msgspec.msgpack.encode(
        [
            0.0,
            [
                ["BlockStored", [digest, -1], digest, [0] * 32, 16, None, "GPU"],
                ["BlockRemoved", [digest], "GPU"],
            ],
        ]
    )
    stored, removed = decode_event_batch(payload).events
    low = int.from_bytes(digest[-8:], "big")
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert list(stored.block_hashes) == [low, 2**64 - 1]
    assert stored.parent_block_hash == low
    assert list(removed.block_hashes) == [low]
    assert fold_hash(-2) == 2**64 - 2


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"garbage",
        msgspec.msgpack.encode({"a": 1}),
        msgspec.msgpack.encode([1.0, [["Nope"]]]),
        msgspec.msgpack.encode([1.0, "x"]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
    ],
)
def test_garbage_raises_decode_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_event_batch(payload)


@given(st.binary(max_size=64))
def test_random_bytes_never_crash(payload: bytes) -> None:
    with contextlib.suppress(EventDecodeError):
        decode_event_batch(payload)
