"""Rendezvous (highest-random-weight) hashing of a session key over workers.

Deterministic across processes and restarts: xxh3_64 of fixed bytes, never Python's ``hash``.
"""

from __future__ import annotations

import xxhash

from kvgate.index.types import WorkerId
from kvgate.scoring.api import RouteRequest


def session_hash_key(request: RouteRequest) -> bytes:
    """The key that keeps one conversation on one worker when costs tie.

    The session key (``x-session-id`` header, else ``user``), else the first block key, else
    the model. The kind prefix keeps, say, session "7" apart from block key 7.
    """
    if request.session_key:
        return b"session\x00" + request.session_key.encode()
    if request.block_keys:
        return b"block\x00" + str(int(request.block_keys[0])).encode()
    return b"model\x00" + request.model.encode()


def rendezvous_weight(key: bytes, worker: WorkerId) -> int:
    """The worker's weight for ``key``; the highest weight wins the tie."""
    return xxhash.xxh3_64_intdigest(key + b"\x00" + worker.encode())
