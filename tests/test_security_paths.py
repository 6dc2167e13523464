"""Pass-through paths: only normalised ``/v1/...`` paths reach an engine.

Requests are written as raw bytes (an HTTP library would refuse or rewrite most of them):
percent-encoded CR, LF and NUL, raw and encoded dot segments, control characters. Each is
refused with an OpenAI-style 400 and the engine never sees it.
"""

from __future__ import annotations

import json

import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate
from fakes.rawhttp import exchange, request_bytes

pytestmark = pytest.mark.anyio

EMBED = json.dumps({"model": "fake-model", "input": "x"}).encode()
JSON = [("content-type", "application/json")]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


HOSTILE_PATHS = [
    "/v1/embeddings%0d%0aX-Injected:%20yes",
    "/v1/embeddings%0aGET%20/admin%20HTTP/1.1",
    "/v1/embeddings%0d",
    "/v1/emb%00eddings",
    "/v1/emb%7feddings",
    "/v1/emb%09eddings",
    "/v1/../admin/workers",
    "/v1/x/../../health",
    "/v1/./embeddings",
    "/v1/embeddings/..",
    "/v1/%2e%2e/admin/workers",
    "/v1/%2E%2e%2fadmin",
    "/v1/x%2f..%2f..%2fhealth",
]


async def test_hostile_pass_through_paths_are_400() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        for target in HOSTILE_PATHS:
            request = request_bytes("POST", target, headers=JSON, body=EMBED)
            r = await exchange(port_of(gw.url), request)
            assert r.status == 400, (target, r)
            assert r.openai_error()["type"] == "invalid_request_error"
        assert all(s.method == "GET" for s in f.engines[0].seen)  # probes only


async def test_dot_segment_paths_do_not_reach_other_routes() -> None:
    """``/v1/../admin/workers`` never becomes an admin call nor an upstream one."""
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        target = "/v1/../admin/workers?model=fake-model"  # a model: worth forwarding
        r = await exchange(port_of(gw.url), request_bytes("GET", target))
        assert r.status == 400 and "workers" not in r.json()
        assert all(s.path != "/v1/../admin/workers" for s in f.engines[0].seen)


async def test_normal_pass_through_paths_are_forwarded_canonically() -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        port = port_of(gw.url)
        r = await exchange(port, request_bytes("POST", "/v1/embeddings", headers=JSON, body=EMBED))
        assert r.status == 200 and r.json()["engine"] == "engine"
        r = await exchange(
            port,
            request_bytes("POST", "/v1/files/a%20b%C3%A9?x=1%202&y=%2F", headers=JSON, body=EMBED),
        )
        assert r.status == 404  # the fake engine has no such route; it got a clean request line
        seen = f.engines[0].seen[-1]
        assert seen.path == "/v1/files/a bé"
        assert seen.raw_path == b"/v1/files/a%20b%C3%A9"


async def test_request_lines_the_parser_refuses_get_openai_errors() -> None:
    """Raw control bytes in the request line: the HTTP parser's 400 is OpenAI-style too."""
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        for target in (b"/v1/embeddings?a=\x01b", b"/v1/emb\x7feddings", b"/v1/a b", b"/v1/\x00"):
            r = await exchange(port_of(gw.url), request_bytes(b"POST", target, body=EMBED))
            assert r.status == 400, target
            assert r.openai_error()["type"] == "invalid_request_error"
        assert all(s.method == "GET" for s in f.engines[0].seen)  # probes only
