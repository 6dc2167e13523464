"""The access log and the log formats.

In process: kvgate (real uvicorn) in front of fake engines with ``router.logs`` installed on
a string stream; each access line is parsed and checked field by field. As a subprocess:
``kvgate serve --log-format json`` (and ``logfmt``) writes nothing on stdout but lines of
that format, uvicorn's own included.
"""

from __future__ import annotations

import io
import json
import logging
import re
import shlex
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.engine import FakeEngine
from fakes.gateway import Kvgate, fleet, kvgate
from fakes.process import kvgate_process
from fakes.rawhttp import exchange
from fakes.server import serve
from fakes.wait import wait_until

from kvgate.router.accesslog import ACCESS_FIELDS, client_key_id
from kvgate.router.logs import (
    FIELDS,
    REPEAT_KEYS,
    LogOutput,
    RepeatLimit,
    configure_logging,
    logfmt,
    make_formatter,
)

pytestmark = pytest.mark.anyio

KEY = "sk-test-access-log-key-1"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "one two three"}]}


@contextmanager
def captured() -> Iterator[tuple[io.StringIO, LogOutput]]:
    stream = io.StringIO()
    output = configure_logging("info", "json", stream)
    try:
        yield stream, output
    finally:
        output.close()


def answered(gw: Kvgate) -> float:
    return sum(
        s.value
        for family in gw.metrics_registry.collect()
        if family.name == "kvgate_requests"
        for s in family.samples
        if s.name == "kvgate_requests_total"
    )


def access_lines(text: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in text.splitlines()]
    return [line for line in lines if line["logger"] == "kvgate.access"]


@asynccontextmanager
async def logged_kvgate(**overrides: Any) -> AsyncIterator[tuple[Kvgate, FakeEngine, io.StringIO]]:
    engine = FakeEngine("a", cached_tokens=2)
    with captured() as (stream, output):
        async with fleet(engine) as f, kvgate(f.urls, **overrides) as gw:
            yield gw, engine, stream
        output.close()  # every queued line written


async def test_one_line_per_request_field_by_field() -> None:
    async with logged_kvgate(api_keys=[KEY, "sk-another-key"]) as (gw, engine, stream):
        auth = {"authorization": f"Bearer {KEY}"}
        body = {**CHAT, "stream": True, "fake": {"tokens": 4}}
        streamed = await gw.client.post(
            "/v1/chat/completions",
            json=body,
            headers={
                **auth,
                "x-request-id": "req-stream",
                "traceparent": f"00-{TRACE}-00f067aa0ba902b7-01",
            },
        )
        plain = await gw.client.post("/v1/chat/completions", json=CHAT, headers=auth)
        refused = await gw.client.post("/v1/chat/completions", json=CHAT)  # no key
        unknown = await gw.client.post(
            "/v1/chat/completions", json={**CHAT, "model": "no-such-model"}, headers=auth
        )
        assert [r.status_code for r in (streamed, plain, refused, unknown)] == [200, 200, 401, 404]
        (sent,) = [s for s in engine.seen if s.headers.get("x-request-id") == "req-stream"]
        assert sent.headers["traceparent"] == f"00-{TRACE}-00f067aa0ba902b7-01"  # untouched
        await wait_until(lambda: answered(gw) >= 4, 10, "4 requests to end")
        worker = next(iter(gw.gateway.registry))
    text = stream.getvalue()
    assert KEY not in text  # the key is never written, only its id
    lines = access_lines(text)
    assert len(lines) == 4
    for line in lines:
        assert list(line)[:4] == ["time", "level", "logger", "message"]
        assert list(line)[4:] == list(ACCESS_FIELDS)
        assert (line["level"], line["message"]) == ("info", "request")
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    first, second, third, fourth = lines
    assert first == first | {
        "request_id": "req-stream",
        "trace_id": TRACE,  # tracing off: the client's trace id
        "client": client_key_id(KEY),
        "method": "POST",
        "path": "/v1/chat/completions",
        "model": "fake-model",
        "stream": True,
        "status": 200,
        "worker": worker.url,
        "policy": "round_robin",
        "attempts": 1,
        "failover": False,
        "prompt_tokens": 3,  # the engine's usage (the fake counts words)
        "predicted_cached_tokens": 0,
        "best_cached_tokens": 0,
        "engine_cached_tokens": 2,
        "output_tokens": 4,
        "bytes_in": len(streamed.request.content),
        "bytes_out": len(streamed.content),
    }
    assert re.fullmatch(r"[0-9a-f]{8}", first["client"])
    assert isinstance(first["reason"], str) and first["reason"]
    assert 0 < first["ttft_ms"] <= first["duration_ms"]
    assert second == second | {
        "request_id": plain.headers["x-request-id"],
        "trace_id": None,
        "stream": False,
        "status": 200,
        "ttft_ms": None,  # not streamed
        "output_tokens": 3,  # usage.completion_tokens of the JSON body
        "bytes_out": len(plain.content),
    }
    assert third == third | {
        "client": "-",
        "model": "none",  # refused before the body was read
        "status": 401,
        "worker": None,
        "attempts": 0,
        "prompt_tokens": None,
        "output_tokens": None,
        "bytes_out": len(refused.content),
    }
    assert fourth == fourth | {"model": "no-such-model", "status": 404, "worker": None}


