"""Which worker produced which stored response (the Responses API's ``previous_response_id``),
for which client.

An engine keeps a response's conversation in its own store: the next turn that names it must
go to the same engine. kvgate reads the response id from the answer as it passes (the JSON
body, or the first SSE event of a stream: ``response.created`` carries the response object)
and remembers it in a map bounded by count (least recently recorded first out) and by age.

Each id is bound to the client key (its id, ``accesslog.client_key_id``) whose request
produced it: ``worker_of`` answers only that key. An id already bound to one key is never
re-bound to another, and each key holds at most its share of the map (``max_ids`` over the
number of keys, rounded up): a key past its share loses its own oldest ids, never another
key's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, NewType

from kvgate.index.errors import JsonDecodeError
from kvgate.index.jsonsafe import decode_json
from kvgate.index.types import WorkerId

ClientKeyId = NewType("ClientKeyId", str)
"""A client key's public id (``accesslog.client_key_id``; "-" without client keys)."""

_MAX_ID_CHARS = 256  # longer "ids" are not remembered
_MAX_SCAN_BYTES = 64 * 1024  # of a stream's start, looked at for the id
_EVENT_END = b"\n\n"


class _Entry(NamedTuple):
    worker: WorkerId
    expires: float
    key: ClientKeyId


class ResponseAffinity:
    """response id → (worker, client key), at most ``max_ids`` of them (each of ``keys``
    client keys at most its share), each for ``ttl_s``."""

    def __init__(
        self,
        max_ids: int,
        ttl_s: float,
        *,
        keys: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_ids = max_ids
        self._per_key = max(1, -(-max_ids // max(keys, 1)))
        self._ttl_s = ttl_s
        self._clock = clock
        self._ids: OrderedDict[str, _Entry] = OrderedDict()
        self._by_key: dict[ClientKeyId, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def per_key(self) -> int:
        """The most ids one client key holds at once."""
        return self._per_key

    def record(self, response_id: str, worker: WorkerId, key: ClientKeyId) -> None:
        """``key``'s request produced ``response_id`` on ``worker`` (an id bound to another
        key stays that key's)."""
        if not response_id or len(response_id) > _MAX_ID_CHARS:
            return
        held = self._ids.get(response_id)
        if held is not None and held.key != key:
            return
        now = self._clock()
        self._drop(response_id)
        self._ids[response_id] = _Entry(worker, now + self._ttl_s, key)
        mine = self._by_key.setdefault(key, OrderedDict())
        mine[response_id] = None
        while len(mine) > self._per_key:
            self._drop(next(iter(mine)))
        while self._ids and (len(self._ids) > self._max_ids or self._oldest().expires <= now):
            self._drop(next(iter(self._ids)))

    def worker_of(self, response_id: str, key: ClientKeyId | None) -> WorkerId | None:
        """The worker that produced ``response_id`` for ``key`` (None: unknown, another
        key's, or remembered too long); ``key`` None: whoever's (the admin's view)."""
        entry = self._ids.get(response_id)
        if entry is None or (key is not None and entry.key != key):
            return None
        if entry.expires <= self._clock():
            self._drop(response_id)
            return None
        return entry.worker

    def tap(self, key: ClientKeyId) -> ResponseIdTap:
        """A tap recording the ids of one answer to ``key``'s request."""
        return ResponseIdTap(self, key)

    def _oldest(self) -> _Entry:
        return next(iter(self._ids.values()))

    def _drop(self, response_id: str) -> None:
        entry = self._ids.pop(response_id, None)
        if entry is None:
            return
        mine = self._by_key.get(entry.key)
        if mine is not None:
            mine.pop(response_id, None)
            if not mine:
                del self._by_key[entry.key]


class ResponseIdTap:
    """Watches one answer for its response id (``feed`` each chunk; True: done watching)."""

    __slots__ = ("_affinity", "_key", "_seen")

    def __init__(self, affinity: ResponseAffinity, key: ClientKeyId) -> None:
        self._affinity = affinity
        self._key = key
        self._seen = b""

    def feed(self, worker: WorkerId, chunk: bytes) -> bool:
        data = self._seen + chunk
        stripped = data.lstrip()
        if stripped.startswith(b"{"):  # a JSON body, whole
            self._found(worker, _id_of(_parse(stripped)))
            return True
        end = data.find(_EVENT_END)
        if end < 0:
            self._seen = data
            return len(data) > _MAX_SCAN_BYTES  # not the stream we know: stop looking
        for line in data[:end].splitlines():
            if line.startswith(b"data:"):
                self._found(worker, _id_of(_parse(line[5:])))
        return True

    def _found(self, worker: WorkerId, response_id: str | None) -> None:
        if response_id is not None:
            self._affinity.record(response_id, worker, self._key)


def _parse(data: bytes) -> Any:
    try:
        return decode_json(data)
    except JsonDecodeError:  # not JSON, or nested too deeply: no id to remember
        return None


def _id_of(obj: Any) -> str | None:
    """A response object's id, or that of the response an event carries."""
    if not isinstance(obj, dict):
        return None
    inner = obj.get("response")
    if isinstance(inner, dict):
        obj = inner
    response_id = obj.get("id")
    return response_id if isinstance(response_id, str) and obj.get("object") == "response" else None
