"""kvgate's log output, configured in one place: kvgate's loggers, uvicorn's and the access log.

``configure_logging(level, fmt)`` sends every record of the process to one stream (stdout)
in one format:

* ``text``: ``2026-01-02 03:04:05,678 INFO kvgate.gateway: message`` (the access log's
  fields follow its message as ``key=value`` pairs);
* ``json``: one JSON object per line, ``{"time", "level", "logger", "message"}`` plus the
  access log's fields at the top level, ``"exc"`` for a traceback;
* ``logfmt``: the same keys as ``key=value`` pairs on one line.

Records are formatted and written by a background thread fed through a bounded queue, so a
slow reader of stdout never blocks the event loop; the thread writes what is queued every
50 ms (one wake-up per batch, not per line). When the queue is full a record is dropped and
counted, and the writer reports the count once it catches up; a batch whose write fails is
lost (told on stderr), never the thread. uvicorn is run
with ``log_config=None`` (``router.serve.uvicorn_config``) so its loggers reach the same
handler.

A warning a client can make a library repeat at will (uvicorn's ``Invalid HTTP request
received.``, once per malformed request; OpenTelemetry's about a malformed ``traceparent`` or
``tracestate``, once per such request) is let through once per ``REPEAT_WINDOW_S`` per logger
and message (``RepeatLimit``); the next one let through says how many were held back. Errors,
and every other logger (kvgate's own included), are never held back.

One record is one line in every format: whatever ``str.splitlines()`` would split on (CR, LF,
VT, FF, the file/group/record separators, NEL U+0085, U+2028, U+2029) is escaped in the
message and the fields (``\\n``, ``\\u2028``, ...), so text a client sent (a model name, a
path) cannot forge a second line. The text format's traceback keeps its own line feeds.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import queue
import re
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from logging.handlers import QueueHandler
from typing import Any, Literal, TextIO

import msgspec

LogFormat = Literal["text", "json", "logfmt"]
FIELDS = "kvgate_fields"  # LogRecord attribute holding structured fields (the access log's)
_QUEUE_RECORDS = 10_000  # records waiting for the writer thread before new ones are dropped
_DRAIN_S = 0.05  # how often the writer thread writes what is queued
_CHATTY = ("httpx", "httpcore")  # one line per health probe otherwise
REPEAT_WINDOW_S = 10.0  # a repeatable warning of a server library: at most one line per window
# the loggers whose warnings a client can repeat at will (OpenTelemetry's: traceparent and
# tracestate parsing, opentelemetry.trace.propagation.tracecontext and opentelemetry.trace.span)
_REPEATABLE = ("uvicorn.error", "opentelemetry.trace")
REPEAT_KEYS = 256  # distinct (logger, message) pairs remembered
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_encode = msgspec.json.Encoder().encode
_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")  # str.splitlines()'s
_BREAKS_BUT_LF = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _ESCAPES.get(char) or f"\\u{ord(char):04x}"


def one_line(text: str, breaks: re.Pattern[str] = _BREAKS) -> str:
    """``text`` with every line break escaped (``\\n``, ``\\u2028``: JSON's escapes, valid
    inside a JSON string too)."""
    return text if breaks.search(text) is None else breaks.sub(_escape, text)


def record_fields(record: logging.LogRecord) -> dict[str, Any] | None:
    fields = getattr(record, FIELDS, None)
    return fields if isinstance(fields, dict) else None


def _iso_time(record: logging.LogRecord) -> str:
    stamp = datetime.fromtimestamp(record.created, UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _logfmt_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if text and not any(c in text for c in ' ="\\') and text.isprintable():
        return text
    return _encode(text).decode()  # quoted, with JSON escapes


def logfmt(pairs: dict[str, Any]) -> str:
    """``key=value`` pairs; values with spaces, quotes or ``=`` quoted; None left out."""
    return one_line(" ".join(f"{k}={_logfmt_value(v)}" for k, v in pairs.items() if v is not None))


def _line(formatter: logging.Formatter, record: logging.LogRecord) -> dict[str, Any]:
    """The keys of a structured line: time, level, logger, message, fields, ``exc``."""
    line: dict[str, Any] = {
        "time": _iso_time(record),
        "level": record.levelname.lower(),
        "logger": record.name,
        "message": record.getMessage(),
    }
    fields = record_fields(record)
    if fields is not None:
        line.update(fields)
    exc = _exception_text(formatter, record)
    if exc:
        line["exc"] = exc
    return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        return one_line(_encode(_line(self, record)).decode())  # NEL, U+2028/9 left raw


class LogfmtFormatter(logging.Formatter):
    """One ``key=value`` line per record."""

    def format(self, record: logging.LogRecord) -> str:
        return logfmt(_line(self, record))


class TextFormatter(logging.Formatter):
    """The classic line; structured fields follow the message as ``key=value`` pairs."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = one_line(super().formatMessage(record))
        fields = record_fields(record)
        return f"{line} {logfmt(fields)}" if fields else line

    def format(self, record: logging.LogRecord) -> str:
        """The line, then the traceback's own lines (only their line feeds kept)."""
        return one_line(super().format(record), _BREAKS_BUT_LF)


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    parts = [part for part in (record.exc_text, record.stack_info) if part]
    return "\n".join(parts)


def make_formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "logfmt":
        return LogfmtFormatter()
    return TextFormatter()


