"""Hostile input against a real kvgate in front of simulated replicas (property-based).

One kvgate (the production app and listener configuration under uvicorn on 127.0.0.1) routes
to two in-process simulated vLLM replicas with KV events and the simulator's tokenizer, in a
thread of its own. Hypothesis writes requests as raw bytes (what a client library would
refuse to send still reaches a server): JSON bodies built from valid requests with fields
swapped for arbitrary values, arbitrary bytes, odd headers (duplicates, control bytes,
huge values), odd paths (percent-encoded anything, dot segments), any method, and request
heads around and past the listener's bounds (bytes, header lines, target length).

Property: every request gets an answer before a generous "no hang" limit, and it is a 2xx,
or a 4xx with an OpenAI-style JSON error body (HEAD: no body). After each run the gateway is
healthy, every worker is healthy with nothing in flight, and it routes normally.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fakes.gateway import Kvgate, kvgate
from fakes.rawhttp import RawResponse, exchange_sync, request_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.backends.sim.config import EngineConfig, SimConfig, TimingConfig
from kvgate.backends.sim.fleet import SimFleet
from kvgate.backends.sim.tokenizer import tokenizer_dir
from kvgate.router.listener import MAX_HEAD_BYTES, MAX_HEADERS, MAX_URL_BYTES

MODEL = "kvgate-sim"
ADMIN = "hostile-suite-admin-token"
LIMIT_S = 60.0  # "no hang" guard per request: far above any answer's time
EXAMPLES = settings(
    max_examples=250,
    deadline=None,  # hypothesis' own per-example timing is not what this suite checks
    derandomize=True,  # the same examples on every run: a failure is reproducible
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Hostile:
    port: int
    gateway: Kvgate
    loop: asyncio.AbstractEventLoop


def _serve_forever(ready: threading.Event, box: dict[str, Any]) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        sim = SimConfig(
            replicas=2,
            port=0,
            events_port=0,
            engine=EngineConfig(model=MODEL, max_model_len=512, default_max_tokens=4),
            timing=TimingConfig(speedup=1000.0),
        )
        tokenizer = await asyncio.to_thread(tokenizer_dir)
        async with SimFleet(sim) as fleet:
            workers = [
                f"{r.url},models={MODEL},events={r.events},replay={r.replay}"
                for r in fleet.replicas
            ]
            async with kvgate(
                workers,
                policy="kv",
                tokenizers=[f"{MODEL}={tokenizer}"],
                admin_token=ADMIN,
                max_body_bytes=256 * 1024,
                # requests that stop half-way (a partial head, a body shorter than declared)
                # are answered at these, well inside the "no hang" limit
                client={"header_timeout_s": 1.0, "body_timeout_s": 2.0},
            ) as gw:
                box["hostile"] = Hostile(
                    int(gw.url.rsplit(":", 1)[1]), gw, asyncio.get_running_loop()
                )
                box["stop"] = stop
                ready.set()
                await stop.wait()

    try:
        asyncio.run(main())
    except BaseException as exc:  # reported to the test thread, which fails with it
        box["error"] = exc
        ready.set()


@pytest.fixture(scope="module")
def hostile() -> Iterator[Hostile]:
    ready = threading.Event()
    box: dict[str, Any] = {}
    thread = threading.Thread(target=_serve_forever, args=(ready, box), daemon=True)
    thread.start()
    assert ready.wait(120), "kvgate and the simulated fleet did not start"
    if "error" in box:
        raise box["error"]
    server: Hostile = box["hostile"]
    try:
        yield server
    finally:
        server.loop.call_soon_threadsafe(box["stop"].set)
        thread.join(60)


# -- the property ---------------------------------------------------------------------------
def check_answer(response: RawResponse, method: str) -> None:
    assert response.status, f"no answer: {response}"
    assert response.status < 500, response
    assert 200 <= response.status < 300 or 400 <= response.status < 500, response
    if response.status >= 400 and method != "HEAD":
        response.openai_error()


def check_healthy(server: Hostile) -> None:
    admin = {"authorization": f"Bearer {ADMIN}"}
    base = f"http://127.0.0.1:{server.port}"
    with httpx.Client(base_url=base, timeout=LIMIT_S) as client:
        assert client.get("/health").status_code == 200
        ready = client.get("/ready").json()
        assert ready == {"ready": True, "ready_workers": 2, "healthy_workers": 2, "workers": 2}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "still fine?"}]}
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json={**body, "stream": stream})
            assert r.status_code == 200 and r.headers["x-kvgate-worker"]
        settle_in_flight(client, admin)


def settle_in_flight(client: httpx.Client, admin: dict[str, str]) -> None:
    """Nothing stays in flight (a finished request releases its load at once after)."""
    for _ in range(2000):  # bounded: each round trip is a few milliseconds
        workers = client.get("/admin/workers", headers=admin).json()["workers"]
        assert all(w["healthy"] for w in workers), workers
        if all(w["in_flight"] == 0 for w in workers):
            return
    raise AssertionError(f"requests left in flight: {workers}")


def send(server: Hostile, data: bytes) -> RawResponse:
    method = data.split(b" ", 1)[0].decode("latin-1")
    response = exchange_sync(server.port, data, limit_s=LIMIT_S)
    check_answer(response, method)
    return response


# -- strategies -----------------------------------------------------------------------------
BIG_INTS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from([2**31, 2**32, 2**63, 2**64])
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    BIG_INTS,
    st.floats(allow_nan=False),
    st.text(max_size=40),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=16,
)
CHAT_FIELDS = [
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "user", "cache_salt", "tools", "add_generation_prompt", "chat_template_kwargs", "n",
    "temperature", "logprobs", "response_format", "tool_choice", "seed", "stop",
]  # fmt: skip
NESTED_TEXT = st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)  # JSON inside a string
TOOL_CALLS = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.text(max_size=8),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.text(max_size=8)},
                optional={
                    "arguments": st.one_of(
                        st.text(max_size=30), JSON_VALUES.map(json.dumps), NESTED_TEXT, JSON_VALUES
                    )
                },
            ),
        }
    )
    | JSON_VALUES,
    max_size=2,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | JSON_VALUES},
    optional={
        "content": st.text(max_size=60) | JSON_VALUES,
        "name": JSON_VALUES,
        "tool_calls": TOOL_CALLS | JSON_VALUES,
        "tool_call_id": JSON_VALUES,
    },
)


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": draw(st.lists(MESSAGE, min_size=1, max_size=3)),
        "max_tokens": draw(st.integers(1, 4)),
        "stream": draw(st.booleans()),
    }
    for name in draw(st.lists(st.sampled_from(CHAT_FIELDS), max_size=3, unique=True)):
        body[name] = draw(JSON_VALUES)
    return body


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    token_ids = st.lists(BIG_INTS | st.integers(0, 50_000), max_size=40)
    prompt = draw(
        st.one_of(
            st.text(max_size=80),
            token_ids,
            st.lists(st.text(max_size=20), max_size=3),
            st.lists(token_ids, max_size=3),
            JSON_VALUES,
        )
    )
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": draw(st.integers(1, 4)),
        "stream": draw(st.booleans()),
    }
    for name in draw(st.lists(st.sampled_from(CHAT_FIELDS), max_size=2, unique=True)):
        body[name] = draw(JSON_VALUES)
    return body


JSON = [("content-type", "application/json")]


def encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


JSON_POSTS = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), chat_bodies().map(encode)),
    st.tuples(st.just("/v1/completions"), completion_bodies().map(encode)),
    st.tuples(
        st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
        st.one_of(
            JSON_VALUES.map(encode), st.binary(max_size=300), st.text(max_size=200).map(str.encode)
        ),
    ),
)
TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
HEADER_NAMES = st.one_of(
    st.sampled_from(
        [
            "authorization", "x-api-key", "x-request-id", "x-session-id", "content-type",
            "content-encoding", "transfer-encoding", "expect", "connection", "accept-encoding",
            "host", "content-length", "upgrade", "te", "trailer", "x-forwarded-for",
            "proxy-authorization", "cookie", "accept",
        ]
    ),
    st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=20),
)  # fmt: skip
HEADER_VALUES = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=80),
    st.sampled_from(["chunked", "gzip", "100-continue", "close", "-1", "99999999999", "Bearer "]),
    st.binary(max_size=30),  # control bytes, CR, LF, NUL: the parser's business
    st.just("x" * 20_000),
)


def header_bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")


PATH_SEGMENTS = st.one_of(
    st.sampled_from(["", ".", "..", "%2e%2e", "%2E", "models", "chat", "completions", "v1"]),
    st.text(max_size=12).map(lambda s: quote(s, safe="")),
    st.text(max_size=8).map(lambda s: quote(s, safe="/:@!$&'()*+,;=")),
    st.binary(max_size=6).map(lambda b: quote(b, safe="")),
)
PATHS = st.builds(
    lambda prefix, segments, query: prefix + "/".join(segments) + query,
    st.sampled_from(["/v1/", "/", "//", "/admin/", "/debug/", "/v1/models/", "/v1//", "/metrics"]),
    st.lists(PATH_SEGMENTS, max_size=4),
    st.one_of(
        st.just(""),
        st.text(max_size=20).map(lambda s: "?" + quote(s, safe="=&")),
        st.just("?model=" + MODEL),
    ),
)
METHODS = st.one_of(
    st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE"]),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=9),
)


# -- the tests ------------------------------------------------------------------------------
# Each test runs its examples, then checks the gateway is still well.
def test_hostile_bodies(hostile: Hostile) -> None:
    @EXAMPLES
    @given(request=JSON_POSTS)
    def run(request: tuple[str, bytes]) -> None:
        path, body = request
        send(hostile, request_bytes("POST", path, headers=JSON, body=body))

    run()
    check_healthy(hostile)


def test_hostile_bodies_explained(hostile: Hostile) -> None:
    """``POST /debug/route`` parses the same bodies (with the admin token)."""

    @EXAMPLES
    @given(request=JSON_POSTS)
    def run(request: tuple[str, bytes]) -> None:
        headers = [("authorization", f"Bearer {ADMIN}")]
        send(hostile, request_bytes("POST", "/debug/route", headers=headers, body=request[1]))

    run()
    check_healthy(hostile)


def test_hostile_headers(hostile: Hostile) -> None:
    body = encode(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )

    @EXAMPLES
    @given(
        headers=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6), chunked=st.booleans()
    )
    def run(headers: list[tuple[str, str | bytes]], chunked: bool) -> None:
        raw: list[tuple[str | bytes, str | bytes]] = [
            (name, header_bytes(value)) for name, value in headers
        ]
        if chunked:
            raw.append(("transfer-encoding", "chunked"))
            framed = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
            data = request_bytes(
                "POST", "/v1/chat/completions", headers=raw, body=framed, content_length=False
            )
        else:
            data = request_bytes("POST", "/v1/chat/completions", headers=raw, body=body)
        send(hostile, data)

    run()
    check_healthy(hostile)


HEAD_NAMES = st.one_of(
    st.sampled_from(["x-session-id", "cookie", "accept", "x-request-id", "traceparent"]),
    st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=20).map(lambda s: "x-" + s),
)
HEAD_VALUE_SIZES = st.sampled_from([0, 1, 100, 900, 8_000, 30_000, MAX_HEAD_BYTES])
TARGET_PADS = st.sampled_from([0, 100, MAX_URL_BYTES - 100, MAX_URL_BYTES, 3 * MAX_URL_BYTES])


def head_status(data: bytes, target: bytes, lines: int) -> int | None:
    """The answer a whole head must get for its bounds (None: within them)."""
    if len(target) > MAX_URL_BYTES:
        return 414
    head = data.index(b"\r\n\r\n") + 4
    return 431 if lines > MAX_HEADERS or head > MAX_HEAD_BYTES else None


def test_hostile_request_heads(hostile: Hostile) -> None:
    """Heads around and past the bounds: 414 for a long target, 431 for too many header
    lines or bytes, else the request is served; each refusal closes its connection."""
    body = encode(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )

    @EXAMPLES
    @given(
        lines=st.lists(st.tuples(HEAD_NAMES, HEAD_VALUE_SIZES), max_size=8),
        repeated=st.sampled_from([0, 1, MAX_HEADERS - 10, MAX_HEADERS, 3 * MAX_HEADERS]),
        pad=TARGET_PADS,
    )
    def run(lines: list[tuple[str, int]], repeated: int, pad: int) -> None:
        raw: list[tuple[str | bytes, str | bytes]] = [(n, "v" * size) for n, size in lines]
        raw += [("x-repeated", "1")] * repeated
        target = b"/v1/chat/completions" + (b"?pad=" + b"a" * pad if pad else b"")
        data = request_bytes("POST", target, headers=[*JSON, *raw], body=body)
        # host, content-type, the lines, content-length
        expected = head_status(data, target, len(raw) + 3)
        response = send(hostile, data)
        if expected is None:
            assert response.status == 200, response
        else:
            assert response.status == expected, response
            assert response.headers["connection"] == "close"

    run()
    check_healthy(hostile)


def test_hostile_paths_and_methods(hostile: Hostile) -> None:
    @EXAMPLES
    @given(method=METHODS, path=PATHS, body=st.one_of(st.just(b""), JSON_VALUES.map(encode)))
    def run(method: str, path: str, body: bytes) -> None:
        send(hostile, request_bytes(method, path, headers=JSON, body=body))

    run()
    check_healthy(hostile)


def test_arbitrary_bytes_on_the_wire(hostile: Hostile) -> None:
    """Whatever arrives gets an answer or a close, never a hang (garbage may not even be a
    request, so an answer is not required here); the gateway stays well."""

    @EXAMPLES
    @given(data=st.binary(max_size=400))
    def run(data: bytes) -> None:
        response = exchange_sync(hostile.port, data + b"\r\n\r\n", limit_s=LIMIT_S)
        if response.status:
            check_answer(response, "GET")

    run()
    check_healthy(hostile)
