"""What a hostile KV-event publisher can send (issue 12): for bench/storm.py and the tests.

* ``forge_block``: 16 token ids whose kvgate block key is any chosen value, under any parent.
  kvgate's key is ``xxh3_64(16 uint32 ids, seed=parent key)``; on a 64-byte input XXH3 is
  ``avalanche(64 * P1 + mix(b0) + mix(b1) + mix(b2) + mix(b3))`` over four 16-byte pieces,
  where ``mix(lo, hi) = fold(lo ^ (s + seed), hi ^ (s' - seed))`` multiplies its two
  operands. Choosing ``hi`` to make the second operand 1 makes ``mix`` equal to its first
  operand, 0 makes it 0, and the avalanche is invertible. So a publisher can make a block its
  own parent, or give its blocks the keys of another tenant's prompt under other parents.
* ``colliding_engine_hashes``: engine hashes that share one home cell of an unkeyed map.
* ``Attacker``: random hostile payloads of every kind (valid ones of both encodings, byte
  mutations, forged chains, long chains removed root first, keys repeated in an event, deep
  nesting, huge and many ranks, events past the block bound, floods of colliding hashes).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import xxhash

BLOCK = 16  # token ids per block: 64 bytes
_MASK = (1 << 64) - 1
_P64_1 = 0x9E3779B185EBCA87
_PMX = 0x165667919E3779F9  # the avalanche multiplier of XXH3's 17..128-byte path
# XXH3's default secret, bytes 0..63 (the 64-byte input reads its first 64 bytes)
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
)


def _unavalanche(h: int) -> int:
    h ^= h >> 32  # xorshifts by 32 or more are their own inverse
    h = h * pow(_PMX, -1, 1 << 64) & _MASK
    return h ^ (h >> 37)


def _secret(offset: int) -> int:
    value: int = struct.unpack_from("<Q", _SECRET, offset)[0]
    return value


def forge_block(target: int, parent: int) -> list[int]:
    """16 token ids (uint32) whose key, chained after ``parent``, is ``target``."""
    acc = (_unavalanche(target) - 64 * _P64_1) & _MASK
    words: list[int] = []
    # the pieces at input offsets 0, 16, 32, 48 use secret offsets 0, 32, 48, 16
    for piece, offset in enumerate((0, 32, 48, 16)):
        lo = (acc if piece == 0 else 0) ^ ((_secret(offset) + parent) & _MASK)
        hi = (1 if piece == 0 else 0) ^ ((_secret(offset + 8) - parent) & _MASK)
        words += [lo, hi]
    ids = list(struct.unpack("<16I", struct.pack("<8Q", *words)))
    if xxhash.xxh3_64_intdigest(struct.pack("<16I", *ids), parent) != target:
        raise AssertionError("forge_block no longer matches xxh3")  # pragma: no cover
    return ids


def colliding_engine_hashes(count: int) -> list[int]:
    """Engine hashes that all land in the same cell of an unkeyed map mixing keys with
    ``x ^= x >> 33; x *= C; x ^= x >> 33`` (inverted for outputs whose low 32 bits are 0)."""
    inverse = pow(0xFF51AFD7ED558CCD, -1, 1 << 64)
    out = []
    for i in range(1, count + 1):
        x = i << 32
        x ^= x >> 33
        x = x * inverse & _MASK
        out.append(x ^ (x >> 33))
    return out


# ------------------------------------------------------------------ wire helpers
def stored(hashes: list[Any], parent: Any, tokens: Any, block: int = BLOCK) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block,
        "lora_id": None,
        "medium": "GPU",
    }


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


_ARRAY_FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"],
    "BlockRemoved": ["block_hashes"],
}


def payload(events: Sequence[dict[str, Any]], rank: Any = 0, array_tagged: bool = False) -> bytes:
    """A batch as vLLM sends it (events as maps), or with events as arrays (older vLLM)."""
    body: list[Any] = list(events)
    if array_tagged:
        fields = {k: [*v, "medium"] for k, v in _ARRAY_FIELDS.items()}
        body = [[e["type"], *(e[f] for f in fields.get(e["type"], []))] for e in events]
    return msgspec.msgpack.encode([1.0, body, rank])


def raw_map(pairs: Sequence[tuple[str, bytes]]) -> bytes:
    """A msgpack map of already-encoded values, in this order (a key may come twice)."""
    count = len(pairs)
    head = bytes([0x80 | count]) if count < 16 else bytes([0xDE, 0, count])
    return head + b"".join(msgspec.msgpack.encode(k) + v for k, v in pairs)


def one_event_batch(event: bytes) -> bytes:
    """``[ts, [event], 0]`` around one event already encoded."""
    return b"\x93" + msgspec.msgpack.encode(1.0) + b"\x91" + event + b"\x00"


def engine_hash(tokens: Sequence[int], end: int, salt: bytes, block: int = BLOCK) -> int:
    """An engine's opaque hash of the prefix ending at block ``end``."""
    return xxhash.xxh3_64_intdigest(
        salt + struct.pack(f"<{(end + 1) * block}I", *tokens[: (end + 1) * block])
    )


