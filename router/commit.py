"""The commit point: when an answer may go to the client, and why an attempt failed before.

``StreamStart`` decides when a streamed answer may be committed: at its first event with
content. ``Reason`` names why an attempt failed before the commit (retried elsewhere) or a
committed stream was cut; ``AttemptFailed`` carries such a failure to the attempt loop
(``router.proxy``).

vLLM (and the simulator's default) opens a streaming response with ``200`` and the SSE
headers as soon as it accepts a request, then queues and prefills it. kvgate holds that
response back (nothing is sent to the client, not even the status) until the engine has
produced something a client can use, so that an engine failing before then costs a retry on
another worker instead of a ``200`` stream holding only an error.

``StreamStart`` reads the held bytes event by event. An event is:

* **not content**, and held: an SSE comment, ``retry:`` or ``id:`` alone, a blank event; a
  chat or text chunk whose choices carry nothing but an index, a role and an empty text (the
  role chunk); a chunk with ``choices: []`` and no usage; the Responses API's
  ``response.created``, ``response.in_progress`` and ``response.queued`` events;
* **a failure** (the attempt failed before any token: retried elsewhere): an error event
  (``data: {"error": ...}``, vLLM's older ``{"object": "error", ...}``, the Responses API's
  ``event: error`` / ``{"type": "error"}`` and ``response.failed``), and JSON nested deeper
  than any answer is (``index.jsonsafe.MAX_JSON_DEPTH``): a broken worker's;
* **content**, and the response is committed: anything else: a token, a tool-call or
  reasoning delta, a finish reason, a usage chunk, ``[DONE]`` (an empty answer is an answer),
  and whatever else kvgate does not recognise (it is relayed, never held or dropped).

The held bytes are bounded (``limit``): past it the response is committed as it stands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

import httpx

from kvgate.index.errors import JsonDecodeError
from kvgate.index.jsonsafe import decode_json
from kvgate.router.errors import KvgateError
from kvgate.router.upstream import ResponseHeadTooLarge

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_END = re.compile(rb"\r\n|\n|\r")
_DONE = b"[DONE]"
_NOT_YET = frozenset({"response.created", "response.in_progress", "response.queued"})
_FAILED = frozenset({"error", "response.failed"})
_EMPTY_KEYS = frozenset({"index", "role"})
_MAX_MESSAGE = 200


class Verdict(Enum):
    WAIT = "wait"  # nothing a client can use yet: keep holding
    COMMIT = "commit"  # content arrived (or the hold is full): send everything held
    FAILED = "failed"  # an error event before any content: the attempt failed


@dataclass(frozen=True, slots=True)
class _Event:
    name: str | None
    data: bytes | None  # the data lines joined by "\n"; None: no data line


def _parse_event(raw: bytes) -> _Event:
    name: str | None = None
    data: list[bytes] = []
    for line in _LINE_END.split(raw):
        if not line or line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        value = value.removeprefix(b" ")
        if field == b"event":
            name = value.decode("utf-8", "replace")
        elif field == b"data":
            data.append(value)
    return _Event(name, b"\n".join(data) if data else None)


def _blank(value: Any) -> bool:
    return value is None or value in ("", [], {})


def _empty_choice(choice: Any) -> bool:
    """A choice with nothing but its index, a role and empty values (the role chunk)."""
    if not isinstance(choice, dict):
        return False
    for key, value in choice.items():
        if key in _EMPTY_KEYS:
            continue
        if key in ("delta", "message") and isinstance(value, dict):
            if not all(k in _EMPTY_KEYS or _blank(v) for k, v in value.items()):
                return False
        elif not _blank(value):
            return False
    return True


def classify(event: _Event) -> Verdict:
    """What one complete SSE event means for the commit."""
    if event.name in _FAILED:
        return Verdict.FAILED
    if event.name in _NOT_YET or event.data is None or not event.data.strip():
        return Verdict.WAIT
    if event.data.strip() == _DONE:
        return Verdict.COMMIT
    try:
        obj = decode_json(event.data)
    except JsonDecodeError as exc:
        # nested past any answer's depth: a broken answer (the attempt fails); other
        # non-JSON data is nothing kvgate understands, so it is relayed
        return Verdict.FAILED if exc.too_deep else Verdict.COMMIT
    if not isinstance(obj, dict):
        return Verdict.COMMIT
    return _classify_object(obj)


def _classify_object(obj: dict[str, Any]) -> Verdict:
    kind = obj.get("type")
    if (obj.get("error") is not None and "choices" not in obj) or obj.get("object") == "error":
        return Verdict.FAILED
    if kind in _FAILED:
        return Verdict.FAILED
    if kind in _NOT_YET:
        return Verdict.WAIT
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return Verdict.COMMIT
    if not choices:
        return Verdict.WAIT if _blank(obj.get("usage")) else Verdict.COMMIT
    if all(_empty_choice(c) for c in choices):
        return Verdict.WAIT
    return Verdict.COMMIT


def _error_message(event: _Event) -> str:
    """The message of an error event, for logs and the worker's ``last_error`` (short)."""
    try:
        obj = decode_json(event.data or b"")
    except JsonDecodeError as exc:
        return str(exc) if exc.too_deep else "error event"
    message: Any = None
    if isinstance(obj, dict):
        inner = obj.get("error")
        message = inner.get("message") if isinstance(inner, dict) else obj.get("message")
    text = message if isinstance(message, str) and message else "error event"
    return text[:_MAX_MESSAGE]


