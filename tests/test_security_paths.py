"""Pass-through paths: only normalised paths of the allowlist reach an engine.

Requests are written as raw bytes (an HTTP library would refuse or rewrite most of them):
percent-encoded CR, LF and NUL, raw and encoded dot segments, control characters. Each is
refused with an OpenAI-style 400 and the engine never sees it.
"""

from __future__ import annotations

import json

import httpx
import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate
from fakes.rawhttp import exchange, request_bytes
from fakes.simgate import MODEL, fleet_config, gate, sim_fleets, worker_specs

from kvgate.router.config import ConfigError, load_settings

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
    async with (
        fleet(FakeEngine()) as f,
        kvgate(f.urls, pass_through_paths=["/v1/files/a bé"]) as gw,
    ):
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


# --- the pass-through allowlist (issue 44, finding 12) -----------------------------------


async def _adapters(url: str) -> set[str]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        cards = (await client.get("/v1/models")).json()["data"]
    return {card["id"] for card in cards if card.get("parent")}


LOAD = {"model": MODEL, "lora_name": "planted", "lora_path": "/adapters/planted"}


async def test_engine_administration_is_not_passed_through_by_default() -> None:
    """An ordinary client key cannot load, replace or unload a LoRA adapter on the engines:
    ``/v1/load_lora_adapter`` and the like are 404 (OpenAI-style) from kvgate."""
    async with (
        sim_fleets(fleet_config(1, lora=["sql"])) as (sims,),
        gate(worker_specs(sims), api_keys=["sk-client"]) as gw,
    ):
        key = {"authorization": "Bearer sk-client"}
        url = sims.replicas[0].url
        for path, body in (
            ("/v1/load_lora_adapter", LOAD),
            ("/v1/load_lora_adapter?model=kvgate-sim", {**LOAD, "load_inplace": True}),
            ("/v1/unload_lora_adapter", {"model": MODEL, "lora_name": "sql"}),
            ("/v1//load_lora_adapter", LOAD),
        ):
            r = await gw.client.post(path, json=body, headers=key)
            assert r.status_code == 404, (path, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "not_found"
            assert "--pass-through-path" in error["message"]
            assert "x-kvgate-worker" not in r.headers
        assert await _adapters(url) == {"sql"}  # nothing loaded, nothing unloaded
        for method in ("GET", "PUT", "PATCH"):  # embeddings: POST only
            r = await gw.client.request(method, "/v1/embeddings?model=kvgate-sim", headers=key)
            assert r.status_code == 404, method


async def test_the_operator_opts_engine_paths_in() -> None:
    async with (
        sim_fleets(fleet_config(1)) as (sims,),
        gate(worker_specs(sims), pass_through_paths=["/v1/load_lora_adapter"]) as gw,
    ):
        r = await gw.client.post("/v1/load_lora_adapter", json=LOAD)
        assert r.status_code == 200, r.text
        assert await _adapters(sims.replicas[0].url) == {"planted"}
        r = await gw.client.post("/v1/unload_lora_adapter", json=LOAD)  # not opted in
        assert r.status_code == 404


async def test_the_default_paths_are_passed_through() -> None:
    """Embeddings, vLLM's rerank and score (under /v1 and at the root), and a stored
    response by id reach a worker serving the model."""
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        port = port_of(gw.url)
        for path in ("/v1/embeddings", "/v1/rerank", "/v1/score", "/rerank", "/score"):
            r = await exchange(port, request_bytes("POST", path, headers=JSON, body=EMBED))
            assert f.engines[0].seen[-1].path == path  # forwarded (the fake serves embeddings)
            assert r.status == (200 if path == "/v1/embeddings" else 404), path
        await exchange(port, request_bytes("GET", "/v1/responses/resp_1?model=fake-model"))
        assert f.engines[0].seen[-1].path == "/v1/responses/resp_1"


@pytest.mark.parametrize("path", ["v1/x", "/v2/x", "/v1/", "/v1/../admin", "/v1/a\nb"])
def test_opted_in_paths_are_checked_at_start_up(path: str) -> None:
    with pytest.raises(ConfigError, match="pass_through_paths"):
        load_settings(overrides={"pass_through_paths": [path]})
