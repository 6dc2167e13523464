"""``kvgate serve --sim``: the simulated fleet subprocess, wired with events and tokenizer."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from fakes.gateway import kvgate

from router.config import load_settings
from router.simfleet import SIM_MODEL, SimFleet

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def free_run(count: int, start: int) -> int:
    """First port p >= start with p .. p+count-1 free on 127.0.0.1."""
    port = start
    while port < 60000:
        try:
            for p in range(port, port + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            port += count
            continue
        return port
    raise RuntimeError("no free ports")


async def test_sim_fleet_is_routed_cache_aware_and_stopped() -> None:
    base = free_run(2, 31500)
    events = free_run(4, 32500)
    fleet = SimFleet(2, base_port=base, events_port=events)
    with fleet:
        overrides = fleet.settings_overrides({})
        settings = load_settings(None, overrides)
        assert [w.events for w in settings.workers] == [
            f"tcp://127.0.0.1:{events}",
            f"tcp://127.0.0.1:{events + 2}",
        ]
        assert settings.index.tokenizers[SIM_MODEL].is_dir()
        async with kvgate(
            overrides["workers"], policy="kv", tokenizers=overrides["tokenizers"]
        ) as gw:
            words = " ".join(["alpha beta gamma delta"] * 20)
            body = {
                "model": SIM_MODEL,
                "messages": [{"role": "user", "content": words}],
                "max_tokens": 2,
            }
            first = await gw.client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200
            worker = first.headers["x-kvgate-worker"]

            async def predicted() -> int:
                explained = (await gw.client.post("/debug/route", json=body)).json()
                assert explained["tokenize_mode"] == "tokenizer"
                entry = next(w for w in explained["workers"] if w["worker"] == worker)
                return int(entry["overlap_tokens"])

            deadline = time.monotonic() + 10  # the engine's BlockStored events reach the index
            while (overlap := await predicted()) == 0:
                assert time.monotonic() < deadline, "no KV events indexed"
                await asyncio.sleep(0.02)
            assert overlap > 0
            again = await gw.client.post("/v1/chat/completions", json=body)
            assert again.headers["x-kvgate-worker"] == worker
            assert int(again.headers["x-kvgate-predicted-cached-tokens"]) == overlap
        process = fleet._process
        assert process is not None and process.poll() is None
    assert process.poll() is not None  # the fleet stopped with the block
