"""Usage capture from SSE streams and JSON bodies, whatever the chunking."""

from __future__ import annotations

import json

import pytest

from kvgate.router.usage import SseUsageTap, Usage, usage_from_body

CONTENT = [
    b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n',
    b'data: {"choices": [{"delta": {"content": "b"}}]}\n\n',
]
USAGE = {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}
USAGE_EVENT = b"data: " + json.dumps({"choices": [], "usage": USAGE}).encode() + b"\n\n"
DONE = b"data: [DONE]\n\n"
STREAM = b"".join([*CONTENT, USAGE_EVENT, DONE])


def run(tap: SseUsageTap, chunks: list[bytes]) -> bytes:
    return b"".join(tap.feed(c) for c in chunks) + tap.flush()


@pytest.mark.parametrize("hide", [False, True])
def test_every_split_point(hide: bool) -> None:
    for cut in range(1, len(STREAM)):
        tap = SseUsageTap(hide=hide)
        out = run(tap, [STREAM[:cut], STREAM[cut:]])
        assert tap.usage == Usage(prompt_tokens=10, cached_tokens=8, completion_tokens=2), cut
        assert out == (b"".join([*CONTENT, DONE]) if hide else STREAM), cut


def test_byte_by_byte() -> None:
    tap = SseUsageTap(hide=True)
    out = run(tap, [STREAM[i : i + 1] for i in range(len(STREAM))])
    assert out == b"".join([*CONTENT, DONE])
    assert tap.usage is not None and tap.usage.cached_tokens == 8


def test_usage_riding_on_a_content_chunk_keeps_the_content() -> None:
    event = {"choices": [{"delta": {"content": "z"}}], "usage": USAGE}
    stream = b"data: " + json.dumps(event).encode() + b"\n\n" + DONE
    tap = SseUsageTap(hide=True)
    out = run(tap, [stream])
    assert tap.usage is not None and tap.usage.prompt_tokens == 10
    first = json.loads(out.split(b"\n\n")[0][len(b"data: ") :])
    assert first == {"choices": [{"delta": {"content": "z"}}]}


def test_null_usage_and_missing_details() -> None:
    nulls = b'data: {"choices": [{"delta": {}}], "usage": null}\n\n'
    bare = b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'
    tap = SseUsageTap(hide=False)
    assert run(tap, [nulls, bare, DONE]) == nulls + bare + DONE
    assert tap.usage == Usage(prompt_tokens=3, cached_tokens=None, completion_tokens=None)


def test_completion_tokens_must_be_a_count() -> None:
    event = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": true}}\n\n'
    tap = SseUsageTap(hide=False)
    run(tap, [event, DONE])
    assert tap.usage == Usage(prompt_tokens=3, cached_tokens=None, completion_tokens=None)


def test_non_sse_bytes_pass_untouched() -> None:
    blob = b"x" * (2 << 20)
    tap = SseUsageTap(hide=True)
    assert run(tap, [blob[: 1 << 20], blob[1 << 20 :]]) == blob
    assert tap.usage is None


def test_usage_from_json_body() -> None:
    body = json.dumps({"id": "x", "choices": [], "usage": USAGE}).encode()
    assert usage_from_body(body) == Usage(10, 8, 2)
    assert usage_from_body(b'{"id": "x"}') is None
    assert usage_from_body(b'{"usage": "broken"}') is None
    assert usage_from_body(b'not json, but mentions "usage"') is None
