"""kvgate's block keys: chained xxh3_64 over full blocks of token ids.

``key[i] = xxh3_64(token bytes of block i, seed=key[i-1])`` with ``key[-1]`` the chain's root
seed (``cache_seed``: LoRA name and cache salt folded in) or the given parent key. Token ids
are packed once as little-endian uint32 and the chain hashed in one call of the native core
(index/csrc/keys.c: its own xxh3_64, checked against the xxhash package by the tests).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import cast

import xxhash

from kvgate.index import _native
from kvgate.index.types import BlockKey

_ROOT_DOMAIN = b"kvgate/block-keys/v1"
_hash = xxhash.xxh3_64_intdigest


def cache_seed(lora_name: str | None, cache_salt: str | None) -> int:
    """The root seed of a chain: requests that cannot share engine cache get different seeds."""
    parts = [_ROOT_DOMAIN, b"\x00lora\x00"]
    if lora_name is not None:
        parts.append(lora_name.encode())
    parts.append(b"\x00salt\x00")
    if cache_salt is not None:
        parts.append(cache_salt.encode())
    return _hash(b"".join(parts))


def pack_tokens(tokens: Sequence[int]) -> memoryview:
    """Token ids as little-endian uint32 bytes (ids outside uint32 raise ``OverflowError``)."""
    packed = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        packed = array("I", packed)
        packed.byteswap()
    return memoryview(packed).cast("B")


def block_keys(
    tokens: Sequence[int],
    block_size: int,
    seed: int,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of ``tokens`` (a trailing partial block gets none).

    ``parent`` is the key of the block before ``tokens[0]``; without it the chain starts at
    ``seed``. The seed only matters at the root: every later key inherits it through the chain.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(tokens) - len(tokens) % block_size
    if full == 0:
        return []
    data = pack_tokens(tokens if full == len(tokens) else tokens[:full])
    prev = seed if parent is None else int(parent)
    return cast("list[BlockKey]", _native.chain_keys(data, block_size, prev))


def shared_prefix_blocks(a: Sequence[BlockKey], b: Sequence[BlockKey]) -> int:
    """How many leading blocks two prompts' chained keys share, in O(log n) comparisons.

    A key covers its block and every block before it (the chain), so equal keys at one
    position mean equal prefixes up to there: the shared length is found by bisection."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def text_block_keys(text: str, chunk_chars: int, seed: int) -> list[BlockKey]:
    """Approximate mode: chained keys over fixed character chunks of rendered text."""
    if chunk_chars <= 0:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    data = memoryview(text.encode("utf-32-le"))
    step = chunk_chars * 4
    full = len(data) - len(data) % step
    prev = seed ^ 0xA5A5A5A5A5A5A5A5
    keys: list[BlockKey] = []
    for offset in range(0, full, step):
        prev = _hash(data[offset : offset + step], prev)
        keys.append(BlockKey(prev))
    return keys
