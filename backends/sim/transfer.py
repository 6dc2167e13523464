"""Prefill/decode disaggregation in the simulator: vLLM's ``kv_transfer_params`` protocol.

Every replica plays both parts (vLLM's ``kv_both``):

* asked ``kv_transfer_params: {"do_remote_decode": true}``, it prefills (the request's
  ``max_tokens`` is 1), keeps the prompt's whole blocks for a lease (``LEASE_S``) and
  answers with where they are, as vLLM's NixlConnector does: ``{"do_remote_prefill": true,
  "do_remote_decode": false, "remote_engine_id", "remote_block_ids": [[...]],
  "remote_host", "remote_port", "tp_size": 1}`` (the port: its HTTP port, where the decode
  replica pulls them: ``POST /sim/kv_transfer/pull``);
* given ``do_remote_prefill`` parameters, it pulls the blocks from that replica (a real
  HTTP request), waits the transfer time of their size (``TRANSFER_US_PER_TOKEN``, divided
  by the speed-up), then runs the request with those blocks loaded: stored in its cache,
  announced in KV events (``BlockStored``, as vLLM does for blocks it received) and
  reported as cached. A transfer it cannot find (unknown engine, lease gone, blocks of
  another prompt) is refused with an OpenAI-style 400, before anything runs.

SGLang's bootstrap protocol too: a request with ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room`` is the prefill leg when the bootstrap address is the replica's own (its
HTTP address: the simulator's bootstrap server), its blocks kept for that room; else the
decode leg, which pulls the room's blocks from that address, waiting for the prefill to end
(the two legs arrive together), at most ``ROOM_WAIT_S``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from kvgate.backends.sim.protocol import ApiError

LEASE_S = 30.0
"""How long a prefill replica keeps a prefill's blocks for its decode replica to pull."""
MAX_LEASES = 4096  # leases kept at most (the oldest goes first)
TRANSFER_US_PER_TOKEN = 1.0
"""Wall microseconds to move one token's KV between replicas (before the speed-up): an
8B model's 128 KiB a token over a 100 Gb/s link, rounded down."""
PULL_TIMEOUT_S = 10.0
ROOM_WAIT_S = 30.0
"""How long a bootstrap decode leg waits for its room's prefill."""
_ENCODE = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Lease:
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # the tokens of those blocks
    expires: float