async def test_client_text_is_capped() -> None:
    async with logged_kvgate() as (gw, _, stream):
        huge = {**CHAT, "model": "m" * 100_000}
        assert (await gw.client.post("/v1/chat/completions", json=huge)).status_code == 404
        await wait_until(lambda: answered(gw) >= 1, 10, "the request to end")
    (line,) = access_lines(stream.getvalue())
    assert line["model"] == "m" * 255 + "…"


async def test_sampling_keeps_every_error() -> None:
    async with logged_kvgate(access_log_sample_rate=0.0) as (gw, _, stream):
        assert (await gw.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        unknown = {**CHAT, "model": "no-such-model"}
        assert (await gw.client.post("/v1/chat/completions", json=unknown)).status_code == 404
        await wait_until(lambda: answered(gw) >= 2, 10, "2 requests to end")
    assert [line["status"] for line in access_lines(stream.getvalue())] == [404]


async def test_access_log_off() -> None:
    async with logged_kvgate(access_log=False) as (gw, _, stream):
        assert (await gw.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        await wait_until(lambda: answered(gw) >= 1, 10, "the request to end")
    assert access_lines(stream.getvalue()) == []


async def test_stream_without_usage_counts_its_content_events() -> None:
    async with logged_kvgate(capture_usage=False) as (gw, _, stream):
        body = {**CHAT, "stream": True, "fake": {"tokens": 5}}
        assert (await gw.client.post("/v1/chat/completions", json=body)).status_code == 200
        await wait_until(lambda: answered(gw) >= 1, 10, "the request to end")
    (line,) = access_lines(stream.getvalue())
    assert line["output_tokens"] == 5  # 5 content events; [DONE] is not a token
    assert line["engine_cached_tokens"] is None  # no usage asked for, none reported


# --- formats -----------------------------------------------------------------------------


def record(message: str, fields: dict[str, Any] | None = None) -> logging.LogRecord:
    rec = logging.LogRecord("kvgate.test", logging.WARNING, __file__, 1, message, None, None)
    if fields is not None:
        setattr(rec, FIELDS, fields)
    return rec


def test_logfmt_quotes_what_needs_it() -> None:
    pairs = {"a": "plain", "b": "two words", "c": 'say "hi"', "d": "x=y", "e": None, "f": True}
    assert logfmt(pairs) == 'a=plain b="two words" c="say \\"hi\\"" d="x=y" f=true'
    assert logfmt({"newline": "a\nb", "empty": ""}) == 'newline="a\\nb" empty=""'


def test_each_format_renders_fields_and_exceptions() -> None:
    fields = {"request_id": "r1", "status": 200, "worker": None}
    line = json.loads(make_formatter("json").format(record("request", fields)))
    assert line["message"] == "request" and line["request_id"] == "r1" and line["worker"] is None
    assert line["level"] == "warning" and line["logger"] == "kvgate.test"
    text = make_formatter("text").format(record("request", fields))
    assert text.endswith("WARNING kvgate.test: request request_id=r1 status=200")
    pairs = dict(
        part.split("=", 1) for part in shlex.split(make_formatter("logfmt").format(record("a b")))
    )
    assert pairs["message"] == "a b" and pairs["level"] == "warning"
    try:
        raise ValueError("boom")
    except ValueError:
        failing = record("failed")
        failing.exc_info = sys.exc_info()
    line = json.loads(make_formatter("json").format(failing))
    assert "ValueError: boom" in line["exc"] and line["message"] == "failed"


class BlockedStream(io.StringIO):
    """A stdout whose reader stalls: the first write waits until ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        assert self.release.wait(10), "never released"
        return super().write(text)


def test_a_stalled_output_drops_records_and_says_so() -> None:
    stream = BlockedStream()
    output = configure_logging("info", "json", stream, queue_size=2)
    log = logging.getLogger("kvgate.test")
    try:
        log.warning("first")  # taken by the writer thread, which then blocks
        assert stream.entered.wait(10)
        for i in range(9):
            log.warning("more %d", i)  # 2 fit in the queue, 7 are dropped at once
    finally:
        stream.release.set()
        output.close()
    messages = [json.loads(line)["message"] for line in stream.getvalue().splitlines()]
    assert messages == [
        "first",
        "7 log records dropped: the log output was too slow",
        "more 0",
        "more 1",
    ]


class BrokenOnce(io.StringIO):
    """A stdout whose first flush fails (a reader gone, then back)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = threading.Event()

    def flush(self) -> None:
        if not self.failed.is_set():
            self.failed.set()
            raise BrokenPipeError("the reader left")
        super().flush()


def test_a_failed_write_costs_its_batch_not_the_writer(capsys: pytest.CaptureFixture[str]) -> None:
    stream = BrokenOnce()
    output = configure_logging("info", "json", stream)
    log = logging.getLogger("kvgate.test")
    try:
        log.warning("before")
        assert stream.failed.wait(10)
        log.warning("after")
    finally:
        output.close()  # writes what is queued: only a live writer thread gets "after" out
    messages = [json.loads(line)["message"] for line in stream.getvalue().splitlines()]
    assert messages[-1] == "after"
    assert "BrokenPipeError: the reader left" in capsys.readouterr().err


# --- the real command --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "logfmt"])
async def test_serve_writes_only_structured_lines_on_stdout(fmt: str, tmp_path: Path) -> None:
    engine = FakeEngine()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    async with (
        serve(engine) as upstream,
        kvgate_process(
            f"{upstream.url},models=fake-model", out, "--log-format", fmt, stderr_path=err
        ) as (port, process),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client,
    ):
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        await wait_until(lambda: b"kvgate.access" in out.read_bytes(), 10, "the access line")
        process.terminate()
        await process.wait()
    text = out.read_text()
    lines = [_parse(fmt, line) for line in text.splitlines()]
    loggers = {line["logger"] for line in lines}
    assert {"uvicorn.error", "kvgate.access"} <= loggers, text
    (access,) = [line for line in lines if line["logger"] == "kvgate.access"]
    assert str(access["status"]) == "200"
    assert str(access["worker"]) == upstream.url
    assert err.read_text() == ""


def _parse(fmt: str, line: str) -> dict[str, Any]:
    if fmt == "json":
        parsed: dict[str, Any] = json.loads(line)
        return parsed
    return dict(part.split("=", 1) for part in shlex.split(line))


async def test_a_warning_clients_can_repeat_is_logged_once_per_window(tmp_path: Path) -> None:
    """Thirty malformed requests: uvicorn warns of each, one line reaches the output (the
    rest held back for ``REPEAT_WINDOW_S``), and each still gets its 400."""
    engine = FakeEngine()
    out = tmp_path / "stdout"
    async with (
        serve(engine) as upstream,
        kvgate_process(f"{upstream.url},models=fake-model", out, "--log-format", "json") as (
            port,
            process,
        ),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client,
    ):
        for _ in range(30):
            reply = await exchange(port, b"NOT HTTP AT ALL\r\n\r\n", limit_s=10)
            assert reply.status == 400
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        await wait_until(lambda: b"kvgate.access" in out.read_bytes(), 10, "the access line")
        process.terminate()
        await process.wait()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    invalid = [line for line in lines if "Invalid HTTP request" in line["message"]]
    assert len(invalid) == 1, invalid
    assert invalid[0]["logger"] == "uvicorn.error"


def test_repeat_limit_holds_back_repeats_and_counts_them() -> None:
    now = [0.0]
    limit = RepeatLimit(window_s=10.0, clock=lambda: now[0])

    def passes(name: str, message: str, level: int = logging.WARNING) -> logging.LogRecord | None:
        record = logging.LogRecord(name, level, __file__, 0, message, None, None)
        return record if limit.filter(record) else None

    assert passes("uvicorn.error", "Invalid HTTP request received.") is not None
    assert passes("uvicorn.error", "Invalid HTTP request received.") is None
    assert passes("uvicorn.error", "Invalid HTTP request received.") is None
    assert passes("uvicorn.error", "another warning") is not None  # its own window
    assert passes("uvicorn.error", "boom", logging.ERROR) is not None  # errors always pass
    assert passes("uvicorn.error", "boom", logging.ERROR) is not None
    assert passes("kvgate.gateway", "a warning of kvgate's") is not None  # never held back
    assert passes("kvgate.gateway", "a warning of kvgate's") is not None
    assert passes("uvicorn.access", "%s - %s") is not None  # nor any other uvicorn logger's
    assert passes("uvicorn.access", "%s - %s") is not None
    now[0] = 10.0
    record = passes("uvicorn.error", "Invalid HTTP request received.")
    assert record is not None
    assert record.getMessage() == (
        "Invalid HTTP request received. (2 more like it not logged since the last)"
    )
    assert passes("uvicorn.error", "Invalid HTTP request received.") is None


def test_repeat_limit_remembers_a_bounded_number_of_messages() -> None:
    limit = RepeatLimit(window_s=10.0, clock=lambda: 0.0)

    def passes(message: str) -> bool:
        return limit.filter(
            logging.LogRecord("uvicorn.error", logging.WARNING, "", 0, message, None, None)
        )

    assert passes("first")
    assert not passes("first")
    assert all(passes(f"message {n}") for n in range(REPEAT_KEYS))  # "first" forgotten
    assert passes("first")


# --- one record, one line (issue 44, low findings) ----------------------------------------

BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # every separator str.splitlines() knows
FORGED = "real" + "".join(f"{c}forged {ord(c):x} level=error" for c in BREAKS)


@pytest.mark.parametrize("fmt", ["json", "logfmt", "text"])
def test_no_format_lets_a_line_separator_through(fmt: Any) -> None:
    formatter = make_formatter(fmt)
    line = formatter.format(record(f"message {FORGED}", {"model": FORGED, "path": "/v1/x"}))
    assert len(line.splitlines()) == 1, line
    if fmt == "json":
        parsed = json.loads(line)  # escaped the JSON way: the text comes back whole
        assert parsed["model"] == FORGED and parsed["message"] == f"message {FORGED}"
    if fmt == "logfmt":
        assert _parse("logfmt", line)["model"] == json.dumps(FORGED).strip('"')
    try:
        raise ValueError(f"bad {FORGED}")
    except ValueError:
        failing = record(FORGED)
        failing.exc_info = sys.exc_info()
    text = formatter.format(failing)
    first, *trace = text.split("\n")  # a traceback keeps its line feeds (text format)
    assert len(first.splitlines()) == 1 and FORGED[:4] in first
    assert all(len(part.splitlines()) <= 1 for part in trace)
    if fmt != "text":
        assert trace == []


@pytest.mark.parametrize("fmt", ["json", "logfmt", "text"])
async def test_a_client_cannot_forge_an_access_log_line(fmt: Any) -> None:
    """A model name and a path carrying NEL, U+2028 and U+2029: each request is still one
    line of output, in every format."""
    stream = io.StringIO()
    output = configure_logging("info", fmt, stream)
    try:
        async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
            body = {**CHAT, "model": "x\u2028forged=1\x85level=error\u2029end"}
            r = await gw.client.post("/v1/chat/completions", json=body)
            assert r.status_code == 404
            r = await gw.client.post("/v1/embeddings%E2%80%A8forged", json=body)
            assert r.status_code == 404
            await wait_until(lambda: answered(gw) >= 2, 10, "2 requests to end")
    finally:
        output.close()
    text = stream.getvalue()
    assert text.splitlines() == text.split("\n")[:-1], text
    assert sum("kvgate.access" in line for line in text.splitlines()) == 2
