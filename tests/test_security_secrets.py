"""Secrets: empty ones refused at start-up, none printed anywhere (config errors, admin API
errors, logs, /admin, /debug, /metrics, response headers); URL userinfo never shown; a
removed worker's metric series leave /metrics."""

from __future__ import annotations

import base64
import logging
from typing import Any
from urllib.parse import quote

import pytest
from fakes.engine import FakeEngine
from fakes.gateway import fleet, kvgate

from kvgate.router import serve
from kvgate.router.config import ConfigError, load_settings

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
SECRET = "sekrit-7f3a"


@pytest.mark.parametrize(
    ("source", "field"),
    [
        ({"admin_token": ""}, "admin_token"),
        ({"admin_token": "   "}, "admin_token"),
        ({"api_keys": [""]}, "api_keys"),
        ({"api_keys": ["ok-key", " "]}, "api_keys"),
        ({"workers": ["http://a:1,api_key="]}, "workers"),
        ({"workers": [{"url": "http://a:1", "api_key": ""}]}, "workers"),
    ],
)
def test_empty_secrets_are_refused_at_start_up(source: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as caught:
        load_settings(None, source)
    assert "empty" in str(caught.value)


def test_empty_admin_token_from_the_environment_stops_serve(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "")
    assert serve.main(["--port", "0"]) == 2
    assert "admin_token" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec",
    [
        f"http://a:1,api_key={SECRET},colour=red",
        f"ftp://a:1,api_key={SECRET}",
        f"http://a:1,apikey={SECRET}",
        f"http://a:1,{SECRET}",
        f"http://a:1,api_key={SECRET},engine=tgi",
        f"http://user:{SECRET}@a:1,colour=red",
        f"http://user:{SECRET}@a:99999",
        f"http://a:1,api_key={SECRET},events=udp://x",
    ],
)
def test_malformed_worker_specs_never_print_secrets(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, {"workers": [spec]})
    assert SECRET not in str(caught.value)
    assert "workers.0" in str(caught.value)
    assert serve.main(["--worker", spec]) == 2
    assert SECRET not in capsys.readouterr().err


BAD_ADMIN_SPECS: list[Any] = [
    f"http://127.0.0.1:1,api_key={SECRET},colour=red",
    {"url": "http://127.0.0.1:1", "api_key": SECRET, "engine": "tgi"},
    {"url": f"ftp://u:{SECRET}@127.0.0.1:1"},
    {"url": "http://127.0.0.1:1", "api_key": [SECRET]},
]


async def test_admin_errors_never_echo_secrets() -> None:
    async with kvgate([]) as gw:
        for spec in BAD_ADMIN_SPECS:  # the CLI form as a JSON string, or an object
            r = await gw.client.post("/admin/workers", json=spec)
            assert r.status_code == 400, spec
            assert SECRET not in r.text


async def test_url_userinfo_is_never_shown_and_becomes_basic_auth(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    engine = FakeEngine()
    async with fleet(engine) as f:
        host = f.urls[0].removeprefix("http://")
        with_userinfo = f"http://svc:{SECRET}@{host}"
        async with kvgate([with_userinfo]) as gw:
            worker = gw.gateway.registry.get(f.urls[0])
            assert worker.url == f.urls[0]
            r = await gw.client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200
            assert r.headers["x-kvgate-worker"] == f.urls[0]
            expected = "Basic " + base64.b64encode(f"svc:{SECRET}".encode()).decode()
            assert engine.seen[-1].headers["authorization"] == expected
            assert engine.seen[0].headers["authorization"] == expected  # health probes too
            shown = [
                (await gw.client.get("/admin/workers")).text,
                (await gw.client.get("/metrics")).text,
                (await gw.client.post("/debug/route", json=CHAT)).text,
                (await gw.client.get("/debug/index")).text,
                str(r.headers),
            ]
            second = f"http://svc:{SECRET}@127.0.0.1:1"
            added = await gw.client.post("/admin/workers", json={"url": second})
            shown += [added.text, (await gw.client.get("/admin/workers")).text]
            removed = await gw.client.delete(
                "/admin/workers/" + quote("http://127.0.0.1:1", safe="")
            )
            assert removed.status_code == 200
            for text in shown:
                assert SECRET not in text and "svc:" not in text
    assert SECRET not in caplog.text


def test_userinfo_and_api_key_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="api_key") as caught:
        load_settings(None, {"workers": [f"http://u:{SECRET}@a:1,api_key=k"]})
    assert SECRET not in str(caught.value)


async def test_removed_workers_leave_metrics() -> None:
    """Adding and removing workers does not grow /metrics: a removed worker's series go."""
    a, b = FakeEngine("a"), FakeEngine("b", models=["other-model"])
    async with fleet(a, b) as f, kvgate(f.urls[:1]) as gw:
        other = {"model": "other-model", "messages": CHAT["messages"]}

        async def churn() -> str:
            assert (
                await gw.client.post("/admin/workers", json={"url": f.urls[1]})
            ).status_code == 201
            for body in (other, {**other, "stream": True}, {**other, "fake": {"status": 500}}):
                await gw.client.post("/v1/chat/completions", json=body)
            await gw.gateway.health.probe_all()
            await gw.gateway.health.scrape_all()
            assert f.urls[1] in (await gw.client.get("/metrics")).text
            r = await gw.client.delete("/admin/workers/" + quote(f.urls[1], safe=""))
            assert r.status_code == 200
            return (await gw.client.get("/metrics")).text

        first = await churn()
        assert f.urls[1] not in first
        sizes = {len([line for line in (await churn()).splitlines() if line[:1] != "#"])}
        sizes.add(len([line for line in (await churn()).splitlines() if line[:1] != "#"]))
        assert len(sizes) == 1, sizes  # steady: nothing left behind per round
        assert f.urls[0] in first  # the remaining worker's series are untouched
