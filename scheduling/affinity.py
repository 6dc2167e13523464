"""Which worker produced which stored response (the Responses API's ``previous_response_id``).

An engine keeps a response's conversation in its own store: the next turn that names it must
go to the same engine. kvgate reads the response id from the answer as it passes (the JSON
body, or the first SSE event of a stream: ``response.created`` carries the response object)
and remembers it in a map bounded by count (least recently recorded first out) and by age.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from index.types import WorkerId

_MAX_ID_CHARS = 256  # longer "ids" are not remembered
_MAX_SCAN_BYTES = 64 * 1024  # of a stream's start, looked at for the id
_EVENT_END = b"\n\n"
_decode = msgspec.json.Decoder().decode


class ResponseAffinity:
    """response id → worker, at most ``max_ids`` of them, each for ``ttl_s``."""

    def __init__(
        self, max_ids: int, ttl_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_ids = max_ids
        self._ttl_s = ttl_s
        self._clock = clock
        self._ids: OrderedDict[str, tuple[WorkerId, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def record(self, response_id: str, worker: WorkerId) -> None:
        if not response_id or len(response_id) > _MAX_ID_CHARS:
            return
        now = self._clock()
        self._ids[response_id] = (worker, now + self._ttl_s)
        self._ids.move_to_end(response_id)
        while self._ids and (
            len(self._ids) > self._max_ids or next(iter(self._ids.values()))[1] <= now
        ):
            self._ids.popitem(last=False)

    def worker_of(self, response_id: str) -> WorkerId | None:
        """The worker that produced ``response_id`` (None: unknown, or remembered too long)."""
        entry = self._ids.get(response_id)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._ids[response_id]
            return None
        return entry[0]

    def tap(self) -> ResponseIdTap:
        return ResponseIdTap(self)


class ResponseIdTap:
    """Watches one answer for its response id (``feed`` each chunk; True: done watching)."""

    __slots__ = ("_affinity", "_seen")

    def __init__(self, affinity: ResponseAffinity) -> None:
        self._affinity = affinity
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
            self._affinity.record(response_id, worker)


def _parse(data: bytes) -> Any:
    try:
        return _decode(data)
    except msgspec.DecodeError:
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
