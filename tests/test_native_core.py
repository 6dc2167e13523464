"""The native core's parts against their references: the hash against the xxhash package,
the key chains against the pure-Python ones, the hash folding against ``fold_hash``, the
engine-hash map against a dict, and the table's memory going back down as entries go."""

from __future__ import annotations

import random
from array import array

import msgspec
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.index import _native
from kvgate.index.config import IndexConfig
from kvgate.index.events import fold_hash
from kvgate.index.keys import block_keys, cache_seed, pack_tokens
from kvgate.index.table import BlockTable, NativeBlockTable, new_table
from kvgate.index.types import WorkerId, WorkerKey

U64 = st.integers(0, 2**64 - 1)


def python_chain_keys(data: memoryview, block_size: int, prev: int) -> list[int]:
    """The chain, block by block with the xxhash package: what the native core must equal."""
    step = block_size * 4
    keys = []
    for offset in range(0, len(data) - len(data) % step, step):
        prev = xxhash.xxh3_64_intdigest(data[offset : offset + step], prev)
        keys.append(prev)
    return keys


@pytest.mark.parametrize("length", [*range(0, 260), 511, 512, 1024, 1025, 4096, 10_007])
def test_xxh3_matches_the_xxhash_package_at_every_length_class(length: int) -> None:
    data = random.Random(length).randbytes(length)
    for seed in (0, 1, 2**63 + 12345, 2**64 - 1, 0x9E3779B97F4A7C15):
        assert _native.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=2048), seed=U64)
def test_xxh3_matches_the_xxhash_package(data: bytes, seed: int) -> None:
    assert _native.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.sampled_from([1, 2, 3, 16, 32]),
    seed=U64,
)
def test_chain_keys_equal_the_python_loop(tokens: list[int], block_size: int, seed: int) -> None:
    full = len(tokens) - len(tokens) % block_size
    data = pack_tokens(tokens[:full])
    assert _native.chain_keys(data, block_size, seed) == python_chain_keys(data, block_size, seed)
    raw = msgspec.Raw(msgspec.msgpack.encode(tokens[:full]))
    from_wire = _native.chain_keys_msgpack(raw, block_size, seed, full // block_size)
    assert list(from_wire) == block_keys(tokens[:full], block_size, seed)


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, 3],  # does not fill 2 blocks of 2
        [1, 2, 3, -4],  # negative
        [1, 2, 3, 2**32],  # past uint32
        [1, 2, 3, "4"],  # not an int
        "1234",  # not an array
    ],
)
def test_chain_keys_msgpack_rejects_what_is_not_two_blocks_of_ids(tokens: object) -> None:
    raw = msgspec.msgpack.encode(tokens)
    with pytest.raises(ValueError, match="token_ids"):
        _native.chain_keys_msgpack(raw, 2, cache_seed(None, None), 2)


@pytest.mark.parametrize("blocks", [-1, 2**61 + 1, 2**62])
def test_chain_keys_msgpack_rejects_block_counts_the_ids_cannot_fill(blocks: int) -> None:
    """A block count whose product with the block size wraps around must not pass."""
    raw = msgspec.msgpack.encode([1] * 8)
    with pytest.raises(ValueError, match="token_ids"):
        _native.chain_keys_msgpack(raw, 8, 0, blocks)


@settings(max_examples=200, deadline=None)
@given(
    hashes=st.lists(
        st.one_of(
            U64,
            st.integers(-(2**63), -1),
            st.binary(min_size=0, max_size=40),
        ),
        max_size=20,
    )
)
def test_fold_hashes_equals_fold_hash(hashes: list[int | bytes]) -> None:
    raw = msgspec.msgpack.encode(hashes)
    assert list(_native.fold_hashes(raw)) == [fold_hash(h) for h in hashes]