# ------------------------------------------------------------------ the attacker
class Attacker:
    """Everything a hostile publisher may send, drawn at random. It knows ``paths`` (token
    ids of prompts, 64 blocks each or more) and their kvgate keys ``keys``, so it can forge
    blocks carrying them under other parents."""

    def __init__(
        self,
        paths: Sequence[Sequence[int]],
        keys: Sequence[Sequence[int]],
        rng: random.Random,
        *,
        root_seed: int,
        max_event_blocks: int,
    ) -> None:
        self.paths, self.keys, self.rng = paths, keys, rng
        self.root_seed = root_seed
        self.max_event_blocks = max_event_blocks
        self.stored: list[tuple[int, int]] = []  # (engine hash, key) it sent in stores
        self.floods = colliding_engine_hashes(20_000)
        self._over_bound: bytes | None = None
        self.kinds: list[tuple[Callable[[], bytes], int]] = [
            (self.valid_store, 8),
            (self.valid_remove, 5),
            (self.root_first, 2),
            (self.self_parent, 3),
            (self.other_keys, 4),
            (self.repeated_key, 2),
            (self.deep, 1),
            (self.ranks, 2),
            (self.over_bound, 1),
            (self.flood, 1),
            (self.clear, 1),
            (self.mutated, 6),
        ]

    def next(self) -> tuple[str, bytes]:
        """A payload of a random kind, and the kind."""
        make = self.rng.choices([k for k, _ in self.kinds], [w for _, w in self.kinds])[0]
        return make.__name__, make()

    def _blocks(self, path: int) -> int:
        return len(self.keys[path])

    def _hash(self, path: int, block: int) -> int:
        return engine_hash(self.paths[path], block, b"attacker")

    def _wire(self, value: int) -> Any:
        form = self.rng.choice(["int", "int", "bytes", "signed"])
        if form == "bytes":
            return bytes(24) + value.to_bytes(8, "big")
        return value - 2**64 if form == "signed" and value >= 2**63 else value

    def _remember(self, engine_hash: int, key: int) -> None:
        self.stored.append((engine_hash, key))
        del self.stored[:-1000]

    def valid_store(self) -> bytes:
        rng = self.rng
        path = rng.randrange(len(self.paths))
        blocks = self._blocks(path)
        start = rng.choice([0, 0, rng.randrange(blocks)])
        end = min(blocks, start + rng.choice([1, 2, 8, 40]))
        tokens = self.paths[path]
        parent = self._wire(self._hash(path, start - 1)) if start else None
        hashes = [self._hash(path, b) for b in range(start, end)]
        for b, h in zip(range(start, end), hashes, strict=True):
            self._remember(h, self.keys[path][b])
        wire = [self._wire(h) for h in hashes]
        event = stored(wire, parent, list(tokens[start * BLOCK : end * BLOCK]))
        return payload([event], array_tagged=rng.random() < 0.3)

    def valid_remove(self) -> bytes:
        rng = self.rng
        events = []
        for _ in range(rng.randrange(1, 8)):
            path = rng.randrange(len(self.paths))
            block = rng.randrange(self._blocks(path))
            events.append(removed([self._wire(self._hash(path, block))]))
        return payload(events, array_tagged=rng.random() < 0.3)

    def root_first(self) -> bytes:
        """A whole chain stored, then removed root first, one block per event."""
        path = self.rng.randrange(len(self.paths))
        blocks = min(self._blocks(path), self.max_event_blocks)
        hashes = [self._hash(path, b) for b in range(blocks)]
        tokens = list(self.paths[path][: blocks * BLOCK])
        return payload([stored(hashes, None, tokens), *(removed([h]) for h in hashes)])

    def self_parent(self) -> bytes:
        """A block whose ids are forged so that its key is its parent's: A under A."""
        if not self.stored:
            return self.valid_store()
        rng = self.rng
        parent_hash, key = rng.choice(self.stored)
        new, child = rng.getrandbits(64), rng.getrandbits(64)
        self._remember(new, key)
        events = [
            stored([new], parent_hash, forge_block(key, key)),
            stored([child], new, list(self.paths[0][:BLOCK])),
            removed([parent_hash]),
            removed([new]),
        ]
        return payload(events[: rng.randrange(1, 5)])

    def other_keys(self) -> bytes:
        """A chain forged to carry the keys of known prompts in another order, under other
        parents."""
        rng = self.rng
        targets = []
        for _ in range(4):
            path = rng.randrange(len(self.paths))
            targets.append(self.keys[path][rng.randrange(self._blocks(path))])
        parent_hash, prev = None, self.root_seed
        if self.stored and rng.random() < 0.5:
            parent_hash, prev = rng.choice(self.stored)
        hashes, tokens = [], []
        for target in targets:
            tokens += forge_block(target, prev)
            prev = target
            hashes.append(rng.getrandbits(64))
            self._remember(hashes[-1], target)
        events = [stored(hashes, parent_hash, tokens)]
        if rng.random() < 0.5:
            events.append(removed(rng.sample(hashes, 2)))
        return payload(events)

    def repeated_key(self) -> bytes:
        path = self.rng.randrange(len(self.paths))
        event = stored([self._hash(path, 0)], None, list(self.paths[path][:BLOCK]))
        pairs = [(k, msgspec.msgpack.encode(v)) for k, v in event.items()]
        pairs.append(self.rng.choice(pairs))
        return one_event_batch(raw_map(pairs))

    def deep(self) -> bytes:
        event = stored([self.rng.getrandbits(64)], None, list(self.paths[1][:BLOCK]))
        pairs = [(k, msgspec.msgpack.encode(v)) for k, v in event.items()]
        depth = self.rng.choice([33, 200, 5000])
        pairs.append(("extra_keys", b"\x91" * depth + b"\xc0"))
        return one_event_batch(raw_map(pairs))

    def ranks(self) -> bytes:
        rank = self.rng.choice([1, 2, 3, 5, 7, 2**31, 2**40, 2**63 - 1])
        tokens = list(self.paths[2][:BLOCK])
        return payload([stored([self._hash(2, 0)], None, tokens)], rank=rank)

    def over_bound(self) -> bytes:
        """One event of one block more than the bound (built once: it may be large)."""
        if self._over_bound is None:
            blocks = self.max_event_blocks + 1
            hashes = [self.rng.getrandbits(64) for _ in range(blocks)]
            tokens = [self.rng.randrange(50_000) for _ in range(blocks * BLOCK)]
            self._over_bound = payload([stored(hashes, None, tokens)])
        return self._over_bound

    def flood(self) -> bytes:
        """Engine hashes colliding in an unkeyed map (kvgate's native maps are keyed)."""
        size = min(250, self.max_event_blocks)
        start = self.rng.randrange(0, len(self.floods) - size)
        hashes = self.floods[start : start + size]
        tokens = [start] * BLOCK + [0] * ((len(hashes) - 1) * BLOCK)
        return payload([stored(hashes, None, tokens)])

    def clear(self) -> bytes:
        return payload([{"type": "AllBlocksCleared"}])

    def mutated(self) -> bytes:
        """A payload of another kind with bytes flipped, cut, repeated or spliced in."""
        rng = self.rng
        make = rng.choice([self.valid_store, self.valid_remove, self.self_parent, self.ranks])
        data = bytearray(make())
        for _ in range(rng.randrange(1, 4)):
            op, at = rng.randrange(4), rng.randrange(len(data))
            if op == 0:
                data[at] = rng.randrange(256)
            elif op == 1:
                del data[at:]
            elif op == 2:
                data[at:at] = data[at : at + rng.randrange(1, 32)]
            else:
                data[at:at] = bytes([rng.choice([0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0x9F, 0xFF, 0])])
            if not data:
                data = bytearray(b"\x90")
        return bytes(data)
