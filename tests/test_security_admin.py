"""Secure defaults of the admin surface: who may use /admin and /debug, which workers and
event endpoints may be added at run time, and what upstream failures tell a client."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import pytest
from fakes.engine import FakeEngine
from fakes.engine import _json as send_json
from fakes.gateway import fleet, kvgate
from fakes.server import unresponsive_port

from kvgate.backends.allowlist import WorkerAllowlist
from kvgate.backends.process import free_port
from kvgate.router.config import ConfigError, load_settings
from kvgate.router.simfleet import SimFleet

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
ADMIN_CALLS = [
    ("GET", "/admin/workers", None),
    ("POST", "/admin/workers", {"url": "http://127.0.0.1:1"}),
    ("DELETE", "/admin/workers/" + quote("http://127.0.0.1:1", safe=""), None),
    ("POST", "/debug/route", CHAT),
    ("GET", "/debug/index", None),
]


async def test_admin_refused_without_token_beyond_loopback() -> None:
    """Listening on every interface with no admin token: admin and debug are off (403)."""
    async with fleet(FakeEngine()) as f, kvgate(f.urls, host="0.0.0.0") as gw:
        for method, path, body in ADMIN_CALLS:
            r = await gw.client.request(method, path, json=body)
            assert r.status_code == 403, path
            error = r.json()["error"]
            assert error["code"] == "admin_disabled" and "admin" in error["message"]
        assert [w.url for w in gw.gateway.registry] == f.urls  # nothing was added or removed
        assert not any(seen.path == "/v1/chat/completions" for seen in f.engines[0].seen)


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
async def test_admin_token_opens_admin_anywhere(host: str) -> None:
    async with fleet(FakeEngine()) as f, kvgate(f.urls, host=host, admin_token="t0k") as gw:
        assert (await gw.client.get("/admin/workers")).status_code == 401
        good = {"authorization": "Bearer t0k"}
        assert (await gw.client.get("/admin/workers", headers=good)).status_code == 200
        assert (await gw.client.post("/debug/route", json=CHAT, headers=good)).status_code == 200


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
async def test_loopback_listener_keeps_admin_and_debug_open(host: str) -> None:
    """``kvgate serve --sim 4`` on 127.0.0.1: /debug/route works as the README shows."""
    async with fleet(FakeEngine()) as f, kvgate(f.urls, host=host) as gw:
        assert (await gw.client.post("/debug/route", json=CHAT)).status_code == 200
        assert (await gw.client.get("/admin/workers")).status_code == 200


def test_the_sim_demo_listens_on_loopback() -> None:
    """``make demo`` (``kvgate serve --sim 4``) keeps the default loopback listener."""
    settings = load_settings(None, SimFleet(4).settings_overrides({}))
    assert settings.host == "127.0.0.1" and settings.admin_token is None


async def test_run_time_workers_must_match_the_default_allowlist() -> None:
    """Default: loopback and the hosts of configured workers; a cloud metadata address or
    any other host is refused before kvgate sends it anything."""
    async with fleet(FakeEngine(), FakeEngine("b")) as f, kvgate(f.urls[:1]) as gw:
        for url in (
            "http://169.254.169.254",
            "http://169.254.169.254:80/latest",
            "http://10.1.2.3:8000",
            "http://[fd00::1]:8000",
        ):
            r = await gw.client.post("/admin/workers", json={"url": url})
            assert r.status_code == 403, url
            assert r.json()["error"]["code"] == "worker_not_allowed"
            assert "--worker-allow" in r.json()["error"]["message"]
        assert [w.url for w in gw.gateway.registry] == f.urls[:1]
        r = await gw.client.post("/admin/workers", json={"url": f.urls[1]})  # loopback
        assert r.status_code == 201


async def test_worker_allow_rules_replace_the_default() -> None:
    async with fleet(FakeEngine()) as f, kvgate([], worker_allow=["10.0.0.0/8"]) as gw:
        r = await gw.client.post("/admin/workers", json={"url": f.urls[0]})
        assert r.status_code == 403  # loopback is no longer allowed once rules are given
        assert f.engines[0].seen == []  # refused before any probe
        allow = gw.gateway.allowlist
        assert await allow.permits_host("10.20.30.40")
        assert not await allow.permits_host("11.0.0.1")


async def test_allow_rules_on_names_and_addresses() -> None:
    """Patterns match names; a name outside every pattern must resolve, every address of
    it, inside the CIDR rules (a scripted resolver: no DNS traffic)."""
    answers = {"inside.example": ["10.1.1.1"], "mixed.example": ["10.1.1.1", "8.8.8.8"]}

    async def resolver(host: str) -> list[str]:
        if host not in answers:
            raise OSError("no such host")
        return answers[host]

    allow = WorkerAllowlist(["10.0.0.0/8", "*.engines.internal", "fd00::/8"], resolver=resolver)
    assert await allow.permits_host("vllm-3.engines.internal")
    assert await allow.permits_host("VLLM-3.Engines.Internal")
    assert not await allow.permits_host("engines.internal.evil.example")
    assert await allow.permits_host("inside.example")
    assert not await allow.permits_host("mixed.example")
    assert not await allow.permits_host("nowhere.example")
    assert await allow.permits_host("[fd00::5]")
    assert not await allow.permits_host("fe80::1")
    default = WorkerAllowlist(static_hosts=["vllm-a", "10.0.0.7"], resolver=resolver)
    assert await default.permits_host("vllm-a") and await default.permits_host("10.0.0.7")
    assert await default.permits_host("127.0.0.5") and await default.permits_host("::1")
    assert not await default.permits_host("vllm-b") and not await default.permits_host("10.0.0.8")
    everything = WorkerAllowlist(["*"], resolver=resolver)
    assert await everything.permits_host("169.254.169.254")


async def test_event_endpoints_added_at_run_time_are_tcp_and_allowed() -> None:
    async with fleet(FakeEngine()) as f, kvgate([]) as gw:
        for events in ("ipc:///tmp/kvgate-x.events", "inproc://x", "tcp://10.9.8.7:5557"):
            for field in ("events", "replay"):
                r = await gw.client.post("/admin/workers", json={"url": f.urls[0], field: events})
                assert r.status_code in (400, 403), (field, events)
                assert r.json()["error"]["param"] == field
        assert len(gw.gateway.registry) == 0
        spec = {"url": f.urls[0], "events": "tcp://127.0.0.1:5557"}
        assert (await gw.client.post("/admin/workers", json=spec)).status_code == 201


def test_worker_allow_is_validated_at_start_up() -> None:
    for bad in (["10.0.0.0/33"], ["http://x"], [""], ["a b"]):
        with pytest.raises(ConfigError, match="worker_allow"):
            load_settings(None, {"worker_allow": bad})
    settings = load_settings(None, {"worker_allow": ["10.0.0.0/8", "*.svc.cluster.local"]})
    assert settings.worker_allow == ["10.0.0.0/8", "*.svc.cluster.local"]


async def test_discovered_hosts_are_allowed_by_default() -> None:
    """A worker found by --discover makes its address eligible for POST /admin/workers,
    while discovery knows it; explicit --worker-allow rules are left as given."""
    async with kvgate([], discover=["dns://localhost:1?interval=3600"]) as gw:
        assert gw.gateway.discovery is not None
        assert gw.gateway.discovery.hosts() == ["127.0.0.1"]
        assert "discovered" in gw.gateway.allowlist.describe()  # wired to the fleet
    known: list[str] = []
    allow = WorkerAllowlist()
    allow.add_known_hosts(lambda: known)
    assert not await allow.permits_host("10.4.5.6")
    known.append("10.4.5.6")
    assert await allow.permits_host("10.4.5.6")
    known.clear()  # discovery forgot it
    assert not await allow.permits_host("10.4.5.6")
    explicit = WorkerAllowlist(["192.168.0.0/16"])
    explicit.add_known_hosts(lambda: ["10.4.5.6"])
    assert not await explicit.permits_host("10.4.5.6")


async def test_upstream_failures_tell_clients_no_network_detail() -> None:
    """A refused connection and a connect timeout read the same to a client: no errno, no
    address, no timing; the detail stays in the admin view."""
    dead = f"http://127.0.0.1:{free_port()}"
    with unresponsive_port() as port:
        slow = f"http://127.0.0.1:{port}"
        workers = [{"url": u, "models": [m]} for u, m in ((dead, "m-dead"), (slow, "m-slow"))]
        async with kvgate(workers, upstream={"connect_timeout_s": 0.2}) as gw:
            errors = {}
            for url, model in ((dead, "m-dead"), (slow, "m-slow")):
                gw.gateway.registry.get(url).healthy = True
                r = await gw.client.post("/v1/chat/completions", json={**CHAT, "model": model})
                assert r.status_code == 502
                error = r.json()["error"]
                errors[url] = error["message"].replace(url, "<worker>")
                assert error["code"] == "upstream_connect_error"
                for leak in ("refused", "timed out", "Errno", str(port), "connect call"):
                    assert leak.lower() not in error["message"].replace(url, "").lower()
            assert errors[dead] == errors[slow]
            listed = (await gw.client.get("/admin/workers")).json()["workers"]
            assert all(w["last_error"] for w in listed)  # the admin still sees why


# --- the loopback-open admin API and browsers (issue 44, finding 11) ---------------------


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_a_cross_origin_browser_post_adds_no_worker() -> None:
    """What a web page can make a browser send to http://127.0.0.1:8000 without a CORS
    preflight: a ``text/plain`` (or form) POST carrying ``Origin``. Refused, nothing added."""
    async with fleet(FakeEngine(), FakeEngine("b")) as f, kvgate(f.urls[:1]) as gw:
        spec = f"{f.urls[1]},models=fake-model".encode()
        for headers, status, code in (
            (
                {"origin": "http://evil.example", "content-type": "text/plain"},
                403,
                "origin_refused",
            ),
            ({"origin": "null", "content-type": "application/json"}, 403, "origin_refused"),
            ({"content-type": "text/plain"}, 415, "unsupported_media_type"),
            ({"content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
            ({}, 415, "unsupported_media_type"),
        ):
            r = await gw.client.post("/admin/workers", content=spec, headers=headers)
            assert r.status_code == status, (headers, r.text)
            assert r.json()["error"]["code"] == code
        r = await gw.client.post(
            "/debug/route", content=json.dumps(CHAT), headers={"content-type": "text/plain"}
        )
        assert r.status_code == 415
        assert [w.url for w in gw.gateway.registry] == f.urls[:1]
        assert f.engines[1].seen == []  # never probed
        # the CLI / SDK path: JSON, no Origin
        r = await gw.client.post("/admin/workers", json=f"{f.urls[1]},models=fake-model")
        assert r.status_code == 201


async def test_dns_rebinding_hosts_are_refused_on_the_open_admin_api() -> None:
    """A name the attacker's DNS points at 127.0.0.1 reaches the loopback listener with the
    attacker's ``Host``: refused, as is another port's; loopback names with kvgate's port
    are served."""
    async with fleet(FakeEngine()) as f, kvgate(f.urls) as gw:
        port = _port(gw.url)
        for host in (f"rebind.evil.example:{port}", "127.0.0.1:1", f"127.0.0.2:{port}", ""):
            for method, path, body in ADMIN_CALLS:
                r = await gw.client.request(method, path, json=body, headers={"host": host})
                assert r.status_code == 403, (host, path)
                assert r.json()["error"]["code"] == "host_refused"
        for host in (
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            f"LOCALHOST:{port}",
            f"[::1]:{port}",
        ):
            r = await gw.client.get("/admin/workers", headers={"host": host})
            assert r.status_code == 200, host
        assert [w.url for w in gw.gateway.registry] == f.urls
        assert (
            await gw.client.get("/v1/models", headers={"host": "any.example"})
        ).status_code == 200


async def test_with_an_admin_token_any_host_but_still_no_browser() -> None:
    """With a token (kvgate behind a name, a proxy, a Service) Host is not checked; Origin
    and non-JSON bodies are still refused."""
    async with fleet(FakeEngine()) as f, kvgate(f.urls, admin_token="t0k") as gw:
        good = {"authorization": "Bearer t0k"}
        r = await gw.client.get("/admin/workers", headers={**good, "host": "kvgate.internal:8000"})
        assert r.status_code == 200
        r = await gw.client.get("/admin/workers", headers={**good, "origin": "http://x.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_refused"
        r = await gw.client.post("/debug/route", content=json.dumps(CHAT), headers=good)
        assert r.status_code == 415


class PagedEngine(FakeEngine):
    """A fake SGLang server declaring a page (block) size of 32."""

    async def _route(self, method: str, path: str, body: Any, receive: Any, send: Any) -> None:
        if (method, path) == ("GET", "/get_server_info"):
            await send_json(send, {"model_path": "/models/m", "page_size": 32, "tp_size": 1})
            return
        await super()._route(method, path, body, receive, send)


async def test_ready_lists_no_worker_urls() -> None:
    """The open ``/ready`` says how many workers are kept out and why (the fact), never
    which: URLs stay behind the admin rules (``/admin/workers``, ``/debug/index``)."""
    async with fleet(PagedEngine(), FakeEngine()) as f:
        specs = [f"{f.urls[0]},engine=sglang", f.urls[1]]
        async with kvgate(specs, index={"block_size": 16}) as gw:
            ready = await gw.client.get("/ready")
            assert ready.status_code == 200
            assert ready.json()["not_ready"] == {"block_size": 1}
            assert "127.0.0.1" not in ready.text
            stats = (await gw.client.get("/debug/index")).json()  # the admin's view: which
            assert "block size is 32" in stats["config_mismatch"][f.urls[0]]["block_size"]