class Leases:
    """A prefill replica's blocks kept for decode replicas, by their first block id."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.engine_id = str(uuid.uuid4())
        self._leases: OrderedDict[tuple[int, ...], Lease] = OrderedDict()
        self._rooms: OrderedDict[int, Lease] = OrderedDict()  # SGLang's bootstrap rooms
        self._waiting: dict[int, asyncio.Event] = {}  # decode legs waiting for a room
        self._clock = clock

    def keep_room(self, room: int, token_ids: Sequence[int]) -> None:
        """A bootstrap prefill's blocks, kept for the decode leg of ``room``."""
        self._rooms[room] = Lease((), tuple(token_ids), self._clock() + LEASE_S)
        while len(self._rooms) > MAX_LEASES:
            self._rooms.popitem(last=False)
        waiting = self._waiting.get(room)
        if waiting is not None:
            waiting.set()

    async def take_room(self, room: int, wait_s: float = ROOM_WAIT_S) -> Lease | None:
        """The lease of ``room``, waiting at most ``wait_s`` for its prefill to end."""
        if room not in self._rooms and room not in self._waiting:
            if len(self._waiting) >= MAX_LEASES:
                return None
            event = self._waiting[room] = asyncio.Event()
            try:
                async with asyncio.timeout(wait_s):
                    await event.wait()
            except TimeoutError:
                return None
            finally:
                self._waiting.pop(room, None)
        lease = self._rooms.pop(room, None)
        return lease if lease is not None and lease.expires > self._clock() else None

    def keep(self, block_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        self._expire()
        key = tuple(block_ids)
        self._leases[key] = Lease(key, tuple(token_ids), self._clock() + LEASE_S)
        while len(self._leases) > MAX_LEASES:
            self._leases.popitem(last=False)

    def take(self, engine_id: str, block_ids: Sequence[int]) -> Lease | None:
        """The lease of exactly ``block_ids`` on this engine, gone once taken."""
        self._expire()
        if engine_id != self.engine_id:
            return None
        return self._leases.pop(tuple(block_ids), None)

    def _expire(self) -> None:
        now = self._clock()
        while self._leases:
            key, lease = next(iter(self._leases.items()))
            if lease.expires > now:
                break
            del self._leases[key]


def bootstrap_of(data: dict[str, Any]) -> tuple[str, int, int] | None:
    """(host, port, room) of a request's SGLang bootstrap fields, or None; 400 when they
    are given but not all well-formed."""
    fields = (data.get("bootstrap_host"), data.get("bootstrap_port"), data.get("bootstrap_room"))
    if all(f is None for f in fields):
        return None
    host, port, room = fields
    if not isinstance(host, str) or type(port) is not int or type(room) is not int:
        raise ApiError(400, "bootstrap_host, bootstrap_port and bootstrap_room go together")
    return host, port, room


def transfer_mode(data: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(``"produce"`` | ``"consume"``, the parameters) of a request's ``kv_transfer_params``,
    or None (a whole request). 400 when they are not an object."""
    params = data.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
    if params.get("do_remote_decode") is True:
        return "produce", params
    if params.get("do_remote_prefill") is True:
        return "consume", params
    return None


def produced(leases: Leases, host: str, port: int, block_ids: Sequence[int]) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill replica answers with."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": leases.engine_id,
        "remote_block_ids": [list(block_ids)],
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


def with_params(body: bytes, params: dict[str, Any]) -> bytes:
    """A JSON object's bytes with ``kv_transfer_params`` added."""
    end = body.rindex(b"}")
    return body[:end] + b',"kv_transfer_params":' + _ENCODE.encode(params) + body[end:]


def _block_ids(params: dict[str, Any]) -> list[int]:
    ids = params.get("remote_block_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]  # one list per KV-cache group
    if not isinstance(ids, list) or not all(type(i) is int for i in ids) or len(ids) > 1 << 20:
        raise ApiError(400, "kv_transfer_params.remote_block_ids must be a list of block ids")
    return ids


async def pull(
    client: httpx.AsyncClient, params: dict[str, Any], prompt: Sequence[int], block_size: int
) -> int:
    """Pull a prefill's blocks for ``prompt`` from the replica ``params`` name: the prompt
    tokens they hold (whole blocks). ``ApiError`` 400 when the transfer cannot be found."""
    host, port, engine = (params.get(k) for k in ("remote_host", "remote_port", "remote_engine_id"))
    if not isinstance(host, str) or type(port) is not int or not isinstance(engine, str):
        raise ApiError(400, "kv_transfer_params: remote_host, remote_port, remote_engine_id needed")
    wanted = {"remote_engine_id": engine, "remote_block_ids": _block_ids(params)}
    return await _pull(client, (host, port), wanted, prompt, block_size, timeout_s=PULL_TIMEOUT_S)


async def pull_room(
    client: httpx.AsyncClient, bootstrap: tuple[str, int, int], prompt: Sequence[int], bs: int
) -> int:
    """A bootstrap decode leg: the room's blocks from its prefill replica (``pull``)."""
    host, port, room = bootstrap
    wanted = {"bootstrap_room": room}
    timeout_s = ROOM_WAIT_S + PULL_TIMEOUT_S
    return await _pull(client, (host, port), wanted, prompt, bs, timeout_s=timeout_s)


async def _pull(
    client: httpx.AsyncClient,
    address: tuple[str, int],
    wanted: dict[str, Any],
    prompt: Sequence[int],
    block_size: int,
    *,
    timeout_s: float,
) -> int:
    host, port = address
    shown = f"[{host}]" if ":" in host else host
    try:
        answer = await client.post(
            f"http://{shown}:{port}/sim/kv_transfer/pull", json=wanted, timeout=timeout_s
        )
    except httpx.HTTPError as exc:
        raise ApiError(
            400, f"KV transfer failed: the prefill engine is unreachable ({exc})"
        ) from exc
    if answer.status_code != 200:
        raise ApiError(400, "KV transfer failed: the prefill engine does not hold these blocks")
    try:
        tokens = msgspec.json.decode(answer.content).get("token_ids")
    except (msgspec.DecodeError, AttributeError) as exc:
        raise ApiError(400, "KV transfer failed: unreadable answer") from exc
    if not isinstance(tokens, list) or tokens != list(prompt[: len(tokens)]):
        raise ApiError(400, "KV transfer failed: the blocks hold another prompt")
    return len(tokens) - len(tokens) % block_size