@pytest.mark.parametrize("raw", [msgspec.msgpack.encode(["x"]), b"\x91\xc1", b"\x92\x01"])
def test_fold_hashes_rejects_other_values(raw: bytes) -> None:
    with pytest.raises(ValueError, match="block_hashes"):
        _native.fold_hashes(raw)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "put_many", "pop", "take", "del", "clear"]), U64, U64),
        max_size=60,
    )
)
def test_key_map_behaves_like_a_dict(ops: list[tuple[str, int, int]]) -> None:
    native, reference = _native.KeyMap(), dict[int, int]()
    keys = [k % 7 if i % 2 else k for i, (_, k, _) in enumerate(ops)]  # repeats: removals hit
    for (kind, _, value), key in zip(ops, keys, strict=True):
        if kind == "put":
            native[key] = value
            reference[key] = value
        elif kind == "put_many":
            native.put_many([key, key ^ 1], array("Q", [value, value ^ 1]))
            reference.update({key: value, key ^ 1: value ^ 1})
        elif kind == "pop":
            assert native.pop(key, None) == reference.pop(key, None)
        elif kind == "take":
            want = [reference.pop(k) for k in (key, key ^ 1) if k in reference]
            assert list(native.take_many(array("Q", [key, key ^ 1]))) == want
        elif kind == "del":
            if key in reference:
                del native[key]
                del reference[key]
            else:
                with pytest.raises(KeyError):
                    del native[key]
        else:
            native.clear()
            reference.clear()
        assert len(native) == len(reference)
        assert all(native.get(k) == v and k in native for k, v in reference.items())
        assert native.get(key) == reference.get(key)


def test_key_map_rejects_keys_that_are_not_uint64() -> None:
    keys = _native.KeyMap()
    with pytest.raises(OverflowError):
        keys[-1] = 1
    with pytest.raises(TypeError):
        keys.put_many(b"not uint64", [1])
    assert -1 not in keys and "x" not in keys


def test_table_memory_goes_back_down_as_entries_go() -> None:
    """A million-entry-class table grows into huge-page cell arrays and shrinks back."""
    rng = random.Random(5)
    table = _native.Table()
    chains = [array("Q", (rng.getrandbits(64) for _ in range(64))) for _ in range(2_000)]
    empty = table.memory_bytes()
    for chain in chains:
        table.store(0, chain, 0, None, 0.0)
        table.store(1, chain[:32], 0, None, 0.0)
    assert table.entry_count() == 2_000 * 96
    full = table.memory_bytes()
    assert full > 8 << 20  # cell arrays past the huge-page threshold
    for chain in chains[:1_900]:
        table.remove(0, chain[::-1], 1)
        table.remove(1, chain[:32][::-1], 1)
    assert table.entry_count() == 100 * 96
    assert table.memory_bytes() < full / 4  # maps halve once under 1/8 full
    for chain in chains[1_900:]:
        table.remove(0, chain, 1)
    table.clear_slot(1)
    assert table.entry_count() == 0 and table.block_count() == 0
    assert table.memory_bytes() <= empty + 4096


def test_table_rejects_bad_arguments() -> None:
    table = _native.Table()
    with pytest.raises(ValueError, match="tier"):
        table.store(0, [1], 3, None, 0.0)
    with pytest.raises(ValueError, match="slot"):
        table.store(-1, [1], 0, None, 0.0)
    with pytest.raises(TypeError):
        table.store(0, ["key"], 0, None, 0.0)
    with pytest.raises(OverflowError):
        table.find_matches([2**64])
    assert table.entry_count() == 0


def test_native_table_wrapper_reuses_released_slots() -> None:
    table = NativeBlockTable()
    workers = [WorkerKey(WorkerId(f"http://w{i}"), 0) for i in range(3)]
    for worker in workers:
        table.store(worker, [1, 2], 0, None)
    table.clear(workers[1])
    table.store(WorkerKey(WorkerId("http://new"), 0), [1], 0, None)
    assert table._slot_of[workers[2]] == 2  # the slot it had
    assert table._slot_of[WorkerKey(WorkerId("http://new"), 0)] == 1  # the released one
    assert sorted(m.gpu for m in table.find_matches([1, 2]).values()) == [1, 2, 2]


def test_the_configured_table_is_used() -> None:
    assert isinstance(new_table(IndexConfig(table="python").table_kind()), BlockTable)
    assert isinstance(new_table(IndexConfig(table="native").table_kind()), NativeBlockTable)
    assert isinstance(new_table(IndexConfig().table_kind()), NativeBlockTable)  # auto, built