class RepeatLimit(logging.Filter):
    """Lets a warning (or lower) of a ``_REPEATABLE`` logger through once per ``window_s``
    per logger and message template; the next one let through says how many were held back.
    Remembers at most ``REPEAT_KEYS`` pairs (the oldest forgotten first)."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._window_s = window_s
        self._clock = clock
        self._seen: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()
        self._lock = threading.Lock()  # records are logged from any thread

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or not record.name.startswith(_REPEATABLE):
            return True
        key = (record.name, str(record.msg))
        now = self._clock()
        with self._lock:
            since, held = self._seen.get(key, (-math.inf, 0))
            if now - since < self._window_s:
                self._seen[key] = (since, held + 1)
                return False
            self._seen[key] = (now, 0)
            self._seen.move_to_end(key)
            while len(self._seen) > REPEAT_KEYS:
                self._seen.popitem(last=False)
        if held:
            record.msg = f"{record.getMessage()} ({held} more like it not logged since the last)"
            record.args = None
        return True


class _Enqueue(QueueHandler):
    """The loop-side handler: a cheap copy of the record into a bounded queue."""

    def __init__(self, records: queue.Queue[logging.LogRecord], formatter: logging.Formatter):
        super().__init__(records)
        self._formatter = formatter
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """Resolve what may change later (the message's arguments, the live exception);
        the formatting itself is left to the writer thread."""
        if not record.args and not record.exc_info:
            return record  # nothing to resolve (the access log's records)
        record = copy.copy(record)
        record.msg = record.getMessage()
        record.args = None
        if record.exc_info:
            record.exc_text = self._formatter.formatException(record.exc_info)
            record.exc_info = None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class _Writer(logging.StreamHandler):  # type: ignore[type-arg]
    """The writer thread's handler: one flush per batch; reports dropped records."""

    def __init__(self, stream: TextIO, source: _Enqueue) -> None:
        super().__init__(stream)
        self._source = source
        self._reported = 0

    def flush(self) -> None:
        """Not per record (``emit`` calls it): ``write_batch`` flushes once per batch."""

    def has_news(self) -> bool:
        """Records were dropped since the last report."""
        return self._source.dropped != self._reported

    def write_batch(self, records: list[logging.LogRecord]) -> None:
        dropped = self._source.dropped
        if dropped != self._reported:
            note = logging.LogRecord(
                "kvgate.logs", logging.WARNING, __file__, 0,
                f"{dropped - self._reported} log records dropped: the log output was too slow",
                None, None,
            )  # fmt: skip
            self._reported = dropped
            self.handle(note)
        for record in records:
            self.handle(record)  # a record that fails to format or write: handleError
        super().flush()


class _Drain(threading.Thread):
    """Writes what is queued every ``_DRAIN_S`` (a line waits at most that long; one wake-up
    per batch, not per line, keeps the writer's cost per line low), and at ``stop``."""

    def __init__(self, records: queue.Queue[logging.LogRecord], writer: _Writer) -> None:
        super().__init__(name="kvgate-log-writer", daemon=True)
        self._records = records
        self._writer = writer
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.wait(_DRAIN_S):
            self._drain_supervised()
        self._drain_supervised()

    def _drain_supervised(self) -> None:
        """A batch that fails (stdout closed or broken: ``flush`` raises) is lost and told
        on stderr; the thread goes on with the next one."""
        try:
            self._drain()
        except Exception:  # noqa: BLE001 - the writer's supervisor: one batch lost, not the thread
            with contextlib.suppress(OSError, ValueError):
                traceback.print_exc(file=sys.stderr)

    def _drain(self) -> None:
        batch: list[logging.LogRecord] = []
        with contextlib.suppress(queue.Empty):
            while True:
                batch.append(self._records.get_nowait())
        if batch or self._writer.has_news():
            self._writer.write_batch(batch)

    def stop(self) -> None:
        self._stopping.set()
        self.join()


class LogOutput:
    """The installed configuration; ``close()`` writes what is queued and restores the root
    logger's previous handlers and level."""

    def __init__(self, level: str, fmt: LogFormat, stream: TextIO, queue_size: int) -> None:
        root = logging.getLogger()
        self._saved = (root.handlers[:], root.level)
        formatter = make_formatter(fmt)
        records: queue.Queue[logging.LogRecord] = queue.Queue(queue_size)
        self.handler = _Enqueue(records, formatter)
        self.handler.addFilter(RepeatLimit())
        writer = _Writer(stream, self.handler)
        writer.setFormatter(formatter)
        self._thread = _Drain(records, writer)
        root.handlers = [self.handler]
        root.setLevel(level.upper())
        for name in _CHATTY:
            logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
        logging.captureWarnings(True)
        self._closed = False
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.stop()  # writes every queued record first
        root = logging.getLogger()
        root.handlers, level = self._saved
        root.setLevel(level)
        logging.captureWarnings(False)

    def __enter__(self) -> LogOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def configure_logging(
    level: str, fmt: LogFormat, stream: TextIO | None = None, *, queue_size: int = _QUEUE_RECORDS
) -> LogOutput:
    """Route every logger of the process to ``stream`` (stdout) in ``fmt`` at ``level``,
    through a queue of ``queue_size`` records."""
    return LogOutput(level, fmt, stream if stream is not None else sys.stdout, queue_size)
