"""Engine-reported usage: prompt, cached (``prompt_tokens_details``) and completion tokens
(the Responses API's ``input_tokens``, ``input_tokens_details.cached_tokens`` and
``output_tokens`` alike).

Answers are decoded by ``index.jsonsafe`` (depth-safe: an engine's deep JSON is no usage,
never an error); a non-streaming body's ``usage`` is converted into a tiny struct.
Streams pass through ``SseUsageTap``, which frames SSE events at C speed and decodes only
the event(s) whose bytes contain ``"usage"``; when kvgate itself asked for usage
(``hide=True``), that event is removed before the client sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvgate.index.errors import JsonDecodeError
from kvgate.index.jsonsafe import decode_json, decode_json_as

_USAGE = b'"usage"'
_EVENT_END = b"\n\n"
_MAX_PENDING = 1 << 20  # an SSE event larger than this is not inspected


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None
    input_tokens: int | None = None  # the Responses API's names
    input_tokens_details: _Details | None = None
    output_tokens: int | None = None


class _Body(msgspec.Struct):
    usage: _Usage | None = None


_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None
    cached_tokens: int | None  # None: the engine does not report prompt_tokens_details
    completion_tokens: int | None = None


def _from_struct(usage: _Usage | None) -> Usage | None:
    if usage is None:
        return None
    prompt, details, completion = (
        usage.prompt_tokens,
        usage.prompt_tokens_details,
        usage.completion_tokens,
    )
    if prompt is None and details is None:
        prompt, details = usage.input_tokens, usage.input_tokens_details
        completion = usage.output_tokens
    return Usage(prompt, details.cached_tokens if details is not None else None, completion)


def _from_mapping(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" not in usage and "input_tokens" in usage:  # the Responses API
        usage = {
            "prompt_tokens": usage.get("input_tokens"),
            "prompt_tokens_details": usage.get("input_tokens_details"),
            "completion_tokens": usage.get("output_tokens"),
        }
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        _int_or_none(usage.get("prompt_tokens")),
        _int_or_none(cached),
        _int_or_none(usage.get("completion_tokens")),
    )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_from_body(body: bytes) -> Usage | None:
    """The ``usage`` of a non-streaming JSON response, if any; ``JsonDecodeError`` when the
    body nests deeper than ``index.jsonsafe.MAX_JSON_DEPTH`` (a broken answer)."""
    if _USAGE not in body:
        return None
    try:
        return _from_struct(decode_json_as(body, _Body).usage)
    except JsonDecodeError as exc:
        if exc.too_deep:
            raise
        return None


class SseUsageTap:
    """Watch an SSE byte stream for the usage event; optionally hide it.

    ``feed`` returns the bytes to forward now. Without ``hide`` every byte is forwarded
    unchanged and at once; with ``hide`` a partial trailing event is held until complete
    (engines send whole events per chunk, so in practice nothing waits).
    """

    __slots__ = ("_hide", "_overflow", "_pending", "usage")

    def __init__(self, *, hide: bool) -> None:
        self._hide = hide
        self._pending = b""
        self._overflow = False
        self.usage: Usage | None = None

    def feed(self, chunk: bytes) -> bytes:
        if self._overflow:
            return chunk
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(_EVENT_END)
        if cut < 0:
            return self._hold(data, chunk)
        complete, self._pending = data[: cut + 2], data[cut + 2 :]
        if _USAGE in complete:
            complete = self._scan(complete)
        if not self._hide:
            return chunk
        return complete

    def flush(self) -> bytes:
        """End of stream: whatever is still held (an unterminated last event)."""
        rest, self._pending = self._pending, b""
        return rest if self._hide else b""

    def _hold(self, data: bytes, chunk: bytes) -> bytes:
        if len(data) > _MAX_PENDING:  # not SSE as we know it: stop inspecting
            self._overflow = True
            self._pending = b""
            return data if self._hide else chunk
        self._pending = data
        return b"" if self._hide else chunk

    def _scan(self, complete: bytes) -> bytes:
        """Record usage from the events that mention it; drop or strip them when hiding."""
        out: list[bytes] = []
        for event in complete.split(_EVENT_END)[:-1]:
            kept = self._usage_event(event) if _USAGE in event else event
            if kept:
                out.append(kept + _EVENT_END)
        return b"".join(out)

    def _usage_event(self, event: bytes) -> bytes:
        prefix, sep, payload = event.partition(b"data:")
        if not sep:
            return event
        try:
            obj = decode_json(payload)
        except JsonDecodeError:
            return event
        if not isinstance(obj, dict):
            return event
        if obj.get("usage") is None:  # a Responses API event carries its response object
            inner = obj.get("response")
            if isinstance(inner, dict) and inner.get("usage") is not None:
                self.usage = _from_mapping(inner["usage"]) or self.usage
            return event
        self.usage = _from_mapping(obj["usage"]) or self.usage
        if not self._hide:
            return event
        if obj.get("choices"):  # usage rode on a content chunk: keep the content
            del obj["usage"]
            return prefix + b"data: " + _encode(obj)
        return b""