class StreamStart:
    """Holds an SSE stream's first bytes until its first content event (``feed``)."""

    __slots__ = ("_pending", "failure", "held", "held_bytes", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.failure: str | None = None  # the error event's message, once FAILED
        self.held: list[bytes] = []  # the chunks as received, to send on commit
        self.held_bytes = 0
        self._pending = bytearray()  # the start of an event not complete yet

    def feed(self, chunk: bytes) -> Verdict:
        self.held.append(chunk)
        self.held_bytes += len(chunk)
        pending = self._pending
        # an event end may straddle the old and new bytes (at most 3 bytes back)
        scan_from = max(0, len(pending) - 3)
        pending += chunk
        start = 0
        for end in _EVENT_END.finditer(pending, scan_from):
            event = _parse_event(bytes(pending[start : end.start()]))
            verdict = classify(event)
            start = end.end()
            if verdict is Verdict.FAILED:
                self.failure = _error_message(event)
            if verdict is not Verdict.WAIT:
                return verdict
        del pending[:start]
        return Verdict.COMMIT if self.held_bytes > self.limit else Verdict.WAIT

    def take(self) -> list[bytes]:
        """The held chunks (the hold is emptied)."""
        held, self.held, self.held_bytes = self.held, [], 0
        self._pending.clear()
        return held


def error_events(chunk: bytes) -> bool:
    """Whether a relayed chunk holds an error event (checked after the commit, per chunk:
    a byte search first, events parsed only when it hits)."""
    if b"error" not in chunk:
        return False
    return any(
        classify(_parse_event(raw)) is Verdict.FAILED
        for raw in _EVENT_END.split(chunk)
        if b"error" in raw
    )


class Reason:
    """Why an attempt failed (``kvgate_upstream_retries_total{reason}``) or a committed
    stream was cut (``kvgate_stream_errors_total{reason}``)."""

    REFUSED = "refused"  # cannot connect (refused, unreachable): the worker is down at once
    CONNECT_TIMEOUT = "connect_timeout"  # may be a starved box: towards the threshold
    RESET = "reset"  # the connection broke or closed early: the worker is down at once
    TIMEOUT = "timeout"  # no answer, or no next chunk, within upstream.read_timeout_s
    HTTP_5XX = "http_5xx"  # the engine answered a server error
    ERROR_EVENT = "error_event"  # the engine's stream carried an error before any token
    BAD_ANSWER = "bad_answer"  # a whole answer nested deeper than kvgate reads JSON
    ENGINE_ERROR = "engine_error"  # ... after tokens (relayed as the engine sent it)
    DEADLINE = "deadline"  # upstream.response_timeout_s passed
    TOO_LARGE = "too_large"  # a non-streamed answer over upstream.max_response_bytes
    HEAD_TOO_LARGE = "head_too_large"  # a response head (or trailer) past its bounds


RETRY_REASONS = (
    Reason.REFUSED,
    Reason.CONNECT_TIMEOUT,
    Reason.RESET,
    Reason.TIMEOUT,
    Reason.HTTP_5XX,
    Reason.ERROR_EVENT,
    Reason.HEAD_TOO_LARGE,
    Reason.BAD_ANSWER,
)
"""The reasons an attempt is retried for (``kvgate_upstream_retries_total{reason}``)."""
STREAM_ERROR_REASONS = (Reason.RESET, Reason.TIMEOUT, Reason.DEADLINE, Reason.ENGINE_ERROR)
"""The reasons a committed stream ends in an error (``kvgate_stream_errors_total{reason}``)."""


def failure_reason(exc: httpx.HTTPError) -> str:
    """The ``Reason`` of a transport failure talking to an engine."""
    if isinstance(exc, ResponseHeadTooLarge):
        return Reason.HEAD_TOO_LARGE
    if isinstance(exc, httpx.ConnectTimeout):
        return Reason.CONNECT_TIMEOUT
    if isinstance(exc, httpx.ConnectError):
        return Reason.REFUSED
    if isinstance(exc, httpx.TimeoutException):
        return Reason.TIMEOUT
    return Reason.RESET


FOLLOWS_REQUEST = frozenset({Reason.HTTP_5XX, Reason.ERROR_EVENT})
"""Failures a request can cause on any engine (a prompt that makes engines answer 500):
their health failure is charged to the worker only once another worker answered the same
request, and two workers failing alike end the failover (``router.proxy``)."""


class AttemptFailed(Exception):
    """One attempt failed before the commit point; ``error`` is what the client gets if no
    other attempt succeeds. ``charge``: the health failure not charged yet (a reason in
    ``FOLLOWS_REQUEST``), for the worker's ``last_error``."""

    def __init__(self, error: KvgateError, reason: str, *, charge: str | None = None) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason
        self.charge = charge
