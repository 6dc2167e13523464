"""The commit point (router/commit.py): which events of an engine's stream are content."""

from __future__ import annotations

import json

import httpx
import pytest

from kvgate.router.commit import Reason, StreamStart, Verdict, error_events, failure_reason


def data(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat_chunk(delta: dict[str, object], finish: str | None = None, **extra: object) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return data({"id": "c", "object": "chat.completion.chunk", "choices": [choice], **extra})


def feed_all(*chunks: bytes, limit: int = 1 << 20) -> tuple[Verdict, StreamStart]:
    start = StreamStart(limit)
    verdict = Verdict.WAIT
    for chunk in chunks:
        verdict = start.feed(chunk)
        if verdict is not Verdict.WAIT:
            break
    return verdict, start


@pytest.mark.parametrize(
    "chunk",
    [
        b": keep-alive\n\n",
        b"retry: 1000\n\n",
        b"id: 7\n\n",
        b"\n\n",
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"role": "assistant"}),
        chat_chunk(
            {"role": "assistant", "content": ""},
            usage={"prompt_tokens": 9, "completion_tokens": 0},  # continuous usage stats
        ),
        data({"id": "c", "object": "chat.completion.chunk", "choices": []}),
        data({"id": "t", "object": "text_completion", "choices": [{"index": 0, "text": ""}]}),
        b"event: response.created\ndata: "
        + json.dumps({"type": "response.created", "response": {"error": None}}).encode()
        + b"\n\n",
        b"event: response.in_progress\ndata: {}\n\n",
        data({"type": "response.queued"}),
    ],
)
def test_what_is_not_content_is_held(chunk: bytes) -> None:
    verdict, start = feed_all(chunk)
    assert verdict is Verdict.WAIT
    assert start.take() == [chunk]


@pytest.mark.parametrize(
    "chunk",
    [
        chat_chunk({"content": "Hello"}),
        chat_chunk({"role": "assistant", "content": "Hi"}),
        chat_chunk({"reasoning_content": "hmm"}),
        chat_chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f"}}]}),
        chat_chunk({}, finish="length"),
        data({"id": "t", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}),
        data({"id": "c", "choices": [], "usage": {"prompt_tokens": 3}}),
        b"data: [DONE]\n\n",
        b"data: not json at all\n\n",
        data([1, 2, 3]),
        data({"something": "unknown"}),
        b"event: response.output_item.added\ndata: "
        + json.dumps({"type": "response.output_item.added"}).encode()
        + b"\n\n",
    ],
)
def test_content_commits(chunk: bytes) -> None:
    verdict, _ = feed_all(b": ping\n\n", chunk)
    assert verdict is Verdict.COMMIT


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (data({"error": {"message": "engine died", "type": "x", "code": 500}}), "engine died"),
        (data({"object": "error", "message": "old vLLM", "code": 500}), "old vLLM"),
        (
            b"event: error\ndata: "
            + json.dumps({"type": "error", "message": "responses failed"}).encode()
            + b"\n\n",
            "responses failed",
        ),
        (data({"type": "response.failed", "response": {}}), "error event"),
    ],
)
def test_an_error_before_content_fails_the_attempt(chunk: bytes, message: str) -> None:
    verdict, start = feed_all(chat_chunk({"role": "assistant", "content": ""}), chunk)
    assert verdict is Verdict.FAILED
    assert start.failure == message


def test_events_split_across_chunks_and_crlf_framing() -> None:
    event = chat_chunk({"content": "tok"}).replace(b"\n\n", b"\r\n\r\n")
    pieces = [event[i : i + 3] for i in range(0, len(event), 3)]
    start = StreamStart(1 << 20)
    verdicts = [start.feed(p) for p in pieces]
    assert verdicts[:-1] == [Verdict.WAIT] * (len(pieces) - 1)
    assert verdicts[-1] is Verdict.COMMIT
    assert b"".join(start.take()) == event


def test_the_hold_is_bounded() -> None:
    comment = b": " + b"x" * 1000 + b"\n\n"
    start = StreamStart(limit=4096)
    verdicts = [start.feed(comment) for _ in range(5)]
    assert verdicts == [Verdict.WAIT] * 4 + [Verdict.COMMIT]  # committed as it stands


def test_error_events_after_the_commit() -> None:
    assert error_events(data({"error": {"message": "boom"}}))
    assert not error_events(chat_chunk({"content": "an error in the text"}))
    assert not error_events(chat_chunk({"content": "fine"}))


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (httpx.ConnectError("refused"), Reason.REFUSED),
        (httpx.ConnectTimeout("slow"), Reason.CONNECT_TIMEOUT),
        (httpx.ReadTimeout("slow"), Reason.TIMEOUT),
        (httpx.RemoteProtocolError("closed"), Reason.RESET),
        (httpx.ReadError("reset"), Reason.RESET),
    ],
)
def test_failure_reasons(exc: httpx.HTTPError, reason: str) -> None:
    assert failure_reason(exc) == reason
